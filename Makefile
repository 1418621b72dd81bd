# Two entry points, both self-contained on a fresh clone:
#   make demo   set up .venv, then a 3-stage smoke run on loopback
#   make test   set up .venv with the test and reference extras, then lint, type-check and run the tests
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,reference]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshd smoke-run --stages 3

lint: $(STAMP)
	$(BIN)/ruff check meshd dashboard tests scripts bench

typecheck: $(STAMP)
	$(BIN)/mypy

# Most tests wait on timers and peers, so two run side by side on two cores.  What changes the
# host's network (netns testbeds, dockerd and its firewall rules) runs after them, one at a time:
# the netns tests check the host's ruleset holds nothing of theirs.
test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -q -n 2 -m "not host_network"
	$(BIN)/python -m pytest -q -m host_network

# Everything but the real-process, netns and browser tests: a quick check while editing.
test-fast: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -q -m "not processes and not netns and not browser"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
