"""Why fsdp's step "differed" from data parallelism's on JAX 0.12 (issue 48): a ReLU on a kink.

Plain JAX and NumPy, no Keras, no meshfit. One SGD step of a 784-1024-1024-10 MLP (batch 64,
lr 0.1) on 8 CPU devices, under a data-parallel layout and an fsdp layout (both large kernels
split by column). The second layer's bias is shifted so that one pre-activation lies `offset` from
zero in float64. Where |offset| is below float32's rounding of that 1024-term sum (about 1e-7), a
layout's own summation order decides the ReLU's side; taking the other side moves the step by
about 1e-4. Each layout's weights are compared with the float64 step on both sides of that ReLU:
one of the two always matches to about 1e-8, so each layout computed a correct step, and their
difference is the flipped ReLU alone. Run:

    python benchmarks/relu_kink.py                       # XLA's default (YNNPACK dot fusions on)
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/relu_kink.py   # off

docs/reference/relu-kink.md has the result and what it means for tests that compare layouts.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402 (the flags above must come first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

ROW, UNIT = 46, 462  # the pre-activation put near zero (any other would do)
OFFSETS = (-3e-7, -1e-7, -3e-8, 0.0, 3e-8, 1e-7, 3e-7, 1e-5)


def model(seed=0):
    """Glorot-uniform kernels, zero biases (Keras' Dense defaults), and a batch of 64."""
    rng = np.random.default_rng(seed)
    kernel = lambda n, m: rng.uniform(-1, 1, (n, m)).astype("float32") * np.float32(np.sqrt(6 / (n + m)))
    weights = [kernel(784, 1024), np.zeros(1024, "float32"), kernel(1024, 1024), np.zeros(1024, "float32"),
               kernel(1024, 10), np.zeros(10, "float32")]
    return weights, rng.random((64, 784)).astype("float32"), rng.integers(0, 10, 64).astype("int32")


def loss(w, x, y):
    h = jax.nn.relu(x @ w[0] + w[1])
    h = jax.nn.relu(h @ w[2] + w[3])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ w[4] + w[5]), y[:, None], 1))


def sgd_step(w, x, y):
    return [a - 0.1 * g for a, g in zip(w, jax.grad(loss)(w, x, y))]


def float64_step(w, x, y, flip=False):
    """The step in float64; `flip`: the ReLU at (ROW, UNIT) taken on its other side."""
    w = [a.astype(np.float64) for a in w]
    x = x.astype(np.float64)
    a1 = x @ w[0] + w[1]
    m1 = a1 > 0
    a2 = (a1 * m1) @ w[2] + w[3]
    m2 = a2 > 0
    if flip:
        m2[ROW, UNIT] = ~m2[ROW, UNIT]
    logits = a2 * m2 @ w[4] + w[5]
    dz = np.exp(logits - logits.max(1, keepdims=True))
    dz /= dz.sum(1, keepdims=True)
    dz[np.arange(len(y)), y] -= 1
    dz /= len(y)
    da2 = dz @ w[4].T * m2
    da1 = da2 @ w[2].T * m1
    grads = [x.T @ da1, da1.sum(0), (a1 * m1).T @ da2, da2.sum(0), (a2 * m2).T @ dz, dz.sum(0)]
    return [a - 0.1 * g for a, g in zip(w, grads)], a2[ROW, UNIT]


def stepped(w, x, y, specs):
    """One step with the weights laid out by `specs` and the batch split over the 8 devices."""
    weights_mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("batch", "model"))
    data_mesh = Mesh(np.array(jax.devices()), ("axis_0",))
    shardings = [NamedSharding(weights_mesh, s) for s in specs]
    placed = [jax.device_put(a, s) for a, s in zip(w, shardings)]
    batch = [jax.device_put(a, NamedSharding(data_mesh, P("axis_0"))) for a in (x, y)]
    return [np.asarray(a) for a in jax.jit(sgd_step, out_shardings=shardings)(placed, *batch)]


LAYOUTS = {"data": [P()] * 6, "fsdp": [P(None, "batch"), P(), P(None, "batch"), P(), P(), P()]}


def main():
    distance = lambda a, b: max(float(np.abs(p - q).max()) for p, q in zip(a, b))
    w, x, y = model()
    _, near = float64_step(w, x, y)
    print(f"JAX {jax.__version__}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    print("offset    float64 side | per layout: side taken, distance to that side's float64 step | fsdp-data")
    for offset in OFFSETS:
        shifted = [a.copy() for a in w]
        shifted[3][UNIT] += np.float32(offset - near)  # the pre-activation now `offset` from zero
        on, value = float64_step(shifted, x, y)
        off, _ = float64_step(shifted, x, y, flip=True)
        cells, results = [], {}
        for name, specs in LAYOUTS.items():
            results[name] = stepped(shifted, x, y, specs)
            d_on, d_off = distance(results[name], on), distance(results[name], off)
            side = "float64's" if d_on <= d_off else "other"
            cells.append(f"{name}: {side:9s} {min(d_on, d_off):.0e}")
        print(f"{value:+.1e}  {'on ' if value > 0 else 'off'}         | {' | '.join(cells)} | "
              f"{distance(results['fsdp'], results['data']):.1e}")


if __name__ == "__main__":
    main()
