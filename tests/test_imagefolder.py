"""meshfit.data.folder_scan, image_files and folders: folders scanned and split, images decoded,
batches streamed from disk as the in-memory pipeline's."""

import json
import os
import shutil
import types

import numpy as np
import pytest
from helpers import ONE_CPU, run_meshfit
from PIL import Image

from meshfit.commands.bench import jpeg_folder
from meshfit.fit import hosts
from meshfit.data import arrays, folder_scan, folders, image_files
from meshfit.errors import MeshfitError

SIZE = (12, 10)  # (height, width) of the generated images


def write_folder(root, counts, size=SIZE, seed=0, suffix=".png"):
    """PNG images of random pixels in root/<class>/; returns (images in scan order, labels)."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, (name, count) in enumerate(sorted(counts.items())):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(count):
            array = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(array).save(os.path.join(root, name, f"{i:03d}{suffix}"))
            images.append(array)
            labels.append(label)
    return np.stack(images), np.asarray(labels, np.int32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A scanned folder of 3 classes (7 + 6 + 8 = 21 images) and its images loaded in memory."""
    root = tmp_path_factory.mktemp("images")
    x, y = write_folder(root, {"cat": 7, "dog": 6, "emu": 8})
    return folder_scan.scan(root), x, y


# ------------------------------------------------------------------------------------ scanning

def test_scan_sorts_classes_and_files_and_skips_what_it_cannot_read(tmp_path):
    write_folder(tmp_path, {"b": 2, "a": 3})
    os.makedirs(tmp_path / "a" / "more")
    Image.new("RGB", SIZE[::-1]).save(tmp_path / "a" / "more" / "deep.jpg")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "b" / ".DS_Store").write_bytes(b"\0")
    with pytest.warns(UserWarning, match=r"skipped 2 file\(s\) .* \(1 unreadable image\(s\)\); e\.g\. .*broken\.png"):
        found = folder_scan.scan(tmp_path)
    assert found.root == str(tmp_path) and found.class_names == ("a", "b")
    names = [os.path.relpath(f, tmp_path) for f in found.files]
    assert names == ["a/000.png", "a/001.png", "a/002.png", "a/more/deep.jpg", "b/000.png", "b/001.png"]
    assert found.labels.dtype == np.int32 and found.labels.tolist() == [0, 0, 0, 0, 1, 1]
    skipped = {os.path.relpath(p, tmp_path): why for p, why in found.skipped}
    assert set(skipped) == {"a/notes.txt", "b/broken.png"}
    assert "not an image" in skipped["a/notes.txt"] and "unreadable" in skipped["b/broken.png"]
    part = found.subset([5, 0])
    assert part.files == (found.files[5], found.files[0]) and part.labels.tolist() == [1, 0]
    assert len(part) == 2 and part.class_names == found.class_names


def test_links_are_followed_once_and_never_back_up(tmp_path):
    root = tmp_path / "data"
    write_folder(root, {"a": 2, "b": 3})
    write_folder(tmp_path / "elsewhere", {"c": 4}, seed=1)
    os.symlink(root, root / "a" / "everything")  # back up to the root: the other class too
    os.symlink(".", root / "b" / "itself")
    os.symlink(tmp_path / "elsewhere" / "c", root / "a" / "more")  # a link down: followed once
    os.symlink(tmp_path / "elsewhere" / "c", root / "a" / "more again")
    with pytest.warns(UserWarning, match=r"skipped 3 file\(s\)"):
        found = folder_scan.scan(root)
    names = [os.path.relpath(f, root) for f in found.files]
    assert names == ["a/000.png", "a/001.png"] + [f"a/more/00{i}.png" for i in range(4)] + [
        "b/000.png", "b/001.png", "b/002.png"]
    assert {os.path.relpath(p, root) for p, why in found.skipped if "not followed" in why} == {
        "a/everything", "a/more again", "b/itself"}


