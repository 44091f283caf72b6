"""Two "nodes" on one machine, for real: the deepspeed runner over ssh/pdsh with a hostfile naming
127.0.0.1 and 127.0.0.2 (a private sshd on both), and torchrun with two node ranks on loopback.
Both give the same per-step losses as a single-node 2-rank run."""

import os
import subprocess

import pytest
from helpers import (
    BIN,
    FAST,
    ROOT,
    TINY,
    TRAIN,
    Result,
    data_cache,
    env_for,
    free_port,
    loopback_nodes,
    train,
)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="session")
def nodes():
    """A private sshd on 127.0.0.1 and 127.0.0.2; stopped by its pid afterwards."""
    yield from loopback_nodes("sshd")


@pytest.fixture(scope="session")
def single_node(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), FAST, launcher="deepspeed")


def args_for(run_dir, debug, extra=None):
    args = [str(TRAIN), str(TINY)]
    for k, v in {**FAST, **(extra or {}), "run_dir": run_dir, "data.cache_dir": data_cache()}.items():
        args += ["--set", f"{k}={v}"]
    return args


def test_deepspeed_hostfile_over_ssh(tmp_path, nodes, single_node):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    debug = tmp_path / "debug"
    # The runner forwards only PYTHON*/MV2*/UCX* variables to the nodes; the rest goes in DS_ENV_FILE.
    remote = {
        "PATH": f"{BIN}:{nodes / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "OMP_NUM_THREADS": "1",
        "TRAINER_DEBUG_DIR": str(debug),
        "PYTHONUNBUFFERED": "1",
        # the CPU kernels (make test-avx2) as on the single node, or fp32 sums differ in the last bits
        **{k: v for k, v in os.environ.items() if k.startswith(("ATEN_", "ONEDNN_", "DNNL_"))},
    }
    env_file = tmp_path / "ds_env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in remote.items()))
    env = env_for(2, {"PATH": f"{nodes / 'bin'}:{BIN}:{os.environ['PATH']}", "DS_ENV_FILE": str(env_file)})
    cmd = [
        str(BIN / "deepspeed"),
        "--hostfile",
        str(hostfile),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args_for(tmp_path / "run", debug),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    r = Result(p.returncode, p.stdout, p.stderr, tmp_path / "run", debug)
    assert "pdsh" in out and "2 rank(s) on 2 node(s) via deepspeed" in out
    assert r.losses == single_node.losses  # same per-step losses as one node with 2 ranks
    reports = r.rank_reports()
    assert reports[0]["all_param_digests"][0] == reports[0]["all_param_digests"][1]


def test_torchrun_two_nodes_on_loopback(tmp_path, single_node):
    port = free_port()
    debug = tmp_path / "debug"
    procs = []
    for node in (0, 1):
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
            *args_for(tmp_path / "run", debug),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env_for(2, {"TRAINER_DEBUG_DIR": str(debug)}),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    r = Result(0, outs[0], "", tmp_path / "run", debug)
    assert "2 rank(s) on 2 node(s) via torchrun" in outs[0] + outs[1]
    assert r.losses == single_node.losses


def test_pipeline_stages_across_two_nodes_on_loopback(tmp_path):
    """Two pipeline stages on two torchrun "nodes" (one rank each: DeepSpeed's topology puts the stages outermost, so
    each node holds a stage and only the stage boundary crosses between them) train as the two stages on one node."""
    stages = {"strategy.pipeline_stages": 2, "strategy.zero_stage": 1, "train.eval_prompts": "[]",
              "train.grad_accum": 2, "data.eval_fraction": 0}  # fmt: skip
    one = train(tmp_path / "one", {**FAST, **stages, "train.eval_prompts": []}, launcher="torchrun")
    port, procs = free_port(), []
    for node in (0, 1):
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-stages",
               *args_for(tmp_path / "run", None, stages)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env_for(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    both = outs[0] + outs[1]
    assert "2 rank(s) on 2 node(s) via torchrun" in both and "pipelines [0,1]" in both, both[-3000:]
    assert Result(0, outs[0], "", tmp_path / "run", None).losses == one.losses


def test_a_run_dir_on_node_local_disks_is_refused_at_start(tmp_path):
    """Two torchrun "nodes" on loopback, node 1 in its own mount namespace where run_dir's parent is
    another directory (a node-local disk at the same path, as cloud nodes and Kubernetes pods have):
    every rank stops at start (exit 2) naming the ranks that do not see rank 0's run_dir and the setting
    to change, before any checkpoint is written (each node would have kept its own part of every
    checkpoint, rank 0 would have committed ones it could not see whole, and no resume could load them)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace per node)")
    disk0, disk1, local = tmp_path / "disk0", tmp_path / "disk1", tmp_path / "local"
    for d in (disk0, disk1, local):
        d.mkdir()
    port, debug = free_port(), tmp_path / "debug"
    procs = []
    for node in (0, 1):
        args = [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "node-local",
                *args_for(local / "run", debug)]  # fmt: skip
        disk = disk0 if node == 0 else disk1
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               f'mount --bind "{disk}" "{local}" && exec "$@"', "node", *args]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env_for(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] != [0, 0], "\n".join(o[-3000:] for o in outs)
    said = "\n".join(outs)
    assert "is not shared between the nodes: rank(s) 1 do not see the file rank 0 wrote" in said, said[-4000:]
    assert "set run_dir to a directory on a filesystem every node mounts" in said
    assert not list((disk0 / "run").glob("checkpoints/*")) and not list((disk1 / "run").glob("checkpoints/*"))
