"""The input pipeline (meshfit.data.arrays): shuffled, augmented batches on the devices and evaluation."""

import numpy as np
import pytest

from meshfit.errors import MeshfitError

N_TEST = 37  # samples to evaluate: not a multiple of the batch (16) or of the 8 devices


@pytest.mark.parametrize("on_device", [True, False])
def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch(strategy, on_device):
    from meshfit.data.arrays import TrainBatches

    x = np.arange(103, dtype=np.uint8).reshape(103, 1, 1, 1)
    y = np.arange(103, dtype=np.int32)
    batches = TrainBatches(x, y, global_batch=16, seed=5, on_device=on_device)
    assert len(batches) == 103 // 16  # the last partial batch is dropped
    epoch0 = np.concatenate([np.asarray(batches.batch(0, s)[1]) for s in range(len(batches))])
    assert len(set(epoch0.tolist())) == len(epoch0) == 6 * 16  # no sample twice
    assert sorted(batches.order(0).tolist()) == list(range(103))  # every sample in the order
    assert not np.array_equal(batches.order(0), batches.order(1))
    again = TrainBatches(x, y, global_batch=16, seed=5, on_device=on_device)
    np.testing.assert_array_equal(again.order(3), batches.order(3))
    other_seed = TrainBatches(x, y, global_batch=16, seed=6, on_device=on_device)
    assert not np.array_equal(other_seed.order(0), batches.order(0))
    images, labels = (np.asarray(a) for a in batches.batch(1, 2))
    np.testing.assert_array_equal(images.reshape(-1), labels)  # images travel with their labels


def test_start_mid_epoch_equals_the_tail_of_a_full_epoch(strategy):
    from meshfit.data.arrays import TrainBatches

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (70, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 70).astype(np.int32)
    batches = TrainBatches(x, y, global_batch=8, seed=1, augment="flip-crop")
    steps = len(batches)
    full = [batches.batch(e, s) for e in (2, 3) for s in range(steps)]
    started = batches.iterate(2, 3)
    tail = [next(started) for _ in range(len(full) - 3)]
    for (xa, ya), (xb, yb) in zip(full[3:], tail):
        np.testing.assert_array_equal(np.asarray(xa), np.asarray(xb))
        np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))


@pytest.mark.parametrize("padding, flips", [(4, "random"), (2, "alternate")])
def test_device_batches_are_sharded_and_equal_to_host_batches(strategy, padding, flips):
    from meshfit.data import arrays

    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (50, 12, 12, 3), dtype=np.uint8)
    y = np.arange(50, dtype=np.int32)
    settings = dict(seed=2, augment="flip-crop", crop_padding=padding, flips=flips)
    device = arrays.TrainBatches(x, y, 16, on_device=True, **settings)
    host = arrays.TrainBatches(x, y, 16, on_device=False, **settings)
    images, labels = device.batch(1, 2)
    assert {s.data.shape[0] for s in images.addressable_shards} == {2}  # 16 over 8 devices
    host_images, host_labels = host.batch(1, 2)
    np.testing.assert_array_equal(np.asarray(images), host_images)
    np.testing.assert_array_equal(np.asarray(labels), host_labels)
    # Every augmented image is a 12x12 crop of its reflect-padded original, maybe mirrored.
    changed = 0
    size = 2 * padding + 1
    for image, label in zip(host_images, host_labels):
        padded = np.pad(x[label], ((padding, padding), (padding, padding), (0, 0)), mode="reflect")
        crops = [padded[r:r + 12, c:c + 12] for r in range(size) for c in range(size)]
        assert any(np.array_equal(image, c) or np.array_equal(image, c[:, ::-1]) for c in crops)
        changed += not np.array_equal(image, x[label])
    assert changed > 8  # the augmentation really moves and flips images


def test_alternate_flips_mirror_each_image_every_other_epoch():
    from meshfit.data import arrays

    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (40, 6, 6, 1), dtype=np.uint8)
    y = np.arange(40, dtype=np.int32)
    batches = arrays.TrainBatches(x, y, 8, seed=5, augment="flip-crop", crop_padding=0,
                                    flips="alternate", on_device=False)

    def mirrored(epoch):
        state = {}
        for step in range(len(batches)):
            images, labels = batches.batch(epoch, step)
            for image, label in zip(images, labels):
                assert np.array_equal(image, x[label]) or np.array_equal(image, x[label][:, ::-1])
                state[int(label)] = not np.array_equal(image, x[label])
        return np.array([state[i] for i in range(40)])

    epochs = [mirrored(e) for e in range(3)]
    assert 10 < epochs[0].sum() < 30  # about half of the images start mirrored
    np.testing.assert_array_equal(epochs[1], ~epochs[0])
    np.testing.assert_array_equal(epochs[2], epochs[0])


def test_bad_augmentation_settings_are_clear_errors():
    from meshfit.data.arrays import TrainBatches

    x, y = np.zeros((16, 8, 8, 3), np.uint8), np.zeros(16, np.int32)
    with pytest.raises(MeshfitError, match="unknown flips 'sometimes'"):
        TrainBatches(x, y, 8, augment="flip-crop", flips="sometimes", on_device=False)
    with pytest.raises(MeshfitError, match="crop padding 8 does not fit 8x8 images"):
        TrainBatches(x, y, 8, augment="flip-crop", crop_padding=8, on_device=False)


@pytest.mark.parametrize("on_device", [True, False])
def test_evaluation_covers_every_sample_once(strategy, on_device):
    import keras

    from meshfit.data import arrays
    from meshfit.fit.predict import predict

    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (N_TEST, 4, 4, 1), dtype=np.uint8)
    batches = arrays.EvalBatches(x, global_batch=16, on_device=on_device)
    assert len(batches) == 3  # 16 + 16 + 5 real samples (and 11 padding)
    seen = np.concatenate([np.asarray(b[0]) for b in batches.iterate()])
    np.testing.assert_array_equal(batches.trim(seen), x)
    mirrored = np.concatenate([np.asarray(b[0]) for b in batches.iterate(flip=True)])
    np.testing.assert_array_equal(batches.trim(mirrored), x[:, :, ::-1])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
    outputs = predict(model, batches)
    assert outputs.shape == (N_TEST, 3)
    kernel, bias = model.get_weights()  # (Keras' own predict fails here: 37 does not split by 8)
    np.testing.assert_allclose(outputs, x.reshape(N_TEST, -1) @ kernel + bias, rtol=1e-5, atol=1e-4)
