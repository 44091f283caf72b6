"""Process-group setup, launcher-agnostic.

The one module that reads the environment (besides `cli`, which reads argv): rank, local rank,
world size and node come from whichever launcher started us (the deepspeed runner, torchrun,
SLURM's srun, or none); the backend follows the device (NCCL on GPU, gloo on CPU); CPU threads
are split between the ranks of a node; seeds are set so that model init is identical on every
rank and dropout differs per rank.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.cluster.devices import gpu_present, hide_gpus_if_asked
from trainer.common.deepspeed_patches import (  # noqa: F401 (re-exported: scripts/build_ops.py, tests)
    build_ops_without_debug_info,
    import_muon_lazily,
    read_cpu_info_once,
    skip_inference_shm_op,
)

ENV_PORTS = "TRAINER_PORTS"  # LO-HI: where rendezvous ports are chosen (see port_range)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    launcher: str = "none"  # deepspeed | torchrun | slurm | none
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    hostname: str = ""

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: dict[str, str], *names: str, default: int | None = None) -> int | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


def detect(env: dict[str, str] | None = None) -> DistEnv:
    """Read rank/world from the launcher's environment variables."""
    env = dict(os.environ if env is None else env)
    host = socket.gethostname()
    if "RANK" in env and "WORLD_SIZE" in env:
        if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
            launcher = "torchrun"
        elif "CROSS_RANK" in env or "LOCAL_SIZE" in env:
            launcher = "deepspeed"
        else:
            launcher = env.get("TRAINER_LAUNCHER", "deepspeed")
        world = _int(env, "WORLD_SIZE", default=1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=world)
        rank = _int(env, "RANK", default=0)
        return DistEnv(
            rank=rank,
            local_rank=_int(env, "LOCAL_RANK", default=0),
            world_size=world,
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", "CROSS_RANK", "NODE_RANK", default=rank // max(1, local_world)),
            launcher=launcher,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=29500),
            hostname=host,
        )
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        world = _int(env, "SLURM_NTASKS", default=1)
        nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
        return DistEnv(
            rank=_int(env, "SLURM_PROCID", default=0),
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            world_size=world,
            local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", default=max(1, world // max(1, nodes))),
            node_rank=_int(env, "SLURM_NODEID", default=0),
            launcher="slurm",
            master_addr=env.get("MASTER_ADDR") or _slurm_first_host(env) or "127.0.0.1",
            master_port=_int(env, "MASTER_PORT", default=29500),
            hostname=host,
        )
    return DistEnv(hostname=host)


