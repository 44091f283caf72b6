#!/usr/bin/env python3
"""Benchmarks of the wrapper's cost, as ratios measured side by side in one run (see BENCHMARKS.md).

    bench/bench.py compare  [--stages 0 2 3] [--rounds 2] [--steps 40] [--warmup 10] [--nproc 2]
    bench/bench.py peer     [--stages 0 2 3] [--shapes tiny gpt2-4x256 llama-gqa] [--rounds 3] [--peer-config minimal]
    bench/bench.py startup  [--rounds 3]
    bench/bench.py threads  [--rounds 2]
    bench/bench.py datawait [--nproc 1] [--settings 1 auto] [--rounds 2]
    bench/bench.py checkpoint [--rounds 2] [--steps 21] [--every 4] [--stage 2]
    bench/bench.py scaling  [--stages 0 2 3] [--ranks 1 2] [--steps 60] [--out runs/scaling]

compare: the same model, data, seed and DeepSpeed JSON (a) through bin/train and (b) through a
minimal hand-written DeepSpeed loop (bench/raw_loop.py), interleaved A B A B under the deepspeed
launcher; median step time over the log intervals after warm-up, tokens/s, the ratio ours/raw (and
its min and max over rounds) and whether the final weights are bitwise equal. On a CUDA machine it
measures the GPT-2 124M experiment (configs/experiments/gpt2-124m.yaml) in bf16 and adds MFU.
startup: seconds from starting bin/train to its first completed step, against bench/bare_start.py
(import deepspeed, build the same model, deepspeed.initialize, one step); and `--help`, `--plan`.
threads: 2 ranks on this machine with the automatic threads per rank against torch's default.
datawait: the share of step time spent waiting for data on tiny, per data.num_workers setting.
scaling: runs of one experiment at each world size in --ranks, per stage: the batch per rank kept
(weak scaling) and the global batch of the most ranks kept through gradient accumulation (strong
scaling); then `bin/report` on all of them (efficiencies, loss curves overlaid). On CPU every rank
gets one thread, so that a rank is one core as a GPU is one device.
checkpoint: synchronous against asynchronous saves (checkpoint.async) of a ~100M-parameter model,
interleaved: training blocked per save, the background write time, step times around saves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from trainer.dist import free_port, gpu_present, malloc_env  # noqa: E402  (free_port: a rendezvous port outside the ephemeral range)

TRAIN = ROOT / "bin" / "train"
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
GPT2 = ROOT / "configs" / "experiments" / "gpt2-124m.yaml"
BIN = Path(sys.executable).parent

# CPU: tiny with 8 sequences per rank, so that a step on 2 gloo ranks (one thread each) takes well
# over 100 ms (about 350 ms on a 2-core machine).
CPU_SETS = {"train.micro_batch_size": 8}


def cores() -> int:
    return len(os.sched_getaffinity(0))


def run_sets(steps: int, log_every: int, run_dir: Path, cache: Path) -> dict[str, Any]:
    return {
        "train.max_steps": steps,
        "train.log_every": log_every,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "checkpoint.every_steps": 0,
        "checkpoint.save_final": False,
        "strategy.justification": "benchmark",
        "run_dir": str(run_dir),
        "data.cache_dir": str(cache),
    }


def overrides(sets: dict[str, Any]) -> list[str]:
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={json.dumps(v) if isinstance(v, bool | list) else v}"]
    return out


def env_for(nproc: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores() // nproc)))  # the same for both sides
    env.update(extra or {})
    return env


def deepspeed_runner() -> list[str]:
    """The `deepspeed` launcher beside this interpreter, or its module where no script was installed
    (a package installed with pip --target, as on a borrowed GPU machine)."""
    script = BIN / "deepspeed"
    return [str(script)] if script.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]


def launch(args: list[str], nproc: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [*deepspeed_runner(), "--num_gpus", str(nproc), "--master_port", str(free_port()), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def job(
    a: argparse.Namespace, gpu: bool, cpu_sets: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The experiment a mode measures and the overrides both sides get: GPT-2 124M on GPU, tiny with
    `cpu_sets` (default CPU_SETS) on CPU, unless --experiment names one; then each --set KEY=VALUE."""
    experiment = Path(a.experiment) if a.experiment else (GPT2 if gpu else TINY)
    base = {} if gpu or a.experiment else dict(CPU_SETS if cpu_sets is None else cpu_sets)
    for item in a.set or []:
        k, _, v = item.partition("=")
        base[k] = v
    return experiment, base


