#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md in one go, for a machine with one CUDA GPU:
#
#   bench/gpu.sh OUT_DIR [probe|compare|compile|all|sweep|modes|profile|tests|peer|llama1b|stepmem|longseq|longseq_max|preference|finetune|unsloth|grpo]
#
# probe:   the environment, --plan on the GPU, and bin/train on the GPT-2 124M experiment at micro
#          batch 32 and 64 for 40 steps each (tokens/s, MFU and peak memory from metrics.jsonl);
# sweep:   bin/train alone with and without torch.compile and model.chunked_loss, and at micro 128;
# modes:   the compiled experiment with train.compile_mode reduce-overhead (CUDA graphs) and
#          max-autotune, and reduce-overhead with the whole loss;
# profile: the top GPU kernels of 5 compiled steps (torch.profiler), and the trace, gzipped;
# compare: bench/bench.py compare for stages 0, 2 and 3 (ours against the raw loop, A B A B);
# compile: the same for stage 0 with train.compile=true;
# tests:   pytest -m gpu;
# peer:    bench/bench.py peer at stage 0 on GPT-2 124M (micro 32): bin/train with train.compile=true
#          against the HF Trainer as configured by default and with its torch_compile option;
#          PEER_SET="model.chunked_loss=false ..." adds overrides (both sides get the model, data
#          and batch they name; model.chunked_loss and train.compile* are bin/train's alone);
# llama1b: configs/experiments/llama-1b.yaml at stages 0, 2 and 3 (micro 8 as in the 2026-11-24 table) without
#          Liger, the whole loss against the chunked one at micro 4, and with Liger-Kernel's kernels
#          (the experiment's model.kernels: liger, whose chunked loss is Liger's fused one).
# levers:  the Llama 1B levers toward 50% MFU at stage 0 and 40% at stage 3 (Liger everywhere):
#          micro 16 against 8, gradient accumulation 4 (the optimizer step amortised, as users'
#          global batches do), stage 2, and a profile of micro 16 (torch.compile over Liger's kernels
#          went non-finite at step 4 and is refused since). LEVERS="name:stage:micro:accum[:k=v,...]".
#          Each probe's results are also appended to OUT/levers.jsonl (one line a probe).
# longseq: issue 41 item 4 on the machine lent (one H100, 128 GiB of host memory, 64 GiB of disk), where
#          the Llama-8B shape's optimizer cannot be offloaded (the planner: 201.93 GiB of host memory at
#          zero3+cpu with synchronous saves; its states and offloaded bf16 weights alone are 134.6 GiB): a
#          Llama 3.2 3B shape stands in (hidden 3072, 28 layers, the 8B's vocabulary and positions):
#          --plan --max-seq-len, then the planned activation bytes against the measured peak at 16k and
#          64k tokens (4 steps each). zero3+cpu needs DeepSpeed's CPU Adam: JIT-built by the first run.
# longseq_max: the longest sequence that plan found, 3 steps (a call of its own: minutes a step).
# preference: issue 41 item 5: bench/bench.py preference on Llama 1B (whole loss, no Liger, ZeRO 0, no
#          activation checkpointing, on both sides: the bench stops if the two are planned apart), at
#          seq_len 128 (the pairs' rows are 77-113 byte tokens; at 2048 the planner sizes each row at
#          2048 and refuses) and micro 64 (MICRO_PREF), so that the forward and backward outweigh the
#          optimizer step both sides pay alike.
# stepmem: bench/step_memory.py --cuda: what the optimizer step allocates for itself at stage 0
#          (DeepSpeed's fused wrapper and the unfused one) and stage 2, against the planner's step column.
# finetune: issue 55's table: a Llama-3-8B with random bf16 weights made on the GPU (bench/finetune.py base),
#          then configs/experiments/llama3-8b-qlora.yaml at seq 2048, micro 1 x accumulation 4 (8,192 tokens
#          a step: train.global_batch_size 4; ours at micro_batch_size auto, and at micro 1 as the recipe), ours
#          (QLoRA and bf16 LoRA, chat data; QLoRA on text data, at dropout 0, and with the old attention and
#          peft's adapters: the before of each lever) against the Hugging Face recipe (Trainer +
#          peft + bitsandbytes, bench/finetune.py hf) on the same shape, at the tutorials' micro 1 x 4 and
#          at 2 x 2 and 4 x 1 (its best micro batch), then a profile of ours; writes
#          OUT/finetune.json (bench/finetune.py collect) after every run, so a call cut short keeps what ran.
#          The profile runs one micro batch a step (its 5 traced steps of an 8B at micro 1 x 4 made a trace
#          whose key_averages outran the call on 2026-11-27).
#          FT_DEADLINE (s, default 500) skips what would not finish; FT_RUNS picks runs by name.
# unsloth: issue 62's lease 3: Unsloth (bench/finetune.py unsloth: FastLanguageModel's 4-bit load of the same
#          base, get_peft_model with the same adapters, its offloaded checkpointing) at micro 1 x 4, 4 x 1 and
#          at dropout 0, beside ours on the same card, from its own site (.whl/unsloth, made by
#          bench/carry.py unsloth); ratio_qlora_unsloth in OUT/finetune.json. FT_* as for finetune.
# grpo:    issue 56's GPU figures: configs/experiments/tiny-grpo.yaml's job (the counting prompts, the format
#          and answer rewards) on a Qwen3-0.6B shape with random bf16 weights (GRPO_SHAPE), the Qwen3 tokenizer
#          where .cache/tokenizers/qwen3 was carried (else the byte tokenizer), 16 completions x 4 micro steps a
#          step (8 prompts x G 8), 256 new tokens, ZeRO-0: a rank's groups in one generate call, TRL's
#          GRPOTrainer on the same job (bench/grpo.py --trl-side --job), ours with the static cache
#          (train.rl.generation_cache static: the decode step compiled and graphed), then a call a group
#          (train.rl.generation_batch 1); OUT/grpo.json (bench/grpo.py --collect): each run's median step,
#          tokens/s and generation's share of the step (steps after the 5th, as TRL's), ours/TRL (both
#          without activation checkpointing: TRL's default is on), and the decode step
#          against its floor (the weights and the KV cache read once a decode step at the GPU's bandwidth).
# A directory .whl beside bench/ (wheels of deepspeed, datasets, pydantic... for a machine that
# cannot reach a package registry; `python bench/carry.py LEASE` makes it) is installed into /tmp/site
# first, unless they import already.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# DeepSpeed's JIT op builder (FusedAdam) cannot parse arch names such as "9.0a" that CUDA images
# put in TORCH_CUDA_ARCH_LIST; name the plain compute capability of GPU 0 instead.
if command -v nvidia-smi > /dev/null; then
    TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
    export TORCH_CUDA_ARCH_LIST
