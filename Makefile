# Two commands matter (see README): `make up` runs the local stack, `make test` runs every test.
# Both create .venv and install the project with its extras on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install up test lint
install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/floodgate up $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy extproc controller sim floodgate bench
	$(VENV)/bin/pytest -q -p no:cacheprovider $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy extproc controller sim floodgate bench