def median_after(intervals: list[dict[str, Any]], warmup: int, log_every: int) -> float:
    """Median of the per-interval mean step times, over the intervals that start after `warmup`."""
    return statistics.median(r["step_time_s"] for r in intervals if r["step"] - log_every >= warmup)


# ----------------------------------------------------------------------------- compare


def spec_for(experiment: Path, sets: dict[str, Any], nproc: int) -> dict[str, Any]:
    """What the raw loop needs to run exactly what bin/train runs: the DeepSpeed JSON bin/train
    prints for this world size, the model config with the tokenizer's vocabulary, the packed data."""

    from trainer import config, data, model
    from trainer.config import thaw
    from trainer.data.stream import resolve_workers
    from trainer.dist import gpu_present
    from trainer.metrics import flops_per_token

    p = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            str(experiment),
            "--print-config",
            "--world-size",
            str(nproc),
            *overrides(sets),
        ],
        cwd=ROOT,
        env=env_for(nproc),
        capture_output=True,
        text=True,
        check=True,
    )
    ds_text = p.stdout[p.stdout.index("# DeepSpeed config") :]
    ds_config = json.loads(ds_text[ds_text.index("{") :])
    exp = config.load(str(experiment), [f"{k}={v}" for k, v in sets.items()])
    built = data.build(exp.data, exp.seed, is_main=True)
    fields = thaw(exp.model.config)
    fields.setdefault("vocab_size", built.vocab_size)
    for key in ("bos_token_id", "eos_token_id"):
        fields.setdefault(key, built.eos_id)
    gpu = gpu_present()  # what bin/train plans with (trainer/cli.py), CUDA_VISIBLE_DEVICES included
    precision = (
        "bf16"
        if ds_config.get("bf16", {}).get("enabled")
        else "fp16"
        if ds_config.get("fp16", {}).get("enabled")
        else "fp32"
    )
    section = model.resolved(
        exp.model, seq_len=exp.data.seq_len, precision=precision, device_type="cuda" if gpu else "cpu"
    )
    info = model.info(section, built.vocab_size, built.eos_id, cache_dir=exp.data.cache_dir)
    user_attn = exp.model.attn_implementation
    return {
        "ds_config": ds_config,
        "model_config": fields,
        "attn_implementation": section.attn_implementation,  # the raw loop: what bin/train runs
        # the Trainer: what the experiment names, the model's default for auto (a user's Trainer does not
        # decide auto; --hf-variants attn_implementation=eager gives it bin/train's choice)
        "hf_attn_implementation": None if user_attn == "auto" else user_attn,
        "seed": exp.seed,
        "data": str(Path(built.cache_path) / "train.npy"),
        "micro": exp.train.micro_batch_size,
        "grad_accum": exp.train.grad_accum,
        "steps": exp.train.max_steps,
        "compile": exp.train.compile,
        "compile_mode": exp.train.compile_mode,
        "chunked_loss": exp.model.chunked_loss,
        "log_every": exp.train.log_every,
        "weight_decay": exp.optim.weight_decay,
        "warmup_steps": exp.optim.warmup_steps,  # the JSON's warmup_num_steps is DeepSpeed's (at least 2)
        "num_workers": resolve_workers(exp.data.num_workers, "cuda" if gpu else "cpu"),
        "pin_memory": exp.data.pin_memory,
        "persistent_workers": exp.data.persistent_workers,
        "seq_len": exp.data.seq_len,
        "params": info.params,
        "flops_per_token": flops_per_token(
            info.params, info.layers, info.hidden, exp.data.seq_len, info.trainable
        ),
    }


