"""peer: bin/train with its defaults against the Hugging Face Trainer with DeepSpeed (bench/hf_peer.py)
at the same stage, on the same job, interleaved A B then B A: median step time after warm-up,
tokens/s, the ratio ours/HF of tokens/s and the paired ratio of the rounds. Also the peer shapes'
model configs for the one-process step scripts (step_config)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    CPU_SETS,
    ROOT,
    cache_dir,
    cores,
    env_for,
    interleave,
    job,
    launch,
    median_after,
    ours,
    ratio,
    run_sets,
    spec_for,
)

# The peer benchmark's shapes on CPU (bin/train's tiny data, 2 gloo ranks, micro 8 x 128 tokens):
# tiny itself, a 4-layer 256-wide GPT-2, and a Llama with grouped-query attention.
PEER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "gpt2-4x256": {"model.config.n_embd": 256, "model.config.n_head": 4},
    "llama-gqa": {
        "model.config": json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
            }
        ),  # fmt: skip
    },
}


def step_config(shape: str) -> Any:
    """A peer shape's model config for the one-process step scripts (bench/malloc_step.py,
    bench/allreduce_step.py): "tiny" (4 x 128 GPT-2), "gpt2" (gpt2-4x256) or "llama" (llama-gqa),
    with tiny's byte vocabulary and tiny.yaml's GPT-2 settings (no dropout, tanh GELU in one kernel)."""
    from transformers import AutoConfig

    if shape == "llama":
        return AutoConfig.for_model(**json.loads(PEER_SHAPES["llama-gqa"]["model.config"]), vocab_size=257)
    return AutoConfig.for_model(model_type="gpt2", n_layer=4, n_embd=256 if shape == "gpt2" else 128, n_head=4,
                                vocab_size=257, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                activation_function="gelu_pytorch_tanh")  # fmt: skip


def hf(spec: dict[str, Any], nproc: int, work: Path) -> dict[str, Any]:
    out = work / "hf.json"
    spec_file = work / "hf-spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out), "work": str(work / "hf-out")}))
    launch([str(ROOT / "bench" / "hf_peer.py"), "--spec", str(spec_file)], nproc, env_for(nproc))
    return json.loads(out.read_text())


def hf_args(variant: str) -> dict[str, Any]:
    """A --hf-variants entry as TrainingArguments: "default" (none) or KEY=VALUE[,KEY=VALUE], each value
    read as JSON where it parses (true, 1, "x"), else as a string: torch_compile=true,use_liger_kernel=true."""
    if variant == "default":
        return {}
    out: dict[str, Any] = {}
    for item in variant.split(","):
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"--hf-variants: '{variant}' is not 'default' or KEY=VALUE[,KEY=VALUE]")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def job_rows(
    a: argparse.Namespace, experiment: Path, shape: str, sets: dict[str, Any], spec: dict[str, Any], nproc: int,
    variants: list[str], work: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """One shape and stage: bin/train and each HF variant (the Trainer's own options on top of its
    DeepSpeed config; "default": none) over the rounds, A B then B A; a row per variant that ran."""
    stage = sets["strategy.zero_stage"]
    failed: set[str] = set()

    def run(side: str, r: int) -> dict[str, Any] | None:
        if side == "ours":
            res = ours(experiment, sets, nproc, work)
        else:
            try:
                res = hf({**spec, "hf_args": hf_args(side)}, nproc, work)
            except SystemExit as e:  # a Trainer option that fails here is reported, not fatal
                print(f"  {shape} zero{stage} {side}: failed\n{str(e)[-3000:]}", flush=True)
                failed.add(side)
                return None
        med = median_after(res["intervals"], a.warmup, a.log_every)
        print(f"  {shape} zero{stage} round {r} {side:4}: median step {med * 1000:8.1f} ms", flush=True)
        return {"median": med, "intervals": [x["step_time_s"] for x in res["intervals"]],
                "losses": [x["loss"] for x in res.get("losses", res["intervals"])]}  # fmt: skip

    runs = interleave(["ours", *variants], a.rounds, run, alternate=True)
    tokens_per_step = spec["micro"] * nproc * spec["grad_accum"] * spec["seq_len"]
    rows, medians = [], {side: [x["median"] for x in runs[side]] for side in runs}
    for variant in (v for v in variants if v not in failed):
        s = ratio(medians[variant], medians["ours"])  # tokens/s ours / hf, per round too
        o, h = s["den"], s["num"]
        rows.append({
            "shape": shape, "stage": stage, "hf_variant": variant, "ours_step_ms": o * 1000,
            "hf_step_ms": h * 1000, "ours_tokens_per_s": tokens_per_step / o,
            "hf_tokens_per_s": tokens_per_step / h, "ratio": s["ratio"], "ratio_min": s["ratio_min"],
            "ratio_max": s["ratio_max"], "runs": {"ours": medians["ours"], "hf": medians[variant]},
            "intervals": {"ours": [x["intervals"] for x in runs["ours"]], "hf": [x["intervals"] for x in runs[variant]]},
            "paired": s["paired"], "ours_faster": s["at_least_1"],
            "losses": {"ours": runs["ours"][-1]["losses"], "hf": runs[variant][-1]["losses"]},
            "ours_ds_config": spec["ds_config"].get("zero_optimization"),
        })  # fmt: skip
    return rows


def print_table(results: list[dict[str, Any]], rounds: int) -> None:
    print()
    # ours/HF: the ratio of the two medians, its range over rounds; paired: the geometric mean of the
    # rounds' own ratios (each round's two runs are neighbours in time), and in how many rounds ours won
    print(
        "| shape | stage | HF Trainer ms/step | bin/train ms/step | ours/HF tokens/s (min-max over rounds) "
        "| paired ratio (rounds ours >= HF) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        variant = "" if r["hf_variant"] == "default" else f" ({r['hf_variant']})"
        print(
            f"| {r['shape']} | {r['stage']} | {r['hf_step_ms']:.1f}{variant} | {r['ours_step_ms']:.1f} | "
            f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['paired']:.2f} ({r['ours_faster']} of {rounds}) |"
        )


def peer(a: argparse.Namespace) -> dict[str, Any]:
    """bin/train with its defaults against the Hugging Face Trainer with DeepSpeed at the same stage,
    on the same job, interleaved A B per round: median step time after warm-up, tokens/s, ratio."""
    import torch

    gpu = torch.cuda.is_available() and not a.cpu
    nproc = a.nproc or (torch.cuda.device_count() if gpu else 2)
    experiment, _ = job(a, gpu)
    shapes = a.shapes or ([experiment.stem] if gpu else list(PEER_SHAPES))
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    cache = cache_dir(a)
    print(
        f"# peer: bin/train against the HF Trainer ({a.peer_config} DeepSpeed config) on {nproc} "
        f"{'GPU' if gpu else 'CPU'} rank(s); {a.rounds} rounds A B, {a.steps} steps, median of the "
        f"{a.log_every}-step intervals after step {a.warmup}",
        flush=True,
    )
    variants = a.hf_variants or ["default"]
    for v in variants:
        hf_args(v)  # a malformed variant fails before any run
    results = []
    for shape in shapes:
        _, base = job(a, gpu, {**CPU_SETS, **PEER_SHAPES.get(shape, {})})
        for stage in a.stages:
            sets = {
                **base,
                **run_sets(a.steps, a.log_every, work / "run", cache),
                "strategy.zero_stage": stage,
            }
            spec = spec_for(experiment, sets, nproc)
            # the Trainer gets bin/train's threads per rank (both ranks share this machine's cores)
            spec.update(stage=stage, peer_config=a.peer_config, schedule="cosine",
                        threads=None if gpu else max(1, cores() // nproc))  # fmt: skip
            results += job_rows(a, experiment, shape, sets, spec, nproc, variants, work)
    shutil.rmtree(work, ignore_errors=True)
    print_table(results, a.rounds)
    return {"peer": results, "device": "cuda" if gpu else "cpu", "nproc": nproc, "peer_config": a.peer_config}
