"""The cost of goodput's accounting of the training loop, as a same-process A/B.

One model (mnist-mlp-bf16's MLP in float32 on one JAX CPU device: the shortest steps, so the
largest share for a per-dispatch cost), one process; epochs alternate between the train function
with goodput's timing (meshfit.fit.hooks) and the same function without it ($MESHFIT_GOODPUT=0
while it runs, so the hook does not wrap it again). Each epoch is timed between device syncs;
prints each arm's median ms/step over the rounds and their ratio.

    python tools/goodput_overhead.py [ROUNDS] [STEPS]
"""

import os
import statistics
import sys
import time

import meshfit

strategy = meshfit.connect(simulate_devices=1, engine="jax", precision="float32", verbose=False)
import jax  # noqa: E402  (after connect: the engine is chosen)
import numpy as np  # noqa: E402

from meshfit import recipes  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
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


def epoch(function, accounting: str) -> float:
    os.environ["MESHFIT_GOODPUT"] = accounting
    model.train_function = function
    jax.block_until_ready([v.value for v in model.variables])
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return 1000 * (time.perf_counter() - start) / STEPS


off, on = [], []
for _ in range(ROUNDS):
    off.append(epoch(plain, "0"))
    on.append(epoch(timed, "1"))
print(f"ms/step without accounting {statistics.median(off):.3f}, with {statistics.median(on):.3f}; "
      f"ratio {statistics.median(on) / statistics.median(off):.4f} (medians of {ROUNDS} rounds "
      f"of {STEPS} steps); per round: "
      + ", ".join(f"{b / a:.3f}" for a, b in zip(off, on)))