def ours(experiment: Path, sets: dict[str, Any], nproc: int, work: Path) -> dict[str, Any]:
    debug = work / "debug"
    shutil.rmtree(work / "run", ignore_errors=True)
    shutil.rmtree(debug, ignore_errors=True)
    launch(
        [str(TRAIN), str(experiment), *overrides(sets)],
        nproc,
        env_for(nproc, {"TRAINER_DEBUG_DIR": str(debug)}),
    )
    lines = [json.loads(x) for x in (Path(sets["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    intervals = [
        {"step": m["step"], "step_time_s": m["step_time_s"], "loss": m["loss"]} for m in lines if "loss" in m
    ]
    report = json.loads((debug / "rank0.json").read_text())
    return {"intervals": intervals, "param_digest": report["param_digest"]}


def raw(spec: dict[str, Any], nproc: int, work: Path) -> dict[str, Any]:
    out = work / "raw.json"
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    # the raw loop gets bin/train's malloc settings too (trainer.dist.keep_freed_memory, CPU), as the
    # environment variables that mean the same: the comparison is of the loops
    malloc = {} if gpu_present() else malloc_env()
    launch([str(ROOT / "bench" / "raw_loop.py"), "--spec", str(spec_file)], nproc, env_for(nproc, malloc))
    return json.loads(out.read_text())


def compare(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    gpu = torch.cuda.is_available() and not a.cpu
    nproc = a.nproc or (torch.cuda.device_count() if gpu else 2)
    experiment, base = job(a, gpu)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    print(
        f"# compare: {experiment.name} on {nproc} {'GPU' if gpu else 'CPU'} rank(s); {a.rounds} rounds A B, "
        f"{a.steps} steps, median of the {a.log_every}-step intervals after step {a.warmup}",
        flush=True,
    )
    for stage in a.stages:
        sets = {**base, **run_sets(a.steps, a.log_every, work / "run", cache), "strategy.zero_stage": stage}
        spec = spec_for(experiment, sets, nproc)
        tokens_per_step = spec["micro"] * nproc * spec["grad_accum"] * spec["seq_len"]
        rows: dict[str, list[Any]] = {"ours": [], "raw": []}
        for r in range(a.rounds):
            for side in ("ours", "raw"):
                t0 = time.perf_counter()
                res = ours(experiment, sets, nproc, work) if side == "ours" else raw(spec, nproc, work)
                med = median_after(res["intervals"], a.warmup, a.log_every)
                rows[side].append({**res, "median_step_s": med})
                print(
                    f"  zero{stage} round {r} {side:4}: median step {med * 1000:8.1f} ms  "
                    f"({time.perf_counter() - t0:.0f} s wall)",
                    flush=True,
                )
        o = statistics.median(x["median_step_s"] for x in rows["ours"])
        w = statistics.median(x["median_step_s"] for x in rows["raw"])
        per_round = [
            x["median_step_s"] / y["median_step_s"] for x, y in zip(rows["ours"], rows["raw"], strict=True)
        ]
        digests = {x["param_digest"] for x in rows["ours"] + rows["raw"]}
        res = {
            "stage": stage,
            "ours_step_ms": o * 1000,
            "raw_step_ms": w * 1000,
            "ours_tokens_per_s": tokens_per_step / o,
            "raw_tokens_per_s": tokens_per_step / w,
            "ratio": o / w,
            "ratio_min": min(per_round),
            "ratio_max": max(per_round),
            "bitwise_equal": len(digests) == 1,
            "runs": {side: [x["median_step_s"] for x in rows[side]] for side in rows},
            "intervals": {
                side: [[r["step_time_s"] for r in x["intervals"]] for x in rows[side]] for side in rows
            },
        }
        if gpu:
            from trainer.metrics import peak_flops

            peak = peak_flops(torch.device("cuda", 0))
            if peak:
                res["ours_mfu"] = res["ours_tokens_per_s"] / nproc * spec["flops_per_token"] / peak
                res["raw_mfu"] = res["raw_tokens_per_s"] / nproc * spec["flops_per_token"] / peak
        results.append(res)
    shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        "| stage | ours ms/step | raw ms/step | ours tok/s | raw tok/s | ratio ours/raw (min-max) | weights bitwise equal |"
        + (" MFU ours / raw |" if gpu else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    for r in results:
        mfu = f" {r['ours_mfu']:.1%} / {r['raw_mfu']:.1%} |" if "ours_mfu" in r else (" n/a |" if gpu else "")
        print(
            f"| {r['stage']} | {r['ours_step_ms']:.1f} | {r['raw_step_ms']:.1f} | {r['ours_tokens_per_s']:,.0f} | "
            f"{r['raw_tokens_per_s']:,.0f} | {r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
            f"{'yes' if r['bitwise_equal'] else 'NO'} |{mfu}"
        )
    return {
        "compare": results,
        "device": "cuda" if gpu else "cpu",
        "nproc": nproc,
        "experiment": experiment.name,
    }


# ----------------------------------------------------------------------------- peer

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


def peer(a: argparse.Namespace) -> dict[str, Any]:
    """bin/train with its defaults against the Hugging Face Trainer with DeepSpeed at the same stage,
    on the same job, interleaved A B per round: median step time after warm-up, tokens/s, ratio."""
    import torch

    gpu = torch.cuda.is_available() and not a.cpu
    nproc = a.nproc or (torch.cuda.device_count() if gpu else 2)
    experiment, _ = job(a, gpu)
    shapes = a.shapes or ([experiment.stem] if gpu else list(PEER_SHAPES))
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
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
            tokens_per_step = spec["micro"] * nproc * spec["grad_accum"] * spec["seq_len"]
            # each HF variant: the Trainer's own options on top of its DeepSpeed config ("default": none)
            sides = ["ours", *variants]
            rows: dict[str, list[float]] = {s: [] for s in sides}
            spread: dict[str, list[list[float]]] = {s: [] for s in sides}  # each round's interval step times
            losses: dict[str, list[float]] = {}
            failed: set[str] = set()
            for r in range(a.rounds):
                # A B, then B A: neither side always runs right after the other (A B B A A B ...)
                for side in sides if r % 2 == 0 else sides[::-1]:
                    if side in failed:
                        continue
                    if side == "ours":
                        res = ours(experiment, sets, nproc, work)
                    else:
                        try:
                            res = hf({**spec, "hf_args": hf_args(side)}, nproc, work)
                        except SystemExit as e:  # a Trainer option that fails here is reported, not fatal
                            print(f"  {shape} zero{stage} {side}: failed\n{str(e)[-3000:]}", flush=True)
                            failed.add(side)
                            continue
                    med = median_after(res["intervals"], a.warmup, a.log_every)
                    rows[side].append(med)
                    spread[side].append([x["step_time_s"] for x in res["intervals"]])
                    losses[side] = [x["loss"] for x in res.get("losses", res["intervals"])]
                    print(
                        f"  {shape} zero{stage} round {r} {side:4}: median step {med * 1000:8.1f} ms",
                        flush=True,
                    )
            o = statistics.median(rows["ours"])
            for variant in (v for v in variants if v not in failed):
                h = statistics.median(rows[variant])
                # tokens/s ours / hf per round
                per_round = [y / x for x, y in zip(rows["ours"], rows[variant], strict=True)]
                results.append({
                    "shape": shape, "stage": stage, "hf_variant": variant, "ours_step_ms": o * 1000,
                    "hf_step_ms": h * 1000, "ours_tokens_per_s": tokens_per_step / o,
                    "hf_tokens_per_s": tokens_per_step / h, "ratio": h / o, "ratio_min": min(per_round),
                    "ratio_max": max(per_round), "runs": {"ours": rows["ours"], "hf": rows[variant]},
                    "intervals": {"ours": spread["ours"], "hf": spread[variant]},
                    "paired": statistics.geometric_mean(per_round), "ours_faster": sum(x >= 1 for x in per_round),
                    "losses": {"ours": losses["ours"], "hf": losses[variant]},
                    "ours_ds_config": spec["ds_config"].get("zero_optimization"),
                })  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
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
            f"{r['paired']:.2f} ({r['ours_faster']} of {a.rounds}) |"
        )
    return {"peer": results, "device": "cuda" if gpu else "cpu", "nproc": nproc, "peer_config": a.peer_config}


# ----------------------------------------------------------------------------- startup


def time_to_line(cmd: list[str], pattern: str, env: dict[str, str]) -> float:
    """Seconds from starting `cmd` to the first output line matching `pattern` (then it is waited for)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = None
    tail = []
    for line in p.stdout:
        tail = (tail + [line])[-30:]
        if found is None and re.search(pattern, line):
            found = time.perf_counter() - t0
    p.wait()
    if p.returncode != 0 or found is None:
        raise SystemExit(
            f"{' '.join(cmd)}: exit {p.returncode}, '{pattern}' seen: {found is not None}\n{''.join(tail)}"
        )
    return found


def startup(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    sets = {**run_sets(1, 1, work / "run", cache), "train.max_steps": 1, "dist.preflight": True}
    spec = spec_for(TINY, sets, 1)
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = env_for(1)
    ours_cmd = [sys.executable, str(TRAIN), str(TINY), *overrides(sets)]
    bare_cmd = [sys.executable, str(ROOT / "bench" / "bare_start.py"), "--spec", str(spec_file)]
    rows: dict[str, list[float]] = {"ours": [], "bare": [], "help": [], "plan": []}
    time_to_line(ours_cmd, r"step +1/1", env)  # warm: data cache, model-shape cache, JIT ops
    time_to_line(bare_cmd, r"first step done", env)
    for _ in range(a.rounds):
        shutil.rmtree(work / "run", ignore_errors=True)
        rows["ours"].append(time_to_line(ours_cmd, r"step +1/1", env))
        rows["bare"].append(time_to_line(bare_cmd, r"first step done", env))
        rows["help"].append(time_to_line([sys.executable, str(TRAIN), "--help"], r"usage:", env))
        rows["plan"].append(
            time_to_line(
                [sys.executable, str(TRAIN), str(TINY), "--plan", *overrides(sets)], r"^decision:", env
            )
        )
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"# startup on tiny, median of {a.rounds} (seconds from process start)")
    print("| what | median s | runs |")
    print("|---|---|---|")
    for k, label in (
        ("ours", "bin/train to its first completed step"),
        ("bare", "bare import + deepspeed.initialize + one step"),
        ("help", "bin/train --help"),
        ("plan", "bin/train --plan (model shape cached)"),
    ):
        print(f"| {label} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in rows[k])} |")
    print(f"\nratio first step ours/bare: {med['ours'] / med['bare']:.2f}")
    return {"startup": rows, "ratio": med["ours"] / med["bare"]}


# ----------------------------------------------------------------------------- threads, data wait


def threads(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    sets = run_sets(a.steps, 10, work / "run", cache)
    results: dict[str, list[float]] = {"auto": [], "torch default": []}
    for _ in range(a.rounds):
        for name in results:
            shutil.rmtree(work / "run", ignore_errors=True)
            env = env_for(2)
            env.pop("OMP_NUM_THREADS")
            if name == "torch default":  # what torch does on its own: every core, in every rank
                env["OMP_NUM_THREADS"] = str(cores())
            p = launch([str(TRAIN), str(TINY), *overrides(sets)], 2, env)
            lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
            results[name].append(median_after([m for m in lines if "loss" in m], 10, 10))
            threads_line = re.search(r"(\d+) CPU thread\(s\) per rank", p.stdout)
            print(
                f"  {name:13}: {threads_line.group(1) if threads_line else '?'} thread(s)/rank, "
                f"median step {results[name][-1] * 1000:.0f} ms",
                flush=True,
            )
    shutil.rmtree(work, ignore_errors=True)
    auto, default = (statistics.median(results[k]) for k in results)
    print(
        f"\n# threads: tiny on 2 ranks, {cores()} cores: auto {auto * 1000:.0f} ms/step, torch default "
        f"{default * 1000:.0f} ms/step: {default / auto:.2f}x faster with the automatic setting"
    )
    return {"threads": results}


def datawait(a: argparse.Namespace) -> dict[str, Any]:
    """tiny with each data.num_workers setting, interleaved per round, on --nproc ranks: the data-wait
    share of step time, the median step time, and whether PyTorch warned about too many workers."""
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    out: dict[str, dict[str, list[Any]]] = {w: {"wait": [], "step_ms": [], "warned": []} for w in a.settings}
    for _ in range(a.rounds):
        for w in a.settings:
            sets = {
                "run_dir": str(work / "run"),
                "data.cache_dir": str(cache),
                "data.num_workers": w,
                "train.max_steps": a.steps,
                "train.eval_every": 0,
                "train.log_every": 5,
                "checkpoint.save_final": False,
                "checkpoint.every_steps": 0,
            }
            shutil.rmtree(work / "run", ignore_errors=True)
            p = launch([str(TRAIN), str(TINY), *overrides(sets)], a.nproc, env_for(a.nproc))
            lines = [
                json.loads(x)
                for x in (work / "run" / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in x
            ]
            steady = [m for m in lines if m["step"] > 10]
            out[w]["wait"].append(statistics.mean(m["data_wait_share"] for m in steady))
            out[w]["step_ms"].append(1000 * statistics.median(m["step_time_s"] for m in steady))
            out[w]["warned"].append("worker processes in total" in p.stdout + p.stderr)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"# data wait on tiny, {a.nproc} rank(s), {a.steps} steps, {a.rounds} rounds interleaved (after step 10)"
    )
    print("| data.num_workers | data wait (mean share of step) | median step ms | DataLoader warning |")
    print("|---|---|---|---|")
    for w, r in out.items():
        print(f"| {w} | {statistics.mean(r['wait']):.2%} | {statistics.median(r['step_ms']):.1f} | "
              f"{'yes' if any(r['warned']) else 'no'} |")  # fmt: skip
    return {"datawait": out, "nproc": a.nproc}


# ----------------------------------------------------------------------------- checkpoint

# CPU: a GPT-2 shape of about 100M parameters (8 layers x 1024), one sequence per rank, so that a
# synchronous save at ZeRO-2 on 2 ranks writes about 1 GB on rank 0 (2-3 s here).
CKPT_SETS = {
    "model.config.n_layer": 8,
    "model.config.n_embd": 1024,
    "model.config.n_head": 16,
    "train.micro_batch_size": 1,
}


def checkpoint(a: argparse.Namespace) -> dict[str, Any]:
    """Synchronous against asynchronous saves (checkpoint.async), interleaved: training blocked per
    save, the background write time, and the step time while a write is in flight against the
    step time with none."""
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for r in range(a.rounds):
        for mode in ("sync", "async"):
            run_dir = work / f"{mode}-{r}"
            sets = {
                **run_sets(a.steps, 1, run_dir, cache),
                **CKPT_SETS,
                "strategy.zero_stage": a.stage,
                "checkpoint.every_steps": a.every,
                "checkpoint.keep_last": 2,
                "checkpoint.async": mode == "async",
            }
            launch([str(TRAIN), str(TINY), *overrides(sets)], a.nproc, env_for(a.nproc))
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            saves = [x for x in recs if "checkpoint" in x]
            steps = {x["step"]: x["step_time_s"] for x in recs if "step_time_s" in x}
            in_flight = {s for x in saves if x["async"] for s in range(x["saved_step"] + 1, x["step"] + 1)}
            steady = [s for s in steps if s > a.every]  # after the first save (warm-up, first copy)
            results[mode].append(
                {
                    "blocked_s": [x["blocked_s"] for x in saves],
                    "write_s": [x["write_s"] for x in saves],
                    "step_s_writing": [steps[s] for s in steady if s in in_flight],
                    "step_s_idle": [steps[s] for s in steady if s not in in_flight],
                }
            )
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"round {r + 1} {mode}: blocked per save {results[mode][-1]['blocked_s']}", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    def med(mode: str, key: str, skip_first: bool = False) -> float:
        vals = [v for run in results[mode] for v in (run[key][1:] if skip_first else run[key])]
        return statistics.median(vals) if vals else float("nan")

    sync_b, async_b = med("sync", "blocked_s"), med("async", "blocked_s", skip_first=True)
    print(
        f"\n# checkpoint: ZeRO-{a.stage}, {a.nproc} ranks, a save every {a.every} steps, {a.rounds} rounds:\n"
        f"  synchronous:  blocked {sync_b:.2f} s per save (median), steps {med('sync', 'step_s_idle') * 1000:.0f} ms\n"
        f"  asynchronous: blocked {async_b:.2f} s per save (median after the first, which allocates the "
        f"host copy: {med('async', 'blocked_s'):.2f} s over all), written in {med('async', 'write_s'):.1f} s; "
        f"steps {med('async', 'step_s_idle') * 1000:.0f} ms, {med('async', 'step_s_writing') * 1000:.0f} ms "
        f"while a write is in flight\n"
        f"  stall async/sync: {async_b / sync_b:.3f}"
    )
    return {"checkpoint": results, "stall_ratio": async_b / sync_b}


# ----------------------------------------------------------------------------- scaling


def scaling(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer.report import compare_main

    gpu = torch.cuda.is_available() and not a.cpu
    ranks = sorted(set(a.ranks or [1, torch.cuda.device_count() if gpu else 2]))
    experiment, base = job(a, gpu)
    cache = Path(a.cache_dir or ROOT / ".cache" / "bench-data")
    out = Path(a.out)
    widest = ranks[-1]
    # (ranks, grad_accum): the batch per rank kept at every size (weak), and the global batch of the
    # most ranks kept (strong) by accumulating widest/n micro batches on n ranks
    jobs = sorted({(n, 1) for n in ranks} | {(n, widest // n) for n in ranks if widest % n == 0})
    print(
        f"# scaling: {experiment.name} at {ranks} {'GPU' if gpu else 'CPU'} rank(s), stages {a.stages}; "
        f"{a.steps} steps each; runs in {out}",
        flush=True,
    )
    dirs = []
    for stage in a.stages:
        for n, accum in jobs:
            run = out / f"zero{stage}-{n}rank{'s' if n > 1 else ''}-accum{accum}"
            shutil.rmtree(run, ignore_errors=True)
            sets = {
                **base,
                **run_sets(a.steps, a.log_every, run, cache),
                "strategy.zero_stage": stage,
                "train.grad_accum": accum,
            }
            env = env_for(n, None if gpu else {"OMP_NUM_THREADS": "1"})  # CPU: one core per rank
            t0 = time.perf_counter()
            launch([str(TRAIN), str(experiment), *overrides(sets)], n, env)
            print(f"  {run.name}: {time.perf_counter() - t0:.0f} s wall", flush=True)
            dirs.append(run)
    print()
    code = compare_main(dirs, out / "scaling.png")
    return {"scaling": [str(d) for d in dirs], "report_exit": code}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compare", help="bin/train against a hand-written DeepSpeed loop")
    c.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--steps", type=int, default=40)
    c.add_argument("--warmup", type=int, default=10)
    c.add_argument("--log-every", type=int, default=5)
    c.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU, or 2 on CPU)")
    c.add_argument("--cpu", action="store_true", help="the CPU mode even where CUDA is present")
    c.add_argument("--experiment", default=None, help="default: gpt2-124m.yaml on GPU, tiny (micro 8) on CPU")
    c.add_argument(
        "--set", action="append", help="an override for both sides, e.g. train.micro_batch_size=32"
    )
    pe = sub.add_parser("peer", help="bin/train against the Hugging Face Trainer with DeepSpeed")
    pe.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    pe.add_argument("--shapes", nargs="+", default=None, help=f"CPU: some of {', '.join(PEER_SHAPES)}")
    pe.add_argument("--rounds", type=int, default=3)
    pe.add_argument("--steps", type=int, default=60)
    pe.add_argument("--warmup", type=int, default=20)
    pe.add_argument("--log-every", type=int, default=5)
    pe.add_argument("--nproc", type=int, default=None)
    pe.add_argument("--cpu", action="store_true")
    pe.add_argument("--experiment", default=None)
    pe.add_argument("--peer-config", choices=["minimal", "hf-docs"], default="minimal")
    pe.add_argument(
        "--hf-variants", nargs="+", default=None,
        help="the Trainer's own options, one run per variant and round: 'default' or KEY=VALUE[,KEY=VALUE] "
        "TrainingArguments (attn_implementation goes to the model's from_config), e.g. default "
        "torch_compile=true use_liger_kernel=true attn_implementation=eager",
    )  # fmt: skip
    pe.add_argument("--set", action="append")
    s = sub.add_parser("startup", help="bin/train to its first step, against a bare DeepSpeed script")
    s.add_argument("--rounds", type=int, default=3)
    t = sub.add_parser("threads", help="automatic CPU threads per rank against torch's default")
    t.add_argument("--rounds", type=int, default=2)
    t.add_argument("--steps", type=int, default=40)
    d = sub.add_parser("datawait", help="data-wait share on tiny per data.num_workers setting")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--nproc", type=int, default=1)
    d.add_argument("--settings", nargs="+", default=["1", "auto"], help="data.num_workers values")
    k = sub.add_parser("checkpoint", help="synchronous against asynchronous checkpoint saves")
    k.add_argument("--rounds", type=int, default=2)
    k.add_argument("--steps", type=int, default=21)
    k.add_argument("--every", type=int, default=4)
    k.add_argument("--stage", type=int, default=2)
    k.add_argument("--nproc", type=int, default=2)
    sc = sub.add_parser("scaling", help="runs at 1 and N ranks, then bin/report's scaling efficiency")
    sc.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    sc.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="world sizes (default: 1 and every GPU, or 1 2)"
    )
    sc.add_argument("--steps", type=int, default=60)
    sc.add_argument("--log-every", type=int, default=5)
    sc.add_argument("--cpu", action="store_true")
    sc.add_argument("--experiment", default=None)
    sc.add_argument("--set", action="append")
    sc.add_argument("--out", default=str(ROOT / "runs" / "scaling"), help="where the runs are kept")
    for q in (c, pe, s, t, d, k, sc):
        q.add_argument("--cache-dir", default=None, help="tokenized-data cache (default .cache/bench-data)")
        q.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    if getattr(a, "cpu", False):  # both sides on CPU on a GPU machine too (torch, DeepSpeed, bin/train)
        from trainer.dist import ENV_CPU, hide_gpus_if_asked

        os.environ[ENV_CPU] = "1"  # for the ranks too, whose CUDA_VISIBLE_DEVICES the launcher resets
        hide_gpus_if_asked()
    res = {
        "compare": compare,
        "peer": peer,
        "startup": startup,
        "threads": threads,
        "datawait": datawait,
        "checkpoint": checkpoint,
        "scaling": scaling,
    }[a.what](a)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
