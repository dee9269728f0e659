"""Input pipeline: training and evaluation batches, in an order fixed by (seed, epoch).

Training: epoch e visits the samples in the order and with the augmentation that meshfit.data.order
draws from (seed, epoch, step), in `steps_per_epoch` global batches; the last partial batch is
dropped, so every step has the same shape and splits evenly across the replicas. `flip-crop`
reflect-pads each image (4 pixels by default) before its random crop.

On the JAX engine the images are put on the devices once, sharded along the batch axis with the
strategy's Keras data layout; the permutation, the gather of each batch and the augmentation run
on the devices in jitted code, and batches come out already sharded. On other engines (and for
data too large for the devices) the same permutation and augmentation parameters are applied
with numpy on the host, giving identical batches.

Evaluation covers every sample exactly once: fixed-size batches, the last one padded with zero
images whose predictions are dropped, so one compiled step serves all batches.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import numpy as np

from meshfit.data.order import DEFAULT_SEED, flip_crop_parameters, permutation
from meshfit.errors import MeshfitError

AUGMENTATIONS = ("none", "flip-crop")
FLIPS = ("random", "alternate")
CROP_PADDING = 4  # default pixels of reflect padding around each image before the random crop
DEVICE_MEMORY_FRACTION = 0.25  # at most this share of a device's memory holds its data shard


def _flip_crop_on_device(images, rows, cols, flips, padding: int):
    """Reflect-pad, crop each image at its (row, col) offset and mirror the flipped ones (jax)."""
    import jax
    import jax.numpy as jnp

    height, width, channels = images.shape[1:]
    padded = jnp.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)), mode="reflect")

    def crop(image, row, col):
        return jax.lax.dynamic_slice(image, (row, col, 0), (height, width, channels))

    cropped = jax.vmap(crop)(padded, rows, cols)
    return jnp.where(flips[:, None, None, None], cropped[:, :, ::-1, :], cropped)


def flip_crop_numpy(images: np.ndarray, rows: np.ndarray, cols: np.ndarray, flips: np.ndarray,
                    padding: int = CROP_PADDING) -> np.ndarray:
    """The same augmentation as on the devices, with numpy on the host: image by image, a gather
    of reflected row indices then of (mirrored) column indices, with no padded copy."""
    height, width = images.shape[1:3]
    row_index = _reflected(np.arange(height) + np.asarray(rows)[:, None] - padding, height)  # (B, H)
    col_index = _reflected(np.arange(width) + np.asarray(cols)[:, None] - padding, width)  # (B, W)
    col_index = np.where(np.asarray(flips)[:, None], col_index[:, ::-1], col_index)
    out = np.empty_like(images)
    for i in range(len(images)):
        out[i] = images[i].take(row_index[i], axis=0).take(col_index[i], axis=1)
    return out


def _reflected(index: np.ndarray, n: int) -> np.ndarray:
    """Indices up to n-1 outside 0..n-1 mirrored back in, as np.pad's "reflect" (edge not repeated)."""
    index = np.abs(index)
    return np.where(index >= n, 2 * (n - 1) - index, index)


def _on_jax() -> bool:
    import keras

    return keras.backend.backend() == "jax"


def _batch_placement(shape: tuple[int, ...]):
    """The JAX placement (a jax.sharding.Sharding) of an array split along its first axis with
    Keras' data layout."""
    import jax
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return distribution.get_data_layout(shape).backend_layout


