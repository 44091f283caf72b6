"""Where a process sits in the job, read from each launcher's environment (no processes)."""

import os
import sys

import pytest

from trainer.cluster import devices, dist
from trainer.common.errors import UserError


def test_no_launcher_is_one_rank():
    e = dist.detect({})
    assert (e.rank, e.world_size, e.local_world_size, e.launcher, e.nodes) == (0, 1, 1, "none", 1)


def test_deepspeed_runner():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
    }
    e = dist.detect(env)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.node_rank) == (3, 1, 4, 2, 1)
    assert (e.launcher, e.master_addr, e.master_port, e.nodes) == ("deepspeed", "10.0.0.1", 29511, 2)


def test_torchrun():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "exp",
    }
    e = dist.detect(env)
    assert (e.rank, e.local_rank, e.node_rank, e.launcher, e.nodes) == (5, 1, 1, "torchrun", 2)


def test_slurm_srun():
    env = {
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "16",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "MASTER_ADDR": "node-a",
    }
    e = dist.detect(env)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.node_rank) == (9, 1, 16, 8, 1)
    assert (e.launcher, e.master_addr) == ("slurm", "node-a")


def test_a_one_task_slurm_allocation_is_a_plain_process():
    assert dist.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"


def test_the_interpreters_ninja_comes_first(monkeypatch, tmp_path):
    """Two ninjas write incompatible build logs: DeepSpeed's ops must always build with the same one."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", f"/usr/bin{os.pathsep}{bindir}")
    assert dist.prefer_interpreter_tools() is None  # no ninja beside the interpreter: PATH unchanged
    assert os.environ["PATH"] == f"/usr/bin{os.pathsep}{bindir}"
    (bindir / "ninja").write_text("")
    assert dist.prefer_interpreter_tools() == str(bindir)
    assert os.environ["PATH"] == f"{bindir}{os.pathsep}/usr/bin"
    assert dist.prefer_interpreter_tools() is None  # already first


def test_deepspeeds_muon_module_is_imported_without_importing_inductor():
    """DeepSpeed imports its Muon module at ZeRO >= 1 whatever the optimizer; its @torch.compile
    decorators would import TorchInductor (1.3-2 s per rank at every start). After
    dist.import_muon_lazily the module is there, Inductor is not, and DeepSpeed's compile helper is
    its own again. If a DeepSpeed upgrade defeats this, this test says so."""
    import subprocess

    code = (
        "import sys, deepspeed, deepspeed.runtime.compiler as c; from trainer.cluster import dist; "
        "before = c.compile; dist.import_muon_lazily(); "
        "from deepspeed.runtime.zero.muon.original_muon import muon_update; "
        "print('deepspeed.runtime.zero.muon.muon_optimizer' in sys.modules, "
        "'torch._inductor.compile_fx' in sys.modules, c.compile is before, muon_update.__name__)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    last = p.stdout.strip().splitlines()[-1]  # DeepSpeed prints its accelerator warning first
    assert last.split() == ["True", "False", "True", "muon_update"], p.stdout + p.stderr[-2000:]


def test_deepspeed_builds_its_ops_without_debug_information():
    """The flags DeepSpeed's JIT build passes to the compiler after dist.build_ops_without_debug_info:
    the builder's own, less `-g` (a third of CPU Adam's compile). Captured at torch's
    cpp_extension.load, in a child process so the patch stays there; nothing is compiled."""
    import subprocess

    code = (
        "import torch.utils.cpp_extension as ext; from trainer.cluster import dist; "
        "from deepspeed.ops.op_builder import CPUAdamBuilder; seen = []; "
        "ext.load = lambda **kw: seen.append(kw['extra_cflags']) or 'module'; "
        "dist.build_ops_without_debug_info(); dist.build_ops_without_debug_info(); b = CPUAdamBuilder(); "
        "print(b.jit_load(verbose=False)); print(b.strip_empty_entries(b.cxx_args())); print(seen)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, own, seen = p.stdout.strip().splitlines()[-3:]
    own, (used,) = eval(own), eval(seen)  # noqa: S307 - our own child's repr of lists of flags
    assert loaded == "module" and "-g" in own and "-O3" in own  # the builder itself is unchanged
    assert "-g" not in used and used[: len(own) - 1] == [a for a in own if a != "-g"]


def test_rendezvous_ports_come_from_outside_the_ephemeral_range_and_are_free(monkeypatch):
    import socket

    monkeypatch.delenv(dist.ENV_PORTS, raising=False)  # (conftest gives each test worker a share)
    lo_eph, hi_eph = dist.ephemeral_ports()
    ports = {dist.free_port() for _ in range(20)}
    assert all(not lo_eph <= p <= hi_eph for p in ports) and len(ports) > 1  # random, not fixed
    # TRAINER_PORTS: a range of 64 with 63 ports taken gives the last one.
    monkeypatch.setenv(dist.ENV_PORTS, "10064-10127")
    held = []
    try:
        for port in range(10064, 10128):
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        spare = held.pop()
        port = spare.getsockname()[1]
        spare.close()
        assert {dist.free_port() for _ in range(5)} == {port}
        held.append(socket.socket())
        held[-1].bind(("", port))
        with pytest.raises(UserError, match=r"no free TCP port in 10064-10127 \(TRAINER_PORTS\)"):
            dist.free_port()
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("spec", ["20000", "a-b", "30000-20000", "80-90", "20000-70000"])
def test_a_malformed_port_range_is_an_error_naming_the_variable(spec):
    with pytest.raises(UserError, match=r"TRAINER_PORTS=.*expected .*e\.g\. 20000-20999"):
        dist.port_range({dist.ENV_PORTS: spec})


# A few steps of a small MLP in a fresh process: page faults per step with glibc's defaults or with
# trainer.cluster.dist.keep_freed_memory() (CPU training's malloc settings). Fresh processes because mallopt
# changes the allocator for the rest of the process. Transparent huge pages off (PR_SET_THP_DISABLE):
# with them a fault maps 2 MiB or 4 KiB depending on the machine's free huge pages at the time, and
# glibc's defaults measured 451-1,792 faults a step under CI's load instead of 1,700-3,400.
_FAULTS = """
import ctypes, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count 4 KiB pages
import torch
torch.set_num_threads(1)
from trainer.cluster.dist import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else None
m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
                          for _ in range(4)])
