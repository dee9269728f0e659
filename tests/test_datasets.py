"""Tests for meshfit.data.datasets on small generated files in the canonical formats."""

import gzip
import hashlib
import io
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import write_idx_dataset
from PIL import Image

from meshfit.data import datasets
from meshfit.data.datasets import IDX_FILES, load, image_folder
from meshfit.data.file_formats import write_cifar_batch, write_idx
from meshfit.errors import MeshfitError

REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No real ~/.keras, cache, $MESHFIT_DATA or network: everything under tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MESHFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MESHFIT_OFFLINE", "1")
    monkeypatch.delenv("MESHFIT_DATA", raising=False)


TINY = {"n_train": 12, "n_test": 5}  # the IDX datasets' sizes (the error messages below count them)


def make_cifar(folder, per_batch=4, seed=0, label_names=None):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    out = {}
    for name in datasets.CIFAR_FILES:
        x = rng.integers(0, 256, (per_batch, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, per_batch)
        write_cifar_batch(os.path.join(folder, name), x, y, label_names)
        out[name] = (x, y)
    return out


def check_mnist_like(ds, arrays, name):
    x_train, y_train, x_test, y_test = arrays
    assert ds.name == name
    assert ds.x_train.shape == (len(x_train), 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.y_train.dtype == np.int32 and ds.y_train.shape == (len(x_train),)
    np.testing.assert_array_equal(ds.x_train[..., 0], x_train)
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.x_test[..., 0], x_test)
    np.testing.assert_array_equal(ds.y_test, y_test)
    assert ds.input_shape == (28, 28, 1) and ds.num_classes == 10


# ----------------------------------------------------------------------------- IDX

def test_idx_round_trip_via_data_dir(tmp_path):
    arrays = write_idx_dataset(tmp_path / "data" / "mnist", **TINY)
    ds = load("mnist", tmp_path / "data")
    check_mnist_like(ds, arrays, "mnist")
    assert ds.class_names == tuple("0123456789")
    # data_dir may also be the dataset's own folder
    check_mnist_like(datasets.mnist(tmp_path / "data" / "mnist"), arrays, "mnist")


def test_fashion_via_meshfit_data_env(tmp_path, monkeypatch):
    arrays = write_idx_dataset(tmp_path / "env" / "fashion-mnist", **TINY, seed=1)
    monkeypatch.setenv("MESHFIT_DATA", str(tmp_path / "env"))
    for name in ("fashion_mnist", "fashion-mnist"):
        ds = load(name)
        check_mnist_like(ds, arrays, "fashion_mnist")
        assert ds.class_names[0] == "T-shirt/top" and ds.class_names[9] == "Ankle boot"
    check_mnist_like(datasets.fashion_mnist(), arrays, "fashion_mnist")


def test_data_dir_searched_before_env_and_keras_cache(tmp_path, monkeypatch):
    first = write_idx_dataset(tmp_path / "explicit" / "mnist", **TINY, seed=1)
    write_idx_dataset(tmp_path / "env" / "mnist", **TINY, seed=2)
    keras = write_idx_dataset(tmp_path / "home" / ".keras" / "datasets" / "mnist", **TINY, seed=3)
    monkeypatch.setenv("MESHFIT_DATA", str(tmp_path / "env"))
    check_mnist_like(load("mnist", tmp_path / "explicit"), first, "mnist")
    monkeypatch.delenv("MESHFIT_DATA")
    check_mnist_like(load("mnist"), keras, "mnist")


def test_fashion_folder_is_not_read_as_mnist(tmp_path):
    write_idx_dataset(tmp_path / "fashion-mnist", **TINY)
    with pytest.raises(MeshfitError, match="mnist not found"):
        load("mnist", tmp_path / "fashion-mnist")


def test_keras_mnist_npz(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, 28, 28), dtype=np.uint8), rng.integers(0, 10, 6),
              rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), rng.integers(0, 10, 3)]
    keras_dir = tmp_path / "home" / ".keras" / "datasets"
    keras_dir.mkdir(parents=True)
    np.savez(keras_dir / "mnist.npz", x_train=arrays[0], y_train=arrays[1],
             x_test=arrays[2], y_test=arrays[3])
    check_mnist_like(load("mnist"), arrays, "mnist")


