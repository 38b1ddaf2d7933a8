# Two commands do everything: `make demo` and `make test`. Setup steps are idempotent (stamp files).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup setup-docker setup-sglang setup-chromium model bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: here it is a local CPU build (seconds); an unpinned torch would pull multi-GB CUDA wheels.
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

setup: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/verl-agent model build-tiny

setup-docker:
	bash scripts/setup_docker.sh

setup-sglang:
	bash scripts/setup_sglang.sh

setup-chromium:
	bash scripts/setup_chromium.sh

demo: setup model
	$(PY) -m verl_agent train examples/calculator/config.yaml

test: setup model setup-docker setup-sglang setup-chromium
	$(PY) -m pytest -q -ra --durations=15

bench: setup model
	$(PY) bench/rollout.py
	$(PY) bench/sandbox.py
	$(PY) bench/containers.py

clean:
	rm -rf $(VENV) .venv-sglang runs .pytest_cache
