"""Run bin/train as a user does: in one process, or on 2 ranks through the real launchers.

`train()` returns the exit code, the output, the parsed metrics.jsonl and each rank's debug
report (parameter digest, consumed samples), and on failure raises with every rank's output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# Rendezvous ports outside the ephemeral range, from this pytest-xdist worker's share (conftest).
from trainer.cluster.dist import free_port  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "bin" / "train"
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
BIN = Path(sys.executable).parent  # the venv's bin: deepspeed, torchrun

# A small, fast version of tiny for multi-rank tests: per-step losses, no eval in between.
FAST = {
    "train.max_steps": 16,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.eval_batches": 2,
    "train.micro_batch_size": 4,
    "model.config.n_layer": 2,
    "data.num_workers": 0,
    "checkpoint.every_steps": 0,
    "checkpoint.save_final": False,
    # tiny trains without dropout; these runs keep GPT-2's, so that restoring each rank's RNG on resume
    # matters (NODROP below turns it off where a test needs that)
    "model.config.resid_pdrop": 0.1,
    "model.config.embd_pdrop": 0.1,
    "model.config.attn_pdrop": 0.1,
}

# The ZeRO cases of the stage and resume tests, name -> (stage, grad_accum, offload): accumulation
# is covered at stages 0 and 3. (Not at stage 1: with accumulation DeepSpeed's stage 1 keeps its
# accumulated gradients partitioned, as stage 2 does, so the plan's whole gradients, from
# DeepSpeed's own estimator, are then an upper bound.)
CASES = {
    "zero0": (0, 2, "none"),
    "zero1": (1, 1, "none"),
    "zero2": (2, 1, "none"),
    "zero3": (3, 2, "none"),
    "zero2+cpu": (2, 1, "cpu"),
    "zero3+cpu": (3, 1, "cpu"),
    "zero3+cpu-opt": (3, 1, "cpu"),
}
# ZeRO-3 with offload: "zero3+cpu" offloads the parameters too; "zero3+cpu-opt" leaves the choice to the plan,
# which offloads the optimizer alone where that fits (issue 61's rung). Every other stage 3 + offload run of the
# tests pins the parameters' offload (resume_sets), as before the plan could choose.
CASE_SETS = {"zero3+cpu-opt": {"strategy.offload_params": "auto"}}

# Settings per precision of the runs A (conftest.runs). bf16 runs train without dropout: one run per
# stage is then both the reference of the exact resume and the source of every resharding
# transition, whose first step after the resume must see the same batch on the same weights (a
# resume on another world size draws dropout from a fresh stream). Restoring the RNG, which only
# dropout reads, is the same in every precision and is proven in fp32 (test_stages.py).
NODROP = {"model.config.resid_pdrop": 0, "model.config.embd_pdrop": 0, "model.config.attn_pdrop": 0}
PRECISIONS = {"fp32": {}, "bf16": {"train.precision": "bf16", **NODROP}}

# The resume tests: 2K steps with a checkpoint every K, on data small enough (conftest.small_data)
# that an epoch ends after the checkpoint.
K = 6


def resume_sets(data, stage, accum=1, **kw):
    if stage == 3 and kw.get("strategy.offload", "none") != "none":
        kw.setdefault("strategy.offload_params", True)
    return {
        **FAST,
        "data.train.files": str(data),
        "data.eval_fraction": 0,
        "strategy.zero_stage": stage,
        "train.grad_accum": accum,
        "train.max_steps": 2 * K,
        "checkpoint.every_steps": K,
        "checkpoint.save_final": True,
        "checkpoint.keep_last": 0,
        **kw,
    }


def steps_after(res, k):
    return {s: v for s, v in res.losses.items() if s > k}


def check_run(r: Result, name: str) -> None:
    """Run A of a ZeRO case trained as it should on 2 ranks: the stage it asked for, every step
    logged, the loss falling, identical parameters on every rank (digests gathered across ranks),
    micro x accum samples per rank per step and, within every epoch, disjoint samples per rank."""
    stage, accum, offload = CASES[name]
    assert f"ZeRO stage {stage}, offload {offload}" in r.output
    losses = r.losses
    assert sorted(losses) == list(range(1, 2 * K + 1))
    first, last = falling(losses)
    assert last < first * 0.85, f"loss did not fall: {first:.3f} -> {last:.3f}"

    reports = r.rank_reports()
    assert [rep["rank"] for rep in reports] == [0, 1]
    digests = reports[0]["all_param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks hold different parameters"
    assert reports[1]["param_digest"] == reports[0]["param_digest"]

    micro = 4
    per_epoch = int(re.search(r"(\d+) micro steps per epoch", r.output).group(1)) * micro
    seen = [rep["samples"] for rep in reports]
    assert len(seen[0]) == len(seen[1]) == 2 * K * accum * micro
    assert len(seen[0]) > per_epoch, "the run should cross an epoch boundary"
    for e in range(0, len(seen[0]), per_epoch):
        a, b = set(seen[0][e : e + per_epoch]), set(seen[1][e : e + per_epoch])
        assert len(a) == len(seen[0][e : e + per_epoch]) and not a & b, (
            f"epoch {e // per_epoch}: {len(a & b)} shared"
        )


def check_memory(r: Result, name: str) -> None:
    """Bytes each rank holds in parameters, gradients and optimizer states (counted from the engine's
    tensors after the first optimizer step) are within 10% of the planner's model-state figures. At
    stage 3 the planner's parameters include one gathered layer, which exists only inside
    forward/backward: the resident parameters are compared. At stages 1-2 DeepSpeed's gradient
    partition buffer holds whole gradients of the parameters that straddle a partition boundary, one
    parameter more than P/N (14% on this tiny model, negligible on a real one), so each category
    gets 15%. (The fp32 gradient partitions of bf16 runs exist only during the step, after this
    census: the planner counts them as the step's, `strategy.step_bytes`, and tests/dist/
    test_step_memory.py measures them.)"""
    for rep in r.rank_reports():
        measured, planned = rep["memory"], dict(rep["plan"]["estimate_bytes"])
        planned["params"] -= planned["gathered_layer"]
        rows = [(k, measured[k], planned[k]) for k in ("params", "grads", "optimizer")]
        total_m, total_p = sum(x[1] for x in rows), sum(x[2] for x in rows)
        print(
            f"{name} rank {rep['rank']}: "
            + ", ".join(f"{k} {m:,} vs plan {p:,}" for k, m, p in rows)
            + f"; total {total_m:,} vs {total_p:,} ({total_m / total_p - 1:+.1%})"
        )
        assert abs(total_m / total_p - 1) <= 0.10
        for key, m, p in rows:
            assert abs(m / p - 1) <= 0.15, f"{key}: measured {m:,}, planned {p:,}"


def saves(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint records of a run's metrics.jsonl: tag -> record ("step": when it was committed,
    "saved_step", "async", "blocked_s", "write_s")."""
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["checkpoint"]: r for r in recs if "checkpoint" in r}


