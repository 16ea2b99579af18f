# The course's single entry point. Every target sets up (or reuses) .venv first.
#   make lab        set up, then open the notebooks in JupyterLab (--allow-root when run as root); more options
#                   with LAB_ARGS, e.g. make lab LAB_ARGS="--port 9999 --no-browser"
#   make test       set up, then lint and run every test: dtlib's, and each notebook once: in JupyterLab in
#                   headless Chromium (the browser tests, without their screenshots), or under nbval when no
#                   Chromium can be had
#   make test-browser         set up (Chromium included, with apt-get), then only the browser tests
#   make browser-screenshots  where the browser tests left their screenshots, with each notebook's time
#   make notebooks  set up, then execute every notebook in a fresh kernel and store the outputs
#   make lock       regenerate requirements.lock (uv pip compile) and environment.yml's pins; set-up installs
#                   exactly the lock. LOCK_ARGS="--upgrade-package NAME" tries a newer release of one package
#   make test-torch TORCH=2.11  the test suite and every notebook (nbval) on another torch, in .venv-torch2.11
#                   (torch from the registry: a CUDA build of a few GB on most machines; never part of setup)
#   make bench      set up, then measure the launcher (python -m dtlib.bench launch)
#   make bench-check  set up, then measure every speed target against its limit (python -m dtlib.bench check);
#                   exits non-zero on a miss. Run it on a quiet machine: the test gate never asserts a time.
#   make gpu-check  on NVIDIA GPUs: the GPU tests, every notebook and small benchmarks, 8 minutes at most
#                   (scripts/gpu_check.sh; writes docs/results/gpu_run.md and the _gpu tables). Runs no set-up,
#                   which would install the CPU torch: .venv's python if there is one, else python3. Without a
#                   GPU it prints what it would run and exits 0
VENV ?= .venv
# pytest-xdist workers; whole files go to one worker (--dist loadfile), since a notebook's cells run in order,
# longest first (tests/conftest.py orders them; --no-loadscope-reorder in pyproject.toml keeps that order).
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
LAB_ARGS ?=
# Jupyter refuses to run as root without --allow-root (containers and cloud notebooks often run as root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
export VENV

LOCK_ARGS ?=
.PHONY: setup lock lab test test-torch test-browser browser-screenshots notebooks bench bench-check gpu-check clean

setup:
	@scripts/setup.sh

lock: setup
	@scripts/lock.sh $(LOCK_ARGS)

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(ALLOW_ROOT) $(LAB_ARGS)

test: setup
	@scripts/browser_setup.sh --try
	$(PY) -m ruff check dtlib tests notebooks
	DTLIB_NO_SCREENSHOTS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# TORCH reaches the script through the environment (make exports a command line's variables), whole: the
# script, not the shell of this recipe, judges it.
test-torch:
	@scripts/test_torch.sh

test-browser: setup
	@scripts/browser_setup.sh
	$(PY) -m pytest tests/browser

browser-screenshots:
	@$(PY) tests/browser/status.py

notebooks: setup
	@$(PY) -c 'import sys, pathlib; from dtlib.bench.targets import notebook_seconds; \
	[print(f"{p}: {notebook_seconds(pathlib.Path(p), store=True):.1f} s") for p in sys.argv[1:]]' notebooks/*.ipynb

bench: setup
	$(PY) -m dtlib.bench launch

bench-check: setup
	$(PY) -m dtlib.bench check

gpu-check:
	@PYTHON="$(if $(wildcard $(PY)),$(PY),python3)" scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
