"""The command line as a new user first meets it: --version, mistyped flags and commands, help
texts that hold for the command they are shown by, the recipe list, and the public names of
`import meshfit`. In-process where no devices are touched, so quick."""

import subprocess
import sys

import pytest
from helpers import ONE_CPU, environment

from meshfit import __version__, cli


def error_line(capsys, *argv) -> str:
    """The one line `meshfit argv...` prints on stderr, exit code 2, with nothing on stdout."""
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:  # argparse's own exit, for a bad value
        code = stop.code
    out = capsys.readouterr()
    assert code == 2 and out.out == "", out
    assert out.err.count("\n") == 1 and out.err.count("meshfit:") == 1, out.err
    return out.err.strip()


def test_version_names_meshfit_python_and_the_engines(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"meshfit {__version__} (Python 3.") and "JAX 0." in line, line


def test_version_names_keras_nightly_as_keras(monkeypatch):
    from importlib import metadata

    installed = {"jax": "0.12.0.1", "keras-nightly": "3.16.0.dev2026102704", "tensorflow": "2.21.0",
                 "tensorflow-cpu": "2.21.0"}

    def version(package):
        if package not in installed:
            raise metadata.PackageNotFoundError(package)
        return installed[package]

    monkeypatch.setattr(metadata, "version", version)
    assert cli.version_text().endswith("; JAX 0.12.0.1, Keras 3.16.0.dev2026102704, TensorFlow 2.21.0)")


@pytest.mark.parametrize("argv,line", [
    (["train", "--epoch", "1"], "meshfit: error: unrecognized argument --epoch for meshfit train; "
                                "did you mean --epochs? (see meshfit train --help)"),
    (["train", "--batchsize=8"], "meshfit: error: unrecognized argument --batchsize for meshfit "
                                 "train; did you mean --batch-size? (see meshfit train --help)"),
    (["predict", "run", "a.png", "--top", "2"], "meshfit: error: unrecognized argument --top for "
                                                "meshfit predict; did you mean --top-k? (see "
                                                "meshfit predict --help)"),
    (["info", "extra"], "meshfit: error: unrecognized argument extra for meshfit info (see meshfit "
                        "info --help)"),
    (["trian"], "meshfit: error: unknown command 'trian'; did you mean train? (see meshfit --help)"),
    (["train", "--epochs", "many"], "meshfit: error: argument --epochs: invalid int value: 'many' "
                                    "(see meshfit train --help)"),
])
def test_a_mistyped_argument_is_one_line_with_the_closest_one(capsys, argv, line):
    assert error_line(capsys, *argv) == line


def test_an_abbreviated_flag_is_refused_not_guessed(capsys):
    # argparse would take --keep for --keep-checkpoints and --sim for --simulate-devices
    for flag, meant in (("--keep", "--keep-checkpoints"), ("--sim", "--simulate-devices")):
        line = error_line(capsys, "train", flag, "2")
        assert f"unrecognized argument {flag} for meshfit train" in line
        assert f"did you mean {meant}?" in line


@pytest.mark.parametrize("command", ["info", "plan", "bench"])
def test_flag_help_of_commands_without_resume_does_not_mention_it(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = capsys.readouterr().out
    assert "--sharding" in shown and "--resume" not in shown


def test_the_recipe_list_gives_each_recipe_whole_first_sentence(capsys):
    assert cli.main(["recipe"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()
            and not line.startswith("meshfit ")]
    assert len(rows) >= 5 and all(row.rstrip().endswith(".") for row in rows), rows
    assert any(row.startswith("cifar10-fast") and 'How to train your ResNet".' in row for row in rows)


def test_dir_of_meshfit_lists_the_public_names_without_importing_keras():
    code = ("import sys, meshfit; names = dir(meshfit); "
            "print(all(n in names for n in meshfit.__all__), 'keras' in sys.modules, "
            "'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=environment(ONE_CPU))
    assert out.stdout.split() == ["True", "False", "False"], out.stderr


def test_a_missing_data_dir_is_named_before_connecting(capsys, tmp_path):
    for command in (["train"], ["plan"]):
        line = error_line(capsys, *command, "--data-dir", str(tmp_path / "dat"))
        assert line.startswith(f"meshfit: error: --data-dir {tmp_path / 'dat'} does not exist;")
        assert line.endswith("(see docs/troubleshooting.md#dataset-not-found)")
    (tmp_path / "notes.txt").write_text("")
    assert "is a file, not a folder" in error_line(capsys, "train", "--data-dir",
                                                   str(tmp_path / "notes.txt"))


def test_a_recipe_name_with_underscores_is_the_recipe_and_a_typo_gets_a_did_you_mean(capsys):
    """fashion_mnist_cnn (its module's spelling) is fashion-mnist-cnn; a mistyped name is one line
    naming the closest built-in recipe."""
    from meshfit import cli, recipes

    assert recipes.get("fashion_mnist_cnn").name == "fashion-mnist-cnn"
    assert not recipes.is_file("fashion_mnist_cnn")
    assert cli.main(["recipe", "fashion_mnist_cnn"]) == 0
    assert capsys.readouterr().out.startswith('"""fashion-mnist-cnn:')
    for typo, meant in (("fashon-mnist-cnn", "fashion-mnist-cnn"), ("cifar10", "cifar10-cnn")):
        assert cli.main(["recipe", typo]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"unknown recipe {typo!r} (did you mean {meant}?)" in err[0], err
