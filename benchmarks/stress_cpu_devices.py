"""Stress: users' Keras programs on 8 simulated CPU devices on an oversubscribed machine, never an
abort or a hang.

Eight model families as keras.io writes them, each run in a fresh process with busy processes
beside it (`--busy` per core, default 2, spinning for the whole run), two ways:

- plain: the user's program with meshfit's two lines (`strategy = meshfit.connect(simulate_devices=8)`,
  build and compile inside `strategy.scope()`), then `model.fit` (2 epochs, validation_split),
  `model.evaluate` and `model.predict` on 3 samples;
- cli: the same model and data as a recipe file, `meshfit train FILE.py --simulate-devices 8`.

A run counts as an abort when it dies of a signal or prints XLA's "Termination timeout", as a
hang when it is stopped by meshfit's stall guard (exit 124, MESHFIT_STALL_TIMEOUT=--stall) or does
not end within --limit seconds. The plain runs' per-epoch losses are compared with the same
program on one device (run once per family, before the rounds): the largest relative difference
is printed. The families: cnn (Conv2D, BatchNormalization, Dropout), vit (keras-io's Vision
Transformer with its augmentation layers and Normalization.adapt; RandomRotation and RandomZoom
make Keras run it op by op, thousands of small programs a step), mixer (MLP-Mixer token mixing),
attention (a text transformer), rnn (an LSTM), train_step (a subclassed model with its own
stateless train_step), tfdata (a CNN fed by tf.data) and pydataset (an MLP fed by a PyDataset
with 2 workers).

    python benchmarks/stress_cpu_devices.py [--rounds 3] [--families cnn vit ...] [--routes plain cli]
    python benchmarks/stress_cpu_devices.py --cost [--rounds 5] [--baseline DIR]

--cost: the epoch time of the cnn family's plain program with meshfit's CPU-client pool against
XLA's own (PJRT_NPROC=8, the default on this 2-core machine; such a run may abort) and, with
--baseline DIR, against another checkout's meshfit (the commit before: XLA's pool and a wait
after every dispatch), alternating fresh processes, with the ratios. Results: BENCHMARKS.md,
section 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Family:
    code: str  # defines data(n, seed) -> (x, y), build_model() and, for some, fit_inputs()
    feed: str = "arrays"  # arrays, tfdata or pydataset: how plain fit is given the data


IMAGES = '''
def data(n, seed, size=16, channels=1):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n)
    x = rng.normal(255 * y[:, None, None, None] / 10, 60, (n, size, size, channels))
    return np.clip(x, 0, 255).round().astype("float32"), y
'''

TOKENS = '''
def data(n, seed, length=16, vocabulary=50):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(1, vocabulary // 2, (n, length)) + y[:, None] * rng.integers(0, vocabulary // 2, (n, length))
    return x.astype("int32"), y
'''

CNN = IMAGES + '''
def build_model():
    return keras.Sequential([
        keras.Input((16, 16, 1)), layers.Rescaling(1 / 255), layers.Conv2D(16, 3, activation="relu"),
        layers.BatchNormalization(), layers.MaxPooling2D(), layers.Conv2D(16, 3, activation="relu"),
        layers.Flatten(), layers.Dropout(0.3), layers.Dense(10, activation="softmax")])
'''

VIT = '''
def data(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n)
    x = rng.normal(255 * y[:, None, None, None] / 10, 60, (n, 32, 32, 3))
    return np.clip(x, 0, 255).round().astype("float32"), y


class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        shape = ops.shape(images)
        patches = ops.image.extract_patches(images, size=self.patch_size)
        count = (shape[1] // self.patch_size) * (shape[2] // self.patch_size)
        return ops.reshape(patches, (shape[0], count, self.patch_size * self.patch_size * shape[-1]))


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(projection_dim)
        self.position_embedding = layers.Embedding(num_patches, projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(0, self.num_patches, 1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


data_augmentation = keras.Sequential([
    layers.Normalization(), layers.Resizing(32, 32), layers.RandomFlip("horizontal"),
    layers.RandomRotation(factor=0.02), layers.RandomZoom(height_factor=0.2, width_factor=0.2)],
    name="data_augmentation")
data_augmentation.layers[0].adapt(data(64, 2)[0])


def build_model():  # keras-io's, smaller: 16 patches of 8x8, one transformer block
    inputs = keras.Input((32, 32, 3))
    patches = Patches(8)(data_augmentation(inputs))
    encoded = PatchEncoder(16, 32)(patches)
    for _ in range(1):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=2, key_dim=32, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = layers.Dense(64, activation=keras.activations.gelu)(x3)
        x3 = layers.Dropout(0.1)(layers.Dense(32, activation=keras.activations.gelu)(x3))
        encoded = layers.Add()([x3, x2])
    x = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(layers.Dropout(0.5)(x)))
'''

MIXER = IMAGES + '''
class MLPMixerLayer(layers.Layer):
    def __init__(self, num_patches, hidden_units, dropout_rate, **kwargs):
        super().__init__(**kwargs)
        self.mlp1 = keras.Sequential([layers.Dense(num_patches, activation="gelu"),
                                      layers.Dense(num_patches), layers.Dropout(dropout_rate)])
        self.mlp2 = keras.Sequential([layers.Dense(num_patches, activation="gelu"),
                                      layers.Dense(hidden_units), layers.Dropout(dropout_rate)])
        self.normalize = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        x = self.normalize(inputs)
        x_channels = ops.transpose(x, axes=(0, 2, 1))  # token mixing across patches
        x = ops.transpose(self.mlp1(x_channels), axes=(0, 2, 1)) + inputs
        return x + self.mlp2(self.normalize(x))


def build_model():
    inputs = keras.Input((16, 16, 1))
    x = layers.Rescaling(1 / 255)(inputs)
    patches = layers.Reshape((16, 16))(ops.image.extract_patches(x, size=4))
    x = layers.Dense(32)(patches)
    for _ in range(2):
        x = MLPMixerLayer(16, 32, 0.1)(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))
'''

ATTENTION = TOKENS + '''
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1, self.dropout2 = layers.Dropout(rate), layers.Dropout(rate)

    def call(self, inputs, training=None):
        out1 = self.layernorm1(inputs + self.dropout1(self.att(inputs, inputs), training=training))
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1), training=training))


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


def build_model():
    inputs = keras.Input((16,), dtype="int32")
    x = TransformerBlock(16, 2, 32)(TokenAndPositionEmbedding(16, 50, 16)(inputs))
    x = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x))
'''

RNN = TOKENS + '''
def build_model():
    return keras.Sequential([keras.Input((16,), dtype="int32"), layers.Embedding(50, 16),
                             layers.Bidirectional(layers.LSTM(16)), layers.Dense(2, activation="softmax")])
'''

TRAIN_STEP = IMAGES + '''
class CustomModel(keras.Model):
    """keras-io's customizing_what_happens_in_fit (JAX): a stateless train_step of its own."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(trainable):
            y_pred, non_trainable_updated = self.stateless_call(trainable, non_trainable, x, training=True)
            return self.compute_loss(x, y, y_pred), (y_pred, non_trainable_updated)

        (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        new_metrics, logs = [], {}
        for metric in self.metrics:
            count = len(metric.variables)
            values, metrics_variables = metrics_variables[:count], metrics_variables[count:]
            if metric.name == "loss":
                values = metric.stateless_update_state(values, loss)
            else:
                values = metric.stateless_update_state(values, y, y_pred)
            result = metric.stateless_result(values)
            logs.update(result if isinstance(result, dict) else {metric.name: result})
            new_metrics += values
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics)