@pytest.mark.parametrize("link", ["root", "class", "file"])
def test_an_image_reached_under_two_classes_is_a_one_line_error(tmp_path, link):
    """A class folder that is a link to the dataset's folder (or to another class), or an image
    linked into a second class, would label the same image twice: one line naming both."""
    root = tmp_path / "data"
    write_folder(root, {"cat": 2, "dog": 3})
    if link == "root":
        os.symlink(root, root / "all")
    elif link == "class":
        os.symlink(root / "dog", root / "pup")
    else:
        os.symlink(root / "dog" / "001.png", root / "cat" / "stray.png")
    with pytest.raises(MeshfitError) as error:
        folder_scan.scan(root)
    message = str(error.value)
    classes = {"root": ("all", "cat"), "class": ("dog", "pup"), "file": ("cat", "dog")}[link]
    assert "\n" not in message and "remove the link" in message, message
    assert all(f"(class {name})" in message for name in classes), message


@pytest.mark.parametrize("make, message", [
    (lambda root: None, "does not exist"),
    (lambda root: os.makedirs(root), "has no class sub-folders"),
    (lambda root: write_folder(root, {"only": 3}), "single class folder (only)"),
    (lambda root: (write_folder(root, {"a": 2}), os.makedirs(os.path.join(root, "b"))),
     "class folder"),
    (lambda root: (write_folder(root, {"a": 2}), os.makedirs(os.path.join(root, "b")),
                   open(os.path.join(root, "b", "x.jpg"), "wb").write(b"nope")), "1 file(s) skipped"),
])
def test_bad_folders_are_one_line_errors(tmp_path, make, message):
    root = str(tmp_path / "data")
    make(root)
    with pytest.raises(MeshfitError) as error:
        folder_scan.scan(root)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_every_mode_and_size_decodes_to_the_asked_shape(tmp_path):
    path = str(tmp_path / "x")
    grey = Image.fromarray(np.full((20, 30), 77, np.uint8), "L")
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque; every other pixel fully transparent (on white: 255)
    palette = Image.new("P", (4, 4), 0)
    palette.putpixel((0, 0), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.info["transparency"] = 0
    sixteen = Image.fromarray(np.full((4, 4), 0x8000, np.uint16))  # mode I;16
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # red
    cases = {"grey.png": grey, "rgba.png": Image.fromarray(rgba, "RGBA"), "palette.png": palette,
             "sixteen.png": sixteen, "cmyk.jpg": cmyk, "grey.jpg": grey, "big.jpg": grey.resize((400, 300)),
             "anim.gif": grey.convert("P")}
    for name, image in cases.items():
        image.save(f"{path}-{name}")
    loaded = {name: image_files.load_image(f"{path}-{name}", (4, 4), 3) for name in cases}
    assert all(a.shape == (4, 4, 3) and a.dtype == np.uint8 for a in loaded.values())
    assert (loaded["grey.png"] == 77).all() and abs(int(loaded["grey.jpg"].mean()) - 77) <= 1
    assert loaded["rgba.png"][0, 0].tolist() == [10, 20, 30] and (loaded["rgba.png"][1:] == 255).all()
    assert loaded["palette.png"][0, 0].tolist() == [200, 100, 50]
    assert (loaded["palette.png"][1:] == 255).all()  # the transparent colour, on white
    assert (loaded["sixteen.png"] == 128).all()  # 0x8000 >> 8, not clipped to 255
    assert (loaded["cmyk.jpg"][..., 0] > 200).all() and (loaded["cmyk.jpg"][..., 1:] < 60).all()
    assert abs(int(loaded["big.jpg"].mean()) - 77) <= 1
    one = image_files.load_image(f"{path}-rgba.png", (2, 3), 1)
    assert one.shape == (2, 3, 1)


def test_pngs_decode_to_the_same_pixels_as_pillow(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (9, 13, 3), np.uint8)
    images = {"grey": Image.fromarray(pixels[..., 0], "L"), "rgb": Image.fromarray(pixels, "RGB"),
              "grey-alpha": Image.fromarray(pixels, "RGB").convert("LA"),
              "rgb-alpha": Image.fromarray(np.dstack([pixels, pixels[..., :1]]), "RGBA")}
    files = []
    for name, image in images.items():
        for interlace in (False, True):
            files.append(tmp_path / f"{name}-{interlace}.png")
            image.save(files[-1], interlace=interlace)
    files.append(tmp_path / "truncated.png")  # pixels Pillow decodes in part: the same bytes in both
    files[-1].write_bytes(files[0].read_bytes()[:-12])
    shapes = [((9, 13), 1), ((9, 13), 3), ((5, 7), 1), ((5, 7), 3)]
    fast = {(f, s): image_files.load_image(str(f), *s) for f in files for s in shapes}
    monkeypatch.setattr(image_files, "_decode_png", lambda data, out: False)  # Pillow for all
    for (f, shape), array in fast.items():
        assert np.array_equal(array, image_files.load_image(str(f), *shape)), (f.name, shape)


def test_an_image_of_too_many_pixels_is_refused_before_decoding(tmp_path):
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    bomb = tmp_path / "bomb.png"  # 40000 x 40000 grey (1.6 GB decoded) in a few hundred bytes
    bomb.write_bytes(image_files.PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(bytes(40001 * 64))) + chunk(b"IEND", b""))
    for channels in (1, 3):
        with pytest.raises(MeshfitError, match="40000x40000 pixels, more than") as error:
            image_files.load_image(str(bomb), (28, 28), channels)
        assert str(bomb) in str(error.value) and "\n" not in str(error.value)


