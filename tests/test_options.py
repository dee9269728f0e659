"""The settings of a training run (meshfit.run.options.TrainOptions): one name, one default and
one check each, from the flags and from Python alike, into config.json's RunSpec."""

import dataclasses

import pytest

import meshfit
from meshfit import cli
from meshfit.run import spec
from meshfit.run.options import TrainOptions


def parsed(*argv):
    return cli._parser("train").parse_args(["train", *argv])


def test_flags_become_the_same_options_as_python_keywords():
    args = parsed("--epochs", "2", "--global-batch", "64", "--precision", "bf16", "--seed", "7",
                  "--simulate-devices", "8", "--no-tensorboard", "--checkpoint-every", "epoch",
                  "--fsdp-min-bytes", "2MiB")
    from_flags = TrainOptions.from_args(args)
    from_python = TrainOptions(epochs=2, global_batch=64, precision="bfloat16", seed=7,
                               simulate_devices=8, tensorboard=False, checkpoint_every="epoch",
                               fsdp_min_bytes="2MiB")
    assert from_flags == from_python
    assert from_flags.precision == "bfloat16"  # an alias is named once, canonically
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_flags.epochs = 3


def test_every_setting_has_one_default_on_both_routes():
    from_flags, from_python = TrainOptions.from_args(parsed()), TrainOptions()
    assert from_flags == from_python
    assert from_python.given() == {}


def test_the_settings_config_json_records_keep_their_names():
    """A setting recorded in config.json has the RunSpec field of the same name (the batch asked
    for and the planned global batch are both global_batch)."""
    recorded = {f.name for f in dataclasses.fields(spec.RunSpec)}
    for name in ("epochs", "steps_per_epoch", "seed", "precision", "data_dir", "validation_split",
                 "checkpoint_every", "keep_checkpoints", "steps_per_dispatch", "micro_batches",
                 "sharding", "global_batch", "simulate_devices", "fsdp_min_bytes"):
        assert name in recorded, name
        assert name in TrainOptions.__dataclass_fields__


@pytest.mark.parametrize("settings, message", [
    ({"epochs": 0}, "--epochs must be at least 1, got 0"),
    ({"global_batch": -1}, "--global-batch must be at least 1, got -1"),
    ({"keep_checkpoints": 0}, "--keep-checkpoints must be at least 1"),
    ({"log_every": 0}, "--log-every must be at least 1"),
    ({"validation_split": 1.0}, "--validation-split must be at least 0 and below 1"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"seed": -1}, "seed -1 is out of range"),
    ({"checkpoint_every": "often"}, "--checkpoint-every 'often' is not understood"),
    ({"profile": "5:2"}, "--profile '5:2' is not understood"),
    ({"steps_per_dispatch": 0}, "steps per dispatch must be a whole number"),
    ({"micro_batches": 0}, "micro-batches must be a whole number"),
])
def test_a_bad_setting_is_one_line_meshfit_error_when_made(settings, message):
    with pytest.raises(meshfit.MeshfitError, match=message.replace("*", r"\*")) as caught:
        TrainOptions(**settings)
    assert "\n" not in str(caught.value)


def test_an_unknown_setting_is_refused_by_train():
    from meshfit.run.train import train

    with pytest.raises(TypeError, match="epoch"):
        train("fashion-mnist-cnn", epoch=1)


