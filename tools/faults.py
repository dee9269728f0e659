"""Fault harness: bad input, kills and failing storage against meshfit, counted in one table.

    python tools/faults.py [--kills 50] [--seed 0] [--work DIR] [--only inputs,kills,faults] [--no-mount]
                           [--sharded]

Runs in this one process, on tiny generated datasets (MESHFIT_OFFLINE=1, a private HOME), in
about 10 minutes on 2 CPU cores (the tmpfs cases need root and a container that allows mount;
elsewhere, or with --no-mount, RLIMIT_FSIZE stands in for the full disk):
  inputs  >= 150 bad inputs: every loader (IDX files, CIFAR-10 pickles, image files and folders;
          truncations, byte flips, header mutations, malicious pickles that would create a canary
          file, decompression bombs), every command's arguments (zero, negative, huge, not a
          number, missing paths, files, unwritable places, foreign run directories) and hostile
          model files (Lambda layers, a config naming os.system, HDF5 named .keras). Commands run
          in this process through meshfit.cli.main; each must give exit code 2 and one line on
          stderr (a mutated file that is still valid may load: counted as "accepted").
  kills   SIGKILLs at random moments of a tiny run with --checkpoint-every 1 (some aimed at
          checkpoint saves), each killed run resumed (and maybe killed again), plus SIGTERM then
          SIGINT within 50 ms; every chain must end bit-identical to an uninterrupted run.
  faults  a full file system (a tiny tmpfs, else RLIMIT_FSIZE), a read-only --out, renames that
          fail, truncated and bit-flipped newest checkpoints, two --resume at once.
Prints a table (one row per group: cases, as expected, failures, tracebacks, hangs, canaries) and
one summary line; exits 1 when anything failed. Not a test: run it by hand after changing how
meshfit reads files or writes checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# meshfit's commands run in this process, one after another, so TensorFlow is already loaded when
# most start: give it the oneDNN setting meshfit's engine would (see meshfit.parallel.engine.ONEDNN)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from helpers import drop_state_field, write_idx_dataset  # noqa: E402

from meshfit.data import datasets, file_formats  # noqa: E402
from meshfit.errors import MeshfitError  # noqa: E402

NOISE = ("WARNING: All log messages before absl", "I0000", "W0000", "E0000")
EPOCHS, BATCH = 2, 16  # 128 images: 8 steps per epoch, 16 checkpoints with --checkpoint-every 1
HANG_SECONDS = 120


@dataclass
class Group:
    """Counts of one kind of fault."""

    name: str
    cases: int = 0
    expected: int = 0
    accepted: int = 0
    tracebacks: int = 0
    hangs: int = 0
    canaries: int = 0
    notes: str = ""
    failures: list[str] = field(default_factory=list)

    def fail(self, case: str, why: str) -> None:
        self.failures.append(f"{case}: {why}")


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def meaningful(stderr: str) -> list[str]:
    """stderr's lines without TensorFlow's and absl's start-up logging."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(NOISE)]


