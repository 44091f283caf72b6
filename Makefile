# The commands the README names. `make tiny` and `make test` set up the environment first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a GPU machine pick the CUDA build you want, e.g. TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH  ?= torch==2.13.0
TEST_WORKERS ?= 3
# DeepSpeed and ninja as pyproject.toml pins them: installed before the rest so that
# scripts/build_ops.py can compile DeepSpeed's CPU Adam (offload) while pip installs the others.
OPS_REQS := $(shell grep -oE "\"(deepspeed|ninja)[^\"]*\"" pyproject.toml)

.PHONY: setup tiny test test-fast lint format reference clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip     # today's pip installs faster than the venv's 23.2 (CI: 101 s vs 119 s)
	$(PY) -m pip install -q $(TORCH)          # first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q $(OPS_REQS)       # DeepSpeed next: its CPU Adam compiles while pip installs the rest
	$(PY) scripts/build_ops.py > $(VENV)/build_ops.log 2>&1 & ops=$$!; \
	  $(PY) -m pip install -q -e '.[dev]' && { wait $$ops; grep '^build_ops' $(VENV)/build_ops.log; true; }
	touch $@

tiny: setup                                  ## train the embedded default experiment
	$(PY) bin/train configs/experiments/tiny.yaml

# pytest-xdist workers (default 3 on this 2-core machine: 12m58s against 18m00s with 2): the
# launchers' start-up, the waits of the fail-fast tests (watchdog, kill detection, restart backoff)
# and the ssh set-up leave the cores idle otherwise. A test file runs whole on one worker (its tests
# share the runs its fixtures cache; run A of the ZeRO cases is shared across workers); the big dist
# files are collected first (testpaths) so that the small ones fill the gaps at the end.
# -rP shows what passing tests print: the measured figures (kill-to-exit times, memory against the plan).
test: setup                                  ## every test: unit, e2e, 2-rank launcher tests
	$(PY) -m pytest -q -rP -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: setup                             ## unit tests only (seconds)
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf runs .cache .pytest_cache
