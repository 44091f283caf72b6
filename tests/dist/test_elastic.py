"""Elastic continuation on the loopback two-"node" setup (scripts/loopback_sshd.sh: an sshd on
127.0.0.1 and one on 127.0.0.2): the second node's sshd is stopped mid-run and its rank dies; the
supervisor (--min-nodes 1) finds that node gone, continues on the first from the latest checkpoint
with grad_accum doubled (the global batch kept), and the job ends with every step logged once and the
losses after the shrink within fp32's resharding tolerance of the uninterrupted run."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import FAST, NODROP, ROOT, TINY, TRAIN, data_cache, env_for, loopback_nodes, train

pytestmark = pytest.mark.dist
SCRIPT = ROOT / "scripts" / "loopback_sshd.sh"
SETS = {**FAST, **NODROP, "train.max_steps": 16, "checkpoint.every_steps": 4, "checkpoint.async": False,
        "checkpoint.keep_last": 0}  # fmt: skip


@pytest.fixture
def own_nodes():
    """Two sshds of this test's own (one is stopped in it); both stopped by their pids afterwards."""
    yield from loopback_nodes("sshd-elastic")


def test_a_lost_node_the_job_goes_on_with_the_survivors(tmp_path, own_nodes):
    reference = train(tmp_path / "ref", SETS, launcher="torchrun", debug=False)  # 2 ranks, uninterrupted
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run_dir = tmp_path / "run"
    args = [sys.executable, str(TRAIN), str(TINY)]
    for k, v in {**SETS, "run_dir": run_dir, "data.cache_dir": data_cache()}.items():
        args += ["--set", f"{k}={v}"]
    args += [
        "--launcher",
        "deepspeed",
        "--hostfile",
        str(hostfile),
        "--max-restarts",
        "2",
        "--min-nodes",
        "1",
    ]
    env = env_for(2, {"PATH": f"{own_nodes / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                      "TRAINER_FAULT": "kill@9:rank=1:attempt=0"})  # fmt: skip
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def read() -> None:
        stopped = False
        for line in p.stdout:
            lines.append((time.monotonic() - t0, line))
            if not stopped and re.search(r"step +3/16", line):  # mid-run: node 2 goes away
                subprocess.run(["bash", str(SCRIPT), "stop", str(own_nodes), "127.0.0.2"], timeout=60)
                stopped = True

    reader = threading.Thread(target=read)
    reader.start()
    try:
        rc = p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
        reader.join(timeout=30)
    out = "".join(x for _, x in lines)
    assert rc == 0, out[-5000:]
    assert "1 of 2 nodes answer (lost: 127.0.0.2); continuing on" in out and "train.grad_accum=2" in out, out[
        -4000:
    ]
    steps = [int(m) for m in re.findall(r"\bstep +(\d+)/16", out)]
    assert sorted(steps) == list(range(1, 17)), steps  # every step once: 1-8 on two nodes, 9-16 on one
    last_before = max(t for t, x in lines if re.search(r"step +8/16", x))
    first_after = min(t for t, x in lines if re.search(r"step +9/16", x))
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            losses[m["step"]] = m
    assert [losses[s]["world_size"] for s in (8, 9)] == [2, 1] and losses[9]["grad_accum"] == 2
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [a["ranks"] for a in attempts] == [2, 1], attempts  # device-hours count the survivors only
    drift = max(abs(losses[s]["loss"] - reference.losses[s]) / reference.losses[s] for s in range(9, 17))
    assert drift < 1e-4, drift  # fp32 on another world size: the same sums in another order
    print(f"elastic: node lost after step 8, training again {first_after - last_before:.1f} s later on 1 node "
          f"(grad_accum 1 -> 2); steps 1-16 each once; loss drift after the shrink {drift:.1e} (relative)")  # fmt: skip