def assert_written_in_background(run_dir: Path, step: int = K) -> None:
    """The checkpoint at `step` was written by the background writer while training went on (it was
    committed at a later step)."""
    rec = saves(run_dir)[f"step_{step:08d}"]
    assert rec["async"] and rec["step"] > step, rec


def assert_same_continuation(a: Result, b: Result, k: int = K) -> None:
    """Run b, resumed at step k, logged the same losses as run a after k, bit for bit, and ended
    with the same weights."""
    assert sorted(steps_after(b, k)) == list(range(k + 1, 2 * K + 1)), b.losses
    assert steps_after(b, k) == steps_after(a, k)  # bit for bit
    assert b.rank_reports()[0]["param_digest"] == a.rank_reports()[0]["param_digest"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    debug_dir: Path | None = None
    cmd: list[str] = field(default_factory=list)
    # (seconds from the job's start, line) for each output line, where the caller read them as they came
    lines: list[tuple[float, str]] = field(default_factory=list)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics if "loss" in m}

    @property
    def eval_losses(self) -> dict[int, float]:
        return {m["step"]: m["eval_loss"] for m in self.metrics if "eval_loss" in m}

    def rank_reports(self) -> list[dict[str, Any]]:
        assert self.debug_dir is not None
        return [json.loads(p.read_text()) for p in sorted(self.debug_dir.glob("rank*.json"))]