def build_model():
    inputs = keras.Input((16, 16, 1))
    x = layers.Flatten()(layers.Rescaling(1 / 255)(inputs))
    x = layers.Dropout(0.2)(layers.Dense(32, activation="relu")(x))
    return CustomModel(inputs, layers.Dense(10, activation="softmax")(x))
'''

PYDATASET_MLP = IMAGES + '''
def build_model():
    return keras.Sequential([keras.Input((16, 16, 1)), layers.Rescaling(1 / 255), layers.Flatten(),
                             layers.Dense(64, activation="relu"), layers.Dense(10, activation="softmax")])
'''

FAMILIES = {
    "cnn": Family(CNN),
    "vit": Family(VIT),
    "mixer": Family(MIXER),
    "attention": Family(ATTENTION),
    "rnn": Family(RNN),
    "train_step": Family(TRAIN_STEP),
    "tfdata": Family(CNN, feed="tfdata"),
    "pydataset": Family(PYDATASET_MLP, feed="pydataset"),
}

SAMPLES, BATCH, EPOCHS = 200, 32, 2  # validation_split=0.2: 160 train (5 x 32), 40 val (32 + 8)

PREAMBLE = '''
import json, os, sys
import meshfit
strategy = meshfit.connect(simulate_devices=int(os.environ["DEVICES"]), engine="jax", verbose=False)
import jax
import keras
import numpy as np
from keras import layers, ops
keras.utils.set_random_seed(0)
'''

FEEDS = {
    "arrays": "history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=0.2, shuffle=False)",
    "tfdata": '''import tensorflow as tf
train = tf.data.Dataset.from_tensor_slices((x[:160], y[:160])).batch(BATCH)
validation = tf.data.Dataset.from_tensor_slices((x[160:], y[160:])).batch(BATCH)
history = model.fit(train, epochs=EPOCHS, validation_data=validation)''',
    "pydataset": '''class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__(workers=2)
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