fi
PY=python3
# A JIT cache carried from an earlier machine (TORCH_EXTENSIONS_DIR, FusedAdam built there: a minute
# saved) must not hold a build's lock file: a tarball made while a build ran had one on 2026-11-25, and
# every run then waited on it until the call's limit (10 minutes of the lease lost).
[ -n "${TORCH_EXTENSIONS_DIR:-}" ] && find "$TORCH_EXTENSIONS_DIR" -name lock -type f -delete 2>/dev/null
if [ -d .whl ] && ! $PY -c "import deepspeed, datasets, pydantic" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
EXP=${EXP:-configs/experiments/gpt2-124m.yaml}
MICRO=${MICRO:-64}
HEADROOM=${HEADROOM:-0.97}  # eager whole loss at micro 64: 73.7 GiB of 79.2 on an H100, above the default 0.9
CACHE=/tmp/bench-data

# bin/train alone for 40 steps with the given --set overrides; its log and metrics.jsonl land in
# OUT/NAME.*, and the last three logged intervals are printed (tokens/s, MFU, peak memory, data wait).
probe() {
    local name=$1; shift
    local sets=()
    for kv in "$@"; do sets+=(--set "$kv"); done
    rm -rf /tmp/probe
    timeout ${PROBE_LIMIT:-300} $PY bin/train $EXP --set train.max_steps=${PROBE_STEPS:-40} --set train.log_every=5 --set strategy.headroom=$HEADROOM \
        --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set train.eval_batches=2 --set run_dir=/tmp/probe \
        --set data.cache_dir=$CACHE "${sets[@]}" > "$out/$name.log" 2>&1
    echo "$name ($*): exit $?"
    grep -E "^.{9}(model|strategy|memory per rank):" "$out/$name.log"
    tail -3 "$out/$name.log"
    cp /tmp/probe/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
    pack
    $PY - "$out/$name.jsonl" <<'EOF2'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
for r in rows[-3:]:
    print({k: r.get(k) for k in ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "data_wait_share", "peak_memory_bytes")})