def test_a_file_that_fails_to_decode_is_a_one_line_error_naming_it(tmp_path):
    write_folder(tmp_path, {"a": 2, "b": 2})
    bad = tmp_path / "b" / "001.png"
    data = bad.read_bytes()
    bad.write_bytes(data[:len(data) // 2])  # the header reads, the pixels do not
    found = folder_scan.scan(tmp_path)
    assert len(found) == 4
    batches = folders.FolderTrainBatches(found, SIZE, 3, 4)
    with pytest.raises(MeshfitError) as error:
        batches.batch(0, 0)
    assert str(bad) in str(error.value) and "\n" not in str(error.value)
    assert batches.failure is error.value  # for callers that get it wrapped (Keras on TensorFlow)


# -------------------------------------------------------------------------------------- layout

def test_layout_uses_train_test_and_val_folders_as_given(tmp_path):
    write_folder(tmp_path / "train", {"a": 5, "b": 5})
    write_folder(tmp_path / "test", {"a": 2, "b": 1}, seed=1)
    split = folder_scan.layout(tmp_path, 0.2, seed=0)
    assert len(split["test"]) == 3 and split["test"].class_names == ("a", "b")
    assert len(split["train"]) == 8 and len(split["validation"]) == 2  # 0.2 of train/, per class
    write_folder(tmp_path / "val", {"a": 1, "b": 1}, seed=2)
    split = folder_scan.layout(tmp_path, 0.2, seed=0)
    assert (len(split["train"]), len(split["validation"]), len(split["test"])) == (10, 2, 3)
    write_folder(tmp_path / "val", {"c": 1}, seed=2)
    with pytest.raises(MeshfitError, match="same class sub-folders"):
        folder_scan.layout(tmp_path, 0.2, seed=0)


def test_the_start_line_calls_only_a_split_of_train_held_out(tmp_path):
    """A val/ folder (or a streamed "validation" source) is the dataset's own validation data:
    the start line called it "a held-out validation split"."""
    from meshfit.data.splits import RunData
    from meshfit.run.keras_side.fitting import evaluation_note

    write_folder(tmp_path / "train", {"a": 5, "b": 5})
    run = types.SimpleNamespace(evaluated_on="validation", recipe_file=None)
    for given in (False, True):
        if given:
            write_folder(tmp_path / "val", {"a": 1, "b": 1}, seed=2)
        split = folder_scan.layout(tmp_path, 0.2, seed=0)
        data = RunData(str(tmp_path), ("a", "b"), (8, 8, 3), split["train"], split["validation"], None)
        assert data.validation_given is given
        note = evaluation_note(run, has_test=False, validation_given=data.validation_given)
        assert note == ("val_* on the dataset's validation data (no test set, so none is scored); " if given
                        else "val_* on a held-out validation split (no test set, so none is scored); ")


def test_layout_takes_train_alone_and_refuses_val_without_train(tmp_path):
    """train/ alone is split as a folder of classes would be (it was the one class "train"); val/
    next to class folders had become a class of its own, silently."""
    write_folder(tmp_path / "train", {"a": 5, "b": 5})
    split = folder_scan.layout(tmp_path, 0.2, seed=0)
    assert split["train"].class_names == ("a", "b") and len(split["validation"]) == 2
    shutil.move(tmp_path / "train" / "a", tmp_path / "a"), shutil.move(tmp_path / "train" / "b", tmp_path / "b")
    (tmp_path / "train").rmdir()
    write_folder(tmp_path / "val", {"a": 1, "b": 1}, seed=2)
    with pytest.raises(MeshfitError, match=r"has val/ but no train/ folder, so val would be a class"):
        folder_scan.layout(tmp_path, 0.2, seed=0)


def test_layout_splits_one_folder_per_class_by_seed(tmp_path):
    write_folder(tmp_path, {"a": 10, "b": 3, "c": 1})
    split = folder_scan.layout(tmp_path, 0.25, seed=5)
    train, validation = split["train"], split["validation"]
    assert split["test"] is None
    assert np.bincount(validation.labels, minlength=3).tolist() == [3, 1, 0]  # round half up; c keeps 1
    assert sorted(train.files + validation.files) == sorted(folder_scan.scan(tmp_path).files)
    assert folder_scan.layout(tmp_path, 0.25, seed=5)["validation"].files == validation.files
    assert folder_scan.layout(tmp_path, 0.25, seed=6)["validation"].files != validation.files
    assert folder_scan.layout(tmp_path, 0.0, seed=5)["validation"] is None
    with pytest.raises(MeshfitError, match="validation_split"):
        folder_scan.layout(tmp_path, 1.0, seed=5)


# ------------------------------------------------------------------------------------- batches

@pytest.mark.parametrize("augment, flips", [("none", "random"), ("flip-crop", "random"),
                                            ("flip-crop", "alternate")])
def test_train_batches_equal_the_in_memory_pipeline(folder, augment, flips):
    found, x, y = folder
    ours = folders.FolderTrainBatches(found, SIZE, 3, 4, seed=3, augment=augment, crop_padding=2,
                                          flips=flips, workers=2)
    theirs = arrays.TrainBatches(x, y, 4, seed=3, augment=augment, crop_padding=2, flips=flips,
                                   on_device=False)
    assert ours.steps_per_epoch == theirs.steps_per_epoch == 5 and len(ours) == 5
    assert ours.num_samples == 21 and ours.global_batch == 4
    for epoch, step in [(0, 0), (0, 4), (1, 2), (2, 3)]:
        images, labels = ours.batch(epoch, step)
        expected_images, expected_labels = theirs.batch(epoch, step)
        assert images.dtype == np.uint8 and labels.dtype == np.int32
        np.testing.assert_array_equal(images, expected_images)
        np.testing.assert_array_equal(labels, expected_labels)


def test_batch_is_a_pure_function_of_seed_epoch_and_step(folder):
    found, _, _ = folder
    make = lambda: folders.FolderTrainBatches(found, SIZE, 3, 4, seed=1, augment="flip-crop")  # noqa: E731
    stream = make().iterate(epoch=1, step=3)
    assert isinstance(stream, types.GeneratorType)  # what Keras' fit takes in one process
    for epoch, step in [(1, 3), (1, 4), (2, 0), (2, 1)]:  # runs on into the next epoch
        images, labels = next(stream)
        fresh_images, fresh_labels = make().batch(epoch, step)
        np.testing.assert_array_equal(images, fresh_images)
        np.testing.assert_array_equal(labels, fresh_labels)
    assert not np.array_equal(make().batch(0, 0)[0], make().batch(1, 0)[0])


def test_flip_crop_shifts_and_mirrors_images(folder):
    found, x, _ = folder
    batches = folders.FolderTrainBatches(found, SIZE, 3, 20, seed=0, augment="flip-crop",
                                             crop_padding=0)
    images, _ = batches.batch(0, 0)
    indices = batches._order(0)[:20]
    mirrored = [np.array_equal(a, x[i][:, ::-1]) for a, i in zip(images, indices)]
    kept = [np.array_equal(a, x[i]) for a, i in zip(images, indices)]
    assert all(m or k for m, k in zip(mirrored, kept)) and any(mirrored) and any(kept)
    shifted, _ = folders.FolderTrainBatches(found, SIZE, 3, 20, augment="flip-crop").batch(0, 0)
    assert sum(np.array_equal(a, x[i]) or np.array_equal(a, x[i][:, ::-1])
               for a, i in zip(shifted, indices)) < 20  # crops move most images


def test_iterate_keeps_only_a_few_batches_in_flight(folder, monkeypatch):
    found, _, _ = folder
    batches = folders.FolderTrainBatches(found, SIZE, 3, 2)
    started = []
    submit = batches._decoder.submit
    monkeypatch.setattr(batches._decoder, "submit", lambda *a, **k: started.append(1) or submit(*a, **k))
    stream = batches.iterate()
    for taken in range(1, 25):  # a bit more than two epochs of 10 steps
        next(stream)
        assert len(started) == taken + folders.PREFETCH_BATCHES
    stream.close()


@pytest.mark.parametrize("cheap_below, threads", [(1.0, 1), (0.0, 4)])
def test_decoding_grows_to_a_thread_per_core_only_for_costly_images(folder, monkeypatch, cheap_below,
                                                                   threads):
    found, _, _ = folder
    monkeypatch.setattr(folders, "default_workers", lambda: 4)
    monkeypatch.setattr(folders, "MEASURED_IMAGES", 8)
    monkeypatch.setattr(folders, "CHEAP_IMAGE_SECONDS", cheap_below)
    batches = folders.FolderTrainBatches(found, SIZE, 3, 2)
    assert batches._decoder.workers == 1  # until MEASURED_IMAGES are decoded
    stream = batches.iterate()
    taken = [next(stream) for _ in range(15)]
    stream.close()
    assert batches._decoder.workers == threads
    for step, (x, y) in enumerate(taken):  # the same batches whatever the threads
        expected = batches.batch(step // len(batches), step % len(batches))
        assert np.array_equal(x, expected[0]) and np.array_equal(y, expected[1])


def test_each_process_decodes_only_its_rows(folder, monkeypatch):
    found, _, _ = folder
    whole = folders.FolderTrainBatches(found, SIZE, 3, 8, augment="flip-crop").batch(1, 1)
    devices = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1)]  # 2 rows per device
    decoded, parts, streams = [], [], []
    real = folders.load_image
    monkeypatch.setattr(folders, "load_image", lambda path, *a: decoded.append(path) or real(path, *a))
    for process in (0, 1):
        monkeypatch.setattr(folders, "_this_process", lambda p=process: (devices, p))
        batches = folders.FolderTrainBatches(found, SIZE, 3, 8, augment="flip-crop")
        parts.append(batches.batch(1, 1))
        assert parts[-1][0].shape == (4, *SIZE, 3) and len(decoded) == 4 * (process + 1)
        streams.append(batches.iterate(1, 1))
    for process, (stream, (images, _)) in enumerate(zip(streams, parts)):
        assert stream.process_local is True
        info = types.SimpleNamespace(devices=devices, process_index=process)
        generator, *_ = hosts.fit_arguments(types.SimpleNamespace(info=info), stream, None, None, {})
        assert isinstance(generator, types.GeneratorType)  # Keras takes generators only
        np.testing.assert_array_equal(next(generator)[0], images)
        stream.close()
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), whole[0])
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), whole[1])