def _slurm_first_host(env: dict[str, str]) -> str | None:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_range(env: dict[str, str] | None = None) -> tuple[int, int]:
    """The ports rendezvous ports are chosen from, [lo, hi): `TRAINER_PORTS=LO-HI` (inclusive) where
    set, e.g. the range a cluster's firewall leaves open; else the larger side outside the kernel's
    ephemeral range (10000 up to it on Linux's defaults)."""
    env = os.environ if env is None else env
    spec = env.get(ENV_PORTS, "").strip()
    if not spec:
        lo_eph, hi_eph = ephemeral_ports()
        return max([(10000, lo_eph), (hi_eph + 1, 65536)], key=lambda r: r[1] - r[0])
    from trainer.common.errors import UserError

    lo_s, sep, hi_s = spec.partition("-")
    if not (sep and lo_s.strip().isdigit() and hi_s.strip().isdigit()):
        raise UserError(f"{ENV_PORTS}={spec!r}: expected LO-HI, the first and last port, e.g. 20000-20999")
    lo, hi = int(lo_s), int(hi_s)
    if not 1024 <= lo <= hi <= 65535:
        raise UserError(f"{ENV_PORTS}={spec!r}: expected 1024 <= LO <= HI <= 65535, e.g. 20000-20999")
    return lo, hi + 1


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (MASTER_PORT), from `port_range()`.

    Chosen at random outside the kernel's ephemeral range, not by bind(("", 0)): a port the kernel
    hands out that way it hands out again to any outgoing connection (gloo opens dozens per job),
    so in the seconds before the rendezvous binds it another job on the host can take it and the
    launch fails with EADDRINUSE. Outside the range only an explicit bind takes a port."""
    lo, hi = port_range()
    if hi <= lo:  # an ephemeral range that leaves no port outside it: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = random.Random().randrange(hi - lo)  # not the seeded global generator (the same every run)
    for k in range(hi - lo):  # from a random port on, each port of the range once
        port = lo + (start + k) % (hi - lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # free on every address, as the rendezvous store binds it
            except OSError:
                continue
            return port
    from trainer.common.errors import UserError

    raise UserError(f"no free TCP port in {lo}-{hi - 1} ({ENV_PORTS}): widen the range or free a port")


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def user_set_threads() -> bool:
    return "OMP_NUM_THREADS" in os.environ


# glibc's malloc tunables that keep a training step's freed tensors in the heap for the next step:
# environment variable -> (mallopt parameter from malloc.h, value)
MALLOC_TUNABLES = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20),
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
    "MALLOC_TOP_PAD_": (-2, 64 << 20),
}


def malloc_env() -> dict[str, str]:
    """`keep_freed_memory` as environment variables, for a process started from outside bin/train."""
    return {name: str(value) for name, (_, value) in MALLOC_TUNABLES.items()}


def keep_freed_memory() -> bool:
    """CPU training: let glibc's malloc reuse the memory a step frees instead of handing it back to the
    kernel. By default every tensor over 128 KiB (up to glibc's adaptive 32 MiB) is its own mmap and
    the heap's top is trimmed after each free, so every step's activations and gradients come back
    as fresh pages: 600-2,800 page faults and 1-5 ms of kernel time a step for a 4-layer 256-wide
    model (BENCHMARKS.md). The same as `malloc_env()` in the environment (what PyTorch's CPU tuning
    guide gets from jemalloc or tcmalloc). Skipped where the user set any MALLOC_* variable (theirs
    applies) or libc is not glibc. True when applied."""
    if any(k.startswith("MALLOC_") for k in os.environ) or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in MALLOC_TUNABLES.values())


@dataclass
class Runtime:
    """The process's place in the job plus its device; built once by `setup`."""

    env: DistEnv
    device_type: str  # cuda | cpu
    backend: str
    threads: int
    device: Any = None  # torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def prefer_interpreter_tools() -> str | None:
    """Put the interpreter's own scripts directory (the venv's bin) first on PATH when it holds
    `ninja`, so DeepSpeed's JIT-built ops always build with the same ninja. Two ninjas (pip's 1.13 in
    the venv, a distribution's 1.11 in /usr/bin) write incompatible build logs, and a run under
    either one rebuilds what the other built, at every start that alternates between `make tiny`
    (no venv on PATH) and `deepspeed ...` (venv activated). Returns the directory added."""
    bindir = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(bindir, "ninja")):
        return None
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path and path[0] == bindir:
        return None
    os.environ["PATH"] = os.pathsep.join([bindir, *(p for p in path if p != bindir)])
    return bindir


def setup(timeout_s: float = 600.0) -> Runtime:
    """Initialise the process group for whichever launcher started us (world 1 without one).
    `timeout_s` bounds every collective, in every group: DeepSpeed creates its own groups without a
    timeout, so torch's defaults (30 minutes for gloo) would apply to them."""
    prefer_interpreter_tools()
    env = detect()
    if env.launcher in ("none", "slurm"):  # give torch.distributed the env:// variables it reads
        port = env.master_port or free_port()
        os.environ.update(
            RANK=str(env.rank),
            LOCAL_RANK=str(env.local_rank),
            WORLD_SIZE=str(env.world_size),
            LOCAL_WORLD_SIZE=str(env.local_world_size),
            MASTER_ADDR=env.master_addr,
            MASTER_PORT=str(port),
        )
        env = DistEnv(**{**env.__dict__, "master_port": port})
    hide_gpus_if_asked()
    if not gpu_present():
        keep_freed_memory()
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say so, instead of DeepSpeed guessing loudly
    import torch

    # CPU threads: cores split between the ranks of this node, unless the user chose.
    threads = (
        int(os.environ["OMP_NUM_THREADS"])
        if user_set_threads()
        else max(1, cpu_cores() // env.local_world_size)
    )
    torch.set_num_threads(threads)

    if torch.cuda.is_available():
        device_type, backend = "cuda", "nccl"
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device_type, backend = "cpu", "gloo"
        device = torch.device("cpu")

    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=timeout_s)  # read by every new_group() without a timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)

    import deepspeed

    if device_type == "cpu":
        skip_inference_shm_op()
    import_muon_lazily()
    build_ops_without_debug_info()
    read_cpu_info_once()
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_s),
        verbose=False,
    )
    return Runtime(env=env, device_type=device_type, backend=backend, threads=threads, device=device)


