"""`meshfit.verify` and `meshfit verify`: seeded defects each diverge (exit 1) from the step and in
the variable or metric they touch; correct models and configurations never do.

Each defect is one a user meets when moving a model from one device to several, written as user
code would: it reads the replica count of the run in progress (keras.distribution.distribution(),
the devices of the active configuration), so it is invisible on one device. The tests run on the
suite's 8 simulated devices, 4 steps of tiny models, 1 device against 8.
"""

import json
import os

import keras
import numpy as np
import pytest
from keras import layers, ops

import meshfit
from helpers import connect_eight_devices

SAMPLES, BATCH, FEATURES, CLASSES, STEPS = 256, 32, 8, 3, 4
rng = np.random.default_rng(0)
X = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
Y = rng.integers(0, CLASSES, SAMPLES)


def replicas() -> int:
    """The replica count of the run in progress, as user code reads it."""
    distribution = keras.distribution.distribution()
    return 1 if distribution is None else int(np.prod(distribution.device_mesh.shape))


def compiled(model, optimizer=None, metrics=("accuracy",)):
    model.compile(optimizer or keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return model


def mlp(*middle):
    return keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu", name="hidden"),
                             *middle, layers.Dense(CLASSES, name="out")])


def verify(build, x=X, y=Y, **kwargs):
    kwargs = {"batch_size": BATCH, "steps": STEPS, "devices": (1, 8), "sharding": "data",
              "resume": False, "verbose": False, **kwargs}
    return meshfit.verify(build, x, y, **kwargs)


def diverging(result):
    """The one configuration's verdict, which must diverge (exit code 1)."""
    assert result.exit_code == 1, result.lines()
    (verdict,) = [v for v in result.verdicts if not v.ok]
    return verdict


@pytest.fixture(autouse=True)
def eight_devices():
    yield connect_eight_devices()
    connect_eight_devices()


# ------------------------------------------------------------------------ the seeded defects

class ScaledLoss(keras.Model):
    """Ported from tf.distribute: the loss multiplied by the replica count, so the gradient is
    the devices' sum, not their mean."""

    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs) * replicas()


def test_gradients_summed_over_devices_instead_of_averaged():
    def build():
        inputs = keras.Input((FEATURES,))
        hidden = layers.Dense(16, activation="relu", name="hidden")(inputs)
        return compiled(ScaledLoss(inputs, layers.Dense(CLASSES, name="out")(hidden)))

    verdict = diverging(verify(build))
    assert verdict.name == "8 devices, data" and verdict.diverges_at == 1
    assert verdict.variable.startswith("variable ") and verdict.times_floor > 1e3


class PerDeviceBatchNorm(layers.Layer):
    """Batch statistics over each device's share (tf.distribute's BatchNormalization without
    synchronisation) where the global batch was meant."""

    def call(self, x, training=False):
        if not training:
            return x
        groups = ops.reshape(x, (replicas(), -1, x.shape[-1]))
        mean = ops.mean(groups, axis=1, keepdims=True)
        variance = ops.var(groups, axis=1, keepdims=True)
        return ops.reshape((groups - mean) / ops.sqrt(variance + 1e-3), ops.shape(x))


def test_batch_statistics_per_device():
    verdict = diverging(verify(lambda: compiled(mlp(PerDeviceBatchNorm()))))
    assert verdict.diverges_at == 1 and "layer" in verdict.variable


