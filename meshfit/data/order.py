"""Batch order and augmentation parameters: pure functions of (seed, epoch, step), used by every
input path (arrays on the devices or the host, image folders).

Epoch e visits the samples in the order of a random permutation drawn from (seed, e) with
`jax.random` (threefry, so the order is the same on every platform, engine and replica count).
`flip-crop` augmentation crops each reflect-padded image at a random offset drawn from (seed,
epoch, step) and mirrors it left-right: at random (flips="random", also from (seed, epoch, step)),
or every other epoch (flips="alternate": each sample has a fixed random bit drawn from (seed,
sample index) and is mirrored in the epochs where that bit differs from the epoch's parity, so over
any two epochs it is seen both ways). Batch (e, s) is therefore a pure function of (seed, e, s): an
iterator can start at any step of any epoch, which is what exact resume needs.
"""

from __future__ import annotations

DEFAULT_SEED = 0  # a run's seed when none is given (weights, order, augmentation, dropout)
ORDER_STREAM, AUGMENT_STREAM, FLIP_STREAM = 0, 1, 2  # independent random streams from the seed


def random_key(seed: int, *path):
    """The jax.random key for `seed` folded with `path` (ints, possibly traced)."""
    import jax

    key = jax.random.key(seed)
    for value in path:
        key = jax.random.fold_in(key, value)
    return key


def permutation(seed: int, epoch, n: int):
    """Epoch `epoch`'s order of `n` samples: a permutation drawn from (seed, epoch), int32."""
    import jax

    return jax.random.permutation(random_key(seed, ORDER_STREAM, epoch), n).astype("int32")


def flip_crop_parameters(seed: int, epoch, step, indices, padding: int, flips: str):
    """Per-image crop offsets (0..2*padding pixels, rows and columns) and flips for batch
    (epoch, step). indices: the batch's sample indices (used by flips="alternate")."""
    import jax

    batch = indices.shape[0]
    offsets_key, flip_key = jax.random.split(random_key(seed, AUGMENT_STREAM, epoch, step))
    offsets = jax.random.randint(offsets_key, (2, batch), 0, 2 * padding + 1, dtype="int32")
    if flips == "alternate":
        bits = jax.vmap(lambda i: jax.random.bernoulli(random_key(seed, FLIP_STREAM, i)))(indices)
        mirrored = bits != (epoch % 2 == 1)
    else:
        mirrored = jax.random.bernoulli(flip_key, 0.5, (batch,))
    return offsets[0], offsets[1], mirrored
