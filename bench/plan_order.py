"""The planner's order against measured steps (issue 61 item 3): on CPU with 2 ranks, every setting of a job --
each ZeRO rung (0, 1, 2, 3, 2 + optimizer offload, 3 + optimizer offload, 3 + parameter offload) without
levers, each activation lever on ZeRO-0 (checkpointing, the tiled loss, the tiled MLP, sequence parallel 2),
checkpointing on ZeRO-3, (the Llama) tensor parallel 2 on ZeRO 0-2 and pipeline stages 2 on ZeRO 0-1 -- for two small models (a GPT-2 and a
grouped-query Llama shape) at two shapes, and a small Mixtral in bf16 at ZeRO 0-3 with and without expert
parallel 2, run
through bin/train under the deepspeed launcher, in interleaved rounds (every setting once a round, the order
reversed on odd rounds). Every setting trains the same global batch (sequence parallelism accumulates twice).

For each job: the planner's estimated step of each setting (trainer/strategy/planning/speed.py, as bin/train
plans it here) against the median measured step, Spearman's rho between the two orders, and the measured step
of the planner's pick among these settings (the fastest by its estimate under the escalation rules: no offload
where a setting without it fits) against the fastest measured one. Targets: rho >= 0.8, the pick within 10%.

    python bench/plan_order.py [--rounds 3] [--steps 12] [--jobs gpt2-256,llama-1024] [--out FILE.json]

It writes FILE.json (default bench/results/plan-order-cpu-<date>.json) and prints the table BENCHMARKS.md
takes; tests/unit/test_plan_order.py holds the planner's order against the newest such file. The step times
need a quiet machine: one core per rank, nothing else running.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8, "n_positions": 1024,
        "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0}  # fmt: skip
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}  # fmt: skip
# a small Mixtral (8 experts, 2 a token), trained in bf16 as AutoEP needs; rows unpacked (text blocks here anyway)
MIXTRAL = {**LLAMA, "model_type": "mixtral", "intermediate_size": 256, "num_local_experts": 8,
           "num_experts_per_tok": 2}  # fmt: skip
# name -> (model config, seq_len, micro batch, global batch): two models at two shapes
JOBS = {
    "gpt2-256": (GPT2, 256, 4, 8),
    "gpt2-1024": (GPT2, 1024, 1, 2),
    "llama-256": (LLAMA, 256, 4, 8),
    "llama-1024": (LLAMA, 1024, 1, 2),
    "mixtral-256": (MIXTRAL, 256, 2, 4),
}
RUNGS = {
    "zero0": {"strategy.zero_stage": 0, "strategy.offload": "none"},
    "zero1": {"strategy.zero_stage": 1, "strategy.offload": "none"},
    "zero2": {"strategy.zero_stage": 2, "strategy.offload": "none"},
    "zero3": {"strategy.zero_stage": 3, "strategy.offload": "none"},
    "zero2+cpu": {"strategy.zero_stage": 2, "strategy.offload": "cpu"},
    "zero3+cpu (optimizer only)": {"strategy.zero_stage": 3, "strategy.offload": "cpu",
                                   "strategy.offload_params": False},
    "zero3+cpu": {"strategy.zero_stage": 3, "strategy.offload": "cpu", "strategy.offload_params": True},
}  # fmt: skip
LEVERS = {
    "none": {},
    "activation checkpointing": {"model.activation_checkpointing": True},
    "tiled loss": {"model.chunked_loss": True},
    "tiled MLP": {"model.tiled_mlp": True},
    "sequence parallel 2": {"strategy.sequence_parallel": 2},
    "tensor parallel 2": {"strategy.tensor_parallel": 2},
    "expert parallel 2": {"strategy.expert_parallel": 2},
    "pipeline stages 2": {"strategy.pipeline_stages": 2},
}
AXES = (
    "tensor parallel 2",
    "expert parallel 2",
    "pipeline stages 2",
)  # the model-parallel axes (issues 70, 71): the jobs whose model takes them
SETTINGS = [(r, "none") for r in RUNGS] + [("zero0", lv) for lv in LEVERS if lv != "none" and lv not in AXES]
SETTINGS.append(("zero3", "activation checkpointing"))
NPROC = 2


def settings(name: str) -> list[tuple[str, str]]:
    """The settings a job is measured at: every rung and lever; tensor parallel 2 at ZeRO 0-2 for the Llamas
    (AutoTP does not take GPT-2); pipeline stages 2 at ZeRO 0-1 for the Llamas and GPT-2s (DeepSpeed's pipeline
    engine takes no higher stage); the Mixtral at ZeRO 0-3 without and with expert parallel 2."""
    if name.startswith("mixtral"):
        return [(r, lv) for lv in ("none", "expert parallel 2") for r in ("zero0", "zero1", "zero2", "zero3")]
    stages = [(r, "pipeline stages 2") for r in ("zero0", "zero1")]
    if name.startswith("llama"):
        return SETTINGS + [(r, "tensor parallel 2") for r in ("zero0", "zero1", "zero2")] + stages
    return SETTINGS + stages


def job_sets(name: str) -> dict[str, Any]:
    cfg, seq, micro, global_batch = JOBS[name]
    return {
        "model.config": json.dumps(cfg),
        "model.attn_implementation": "sdpa",
        "data.seq_len": seq,
        "train.micro_batch_size": micro,
        "train.precision": "bf16" if cfg is MIXTRAL else "fp32",
        "train.eval_prompts": [],
        # planned as the same machine whatever runs the test: every setting fits in these
        "strategy.device_memory": "8GB",
        "strategy.host_memory": "32GB",
        "model.activation_checkpointing": False,
        "model.chunked_loss": False,
        "model.tiled_mlp": False,
        "model.offload_activations": False,
        "strategy.sequence_parallel": 1,
        "strategy.tensor_parallel": 1,
        "strategy.expert_parallel": 1,
        "strategy.pipeline_stages": 1,
        "strategy.justification": "benchmark",
    }


def setting_sets(name: str, rung: str, levers: str) -> dict[str, Any]:
    """The setting's overrides, and the accumulation that trains the job's global batch at its degree."""
    _, _, micro, global_batch = JOBS[name]
    lv = LEVERS[levers]
    mp = (lv.get("strategy.sequence_parallel", 1) * lv.get("strategy.tensor_parallel", 1)
          * lv.get("strategy.pipeline_stages", 1))  # fmt: skip
    return {**RUNGS[rung], **LEVERS[levers], "train.grad_accum": global_batch // (micro * (NPROC // mp))}


def label(rung: str, levers: str) -> str:
    return rung if levers == "none" else f"{rung} + {levers}"


def plan_of(name: str, rung: str, levers: str) -> Any:
    """The planner's plan of one setting, as bin/train plans it on this CPU with 2 ranks."""
    from bench.common import TINY, overrides
    from trainer import config
    from trainer.run.plan import make_plan, vocab_for_planning

    sets = {**job_sets(name), **setting_sets(name, rung, levers)}
    args = overrides(sets)
    exp = config.load(TINY, [args[i + 1] for i in range(0, len(args), 2)])
    vocab, eos = vocab_for_planning(exp)
    p = make_plan(exp, world_size=NPROC, gpus_per_node=NPROC, device_type="cpu", device_memory=None,
                  vocab_size=vocab, eos_id=eos, force=False, this_machine=False).plan  # fmt: skip
    assert (p.candidate.name, p.levers.describe()) == (rung, levers), (p.candidate.name, p.levers.describe())
    return p


