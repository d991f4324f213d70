# One place that installs what Kairos needs. Every target creates/updates .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench decide clean

$(STAMP): requirements-lock.txt requirements.txt requirements-dev.txt pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || { \
	  echo "Kairos needs Python >= 3.11; '$(PY)' is $$($(PY) --version 2>&1 || echo missing)." \
	       "Install Python 3.11+ or run make PY=python3.11 ..." >&2; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-lock.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

## Main job on the embedded default (emulated engines).
run: $(STAMP)
	$(BIN)/kairos demo

## Full test suite (unit + integration with a real nats-server).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## Decision-cost benchmark (not a test: prints measured figures).
bench: $(STAMP)
	$(BIN)/python bench/decision_cost.py

clean:
	rm -rf $(VENV)
