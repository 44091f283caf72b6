"""Failures end the whole job quickly and loudly, under both launchers, and leave nothing behind.

Each run injects a fault (TRAINER_FAULT) and measures how long the job takes to exit; afterwards no
process of the run is alive and no DeepSpeed shared-memory buffer of its port is left in /dev/shm."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
from helpers import BIN, FAST, ROOT, TINY, TRAIN, Result, cli, data_cache, env_for, free_port

pytestmark = pytest.mark.dist


def launch(tmp_path, launcher, fault, sets=None, extra=None, timeout=300):
    port = free_port()
    run_dir = tmp_path / "run"
    args = [str(TRAIN), str(TINY)]
    for k, v in {**FAST, "train.max_steps": 40, "run_dir": run_dir, "data.cache_dir": data_cache(), **(sets or {})}.items():
        args += ["--set", f"{k}={v}"]
    args += extra or []
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), *args]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), *args]
    env = env_for(2, {"TRAINER_FAULT": fault, "TRAINER_DEBUG_DIR": str(tmp_path / "debug")} if fault else
                  {"TRAINER_DEBUG_DIR": str(tmp_path / "debug")})
    t0 = time.time()
    # Output read line by line with the time each line arrived (stderr merged into stdout), so that a
    # test can time the job's reaction from the moment of the fault rather than from process start.
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    deadline = threading.Timer(timeout, p.kill)
    deadline.start()
    try:
        for line in p.stdout:
            lines.append((time.time() - t0, line))
        p.wait()
    finally:
        deadline.cancel()
    took = time.time() - t0
    assert took < timeout, f"the job did not end within {timeout} s"
    leftovers = [q.pid for q in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(q.info["cmdline"] or [])]
    shm = [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in f]
    assert not leftovers, f"processes of the run still alive: {leftovers}"
    assert not shm, f"shared-memory buffers left behind: {shm}"
    output = "".join(line for _, line in lines)
    return Result(p.returncode, output, "", run_dir, tmp_path / "debug", cmd, lines), took


def seconds_after(r, took: float, marker: str) -> float:
    """How long the job ran on after the first output line containing `marker` (`took`: its duration)."""
    at = next((t for t, line in r.lines if marker in line), None)
    assert at is not None, f"no output line contains {marker!r} (exit {r.returncode}):\n{r.output[-4000:]}"
    return took - at


STEP_4 = "step      4/40"  # rank 0's log line of step 4, just before the faults at step 5


def first_step_logged(r):
    return max(r.losses) if r.losses else 0


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_sigkill_of_rank_1_ends_the_job(tmp_path, launcher):
    r, took = launch(tmp_path, launcher, "kill@5:rank=1")
    after = seconds_after(r, took, STEP_4)
    print(f"{launcher}: SIGKILL of rank 1 at step 5 -> exit {r.returncode} {after:.1f} s after step 4 ({took:.1f} s in all)")
    assert r.returncode != 0 and after < 30
    if launcher == "deepspeed":
        # The launcher polls its ranks once a second and reports the return code of the first failed
        # one it finds (always under the last rank's command line): rank 1's -9, or rank 0's 1 when
        # its collective with the dead rank failed within that second.
        killed = re.search(r"--local_rank=1.*exits with return code = -9", r.output)
        peer_lost = re.search(r"exits with return code = 1", r.output) and re.search(
            r"\[rank0\].*(Connection closed by peer|Connection reset by peer)", r.output
        )
        assert killed or peer_lost, r.output[-3000:]
    else:
        assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", r.output) and "SIGKILL" in r.output, r.output[-3000:]
    assert first_step_logged(r) < 6


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_an_exception_on_rank_0_only_ends_the_job_and_is_shown(tmp_path, launcher):
    r, took = launch(tmp_path, launcher, "raise@5:rank=0")
    after = seconds_after(r, took, STEP_4)
    print(f"{launcher}: exception on rank 0 at step 5 -> exit {r.returncode} {after:.1f} s after step 4 ({took:.1f} s in all)")
    assert r.returncode != 0 and after < 30
    assert "RuntimeError: injected failure at rank 0 step 5 (TRAINER_FAULT)" in r.output


def test_a_hung_rank_ends_the_job_within_the_watchdog_timeout(tmp_path):
    r, took = launch(tmp_path, "deepspeed", "sleep@5:rank=1", sets={"dist.watchdog_s": 30})
    assert r.returncode != 0 and "[rank 1] WARNING injected hang" in r.output, r.output[-3000:]
    assert "watchdog: rank 1 made no progress" in r.output and "Stacks of every thread" in r.output
    dump = r.output[r.output.find("watchdog: rank 1") :][:4000]
    # Where rank 1 is stuck. (Rank 0, blocked in the all-reduce, dumps its stacks at the same moment
    # and the launcher interleaves the two streams character by character: look for the names alone.)
    assert "faults.py" in r.output and "before_step" in r.output, dump
    # Timed from the hang, not from process start (start-up takes 10-40 s on a loaded 2-core machine):
    # 30 s of watchdog, then the dump of stacks, the abort and the launcher's reaction.
    after = seconds_after(r, took, "injected hang")
    print(f"rank 1 hung at step 5; the job exited {r.returncode} {after:.1f} s later ({took:.1f} s in all; watchdog 30 s)")
    # (The watchdog counts from the last progress, a moment before the hang is logged: 2 s of slack.)
    assert 30 - 2 <= after < 30 + 25, f"the job ended {after:.1f} s after the hang"


@pytest.fixture(scope="session")
def slow_then_nan(tmp_path_factory):
    """One run for two tests: rank 1 is 600 ms slower a step from step 2 (a straggler), then its loss
    is NaN at step 5. (A straggler stands out when it spends more than 1.2x the median; with two ranks
    and 600 ms added that holds while a step's own compute is under 1.2 s, which a loaded CI machine
    keeps to; 100 ms was not enough when the tiny model's step took 200 ms.)"""
    return launch(tmp_path_factory.mktemp("nan"), "deepspeed", "slow@2:rank=1:ms=600,nan@5:rank=1")[0]


def test_a_nan_loss_on_rank_1_stops_every_rank_at_that_step(slow_then_nan):
    r = slow_then_nan
    assert r.returncode == 4, r.output[-3000:]
    assert "non-finite loss at step 5 on rank(s) 1: every rank stops before the optimizer update" in r.output
    assert max(r.losses) == 4
    reports = r.rank_reports()
    assert [rep["step"] for rep in reports] == [4, 4]  # both ranks stopped after step 4
    assert reports[0]["param_digest"] == reports[1]["param_digest"]  # identical...
    probe = __import__("torch").load(r.debug_dir / "probe.pt")
    assert bool(probe["logits"].isfinite().all())  # ...and finite


def test_check_passes_and_names_a_perturbed_rank(tmp_path):
    ok, _ = launch(tmp_path / "ok", "torchrun", "", extra=["--check"])
    assert ok.returncode == 0, ok.output[-3000:]
    for line in ("preflight: all-reduce across 2 ranks", "weights identical on all 2 ranks at start",
                 "gradient norm after the first step agrees", "checkpoint round trip ok", "check passed"):
        assert line in ok.output
    # the step between save and load moved the weights (at LR 0 it did not, and a load that restored
    # nothing would have passed): step 2 applies a nonzero LR whatever the warmup
    saved, moved = re.search(r"loss on a fixed batch (\S+) at save, (\S+) after another step", ok.output).groups()
    assert saved != moved and "(unchanged" not in ok.output
    assert not (tmp_path / "ok" / "run" / ".check").exists()
    bad, _ = launch(tmp_path / "bad", "torchrun", "perturb@0:rank=1", extra=["--check"])
    assert bad.returncode == 1
    assert "check failed: parameters differ across ranks at start: rank 1" in bad.output


def test_supervised_restart_after_a_crash_resumes_and_completes(tmp_path):
    run_dir = tmp_path / "run"
    code, out = cli({**FAST, "train.max_steps": 12, "checkpoint.every_steps": 4, "run_dir": run_dir},
                    "--launcher", "deepspeed", "--nproc-per-node", "2", "--max-restarts", "2",
                    env={"TRAINER_FAULT": "raise@7:rank=1:attempt=0"}, timeout=600)  # fmt: skip
    assert code == 0, out[-4000:]
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [a["exit"] != 0 for a in attempts] == [True, False], (attempts, out[-6000:])  # (once in CI: 3 attempts)
    assert "restarting in 2 s from step_00000004" in out and "resumed from" in out
    steps = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert sorted(set(steps)) == list(range(1, 13))  # every step ran; 5 and 6 twice (after the checkpoint at 4)
    assert sorted({s for s in steps if steps.count(s) > 1}) == [5, 6]


def test_torchrun_max_restarts_with_gloo_resumes(tmp_path):
    """torchrun's own --max-restarts: with gloo it needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (pytorch#135712); checkpoint.resume: auto makes the restarted workers resume."""
    run_dir = tmp_path / "run"
    args = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(TRAIN), str(TINY)]
    for k, v in {**FAST, "train.max_steps": 12, "checkpoint.every_steps": 4, "checkpoint.resume": "auto",
                 "run_dir": run_dir, "data.cache_dir": data_cache()}.items():
        args += ["--set", f"{k}={v}"]
    env = env_for(2, {"TRAINER_FAULT": "raise@7:rank=1:attempt=0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "resumed from" in out and "step_00000004 at step 4" in out
    steps = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert sorted(set(steps)) == list(range(1, 13))


def test_stragglers_are_named(slow_then_nan):
    r = slow_then_nan
    assert re.search(r"straggler: rank 1 on \S+ spends \d+ ms per step", r.output)
    last = [m for m in r.metrics if "loss" in m][-1]
    assert last["step"] == 4 and [s["rank"] for s in last["stragglers"]] == [1] and len(last["rank_busy_s"]) == 2


def test_a_background_write_stuck_on_a_hung_mount_ends_the_job_within_the_watchdog_timeout(tmp_path):
    """Every rank's background write of the step-6 checkpoint blocks opening its first file (a FIFO
    nobody reads, as a hung NFS or Lustre mount blocks); training goes on to step 8, where the final
    save waits for it. The wait pets the watchdog only while bytes are written, so the watchdog ends
    the job after dist.watchdog_s (it petted it every second for as long as the writer thread lived:
    the job hung forever), and `latest` still names step 3."""
    sets = {"train.max_steps": 8, "checkpoint.every_steps": 3, "checkpoint.async": True, "dist.watchdog_s": 20,
            "checkpoint.save_final": True}  # fmt: skip
    r, took = launch(tmp_path, "deepspeed", "hangwrite@6", sets=sets, timeout=240)
    assert r.returncode != 0 and "injected hangwrite at rank 1 step 6" in r.output, r.output[-3000:]
    assert "made no progress (no step, eval or save) for 20 s" in r.output, r.output[-3000:]
    last = max(t for t, line in r.lines if re.search(r"step +8/8", line))
    after = took - last
    print(f"the writes hung at step 6; the final save waited from step 8; the job exited {r.returncode} "
          f"{after:.1f} s later (watchdog 20 s)")  # fmt: skip
    assert 20 - 2 <= after < 20 + 25, after
    latest = (r.run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000003", latest