def test_eval_batches_cover_every_image_once(folder):
    found, x, y = folder
    batches = folders.FolderEvalBatches(found, SIZE, 3, 8)
    assert (batches.num_batches, len(batches), batches.num_samples) == (3, 3, 21)
    np.testing.assert_array_equal(batches.labels, y)
    plain = np.concatenate([b for (b,) in batches.iterate()])
    flipped = np.concatenate([b for (b,) in batches.iterate(flip=True)])
    assert plain.shape == (24, *SIZE, 3) and (plain[21:] == 0).all()
    np.testing.assert_array_equal(batches.trim(plain), x)
    np.testing.assert_array_equal(batches.trim(flipped), x[:, :, ::-1])
    grey = folders.FolderEvalBatches(found, (6, 5), 1, 21)
    assert next(iter(grey.iterate()))[0].shape == (21, 6, 5, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"channels": 2}, "channels must be 1"),
    ({"image_size": (0, 4)}, "image size"),
    ({"global_batch": 22}, "larger than the 21 training samples"),
    ({"augment": "mixup"}, "unknown augmentation"),
    ({"steps_per_epoch": 6}, "use at most 5 steps"),
])
def test_bad_batch_arguments_are_one_line_errors(folder, kwargs, message):
    arguments = {"image_size": SIZE, "channels": 3, "global_batch": 4, **kwargs}
    with pytest.raises(MeshfitError, match=message):
        folders.FolderTrainBatches(folder[0], **arguments)