x = torch.randn(1024, 128)
def step():
    m(x).square().mean().backward()
step(); step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
"""


def _faults(apply: bool, **env: str) -> tuple[str, float]:
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _FAULTS, "1" if apply else "0"], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_training_keeps_freed_memory_instead_of_faulting_pages_in_every_step():
    applied, kept = _faults(True)
    _, default = _faults(False)
    assert applied == "True"
    # glibc's defaults hand a step's freed activations back to the kernel: thousands of fresh pages a
    # step in most processes (1,700-5,100 measured), 566 in about one in four (its dynamic mmap
    # threshold settles differently); kept in the heap, 38-128. (`kept * 5 < default` failed on
    # those: 128 * 5 > 566.)
    assert kept < 300 and kept * 2 < default, (kept, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_users_own_malloc_settings_win():
    applied, _ = _faults(True, MALLOC_ARENA_MAX="2")
    assert applied == "False"


@pytest.mark.parametrize(
    "visible,cpu,found",
    [(None, None, True), ("0", None, True), ("", None, False), ("-1", None, False), ("-1,0", None, False),
     ("0,1", "1", False)],  # the deepspeed launcher's ranks: CUDA_VISIBLE_DEVICES reset, TRAINER_CPU kept
)  # fmt: skip
def test_hidden_gpus_make_a_cpu_run_on_a_gpu_machine(monkeypatch, tmp_path, visible, cpu, found):
    """`CUDA_VISIBLE_DEVICES=` on a GPU machine: torch finds no GPU, so neither may the planner and
    set-up (nvidia-smi lists every GPU regardless), or a CPU run is planned for the GPU's memory,
    with a GPU's attention kernel, and DeepSpeed is left to guess its accelerator."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if cpu is None:
        monkeypatch.delenv(devices.ENV_CPU, raising=False)
    else:
        monkeypatch.setenv(devices.ENV_CPU, cpu)
    assert devices.device_memory() == (81559 * 2**20 if found else None)
    assert devices.gpu_present() is found
    devices.hide_gpus_if_asked()  # set-up: under TRAINER_CPU=1 torch must find none either
    if cpu == "1":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_deepspeed_asks_py_cpuinfo_once_per_process():
    """DeepSpeed asks py-cpuinfo for the CPU three times in a rank that offloads (DeepSpeedCPUAdam's
    vendor check, its builder's -march and SIMD flags), and each answer is a new Python process.
    After dist.read_cpu_info_once it is one process, the flags are the same, and a caller changing
    its copy changes no one else's. Counted at subprocess.Popen in a child process (the patch stays
    there): 3 without the patch, 1 with it."""
    import subprocess

    code = (
        "import subprocess, sys, cpuinfo; from trainer.cluster import dist; n = []; real = subprocess.Popen.__init__\n"
        "def counted(self, args, *a, **k):\n"
        "    n.extend(['spawn'] if '--json' in list(args) else [])\n"
        "    return real(self, args, *a, **k)\n"
        "subprocess.Popen.__init__ = counted\n"
        "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
        "if sys.argv[1:]: dist.read_cpu_info_once(); dist.read_cpu_info_once()\n"
        "b = CPUAdamBuilder(); flags = [b.cpu_arch(), b.simd_width()]\n"
        "cpuinfo.get_cpu_info()['arch'] = 'changed'\n"
        "print(len(n), *flags, cpuinfo.get_cpu_info()['arch'] != 'changed')\n"
    )
    out = {}
    for patched in ([], ["patched"]):
        p = subprocess.run([sys.executable, "-c", code, *patched], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        out[bool(patched)] = p.stdout.strip().splitlines()[-1].split()
    assert out[False][0] == "3" and out[True][0] == "1", out
    assert out[True][1:] == out[False][1:] and out[True][-1] == "True", out