def gather_ints(values: list[int], world_size: int, group: Any = None) -> list[list[int]]:
    """Every rank's few `values`, on every rank, in one all-gather on `group` (a CPU gloo group:
    never a GPU sync); `[values]` without one."""
    if group is None:
        return [list(values)]
    import torch
    import torch.distributed as tdist

    n = len(values)
    out = torch.zeros(world_size * n, dtype=torch.int64)
    tdist.all_gather_into_tensor(out, torch.tensor(values, dtype=torch.int64), group=group)
    return out.view(world_size, n).tolist()


def all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, on every rank."""
    if world_size == 1:
        return [obj]
    import torch.distributed as tdist

    out: list[Any] = [None] * world_size
    tdist.all_gather_object(out, obj)
    return out


def seed_all(seed: int) -> None:
    """Same seed everywhere: python, numpy, torch (CPU and every GPU)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def debug_dir() -> str | None:
    """Where tests want per-rank reports (parameter digests, consumed samples); None = off."""
    return os.environ.get("TRAINER_DEBUG_DIR") or None


def debug_grads_step() -> int:
    """Tests (TRAINER_DEBUG_GRADS=STEP): the step after whose backward the gradients are written to the
    debug directory (consistency.GradDump); 0 = off."""
    return int(os.environ.get("TRAINER_DEBUG_GRADS") or 0)


def attempt() -> int:
    """Which attempt this is (0 = first): set by our supervisor, or torchrun's restart count."""
    return int(os.environ.get("TRAINER_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def restarted() -> bool:
    """Whether this process reruns its job's command line: our supervisor's attempt after the first, torchrun's
    restart (--max-restarts), or a Slurm requeue of the same job."""
    keys = ("TRAINER_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    return any(int(os.environ.get(k) or 0) > 0 for k in keys)


def job() -> str | None:
    """The job this process belongs to, the same across the restarts that rerun its command line (recorded with
    every commit, so that a restart knows whether the job has a checkpoint of its own yet): our supervisor's
    (TRAINER_JOB), else torchrun's agent, which restarts the ranks it started (its host, pid and start time: a
    new torchrun is a new job even with the same rendezvous id), within Slurm's job (`slurm_job`: a requeue
    continues it); None where nothing restarts the command line. Multi-node torchrun: rank 0's, shared at start (run/rundir.hold)."""
    if os.environ.get("TRAINER_JOB"):
        return os.environ["TRAINER_JOB"]
    own = None
    if under_torchrun():
        agent = os.getppid()
        try:  # its start time (clock ticks since boot): a pid the system reused is another process
            since = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            since = "0"
        own = f"torchrun-{socket.gethostname()}-{agent}-{since}"
    elif os.environ.get("SLURM_JOB_ID"):
        own = f"step-{os.environ.get('SLURM_STEP_ID', 'batch')}"  # srun's ranks: its job step
    return slurm_job(own) if os.environ.get("SLURM_JOB_ID") else own


def slurm_job(own: str | None) -> str:
    """Under Slurm, a job id that a requeue continues: `slurm-<job id>.<restart count>/<this command>`. A requeue
    (the restart count one more) is the same job as every command of the allocations before it
    (checkpoint/restart.same_job); two commands in one allocation (two `srun`s, or bin/train typed twice in an
    salloc) are two jobs."""
    return f"slurm-{os.environ['SLURM_JOB_ID']}.{int(os.environ.get('SLURM_RESTART_COUNT') or 0)}/{own}"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


# Environment a remote node needs (the deepspeed runner forwards only PYTHON*, MLFLOW*, MV2*, UCX*).
FORWARD_PREFIXES = (
    "NCCL_",
    "TRAINER_",
    "HF_",
    "TRANSFORMERS_",
    "WANDB_",
    "TORCH_",
    "CUDA_",
    "OMP_",
    "ATEN_",  # ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: the CPU kernels (make test-avx2), alike on every node
    "ONEDNN_",
    "DNNL_",
    "MKL_",
    "GLOO_",
)
FORWARD_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")


def remote_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of `env` (default: this process's) to forward to every node of a hostfile run."""
    return {
        k: v
        for k, v in (os.environ if env is None else env).items()
        if (k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)) and "\n" not in v
    }