def test_truncated_gz_names_the_file(tmp_path):
    write_idx_dataset(tmp_path / "mnist", **TINY)
    path = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(MeshfitError, match="train-images-idx3-ubyte.gz") as e:
        load("mnist", tmp_path)
    assert "delete" in str(e.value) and "\n" not in str(e.value)


def test_wrong_magic_number(tmp_path):
    write_idx_dataset(tmp_path / "mnist", **TINY)
    # an image file where a label file belongs: magic 0x00000803 instead of 0x00000801
    write_idx(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz", np.zeros((5, 28, 28), np.uint8))
    with pytest.raises(MeshfitError, match="t10k-labels-idx1-ubyte.gz.*wrong magic number"):
        load("mnist", tmp_path)


def test_short_data_and_count_mismatch(tmp_path):
    write_idx_dataset(tmp_path / "mnist", **TINY)
    path = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-1]))  # valid gzip, one label byte missing
    with pytest.raises(MeshfitError, match="train-labels-idx1-ubyte.gz.*data bytes"):
        load("mnist", tmp_path)
    write_idx(path, np.zeros(11, np.uint8))  # complete file, but 11 labels for 12 images
    with pytest.raises(MeshfitError, match="12 images.*11 labels"):
        load("mnist", tmp_path)


def test_label_out_of_range(tmp_path):
    write_idx_dataset(tmp_path / "mnist", **TINY)
    write_idx(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz", np.array([0, 1, 2, 3, 10]))
    with pytest.raises(MeshfitError, match="label 10"):
        load("mnist", tmp_path)


def test_md5_checked_only_for_files_of_published_size(tmp_path, monkeypatch):
    write_idx_dataset(tmp_path / "mnist", **TINY)
    path = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    size = path.stat().st_size
    # pretend this generated file's size is the published one: its MD5 must then match
    monkeypatch.setitem(datasets.PUBLISHED, ("mnist", path.name), ("0" * 32, size))
    with pytest.raises(MeshfitError, match="train-labels-idx1-ubyte.gz.*MD5"):
        load("mnist", tmp_path)
    assert load("mnist", tmp_path, verify=False).y_train.shape == (12,)
    good = hashlib.md5(path.read_bytes()).hexdigest()
    monkeypatch.setitem(datasets.PUBLISHED, ("mnist", path.name), (good, size))
    assert load("mnist", tmp_path).y_train.shape == (12,)


# ----------------------------------------------------------------------------- not found / download

def test_missing_offline_names_searched_places(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHFIT_DATA", str(tmp_path / "envdata"))
    with pytest.raises(MeshfitError) as e:
        load("cifar10", tmp_path / "nothing")
    msg = str(e.value)
    assert "\n" not in msg
    for place in (tmp_path / "nothing", tmp_path / "envdata",
                  tmp_path / "home" / ".keras" / "datasets", tmp_path / "cache"):
        assert str(place) in msg
    assert "--data-dir" in msg and "MESHFIT_DATA" in msg and "MESHFIT_OFFLINE" in msg


def test_download_false_is_refused_even_online(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setattr(datasets, "_download_dataset", lambda *a: pytest.fail("downloaded"))
    with pytest.raises(MeshfitError, match="download=False"):
        load("mnist", download=False)


def test_unknown_name_lists_valid_names():
    with pytest.raises(MeshfitError, match="mnist, fashion_mnist, cifar10"):
        load("imagenet")


def test_download_into_cache_checks_md5(tmp_path, monkeypatch):
    """Download from a file:// 'server' of generated files; a wrong MD5 leaves nothing behind."""
    arrays = write_idx_dataset(tmp_path / "server", **TINY)
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setitem(datasets.URLS, "mnist", (tmp_path / "server").as_uri() + "/")
    with pytest.raises(MeshfitError, match="MD5"):  # published MD5s don't fit generated files
        load("mnist")
    assert not any((tmp_path / "cache" / "mnist").iterdir())  # no partial or temporary files
    for f in IDX_FILES:
        md5 = hashlib.md5((tmp_path / "server" / f).read_bytes()).hexdigest()
        monkeypatch.setitem(datasets.PUBLISHED, ("mnist", f), (md5, 0))
    check_mnist_like(load("mnist"), arrays, "mnist")
    assert sorted(os.listdir(tmp_path / "cache" / "mnist")) == sorted(IDX_FILES)
    monkeypatch.setenv("MESHFIT_OFFLINE", "1")  # now found in the cache without the network
    check_mnist_like(load("mnist"), arrays, "mnist")


def test_network_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setitem(datasets.URLS, "mnist", (tmp_path / "no-server").as_uri() + "/")
    with pytest.raises(MeshfitError, match="downloading it from .* failed.*--data-dir"):
        load("mnist")


def serve_mnist(tmp_path, monkeypatch):
    """Generated MNIST files behind a file:// 'server' whose published MD5s and sizes fit them."""
    arrays = write_idx_dataset(tmp_path / "server", **TINY)
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setitem(datasets.URLS, "mnist", (tmp_path / "server").as_uri() + "/")
    for f in IDX_FILES:
        data = (tmp_path / "server" / f).read_bytes()
        monkeypatch.setitem(datasets.PUBLISHED, ("mnist", f), (hashlib.md5(data).hexdigest(), len(data)))
    return arrays


def test_processes_sharing_a_cache_download_once(tmp_path, monkeypatch):
    """Loads racing into one cache (threads stand in for processes: each opens the lock file
    itself): one downloads, the others wait for it and read its files; a killed download's
    temporary file is removed."""
    import threading
    import urllib.request

    arrays = serve_mnist(tmp_path, monkeypatch)
    (tmp_path / "cache" / "mnist").mkdir(parents=True)
    (tmp_path / "cache" / "mnist" / ".download-killed").write_bytes(b"partial")
    opened, results = [], []
    real_urlopen = urllib.request.urlopen

    def slow_urlopen(url, timeout=None):
        opened.append(url)
        threading.Event().wait(0.05)  # long enough for the others to reach the lock
        return real_urlopen(url, timeout=timeout)

    monkeypatch.setattr(urllib.request, "urlopen", slow_urlopen)
    loaders = [threading.Thread(target=lambda: results.append(load("mnist"))) for _ in range(3)]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join()
    assert len(results) == 3 and sorted(opened) == sorted({*opened}) and len(opened) == len(IDX_FILES)
    for ds in results:
        check_mnist_like(ds, arrays, "mnist")
    assert sorted(os.listdir(tmp_path / "cache" / "mnist")) == sorted(IDX_FILES)


def test_download_larger_than_published_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    serve_mnist(tmp_path, monkeypatch)
    md5, size = datasets.PUBLISHED[("mnist", IDX_FILES[0])]
    monkeypatch.setitem(datasets.PUBLISHED, ("mnist", IDX_FILES[0]), (md5, size - 1))
    with pytest.raises(MeshfitError, match=f"more than the {size - 1} expected"):
        load("mnist")
    assert not any((tmp_path / "cache" / "mnist").iterdir())


def write_tgz(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def test_cifar_download_extracts_tarball(tmp_path, monkeypatch):
    batches = make_cifar(tmp_path / "src")
    files = {f"cifar-10-batches-py/{n}": (tmp_path / "src" / n).read_bytes()
             for n in datasets.CIFAR_FILES}
    md5 = write_tgz(tmp_path / "c.tar.gz", files)
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setitem(datasets.URLS, "cifar10", (tmp_path / "c.tar.gz").as_uri())
    monkeypatch.setattr(datasets, "CIFAR_TGZ_MD5", md5)
    ds = load("cifar10")
    np.testing.assert_array_equal(ds.x_test, batches["test_batch"][0])
    assert sorted(os.listdir(tmp_path / "cache" / "cifar10")) == ["cifar-10-batches-py"]


def test_cifar_download_refuses_unsafe_tar_entries(tmp_path, monkeypatch):
    md5 = write_tgz(tmp_path / "c.tar.gz", {"../evil": b"x"})
    monkeypatch.delenv("MESHFIT_OFFLINE")
    monkeypatch.setitem(datasets.URLS, "cifar10", (tmp_path / "c.tar.gz").as_uri())
    monkeypatch.setattr(datasets, "CIFAR_TGZ_MD5", md5)
    with pytest.raises(MeshfitError, match="unsafe entry"):
        load("cifar10")
    assert not (tmp_path / "cache" / "evil").exists()


# ----------------------------------------------------------------------------- CIFAR-10

def test_cifar_round_trip_channel_major_to_nhwc(tmp_path):
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    batches = make_cifar(folder, label_names=[f"c{i}" for i in range(10)])
    # set one pixel through the raw channel-major layout: image 2, row 5, column 7
    with open(folder / "data_batch_3", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    for channel, value in enumerate((11, 22, 33)):
        batch[b"data"][2, channel * 1024 + 5 * 32 + 7] = value
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump(batch, f)
    ds = load("cifar10", tmp_path)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (4, 32, 32, 3)
    assert ds.x_train[2 * 4 + 2, 5, 7].tolist() == [11, 22, 33]
    np.testing.assert_array_equal(ds.x_train[:4], batches["data_batch_1"][0])
    np.testing.assert_array_equal(ds.y_train[4:8], batches["data_batch_2"][1])
    np.testing.assert_array_equal(ds.y_test, batches["test_batch"][1])
    assert ds.y_train.dtype == np.int32 and ds.class_names == tuple(f"c{i}" for i in range(10))
    # keras's layout (ROOT/cifar-10-batches-py) and the batch folder itself also work
    assert load("cifar10", folder).x_train.shape == (20, 32, 32, 3)
    assert load("cifar10", tmp_path / "cifar10").class_names[0] == "c0"


def test_cifar_default_class_names_without_meta(tmp_path):
    make_cifar(tmp_path / "cifar-10-batches-py")
    ds = datasets.cifar10(tmp_path)
    assert ds.class_names == datasets.CLASS_NAMES["cifar10"] and ds.num_classes == 10


def test_cifar_corrupt_pickle_names_the_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    make_cifar(folder)
    path = folder / "data_batch_4"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(MeshfitError, match="data_batch_4.*delete"):
        load("cifar10", tmp_path)


def test_cifar_pickle_with_foreign_object_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    make_cifar(folder)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": os.getcwd}, protocol=2))
    with pytest.raises(MeshfitError, match="test_batch.*refusing"):
        load("cifar10", tmp_path)


def test_cifar_wrong_shape(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    make_cifar(folder)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(MeshfitError, match="test_batch.*3072"):
        load("cifar10", tmp_path)


# ----------------------------------------------------------------------------- image_folder

def write_png(path, size_wh, color, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size_wh, color).save(path)


def make_image_folder(root):
    colors = {"cat": (255, 0, 0), "dog": (0, 255, 0), "bird": (0, 0, 255)}
    counts = {"cat": 5, "dog": 4, "bird": 3}
    for cls, n in counts.items():
        for i in range(n):
            ext = ".PNG" if i % 2 else ".png"
            write_png(root / cls / f"{i}{ext}", (10 + 7 * i, 20 + 3 * i), colors[cls])
    (root / "cat" / "notes.txt").write_text("not an image")
    write_png(root / "dog" / "grey.png", (8, 8), 128, mode="L")  # a grey image among RGB ones
    counts["dog"] += 1
    return colors, counts


def test_image_folder_shapes_labels_and_split(tmp_path):
    colors, counts = make_image_folder(tmp_path / "imgs")
    ds = image_folder(tmp_path / "imgs", (16, 12), validation_split=0.4, seed=3)
    assert ds.class_names == ("bird", "cat", "dog") and ds.num_classes == 3
    assert ds.x_train.shape[1:] == (16, 12, 3) and ds.input_shape == (16, 12, 3)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
    # per class round(n * 0.4) go to test: bird 3 -> 1, cat 5 -> 2, dog 5 -> 2
    assert np.bincount(ds.y_test, minlength=3).tolist() == [1, 2, 2]
    assert np.bincount(ds.y_train, minlength=3).tolist() == [2, 3, 3]
    assert len(ds.x_train) + len(ds.x_test) == sum(counts.values())
    # every image is its class's solid colour (the grey dog image is 128 on all channels)
    pairs = zip(np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test]))
    for x, y in pairs:
        cls = ds.class_names[y]
        assert x[0, 0].tolist() in (list(colors[cls]), [128, 128, 128])
    again = image_folder(tmp_path / "imgs", (16, 12), validation_split=0.4, seed=3)
    np.testing.assert_array_equal(again.y_train, ds.y_train)


def test_image_folder_grey_and_no_split(tmp_path):
    make_image_folder(tmp_path / "imgs")
    ds = image_folder(tmp_path / "imgs", (8, 9), validation_split=0.0, channels=1)
    assert ds.x_train.shape == (13, 8, 9, 1) and ds.x_test.shape == (0, 8, 9, 1)
    assert ds.name == "imgs"


def test_image_folder_skips_unreadable_files_with_a_warning_and_names_undecodable_ones(tmp_path):
    _, counts = make_image_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.warns(UserWarning, match="broken.jpg"):
        ds = image_folder(tmp_path / "imgs", (8, 8), validation_split=0.0)
    assert len(ds.x_train) == sum(counts.values())
    cut = tmp_path / "imgs" / "dog" / "cut.png"  # its header reads, its pixels do not
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    Image.fromarray(noise).save(cut)
    cut.write_bytes(cut.read_bytes()[:1500])
    with pytest.raises(MeshfitError, match="cut.png"):
        image_folder(tmp_path / "imgs", (8, 8))


def test_image_folder_errors(tmp_path):
    with pytest.raises(MeshfitError, match="does not exist"):
        image_folder(tmp_path / "missing", (8, 8))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MeshfitError, match="no class sub-folders"):
        image_folder(tmp_path / "empty", (8, 8))
    make_image_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "fish").mkdir()
    (tmp_path / "imgs" / "fish" / "readme.txt").write_text("no images here")
    with pytest.raises(MeshfitError, match="fish has no readable images"):
        image_folder(tmp_path / "imgs", (8, 8))


# ----------------------------------------------------------------------------- real data

@pytest.mark.skipif(not (REAL_DATA / "fashion-mnist").is_dir(),
                    reason="../shared/data/fashion-mnist not present")
def test_real_fashion_mnist_with_md5(tmp_path, monkeypatch):
    ds = load("fashion_mnist", REAL_DATA)
    assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    # the real files have their published sizes, so their MD5s are checked: a wrong MD5 fails
    name = "t10k-labels-idx1-ubyte.gz"
    md5, size = datasets.PUBLISHED[("fashion_mnist", name)]
    assert (REAL_DATA / "fashion-mnist" / name).stat().st_size == size
    monkeypatch.setitem(datasets.PUBLISHED, ("fashion_mnist", name), ("0" * 32, size))
    with pytest.raises(MeshfitError, match=f"{name}.*MD5"):
        load("fashion_mnist", REAL_DATA)


# ----------------------------------------------------------------------------- the unpacked cache

def test_a_second_load_reads_the_kept_arrays_not_the_sources(tmp_path, monkeypatch):
    arrays = write_idx_dataset(tmp_path / "data" / "fashion-mnist", **TINY, seed=3)
    check_mnist_like(load("fashion_mnist", tmp_path / "data"), arrays, "fashion_mnist")
    kept = list((tmp_path / "cache" / "unpacked").iterdir())
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == [
        "class_names.txt", "sources.json", "x_test.npy", "x_train.npy", "y_test.npy", "y_train.npy"]

    def unpack(*_):
        raise AssertionError("the sources were read again")

    monkeypatch.setattr(datasets, "_read", unpack)
    ds = load("fashion_mnist", tmp_path / "data")
    check_mnist_like(ds, arrays, "fashion_mnist")
    assert ds.class_names[9] == "Ankle boot"


def test_a_changed_source_is_read_and_checked_again(tmp_path):
    folder = tmp_path / "data" / "mnist"
    write_idx_dataset(folder, **TINY, seed=4)
    load("mnist", tmp_path / "data")
    changed = write_idx_dataset(folder, n_train=14, n_test=5, seed=5)  # other images, other size
    check_mnist_like(load("mnist", tmp_path / "data"), changed, "mnist")
    (folder / IDX_FILES[1]).write_bytes(b"not gzip at all")
    with pytest.raises(MeshfitError, match="corrupt or truncated"):
        load("mnist", tmp_path / "data")


def test_a_cut_entry_or_an_unwritable_cache_falls_back_to_the_sources(tmp_path, monkeypatch):
    arrays = write_idx_dataset(tmp_path / "data" / "mnist", **TINY, seed=6)
    load("mnist", tmp_path / "data")
    (entry,) = (tmp_path / "cache" / "unpacked").iterdir()
    (entry / "x_train.npy").write_bytes(b"\x93NUMPY cut short")
    check_mnist_like(load("mnist", tmp_path / "data"), arrays, "mnist")
    monkeypatch.setenv("MESHFIT_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a folder")
    check_mnist_like(load("mnist", tmp_path / "data"), arrays, "mnist")


def test_writing_an_entry_removes_those_whose_sources_are_gone_or_changed(tmp_path, monkeypatch):
    unpacked = tmp_path / "cache" / "unpacked"
    for copy in "abc":
        write_idx_dataset(tmp_path / copy / "mnist", **TINY, seed=7)
        load("mnist", tmp_path / copy)
    assert len(list(unpacked.iterdir())) == 3  # a copy elsewhere is another entry
    shutil.rmtree(tmp_path / "a")
    write_idx_dataset(tmp_path / "b" / "mnist", n_train=14, n_test=5, seed=8)
    (unpacked / "mnist-of-format-1").mkdir()  # no sources.json: never read again
    (unpacked / ".tmp-of-a-writer-that-died").mkdir()
    os.utime(unpacked / ".tmp-of-a-writer-that-died", (0, 0))
    (unpacked / ".tmp-of-a-writer-at-work").mkdir()
    arrays = write_idx_dataset(tmp_path / "d" / "mnist", **TINY, seed=9)
    check_mnist_like(load("mnist", tmp_path / "d"), arrays, "mnist")
    kept = sorted(p.name for p in unpacked.iterdir())
    assert len(kept) == 3 and kept[0] == ".tmp-of-a-writer-at-work"  # and c's and d's entries
    monkeypatch.setattr(datasets, "_read", None)  # c and d are read from their kept entries
    for copy in "cd":
        load("mnist", tmp_path / copy)


def test_cifar_class_names_come_back_from_the_kept_entry(tmp_path, monkeypatch):
    names = [f"class {i}" for i in range(10)]
    make_cifar(tmp_path / "data" / "cifar10" / datasets.CIFAR_DIR, label_names=names)
    first = load("cifar10", tmp_path / "data")
    monkeypatch.setattr(datasets, "_read", None)  # a second read of the sources would fail
    again = load("cifar10", tmp_path / "data")
    assert again.class_names == first.class_names == tuple(names)
    np.testing.assert_array_equal(again.x_train, first.x_train)
    np.testing.assert_array_equal(again.y_test, first.y_test)
