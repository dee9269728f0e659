# Two commands do all the set-up: `make train` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= ../shared/data

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,onnx,test,docs]'
	touch $@

.PHONY: install train test
install: $(VENV)/.installed

# The datasets of $(DATA) where that folder exists; else meshfit downloads them on first use.
train: $(VENV)/.installed
	$(VENV)/bin/meshfit train fashion-mnist-cnn $(if $(wildcard $(DATA)),--data-dir $(DATA))

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=30  # a test file per CPU core
