# Set-up, demo and tests. Everything installs into .venv; the default model goes to ~/.cache/conveyor.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install model demo test lint clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

model: install
	$(VENV)/bin/conveyor fetch-default-model

demo: model
	$(VENV)/bin/conveyor generate --chat --echo --max-tokens 64 "Name the three primary colors."

test: model
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check conveyor tests scripts benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
