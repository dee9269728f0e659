"""meshfit installs from what the repository builds: `python -m build` makes a wheel and an sdist
whose metadata `twine check` accepts, and the wheel, installed into a fresh virtual environment
away from the checkout, runs `meshfit --version` and `meshfit info --simulate-devices 2`.

Nothing is downloaded: the build runs without isolation (setuptools and build come with the test
extra), the wheel installs with --no-deps, and its dependencies (JAX, Keras...) are read from this
test environment's site-packages, appended to the fresh environment's path by a .pth file after
the install. A .pth line adds a folder without running the .pth files in it, so the checkout's
editable install of meshfit stays invisible there: the test asserts the installed copy ran."""

import json
import os
import site
import subprocess
import sys
import zipfile

import pytest
from helpers import ONE_CPU, environment

from meshfit import __version__

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env=environment({**ONE_CPU, "PYTHONPATH": None}))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_wheel_builds_passes_twine_check_and_runs_from_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), ROOT, cwd=tmp_path)
    wheel, sdist = (dist / f"meshfit-{__version__}-py3-none-any.whl", dist / f"meshfit-{__version__}.tar.gz")
    assert wheel.is_file() and sdist.is_file(), os.listdir(dist)
    run(sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist), cwd=tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(f"meshfit-{__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"meshfit-{__version__}.dist-info/entry_points.txt").decode()
    assert "meshfit/recipes/fashion_mnist_cnn.py" in names and not [n for n in names if n.startswith("tests/")]
    assert "meshfit = meshfit.cli:main" in entry_points
    assert "Requires-Dist: jax<0.13,>=0.6" in metadata  # JAX 0.11 (the GPU runs) and 0.12 are in range
    assert 'Provides-Extra: cuda13' in metadata and 'Provides-Extra: cuda12' in metadata

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
        "--no-compile", str(wheel), cwd=tmp_path)
    own = run(str(python), "-c", "import site; print(site.getsitepackages()[0])", cwd=tmp_path)
    with open(os.path.join(own.stdout.strip(), "dependencies.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")

    where = run(str(python), "-c", "import meshfit; print(meshfit.__file__)", cwd=tmp_path)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the installed copy, not ROOT
    version = run(str(venv / "bin" / "meshfit"), "--version", cwd=tmp_path)
    assert version.stdout.startswith(f"meshfit {__version__} (Python "), version.stdout
    info = run(str(venv / "bin" / "meshfit"), "info", "--simulate-devices", "2", "--json", cwd=tmp_path)
    report = json.loads(info.stdout.strip().splitlines()[-1])
    assert report["replicas"] == 2 and report["simulated"] and report["engine"] == "jax"
