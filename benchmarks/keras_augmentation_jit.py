"""Upstream-ready reproduction (plain Keras on JAX, no meshfit) for
docs/reference/keras-augmentation-jit.md: (1) one augmentation layer (RandomRotation) makes Keras
train the whole model op by op, though it traces; (2) RandomCrop of a larger image does not trace.

    python benchmarks/keras_augmentation_jit.py
"""
import os
os.environ["KERAS_BACKEND"] = "jax"
import time
import numpy as np
import keras
from keras import layers

x = np.random.rand(512, 32, 32, 3).astype("float32")
y = np.random.randint(0, 10, 512)


def model(*augmentation):
    m = keras.Sequential([keras.Input((32, 32, 3)), *augmentation, layers.Conv2D(16, 3),
                          layers.GlobalAveragePooling2D(), layers.Dense(10)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


# 1. One augmentation layer makes Keras train the whole model op by op on JAX.
m = model(layers.RandomRotation(0.1))
print("jit_compile:", m.jit_compile)  # False: RandomRotation sets supports_jit = False
m.fit(x, y, batch_size=32, verbose=0)
start = time.perf_counter(); m.fit(x, y, batch_size=32, verbose=0)
print(f"op by op: {time.perf_counter() - start:.2f} s an epoch")
m._jit_compile = True  # the public setter refuses True here (a warning, then False)
m.train_function = None
m.fit(x, y, batch_size=32, verbose=0)
start = time.perf_counter(); m.fit(x, y, batch_size=32, verbose=0)
print(f"compiled: {time.perf_counter() - start:.2f} s an epoch")

# 2. RandomCrop of a larger image does not trace: it slices with traced offsets.
m = model(layers.RandomCrop(28, 28))
m._jit_compile = True
try:
    m.fit(x, y, batch_size=32, verbose=0)
except IndexError as error:
    print("RandomCrop under jit:", str(error).splitlines()[2][:120])
