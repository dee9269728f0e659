"""XLA's SPMD partitioner doubles a convolution kernel's gradient when the kernel's window is
split: a reproduction with plain JAX.

One SGD step of a strided convolution (a ViT's patch embedding: kernel 4 x 4 x 3 x 32, stride 4)
and its bias, on 8 simulated CPU devices as a mesh 4 x 2 ('batch', 'model'): the images split
over 'batch', the kernel's second window axis split over 'batch' and the bias over 'batch'. The
kernel's gradient comes out exactly twice the one of the same step on one device; split over the
channels instead, or with the bias replicated or over 'model', it is right. Seen with jaxlib 0.10.2,
under Shardy and GSPMD alike. meshfit's layout rule never splits a convolution's window
(meshfit.parallel.sharding.splittable_axes). See docs/reference/xla-conv-window-gradient.md.

    python benchmarks/xla_conv_window_gradient.py [--gspmd]

Prints the ratio of the sharded step's kernel gradient to one device's, per kernel layout.
"""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gspmd", action="store_true", help="GSPMD's propagation instead of Shardy")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if args.gspmd:
        jax.config.update("jax_use_shardy_partitioner", False)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("batch", "model"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16, 16, 3)).astype("float32")
    k = rng.normal(size=(4, 4, 3, 32)).astype("float32")
    b = rng.normal(size=(32,)).astype("float32")

    def loss(k, b, x):
        y = jax.lax.conv_general_dilated(x, k, (4, 4), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + b
        return jnp.sum(jnp.mean(y, axis=(1, 2)) ** 2)

    def sgd(k, b, x):  # the new kernel and bias, as a train step returns them
        gk, gb = jax.grad(loss, argnums=(0, 1))(k, b, x)
        return k - gk, b - gb

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    true = k - np.asarray(jax.jit(sgd)(k, b, x)[0])
    for name, kspec, bspec in [("window over batch", P(None, "batch"), P("batch")),
                               ("window over batch, bias over model", P(None, "batch"), P("model")),
                               ("window over model, bias over batch", P(None, "model"), P("batch")),
                               ("channels over batch", P(None, None, None, "batch"), P("batch"))]:
        new_k, _ = jax.jit(sgd)(put(k, kspec), put(b, bspec), put(x, P("batch")))
        ratio = np.median((k - np.asarray(new_k)) / true)
        print(f"kernel {name:38s} gradient / one device's: {ratio:.4f}")


if __name__ == "__main__":
    main()