def env_for(nproc: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # Threads per rank: the cores shared by this job's ranks and, under pytest-xdist, by the jobs of
    # the other workers (oversubscribed OpenMP threads spin and crawl).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // (nproc * workers))))
    env.setdefault("TRAINER_TEST_DATA_CACHE", "")
    env.update(extra or {})
    return env


def command(launcher: str, nproc: int, args: list[str], port: int | None = None) -> list[str]:
    if launcher == "none":
        return [sys.executable, str(TRAIN), *args]
    port = port or free_port()
    if launcher == "deepspeed":
        return [
            str(BIN / "deepspeed"),
            "--num_gpus",
            str(nproc),
            "--master_port",
            str(port),
            str(TRAIN),
            *args,
        ]
    if launcher == "torchrun":
        return [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(port),
            str(TRAIN),
            *args,
        ]
    raise ValueError(launcher)


def train(
    tmp: Path,
    sets: dict[str, Any] | None = None,
    *,
    launcher: str = "none",
    nproc: int = 2,
    experiment: Path | str = TINY,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    debug: bool = True,
    check: bool = True,
    timeout: float = 900,
    cache: Path | None = None,
) -> Result:
    """Run bin/train; `sets` become --set KEY=VALUE (run_dir and the data cache default into tmp).
    `timeout` detects a hang, it is no budget: 900 s is 5.8x the slowest run measured with
    `make test-avx2` (154 s, 3 workers on 2 cores; tests/conftest.py reports the closest)."""
    tmp.mkdir(parents=True, exist_ok=True)
    sets = dict(sets or {})
    sets.setdefault("run_dir", str(tmp / "run"))
    sets.setdefault("data.cache_dir", str(cache or data_cache()))
    args = [str(experiment)]
    for k, v in sets.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    args += extra_args or []
    debug_dir = tmp / "debug" if debug else None
    extra = dict(env or {})
    if debug_dir:
        shutil.rmtree(debug_dir, ignore_errors=True)
        extra["TRAINER_DEBUG_DIR"] = str(debug_dir)
    n = 1 if launcher == "none" else nproc
    cmd = command(launcher, n, args)
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(n, extra), capture_output=True, text=True, timeout=timeout)
    res = Result(p.returncode, p.stdout, p.stderr, Path(sets["run_dir"]), debug_dir, cmd)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexit {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-6000:]}"
        )
    return res


