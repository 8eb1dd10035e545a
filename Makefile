# Quick start: `make lab` (set up, open JupyterLab on the first notebook), `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch (on this project's machines it lies on disk). With a GPU,
# install your CUDA torch into $(VENV) first: an importable torch is left alone.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
LAB_PORT ?= 8888

.PHONY: setup lab lint test test-fast demo bench gpu-check browser-deps clean binder-lock binder-link docs package-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# Run-time packages at the versions binder/constraints.txt pins (what Binder installs too);
# `make binder-lock` rewrites it from .venv after a change of dependencies. Then, where Python
# >= 3.11, tinker-cookbook (tests/test_cookbook.py) with --no-deps: it requires tml-renderers,
# which PyPI lacks (used only for hosted families a local pool does not serve), so
# requirements-cookbook.txt pins everything else it needs (make binder-lock writes it too).
$(STAMP): $(PY) pyproject.toml binder/constraints.txt requirements-cookbook.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c binder/constraints.txt "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c binder/constraints.txt -e ".[engine,dev,lab,docs]"
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
	  $(PY) -m pip install -q --no-deps -r requirements-cookbook.txt; fi
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium drives the browser tests (Playwright cannot download browsers here).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "chromium missing: run 'sudo apt-get install -y chromium' (browser tests need it)"; exit 1; fi; }

# The same JupyterLab settings as Binder (binder/postBuild: no news pop-up, comms on the main
# shell), written to a folder of this checkout, so the user's own settings stay as they are.
LAB_SETTINGS := $(CURDIR)/.jupyter-lab/user-settings

lab: setup
	JUPYTERLAB_SETTINGS_DIR=$(LAB_SETTINGS) PATH=$(abspath $(VENV))/bin:$$PATH bash binder/postBuild
	JUPYTERLAB_SETTINGS_DIR=$(LAB_SETTINGS) $(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --ServerApp.root_dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/01_quickstart.ipynb

binder-lock: setup
	$(PY) binder/lock.py

# The Binder link of the published repository (from pyproject.toml's project.urls or git's origin
# remote; standard library only, no setup needed); says how to get one when it is not published.
binder-link:
	@$(PYTHON) binder/link.py

demo: setup
	$(PY) -m trio_widgets demo

# Numerics must hold at any torch thread count: the whole suite runs at 1, these again at 2, for their
# numbers only: not the tests of files, processes or scheduling among them (marked no_numerics), nor
# the same numbers through the Tinker wire (their in-process twins compute them in the same engine).
NUMERIC_TESTS := tests/test_isolation.py tests/test_gradients.py tests/test_losses.py tests/test_sampling.py \
	tests/test_checkpoints.py tests/test_models.py

# Lint and type check are part of the test run.
lint: setup
	$(VENV)/bin/ruff check trio_widgets tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# -rfE: each failure's message again in the summary at the end (CI shows a run's tail; on CI pytest
# prints it whole). build/test-times*.xml: every test's seconds (JUnit XML), to see where the run's
# time goes (issue 31: make test in <= 35 minutes). The tests run at one torch thread, so two
# pytest-xdist workers use both cores (each worker runs whole modules: tests/conftest.py's groups);
# the tests that measure time, CPU or memory (marked `alone`) then run with nothing beside them.
test: setup browser-deps lint
	TRIO_TORCH_THREADS=1 $(PY) -m pytest -q -rfEs --durations=15 -n 2 -m "not alone" \
	  --junitxml=build/test-times.xml tests
	TRIO_TORCH_THREADS=1 $(PY) -m pytest -q -rfEs --durations=10 -m alone --junitxml=build/test-times-alone.xml tests
	TRIO_TORCH_THREADS=2 $(PY) -m pytest -q -rfEs -m "not no_numerics" -k "not tinker-http" $(NUMERIC_TESTS)
	$(MAKE) docs

# The docs site into build/site, strict: a broken link, a missing reference or a public name
# without a docstring fails it. The tutorial pages reuse the notebooks test_notebooks.py ran
# (build/notebooks/); a notebook without a current run is executed here (TRIO_DOCS_EXECUTE=0: not).
docs: setup
	NO_MKDOCS_2_WARNING=1 TRIO_TORCH_THREADS=1 $(VENV)/bin/mkdocs build --strict

# The wheel and sdist as users get them (tests/test_packaging.py; the suite runs it too): build,
# twine check, a fresh venv with the core and [engine], the notebooks inside, the sdist's wheel.
package-check: setup
	$(PY) -m pytest -q -rs tests/test_packaging.py

test-fast: setup
	$(PY) -m pytest -q -m "not browser and not notebooks" tests

bench: setup
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/vs_peft.py
	$(PY) benchmarks/dashboard_overhead.py

# On a GPU machine: CUDA tests + vs_peft.py on a ~0.5B shape, < 8 minutes (--dry-run: on CPU).
gpu-check: setup
	PYTHON=$(PY) benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