history = model.fit(Batches(x[:160], y[:160]), epochs=EPOCHS, validation_data=Batches(x[160:], y[160:]))''',
}

PLAIN = PREAMBLE + '''
FAMILY
x, y = data(SAMPLES, 0)
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
FEED
model.evaluate(*data(35, 1))
assert model.predict(data(3, 1)[0]).shape[0] == 3
print("HISTORY", json.dumps(history.history), flush=True)
'''

RECIPE = '''"""NAME: a stress-harness recipe (benchmarks/stress_cpu_devices.py)."""
import jax
import keras
import numpy as np
from keras import layers, ops

import meshfit

FAMILY

SOURCE


def dataset(seed):
    return {"train": batches(SAMPLES, 0), "test": batches(35, 1), "class_names": [str(c) for c in range(10)]}


def optimizer(steps_per_epoch, epochs):
    return keras.optimizers.Adam()


RECIPE = meshfit.Recipe(name="NAME", dataset=dataset, build_model=lambda shape, classes: build_model(),
                        optimizer=optimizer, epochs=1)
'''


SOURCES = {  # a recipe file's batches(n, seed): the streamed source of each kind of feed
    "arrays": '''def batches(n, seed):
    def source():
        x, y = data(n, seed)
        for i in range(0, n, BATCH):
            yield x[i:i + BATCH], y[i:i + BATCH]
    return source''',
    "tfdata": '''def batches(n, seed):
    import tensorflow as tf
    return tf.data.Dataset.from_tensor_slices(data(n, seed)).batch(BATCH)''',
    "pydataset": '''def batches(n, seed):
    class Batches(keras.utils.PyDataset):
        def __init__(self, x, y):
            super().__init__(workers=2)
            self.x, self.y = x, y

        def __len__(self):
            return -(-len(self.x) // BATCH)

        def __getitem__(self, i):
            return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]

    return Batches(*data(n, seed))''',
}


def fill(template: str, name: str) -> str:
    family = FAMILIES[name]
    values = {"FAMILY": family.code, "FEED": FEEDS[family.feed], "SOURCE": SOURCES[family.feed],
              "NAME": name, "SAMPLES": str(SAMPLES),
              "BATCH": str(BATCH), "EPOCHS": str(EPOCHS)}
    for key, value in values.items():
        template = template.replace(key, value)
    return template


@dataclass
class Outcome:
    kind: str  # "ok", "abort", "hang" or "error"
    seconds: float
    losses: list[float] | None = None
    tail: str = ""


def run(argv: list[str], env: dict[str, str], limit: float) -> Outcome:
    """One fresh process: how it ended, its time, the losses it printed."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return Outcome("hang", time.monotonic() - start, tail="(killed at --limit)")
        log.seek(0)
        text = log.read()
    seconds = time.monotonic() - start
    if child.returncode < 0 or child.returncode == 134 or "Termination timeout" in text:
        kind = "abort"
    elif child.returncode == 124:
        kind = "hang"  # stopped by meshfit's stall guard
    elif child.returncode != 0:
        kind = "error"
    else:
        kind = "ok"
    losses = None
    for line in text.splitlines():
        if line.startswith("HISTORY "):
            losses = json.loads(line[len("HISTORY "):])["loss"]
    return Outcome(kind, seconds, losses, "" if kind == "ok" else text[-1500:])


def environment(devices: int, stall: int) -> dict[str, str]:
    env = dict(os.environ, DEVICES=str(devices), MESHFIT_STALL_TIMEOUT=str(stall), PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("XLA_FLAGS", "MESHFIT_SIMULATE_DEVICES", "PJRT_NPROC"):
        env.pop(name, None)
    return env


def plain(name: str, devices: int, stall: int, limit: float) -> Outcome:
    return run([sys.executable, "-c", fill(PLAIN, name)], environment(devices, stall), limit)


def cli(name: str, folder: str, stall: int, limit: float) -> Outcome:
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(fill(RECIPE, name))
    return run([sys.executable, "-m", "meshfit", "train", path, "--simulate-devices", "8", "--engine", "jax",
                "--out", os.path.join(tempfile.mkdtemp(dir=folder), "run"), "--checkpoint-every", "off"],
               dict(environment(8, stall), MESHFIT_OFFLINE="1"), limit)


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stress(args) -> None:
    busy = spinners(args.busy * (os.cpu_count() or 1))
    rows: dict[tuple[str, str], list[Outcome]] = {}
    reference: dict[str, list[float] | None] = {}
    try:
        if "plain" in args.routes and args.reference:
            for name in args.families:
                one = plain(name, 1, args.stall, args.limit)
                reference[name] = one.losses
                print(f"reference {name} on 1 device: {one.kind} {one.seconds:.0f} s {one.tail}",
                      file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as folder:
            for round_ in range(args.rounds):
                for name in args.families:
                    for route in args.routes:
                        outcome = (plain(name, 8, args.stall, args.limit) if route == "plain"
                                   else cli(name, folder, args.stall, args.limit))
                        rows.setdefault((name, route), []).append(outcome)
                        print(f"round {round_ + 1} {name} {route}: {outcome.kind} {outcome.seconds:.0f} s "
                              f"load {os.getloadavg()[0]:.1f} {outcome.tail}", file=sys.stderr, flush=True)
    finally:
        for spinner in busy:
            spinner.kill()
    print("| family | route | runs | finished | aborts | hangs | errors | loss vs 1 device (max rel.) "
          "| median s |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (name, route), outcomes in rows.items():
        counts = {k: sum(o.kind == k for o in outcomes) for k in ("ok", "abort", "hang", "error")}
        difference = "n/a"
        ref = reference.get(name)
        if route == "plain" and ref:
            diffs = [max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(o.losses, ref))
                     for o in outcomes if o.losses]
            difference = f"{max(diffs):.1e}" if diffs else "n/a"
        print(f"| {name} | {route} | {len(outcomes)} | {counts['ok']} | {counts['abort']} | {counts['hang']} "
              f"| {counts['error']} | {difference} | {statistics.median(o.seconds for o in outcomes):.0f} |")
    total = sum(len(o) for o in rows.values())
    bad = sum(o.kind != "ok" for outcomes in rows.values() for o in outcomes)
    print(f"\n{total} runs, {bad} not finished; {args.busy} busy processes per core "
          f"({args.busy * (os.cpu_count() or 1)} on {os.cpu_count()} cores)")


# XLA_POOL=1: XLA's own pool, max(cores, devices) threads, instead of meshfit's (meshfit.parallel.devices)
COST = '''
import os
if os.environ.get("XLA_POOL"):
    from meshfit.parallel import devices
    devices.THREADS_PER_DEVICE = 1
