"""Is meshfit's train step the same program as plain Keras'? A recipe's step lowered both ways.

Two fresh processes build the recipe's model at its precision, fit it one step on random data
(so that everything fit builds is built) and lower the model's `train_step` on the resulting
state: one as plain Keras (`keras.config.set_dtype_policy` and `model.fit`), one as meshfit runs it
(`meshfit.connect()`, `strategy.scope()`, `Strategy.fit`). Prints each program's StableHLO
operations by kind and the tensor element types it mentions, and the kinds that differ. The
lowering is the device-independent part, so a CPU answers it: where the two are the same, a gap
in speed between the paths lies outside the step (input, host, the order the rows ran in).

Usage: python benchmarks/same_step.py [RECIPE] [--batch 8]   (default: resnet50-synthetic)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from main_job import environment  # this checkout first on PYTHONPATH (benchmarks/ is sys.path[0])

PROGRAM = """
import collections, json, re, sys
import numpy as np
import meshfit
from meshfit import recipes
from meshfit.parallel import planning
path, name, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
recipe = recipes.get(name)
shape, classes = recipes.input_shape(recipe), 10
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (2 * batch, *shape), dtype=np.uint8)
if path == "meshfit":
    strategy = meshfit.connect(engine="jax", precision=recipe.precision, verbose=False)
    import jax, keras
    with strategy.scope():
        model = recipe.build_model(shape)
        model.compile(optimizer=recipe.optimizer(1, 1), loss=recipe.make_loss(), metrics=["accuracy"])
else:
    import jax, keras
    precision = planning.resolve_precision(recipe.precision, jax.devices()[0].platform)
    keras.config.set_dtype_policy(planning.keras_policy(precision))
    model = recipe.build_model(shape)
    model.compile(optimizer=recipe.optimizer(1, 1), loss=recipe.make_loss(), metrics=["accuracy"])
y = rng.integers(0, model.output_shape[-1], 2 * batch).astype(np.int32)
fit = strategy.fit if path == "meshfit" else (lambda m, *a, **k: m.fit(*a, **k))
fit(model, x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
state = tuple([v.value for v in group] for group in (model.trainable_variables,
              model.non_trainable_variables, model.optimizer.variables, model.metrics_variables))
text = jax.jit(model.train_step).lower(state, (jax.numpy.asarray(x[:batch]),
                                               jax.numpy.asarray(y[:batch]))).as_text()
print(json.dumps({"ops": collections.Counter(re.findall(r"= \\"?((?:stablehlo|mhlo|sdy)\\.[a-z_]+|call)", text)),
                  "types": collections.Counter(re.findall(r"x(bf16|f16|f32|f64|i32|i64|ui8|i1)>", text)),
                  "policy": model.dtype_policy.name}))
"""


def lowered(path: str, recipe: str, batch: int) -> dict:
    env = {**environment(), "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", PROGRAM, path, recipe, str(batch)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"the {path} path failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="resnet50-synthetic")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    results = {path: lowered(path, args.recipe, args.batch) for path in ("plain", "meshfit")}
    for path, result in results.items():
        print(f"{path}: policy {result['policy']}, {sum(result['ops'].values())} operations; "
              f"element types {result['types']}")
    plain, mine = results["plain"]["ops"], results["meshfit"]["ops"]
    differ = {k: (plain.get(k, 0), mine.get(k, 0)) for k in sorted(set(plain) | set(mine))
              if plain.get(k, 0) != mine.get(k, 0)}
    same_types = results["plain"]["types"] == results["meshfit"]["types"]
    if not differ and same_types:
        print("the same operations and element types: the paths lower the same step")
    else:
        print(f"operations that differ (plain, meshfit): {differ}; element types "
              f"{'the same' if same_types else 'differ'}")


if __name__ == "__main__":
    main()
