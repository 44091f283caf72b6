#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md in one go, for a machine with one CUDA GPU:
#
#   bench/gpu.sh OUT_DIR [probe|compare|compile|all]
#
# probe:   the environment, --plan on the GPU, and bin/train on the GPT-2 124M experiment at micro
#          batch 32 and 64 for 40 steps each (tokens/s, MFU and peak memory from metrics.jsonl);
# compare: bench/bench.py compare for stages 0, 2 and 3 (ours against the raw loop, A B A B);
# compile: the same for stage 0 with train.compile=true.
# A directory .whl beside bench/ (wheels of deepspeed, datasets, pydantic... for a machine that
# cannot reach a package registry) is installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# DeepSpeed's JIT op builder (FusedAdam) cannot parse arch names such as "9.0a" that CUDA images
# put in TORCH_CUDA_ARCH_LIST; name the plain compute capability of GPU 0 instead.
TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
export TORCH_CUDA_ARCH_LIST
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=python3
EXP=configs/experiments/gpt2-124m.yaml
MICRO=${MICRO:-64}
HEADROOM=${HEADROOM:-0.97}  # micro 64 peaks at 73.7 GiB of 79.2 on an H100: above the default 0.9
CACHE=/tmp/bench-data

if [[ $what == probe || $what == all ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    $PY -c "import torch, deepspeed, transformers, datasets; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)" | tee -a "$out/gpu.txt"
    $PY bin/train $EXP --plan --set data.cache_dir=$CACHE 2>&1 | tee "$out/plan.txt"
    for m in 32 64; do
        rm -rf /tmp/probe
        timeout 400 $PY bin/train $EXP --set train.micro_batch_size=$m --set strategy.headroom=$HEADROOM --set train.max_steps=40 --set train.log_every=5 \
            --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set run_dir=/tmp/probe \
            --set data.cache_dir=$CACHE > "$out/probe_m$m.log" 2>&1
        echo "micro $m: exit $?"
        tail -4 "$out/probe_m$m.log"
        cp /tmp/probe/metrics.jsonl "$out/probe_m$m.jsonl" 2>/dev/null
        $PY - "$out/probe_m$m.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
for r in rows[-3:]:
    print({k: r.get(k) for k in ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "data_wait_share", "peak_memory_bytes")})
EOF
    done
fi
if [[ $what == compare || $what == all ]]; then
    timeout ${LIMIT:-560} $PY bench/bench.py compare --stages ${STAGES:-0 2 3} --rounds ${ROUNDS:-2} --steps 60 --warmup 20 \
        --set train.micro_batch_size=$MICRO --set strategy.headroom=$HEADROOM --cache-dir $CACHE --json "$out/compare.json" 2>&1 | tee "$out/compare.log"
fi
if [[ $what == compile || $what == all ]]; then
    timeout ${LIMIT:-560} $PY bench/bench.py compare --stages ${STAGES:-0} --rounds ${ROUNDS:-2} --steps 80 --warmup 40 \
        --set train.micro_batch_size=$MICRO --set strategy.headroom=$HEADROOM --set train.compile=true --cache-dir $CACHE \
        --json "$out/compile.json" 2>&1 | tee "$out/compile.log"
fi