EOF2
}

if [[ $what == probe || $what == all ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    $PY -c "import torch, deepspeed, transformers, datasets; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)" | tee -a "$out/gpu.txt"
    $PY bin/train $EXP --plan --set data.cache_dir=$CACHE 2>&1 | tee "$out/plan.txt"
    for m in 32 64; do
        probe probe_m$m train.micro_batch_size=$m
    done
fi
# sweep: what each MFU lever is worth, bin/train alone at stage 0 on the experiment's settings
# (dropout 0, tanh GELU, chunked loss), eager and compiled, with the whole loss, and at micro 128.
if [[ $what == sweep ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    $PY -c "import torch, deepspeed, transformers, datasets; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)" | tee -a "$out/gpu.txt"
    # the most telling first: a call cut short at its 10 minutes still has them
    probe eager train.micro_batch_size=64
    probe compiled train.micro_batch_size=64 train.compile=true
    probe compiled_whole_loss train.micro_batch_size=64 train.compile=true model.chunked_loss=false
    probe compiled_m128 train.micro_batch_size=128 train.compile=true
    [[ -n ${SWEEP_ALL:-} ]] && probe eager_whole_loss train.micro_batch_size=64 model.chunked_loss=false
fi
# modes: torch.compile's modes (train.compile_mode) on the compiled experiment at micro 64: CUDA
# graphs against the host gap the profile showed (kernels 152 ms of a 183 ms step), and autotuned
# matmuls; the whole loss with CUDA graphs last.
if [[ $what == modes ]]; then
    PROBE_LIMIT=${PROBE_LIMIT:-420}
    probe compiled_reduce_overhead train.micro_batch_size=64 train.compile=true train.compile_mode=reduce-overhead
    probe compiled_max_autotune train.micro_batch_size=64 train.compile=true train.compile_mode=max-autotune
    probe compiled_ro_whole_loss train.micro_batch_size=64 train.compile=true train.compile_mode=reduce-overhead model.chunked_loss=false
fi
if [[ $what == levers ]]; then
    EXP=${LEVERS_EXP:-configs/experiments/llama-1b.yaml}
    PROBE_STEPS=${PROBE_STEPS:-25}
    for spec in ${LEVERS:-z0_m16:0:16:1 z3_m16:3:16:1 z0_m8:0:8:1 z0_m16_ga4:0:16:4 z3_m16_ga4:3:16:4 z2_m16:2:16:1}; do
        IFS=: read -r name stage micro ga extra <<< "$spec"
        steps=$PROBE_STEPS; [[ $ga -gt 1 ]] && steps=15
        PROBE_STEPS=$steps probe "l1b_$name" strategy.zero_stage=$stage train.micro_batch_size=$micro train.grad_accum=$ga ${extra//,/ }
        $PY - "$out/l1b_$name.jsonl" "$out/l1b_$name.log" "$name" >> "$out/levers.jsonl" <<'EOF2'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l] if __import__("os").path.exists(sys.argv[1]) else []
log = open(sys.argv[2]).read()
plan = re.findall(r"strategy: ([^\n]*)", log)
last = rows[-1] if rows else {}
print(json.dumps({"name": sys.argv[3], **{k: last.get(k) for k in ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "data_wait_share")}, "plan": plan[:1]}))
EOF2
    done
    if [[ -z ${NO_LEVER_PROFILE:-} ]]; then
        EXP=configs/experiments/llama-1b.yaml COMPILE=false MICRO_PROFILE=16 PROBE_LIMIT=150 bash "$0" "$out" profile
    fi
fi
if [[ $what == stepmem ]]; then
    timeout ${LIMIT:-240} $PY bench/step_memory.py --cuda 0:auto 0:torch 2:auto 2>&1 | grep -E "^\{|Error|error" | tee "$out/stepmem.log"
fi
if [[ $what == tests ]]; then
    timeout ${LIMIT:-120} $PY -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tail -15 | tee "$out/gpu-tests.log"
fi
if [[ $what == peer ]]; then
    timeout ${LIMIT:-400} $PY bench/bench.py peer --stages ${STAGES:-0} --rounds ${ROUNDS:-1} --steps ${STEPS:-40} --warmup 15 \
        --set train.micro_batch_size=${MICRO_PEER:-32} --set train.compile=${COMPILE:-true} --set strategy.headroom=$HEADROOM \
        $(for x in ${PEER_SET:-}; do printf -- '--set %s ' "$x"; done) \
        --hf-variants ${HF_VARIANTS:-default torch_compile=true} --json "$out/peer.json" 2>&1 | tee "$out/peer.log"
fi
if [[ $what == llama1b ]]; then
    EXP=configs/experiments/llama-1b.yaml
    PROBE_STEPS=${PROBE_STEPS:-30}
    $PY bin/train $EXP --plan --set data.cache_dir=$CACHE --set strategy.headroom=$HEADROOM 2>&1 | tee "$out/plan-1b.txt"
    probe l1b_z0 train.micro_batch_size=8 strategy.zero_stage=0 model.kernels=none
    probe l1b_z2 train.micro_batch_size=8 strategy.zero_stage=2 model.kernels=none
    probe l1b_z3 train.micro_batch_size=8 strategy.zero_stage=3 model.kernels=none
    probe l1b_z0_m4_whole strategy.zero_stage=0 train.micro_batch_size=4 model.chunked_loss=false model.kernels=none
    probe l1b_z0_m4 strategy.zero_stage=0 train.micro_batch_size=4 model.kernels=none
    probe l1b_z0_liger train.micro_batch_size=8 strategy.zero_stage=0 model.kernels=liger
    probe l1b_z2_liger train.micro_batch_size=8 strategy.zero_stage=2 model.kernels=liger
    probe l1b_z3_liger train.micro_batch_size=8 strategy.zero_stage=3 model.kernels=liger
fi
L3B=(model.config.hidden_size=3072 model.config.intermediate_size=8192 model.config.num_hidden_layers=28
     model.config.num_attention_heads=24 checkpoint.async=false data.eval_fraction=0 data.train.files=/tmp/longseq.jsonl)
LONG_EXP=configs/experiments/llama3-8b-32k.yaml
if [[ $what == longseq || $what == longseq_max ]]; then
    for i in 1 2 3 4; do cat data/tiny/python_docs.jsonl; done > /tmp/longseq.jsonl  # ~1.9M byte tokens
    sets=(); for kv in "${L3B[@]}"; do sets+=(--set "$kv"); done
    $PY bin/train $LONG_EXP --plan --max-seq-len "${sets[@]}" 2>&1 | tee "$out/longseq_plan.txt"
    longest=$(grep -oP 'longest sequence: \K[\d,]+' "$out/longseq_plan.txt" | tr -d ,)
fi
if [[ $what == longseq ]]; then
    for len in 16384 65536; do
        EXP=$LONG_EXP HEADROOM=0.9 PROBE_STEPS=4 PROBE_LIMIT=${PROBE_LIMIT:-250} probe longseq_$len "${L3B[@]}" data.seq_len=$len
    done
fi
if [[ $what == longseq_max && -n ${longest:-} ]]; then
    EXP=$LONG_EXP HEADROOM=0.9 PROBE_STEPS=3 PROBE_LIMIT=${LIMIT:-540} probe longseq_max "${L3B[@]}" data.seq_len=$longest
fi
if [[ $what == preference ]]; then
    timeout ${LIMIT:-560} $PY bench/bench.py preference --experiment configs/experiments/llama-1b.yaml --micro ${MICRO_PREF:-64} \
        --rounds ${ROUNDS:-2} --steps 30 --warmup 10 --set data.seq_len=128 --set model.chunked_loss=false \
        --set model.kernels=none --set strategy.zero_stage=0 --set model.activation_checkpointing=false \
        --cache-dir $CACHE --json "$out/preference.json" 2>&1 | tee "$out/preference.log"
fi
# profile: torch.profiler over 5 steps after 3 (--profile) of the compiled experiment: the top
# kernels by GPU time, the time by kind of work and how busy the GPU was.
if [[ $what == profile ]]; then
    rm -rf /tmp/prof
    timeout ${PROBE_LIMIT:-300} $PY bin/train $EXP --profile --set run_dir=/tmp/prof --set data.cache_dir=$CACHE \
        --set train.micro_batch_size=${MICRO_PROFILE:-64} --set train.compile=${COMPILE:-true} > "$out/profile.log" 2>&1
    echo "profile: exit $?"
    grep -A22 "top operators" "$out/profile.log"
    grep -E "profile: (GPU kernels|CPU operator time|no time by kind)" "$out/profile.log"
    gzip -c /tmp/prof/profile/trace_rank00000.json > "$out/trace.json.gz" 2>/dev/null
    ls -la "$out"
fi
if [[ $what == grpo ]]; then
    EXP=configs/experiments/tiny-grpo.yaml
    [ -f .cache/tokenizers/qwen3/tokenizer.json ] || { [ -f .whl/qwen3-tokenizer.tar.xz ] && mkdir -p .cache/tokenizers/qwen3 &&
        tar -xJf .whl/qwen3-tokenizer.tar.xz -C .cache/tokenizers/qwen3; }
    tok=byte; [ -f .cache/tokenizers/qwen3/tokenizer.json ] && tok=.cache/tokenizers/qwen3
    shape=${GRPO_SHAPE:-'{"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "tie_word_embeddings": true}'}
    new_tokens=${GRPO_NEW:-256}
    common=("model.config=$shape" data.tokenizer=$tok data.seq_len=${GRPO_SEQ:-512} train.precision=${GRPO_PRECISION:-bf16}
            train.micro_batch_size=16 train.grad_accum=4 train.rl.num_generations=8 train.rl.max_new_tokens=$new_tokens
            train.log_every=1 strategy.zero_stage=0 strategy.justification=bench model.activation_checkpointing=false)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    PROBE_STEPS=${PROBE_STEPS:-10} probe grpo_batched "${common[@]}"
    # TRL's GRPOTrainer on the same job (the same shape, tokenizer, prompts, rewards, 8 prompts x G 8 a step
    # in one generate call, 256 new tokens, bf16 weights; .whl carries trl: bench/carry.py grpo)
    job=$($PY -c 'import json, sys; print(json.dumps({"shape": sys.argv[1], "tokenizer": sys.argv[2], "precision": sys.argv[3], "micro": 16, "accum": 4, "generations": 8}))' "$shape" "$tok" "${GRPO_PRECISION:-bf16}")
    timeout ${PROBE_LIMIT:-300} $PY bench/grpo.py --trl-side "$out/trl.json" --steps ${PROBE_STEPS:-10} --max-new-tokens $new_tokens \
        --job "$job" > "$out/trl.log" 2>&1
    echo "trl: exit $?"; tail -c 600 "$out/trl.log"; pack
    # the static cache: transformers compiles the decode step and replays it as a CUDA graph (its first steps compile)
    PROBE_STEPS=${PROBE_STEPS:-10} probe grpo_static "${common[@]}" train.rl.generation_cache=static
    # a generate call a group (8 calls of 8 rows a step: the slowest; fewer steps)
    PROBE_STEPS=${PER_GROUP_STEPS:-6} probe grpo_per_group "${common[@]}" train.rl.generation_batch=1
    $PY bench/grpo.py --collect "$out" --shape "$shape" --new-tokens $new_tokens --tokenizer $tok --precision ${GRPO_PRECISION:-bf16} 2>&1 | tee "$out/grpo.json"
    pack
fi
# PACK=FILE (the device tool returns 8 files at most): OUT packed into FILE (a .tgz) after every run, so that a
# call cut short returns what ran: `PACK=$OUT/lease.tgz bash bench/gpu.sh /tmp/o finetune`.
pack() { [[ -n ${PACK:-} ]] && tar -czf "$PACK.part" -C "$out" . && mv "$PACK.part" "$PACK"; return 0; }
# The fine-tuning runs of `finetune` and `unsloth`: each spec is "name|arguments": bin/train's --set
# overrides (ours_*), or bench/finetune.py hf's or unsloth's arguments (hf_*, unsloth_*; Unsloth from its own
# site, UNSLOTH_SITE). Writes OUT/finetune.json (bench/finetune.py collect) after every run.
ft_runs() {
    for spec in "$@"; do
        name=${spec%%|*}; args=${spec#*|}
        [[ -n ${FT_RUNS:-} && " $FT_RUNS " != *" $name "* ]] && continue
        left=$((deadline - (SECONDS - t_start)))
        if (( left < ${FT_MIN_LEFT:-75} )); then echo "$name: skipped ($left s left)"; continue; fi
        if [[ $name == hf_* ]]; then
            timeout $((left - 5)) $PY bench/finetune.py hf "$name" --base "$base" --steps "$steps" --json "$out/$name.json" $args > "$out/$name.log" 2>&1
            echo "$name: exit $? at $((SECONDS - t_start)) s"; tail -1 "$out/$name.log"
        elif [[ $name == unsloth_* ]]; then
            PYTHONPATH=$UNSLOTH_SITE timeout $((left - 5)) $PY bench/finetune.py unsloth "$name" --base "$base" --steps "$steps" \
                --json "$out/$name.json" $args > "$out/$name.log" 2>&1
            echo "$name: exit $? at $((SECONDS - t_start)) s"; grep -E "Unsloth|Error|error" "$out/$name.log" | head -5; tail -1 "$out/$name.log"
        else
            sets=(); for kv in $args ${FT_SETS:-}; do sets+=(--set "$kv"); done
            rm -rf /tmp/ft-run
            timeout $((left - 5)) $PY bin/train $FT_EXP --set model.pretrained=$base --set train.max_steps=$steps \
                --set train.global_batch_size=4 --set train.log_every=1 --set optim.implementation=torch \
                --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set data.eval_fraction=0 \
                --set run_dir=/tmp/ft-run --set data.cache_dir=$CACHE --set strategy.headroom=0.9 "${sets[@]}" > "$out/$name.log" 2>&1
            echo "$name: exit $? at $((SECONDS - t_start)) s"
            grep -E "^.{9}(model|strategy|memory per rank|base weights):" "$out/$name.log"; tail -2 "$out/$name.log"
            cp /tmp/ft-run/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
        fi
        $PY bench/finetune.py collect "$out" > "$out/table.txt" 2>&1
        pack
    done
    cat "$out/table.txt"
}
if [[ $what == finetune || $what == unsloth ]]; then
    t_start=$SECONDS
    deadline=${FT_DEADLINE:-500}
    base=${FT_BASE:-/tmp/llama8b}
    steps=${FT_STEPS:-8}
    FT_EXP=${FT_EXP:-configs/experiments/llama3-8b-qlora.yaml}
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    $PY -c "import torch, deepspeed, transformers, peft, bitsandbytes; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)" | tee -a "$out/gpu.txt"
    [[ -f $base/config.json ]] || $PY bench/finetune.py base "$base" 2>&1 | tail -2 | tee -a "$out/gpu.txt"
fi
if [[ $what == finetune ]]; then
    timeout 120 $PY bench/finetune.py check 2>&1 | tail -1 | tee "$out/check.json"
    # In the order the issue's targets need them (a call cut short keeps the first): ours at micro auto and
    # the recipe at the tutorials' 1 x 4, ours at 1 x 4, the recipe at its other micro batches (its best),
    # bf16 LoRA on both sides, then the levers' befores.
    FT_DEFAULT=(
        "ours_qlora|model.activation_checkpointing=true"
        "hf_qlora|--quant 4bit"
        "ours_qlora_m1|model.activation_checkpointing=true train.micro_batch_size=1"
        "hf_qlora_m4|--quant 4bit --micro 4"
        "hf_qlora_m2|--quant 4bit --micro 2"
        "ours_lora|model.lora.quantization=none"
        "hf_lora|--quant none"
        "ours_qlora_d0|model.activation_checkpointing=true model.lora.dropout=0"
        "hf_qlora_d0|--quant 4bit --dropout 0"
        "ours_qlora_before|model.activation_checkpointing=true model.attn_implementation=sdpa model.cudnn_attention=true model.lora.kernels=peft"
        "ours_qlora_text|model.activation_checkpointing=true data.train.files=data/tiny/python_docs.jsonl data.train.kind=text"
        "ours_qlora_sdpa|model.activation_checkpointing=true model.attn_implementation=sdpa"
        "ours_qlora_peft|model.activation_checkpointing=true model.lora.kernels=peft"
        "ours_lora_ckpt|model.lora.quantization=none model.activation_checkpointing=true"
    )
    ft_runs "${FT_DEFAULT[@]}"
    left=$((deadline - (SECONDS - t_start)))
    if (( left > ${FT_PROFILE_LEFT:-60} )) && [[ -z ${FT_NO_PROFILE:-} ]]; then
        rm -rf /tmp/prof
        timeout $((left - 5)) $PY bin/train $FT_EXP --profile --set model.pretrained=$base --set train.global_batch_size=1 \
            --set optim.implementation=torch --set model.activation_checkpointing=true \
            --set data.eval_fraction=0 --set run_dir=/tmp/prof --set data.cache_dir=$CACHE ${FT_SETS:+$(printf -- '--set %s ' $FT_SETS)} > "$out/profile.log" 2>&1
        echo "profile: exit $?"
        grep -A22 "top operators" "$out/profile.log"
        grep -E "profile: (GPU kernels|CPU operator time|no time by kind)" "$out/profile.log"
        pack
    fi
fi
if [[ $what == unsloth ]]; then
    # Unsloth needs transformers <= 5.17 and trl <= 1.15 (the image's transformers; not the 5.24 that .whl
    # carries for ours), datasets < 5: its wheels (bench/carry.py unsloth: .whl/unsloth/) go to a site of
    # their own, without /tmp/site; FastLanguageModel loads a tokenizer with the base (Llama 3's, carried).
    UNSLOTH_SITE=/tmp/site-unsloth
    if [[ -d .whl/unsloth ]] && [[ ! -d $UNSLOTH_SITE ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $UNSLOTH_SITE .whl/unsloth/*.whl ||
            echo "unsloth: its wheels did not install (.whl/unsloth: bench/carry.py unsloth); ours runs on"
    fi
    [[ -f $base/tokenizer.json ]] || tar -xJf .whl/llama3-tokenizer.tar.xz -C "$base" || echo "no tokenizer for the base: Unsloth's load may refuse"
    PYTHONPATH=$UNSLOTH_SITE timeout 120 $PY -c "import unsloth, transformers, trl, peft, bitsandbytes; print('unsloth', unsloth.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -3 | tee -a "$out/gpu.txt"
    # Unsloth at the tutorials' 1 x 4 (its offloaded checkpointing, dropout 0.05 as ours), at its other micro
    # batches, at dropout 0 (its fast path), with plain checkpointing; ours beside it on the same card.
    UNSLOTH_DEFAULT=(
        "unsloth_qlora|--quant 4bit"
        "ours_qlora|model.activation_checkpointing=true"
        "unsloth_qlora_m4|--quant 4bit --micro 4"
        "unsloth_qlora_d0|--quant 4bit --dropout 0"
        "ours_qlora_d0|model.activation_checkpointing=true model.lora.dropout=0"
        "unsloth_qlora_m2|--quant 4bit --micro 2"
        "unsloth_qlora_ckpt|--quant 4bit --checkpointing true"
        "unsloth_lora|--quant none"
        "ours_lora|model.lora.quantization=none"
    )
    ft_runs "${UNSLOTH_DEFAULT[@]}"
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
