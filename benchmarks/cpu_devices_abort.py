"""Plain `model.fit` on 8 simulated CPU devices: how often it hangs and what the fix costs.

XLA:CPU can deadlock in an all-reduce on several CPU devices and abort after 40 s ("Termination
timeout for 'all reduce'"). meshfit finishes each train/test/predict dispatch before the next
(one program in flight; meshfit.fit.hooks). A second remedy was tried and not adopted:
single-threaded XLA:CPU kernels (`--xla_cpu_multi_thread_eigen=false`). This runs a user's plain
Keras program (a two-convolution CNN, 4,096 random 28x28 images, batch 128,
`validation_split=0.125`, Keras' progress bar, 4 epochs, then `evaluate` and `predict` on odd
counts) in a fresh process per run, for the four combinations, alternating, and prints per
combination the runs that hung (caught at XLA's 20 s "may be stuck" warning and killed) and the
median epoch time of the runs that finished (epochs 2-4: no compilation), as a ratio to meshfit's.

    python benchmarks/cpu_devices_abort.py [--rounds 8] [--configs 3 4]
    python benchmarks/cpu_devices_abort.py --cost [--rounds 8]

--cost measures the wait's price in one process: the same CNN trains 2 x rounds epochs without
validation (train steps depend on each other's weights, so they never overlap and the run cannot
hang either way), alternating epochs with and without the wait; it prints the median epoch
time of each and their ratio.

Results: BENCHMARKS.md, section 2.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

CONFIGS = {  # name: (multi-threaded kernels, finish each dispatch)
    "Keras' defaults": (True, False),
    "single-threaded kernels": (False, False),
    "meshfit: one program in flight": (True, True),
    "both": (False, True),
}

CHILD = textwrap.dedent("""
    import os, sys, time
    import meshfit
    strategy = meshfit.connect(simulate_devices=8, verbose=False)
    import keras, numpy as np
    from meshfit.fit import jax_loop
    from meshfit.watch import report
    if os.environ["WAIT"] == "0":
        jax_loop.finish_dispatch = lambda outputs: None
    rng = np.random.default_rng(0)
    x = rng.random((4096, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 4096)

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            report.wait_for_device(self.model)
            print("EPOCH_SECONDS", time.perf_counter() - self.start, flush=True)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dropout(0.2), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=4, validation_split=0.125, callbacks=[EpochTimes()])
    model.evaluate(x[:1001], y[:1001])
    assert model.predict(x[:5]).shape == (5, 10)
    print("DONE", flush=True)
""")


COST_CHILD = textwrap.dedent("""
    import statistics, sys, time
    import meshfit
    strategy = meshfit.connect(simulate_devices=8, verbose=False)
    import keras, numpy as np
    from meshfit.fit import jax_loop
    from meshfit.watch import report
    finish = jax_loop.finish_dispatch
    rng = np.random.default_rng(0)
    x = rng.random((4096, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 4096)
    times = {True: [], False: []}

    class Alternate(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.wait = epoch % 2 == 1
            jax_loop.finish_dispatch = finish if self.wait else (lambda outputs: None)
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            report.wait_for_device(self.model)
            if epoch >= 2:  # epochs 0 and 1 compile
                times[self.wait].append(time.perf_counter() - self.start)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=2 + 2 * int(sys.argv[1]), verbose=0, callbacks=[Alternate()])
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"epoch with the wait {on:.3f} s, without {off:.3f} s: {on / off:.3f}x "
          f"({len(times[True])} epochs each, alternating)")
""")


def run(multi_threaded: bool, wait: bool, timeout: float = 300) -> list[float] | None:
    """One fresh process: its epoch times after the first, or None if it hung."""
    env = dict(os.environ, WAIT="1" if wait else "0",
               XLA_FLAGS=f"--xla_cpu_multi_thread_eigen={'true' if multi_threaded else 'false'}")
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=log, stderr=subprocess.STDOUT, env=env)
        start = time.monotonic()
        while child.poll() is None:
            time.sleep(1)
            log.seek(0)
            text = log.read()
            if "may be stuck" in text or "Termination timeout" in text or time.monotonic() - start > timeout:
                child.kill()
                child.wait()
                return None
        log.seek(0)
        text = log.read()
    if child.returncode != 0 or "DONE" not in text:
        raise RuntimeError(f"the run failed (exit {child.returncode}):\n{text[-2000:]}")
    return [float(s) for s in re.findall(r"EPOCH_SECONDS ([0-9.]+)", text)][1:]  # Keras' bar shares lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--configs", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="which of the four combinations to run, by their place in the list (1-4)")
    parser.add_argument("--cost", action="store_true", help="the wait's price, in one process")
    args = parser.parse_args()
    if args.cost:
        subprocess.run([sys.executable, "-c", COST_CHILD, str(args.rounds)], check=True)
        return
    names = [list(CONFIGS)[i - 1] for i in args.configs]
    hung = {name: 0 for name in names}
    epochs: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            multi_threaded, wait = CONFIGS[name]
            seconds = run(multi_threaded, wait)
            if seconds is None:
                hung[name] += 1
            else:
                epochs[name].extend(seconds)
            print(f"round {round_ + 1}: {name}: {'hung' if seconds is None else f'{statistics.median(seconds):.3f} s/epoch'}",
                  file=sys.stderr, flush=True)
    ours = epochs.get("meshfit: one program in flight")
    base = statistics.median(ours) if ours else None
    for name in names:
        median = statistics.median(epochs[name]) if epochs[name] else None
        ratio = f"{median / base:.3f}x meshfit's" if (median and base) else "n/a"
        print(f"{name:<30} hung {hung[name]} of {args.rounds}   epoch "
              f"{'n/a' if median is None else f'{median:.3f} s'} ({ratio})")


if __name__ == "__main__":
    main()
