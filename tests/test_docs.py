"""The documentation site: `mkdocs build --strict` passes (broken links and anchors, bad API
references and docstrings fail it), and its CLI reference, generated from meshfit.cli, has exactly
the flags of `meshfit COMMAND --help`. The pages hold in the repository too: their relative links
resolve there, every troubleshooting entry the code points to exists, and every `meshfit` command
they show names a command and flags that exist."""

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
    assert _unresolved_site_links(site) == []


def _unresolved_site_links(site) -> list[str]:
    """The relative links of the built site's pages that lead to no file of the site."""
    unresolved = []
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"]+)"', page.read_text()):
            path = href.split("#", 1)[0].split("?", 1)[0]
            if not path or re.match(r"[a-z]+:", path) or path.startswith("/"):
                continue
            target = (page.parent / path).resolve()
            if not (target.is_file() or (target / "index.html").is_file()):
                unresolved.append(f"{page.relative_to(site)}: {href}")
    return unresolved


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


# ------------------------------------------------------------------ the pages agree with the repo

PAGES = sorted([os.path.join(ROOT, "README.md")]
               + [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "docs"))
                  for f in files if f.endswith(".md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _prose(markdown: str) -> str:
    """The text without fenced code blocks and inline code spans (their brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", markdown))


def _anchors(path: str) -> set[str]:
    """The heading anchors MkDocs gives the page (markdown's toc slugs)."""
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", open(path, encoding="utf-8").read())
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+\s+(.+?)\s*$", text, re.M)}


def test_relative_links_resolve_in_the_repository():
    """Every relative link of README.md and docs/ names a file of the repository, and an anchor one
    of its headings (the site build checks the same links strictly, mkdocs.yml `validation`)."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(open(page, encoding="utf-8").read())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_troubleshooting_pointer_of_the_code_has_its_entry():
    """`see="anchor"` and `troubleshooting("anchor")` in meshfit/ name headings of the page."""
    from meshfit.errors import TROUBLESHOOTING

    named = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "meshfit")):
        for name in files:
            if name.endswith(".py") and name != "errors.py":  # its docstring's example
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                named |= set(re.findall(r"""(?:see=|troubleshooting\()["']([\w-]+)["']""", text))
    assert len(named) >= 6, named
    assert named <= _anchors(os.path.join(ROOT, TROUBLESHOOTING)), named - _anchors(os.path.join(ROOT, TROUBLESHOOTING))


def _meshfit_commands(markdown: str):
    """(command, flags) of every `meshfit COMMAND ...` in the shell code blocks and in the inline
    code spans that begin with `meshfit `, also inside `--command="..."` and after `launch --`."""
    import shlex

    snippets = FENCE.findall(markdown) + re.findall(r"`(meshfit [^`\n]+)`", markdown)
    for snippet in snippets:
        for line in snippet.replace("\\\n", " ").splitlines():
            if "meshfit" not in line or line.lstrip().startswith(("import", "from", ">>>")):
                continue
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote in prose-like text
                tokens = line.split()
            words = [w for t in tokens for w in (t.split("=", 1)[1].split() if t.startswith("--command=")
                                                  else [t])]
            for i, word in enumerate(words):
                if word.rsplit("/", 1)[-1] == "meshfit" and i + 1 < len(words) and \
                        not words[i + 1].startswith(("-", "[")) and words[i - 1:i] != ["import"]:
                    rest = words[i + 2:]
                    end = next((j for j, w in enumerate(rest) if w in ("--", "|", "&&", ";", ">")
                                or w.rsplit("/", 1)[-1] == "meshfit"), len(rest))
                    flags = {m for w in rest[:end] for m in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", w)}
                    yield words[i + 1], flags


def test_shell_commands_of_the_docs_name_commands_and_flags_that_exist():
    """Each `meshfit COMMAND --flag` shown in README.md, docs/ and BENCHMARKS.md exists as shown."""
    from meshfit import cli

    seen, wrong = 0, []
    for page in PAGES + [os.path.join(ROOT, "BENCHMARKS.md")]:
        for command, flags in _meshfit_commands(open(page, encoding="utf-8").read()):
            seen += 1
            where = os.path.relpath(page, ROOT)
            if command not in cli.COMMANDS:
                if not command.isupper():  # COMMAND, a placeholder
                    wrong.append(f"{where}: meshfit {command}")
                continue
            parser = cli._parser(command).commands[command]
            unknown = flags - set(parser._option_string_actions)
            if unknown:
                wrong.append(f"{where}: meshfit {command} {' '.join(sorted(unknown))}")
    assert seen > 50 and not wrong, "\n".join(wrong)


def test_no_page_says_a_cpu_has_no_mfu():
    """A CPU's peak FLOP/s is measured (meshfit.watch.peak), so its epoch lines show an MFU: no
    sentence of the docs says a CPU gets `n/a`, and no example epoch line shows `MFU n/a`."""
    wrong = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", open(page, encoding="utf-8").read())
        for sentence in re.split(r"[.!?] ", text):
            if re.search(r"\bCPUs?\b", sentence) and "n/a" in sentence or re.search(r"epoch \d+/\d+ .*MFU n/a", sentence):
                wrong.append(f"{os.path.relpath(page, ROOT)}: {sentence[:120]}")
    assert not wrong, "\n".join(wrong)


def test_every_extra_the_docs_name_exists():
    """Each `meshfit[extra,...]` and `.[extra,...]` of README.md, docs/, tools/, the notebooks and
    the Makefile is an extra of pyproject.toml (`meshfit[cuda]` is none: cuda12 and cuda13 are)."""
    project = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    section = project.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([a-z0-9_-]+) = \[", section, re.M))  # tomllib is Python 3.11's
    assert {"cpu", "cuda12", "cuda13", "hub", "test"} <= extras, extras
    files = PAGES + [os.path.join(ROOT, "Makefile")] + [
        os.path.join(d, f) for top in ("tools", "notebooks") for d, _, names in os.walk(os.path.join(ROOT, top))
        for f in names]
    wrong, seen = [], 0
    for path in files:
        for named in re.findall(r"(?:meshfit|whl|\.)\[([a-z0-9_,-]+)\]", open(path, encoding="utf-8").read()):
            seen += 1
            wrong += [f"{os.path.relpath(path, ROOT)}: [{extra}]" for extra in named.split(",") if extra not in extras]
    assert seen > 20 and not wrong, "\n".join(wrong)


REPO_PATH = re.compile(r"(?<![\w/.:-])((?:meshfit|benchmarks|tests|tools|docs|notebooks)/[\w./-]*\w)")


def test_every_repository_path_the_docs_name_exists():
    """Each path into the repository (meshfit/..., benchmarks/..., tests/..., tools/...) that
    README.md, docs/ and BENCHMARKS.md name exists, or the page names the commit that had it
    (`git show COMMIT:path`, for a benchmark's row run with a script since removed)."""
    wrong = []
    for page in PAGES + [os.path.join(ROOT, "BENCHMARKS.md")]:
        text = open(page, encoding="utf-8").read()
        for path in sorted(set(REPO_PATH.findall(text))):
            if not os.path.exists(os.path.join(ROOT, path)) and not re.search(rf"\b[0-9a-f]{{7,40}}:{re.escape(path)}\b", text):
                wrong.append(f"{os.path.relpath(page, ROOT)}: {path}")
    assert not wrong, "\n".join(wrong)


def test_make_train_names_the_data_folder_only_where_it_exists(tmp_path):
    """README's `make train` on a machine without ../shared/data: meshfit train is called without
    --data-dir (which would refuse a missing folder), so the datasets are downloaded; with the
    folder, it is passed. (`make -n`: the commands, none run.)"""
    for data, passed in ((tmp_path / "missing", False), (tmp_path, True)):
        out = subprocess.run(["make", "-n", "train", f"DATA={data}", f"VENV={tmp_path / 'venv'}"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        line = next(line for line in out.splitlines() if "meshfit train fashion-mnist-cnn" in line)
        assert line.strip().endswith(f"--data-dir {data}" if passed else "fashion-mnist-cnn"), line


def test_make_test_runs_the_suite_then_its_core_on_the_second_version_set(tmp_path):
    """README's `make test` (CI's command) runs the whole suite in .venv, then the core of it in a
    venv of the Python 3.13 it finds or is given (docs/installation.md, "Compatibility"); with no
    Python 3.13 it stops with one line that says how to give one, never skipping the second set."""
    venvs = [f"VENV={tmp_path / 'venv'}", f"NEWEST_VENV={tmp_path / 'newest'}"]
    out = subprocess.run(["make", "-n", "test", "PYTHON_NEWEST=/opt/py313/bin/python3.13", *venvs],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    runs = [line for line in out.splitlines() if " -m pytest " in line]
    assert len(runs) == 2 and runs[0].startswith(f"{tmp_path / 'venv'}/bin/python"), out
    assert runs[1].startswith(f"{tmp_path / 'newest'}/bin/python") and "tests/test_sharding.py" in runs[1], out
    assert "tests/test_hub.py" in runs[1], out
    assert f"/opt/py313/bin/python3.13 -m venv {tmp_path / 'newest'}" in out
    # its packages: pyproject.toml's with the cpu, hub and test-core extras, then meshfit itself
    assert f"{tmp_path / 'newest'}/bin/python tools/requirements.py cpu,hub,test-core" in out, out
    assert f"{tmp_path / 'newest'}/bin/python -m pip install -q --no-deps -e ." in out, out
    missing = subprocess.run(["make", "test-newest", "PYTHON_NEWEST=", *venvs], cwd=ROOT, capture_output=True,
                             text=True)
    assert missing.returncode != 0 and not (tmp_path / "newest").exists()
    assert "needs Python 3.13" in missing.stdout and "PYTHON_NEWEST=" in missing.stdout, missing.stdout

RESOLVE = """
import json, sys
import meshfit

def missing(names):
    wrong = []
    for name in names:
        value = meshfit
        try:
            for part in name.split(".")[1:]:
                value = getattr(value, part)
        except AttributeError as e:
            wrong.append(f"{name}: {e}")
    return wrong

names = json.loads(sys.argv[1])
keras_side = [n for n in names if n.startswith("meshfit.fit.") or ".keras_side." in n]
before = missing([n for n in names if n not in keras_side])
meshfit.connect(verbose=False)
print(json.dumps(before + missing(keras_side)))
"""


def test_every_meshfit_name_the_docs_show_works_after_import_meshfit():
    """`meshfit.data.datasets.load` and every other dotted name of README.md and docs/ (the API
    reference names functions by their modules) is reached from `import meshfit` alone, as a
    user types it; those of fit/, the Keras side, once connect() has chosen the engine."""
    import json

    names = sorted({n for page in PAGES for n in re.findall(r"(?<![\w/.:-])meshfit(?:\.[A-Za-z_]\w*)+",
                                                           open(page, encoding="utf-8").read())})
    assert "meshfit.data.datasets.load" in names and len(names) > 20, names
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(names)], capture_output=True,
                         text=True, env=environment({"XLA_FLAGS": ""}), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_requirements_make_installs_are_pyprojects_with_the_extras_expanded():
    """tools/requirements.py, which `make` installs each version set's packages from: the
    dependencies and the extras named, meshfit's own extras (test's meshfit[test-core]) expanded."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "requirements.py"), "cpu,test"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    names = [re.split(r"[<>=\[]", line)[0] for line in out]
    assert {"keras", "jax", "orbax-checkpoint", "tensorflow-cpu", "grain", "pytest", "pytest-xdist"} <= set(names)
    assert len(names) == len(set(names)) and not any(line.startswith("meshfit") for line in out), out
    assert "mkdocs" not in names  # docs was not asked for


def test_make_test_next_runs_the_core_on_keras_nightly_and_is_not_in_make_test(tmp_path):
    """`make test-next` (docs/installation.md, "Compatibility"): a venv of the Python 3.13 it finds
    or is given, the newest set's packages, then keras-nightly and keras-hub-nightly in place of
    the releases (whose files they share), meshfit, and the core of the suite; `make test` (CI)
    runs none of it; with no Python 3.13 it stops with one line saying how to give one."""
    venvs = [f"VENV={tmp_path / 'venv'}", f"NEWEST_VENV={tmp_path / 'newest'}", f"NEXT_VENV={tmp_path / 'next'}"]
    out = subprocess.run(["make", "-n", "test-next", "PYTHON_NEXT=/opt/py313/bin/python3.13", *venvs],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    python = f"{tmp_path / 'next'}/bin/python"
    order = [f"/opt/py313/bin/python3.13 -m venv {tmp_path / 'next'}",
             f"{python} tools/requirements.py cpu,hub,test-core",
             f"{python} -m pip install -q --no-deps -e .",
             f"{python} -m pip uninstall -q -y keras keras-hub",
             f"{python} -m pip install -q --upgrade --force-reinstall --pre --no-deps keras-nightly keras-hub-nightly",
             f"{python} -m meshfit --version", f"{python} -m pytest"]
    at = [out.find(step) for step in order]
    assert -1 not in at and at == sorted(at), out
    assert "tests/test_sharding.py" in out and "tests/test_hub.py" in out
    ci = subprocess.run(["make", "-n", "test", "PYTHON_NEWEST=/opt/py313/bin/python3.13", *venvs],
                        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "nightly" not in ci and str(tmp_path / "next") not in ci, ci
    missing = subprocess.run(["make", "test-next", "PYTHON_NEXT=", *venvs], cwd=ROOT, capture_output=True,
                             text=True)
    assert missing.returncode != 0 and not (tmp_path / "next").exists()
    # one line of its own (a make run inside `make test`, as in CI, adds its directory lines around it)
    assert any(line.startswith("make test-next: needs Python 3.13") for line in missing.stdout.splitlines()), \
        missing.stdout
    assert "PYTHON_NEXT=" in missing.stdout
