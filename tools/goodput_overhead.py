"""The cost of goodput's accounting of the training loop, as a same-process A/B.

One model (mnist-mlp-bf16's MLP in float32 on one JAX CPU device: the shortest steps, so the
largest share for a per-dispatch cost), one process; epochs alternate between the train function
with goodput's timing (meshfit.fit.hooks) and the same function without it ($MESHFIT_GOODPUT=0
while it runs, so the hook does not wrap it again). Each epoch is timed between device syncs, in
wall time and in this process's CPU time (which other work on a shared machine disturbs less);
prints each arm's median ms/step and the median of the rounds' ratios (with / without). Then the wrapper alone: a train
function that does nothing, called 20,000 times bare and wrapped, 7 alternating blocks.

    python tools/goodput_overhead.py [ROUNDS] [STEPS] [ENGINE]

ENGINE: jax (default) or tensorflow, whose timing reads each batch in Python before the compiled
step (meshfit.fit.hooks._tensorflow_timed); the wrapper-alone line is JAX's only.
"""

import os
import statistics
import sys
import time

import meshfit

ENGINE = sys.argv[3] if len(sys.argv) > 3 else "jax"
strategy = meshfit.connect(simulate_devices=1 if ENGINE == "jax" else None, engine=ENGINE,
                           precision="float32", verbose=False)
import keras  # noqa: E402  (after connect: the engine is chosen)
import numpy as np  # noqa: E402

from meshfit import recipes  # noqa: E402
from meshfit.fit import hooks  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
BATCH = 128

recipe = recipes.get("mnist-mlp-bf16")
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (STEPS * BATCH, 28, 28, 1), dtype=np.uint8)
y = rng.integers(0, 10, STEPS * BATCH).astype("int32")
with strategy.scope():
    model = recipe.build_model((28, 28, 1), 10)
    model.compile(optimizer=recipe.optimizer(STEPS, 100), loss=recipe.make_loss(), metrics=["accuracy"])
model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # compiled, warm
timed = model.train_function
plain = timed.__wrapped__


def epoch(function, accounting: str) -> tuple[float, float]:
    """(wall ms/step, CPU ms/step) of one epoch."""
    os.environ["MESHFIT_GOODPUT"] = accounting
    model.train_function = function
    keras.ops.convert_to_numpy(model.trainable_variables[-1])  # the device has finished
    start, cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return (1000 * (time.perf_counter() - start) / STEPS, 1000 * (time.process_time() - cpu) / STEPS)


off, on = [], []
for _ in range(ROUNDS):
    off.append(epoch(plain, "0"))
    on.append(epoch(timed, "1"))
for i, clock in enumerate(("wall", "CPU")):
    a, b = [r[i] for r in off], [r[i] for r in on]
    ratios = [q / p for p, q in zip(a, b)]
    print(f"{clock}: ms/step without accounting {statistics.median(a):.3f}, with "
          f"{statistics.median(b):.3f}; median ratio {statistics.median(ratios):.4f} over {ROUNDS} "
          f"rounds of {STEPS} steps (rounds from {min(ratios):.3f} to {max(ratios):.3f})")

if ENGINE != "jax":
    sys.exit()


def per_call(function, calls: int = 20000) -> float:
    batches = iter(range(calls))
    start = time.perf_counter()
    for _ in range(calls):
        function(None, batches)
    return (time.perf_counter() - start) / calls


def nothing(state, iterator):
    next(iterator)
    return {"loss": keras.ops.zeros(())}, state


wrapped = hooks._timed(nothing)  # the wrapper the fit hook puts around every train function
bare, costly = [], []
for _ in range(7):
    bare.append(per_call(nothing))
    costly.append(per_call(wrapped))
print(f"the wrapper alone: {1e6 * (statistics.median(costly) - statistics.median(bare)):.1f} us "
      "per dispatch")