def test_bad_flag_values_fail_in_one_line(capsys):
    assert cli.main(["train", "--precision", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == ("meshfit: error: unknown precision 'fp8'; use one "
                                               "of: auto, float32, bfloat16, float16")


def test_the_older_spellings_of_renamed_settings_are_still_accepted(strategy):
    """Renamed for one name per setting, the flags --batch-size and --fsdp-min-size, the Python
    keywords batch_size and fsdp_min_size (train), simulate (connect) and batch_size (EpochReport)
    still work and mean the same."""
    from meshfit.run.options import current_names
    from meshfit.watch.keras_side.report import EpochReport

    old = TrainOptions.from_args(parsed("--batch-size", "64", "--fsdp-min-size", "2MiB"))
    new = TrainOptions.from_args(parsed("--global-batch", "64", "--fsdp-min-bytes", "2MiB"))
    assert old == new and new.global_batch == 64 and new.fsdp_min_bytes == "2MiB"
    assert current_names({"batch_size": 64, "fsdp_min_size": "1MiB", "epochs": 1}) == {
        "global_batch": 64, "fsdp_min_bytes": "1MiB", "epochs": 1}
    with pytest.raises(meshfit.MeshfitError, match="batch_size is the older name of global_batch"):
        current_names({"batch_size": 64, "global_batch": 64})
    assert meshfit.connect(simulate=8, engine="jax", verbose=False).replicas == 8
    assert EpochReport(batch_size=16).global_batch == 16
    bench = cli._parser("bench").parse_args(["bench", "--batch-sizes", "8,16"])
    assert bench.global_batches == "8,16"


def flags_of(command: str) -> dict:
    """The arguments of `meshfit COMMAND` by destination, as its --help shows them."""
    parser = cli._parser(command).commands[command]
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("command", ["info", "plan", "eval"])
def test_commands_take_the_run_settings_flags_as_train_declares_them(command):
    """One declaration per setting: info, plan and eval take the flags of TrainOptions as train
    does (name, older spellings, default, type, help; the help without --resume's part)."""
    from meshfit.run import options

    train, own = flags_of("train"), {"help", "json", "recipe", "model", "data"}
    shared = {dest: a for dest, a in flags_of(command).items() if dest not in own}
    if command == "eval":  # eval's --data-dir is the run's: its own flag, with its own default
        shared.pop("data_dir")
    assert set(shared) <= set(TrainOptions.__dataclass_fields__), set(shared)
    assert {"simulate_devices", "engine", "require"} <= set(shared)
    for dest, action in shared.items():
        meant = train[dest]
        assert (action.option_strings, action.default, action.type, action.metavar,
                action.choices) == (meant.option_strings, meant.default, meant.type, meant.metavar,
                                    meant.choices), dest
        assert action.help == meant.help.replace(options.ON_RESUME, ""), dest


def test_connect_and_the_options_have_the_same_defaults():
    """The settings meshfit.connect() takes default as TrainOptions declares them (the engine
    and precision in the light core, which connect() needs before Keras)."""
    import inspect

    from meshfit.parallel import engine, planning
    from meshfit.run import options

    keywords = inspect.signature(meshfit.connect).parameters
    for name in (*options.CONNECT, "verbose"):
        assert keywords[name].default == options.default(name), name
    assert options.default("precision") == planning.DEFAULT_PRECISION
    assert engine.choose_engine(options.default("engine"), "cpu", 8) == "jax"  # None: auto


def test_each_default_is_written_once_and_is_what_its_flag_says():
    """The seed, the kept checkpoints, the folder validation split, log_every, the engine and the
    precision: the value each help text names is the one every function applying it defaults to."""
    import inspect

    from meshfit.data import FOLDER_VALIDATION_SPLIT, arrays, datasets, folders, order, splits
    from meshfit.parallel import engine, planning
    from meshfit.run import options
    from meshfit.run.keras_side import checkpoint_save, checkpoints
    from meshfit.watch.keras_side import tensorboard

    def default(function, name):
        return inspect.signature(function).parameters[name].default

    helps = {dest: action.help for dest, action in flags_of("train").items()}
    shown = {"seed": order.DEFAULT_SEED, "keep_checkpoints": spec.DEFAULT_KEEP_CHECKPOINTS,
             "checkpoint_every": spec.DEFAULT_CHECKPOINT_EVERY,
             "validation_split": FOLDER_VALIDATION_SPLIT, "log_every": options.default("log_every"),
             "engine": engine.DEFAULT_ENGINE, "precision": planning.DEFAULT_PRECISION}
    for name, value in shown.items():
        assert f"(default: {value}" in helps[name], (name, helps[name])
    assert spec.check_seed(None) == order.DEFAULT_SEED
    for function in (datasets.image_folder, arrays.TrainBatches, folders.FolderTrainBatches):
        assert default(function, "seed") == order.DEFAULT_SEED
    assert default(datasets.image_folder, "validation_split") == FOLDER_VALIDATION_SPLIT
    assert splits.default_validation_split("my/images") == FOLDER_VALIDATION_SPLIT
    for function in (checkpoint_save.save, checkpoint_save.begin_save, checkpoints.Checkpointer):
        assert default(function, "keep") == spec.DEFAULT_KEEP_CHECKPOINTS
    recorded = spec.RunSpec.__dataclass_fields__["keep_checkpoints"].default  # older config.json
    assert recorded == spec.DEFAULT_KEEP_CHECKPOINTS
    assert default(tensorboard.TensorBoardLog, "log_every") is inspect.Parameter.empty  # a run's
    assert planning.precision_name(None) == planning.DEFAULT_PRECISION