def _replicated(placement):
    """A placement over the same devices that keeps a full copy on each."""
    import jax

    if isinstance(placement, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
    return placement


def _fits_on_devices(nbytes: int, placement) -> bool:
    """True when a batch-sharded array of `nbytes` takes at most a quarter of each device's memory."""
    devices = sorted(placement.addressable_devices, key=lambda d: d.id)
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return not limit or nbytes / len(devices) <= DEVICE_MEMORY_FRACTION * limit


def _put_sharded(array: np.ndarray, multiple: int):
    """`array` padded with zeros to a multiple of `multiple` rows, placed batch-sharded."""
    import jax

    extra = -len(array) % multiple  # JAX shards an array only in equal parts; no order reaches the padding
    if extra:
        array = np.concatenate([array, np.zeros((extra,) + array.shape[1:], array.dtype)])
    placement = _batch_placement(array.shape)
    return jax.make_array_from_callback(array.shape, placement, lambda index: array[index])


def check_train_batches(samples: int, image_size: tuple[int, int], global_batch: int,
                        steps_per_epoch: int | None, augment: str, crop_padding: int,
                        flips: str) -> int:
    """The steps per epoch of training batches with these settings; a MeshfitError if they do not fit.

    image_size: (height, width) of the images, in pixels.
    """
    if augment not in AUGMENTATIONS:
        raise MeshfitError(f"unknown augmentation {augment!r}; use one of: {', '.join(AUGMENTATIONS)}")
    if flips not in FLIPS:
        raise MeshfitError(f"unknown flips {flips!r}; use one of: {', '.join(FLIPS)}")
    height, width = image_size
    if augment == "flip-crop" and not 0 <= crop_padding < min(height, width):
        raise MeshfitError(f"crop padding {crop_padding} does not fit {height}x{width} images; "
                           f"use 0 to {min(height, width) - 1} pixels")
    if global_batch > samples:
        raise MeshfitError(f"global batch {global_batch} is larger than the {samples} training "
                           f"samples; use --global-batch {samples} or less")
    full_steps = samples // global_batch
    if steps_per_epoch is not None and not 1 <= steps_per_epoch <= full_steps:
        raise MeshfitError(f"steps_per_epoch {steps_per_epoch} x global batch {global_batch} "
                           f"needs more than the {samples} training samples; use at most "
                           f"{full_steps} steps or a smaller batch")
    return steps_per_epoch or full_steps


class TrainBatches:
    """Training batches of (x, y): `steps_per_epoch` global batches per epoch.

    x: uint8 images (N, H, W, C); y: labels (N,). global_batch: samples per step over all
    replicas. steps_per_epoch: defaults to N // global_batch (at most that many). augment: "none"
    or "flip-crop", with crop_padding pixels (translations up to that many) and flips "random" or
    "alternate" (see the module docstring). on_device: None picks the devices on the JAX engine
    when the data fits.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, global_batch: int, seed: int = DEFAULT_SEED,
                 steps_per_epoch: int | None = None, augment: str = "none",
                 on_device: bool | None = None, crop_padding: int = CROP_PADDING,
                 flips: str = "random"):
        if len(x) != len(y):
            raise MeshfitError(f"{len(x)} images but {len(y)} labels; give one label per image")
        steps = check_train_batches(len(x), x.shape[1:3], global_batch, steps_per_epoch, augment,
                                    crop_padding, flips)
        self.x, self.y = x, y
        self.global_batch = global_batch
        self.seed = int(seed)
        self.steps_per_epoch = steps
        self.augment, self.crop_padding, self.flips = augment, int(crop_padding), flips
        self.num_samples = len(x)
        if on_device is None:
            on_device = _on_jax() and _fits_on_devices(x.nbytes, _batch_placement(x.shape))
        self.on_device = on_device
        self._order_epoch, self._order = None, None
        if on_device:
            self._x = _put_sharded(x, len(_batch_placement(x.shape).device_set))
            self._y = _put_sharded(y, len(_batch_placement(y.shape).device_set))

    def __len__(self) -> int:
        return self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices of epoch `epoch` in training order (all N of them)."""
        return np.asarray(self._order_function(epoch))

    def batch(self, epoch: int, step: int) -> tuple[Any, Any]:
        """Global batch `step` of epoch `epoch`: (images, labels), augmented if asked."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside 0..{self.steps_per_epoch - 1}")
        if self.on_device:
            return self._device_batch(self._x, self._y, self._cached_order(epoch), epoch, step)
        return self._host_batch(epoch, step)

    def iterate(self, epoch: int = 0, step: int = 0) -> Iterator[tuple[Any, Any]]:
        """Batches from step `step` of epoch `epoch` on, running into the following epochs."""
        while True:
            for s in range(step, self.steps_per_epoch):
                yield self.batch(epoch, s)
            epoch, step = epoch + 1, 0

    # ---------------------------------------------------------------------------- internals
    def _cached_order(self, epoch: int):
        """Epoch `epoch`'s order, computed once per epoch: on the devices, or as numpy."""
        if self._order_epoch != epoch:
            order = self._order_function(epoch)
            self._order = order if self.on_device else np.asarray(order)
            self._order_epoch = epoch
        return self._order

    @functools.cached_property
    def _order_function(self):
        import jax

        # Each device gathers its batch rows from anywhere in the data: the order is whole on each.
        out = _replicated(_batch_placement(self.x.shape)) if self.on_device else None
        return jax.jit(functools.partial(permutation, self.seed, n=self.num_samples),
                       out_shardings=out)

    @functools.cached_property
    def _device_batch(self):
        import jax
        import jax.numpy as jnp

        batch, augment = self.global_batch, self.augment
        parameters = self._parameters()
        placements = (_batch_placement((batch,) + self.x.shape[1:]),
                      _batch_placement((batch,) + self.y.shape[1:]))

        def gather(x, y, order, epoch, step):
            indices = jax.lax.dynamic_slice_in_dim(order, step * batch, batch)
            images, labels = jnp.take(x, indices, axis=0), jnp.take(y, indices, axis=0)
            if augment == "flip-crop":
                rows, cols, flips = parameters(epoch, step, indices)
                images = _flip_crop_on_device(images, rows, cols, flips, self.crop_padding)
            return images, labels

        return jax.jit(gather, out_shardings=placements)

    def _parameters(self):
        """`fn(epoch, step, indices)`: the batch's crop offsets and flips (jax, traceable)."""
        return functools.partial(flip_crop_parameters, self.seed, padding=self.crop_padding,
                                 flips=self.flips)

    @functools.cached_property
    def _augment_parameters(self):
        import jax

        return jax.jit(self._parameters())

    def _host_batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        start = step * self.global_batch
        indices = self._cached_order(epoch)[start:start + self.global_batch]
        images, labels = self.x[indices], self.y[indices]
        if self.augment == "flip-crop":
            rows, cols, flips = (np.asarray(a) for a in self._augment_parameters(epoch, step, indices))
            images = flip_crop_numpy(images, rows, cols, flips, self.crop_padding)
        return images, labels


def tta_views(tta_flip: bool = False, tta_translate: int = 0) -> list[tuple[bool, int, float]]:
    """The views of each image that test-time augmentation averages: (mirrored, shift in pixels
    down and right (negative: up and left), weight). With tta_translate, airbench's multi-crop:
    half the weight on the image (and its mirror), half on its translations by that many pixels
    down-right and up-left, reflect-padded at the border (and their mirrors)."""
    flips = (False, True) if tta_flip else (False,)
    shifts = ((0, 0.5), (tta_translate, 0.25), (-tta_translate, 0.25)) if tta_translate else ((0, 1.0),)
    return [(flip, shift, weight / len(flips)) for shift, weight in shifts for flip in flips]


class EvalBatches:
    """Evaluation batches covering every one of N samples once, the last batch zero-padded.

    Iterating yields `(images,)` tuples of `global_batch` samples (as Keras' predict expects); with
    flip=True the images are mirrored left-right. `trim(outputs)` drops the padding's rows.
    """

    def __init__(self, x: np.ndarray, global_batch: int, on_device: bool | None = None):
        self.x, self.global_batch, self.num_samples = x, global_batch, len(x)
        self.num_batches = -(-len(x) // global_batch)
        padded = self.num_batches * global_batch  # one shape for every batch: predict compiles once
        if on_device is None:
            on_device = _on_jax() and _fits_on_devices(x.nbytes, _batch_placement(x.shape))
        self.on_device = on_device
        if on_device:
            # (batches, batch, ...) sharded on the batch axis: batch i is a local slice per device.
            import jax

            stacked = np.zeros((padded,) + x.shape[1:], x.dtype)
            stacked[:len(x)] = x
            stacked = stacked.reshape((self.num_batches, global_batch) + x.shape[1:])
            inner = _batch_placement((global_batch,) + x.shape[1:])
            placement = inner
            if isinstance(inner, jax.sharding.NamedSharding):
                placement = jax.sharding.NamedSharding(
                    inner.mesh, jax.sharding.PartitionSpec(None, *inner.spec))
            self._x = jax.make_array_from_callback(stacked.shape, placement, lambda i: stacked[i])
            self._take = jax.jit(lambda xs, i, flip: xs[i][:, :, ::-1, :] if flip else xs[i],
                                 static_argnums=2, out_shardings=inner)

    def __len__(self) -> int:
        return self.num_batches

    def iterate(self, flip: bool = False) -> Iterator[tuple[Any]]:
        """`(images,)` for every batch in order; mirrored left-right when flip=True."""
        for i in range(self.num_batches):
            if self.on_device:
                yield (self._take(self._x, i, flip),)
                continue
            images = self.x[i * self.global_batch:(i + 1) * self.global_batch]
            if len(images) < self.global_batch:
                pad = np.zeros((self.global_batch - len(images),) + images.shape[1:], images.dtype)
                images = np.concatenate([images, pad])
            yield (np.ascontiguousarray(images[:, :, ::-1]) if flip else images,)

    def trim(self, outputs: np.ndarray) -> np.ndarray:
        """The first N rows of outputs computed on the padded batches."""
        if len(outputs) != self.num_batches * self.global_batch:
            raise ValueError(f"expected {self.num_batches * self.global_batch} outputs, got {len(outputs)}")
        return outputs[:self.num_samples]
