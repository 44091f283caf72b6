"""preference: what a DPO step costs against an SFT step on the same pairs. The same model, micro batch
(pairs on one side, conversations on the other), precision, ranks and plan (the ZeRO stage and the
activation levers must come out the same: the bench stops where they do not), interleaved: SFT on
each pair's prompt and chosen response (a chat file made from the pairs), DPO on the pairs (chosen
and rejected in one forward; the reference's log-probs computed once as training starts, so a step
runs no reference model). The median step times' ratio DPO / SFT beside the ratio of the tokens a
step feeds: with the reference precomputed the first should follow the second (about 2x); a
reference forward every step would add about a third of a step's work more (about 2.7x)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    TRAIN,
    cache_dir,
    env_for,
    interleave,
    job,
    launch,
    median_after,
    overrides,
    ratio,
    run_sets,
)

PAIRS = ROOT / "data" / "tiny" / "python_prefs.jsonl"
PLAN = re.compile(r"strategy: (ZeRO stage \d+, offload \w+)|activation levers: ([^(\n]*?) \(")


def chat_from_pairs(pairs: Path, out: Path) -> Path:
    """Each pair's prompt and chosen response as one conversation (`messages`), the SFT side's data. A
    prompt or response given as text (not messages) is the user's or the assistant's turn."""

    def turns(value: Any, role: str) -> list[dict[str, Any]]:
        return [{"role": role, "content": value}] if isinstance(value, str) else list(value)

    rows = [json.loads(line) for line in pairs.read_text().splitlines() if line.strip()]
    out.write_text(
        "".join(
            json.dumps({"messages": turns(r["prompt"], "user") + turns(r["chosen"], "assistant")}) + "\n"
            for r in rows
        )  # fmt: skip
    )
    return out


def preference(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-preference-"))
    try:
        return _measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    experiment, sets = job(a, gpu=False, cpu_sets={})  # tiny unless --experiment; then each --set
    if "data.packing" in sets:
        raise SystemExit(
            "preference: pairs are never packed, and the SFT side is not either; drop data.packing"
        )
    n = a.nproc or 1
    base = {
        **run_sets(a.steps, a.log_every, work / "run", cache_dir(a)),
        "train.micro_batch_size": a.micro,
        "train.eval_prompts": [],
        "data.eval_fraction": 0,
        **sets,
    }
    sides = {
        "sft": {"data.train.files": str(chat_from_pairs(Path(a.pairs), work / "chat.jsonl")),
                "data.train.kind": "chat", "train.objective": "sft",
                "data.packing": False},  # pairs are not packed: neither are the conversations
        "dpo": {"data.train.files": str(Path(a.pairs).resolve()), "data.train.kind": "preference",
                "train.objective": "dpo"},
    }  # fmt: skip
    tokens: dict[str, list[float]] = {s: [] for s in sides}
    plans: dict[str, str] = {}

    def run(name: str, r: int) -> float:
        shutil.rmtree(work / "run", ignore_errors=True)
        args = [str(TRAIN), str(experiment), *overrides({**base, **sides[name]})]
        p = launch(args, n, env_for(n))
        plans[name] = "; ".join(x for m in PLAN.finditer(p.stdout) for x in m.groups() if x)
        if len(plans) == 2 and len(set(plans.values())) > 1:
            raise SystemExit(
                f"preference: the sides were planned differently ({plans}); pin them alike, e.g. --set "
                "strategy.zero_stage=0 --set model.activation_checkpointing=false, or lower --micro"
            )
        lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in lines if "loss" in m and "step_time_s" in m]
        med = median_after(steps, a.warmup, a.log_every)
        tokens[name].append(statistics.median(m["tokens_per_step"] for m in steps))
        print(
            f"  {name}  round {r}: median step {med * 1000:.1f} ms, {tokens[name][-1]:.0f} tokens a step",
            flush=True,
        )
        return med

    results = interleave(tuple(sides), a.rounds, run, alternate=True)
    r = ratio(results["dpo"], results["sft"])
    fed = statistics.median(tokens["dpo"]) / statistics.median(tokens["sft"])
    print(
        f"\n# preference: {experiment.name}, micro {a.micro}, {n} rank(s), {plans['dpo']}: DPO {r['num'] * 1000:.1f} "
        f"ms/step, SFT {r['den'] * 1000:.1f} ms/step: ratio {r['ratio']:.2f} (rounds {r['ratio_min']:.2f}-"
        f"{r['ratio_max']:.2f}); tokens a step DPO/SFT {fed:.2f}"
    )
    return {
        "preference": {**results, "ratio": r, "tokens_per_step": tokens, "tokens_ratio": fed, "plan": plans}
    }
