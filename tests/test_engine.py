"""Engine choice (meshfit.parallel.engine): the flag, the automatic choice, switching too late, and the
TensorFlow engine's conv bias gradient."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import ONE_CPU, environment

import meshfit
from meshfit.parallel import engine


def run_python(args, env=None, timeout=240):
    """Start `python args...` with `env` applied over ours (None removes a variable)."""
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environment(env))


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_engine_flag_overrides_the_choice():
    procs = {name: run_python(["-m", "meshfit", "info", "--engine", name, "--json"], ONE_CPU)
             for name in ("jax", "tensorflow")}
    for name, proc in procs.items():
        code, out, err = finish(proc)
        assert code == 0, err
        info = json.loads(out.strip().splitlines()[-1])
        assert info["engine"] == name and info["replicas"] == 1


def test_auto_picks_tensorflow_on_one_cpu_and_jax_elsewhere(monkeypatch):
    assert engine.fastest("cpu", 1) == ("tensorflow" if engine.installed("tensorflow") else "jax")
    assert engine.fastest("cpu", 8) == "jax"
    assert engine.fastest("gpu", 1) == "jax"
    assert engine.fastest("tpu", 4) == "jax"
    monkeypatch.setattr(engine, "installed", lambda name: name != "tensorflow")
    assert engine.fastest("cpu", 1) == "jax"


def test_switching_engine_after_keras_import_is_a_clear_error():
    script = textwrap.dedent("""
        import os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        import keras
        import meshfit
        try:
            meshfit.connect(engine="tensorflow", verbose=False)
        except meshfit.MeshfitError as err:
            print(err)
            sys.exit(2)
    """)
    code, out, err = finish(run_python(["-c", script], ONE_CPU))
    assert code == 2, err
    assert "too late to switch to engine tensorflow" in out
    assert "KERAS_BACKEND=tensorflow" in out  # names the fix
    assert out.strip().count("\n") == 0


def test_engine_switch_too_late_is_a_clear_error(strategy):
    with pytest.raises(meshfit.MeshfitError, match="too late to switch to engine tensorflow"):
        meshfit.connect(engine="tensorflow", verbose=False)


def test_faster_engine_hint_names_the_install_command_once(monkeypatch):
    monkeypatch.setattr(engine, "_hinted", False)
    monkeypatch.setattr(engine, "installed", lambda name: name != "tensorflow")
    assert engine.hint_faster_engine("jax", "cpu", 8) is None  # several devices: JAX is right
    assert engine.hint_faster_engine("jax", "gpu", 1) is None
    hint = engine.hint_faster_engine("jax", "cpu", 1)
    assert "pip install 'meshfit[cpu]'" in hint
    assert engine.hint_faster_engine("jax", "cpu", 1) is None  # once per process
    monkeypatch.setattr(engine, "_hinted", False)
    monkeypatch.setattr(engine, "installed", lambda name: True)
    assert engine.hint_faster_engine("jax", "cpu", 1) is None  # already installed


BIAS_GRADIENT_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import meshfit
    from meshfit.fit import tf_bias_gradient

    import tensorflow as tf
    from tensorflow.python.framework import ops

    stock = ops._gradient_registry.lookup("BiasAdd")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(6, 9, 9, 2)).astype("float32"))
    kernel = tf.Variable(rng.normal(size=(3, 3, 2, 5)).astype("float32"))
    bias = tf.Variable(rng.normal(size=(5,)).astype("float32"))
    dense = tf.Variable(rng.normal(size=(5, 3)).astype("float32"))
    dense_bias = tf.Variable(rng.normal(size=(3,)).astype("float32"))
    variables = [kernel, bias, dense, dense_bias]

    def gradients(dtype):
        # conv + bias (NHWC, rank 4), max-pool, then dense + bias (rank 2), in a traced function
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = tf.nn.bias_add(tf.nn.conv2d(tf.cast(x, dtype), tf.cast(kernel, dtype), 1, "VALID"),
                                   tf.cast(bias, dtype))
                h = tf.reduce_max(tf.nn.max_pool2d(h, 2, 2, "VALID"), axis=[1, 2])
                out = tf.nn.bias_add(tf.matmul(h, tf.cast(dense, dtype)), tf.cast(dense_bias, dtype))
                loss = tf.reduce_sum(tf.cast(out, "float32") ** 2)
            return tape.gradient(loss, variables)
        ops_used = [op.type for op in step.get_concrete_function().graph.get_operations()]
        return [g.numpy() for g in step()], ops_used.count("BiasAddGrad")

    before = {d: gradients(d) for d in ("float32", "bfloat16")}
    meshfit.connect(engine="tensorflow", verbose=False)
    installed = ops._gradient_registry.lookup("BiasAdd") is tf_bias_gradient.conv_bias_gradient
    tf_bias_gradient.install()  # a second install keeps TF's own as the fallback
    after = {d: gradients(d) for d in ("float32", "bfloat16")}
    print(json.dumps({
        "installed": installed, "fallback_is_stock": tf_bias_gradient.tensorflow_bias_gradient is stock,
        "bias_add_grads": {f"{when} {d}": grads[d][1] for when, grads in (("before", before), ("after", after))
                           for d in grads},
        "float32": max(float(np.max(np.abs(a - b))) for a, b in zip(before["float32"][0], after["float32"][0])),
        "bfloat16": max(float(np.max(np.abs(a - b))) for a, b in zip(before["bfloat16"][0], after["bfloat16"][0])),
        "bias_gradient_size": float(np.max(np.abs(after["float32"][0][1]))),
    }))
""")


