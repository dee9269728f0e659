"""Per-device bytes and step time of keras-hub causal LMs under data, fsdp and 2-D layouts.

Builds a small Gemma-shaped and a Llama-shaped causal LM (random weights, token ids in) on
8 simulated CPU devices under each layout (sharding data or fsdp, model_parallel 1 or 2 or 4),
prints XLA's per-device bytes of its train step (meshfit's memory plan: weights, optimizer state,
the step's temporary memory) and the median step time of `--rounds` timed plain `fit`s of
`--steps` steps each, the layouts interleaved round by round, with each layout's ratio to
data-parallel (8 x 1). One JSON line per model and layout, then a table.

    python benchmarks/hub_layouts.py --rounds 5 --steps 4
"""

import argparse
import json
import statistics
import time

import meshfit

LAYOUTS = [("data", 1), ("fsdp", 1), ("data", 2), ("fsdp", 2), ("fsdp", 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    meshfit.connect(simulate_devices=8, verbose=False)
    import keras
    import keras_hub
    import numpy as np

    from meshfit.fit import memory_plan

    configs = {
        "gemma": lambda: keras_hub.models.GemmaCausalLM(backbone=keras_hub.models.GemmaBackbone(
            vocabulary_size=1024, num_layers=4, num_query_heads=8, num_key_value_heads=1,
            hidden_dim=256, intermediate_dim=2048, head_dim=32), preprocessor=None),
        "llama": lambda: keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(
            vocabulary_size=1024, num_layers=4, num_query_heads=8, num_key_value_heads=4,
            hidden_dim=256, intermediate_dim=1024), preprocessor=None),
    }
    tokens = np.random.default_rng(0).integers(1, 1024, (args.batch * args.steps, args.length + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((len(tokens), args.length), "int32")}
    y = tokens[:, 1:]
    runs = {}
    for name, make in configs.items():
        for sharding, k in LAYOUTS:
            strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding=sharding,
                                       model_parallel=k, fsdp_min_bytes="64KB")
            keras.utils.set_random_seed(0)
            model = make()
            model.compile(optimizer=keras.optimizers.Adam(1e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            plan = memory_plan.plan_mode(model, strategy, sharding, args.batch, None,
                                         data=(x, y))
            model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # compiles
            runs[name, sharding, k] = {"strategy": strategy, "model": model, "plan": plan, "times": []}
    for _ in range(args.rounds):
        for run in runs.values():
            run["strategy"].activate()
            start = time.perf_counter()
            run["model"].fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
            run["times"].append((time.perf_counter() - start) / args.steps)
    rows = []
    for (name, sharding, k), run in runs.items():
        step = statistics.median(run["times"])
        base = statistics.median(runs[name, "data", 1]["times"])
        p = run["plan"]
        row = {"model": name, "layout": f"{sharding} {8 // k}x{k}", "weights": p.weights,
               "optimizer": p.optimizer, "step_temp": p.step_temp, "total": p.total,
               "step_s": round(step, 4), "ratio_to_data": round(step / base, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| model | layout (batch x model) | weights | optimizer | step temp | total | step time vs data 8x1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mb = lambda b: f"{b / 1e6:.2f} MB"
        print(f"| {r['model']} | {r['layout']} | {mb(r['weights'])} | {mb(r['optimizer'])} | "
              f"{mb(r['step_temp'])} | {mb(r['total'])} | {r['ratio_to_data']:.2f}x |")


if __name__ == "__main__":
    main()
