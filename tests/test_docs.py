"""The documentation site: `mkdocs build --strict` passes (broken links, bad API references and
docstrings fail it), and its CLI reference, generated from meshfit.cli, has exactly the flags of
`meshfit COMMAND --help`."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def cli_reference():
    spec = importlib.util.spec_from_file_location(
        "cli_reference", os.path.join(ROOT, "docs", "hooks", "cli_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_offline(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
         "-d", str(site)], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=environment({"NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": ROOT}))
    assert done.returncode == 0, done.stdout + done.stderr
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    assert "--checkpoint-every" in cli_page and "meshfit predict" in cli_page
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "Find the devices, pick engine and precision" in api_page  # connect's docstring
    assert (site / "notebooks" / "01_fashion_mnist_cnn.ipynb").is_file()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


def _sections(markdown: str) -> dict[str, str]:
    parts = re.split(r"^## meshfit (\w+)$", markdown, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_cli_reference_lists_exactly_the_flags_of_help(capsys):
    from meshfit import cli

    sections = _sections(cli_reference().markdown())
    assert list(sections) == list(cli.COMMANDS)
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        shown = capsys.readouterr().out
        options = shown.split("options:", 1)[1] if "options:" in shown else shown
        listed = {line.split(": ", 1)[0] for line in sections[name].splitlines() if line.startswith("- ")}
        documented = set(FLAG.findall(" ".join(listed)))
        helped = {f for line in options.splitlines() if line.startswith("  -")
                  for f in FLAG.findall(line.split("  ")[1] if line.startswith("  -") else "")}
        assert documented == helped, (name, documented ^ helped)
        assert "--help" in documented
