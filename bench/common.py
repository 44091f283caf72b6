"""What the benchmarks share: the paths, the overrides and environment both sides of a comparison get,
the deepspeed launcher, the raw loop's spec of a bin/train job, a bin/train run's step times, and
the one way sides are interleaved over rounds and their step times turned into a ratio."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.cluster.dist import free_port  # a rendezvous port outside the ephemeral range

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bin" / "train"
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
GPT2 = ROOT / "configs" / "experiments" / "gpt2-124m.yaml"
BIN = Path(sys.executable).parent

# CPU: tiny with 8 sequences per rank, so that a step on 2 gloo ranks (one thread each) takes well
# over 100 ms (about 350 ms on a 2-core machine).
CPU_SETS = {"train.micro_batch_size": 8}


def cores() -> int:
    return len(os.sched_getaffinity(0))


def cache_dir(a: argparse.Namespace) -> Path:
    """The tokenized-data cache: --cache-dir, or .cache/bench-data."""
    return Path(a.cache_dir or ROOT / ".cache" / "bench-data")


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


# ----------------------------------------------------------------------------- rounds and ratios


def median_after(intervals: list[dict[str, Any]], warmup: int, log_every: int) -> float:
    """Median of the per-interval mean step times, over the intervals that start after `warmup`."""
    return statistics.median(r["step_time_s"] for r in intervals if r["step"] - log_every >= warmup)


def interleave(
    sides: Sequence[str], rounds: int, run: Callable[[str, int], Any], alternate: bool = False
) -> dict[str, list[Any]]:
    """Each side run once a round, side by side: `run(side, round)` -> that run's result. In the
    order given every round (A B, A B, ...), or with `alternate` reversed on odd rounds (A B, B A,
    A B, ...: neither side always runs right after the other). A run that returns None failed: its
    side runs no more. Returns each side's results in round order."""
    out: dict[str, list[Any]] = {s: [] for s in sides}
    failed: set[str] = set()
    for r in range(rounds):
        for side in sides if r % 2 == 0 or not alternate else sides[::-1]:
            if side in failed:
                continue
            res = run(side, r)
            if res is None:
                failed.add(side)
            else:
                out[side].append(res)
    return out


def ratio(num: list[float], den: list[float]) -> dict[str, Any]:
    """Two sides' per-round values (median step times, paired by round): their medians, the ratio of
    the medians num/den, the range of the rounds' own ratios, their geometric mean (each round's two
    runs are neighbours in time) and in how many rounds the ratio was at least 1."""
    per_round = [x / y for x, y in zip(num, den, strict=True)]
    n, d = statistics.median(num), statistics.median(den)
    return {
        "num": n,
        "den": d,
        "ratio": n / d,
        "ratio_min": min(per_round),
        "ratio_max": max(per_round),
        "paired": statistics.geometric_mean(per_round),
        "at_least_1": sum(x >= 1 for x in per_round),
    }


# ----------------------------------------------------------------------------- bin/train's side


def spec_for(experiment: Path, sets: dict[str, Any], nproc: int) -> dict[str, Any]:
    """What the raw loop needs to run exactly what bin/train runs: the DeepSpeed JSON bin/train
    prints for this world size, the model config with the tokenizer's vocabulary, the packed data."""

    from trainer import config, data, model
    from trainer.cluster.devices import gpu_present
    from trainer.config import thaw
    from trainer.data.stream import resolve_workers
    from trainer.strategy import flops_per_token

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
    # the levers as bin/train resolves them (auto decided by its plan)
    resolved = yaml.safe_load(
        p.stdout[p.stdout.index("# experiment (resolved)") : p.stdout.index("# DeepSpeed config")]
    )
    ds_config = json.loads(ds_text[ds_text.index("{") :])
    exp = config.load(str(experiment), [f"{k}={v}" for k, v in sets.items()])
    built = data.build(exp.data, exp.seed, is_main=True)
    fields = thaw(exp.model.config)
    fields.setdefault("vocab_size", built.vocab_size)
    for key in ("bos_token_id", "eos_token_id"):
        fields.setdefault(key, built.eos_id)
    gpu = gpu_present()  # what bin/train plans with (trainer/run/cli.py), CUDA_VISIBLE_DEVICES included
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
        "chunked_loss": resolved["model"]["chunked_loss"],
        "log_every": exp.train.log_every,
        "weight_decay": exp.optim.weight_decay,
        "warmup_steps": exp.optim.warmup_steps,  # the JSON's warmup_num_steps is DeepSpeed's (at least 2)
        "num_workers": resolve_workers(exp.data.num_workers, "cuda" if gpu else "cpu"),
        "pin_memory": exp.data.pin_memory,
        "persistent_workers": exp.data.persistent_workers,
        "seq_len": exp.data.seq_len,
        "params": info.params,
        "flops_per_token": flops_per_token(info, exp.data.seq_len),
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