class Harness:
    def __init__(self, work: str, seed: int, sharded: bool = False):
        self.work, self.rng = work, random.Random(seed)
        # --sharded: runs on 8 simulated JAX devices with fsdp, checkpointed by orbax (format 3)
        self.sharded_args = ["--engine", "jax", "--simulate-devices", "8", "--sharding", "fsdp",
                             "--fsdp-min-bytes", "10KB"] if sharded else []
        self.canary = os.path.join(work, "CANARY")
        self.env = {"MESHFIT_OFFLINE": "1", "HOME": work, "MESHFIT_CACHE": os.path.join(work, "cache"),
                    "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
        os.environ.update(self.env)
        for key in ("MESHFIT_DATA", "KERAS_BACKEND", "MESHFIT_ENGINE", "MESHFIT_SIMULATE_DEVICES",
                    "XLA_FLAGS"):
            os.environ.pop(key, None)
        # Children get this environment, not what commands run in this process set later (the
        # engine's TensorFlow settings would change their kernels, so their weights).
        self.child_env = dict(os.environ)
        self.data = os.path.join(work, "data")
        write_idx_dataset(os.path.join(self.data, "fashion-mnist"))
        self.groups: list[Group] = []

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    # ------------------------------------------------------------------------------ running

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """`python -m meshfit args` in a child process."""
        return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True,
                              text=True, timeout=timeout, env=self.child_env)

    def spawn(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "meshfit", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.child_env)

    def check(self, group: Group, case: str, call, may_pass: bool = False) -> None:
        """Run `call` (returns (exit code, stderr)); count its outcome against a one-line error."""
        group.cases += 1
        if os.path.exists(self.canary):
            os.remove(self.canary)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(HANG_SECONDS)
        try:
            code, stderr = call()
        except Hang:
            group.hangs += 1
            group.fail(case, f"no answer in {HANG_SECONDS} s")
            return
        except BaseException as e:  # anything but a MeshfitError escaping is a traceback
            group.tracebacks += 1
            group.fail(case, f"{type(e).__name__}: {str(e)[:200]}")
            return
        finally:
            signal.alarm(0)
        if os.path.exists(self.canary):
            group.canaries += 1
            group.fail(case, "the canary file was created")
        lines = meaningful(stderr)
        if "Traceback" in stderr:
            group.tracebacks += 1
            group.fail(case, "traceback: " + " | ".join(lines[-3:]))
        elif code == 2 and len(lines) == 1 and lines[0].startswith("meshfit: error: "):
            group.expected += 1
        elif code == 0 and may_pass:
            group.accepted += 1
        else:
            group.fail(case, f"exit code {code}, stderr: " + " | ".join(lines[-4:]))

    def main(self, *args: str):
        """A closure running meshfit.cli.main(args) in this process: (exit code, stderr)."""
        def call():
            from meshfit.cli import main

            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = main(list(args))
                except SystemExit as e:  # argparse
                    code = e.code
            return code, err.getvalue()
        return call

    @staticmethod
    def function(fn, *args, must_warn: bool = False, **kwargs):
        """A closure calling a library function: a one-line MeshfitError counts as exit code 2;
        with must_warn, returning without a warning counts as exit code 1 (a silent acceptance)."""
        def call():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fn(*args, **kwargs)
                except MeshfitError as e:
                    return 2, f"meshfit: error: {e}\n"
            said = "".join(f"meshfit: warning: {w.message}\n" for w in caught if w.category is UserWarning)
            return (1 if must_warn and not said else 0), said
        return call

    def train_args(self, out: str, *more: str) -> list[str]:
        return ["train", "--epochs", str(EPOCHS), "--global-batch", str(BATCH), "--data-dir",
                self.data, "--out", out, "--checkpoint-every", "1", "--no-tensorboard",
                *self.sharded_args, *more]

    # ------------------------------------------------------------------------------ bad inputs

    def mutations(self, data: bytes, flips: int) -> list[tuple[str, bytes]]:
        """Truncations and byte flips of a file's bytes."""
        n = len(data)
        out = [(f"truncated to {k} bytes", data[:k]) for k in
               sorted({0, 1, 3, 10, n // 4, n // 2, n - 9, n - 4, n - 1})]
        for _ in range(flips):
            at = self.rng.randrange(n)
            out.append((f"byte {at} flipped", data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]))
        return out

    def idx_cases(self, group: Group, run: str) -> None:
        folder = os.path.join(self.data, "fashion-mnist")
        for name in (datasets.IDX_FILES[0], datasets.IDX_FILES[1], datasets.IDX_FILES[3]):
            original = open(os.path.join(folder, name), "rb").read()
            raw = gzip.decompress(original)
            ndim = raw[3]
            cases = self.mutations(original, 8)
            header = [("magic 0x0801", b"\0\0\x08\x01"), ("magic 0x0d03", b"\0\0\x0d\x03"),
                      ("magic ffff", b"\xff\xff\xff\xff"), ("ndim 9", raw[:3] + b"\x09")]
            cases += [(what, gzip.compress(magic + raw[4:])) for what, magic in header if magic != raw[:4]]
            for dim in range(ndim):
                for value in (0, 1, 27, 0xFFFFFFFF, 0x7FFFFFFF):
                    mutated = bytearray(raw)
                    mutated[4 + 4 * dim:8 + 4 * dim] = value.to_bytes(4, "big")
                    cases.append((f"dimension {dim} = {value}", gzip.compress(bytes(mutated))))
            cases += [("extra data after the images", gzip.compress(raw + b"\x01" * 1000)),
                      ("not gzip", raw), ("two gzip members", original + original)]
            if ndim == 1:
                cases.append(("label 200", gzip.compress(raw[:8] + b"\xc8" + raw[9:])))
            for what, data in cases:
                bad = self.path("idx", f"{name}-{len(group.failures)}-{group.cases}")
                shutil.copytree(folder, os.path.join(bad, "fashion-mnist"))
                with open(os.path.join(bad, "fashion-mnist", name), "wb") as f:
                    f.write(data)
                self.check(group, f"eval with {name} {what}", self.main("eval", run, "--data-dir", bad),
                           may_pass=what.startswith("byte"))
                shutil.rmtree(bad)
        self.check(group, "IDX decompression bomb (header claims 40 GB)",
                   self.function(datasets.load, "fashion_mnist", self.bomb(0xFFFFFFFF), download=False))
        self.check(group, "IDX decompression bomb (1 GB of images after a small header)",
                   self.function(datasets.load, "fashion_mnist", self.bomb(128), download=False))

    def bomb(self, count: int) -> str:
        """A data folder whose train images are 1 GB of zeros gzipped to about 1 MB."""
        root = self.path("bomb", str(count))
        shutil.copytree(os.path.join(self.data, "fashion-mnist"), os.path.join(root, "fashion-mnist"))
        pack = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        parts = [pack.compress(b"\0\0\x08\x03" + count.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)]
        zeros = bytes(1 << 24)
        parts += [pack.compress(zeros) for _ in range(64)] + [pack.flush()]
        with open(os.path.join(root, "fashion-mnist", datasets.IDX_FILES[0]), "wb") as f:
            f.write(b"".join(parts))
        return root

    def cifar_cases(self, group: Group) -> None:
        good = self.path("cifar", "good")
        os.makedirs(good)
        rng = np.random.default_rng(0)
        for name in datasets.CIFAR_FILES:
            file_formats.write_cifar_batch(os.path.join(good, name), rng.integers(0, 256, (20, 32, 32, 3)),
                                       rng.integers(0, 10, 20), datasets.CLASS_NAMES["cifar10"])
        canary = self.canary

        class Reduce:
            def __init__(self, fn, args):
                self.fn, self.args = fn, args

            def __reduce__(self):
                return self.fn, self.args

        evil = [("os.system", Reduce(os.system, (f"touch {canary}",))),
                ("builtins.exec", Reduce(exec, (f"open({canary!r}, 'w')",))),
                ("builtins.eval", Reduce(eval, (f"open({canary!r}, 'w')",))),
                ("builtins.open", Reduce(open, (canary, "w"))),
                ("subprocess.Popen", Reduce(subprocess.Popen, (["touch", canary],))),
                ("shutil.copy", Reduce(shutil.copy, (__file__, canary))),
                ("numpy.save", Reduce(np.save, (canary, np.zeros(1)))),
                ("os.system inside the batch", {b"data": Reduce(os.system, (f"touch {canary}",)), b"labels": [0]})]
        batch = pickle.load(open(os.path.join(good, "data_batch_1"), "rb"), encoding="bytes")
        odd = [("labels 2**70", {**batch, b"labels": [2 ** 70] * 20}),
               ("labels -1", {**batch, b"labels": [-1] * 20}),
               ("label 10", {**batch, b"labels": [10] * 20}),
               ("labels text", {**batch, b"labels": ["a"] * 20}),
               ("labels missing", {b"data": batch[b"data"]}),
               ("19 labels", {**batch, b"labels": [0] * 19}),
               ("data float", {**batch, b"data": batch[b"data"].astype(np.float32)}),
               ("data 3071 wide", {**batch, b"data": batch[b"data"][:, :3071]}),
               ("data 1-D", {**batch, b"data": batch[b"data"].reshape(-1)}),
               ("data a list", {**batch, b"data": [1, 2, 3]}),
               ("not a dict", [1, 2, 3]), ("None", None)]
        data = open(os.path.join(good, "data_batch_1"), "rb").read()
        cases = [(what, pickle.dumps(obj, protocol=2)) for what, obj in evil + odd]
        cases += self.mutations(data, 10)
        meta = [("meta names 2**70", {b"label_names": [2 ** 70]}), ("meta names empty", {b"label_names": []}),
                ("meta os.system", Reduce(os.system, (f"touch {canary}",)))]
        for i, (what, data) in enumerate(cases + [(w, pickle.dumps(o, protocol=2)) for w, o in meta]):
            bad = self.path("cifar", str(i), "cifar10", datasets.CIFAR_DIR)
            shutil.copytree(good, bad)
            target = "batches.meta" if what.startswith("meta") else "data_batch_1"
            with open(os.path.join(bad, target), "wb") as f:
                f.write(data)
            self.check(group, f"CIFAR-10 {target} {what}",
                       self.function(datasets.load, "cifar10", self.path("cifar", str(i)), download=False),
                       may_pass=what.startswith("byte"))
            shutil.rmtree(self.path("cifar", str(i)))

    def image_cases(self, group: Group, run: str) -> None:
        from PIL import Image

        folder = self.path("images")
        os.makedirs(folder)
        png, jpg = os.path.join(folder, "good.png"), os.path.join(folder, "good.jpg")
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28, 3), np.uint8)).save(png)
        Image.fromarray(np.random.default_rng(1).integers(0, 256, (28, 28, 3), np.uint8)).save(jpg)
        cases = []
        for source in (png, jpg):
            original = open(source, "rb").read()
            for what, data in self.mutations(original, 4):
                path = os.path.join(folder, f"{len(cases)}{os.path.splitext(source)[1]}")
                open(path, "wb").write(data)
                # a flip, or a cut into a PNG's last chunk (IEND, 12 bytes), may leave all pixels
                cases.append((f"{os.path.basename(source)} {what}", path,
                              what.startswith("byte") or (source == png and len(data) >= len(original) - 12)))
        text = os.path.join(folder, "text.png")
        open(text, "w").write("not an image\n")
        bomb = os.path.join(folder, "bomb.png")
        Image.new("1", (40000, 40000)).save(bomb)  # 1.6 G pixels in a few hundred KB
        os.makedirs(os.path.join(folder, "dir.png"))
        cases += [("a text file named .png", text, False), ("a 40000x40000 PNG", bomb, False),
                  ("a folder named .png", os.path.join(folder, "dir.png"), False),
                  ("a missing file", os.path.join(folder, "missing.png"), False),
                  ("/dev/null", "/dev/null", False)]
        for what, path, may_pass in cases:
            self.check(group, f"predict {what}", self.main("predict", run, path), may_pass=may_pass)
        # image folders (datasets.image_folder, the loader of a user's own images)
        tree = self.path("folders")
        for cls in ("a", "b"):
            os.makedirs(os.path.join(tree, "good", cls))
            for i in range(3):
                shutil.copy(png, os.path.join(tree, "good", cls, f"{i}.png"))
        def variant(name, change):
            shutil.copytree(os.path.join(tree, "good"), os.path.join(tree, name))
            change(os.path.join(tree, name))
            return os.path.join(tree, name)
        # (what, folder, skipped: the bad file may be skipped with a warning, as documented)
        folders = [
            ("no class folders", variant("flat", lambda p: [shutil.rmtree(os.path.join(p, c)) for c in "ab"]), False),
            ("an empty class", variant("empty", lambda p: [os.remove(os.path.join(p, "b", f))
                                                           for f in os.listdir(os.path.join(p, "b"))]), False),
            ("one class", variant("single", lambda p: shutil.rmtree(os.path.join(p, "b"))), False),
            ("a text file as .png", variant("text", lambda p: shutil.copy(text, os.path.join(p, "a", "9.png"))), True),
            ("a truncated png", variant("cut", lambda p: open(os.path.join(p, "a", "9.png"), "wb")
                                        .write(open(png, "rb").read()[:40])), True),
            ("a 40000x40000 png", variant("bomb", lambda p: shutil.copy(bomb, os.path.join(p, "a", "9.png"))), True),
            ("a missing folder", os.path.join(tree, "missing"), False),
            ("a file", png, False)]
        for what, path, skipped in folders:
            self.check(group, f"image folder with {what}",
                       self.function(datasets.image_folder, path, (28, 28), must_warn=skipped), may_pass=skipped)
        good = os.path.join(tree, "good")
        for what, kwargs in (("image_size 0x0", {"image_size": (0, 0)}),
                             ("image_size -1", {"image_size": (-1, 28)}),
                             ("image_size of 3", {"image_size": (28, 28, 3)}),
                             ("validation_split 1", {"image_size": (28, 28), "validation_split": 1.0}),
                             ("validation_split -0.5", {"image_size": (28, 28), "validation_split": -0.5}),
                             ("channels 2", {"image_size": (28, 28), "channels": 2})):
            self.check(group, f"image folder with {what}", self.function(datasets.image_folder, good, **kwargs))

    def model_cases(self, group: Group, run: str) -> None:
        """Hostile and broken model files for predict, eval and export."""
        import zipfile

        folder = self.path("models")
        os.makedirs(folder)
        script = f"""
import json, zipfile, keras
m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                      keras.layers.Lambda(lambda x: x * 2), keras.layers.Dense(10, activation="softmax")])
m.save({os.path.join(folder, 'lambda.keras')!r})
"""
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       env={**self.child_env, "KERAS_BACKEND": "tensorflow"})
        source = os.path.join(run, "model.keras")
        with zipfile.ZipFile(source) as z:
            files = {n: z.read(n) for n in z.namelist()}
        config = json.loads(files["config.json"])
        layer = config["config"]["layers"][1]
        layer.update(module="os", class_name="system", registered_name=None,
                     config={"command": f"touch {self.canary}"})
        hostile = {"os.system config": json.dumps(config),
                   "builtins.exec config": files["config.json"].decode().replace(
                       '"module": "keras.layers"', '"module": "builtins"', 1).replace(
                       '"class_name": "Conv2D"', '"class_name": "exec"', 1),
                   "config not JSON": "{not json", "config a list": "[]"}
        paths = {"Lambda layer": os.path.join(folder, "lambda.keras")}
        for what, text in hostile.items():
            path = os.path.join(folder, what.replace(" ", "-").replace(".", "-") + ".keras")
            with zipfile.ZipFile(path, "w") as z:
                for name, data in files.items():
                    z.writestr(name, text if name == "config.json" else data)
            paths[what] = path
        import h5py

        with h5py.File(os.path.join(folder, "h5.keras"), "w") as f:
            f["weights"] = np.zeros(3)
        paths["HDF5 named .keras"] = os.path.join(folder, "h5.keras")
        open(os.path.join(folder, "garbage.keras"), "wb").write(os.urandom(3000))
        paths["random bytes"] = os.path.join(folder, "garbage.keras")
        open(os.path.join(folder, "empty.keras"), "wb").close()
        paths["empty file"] = os.path.join(folder, "empty.keras")
        open(os.path.join(folder, "garbage.onnx"), "wb").write(os.urandom(3000))
        image = os.path.join(self.work, "images", "good.png")
        for what, path in paths.items():
            self.check(group, f"predict a .keras: {what}", self.main("predict", path, image))
            self.check(group, f"export a .keras: {what}", self.main("export", path, "--out",
                                                                     os.path.join(folder, "x.onnx")))
        for what in ("Lambda layer", "os.system config", "HDF5 named .keras"):  # as a run's model
            fake = self.path("fake-run-" + what.replace(" ", "-").replace(".", ""))
            shutil.copytree(run, fake, ignore=shutil.ignore_patterns("model.onnx", "checkpoints"))
            shutil.copy(paths[what], os.path.join(fake, "model.keras"))
            self.check(group, f"eval a run whose model is: {what}", self.main("eval", fake))
        self.check(group, "predict garbage .onnx", self.main("predict", os.path.join(folder, "garbage.onnx"), image))
        mine = self.path("own")
        os.makedirs(mine)
        shutil.copy(source, os.path.join(mine, "net.keras"))
        open(os.path.join(mine, "net.onnx"), "wb").write(b"the user's own onnx")
        self.check(group, "export over a user's own X.onnx", self.main("export", os.path.join(mine, "net.keras")))
        if open(os.path.join(mine, "net.onnx"), "rb").read() != b"the user's own onnx":
            group.fail("predict/export beside a user's X.onnx", "the user's file was overwritten")

    def argument_cases(self, group: Group, run: str) -> None:
        bad_numbers = ("0", "-1", "abc", "1.5", "")
        out = self.path("args-out")
        file = self.path("a-file.txt")
        open(file, "w").write("mine")
        foreign = self.path("foreign")
        os.makedirs(foreign, exist_ok=True)
        open(os.path.join(foreign, "notes.txt"), "w").write("mine")
        foreign_run = self.path("foreign-run")
        os.makedirs(foreign_run, exist_ok=True)
        open(os.path.join(foreign_run, "config.json"), "w").write('{"recipe": "x"}')
        cases = []
        for flag in ("--epochs", "--global-batch", "--keep-checkpoints", "--log-every",
                     "--steps-per-dispatch", "--micro-batches", "--simulate-devices"):
            cases += [(["train", flag, v, "--out", out, "--data-dir", self.data], False) for v in bad_numbers]
        huge = [("--global-batch", str(10 ** 12)), ("--steps-per-dispatch", str(10 ** 9)),
                ("--micro-batches", str(10 ** 9)), ("--seed", str(2 ** 70)), ("--seed", "-1"),
                ("--simulate-devices", str(10 ** 6)), ("--checkpoint-every", "0"),
                ("--checkpoint-every", "-5"), ("--checkpoint-every", "abc"), ("--checkpoint-every", "1e999"),
                ("--checkpoint-every", "5x"), ("--profile", "a:b"), ("--profile", "5:2"),
                ("--profile", "-1:3"), ("--precision", "float8"), ("--engine", "torch"),
                ("--data-dir", self.path("missing")), ("--data-dir", file), ("--out", file),
                ("--out", foreign), ("--out", "/proc/meshfit-run"), ("--resume", self.path("missing")),
                ("--resume", file), ("--resume", foreign), ("--resume", foreign_run),
                ("--resume", os.path.join(run, "checkpoints", "ckpt-99")), ("--require", "tpu")]
        cases += [(["train", flag, v, "--out", out, "--data-dir", self.data], False) for flag, v in huge]
        cases += [(["train", "no-such-recipe", "--out", out], False),
                  (["train", "--resume", run, "--global-batch", "7"], False),
                  (["train", "--resume", run, "--seed", "5"], False),
                  (["train", "--resume", run, "--recipe-typo"], False)]
        image = os.path.join(self.work, "images", "good.png")
        for flag in ("--top-k", "--threads", "--benchmark"):
            cases += [(["predict", run, image, flag, v], False) for v in bad_numbers]
        cases += [(["predict", run, image, "--top-k", str(10 ** 9)], False),
                  (["predict", run, image, "--show", self.path("out.txt")], False),
                  (["predict", run, image, "--show", "/proc/x.png"], False),
                  (["predict", run, image, "--backend", "gpu"], False),
                  (["predict", run], False), (["predict", self.path("missing"), image], False),
                  (["predict", file, image], False), (["predict", foreign, image], False),
                  (["eval", self.path("missing")], False), (["eval", file], False),
                  (["eval", foreign], False), (["eval", foreign_run], False),
                  (["eval", run, "--data-dir", self.path("missing")], False),
                  (["export", self.path("missing")], False), (["export", file], False),
                  (["export", run, "--format", "pt"], False),
                  (["export", run, "--out", self.path("x.txt")], False),
                  (["export", run, "--format", "keras", "--out", os.path.join(run, "model.keras")], False),
                  (["export", run, "--out", "/proc/x.onnx"], False),
                  (["info", "--simulate-devices", "0"], False), (["info", "--precision", "x"], False),
                  (["info", "--engine", "x"], False), (["info", "--require", "tpu"], False)]
        for flag in ("--global-batches", "--steps-per-dispatch"):
            cases += [(["bench", flag, v], False) for v in ("0", "-1", "abc", ",")]
        cases += [(["bench", flag, v], False) for flag in ("--rounds", "--repeats", "--steps")
                  for v in ("0", "-1", "abc")]
        cases += [(["bench", "--engines", "torch"], False), (["bench", "--precisions", "float8"], False),
                  (["bench", "no-such-recipe"], False), (["runs", "--plot", self.path("x.txt")], False),
                  (["launch", "--processes", "0", "--", "meshfit", "info"], False),
                  (["launch", "--processes", "-1", "--", "meshfit", "info"], False),
                  (["launch", "--processes", "abc", "--", "meshfit", "info"], False),
                  (["launch", "--processes", "2"], False), (["no-such-command"], False)]
        for argv, may_pass in cases:
            self.check(group, "meshfit " + " ".join(argv), self.main(*argv), may_pass=may_pass)
            for leftover in (out, self.path("x.onnx")):
                if os.path.isdir(leftover) and not os.path.isfile(os.path.join(leftover, "config.json")):
                    shutil.rmtree(leftover)
        if open(file).read() != "mine" or os.listdir(foreign) != ["notes.txt"]:
            group.fail("arguments", "a user's file was changed")

    # ------------------------------------------------------------------------------ kills

    def final_state(self, run: str) -> tuple[dict, list]:
        from meshfit.run import checkpoint_format

        newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
        history = json.load(open(os.path.join(run, "history.json")))
        return checkpoint_format.read_arrays(newest), [
            {k: r.get(k) for k in ("loss", "accuracy", "val_loss", "val_accuracy")} for r in history]

    def same(self, run: str, reference) -> str | None:
        """None when `run` ended bit-identical to the reference run, else what differs."""
        try:
            arrays, history = self.final_state(run)
        except Exception as e:  # a run that did not finish
            return f"no final state ({type(e).__name__}: {e})"
        if sorted(arrays) != sorted(reference[0]):
            return "other variables"
        differ = [k for k in arrays if not np.array_equal(arrays[k], reference[0][k])]
        if differ:
            return f"arrays differ: {differ[:4]}"
        return None if history == reference[1] else "history differs"

    def start_or_resume(self, run: str) -> list[str]:
        if os.path.isfile(os.path.join(run, "config.json")):
            return ["train", "--resume", run]
        return self.train_args(run)

    def kill_at_random(self, argv: list[str], run: str, mode: str, horizon: float) -> str:
        """Start meshfit with argv and SIGKILL it: at a random moment of its life (mode
        "anywhere"), of its training (mode "training": after it wrote config.json, within the
        reference run's training time) or as a checkpoint save begins (mode "save"); wait."""
        from meshfit.run import rundir

        started = time.time()
        process = self.spawn(*argv)
        config = os.path.join(run, "config.json")
        if mode != "anywhere":  # wait for training to begin
            while process.poll() is None and not (os.path.isfile(config) and
                                                  os.path.getmtime(config) >= started - 1):
                time.sleep(0.005)
        deadline = time.monotonic() + self.rng.uniform(0 if mode != "anywhere" else 0.2,
                                                       self.train_span if mode != "anywhere" else horizon)
        what = "random moment"
        checkpoints_dir = os.path.join(run, "checkpoints")
        while process.poll() is None and time.monotonic() < deadline + (30 if mode == "save" else 0):
            if mode == "save" and time.monotonic() >= deadline and os.path.isdir(checkpoints_dir):
                if any(not rundir.checkpoint_complete(os.path.join(checkpoints_dir, n))
                       for n in os.listdir(checkpoints_dir) if n.startswith("ckpt-")):
                    what = "during a save"
                    break
            time.sleep(0.0005 if mode == "save" else 0.005)
        if process.poll() is None:
            process.kill()
        out, err = process.communicate()
        if process.returncode not in (0, -signal.SIGKILL) or "Traceback" in err:
            return f"unexpected exit {process.returncode}: " + " | ".join(meaningful(err)[-3:])
        return what if process.returncode == -signal.SIGKILL else "finished first"

    def step_of(self, run: str) -> int:
        """The global step of the run's newest checkpoint (-1: none)."""
        from meshfit.run import checkpoint_format

        newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
        return int(os.path.basename(newest)[5:]) if newest else -1

    def kills(self, count: int, reference, horizon: float) -> Group:
        """`count` SIGKILLs of runs that are not finished: a run is resumed (and killed again)
        until it finishes, then compared with the reference and a new one started."""
        group = Group("kills (SIGKILL, SIGTERM+SIGINT)")
        moments = {"during a save": 0, "in training": 0, "at start-up": 0}
        runs, run = 0, self.path("kills", "0")
        for k in range(count):
            group.cases += 1
            before = self.step_of(run)
            what = self.kill_at_random(self.start_or_resume(run), run,
                                       ("anywhere", "training", "save")[k % 3], horizon)
            if what.startswith("unexpected"):
                group.tracebacks += "Traceback" in what
                group.fail(f"kill {k} of {run}", what)
                continue
            group.expected += 1
            if what == "random moment":
                what = "in training" if self.step_of(run) != before else "at start-up"
            moments[what] = moments.get(what, 0) + 1
            if os.path.isfile(os.path.join(run, "metrics.json")) or k == count - 1:
                group.cases += 1  # the run finished (or, after the last kill, is finished now)
                done = self.cli(*self.start_or_resume(run))
                why = self.same(run, reference) if done.returncode == 0 else \
                    " | ".join(meaningful(done.stderr)[-3:])
                if why:
                    group.fail(f"{run} after its kills", why)
                else:
                    group.expected += 1
                runs += 1
                run = self.path("kills", str(runs))
        for i in range(3):  # SIGTERM, then SIGINT within 50 ms
            group.cases += 1
            run = self.path("term-int", str(i))
            process = self.spawn(*self.train_args(run))
            while process.poll() is None and self.step_of(run) < 0:  # training has begun
                time.sleep(0.01)
            time.sleep(self.rng.uniform(0, self.train_span))
            process.send_signal(signal.SIGTERM)
            time.sleep(self.rng.uniform(0, 0.05))
            process.send_signal(signal.SIGINT)
            _, err = process.communicate()
            # 143: stopped after saving; 130: the second signal cut it short; -15: the SIGTERM came
            # after training, when the default handler is back (a plain kill)
            if "Traceback" in err or process.returncode not in (0, 2, 130, 143, -signal.SIGTERM):
                group.tracebacks += "Traceback" in err
                group.fail(f"SIGTERM+SIGINT {i}", f"exit {process.returncode}: " + " | ".join(meaningful(err)[-3:]))
                continue
            done = self.cli(*self.start_or_resume(run))
            why = self.same(run, reference) if done.returncode == 0 else " | ".join(meaningful(done.stderr)[-2:])
            if why:
                group.fail(f"SIGTERM+SIGINT {i}", why)
            else:
                group.expected += 1
        group.notes = (f"{count} SIGKILLs (" + ", ".join(f"{n} {m}" for m, n in moments.items())
                       + f") in {runs} runs, each compared")
        return group

    # ------------------------------------------------------------------------------ faults

    def faults(self, reference, horizon: float, mount_allowed: bool = True) -> Group:
        group = Group("faults (storage)")

        def one_line(case, result, codes=(2,)):
            group.cases += 1
            lines = meaningful(result.stderr)
            if "Traceback" in result.stderr:
                group.tracebacks += 1
                group.fail(case, "traceback: " + " | ".join(lines[-3:]))
            elif result.returncode in codes and len(lines) == 1 and lines[0].startswith("meshfit: error: "):
                group.expected += 1
            else:
                group.fail(case, f"exit {result.returncode}: " + " | ".join(lines[-3:]))

        def identical(case, run):
            group.cases += 1
            done = self.cli(*self.start_or_resume(run))
            why = self.same(run, reference) if done.returncode == 0 else " | ".join(meaningful(done.stderr)[-2:])
            if why:
                group.fail(case, why)
            else:
                group.expected += 1

        # A full file system: a 3 MB tmpfs (about two checkpoints), then more room and --resume.
        mount = self.path("full")
        os.makedirs(mount)
        mounted = mount_allowed and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mount],
                                                   capture_output=True).returncode == 0
        group.notes = "full disk: a 3 MB tmpfs" if mounted else "full disk: RLIMIT_FSIZE of 1 MB (no tmpfs)"
        if mounted:
            try:
                run = os.path.join(mount, "run")
                one_line("disk full during training", self.cli(*self.train_args(run)))
                subprocess.run(["mount", "-o", "remount,size=64m", mount], check=True)
                identical("resume after the disk was full", run)
                shutil.copytree(run, self.path("full-copy"))
            finally:
                subprocess.run(["umount", "-l", mount])
        else:  # no tmpfs: a file-size limit makes writes past 1 MB fail with EFBIG
            import resource

            run = self.path("fsize", "run")
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731
            result = subprocess.run([sys.executable, "-m", "meshfit", *self.train_args(run)],
                                    capture_output=True, text=True, preexec_fn=limit,
                                    env=self.child_env)
            one_line("file size limit during training", result)
            identical("resume after the file size limit", run)
        # A read-only --out and a read-only run directory to resume.
        readonly = self.path("readonly")
        os.makedirs(readonly)
        if mount_allowed and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", readonly],
                                            capture_output=True).returncode == 0:
            try:
                one_line("read-only --out", self.cli(*self.train_args(os.path.join(readonly, "run"))))
            finally:
                subprocess.run(["umount", "-l", readonly])
        one_line("--out under /proc", self.cli(*self.train_args("/proc/meshfit-run")))
        # Renames that fail: every os.replace, or only the checkpoint's manifest commit.
        for what, test in (("every rename fails", "True"), ("the manifest rename fails", "'manifest' in b")):
            run = self.path("rename", what.replace(" ", "-"))
            code = ("import os, sys\nreal = os.replace\n"
                    "def replace(a, b, *k, **kw):\n"
                    f"    if {test}:\n        raise OSError(1, 'Operation not permitted')\n"
                    "    return real(a, b, *k, **kw)\n"
                    "os.replace = replace\nfrom meshfit.cli import main\n"
                    f"sys.exit(main({self.train_args(run)!r}))\n")
            one_line(f"{what}", subprocess.run([sys.executable, "-c", code], capture_output=True,
                                               text=True, env=self.child_env))
            identical(f"resume after {what}", run)
        # A damaged newest checkpoint of a killed run: resumed from the previous one.
        from meshfit.run import checkpoint_format, rundir

        for damage in ("truncated arrays", "flipped arrays byte", "flipped state byte",
                       "truncated manifest", "state lacking a field", "deleted arrays"):
            run = self.path("damaged", damage.replace(" ", "-"))
            process = self.spawn(*self.train_args(run))
            while process.poll() is None and len(rundir.list_checkpoints(os.path.join(run, "checkpoints"))) < 3:
                time.sleep(0.01)
            process.kill()
            process.communicate()
            newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
            arrays, state = os.path.join(newest, "arrays.npz"), os.path.join(newest, "state.json")
            shards = [os.path.join(root, name) for root, _, names in
                      os.walk(os.path.join(newest, "arrays")) for name in names]
            if shards:  # format 3: damage the largest file orbax wrote, the weights' shards
                arrays = max(shards, key=os.path.getsize)
            if damage == "truncated arrays":
                os.truncate(arrays, os.path.getsize(arrays) // 2)
            elif damage.startswith("flipped"):
                path = arrays if "arrays" in damage else state
                data = bytearray(open(path, "rb").read())
                data[self.rng.randrange(len(data))] ^= 0x01
                open(path, "wb").write(bytes(data))
            elif damage == "truncated manifest":
                os.truncate(os.path.join(newest, "manifest.json"), 10)
            elif damage == "state lacking a field":  # rewritten with a matching manifest
                drop_state_field(newest, "steps_per_epoch")
            else:
                os.remove(arrays)
            identical(f"resume with a {damage} newest checkpoint", run)
        # Two --resume at once: one runs, the other says the run is in use (or finds it done).
        run = self.path("twice")
        process = self.spawn(*self.train_args(run))
        while process.poll() is None and not rundir.list_checkpoints(os.path.join(run, "checkpoints")):
            time.sleep(0.01)
        process.kill()
        process.communicate()
        both = [self.spawn("train", "--resume", run) for _ in range(2)]
        results = [(p.wait(), p.communicate()[1]) for p in both]
        group.cases += 1
        codes = sorted(code for code, _ in results)
        if any("Traceback" in err for _, err in results) or codes not in ([0, 0], [0, 2]):
            group.fail("two --resume at once", f"exit codes {codes}: " +
                       " | ".join(line for _, err in results for line in meaningful(err)[-2:]))
        else:
            group.expected += 1
            if (why := self.same(run, reference)) is not None:
                group.fail("two --resume at once", why)
        return group


def table(groups: list[Group]) -> str:
    header = ("group", "cases", "as expected", "accepted", "failures", "tracebacks", "hangs", "canaries")
    rows = [header] + [(g.name, g.cases, g.expected, g.accepted, len(g.failures), g.tracebacks, g.hangs,
                        g.canaries) for g in groups]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random moments and flips")
    parser.add_argument("--work", help="working folder (default: a temporary one, removed after)")
    parser.add_argument("--only", default="inputs,kills,faults", help="comma-separated groups to run")
    parser.add_argument("--no-mount", action="store_true",
                        help="mount no tmpfs (as where mount is refused): a file-size limit stands in")
    parser.add_argument("--sharded", action="store_true",
                        help="train on 8 simulated JAX devices with fsdp (orbax checkpoints, "
                             "written in the background) instead of TensorFlow on one CPU")
    args = parser.parse_args()
    only = set(args.only.split(","))
    work = args.work or tempfile.mkdtemp(prefix="meshfit-faults-")
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    harness = Harness(work, args.seed, args.sharded)
    groups: list[Group] = []
    try:
        reference = harness.path("reference")
        t0 = time.monotonic()
        done = harness.cli(*harness.train_args(reference))
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        horizon = time.monotonic() - t0  # kills land anywhere in an uninterrupted run's time
        harness.train_span = (os.path.getmtime(os.path.join(reference, "metrics.json")) -
                              os.path.getmtime(os.path.join(reference, "config.json")))
        expected = harness.final_state(reference)
        if "inputs" in only:
            for name, cases in (("IDX files", harness.idx_cases), ("CIFAR-10 pickles", harness.cifar_cases),
                                ("images and image folders", harness.image_cases),
                                ("model files", harness.model_cases),
                                ("command arguments", harness.argument_cases)):
                group = Group(f"bad input: {name}")
                cases(group, reference) if name != "CIFAR-10 pickles" else cases(group)
                groups.append(group)
                print(f"{group.name}: {group.cases} cases, {len(group.failures)} failures "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
        if "kills" in only:
            groups.append(harness.kills(args.kills, expected, horizon))
            print(f"kills: {groups[-1].notes} ({time.monotonic() - started:.0f} s)", flush=True)
        if "faults" in only:
            groups.append(harness.faults(expected, horizon, mount_allowed=not args.no_mount))
            print(f"faults: {groups[-1].notes} ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(groups))
    for group in groups:
        for failure in group.failures:
            print(f"FAIL {group.name}: {failure}")
    total = sum(g.cases for g in groups)
    failed = sum(len(g.failures) for g in groups)
    print(f"faults: {total} cases, {failed} failures, {sum(g.tracebacks for g in groups)} tracebacks, "
          f"{sum(g.hangs for g in groups)} hangs, {sum(g.canaries for g in groups)} canary files "
          f"in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