def planned(name: str, rung: str, levers: str) -> dict[str, Any]:
    """The planner's estimate of one setting (`plan_of`)."""
    p = plan_of(name, rung, levers)
    return {
        "seconds": p.speed.seconds,
        "per_token": p.speed.per_token,
        "offload": p.candidate.offload != "none",
    }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists (ties: their mean rank)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """rho between the planned and measured orders; the planner's pick among these settings (no offload where
    a setting without it is here; the fastest estimate, ties to the earlier setting) against the fastest
    measured of the settings the rules allow, and of all."""
    plan = [r["planned_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    allowed = [r for r in rows if not r["offload"]] or rows
    least = min(r["planned_s"] for r in allowed)  # ties (within 1e-9) to the earlier, cheaper setting
    pick = next(r for r in allowed if r["planned_s"] <= least * (1 + 1e-9))
    best = min(allowed, key=lambda r: r["measured_s"])
    overall = min(rows, key=lambda r: r["measured_s"])
    return {
        "rho": spearman(plan, measured),
        "pick": pick["setting"],
        "pick_s": pick["measured_s"],
        "fastest": best["setting"],
        "fastest_s": best["measured_s"],
        "pick_ratio": pick["measured_s"] / best["measured_s"],
        "fastest_overall": overall["setting"],
        "pick_ratio_overall": pick["measured_s"] / overall["measured_s"],
    }


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from bench.common import TINY, TRAIN, env_for, interleave, launch, median_after, overrides, run_sets

    work = Path(tempfile.mkdtemp(prefix="bench-plan-order-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    out: dict[str, Any] = {
        "nproc": NPROC,
        "rounds": a.rounds,
        "steps": a.steps,
        "warmup": a.warmup,
        "jobs": {},
    }
    for name in a.jobs.split(","):
        sides = [label(r, lv) for r, lv in settings(name)]
        by_label = dict(zip(sides, settings(name), strict=True))

        def run(side: str, r: int, name: str = name, by_label: dict = by_label) -> float:
            rung, levers = by_label[side]
            shutil.rmtree(work / "run", ignore_errors=True)
            sets = {
                **run_sets(a.steps, 1, work / "run", cache),
                **job_sets(name),
                **setting_sets(name, rung, levers),
            }
            launch([str(TRAIN), str(TINY), *overrides(sets)], NPROC, env_for(NPROC))
            lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
            med = median_after([m for m in lines if "loss" in m], a.warmup, 1)
            print(f"  {name} {side:42} round {r}: median step {med * 1000:.0f} ms", flush=True)
            return med

        results = interleave(sides, a.rounds, run, alternate=True)
        rows = []
        for side, (rung, levers) in zip(sides, settings(name), strict=True):
            est = planned(name, rung, levers)
            rows.append({"setting": side, "rung": rung, "levers": levers, "measured": results[side],
                         "measured_s": statistics.median(results[side]), "planned_s": est["seconds"],
                         "offload": est["offload"]})  # fmt: skip
        out["jobs"][name] = {"rows": rows, **verdict(rows)}
    shutil.rmtree(work, ignore_errors=True)
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown BENCHMARKS.md takes: per job, each setting's planned and measured step, then the verdict."""
    lines = []
    for name, j in result["jobs"].items():
        lines += [f"**{name}** (Spearman's rho {j['rho']:.2f}; the pick, {j['pick']}, at {j['pick_ratio']:.2f}x "
                  f"the fastest measured without offload, {j['fastest']}; {j['pick_ratio_overall']:.2f}x the "
                  f"fastest of all, {j['fastest_overall']})", "",
                  "| setting | planned s/step | measured s/step (median; rounds) | measured / planned |",
                  "|---|---|---|---|"]  # fmt: skip
        for r in sorted(j["rows"], key=lambda r: r["measured_s"]):
            rounds = ", ".join(f"{x:.3f}" for x in r["measured"])
            lines.append(f"| {r['setting']} | {r['planned_s']:.3f} | {r['measured_s']:.3f} ({rounds}) | "
                         f"{r['measured_s'] / r['planned_s']:.2f} |")  # fmt: skip
        lines.append("")
    rhos = [j["rho"] for j in result["jobs"].values()]
    ratios = [j["pick_ratio"] for j in result["jobs"].values()]
    lines.append(f"rho {min(rhos):.2f}-{max(rhos):.2f} (target >= 0.8); the pick within "
                 f"{(max(ratios) - 1) * 100:.0f}% of the fastest (target 10%)")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    p.add_argument("--jobs", default=",".join(JOBS))
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = measure(a)
    result["date"] = datetime.date.today().isoformat()
    out = Path(a.out or RESULTS / f"plan-order-cpu-{result['date']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{table(result)}\n\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