class SameNoiseOnEveryDevice(layers.Layer):
    """Noise drawn for one device's share and repeated on every device."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seeds = keras.random.SeedGenerator(7)

    def call(self, x, training=False):
        if not training:
            return x
        share = keras.random.normal((x.shape[0] // replicas(), x.shape[-1]), seed=self.seeds)
        return x + 0.5 * ops.tile(share, (replicas(), 1))


def test_noise_that_draws_the_same_numbers_on_every_device():
    verdict = diverging(verify(lambda: compiled(mlp(SameNoiseOnEveryDevice()))))
    assert verdict.diverges_at == 1 and "layer" in verdict.variable


class MeanAbsoluteLogit(keras.metrics.Metric):
    """A metric whose per-device means are summed over the devices instead of averaged (its
    sum divided by a device's share of the batch)."""

    def __init__(self, name="mean_abs_logit", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        share = ops.shape(y_pred)[0] // replicas()
        self.total.assign_add(ops.sum(ops.abs(y_pred)) / ops.cast(share * y_pred.shape[-1], "float32"))
        self.count.assign_add(1.0)

    def result(self):
        return self.total / self.count


def test_a_metric_summed_over_devices():
    verdict = diverging(verify(lambda: compiled(mlp(), metrics=[MeanAbsoluteLogit()])))
    assert verdict.diverges_at == 1 and verdict.variable == "metric mean_abs_logit"


def test_a_data_order_that_depends_on_the_device_count():
    def batches(start):  # shuffled with the replica count as its seed
        order = np.random.default_rng(replicas()).permutation(SAMPLES)
        for step in range(start, 10 ** 6):
            rows = order[np.arange(step * BATCH, (step + 1) * BATCH) % SAMPLES]
            yield X[rows], Y[rows]

    verdict = diverging(verify(lambda: compiled(mlp()), batches, None))
    assert verdict.diverges_at == 1 and verdict.variable.startswith("variable ")


@pytest.mark.parametrize("offset, words", [(1, "skips"), (-1, "repeats")])
def test_a_resume_that_skips_or_repeats_a_batch(offset, words):
    def batches(start):  # the stream restarted one batch off where it resumes
        for step in range(start + offset if start else 0, 10 ** 6):
            rows = np.arange(step * BATCH, (step + 1) * BATCH) % SAMPLES
            yield X[rows], Y[rows]

    result = verify(lambda: compiled(mlp()), batches, None, resume=True)
    verdict = diverging(result)
    assert verdict.name == "8 devices, data, resumed after step 2", words
    assert verdict.diverges_at == 3 and verdict.variable.startswith("variable ")


@pytest.mark.parametrize("lost, optimizer, middle", [
    ("momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9), ()),
    ("iteration", lambda: keras.optimizers.Adam(1e-2), ()),
    ("seed_generator_state", lambda: keras.optimizers.SGD(0.1), (0.3,))])
def test_a_checkpoint_that_loses_or_mangles_a_variable(monkeypatch, lost, optimizer, middle):
    """The resume goes through meshfit's checkpoint files: a restore that leaves an optimizer slot
    or the step counter as a new model has them, or mangles a seed generator's state, diverges
    from the first step after the resume."""
    from meshfit.run.keras_side import checkpoint_restore

    def lossy(variables, arrays, group):
        for i, v in enumerate(variables):
            value = arrays[f"{group}/{i:05d}"]
            if lost not in v.path:
                v.assign(value)
            elif "seed" in lost:
                v.assign(np.asarray(value) + 1)  # mangled
    monkeypatch.setattr(checkpoint_restore, "_assign", lossy)

    def build():
        return compiled(mlp(*[layers.Dropout(rate) for rate in middle]), optimizer())

    verdict = diverging(verify(build, resume=True))
    assert verdict.name == "8 devices, data, resumed after step 2" and verdict.diverges_at == 3
    assert verdict.variable.startswith("variable ") and " of layer " in verdict.variable


# ---------------------------------------------------------------------- no false alarms

class WithActivityLoss(keras.Model):
    """A subclassed model with its own layers, call and add_loss."""

    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(16, activation="relu")
        self.dropout = layers.Dropout(0.3)
        self.norm = layers.BatchNormalization()
        self.out = layers.Dense(CLASSES)

    def call(self, x, training=False):
        h = self.norm(self.dropout(self.hidden(x), training=training), training=training)
        self.add_loss(1e-2 * ops.mean(ops.square(h)))
        return self.out(h)


def test_a_subclassed_model_with_add_loss_dropout_and_batch_norm_is_equal(tmp_path):
    picture = str(tmp_path / "verify.png")
    result = verify(lambda: compiled(WithActivityLoss(), keras.optimizers.Adam(1e-2)),
                    devices=(1, 8), sharding="data,fsdp", resume=True, steps_per_dispatch=(2,),
                    plot=picture)
    assert result.exit_code == 0, result.lines()
    names = [v.name for v in result.verdicts]
    assert names == ["8 devices, data", "8 devices, fsdp", "8 devices, data, 2 steps per dispatch",
                     "8 devices, data, resumed after step 2"]
    assert all(0 < v.worst <= 30 for v in result.verdicts)  # measured, never trivially zero
    lines = result.lines()
    assert "rounding floor" in lines[1] and "one rounding unit" in lines[1]
    assert all("equal within rounding" in line for line in lines[2:-1])
    assert os.path.getsize(picture) > 10_000
    assert json.loads(json.dumps(result.as_dict()))["ok"] is True


def test_mixed_precision_is_equal():
    result = verify(lambda: compiled(mlp(layers.Dropout(0.2))), precision="bfloat16",
                    sharding="data,fsdp,model:2")
    assert result.exit_code == 0, result.lines()
    assert "bfloat16" in result.lines()[0] and len(result.verdicts) == 3


def test_several_precisions_each_against_its_own_reference_and_floor():
    result = verify(lambda: compiled(mlp(layers.Dropout(0.2))), precision="float32,mixed_bfloat16")
    assert result.exit_code == 0, result.lines()
    (bf16,) = result.more
    assert result.precision == "float32" and bf16.precision == "bfloat16"
    assert bf16.roundoff == 2.0 ** -9 and bf16.weight_floor[-1] > 100 * result.weight_floor[-1]
    assert [v.name for v in bf16.verdicts] == ["8 devices, data"] and 0 < bf16.verdicts[0].worst <= 30
    lines = result.lines()
    assert any(line.startswith("bfloat16: its own reference on 1 device") for line in lines)
    assert any("8 devices, data, bfloat16" in line and "equal within rounding" in line
               for line in lines)
    assert result.as_dict()["precisions"][0]["precision"] == "bfloat16"


def test_a_defect_in_a_further_precision_fails_verify():
    result = verify(lambda: compiled(mlp(SameNoiseOnEveryDevice())), precision=["float32", "bf16"])
    assert result.exit_code == 1 and not result.more[0].ok, result.lines()
    assert "2 of 2 configuration(s) diverge" in result.lines()[-1]


def test_micro_batches_are_equal_but_their_dropout_draws_other_numbers():
    """On JAX each micro-batch draws its own Dropout masks (meshfit.fit.jax_microbatch): the same
    distribution, other numbers than one device draws, which verify must report."""
    plain = verify(lambda: compiled(mlp()), micro_batches=(2,))
    assert plain.exit_code == 0, plain.lines()
    verdict = diverging(verify(lambda: compiled(mlp(layers.Dropout(0.2))), micro_batches=(2,)))
    assert verdict.name == "8 devices, data, 2 micro-batches" and verdict.diverges_at == 1


IMAGES = rng.random((64, 12, 12, 1)).astype("float32")
LABELS = rng.integers(0, CLASSES, 64)


def small_cnn(dropout: float = 0.0):
    """fashion-mnist-cnn in miniature, at the top level of this module: another engine's
    process imports it by reference to rebuild the model."""
    model = keras.Sequential([keras.Input((12, 12, 1)), layers.Conv2D(4, 3, activation="relu"),
                              layers.MaxPooling2D(), layers.Flatten(), layers.Dropout(dropout),
                              layers.Dense(CLASSES)])
    return compiled(model, keras.optimizers.Adam(1e-2))


def small_cnn_with_dropout():
    return small_cnn(0.3)


def test_the_tensorflow_engine_trains_the_same_model_as_jax():
    """TensorFlow, in a process of its own, from the same weights on the same batches."""
    result = verify(small_cnn, IMAGES, LABELS, batch_size=16, devices=(1,),
                    engines="jax,tensorflow")
    assert result.exit_code == 0, result.lines()
    (verdict,) = result.verdicts
    assert verdict.name == "1 device, tensorflow engine" and verdict.steps == [1, 2, 3, 4]
    assert 0 < verdict.worst <= 30, result.lines()  # measured, never trivially zero


class Reconstruction(keras.Model):
    """Trained on x alone (fit(x), no y: a keras-hub task whose preprocessor makes the targets
    from the strings is fitted so); its loss is add_loss's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encode, self.decode = layers.Dense(4, name="encode"), layers.Dense(FEATURES, name="decode")

    def call(self, x):
        out = self.decode(self.encode(x))
        self.add_loss(ops.mean(ops.square(out - x)))
        return out


def reconstruction():
    model = Reconstruction()
    model.compile(keras.optimizers.SGD(0.1))
    return model


def test_a_model_trained_on_x_alone_is_equal_here_and_on_the_tensorflow_engine():
    """y=None, as meshfit.verify's signature allows: every configuration, and the other engine's
    process (which receives the batches), trains on x alone. It failed with an IndexError on
    np.asarray(None)[index] as it read the first batch."""
    result = verify(reconstruction, X, None, sharding="data,fsdp", resume=True,
                    engines="jax,tensorflow")
    assert result.exit_code == 0, result.lines()
    assert [v.name for v in result.verdicts] == [
        "8 devices, data", "8 devices, fsdp", "8 devices, data, resumed after step 2",
        "1 device, tensorflow engine"]
    assert all(0 < v.worst <= 30 for v in result.verdicts), result.lines()


def test_engines_on_a_model_that_draws_random_numbers_are_not_comparable():
    result = verify(small_cnn_with_dropout, IMAGES, LABELS, batch_size=16, devices=(1,),
                    engines=("jax", "tensorflow"))
    assert result.exit_code == 0 and not result.verdicts, result.lines()
    (line,) = [line for line in result.lines() if "tensorflow engine" in line]
    assert "not comparable: the model draws random numbers" in line


def test_engines_need_a_build_function_another_process_can_import():
    with pytest.raises(meshfit.MeshfitError, match="top level of an importable module"):
        verify(lambda: small_cnn(), IMAGES, LABELS, batch_size=16, engines="tensorflow")
    with pytest.raises(meshfit.MeshfitError, match="unknown engine 'torch'"):
        verify(small_cnn, IMAGES, LABELS, batch_size=16, engines="jax,torch")


def plain_mlp():
    """At the top level of this module: a job of several processes imports it by reference."""
    return compiled(mlp())


def batches_by_process_count(start):
    """Shuffled with the process count as its seed (read in each process of the job)."""
    import jax

    order = np.random.default_rng(jax.process_count()).permutation(SAMPLES)
    for step in range(start, 10 ** 6):
        rows = order[np.arange(step * BATCH, (step + 1) * BATCH) % SAMPLES]
        yield X[rows], Y[rows]


@pytest.mark.slow  # two jobs of `meshfit launch`, each ~20 s of starting JAX twice on 2 loaded cores
def test_two_processes_train_the_same_model_as_one_device():
    """2 processes x 2 devices, a job of `meshfit launch`; and a data order that depends on the
    process count diverges from step 1."""
    result = verify(plain_mlp, devices=(1, 4), processes=(2,))
    assert result.exit_code == 0, result.lines()
    assert [v.name for v in result.verdicts] == ["4 devices, data", "2 processes x 2 devices, data"]
    assert all(0 < v.worst <= 30 for v in result.verdicts), result.lines()
    result = verify(plain_mlp, batches_by_process_count, None, devices=(1, 4), processes=(2,))
    verdict = diverging(result)
    assert verdict.name == "2 processes x 2 devices, data" and verdict.diverges_at == 1


@pytest.mark.slow
def test_a_keras_hub_model_is_equal():
    keras_hub = pytest.importorskip("keras_hub")
    vocabulary, length = 64, 8
    tokens = np.random.default_rng(1).integers(1, vocabulary, (64, length + 1)).astype("int32")

    def build():
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=vocabulary, num_layers=1,
                                                  num_query_heads=2, num_key_value_heads=1,
                                                  hidden_dim=16, intermediate_dim=32)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((64, length), bool)}
    result = verify(build, x, tokens[:, 1:], batch_size=16, sharding="data,fsdp")
    assert result.exit_code == 0, result.lines()


@pytest.mark.parametrize("recipe", ["fashion-mnist-cnn",
                                    pytest.param("mnist-mlp-bf16", marks=pytest.mark.slow)])
def test_the_tutorial_recipes_on_the_command_line(recipe, data_dir, tmp_path, capsys):
    from meshfit import cli

    picture = str(tmp_path / "fm.png")
    code = cli.main(["verify", recipe, "--data-dir", data_dir, "--global-batch", "32",
                     "--steps", "4", "--devices", "1,8", "--sharding", "data,fsdp", "--plot",
                     picture, "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, json.dumps(result)
    assert [c["name"] for c in result["configurations"]] == [
        "8 devices, data", "8 devices, fsdp", "8 devices, data, resumed after step 2"]
    assert result["recipe"] == recipe and os.path.getsize(picture) > 10_000
    assert result["precision"] == ("bfloat16" if recipe == "mnist-mlp-bf16" else "float32")


@pytest.mark.slow
def test_a_run_directory_is_verified_with_its_own_batch_and_seed(data_dir, tmp_path, capsys):
    from meshfit import cli

    run = str(tmp_path / "run")
    assert cli.main(["train", "fashion-mnist-cnn", "--data-dir", data_dir, "--epochs", "1",
                     "--steps-per-epoch", "2", "--global-batch", "16", "--seed", "3", "--out", run,
                     "--checkpoint-every", "off"]) == 0
    capsys.readouterr()
    code = cli.main(["verify", run, "--steps", "2", "--sharding", "data", "--no-resume",
                     "--plot", "", "--engines", "jax,tensorflow", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, json.dumps(result)
    assert result["global_batch"] == 16 and result["seed"] == 3 and result["recipe"] == "fashion-mnist-cnn"
    # the recipe rebuilt from the run directory in TensorFlow's process
    assert [c["name"] for c in result["configurations"]] == ["8 devices, data",
                                                             "1 device, tensorflow engine"]


def test_a_defective_recipe_file_exits_1_on_the_command_line(data_dir, tmp_path, capsys):
    from meshfit import cli

    recipe = tmp_path / "scaled.py"
    recipe.write_text(
        "import keras, meshfit\n"
        "class Scaled(keras.Model):\n"
        "    def compute_loss(self, *args, **kwargs):\n"
        "        d = keras.distribution.distribution()\n"
        "        n = 1 if d is None else d.device_mesh.devices.size\n"
        "        return super().compute_loss(*args, **kwargs) * n\n"
        "def build_model(input_shape, num_classes):\n"
        "    x = keras.Input(input_shape)\n"
        "    h = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
        "    return Scaled(x, keras.layers.Dense(num_classes, activation='softmax')(h))\n"
        "RECIPE = meshfit.Recipe(name='scaled', dataset='fashion_mnist', build_model=build_model,\n"
        "    optimizer=lambda steps, epochs: keras.optimizers.SGD(0.01), epochs=1, global_batch=32)\n")
    code = cli.main(["verify", str(recipe), "--data-dir", data_dir, "--steps", "2", "--no-resume",
                     "--sharding", "data", "--plot", ""])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "8 devices, data" in out and "diverges from step 1 of 2" in out and "variable" in out


def test_the_configurations_asked():
    from meshfit.run.verify import configurations, parse_shardings

    runs = configurations((1, 2, 8), parse_shardings("fsdp, auto, model:2"), steps=8,
                          micro_batches=(1, 4), steps_per_dispatch=(2,))
    assert [r.name for r in runs] == [
        "2 devices, fsdp", "2 devices, auto", "2 devices, data x model 2", "8 devices, fsdp",
        "8 devices, auto", "8 devices, data x model 2", "8 devices, fsdp, 4 micro-batches",
        "8 devices, fsdp, 2 steps per dispatch", "8 devices, fsdp, resumed after step 4"]
    with pytest.raises(meshfit.MeshfitError, match="model:3 does not divide 8 devices"):
        configurations((8,), parse_shardings("model:3"), steps=8)
    with pytest.raises(meshfit.MeshfitError, match="--steps-per-dispatch 3 does not divide --steps 8"):
        configurations((8,), parse_shardings("data"), steps=8, steps_per_dispatch=(3,))
    with pytest.raises(meshfit.MeshfitError, match="unknown sharding 'rows'"):
        parse_shardings("data,rows")
    runs = configurations((1, 4), parse_shardings("data"), steps=4, resume=False, processes=(1, 2),
                          engines=("jax", "tensorflow"))
    assert [r.name for r in runs] == ["4 devices, data", "2 processes x 2 devices, data",
                                      "1 device, tensorflow engine"]
    with pytest.raises(meshfit.MeshfitError, match="--processes 3 does not divide 4 devices"):
        configurations((1, 4), parse_shardings("data"), steps=4, processes=(3,))


def test_bad_input_is_one_line(capsys):
    from meshfit import cli

    assert cli.main(["verify", "fashion-mnist-cnn", "--devices", "1,x"]) == 2
    assert "--devices '1,x': give whole numbers" in capsys.readouterr().err
    assert cli.main(["verify", "fashion-mnist-cnn", "--engines", "jax,torch"]) == 2
    assert "unknown engine 'torch' for --engines" in capsys.readouterr().err
    assert cli.main(["verify", "fashion-mnist-cnn", "--precision", "float32,fp8"]) == 2
    assert "unknown precision 'fp8'" in capsys.readouterr().err
    with pytest.raises(meshfit.MeshfitError, match="does not split over 8 devices"):
        verify(lambda: compiled(mlp()), batch_size=12)
    with pytest.raises(meshfit.MeshfitError, match="must return a compiled Keras model"):
        verify(lambda: mlp())


def test_a_metric_counting_samples_has_one_samples_share_as_its_floor():
    """accuracy moved by one sample of the batch is rounding (a near tie taking the other class),
    even where the floor run moved it by none; by many samples (a metric summed over 8 devices) it
    diverges, named as the metric."""
    import types

    import numpy as np

    from meshfit.run import verify_report

    def trace(accuracies, loss=0.5):
        return types.SimpleNamespace(steps=[1, 2], logs=[{"loss": loss, "accuracy": a} for a in accuracies],
                                     weights=[[np.ones(3)], [np.ones(3)]], paths=["dense/kernel"], seconds=1.0)

    reference, floor = trace([0.18, 0.25]), trace([0.18, 0.25], loss=0.5 + 1e-6)
    verdicts = verify_report.judge(reference, floor, {"one sample": trace([0.181, 0.249]),
                                                      "summed": trace([0.18 * 8, 0.25 * 8])},
                                   roundoff=2.0 ** -9, precision="bfloat16", global_batch=1000)
    ok, summed = verdicts.verdicts
    assert ok.ok and ok.worst <= 1.0 + 1e-9, ok
    assert not summed.ok and summed.diverges_at == 1 and summed.variable == "metric accuracy"


def test_a_reference_that_turns_nan_is_a_one_line_error_and_a_configuration_that_alone_does_diverges():
    """Distances from NaN mean nothing (NaN compares false with every threshold, so everything
    passed): a reference whose weights become NaN or inf is a one-line error naming the step; a
    configuration whose weights alone turn NaN diverges at that step."""
    import types

    from meshfit.run import verify_report

    class Explodes(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):  # 0.1 for the first 2 steps, then inf
            return ops.where(step < 2, 0.1, float("inf"))

    with pytest.raises(meshfit.MeshfitError) as error:
        verify(lambda: compiled(mlp(), keras.optimizers.SGD(Explodes())))
    message = str(error.value)
    assert "\n" not in message and "holds NaN or inf after step 3" in message, message
    assert "(--steps 2)" in message and "lower the learning rate" in message, message

    def trace(kernel):
        return types.SimpleNamespace(steps=[1, 2], logs=[{"loss": 0.5}, {"loss": 0.4}],
                                     weights=[[np.ones(3)], [np.asarray(kernel)]],
                                     paths=["dense/kernel"], seconds=1.0)

    reference = trace([1.0, 1.0, 1.0])
    verdicts = verify_report.judge(reference, reference, {"nan": trace([1.0, np.nan, 1.0])},
                                   roundoff=2.0 ** -24, precision="float32", global_batch=32)
    (verdict,) = verdicts.verdicts
    assert not verdict.ok and verdict.diverges_at == 2 and verdicts.exit_code == 1, verdict


def test_steps_whose_floor_would_pass_any_model_are_not_judged():
    """A model that amplifies rounding until a one-unit nudge moves its weights and loss by more
    than 1/30 (MobileNetV2 from random weights, SGD: 2.0 and 0.23 by step 3) passed every
    configuration, another model included: such steps are left out and named, a defect before
    them still diverges, and a model blind from its first step is a one-line error."""
    import types

    from meshfit.run import verify_report

    def trace(losses, kernels):
        return types.SimpleNamespace(steps=[1, 2, 3], logs=[{"loss": v} for v in losses],
                                     weights=[[np.asarray(k, "float64")] for k in kernels],
                                     paths=["dense/kernel"], seconds=1.0)

    reference = trace([1.0, 0.9, 0.8], [[1.0, 1.0], [1.0, 1.1], [1.0, 1.2]])
    floor = trace([1.0, 0.9 * (1 + 1e-6), 0.8 * 1.5], [[1.0, 1.0], [1.0, 1.1], [3.0, -1.2]])
    other_model = trace([1.0, 0.9, 2.0], [[1.0, 1.0], [1.0, 1.1], [-5.0, 5.0]])
    defect = trace([1.0, 0.95, 0.8], [[1.0, 1.0], [1.0, 1.5], [1.0, 1.2]])
    verdicts = verify_report.judge(reference, floor, {"other model at step 3": other_model,
                                                      "defect at step 2": defect},
                                   roundoff=2.0 ** -24, precision="float32", global_batch=8)
    late, early = verdicts.verdicts
    assert verdicts.judged == 2 and late.ok and late.judged == 2, late
    assert not early.ok and early.diverges_at == 2 and verdicts.exit_code == 1
    lines = verdicts.lines()
    assert lines[2].startswith("step 3 not judged: from step 3 rounding alone moves the weights"), lines
    assert "equal within rounding through step 2" in late.line(3)
    assert verdicts.as_dict()["judged_steps"] == 2
    alone = verify_report.judge(reference, floor, {"other model at step 3": other_model},
                                roundoff=2.0 ** -24, precision="float32", global_batch=8)
    assert alone.lines()[-1] == "every configuration trains the reference's model through step 2 of 3"

    blind = trace([1.5, 0.9, 0.8], [[3.0, -1.0], [1.0, 1.1], [1.0, 1.2]])
    with pytest.raises(meshfit.MeshfitError) as error:
        verify_report.judge(reference, blind, {"any": other_model}, roundoff=2.0 ** -24,
                            precision="float32", global_batch=8)
    assert "\n" not in str(error.value) and "verify cannot judge this model: after step 1" in str(error.value)
