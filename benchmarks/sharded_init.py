"""What creating every sharded variable in its shards costs: model build time on 8 simulated CPU
devices under fsdp, three ways alternating in one process.

- keras: Keras' own rule (keras.src.backend.jax.core.should_shard_at_init): one jitted program
  straight into the shards only when bytes x devices reach 256 MiB; a smaller variable is made
  whole on one device, then distributed.
- per-variable: a program compiled for every sharded variable (Keras' seed is baked into each).
- meshfit: meshfit.fit.sharded_init, the seed an argument, one compile per initializer, shape
  and layout (what meshfit does).

Prints each build time and the ratios of the medians to keras. --model llama builds a keras-hub
Llama-shaped causal LM instead (vocabulary 32,000, hidden 512, 8 layers; --layers sets them),
fsdp over 'batch' with --fsdp-min-bytes 64KB.

    python benchmarks/sharded_init.py [--model dense|llama] [--layers 24] [--rounds 3]
"""

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "llama"), default="dense")
    parser.add_argument("--layers", type=int, default=None,
                        help="Dense(1024) layers: 4 MiB kernels (default 24), or Llama blocks (8)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import meshfit

    meshfit.connect(simulate_devices=8, engine="jax", verbose=False, sharding="fsdp",
                    fsdp_min_bytes="64KB")
    import jax
    import keras
    from keras.src.backend.jax import core

    meshfit_init = core.JaxVariable._initialize_with_initializer  # installed by connect()
    keras_init = meshfit_init.__wrapped__
    keras_rule = core.should_shard_at_init

    def every_sharded_variable(layout, shape):
        split = isinstance(layout, jax.sharding.NamedSharding) and not layout.is_fully_replicated
        return split or keras_rule(layout, shape)

    ways = {"keras": (keras_init, keras_rule), "per-variable": (keras_init, every_sharded_variable),
            "meshfit": (meshfit_init, keras_rule)}

    def make():
        if args.model == "dense":
            return keras.Sequential([keras.Input((1024,))]
                                    + [keras.layers.Dense(1024) for _ in range(args.layers or 24)])
        import keras_hub

        return keras_hub.models.LlamaBackbone(
            vocabulary_size=32000, num_layers=args.layers or 8, num_query_heads=8,
            num_key_value_heads=4, hidden_dim=512, intermediate_dim=1376)

    def build() -> float:
        start = time.perf_counter()
        model = make()
        jax.block_until_ready([v.value for v in model.weights])
        return time.perf_counter() - start

    seconds = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, (initialize, rule) in ways.items():
            core.JaxVariable._initialize_with_initializer, core.should_shard_at_init = initialize, rule
            seconds[name].append(build())
    keras_median = statistics.median(seconds["keras"])
    for name, times in seconds.items():
        print(f"{name:>12}: " + " ".join(f"{t:.2f}" for t in times)
              + f" s, median / keras {statistics.median(times) / keras_median:.2f}x")


if __name__ == "__main__":
    main()