def bin_train(
    *args: Any, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`bin/train ARGS` in one process, as a user runs it (a supervisor of 2 ranks with
    --nproc-per-node 2)."""
    return subprocess.run(
        [sys.executable, str(TRAIN), *map(str, args)],
        cwd=ROOT,
        env=env_for(2 if "--nproc-per-node" in map(str, args) else 1, env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(
    sets: dict[str, Any], *extra: Any, env: dict[str, str] | None = None, timeout: float = 300
) -> tuple[int, str]:
    """bin/train on TINY with `--set KEY=VALUE` for `sets` (the data cache defaults to the session's),
    then `extra` arguments. Returns the exit code and the output."""
    args: list[Any] = [TINY]
    for k, v in {"data.cache_dir": data_cache(), **sets}.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    p = bin_train(*args, *extra, env=env, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def refused_by_print_config(
    exp: Any, sets: list[str], needles: list[str], tmp_path: Path, capsys: Any
) -> None:
    """`bin/train EXP --print-config --set ...` (in process) exits 2 without a traceback, naming the experiment's
    file and each of `needles`."""
    from trainer.run.cli import main

    args = [str(exp), "--print-config", "--set", f"run_dir={tmp_path / 'run'}"]
    for s in sets:
        args += ["--set", s]
    capsys.readouterr()
    code = main(args)
    out = "".join(capsys.readouterr())
    assert code == 2 and "Traceback" not in out and Path(exp).name in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


def yaml_value(v: Any) -> str:
    """A value as --set KEY=VALUE writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list | dict):
        return json.dumps(v)
    return str(v)


def data_cache() -> Path:
    """One tokenized-data cache for the whole test session (tokenizing tiny once)."""
    path = os.environ.get("TRAINER_TEST_DATA_CACHE") or str(ROOT / ".cache" / "test-data")
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def falling(losses: dict[int, float], k: int = 3) -> tuple[float, float]:
    steps = sorted(losses)
    first = sum(losses[s] for s in steps[:k]) / k
    last = sum(losses[s] for s in steps[-k:]) / k
    return first, last


def wandb_offline_run(path: Path) -> dict[str, Any]:
    """What an offline wandb run recorded (run id, config, history), read from its `run-<id>.wandb`
    file: wandb's LevelDB-style log (a 7-byte header, 32 KiB blocks of records split into
    FULL/FIRST/MIDDLE/LAST chunks) of protobuf Records. wandb 0.31 ships no reader for it."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb run file"
    raw, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            raw.append(pending)
    out: dict[str, Any] = {"id": None, "config": {}, "history": []}
    for r in raw:
        rec = pb.Record()
        rec.ParseFromString(r)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"] = rec.run.run_id
            out["config"] = {_key(i): json.loads(i.value_json) for i in rec.run.config.update}
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    return out


def _key(item: Any) -> str:
    """A history/config item's key: plain, or split into parts ("train/loss" -> ["train", "loss"])."""
    return item.key or "/".join(item.nested_key)


def sigterm_rank_1(
    tmp: Path, sets: dict[str, Any], fault: str, after_lines: int
) -> tuple[int, str, float, int]:
    """A deepspeed-launcher job on 2 ranks with TRAINER_FAULT `fault`; once metrics.jsonl has
    `after_lines` lines, a real SIGTERM from outside to rank 1. Returns (exit code, output, seconds
    from the signal to the job's end, the step of `latest`)."""
    import os
    import signal
    import time

    import psutil

    args = [str(TINY)]
    for k, v in {**sets, "run_dir": str(tmp / "run"), "data.cache_dir": str(data_cache())}.items():
        args += ["--set", f"{k}={v}"]
    env = env_for(2, {"TRAINER_DEBUG_DIR": str(tmp / "debug"), "TRAINER_FAULT": fault})
    proc = subprocess.Popen(
        command("deepspeed", 2, args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= after_lines
    ):
        time.sleep(0.1)
    rank1 = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "--local_rank=1" in " ".join(p.cmdline())
    ]
    assert rank1, "rank 1 not found"
    t0 = time.time()
    os.kill(rank1[0].pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    took = time.time() - t0
    latest = tmp / "run" / "checkpoints" / "latest"
    step = int(latest.read_text().strip().split("_")[1]) if latest.exists() else -1
    return proc.returncode, out, took, step


def export_differences(pairs: list[tuple[Result, Result]], step: int, tmp: Path) -> list[float]:
    """Each pair of runs' checkpoints at `step` through bin/export's main (in one process: its start-up once), and
    for each pair the largest weight difference of the two exports, over the weight's largest value."""
    from safetensors.torch import load_file

    args = [str(x) for i, r in enumerate(r for p in pairs for r in p)
            for x in (r.run_dir / "checkpoints" / f"step_{step:08d}", tmp / f"export-{i}")]  # fmt: skip
    script = (
        "import sys\nfrom trainer.checkpoint.export import main\nfor a, b in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    assert main([a, b]) == 0, a\n"
    )  # fmt: skip
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env_for(1), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    worst = []
    for i in range(len(pairs)):
        a, b = (load_file(tmp / f"export-{2 * i + j}" / "model.safetensors") for j in (0, 1))
        assert a.keys() == b.keys()
        worst.append(max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a))
        print(f"largest weight difference {worst[-1]:.1e} of the weight's largest value")
    return worst


def chat_data(path: Path, rows: int = 400) -> Path:
    """A chat JSONL made here (no download): additions asked two ways, with and without a system
    prompt, so that answers (the targets) have very different lengths."""
    import random

    r = random.Random(0)
    out = []
    for i in range(rows):
        a, b = r.randint(0, 50), r.randint(0, 50)
        if i % 2:
            msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": f"{a}+{b}?"},
                    {"role": "assistant", "content": str(a + b)}]  # fmt: skip
        else:
            msgs = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}, as {b} plus {a} is."}]  # fmt: skip
        out.append(json.dumps({"messages": msgs}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    return path


# ----------------------------------------------------------------------------- real chat templates

TOKENIZERS = ROOT / ".cache" / "tokenizers"  # scripts/fetch_tokenizers.py (make tokenizers)
# The published tokenizers and templates of four families, and a tiny model of each, of the same vocabulary.
FAMILIES = {
    "llama3_2": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3", "head_dim": 8},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 8, "sliding_window": 64},
    "mistral_nemo": {"model_type": "mistral", "head_dim": 8},
}


def tokenizer_dir(name: str) -> Path:
    import pytest

    path = TOKENIZERS / name
    if not (path / "tokenizer.json").is_file():
        why = f"{path} is missing: run `make tokenizers` (scripts/fetch_tokenizers.py) first"
        if os.environ.get("TRAINER_REQUIRE_TOKENIZERS"):  # make test fetches them: missing is a failure there
            pytest.fail(why)
        pytest.skip(why)
    return path


def family_sets(name: str, data: Path, **kw: Any) -> dict[str, Any]:
    """bin/train overrides for a tiny model of the family on chat data, with the family's tokenizer."""
    model = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
             **FAMILIES[name]}  # fmt: skip
    return {
        "model.config": model,
        "data.tokenizer": str(tokenizer_dir(name)),
        "data.train.files": str(data),
        "data.train.kind": "chat",
        "data.seq_len": 192,
        "data.eval_fraction": 0,
        "data.num_workers": 0,
        "data.chat_template_kwargs": {
            "date_string": "26 Jul 2024"
        },  # Llama 3's template dates its system prompt
        "train.micro_batch_size": 2,
        "train.precision": "fp32",
        "train.log_every": 5,
        "train.eval_every": 0,
        "train.eval_prompts": [],
        "optim.lr": 1e-2,
        "optim.warmup_steps": 0,
        "checkpoint.save_final": False,
        **kw,
    }


# (the answer's rendering before its content, end-of-turn token, the strategy auto must choose)
EXPECTED = {
    "llama3_2": ("", "<|eot_id|>", "all"),
    "qwen3": ("<think>\n\n</think>\n\n", "<|im_end|>", "each"),
    "gemma3": ("", "<end_of_turn>", "all"),
    # Mistral's template puts the system prompt in the last user turn only: conversations with one are
    # rendered turn by turn, each prompt as inference sees it (test_real_templates.py)
    "mistral_nemo": ("", "</s>", "all"),
}


def data_for(name: str, tmp_path: Path, rows: int = 30) -> Path:
    return real_chat_data(tmp_path / f"{name}.jsonl", rows=rows, system=True, tools=name == "qwen3")


def sets_for(name: str, path: Path, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    seq = {"data.seq_len": 384} if name == "qwen3" else {}  # the tool schemas take 200 tokens
    return family_sets(name, path, **{"data.cache_dir": str(tmp_path / "cache"), **seq, **kw})


def real_chat_data(path: Path, rows: int = 60, system: bool = True, tools: bool = False, seed: int = 0,
                   random_users: bool = False) -> Path:  # fmt: skip
    """Chat JSONL (scripts/make_chat_samples.py): 1-3 exchanges with fixed answers, a system prompt in
    every other conversation, every third a tool call where `tools`; user turns of random letters
    answered "Noted." where `random_users`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_chat_samples import conversations, write

    return write(path, conversations(rows, system, tools, seed, random_users))


def private_services(
    script: str, name: str, binaries: tuple[str, ...], commands: tuple[str, ...], packages: str
):
    """`bash scripts/SCRIPT up DIR` (private daemons: the loopback sshds, the one-machine Slurm
    cluster), yield DIR, then `down DIR`, which stops them by their pids. Skipped, naming what is
    missing, where the packages or root are not there (.ci/run installs them)."""
    missing = [b for b in binaries if not Path(b).exists()] + [c for c in commands if not shutil.which(c)]
    if missing or os.geteuid() != 0:
        pytest.skip(
            f"needs {packages} and root (missing: {', '.join(missing) or 'root'}; .ci/run installs them)"
        )
    path = ROOT / "scripts" / script
    d = Path(f"/tmp/trainer-{name}-{os.getpid()}")
    p = subprocess.run(["bash", str(path), "up", str(d)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    yield d
    subprocess.run(["bash", str(path), "down", str(d)], timeout=60)
    assert not d.exists()


def loopback_nodes(name: str):
    """A private sshd on 127.0.0.1 and one on 127.0.0.2 (scripts/loopback_sshd.sh)."""
    yield from private_services(
        "loopback_sshd.sh", name, ("/usr/sbin/sshd",), ("pdsh",), "openssh-server, pdsh"
    )


# One global batch of 4 rows split three ways: name -> (sets, launcher, ranks).
SPLITS = {
    "micro4": ({"train.micro_batch_size": 4, "train.grad_accum": 1}, "none", 1),
    "accum4": ({"train.micro_batch_size": 1, "train.grad_accum": 4}, "none", 1),
    "2ranks": ({"train.micro_batch_size": 2, "train.grad_accum": 1}, "torchrun", 2),
}


def split_losses(
    tmp: Path, sets_for, names=tuple(SPLITS), check=None, rel: float = 1e-6
) -> dict[str, dict[int, float]]:
    """Per-step losses of each split in `names` (sets_for(split) gives the run's sets; `check(result)`,
    if given, is asserted on each run), and the assertion that every split logs micro4's losses at
    every step within `rel` (1e-6 relative)."""
    losses = {}
    for name in names:
        split, launcher, n = SPLITS[name]
        r = train(tmp / name, sets_for(split), launcher=launcher, nproc=n, debug=False)
        if check:
            check(r)
        losses[name] = r.losses
    ref = losses[names[0]]
    for name in names[1:]:
        for step, value in ref.items():
            assert losses[name][step] == pytest.approx(value, rel=rel), (name, step, losses[name], ref)
    return losses


# ----------------------------------------------------------------------------- the family matrix
# A tiny model of each family users bring, with its special features on and windows (16) shorter than the
# matrix's rows (32): tests/unit/test_family_matrix.py (packed = one by one, chunked loss = plain loss) and
# tests/dist/test_family_matrix.py (sequence parallel 2 = 1, 2-rank ZeRO-3 = 1 rank).
MATRIX_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 128, "bos_token_id": 1,
               "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
MATRIX = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"sliding_window": 16},
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0, "num_key_value_heads": None},  # GPT-2 has as many as heads
    "olmo2": {},
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
                    "topk_group": 1},
}  # fmt: skip


def matrix_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**MATRIX_BASE, **MATRIX[model_type]})


def matrix_rows(seq: int = 32) -> Any:
    """Two fine-tuning rows of [input_ids, labels, position_ids]: one example, and two packed (20 and
    12 tokens), their first 3 tokens prompt (no target)."""
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 97, (2, seq), generator=g)
    pos = torch.stack([torch.arange(seq), torch.cat([torch.arange(20), torch.arange(seq - 20)])])
    labels = ids.clone()
    labels[pos < 3] = -100
    return torch.stack([ids, labels, pos], dim=1)


# ----------------------------------------------------------------------------- QLoRA
# tests/dist/test_qlora.py (the stages, export) and tests/dist/test_qlora_training.py (the curves, splits, DPO)
QLORA = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0, "quantization": "4bit"}, "optim.lr": 1e-2,
         "optim.warmup_steps": 0, "train.precision": "bf16", "strategy.justification": "test"}  # fmt: skip


def qlora_base(shared_dir: Path, small: bool = False) -> Path:
    """A Llama of the byte tokenizer's vocabulary, saved as a from_pretrained directory once a session:
    12.6M parameters in its linear layers (25 MB in bf16, 6.3 MB packed in 4 bits), enough for the
    planner's packed bytes and quantization state to be told apart from the rest; `small`: hidden 256,
    2 layers (1.6M), for the 100-step curves (bf16 products crawl on AVX2-only hosts)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.common.files import file_lock

    out = shared_dir / ("qlora-base-256" if small else "qlora-base-512")
    shape = (256, 768, 2, 4, 2) if small else (512, 1536, 4, 8, 4)
    with file_lock(shared_dir / f"{out.name}.lock"):
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            cfg = AutoConfig.for_model("llama", **dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads"), shape, strict=True)), max_position_embeddings=256,
                                       vocab_size=257, bos_token_id=256, eos_token_id=256)  # fmt: skip
            AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out
