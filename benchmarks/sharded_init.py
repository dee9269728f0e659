"""What creating every sharded variable in its shards would cost: model build time, Keras' rule
against one compiled initializer per sharded variable, on 8 simulated CPU devices under fsdp.

Keras (3.13 and later, keras.src.backend.jax.core.should_shard_at_init) initializes a variable by
one jitted program straight into its shards only when its bytes x devices reach 256 MiB (32 MiB a
variable on 8 devices); a smaller one is made whole on one device, then distributed. The other
rule jits every variable whose layout splits it. Both builds alternate, ROUNDS times each, in one
process; prints each time and the ratio of the medians.

    python benchmarks/sharded_init.py [--layers 24] [--rounds 3]
"""

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="Dense(1024) layers: 4 MiB kernels")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import meshfit

    meshfit.connect(simulate_devices=8, engine="jax", verbose=False, sharding="fsdp")
    import jax
    import keras
    from keras.src.backend.jax import core

    keras_rule = core.should_shard_at_init

    def every_sharded_variable(layout, shape):
        split = isinstance(layout, jax.sharding.NamedSharding) and any(a is not None for a in layout.spec)
        return split or keras_rule(layout, shape)

    def build() -> float:
        start = time.perf_counter()
        model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024) for _ in range(args.layers)])
        jax.block_until_ready([v.value for v in model.weights])
        return time.perf_counter() - start

    seconds = {"keras": [], "every": []}
    for _ in range(args.rounds):
        for name, rule in (("keras", keras_rule), ("every", every_sharded_variable)):
            core.should_shard_at_init = rule
            seconds[name].append(build())
    for name, times in seconds.items():
        print(f"{name:>5}: " + " ".join(f"{t:.2f}" for t in times) + " s")
    print(f"every / keras (medians): {statistics.median(seconds['every']) / statistics.median(seconds['keras']):.1f}x")


if __name__ == "__main__":
    main()
