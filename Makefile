# Two commands do all the set-up: `make train` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= ../shared/data
# The second version set of `make test`: Python 3.13 with the newest JAX and Keras that the ranges
# of pyproject.toml admit (docs/installation.md, "Compatibility"). The interpreter: pyenv's 3.13,
# else python3.13 on the PATH, else the one named: `make test PYTHON_NEWEST=/path/to/python3.13`.
NEWEST_VENV ?= .venv-newest
PYTHON_NEWEST ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.13*/bin/python) $(shell command -v python3.13))
# The core of the suite that the second set runs, its tests not marked slow, and keras-hub's
# models (test_hub: the first-class fine-tuning path on the newest keras-hub).
CORE_TESTS := tests/test_devices.py tests/test_conformance.py tests/test_sharding.py \
	tests/test_keras_hooks.py tests/test_checkpoints.py tests/test_launch.py tests/test_compatibility.py \
	tests/test_seam.py tests/test_hub.py

# A set's packages (tools/requirements.py: pyproject.toml's, with the extras named), then meshfit
# itself. `make test` installs both sets' packages side by side: each pip keeps about one core busy
# (2 and 1 min in a row on a 2-core VM, 40-50% of the CPU idle), and meshfit after them, one set
# after the other, as its install writes meshfit.egg-info into this folder.
$(VENV)/.packages: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) tools/requirements.py cpu,onnx,test,docs > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	touch $@

$(VENV)/.installed: $(VENV)/.packages
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# A Python 3.13 venv with a version set's packages, then meshfit: $(1) the venv, $(2) the variable
# that names its Python, $(3) the make target that needs it, $(4) the extras. No TensorFlow-free
# shortcut: the core tests run meshfit on TensorFlow too (its one-CPU engine).
define python313_venv
$(1)/.packages: pyproject.toml
	@test -n "$$($(2))" || { echo "make $(3): needs Python 3.13: none in $$(or $$(PYENV_ROOT),$$(HOME)/.pyenv)/versions or on the PATH; install one (pyenv install 3.13) or name it: make $(3) $(2)=/path/to/python3.13"; exit 1; }
	$$($(2)) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python tools/requirements.py $(4) > $(1)/requirements.txt
	$(1)/bin/python -m pip install -q --upgrade -r $(1)/requirements.txt
	touch $$@

$(1)/.installed: $(1)/.packages
	$(1)/bin/python -m pip install -q --no-deps -e .
	touch $$@
endef
SECOND_SET_EXTRAS := cpu,hub,test-core
$(eval $(call python313_venv,$(NEWEST_VENV),PYTHON_NEWEST,test,$(SECOND_SET_EXTRAS)))

# `make test-next` (not in `make test`, not in CI): one release ahead. Python 3.13 (pyenv's, else
# python3.13 on the PATH, else `make test-next PYTHON_NEXT=/path/to/python3.13`) with the newest
# set's packages, then Keras' and keras-hub's nightly builds in place of their releases, and the
# core of the suite plus tests/test_hub.py (docs/installation.md, "Compatibility").
NEXT_VENV ?= .venv-next
PYTHON_NEXT ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.13*/bin/python) $(shell command -v python3.13))

$(eval $(call python313_venv,$(NEXT_VENV),PYTHON_NEXT,test-next,$(SECOND_SET_EXTRAS)))

.PHONY: install train test test-current test-newest
install: $(VENV)/.installed

# The datasets of $(DATA) where that folder exists; else meshfit downloads them on first use.
train: $(VENV)/.installed
	$(VENV)/bin/meshfit train fashion-mnist-cnn $(if $(wildcard $(DATA)),--data-dir $(DATA))

# Both version sets, one after the other (CI runs this).
test:
	$(MAKE) -j2 $(VENV)/.packages $(NEWEST_VENV)/.packages
	$(MAKE) test-current
	$(MAKE) test-newest

test-current: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=30  # a test file per CPU core

test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/python -m meshfit --version  # the set's versions, for the log
	$(NEWEST_VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=10 -m "not slow" $(CORE_TESTS)

.PHONY: test-next
# The nightlies on every run (the newest of the day): keras-nightly installs the package `keras`
# under another name, so the releases go first; --no-deps, as keras-hub-nightly asks for `keras`,
# and --force-reinstall, as a later install of the releases would overwrite the same files.
test-next: $(NEXT_VENV)/.installed
	$(NEXT_VENV)/bin/python -m pip uninstall -q -y keras keras-hub
	$(NEXT_VENV)/bin/python -m pip install -q --upgrade --force-reinstall --pre --no-deps keras-nightly keras-hub-nightly
	$(NEXT_VENV)/bin/python -m meshfit --version  # the set's versions, for the log
	$(NEXT_VENV)/bin/python -m pip list 2>/dev/null | grep -iE "^(keras|jax)"
	$(NEXT_VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=10 -m "not slow" $(filter-out tests/test_hub.py,$(CORE_TESTS)) tests/test_jax_loop.py; \
	core=$$?; $(NEXT_VENV)/bin/python -m pytest -q -n 1 --dist load -rfE -m "not slow" tests/test_hub.py; exit $$((core || $$?))  # apart, and in a worker: a test that aborts the process is one failure, the rest still run
