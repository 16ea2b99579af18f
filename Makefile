# The course's single entry point. Every target sets up (or reuses) .venv first.
#   make lab        set up, then open the notebooks in JupyterLab
#   make test       set up, then lint and run every test: dtlib's, nbval over every notebook, and the browser
#                   tests (every notebook run in JupyterLab in headless Chromium; skipped, saying why, without one)
#   make test-browser         set up (Chromium included, with apt-get), then only the browser tests
#   make browser-screenshots  where the browser tests left their screenshots, with each notebook's time
#   make notebooks  set up, then execute every notebook in a fresh kernel and store the outputs
#   make bench      set up, then measure the launcher (python -m dtlib.bench launch)
VENV ?= .venv
# pytest-xdist workers; whole files go to one worker (--dist loadfile), since a notebook's cells run in order.
# Tests marked `timing` (a time or a ratio of times against a target) run afterwards, alone.
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
export VENV

.PHONY: setup lab test test-browser browser-screenshots notebooks bench clean

setup:
	@scripts/setup.sh

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

test: setup
	@scripts/browser_setup.sh --try
	$(PY) -m ruff check dtlib tests notebooks
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not timing"
	$(PY) -m pytest -m timing

test-browser: setup
	@scripts/browser_setup.sh
	$(PY) -m pytest tests/browser

browser-screenshots:
	@$(PY) tests/browser/status.py

notebooks: setup
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=300 notebooks/*.ipynb

bench: setup
	$(PY) -m dtlib.bench launch

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
