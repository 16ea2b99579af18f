# The course's single entry point. Every target sets up (or reuses) .venv first.
#   make lab        set up, then open the notebooks in JupyterLab
#   make test       set up, then lint and run every test, nbval over every notebook included
#   make notebooks  set up, then execute every notebook in a fresh kernel and store the outputs
#   make bench      set up, then measure the launcher (python -m dtlib.bench launch)
VENV ?= .venv
PY := $(VENV)/bin/python
export VENV

.PHONY: setup lab test notebooks bench clean

setup:
	@scripts/setup.sh

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

test: setup
	$(PY) -m ruff check dtlib tests notebooks
	$(PY) -m pytest

notebooks: setup
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=300 notebooks/*.ipynb

bench: setup
	$(PY) -m dtlib.bench launch

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