''' + PREAMBLE + '''
import time
FAMILY
x, y = data(2048, 0)
times = []


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        jax.block_until_ready([v.value for v in self.model.trainable_variables])
        times.append(time.perf_counter() - self.start)


with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x, y, batch_size=128, epochs=4, verbose=0, callbacks=[EpochTimes()])
print("EPOCH", statistics.median(times[1:]))
'''


def cost(args) -> None:
    """Epoch time with meshfit's pool, with XLA's own pool (PJRT_NPROC=8) and, given --baseline,
    with another meshfit checkout (e.g. the commit before), fresh processes alternating."""
    program = "import statistics\n" + fill(COST, "cnn")
    sides = {"meshfit": ({}, ROOT), "xla pool": ({"XLA_POOL": "1"}, ROOT)}
    if args.baseline:  # `python -c` imports meshfit from its working folder first
        sides["baseline"] = ({}, os.path.abspath(args.baseline))
    times: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side, (extra, folder) in sides.items():
            out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=folder,
                                 env={**environment(8, args.stall), **extra}, timeout=args.limit)
            line = [l for l in out.stdout.splitlines() if l.startswith("EPOCH ")]
            if line:
                times[side].append(float(line[0].split()[1]))
            print(f"round {round_ + 1} {side}: {line[0] if line else f'failed (exit {out.returncode})'} "
                  f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    ours = statistics.median(times["meshfit"])
    print(f"epoch of 2,048 images, batch 128, 8 simulated devices, cnn family, median of {args.rounds} "
          "alternating fresh processes:")
    for side, seconds in times.items():
        if seconds:
            print(f"  {side:<9} {statistics.median(seconds):.2f} s ({len(seconds)} of {args.rounds} runs "
                  f"finished; meshfit / {side} = {ours / statistics.median(seconds):.2f}x)")
        else:
            print(f"  {side:<9} no run finished")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--routes", nargs="+", default=["plain", "cli"], choices=["plain", "cli"])
    parser.add_argument("--busy", type=int, default=2, help="busy processes per core beside each run")
    parser.add_argument("--stall", type=int, default=180, help="MESHFIT_STALL_TIMEOUT of each run")
    parser.add_argument("--limit", type=float, default=1800, help="seconds before a run counts as hung")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the one-device runs that the losses are compared with")
    parser.add_argument("--cost", action="store_true", help="the pool's cost: epoch time A/B")
    parser.add_argument("--baseline", help="--cost: also time the meshfit of this checkout (a folder)")
    args = parser.parse_args()
    cost(args) if args.cost else stress(args)


if __name__ == "__main__":
    main()
