"""The planner's decisions over a matrix of jobs, as users bring them (issue 61): Llama-3.2-1B, Llama-3-8B and
Llama-3-70B shapes (configs/models/: the published config.json alone); full fine-tuning, LoRA (r 16 on every
projection, bf16 base) and QLoRA (4-bit base); 1 to 64 ranks (8 a node); 16, 24, 80 and 141 GB GPUs; 2k, 8k and
32k tokens a sequence. Every job keeps a global batch of 64 sequences with micro_batch_size: auto, on
configs/experiments/llama3-8b-qlora.yaml's settings otherwise. The families that are not Llama-shaped (issue 68:
Qwen3-4B's own head size, Gemma-3-1B's sliding windows, Mixtral-8x7B's and Qwen3-30B-A3B's experts) on 1, 8 and 64
ranks. Each model's attention is the one a run on those GPUs takes (model.attn_implementation: auto resolved for
CUDA in bf16: varlen for the Llama and Qwen3 families, sdpa for the others, whose packed rows carry masks).

    python bench/plan_matrix.py            # print the table
    python bench/plan_matrix.py --write    # rewrite tests/unit/plan_matrix.md (then review its diff)

tests/unit/test_plan_matrix.py regenerates the table and fails on any difference, so that a change to a
decision is seen in review. NOTES says why the decisions a practitioner could dispute are what they are.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests/unit/plan_matrix.md"
MODEL_INFO = ROOT / "bench" / "results" / "plan_matrix"  # model.info's cache of the nine counts, checked in
EXPERIMENT = ROOT / "configs" / "experiments" / "llama3-8b-qlora.yaml"
GiB = 2**30

MODELS = {"1b": "llama-3.2-1b", "8b": "llama-3-8b", "70b": "llama-3-70b", "qwen3-4b": "qwen3-4b",
          "gemma3-1b": "gemma-3-1b", "mixtral": "mixtral-8x7b", "qwen3-30b-a3b": "qwen3-30b-a3b"}  # fmt: skip
METHODS = ("full", "lora", "qlora")
RANKS = (1, 2, 8, 16, 64)
FAMILY_RANKS = (1, 8, 64)  # the models beyond Llama's
LLAMAS = ("1b", "8b", "70b")
EXPERTS = ("mixtral", "qwen3-30b-a3b")
MEMORY = {16: "rtx4090", 24: "rtx4090", 80: "h100", 141: "h200"}  # GB -> the GPU profile timed on
SEQS = (2048, 8192, 32768)
HOST_PER_GPU = 256  # GB of host memory a GPU (a DGX H100 node: 2 TB for 8)
GLOBAL_BATCH = 64

# (model, method, ranks, GB, seq) -> why a decision is what it is, where a practitioner could dispute it (a
# faster offload the rules passed over is noted by `row` itself)
NOTES = {
    (
        "8b",
        "full",
        16,
        80,
        2048,
    ): "zero1, not zero2: at accumulation 1 both reduce the same bytes; zero1 is the "
    "lower rung (zero2 holds less)",
    (
        "8b",
        "full",
        64,
        80,
        2048,
    ): "3D (PP 2 x TP 2 x DP 16, the stages across nodes): a rank reduces a quarter of the model's gradients "
    "(the first stage's embedding whole), where TP 2 alone reduces a half over 32 ranks (0.61 s planned); the "
    "bubble at 4 micro batches is 20% of a step; planned, not yet measured on GPUs",
    ("8b", "full", 1, 80, 2048): "ZeRO-Offload (zero2+cpu): the parameters stay on the GPU, where zero3+cpu "
    "would copy them over PCIe in every pass",
    (
        "1b",
        "full",
        1,
        16,
        8192,
    ): "the parameters offloaded for a 1B: the plan prices their PCIe copies and the tiled "
    "MLP under checkpointing's recompute on this GPU",
    (
        "8b",
        "qlora",
        8,
        16,
        2048,
    ): "sequence parallel 4 on a 2k sequence: it spares the recompute that checkpointing "
    "would cost, and the all-to-alls stay inside the node",
    (
        "70b",
        "full",
        16,
        16,
        2048,
    ): "no sequence parallelism across the two nodes (all-to-alls over the network)",
    (
        "8b",
        "full",
        64,
        80,
        8192,
    ): "fewer us a token than at 2k: the 64 ranks' reductions over the network are paid "
    "once a step, over 4x the tokens",
}


def sets_for(model: str, method: str, seq: int, gpu: str) -> list[str]:
    # relative to the repository's root (the cwd, as the tests run): model.info's cache key holds the path
    out = [f"model.pretrained=configs/models/{MODELS[model]}", f"data.seq_len={seq}",
           f"train.global_batch_size={GLOBAL_BATCH}", f"strategy.hardware.gpu={gpu}"]  # fmt: skip
    if method == "full":
        out.append("model.lora=null")
    elif method == "lora":
        out.append("model.lora.quantization=none")
    if method != "full" and model in EXPERTS:  # their experts are 3-D parameters: adapters on the attention
        out.append("model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    return out


def infos(cache: Path = MODEL_INFO) -> dict[tuple[str, str], object]:
    """Each model and method's facts, counted on the meta device (30 s for the nine) or read from the counts
    checked in beside the table (MODEL_INFO: model.info's own cache, keyed by the model section, the
    config.json's digest and the transformers version, so that a change to any of them counts again)."""
    from trainer import config, model

    out = {}
    for m in MODELS:
        for method in METHODS:
            exp = config.load(EXPERIMENT, sets_for(m, method, 2048, "h100"))
            # the attention a run on these GPUs takes (bin/train resolves auto the same way: trainer/run/plan.py)
            section = model.resolved(exp.model, seq_len=2048, precision="bf16", device_type="cuda")
            out[m, method] = model.info(section, 257, 256, cache_dir=cache)
    return out


def ranks_of(m: str) -> tuple[int, ...]:
    return RANKS if m in LLAMAS else FAMILY_RANKS


@functools.cache
def experiment(m: str, method: str, seq: int, gpu: str) -> object:
    from trainer import config

    return config.load(EXPERIMENT, sets_for(m, method, seq, gpu))


def row(m: str, method: str, ranks: int, gb: int, seq: int, info: object) -> list[str]:
    from trainer import strategy
    from trainer.common.errors import UserError
    from trainer.strategy.batch import resolve

    exp = experiment(m, method, seq, MEMORY[gb])
    node = min(ranks, 8)
    plans: dict[tuple[int, int], object] = {}

    def plan_for(e: object) -> object:
        key = (e.train.micro_batch_size, e.train.grad_accum)
        if key not in plans:
            plans[key] = strategy.plan(e, info, world_size=ranks, gpus_per_node=node, device_type="cuda",
                                       device_memory=gb * GiB, host_memory=HOST_PER_GPU * node * GiB,
                                       precision="bf16")  # fmt: skip
        return plans[key]

    key = (m, method, ranks, gb, seq)
    try:
        e, _ = resolve(exp, ranks, plan_for)
        p = plan_for(e)
    except UserError as err:
        first = str(err).splitlines()[0]
        what = first.split(": ", 2)[-1].split(". To fit")[0] if "blocks it" in first else first[:90]
        return [*map(str, key), "nothing fits", "", "", "", "", what]
    t = p.speed
    micro = f"{e.train.micro_batch_size} x {e.train.grad_accum}"
    notes = [NOTES[key]] if key in NOTES else []
    fastest = p.fastest[0] if p.fastest else None
    passed_over = fastest and fastest[1].offload != "none" and p.candidate.offload == "none"
    if passed_over and fastest[2].per_token < t.per_token * (1 - 1e-6):
        notes.append(f"{fastest[1].name} est. {fastest[2].per_token * 1e6:.1f} us/token: offload only when no "
                     "rung fits without it")  # fmt: skip
    return [*map(str, key), p.candidate.name, p.levers.describe(), micro, f"{t.seconds:.2f}",
            f"{t.per_token * 1e6:.1f}", "; ".join(notes)]  # fmt: skip


def table(cache: Path = MODEL_INFO) -> str:
    head = ["model", "method", "ranks", "GB", "seq", "decision", "levers", "micro x accum", "s/step",
            "us/token", "note"]  # fmt: skip
    found = infos(cache)
    rows = [row(m, method, r, gb, s, found[m, method]) for m in MODELS for method in METHODS for r in ranks_of(m)
            for gb in MEMORY for s in SEQS]  # fmt: skip
    lines = [
        "# The planner's decisions over a matrix of jobs",
        "",
        "Generated by `python bench/plan_matrix.py --write` (its docstring says what each job is);",
        "tests/unit/test_plan_matrix.py fails when the planner decides otherwise. s/step and us/token are",
        "the plan's own estimates (trainer/strategy/planning/speed.py) on the GPU profile of each memory size.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    text = table()
    if "--write" in sys.argv:
        TABLE.write_text(text)
        print(f"wrote {TABLE}")
    else:
        print(text)
