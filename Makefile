# Tempera's two set-up commands (see README.md):
#   make demo   set up .venv if needed, then train the tiny built-in model on the built-in dataset
#   make test   set up .venv if needed, then run the test suite
# Both are idempotent: the second run reuses .venv. GPU users pick their torch build with
#   make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tempera-installed

.PHONY: demo test test-fast lint ui docs

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, so the rest does not pull a different (multi-GB CUDA) build.
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check \
		-c requirements/constraints.txt -e ".[dev,memory,wandb,data]"
	# rembg (the data extra) imports pymatting, whose numba kernels compile on the first import
	# (about 85 s of one core) and are cached in the venv: pay it here, not in a test.
	$(PY) -c "import rembg"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/train.py --config training_presets/demo.json

# On every core (pytest-xdist, at most 4 workers): a test file is one unit of work, the known-long
# ones first (tests/work_units.py). --durations shows the slowest tests; the end of the run lists
# the slowest units and the critical path, all of them in test-times.json.
test: $(STAMP) lint
	bash scripts/ensure_xvfb.sh
	$(PY) -m pytest -n auto --maxprocesses=4 --work-unit-times=test-times.json

# ruff's small bug-finding rule set, then mypy over modules/ and app/ (both configured in
# pyproject.toml; docs/contributing.md), run first by `make test` and CI.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-fast: $(STAMP)
	$(PY) -m pytest -m "not inductor and not gui"

ui: $(STAMP)
	$(PY) scripts/train_ui.py

docs: $(STAMP)
	$(PY) scripts/gen_config_docs.py