# --------------------------------------------------------------------------------------- bench

def test_bench_input_json_times_ours_and_the_keras_anchor(tmp_path):
    write_folder(tmp_path / "images", {"a": 6, "b": 6})
    result = run_meshfit("bench", "--input", str(tmp_path / "images"), "--image-size", "8", "8",
                         "--global-batches", "4", "--rounds", "1", "--steps", "2", "--json",
                         "--out", str(tmp_path / "out"), env=ONE_CPU, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["input_images_per_second"] > 0 and data["anchor_images_per_second"] > 0
    assert data["vs_anchor"] == pytest.approx(data["input_images_per_second"] / data["anchor_images_per_second"])
    assert [r["path"] for r in data["rows"]] == ["meshfit", "keras"]
    assert all(r["batches"] == 2 and r["peak_rss_mb"] > 0 for r in data["rows"])
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["images"] == 12


def test_bench_input_needs_an_image_size_and_a_good_folder(tmp_path):
    result = run_meshfit("bench", "--input", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "--image-size" in result.stderr
    result = run_meshfit("bench", "--input", str(tmp_path), "--image-size", "8", "8", timeout=60)
    assert result.returncode == 2 and "no class sub-folders" in result.stderr
    assert "Traceback" not in result.stderr


def test_write_jpeg_folder_upscales_cifar_images(tmp_path, monkeypatch):
    from meshfit.data import datasets

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    y = np.arange(12, dtype=np.int32) % 10
    fake = datasets.Dataset(x, y, x[:0], y[:0], tuple(f"c{i}" for i in range(10)), "cifar10")
    monkeypatch.setattr(datasets, "load", lambda *a, **k: fake)
    assert jpeg_folder.write_jpeg_folder(str(tmp_path / "jpegs"), image_size=(40, 48)) == 12
    found = folder_scan.scan(tmp_path / "jpegs")
    assert len(found) == 12 and found.class_names == fake.class_names
    assert Image.open(found.files[0]).size == (48, 40)