def test_tensorflow_engine_sums_conv_bias_gradients_apart_with_the_same_result():
    code, out, err = finish(run_python(["-c", BIAS_GRADIENT_SCRIPT], ONE_CPU))
    assert code == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["installed"] and result["fallback_is_stock"]
    # TF's BiasAddGrad for the conv and the dense layer; after: only the dense one's in float32
    assert result["bias_add_grads"] == {"before float32": 2, "before bfloat16": 2,
                                        "after float32": 1, "after bfloat16": 2}, result
    assert result["bias_gradient_size"] > 1  # a real gradient, not zeros
    assert result["float32"] < 1e-3, result
    assert result["bfloat16"] == 0, result  # bfloat16 keeps TF's own (fused) gradient


ACCURACY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import meshfit
    from meshfit import recipes

    strategy = meshfit.connect(engine=sys.argv[1], verbose=False)
    import keras

    def blocks(n, seed):
        # 28x28 noise with a bright 7x7 block at one of 10 places; the place is the class
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 10, n).astype("int32")
        x = rng.integers(0, 60, (n, 28, 28, 1)).astype("uint8")
        for i, c in enumerate(y):
            x[i, 7 * (c // 4):7 * (c // 4) + 7, 7 * (c % 4):7 * (c % 4) + 7] = 255
        return x, y

    keras.utils.set_random_seed(0)  # on JAX it leaves TensorFlow unloaded (keras_internals)
    recipe = recipes.get("fashion-mnist-cnn")
    x, y = blocks(480, 0)
    x_test, y_test = blocks(200, 1)
    with strategy.scope():
        model = recipe.build_model((28, 28, 1), 10)
        model.compile(optimizer=recipe.optimizer(15, 2), loss=recipe.loss, metrics=["accuracy"])
    strategy.fit(model, x, y, batch_size=32, epochs=2)
    scores = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    keras.saving.serialize_keras_object(model)  # asks Keras' TensorFlow handle too
    from meshfit.watch.keras_side.report import flops_key  # its FLOP count is kept on both engines
    print(json.dumps({"engine": strategy.engine, "backend": keras.backend.backend(),
                      "accuracy": float(scores["accuracy"]), "flops_key": flops_key(model, 32) is not None,
                      "tensorflow": "tensorflow" in sys.modules}))
""")


def test_same_recipe_learns_the_same_on_each_engine():
    procs = {name: run_python(["-c", ACCURACY_SCRIPT, name], ONE_CPU) for name in ("jax", "tensorflow")}
    accuracy = {}
    for name, proc in procs.items():
        code, out, err = finish(proc)
        assert code == 0, err[-2000:]
        lines = out.strip().splitlines()
        result = json.loads(lines[-1])
        assert result["engine"] == result["backend"] == name
        assert result["tensorflow"] == (name == "tensorflow")  # the JAX engine never loads TF
        assert result["flops_key"]
        epochs = [line for line in lines if line.startswith("epoch ")]
        assert len(epochs) == 2 and all("samples/s" in line and "MFU " in line for line in epochs)
        assert not any("MFU n/a" in line for line in epochs)  # a CPU's peak is measured
        assert "oneDNN custom operations" not in err and "absl::InitializeLog" not in err, err
        accuracy[name] = result["accuracy"]
    assert min(accuracy.values()) > 0.9, accuracy
    assert abs(accuracy["jax"] - accuracy["tensorflow"]) < 0.08, accuracy


def test_on_jax_keras_seeds_tensorflow_only_once_something_has_loaded_it():
    """keras.utils.set_random_seed seeds TensorFlow wherever it is installed, importing it (5-6 s
    of a JAX run's start-up): on the JAX engine only once something (a user's tf.data) has loaded
    it (a user's tf.data, a Keras layer that requires it), and then it is seeded as before."""
    script = textwrap.dedent("""
        import json, sys
        import meshfit
        meshfit.connect(engine="jax", verbose=False)
        import keras
        keras.utils.set_random_seed(3)
        unloaded = "tensorflow" not in sys.modules
        keras.layers.Hashing(num_bins=3)  # a layer that requires TensorFlow: Keras loads it
        from tensorflow.python.eager import context
        keras.utils.set_random_seed(7)
        print(json.dumps({"unloaded": unloaded, "tf_seed": context.global_seed()}))
    """)
    code, out, err = finish(run_python(["-c", script], ONE_CPU))
    assert code == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"unloaded": True, "tf_seed": 7}


def test_auto_never_picks_a_one_device_engine_for_several_devices(monkeypatch):
    """Keras imported (or KERAS_BACKEND set) with TensorFlow before meshfit chose: several
    devices are refused in one line naming the fix, never trained on with 1 replica."""
    monkeypatch.delenv("MESHFIT_ENGINE", raising=False)
    monkeypatch.setattr(engine, "loaded_backend", lambda: "tensorflow")
    with pytest.raises(meshfit.MeshfitError, match="already imported with the tensorflow backend"
                       ".* 4 cpu device.* in use; .*KERAS_BACKEND=jax"):
        engine.choose_engine(None, "cpu", 4)
    with pytest.raises(meshfit.MeshfitError, match="1 gpu device.* in use"):  # one GPU, too
        engine.choose_engine(None, "gpu", 1)
    assert engine.choose_engine(None, "cpu", 1) == "tensorflow"
    monkeypatch.setattr(engine, "loaded_backend", lambda: None)
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    with pytest.raises(meshfit.MeshfitError, match="KERAS_BACKEND=tensorflow is set"):
        engine.choose_engine("auto", "cpu", 8)


def test_a_notebook_is_told_to_restart_its_kernel(monkeypatch):
    """Colab's `import keras` first gives TensorFlow: in a notebook the one-line fix says to
    restart the kernel and import meshfit first (a new process cannot be started from a cell)."""
    from meshfit import env

    monkeypatch.delenv("MESHFIT_ENGINE", raising=False)
    monkeypatch.setattr(engine, "loaded_backend", lambda: "tensorflow")
    monkeypatch.setattr(env, "notebook", lambda: True)
    for args in ((None, "tpu", 8), ("jax", "cpu", 1)):
        with pytest.raises(meshfit.MeshfitError) as caught:
            engine.choose_engine(*args)
        message = str(caught.value)
        assert "\n" not in message and "restart the kernel" in message, message
        assert "import meshfit" in message and "KERAS_BACKEND'] = 'jax'" in message, message


def test_a_cpu_run_prints_no_cuda_error_of_the_tensorflow_wheel():
    """keras-hub's tensorflow-text pulls the `tensorflow` wheel in beside tensorflow-cpu (the
    `hub` and `test` extras); it calls cuInit when it first lists its devices (a model's first
    variable) and logs the failure as an error, as `import jax` set TF_CPP_MIN_LOG_LEVEL to 1
    before meshfit could set 3. meshfit drops that line, as it drops TensorFlow's load notices."""
    script = ("import meshfit; meshfit.connect(engine='tensorflow', verbose=False); import keras; "
              "keras.Variable(1.0); print('done')")
    code, out, err = finish(run_python(["-c", script], {**ONE_CPU, "TF_CPP_MIN_LOG_LEVEL": None}))
    assert code == 0 and out.strip() == "done", err[-2000:]
    assert "cuInit" not in err and "CUDA error" not in err, err


def test_tensorflow_imported_after_connect_on_jax_prints_no_load_notices():
    """On the JAX engine TensorFlow comes in with a user's own import (keras-hub's tensorflow-text,
    tf.data): its load notices ("oneDNN custom operations are on", "Could not find cuda drivers",
    on a GPU machine a cuInit error) are dropped there too, and TensorFlow works."""
    script = ("import meshfit; meshfit.connect(engine='jax', verbose=False)\n"
              "import tensorflow as tf\n"
              "print(int(tf.reduce_sum(tf.constant([1, 2]))))\n")
    code, out, err = finish(run_python(["-c", script], {**ONE_CPU, "TF_CPP_MIN_LOG_LEVEL": None}))
    assert code == 0 and out.strip() == "3", err[-2000:]
    notices = [line for line in err.splitlines()
               if any(n.decode() in line for n in engine._LOAD_NOTICES) or "cuInit" in line]
    assert not notices, err


def test_the_first_tensorflow_import_keeps_every_other_line_and_its_loader(tmp_path):
    """A stand-in `tensorflow` writes a load notice and another line to file descriptor 2 as it
    loads: the notice is dropped, the other line kept; the module's loader still answers for the
    package (resources), and the finder is gone after its one import, not before: a lookup
    without an import (connect()'s summary asks whether TensorFlow is installed on one CPU
    device) once took it out, and keras-hub's import of TensorFlow printed every notice."""
    package = tmp_path / "tensorflow"
    package.mkdir()
    (package / "data.txt").write_text("resource")
    (package / "__init__.py").write_text(textwrap.dedent("""
        import os, types
        os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see...\\n")
        os.write(2, b"a line of the user's own\\n")
        config = types.SimpleNamespace(list_physical_devices=lambda: os.write(2, b"listed\\n"))
    """))
    script = textwrap.dedent("""
        import importlib.resources, sys
        from meshfit.parallel import engine
        engine.drop_tensorflow_notices_at_import()
        assert engine.installed("tensorflow") and "tensorflow" not in sys.modules
        import tensorflow
        print(importlib.resources.files("tensorflow").joinpath("data.txt").read_text())
        print(any(isinstance(f, engine._TensorFlowImportedQuietly) for f in sys.meta_path))
    """)
    code, out, err = finish(run_python(["-c", script], {"PYTHONPATH": str(tmp_path)}))
    assert code == 0 and out.split() == ["resource", "False"], err[-2000:]
    assert err.splitlines() == ["a line of the user's own", "listed"], err


def test_connect_keeps_compiled_programs_in_the_users_cache(tmp_path):
    """JAX programs (the batch order's, on every engine) are cached across runs under
    $XDG_CACHE_HOME/meshfit/jax, where the user set no cache of their own."""
    from helpers import cli_env

    script = ("import functools, numpy as np, meshfit\n"
              "meshfit.connect(verbose=False)\n"
              "import jax\n"
              "from meshfit.data.arrays import permutation\n"
              "np.asarray(jax.jit(functools.partial(permutation, 0, n=60000))(0))\n")
    changes = {**cli_env(tmp_path, "tensorflow"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
               "JAX_COMPILATION_CACHE_DIR": None, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": None}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=environment(changes))
    assert done.returncode == 0, done.stderr[-2000:]
    cached = os.listdir(tmp_path / "xdg" / "meshfit" / "jax")
    assert any(name.startswith("jit_permutation") for name in cached), cached


def test_the_command_line_loads_keras_without_the_extras_it_never_uses(tmp_path):
    """Keras imports scikit-learn, pandas and matplotlib's pyplot at its top when they are
    installed (2.1 s of its 4.5 s import on a GPU machine): meshfit's command line leaves them
    out of Keras' import, and they import normally afterwards; a user's own program (connect())
    keeps them, so its fit still takes pandas DataFrames. Stand-in packages record their import."""
    site = tmp_path / "site"
    for name, body in (("sklearn", ""), ("pandas", "class Series: pass\nclass DataFrame: pass\n")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(
            f"import os\nopen(os.environ['EXTRAS_MARKER'], 'a').write('{name}\\n')\n{body}")
    program = textwrap.dedent("""
        import os, sys
        from meshfit import cli
        import meshfit
        way, engine = sys.argv[1:]
        if way == "command-line":
            sys.argv = ["meshfit", "info", "--engine", engine]
            assert cli.main() == 0
        else:
            meshfit.connect(engine=engine, verbose=False)
        from keras.src.trainers.data_adapters import array_slicing
        marker = os.environ["EXTRAS_MARKER"]
        print("keras", sorted(open(marker).read().split()) if os.path.exists(marker) else [],
              array_slicing.pandas is None)
        import pandas, sklearn
        print("after", sorted(open(marker).read().split()))
    """)
    env = {**ONE_CPU, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    # On TensorFlow, Keras' import loads TensorFlow too: nothing it needs may be left out.
    ways = {("command-line", "jax"): "keras [] True", ("command-line", "tensorflow"): "keras [] True",
            ("user", "jax"): "keras ['pandas', 'sklearn'] False"}
    procs = {}
    for way, engine_name in ways:
        marker = tmp_path / f"imported-{way}-{engine_name}"
        procs[way, engine_name] = run_python(["-c", program, way, engine_name],
                                             {**env, "EXTRAS_MARKER": str(marker)})
    for key, proc in procs.items():
        code, out, err = finish(proc)
        assert code == 0, err[-2000:]
        assert ways[key] in out and "after ['pandas', 'sklearn']" in out, (key, out)
