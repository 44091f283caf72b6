"""The machine a plan is timed on (speed.py): each device's achieved FLOP/s, the links between devices,
nodes and host memory, DeepSpeed's CPU Adam and NVMe, from a profile of the GPU (`PROFILES`) with
`strategy.hardware`'s keys over it (`machine`).

The published figures behind each profile (dense bf16 tensor peak; per direction for the links):

- H100 SXM5 and H200 SXM: 989 TFLOP/s (NVIDIA's H100 and H200 datasheets: 1,979 "with sparsity"); NVLink 4,
  900 GB/s per GPU both directions together (450 each way); PCIe Gen5 x16 to the host (64 GB/s each way); a
  DGX H100/H200 node has one 400 Gb/s ConnectX-7 InfiniBand port per GPU (50 GB/s).
- A100 SXM4: 312 TFLOP/s (A100 datasheet: 624 with sparsity); NVLink 3, 600 GB/s both ways (300 each); PCIe
  Gen4 x16 (32 GB/s); DGX A100: one 200 Gb/s HDR port per GPU (25 GB/s).
- L40S: 362 TFLOP/s (L40S datasheet: 733 with sparsity); no NVLink: peers over PCIe Gen4 x16 (32 GB/s).
- The PCIe cards: H100 PCIe 756 TFLOP/s (H100 datasheet: 1,513 with sparsity), H100 NVL and H200 NVL 835 (H100
  and H200 NVL datasheets: 1,671 with sparsity), A100 PCIe 312 (A100 datasheet, as the SXM4's); PCIe Gen5 x16 (64
  GB/s each way; Gen4's 32 for the A100). Their NVLink bridges join pairs (the H200 NVL's up to four), so a node's
  collectives run at PCIe's rate: peers 64 GB/s (32 for the A100 PCIe), `peer_gbs` for a job inside a bridge.
- GeForce RTX 4090: 165 TFLOP/s with fp32 accumulation (NVIDIA Ada Lovelace architecture whitepaper,
  appendix table: 330 with sparsity); no NVLink and no peer-to-peer: peers through host memory over PCIe
  Gen4 (32 GB/s at best).
  Neither the last two nor the PCIe cards has a reference multi-node design: 100 Gb/s (12.5 GB/s) a GPU between
  nodes is an assumption (`strategy.hardware.network_gbs`).

A device achieves `MFU` (45%) of its peak on a model's matmuls by default, and a link its published rate (an
optimistic bound: NCCL's all-reduce reaches 70-85% of NVLink's). DeepSpeed's CPU Adam is the host's: a node's
ranks share its cores, so a node updates `cpu_adam` parameters a second whatever its GPUs (4e9: the order
ZeRO-Offload, Ren et al. 2021, reports for its CPU-Adam on a DGX-2 host; measure yours). The CPU profile is
this project's test machines: two cores, gloo between processes, "offload" a copy within host memory, its
figures fitted to measured steps (below). A GPU's `micro_s` and `collective_s` are 0 until a GPU lease measures
them (issue 62): NCCL's latency (tens of microseconds) and the engine's per-micro-step host time, assumed
hidden behind the device's work in the jobs the GPU profiles plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainer.common.errors import UserError

GB = 1e9  # the links' unit (decimal, as datasheets give them)
MFU = 0.45  # the share of the dense peak a device achieves on the model's matmuls


@dataclass(frozen=True)
class Machine:
    """What speed.py times a step on. Bandwidths are bytes a second in one direction."""

    name: str
    flops: float  # dense FLOP/s a device achieves on the model's matmuls
    peers: float  # between the devices of a node (NVLink; PCIe where there is none)
    network: float  # per device, between nodes
    host_link: float  # between a device and host memory (PCIe)
    cpu_adam: float  # parameters a second DeepSpeed's CPU Adam updates on one node (its ranks share it)
    nvme: float  # per node, to and from NVMe
    op_s: float  # host seconds per operator launched (Python, autograd, dispatch, the launch)
    zero3_tensor_s: float  # host seconds ZeRO-3's hooks spend per parameter tensor per pass
    overlap: bool = True  # the host launches ahead of the device (a GPU); False: the same cores do both (CPU)
    micro_s: float = 0.0  # host seconds a micro step costs whatever its size (the engine's calls)
    collective_s: float = 0.0  # seconds an exchange of sequence parallelism costs whatever its size


def _gpu(name: str, tflops: float, peers: float, network: float, host: float) -> Machine:
    # op_s and zero3_tensor_s measured on an H200 (issue 55: QLoRA of an 8B pinned to ZeRO-3 took 9.6 s a
    # step against ZeRO-0's 2.8, ~0.8 ms a tensor a pass); the host is about as fast behind every GPU here
    return Machine(name=name, flops=MFU * tflops * 1e12, peers=peers * GB, network=network * GB,
                   host_link=host * GB, cpu_adam=4e9, nvme=6 * GB, op_s=30e-6, zero3_tensor_s=0.8e-3)  # fmt: skip


PROFILES = {
    "h100": _gpu("h100", 989, 450, 50, 64),
    "h200": _gpu("h200", 989, 450, 50, 64),
    "a100": _gpu("a100", 312, 300, 25, 32),
    "h100-pcie": _gpu("h100-pcie", 756, 64, 12.5, 64),
    "h100-nvl": _gpu("h100-nvl", 835, 64, 12.5, 64),
    "h200-nvl": _gpu("h200-nvl", 835, 64, 12.5, 64),
    "a100-pcie": _gpu("a100-pcie", 312, 32, 12.5, 32),
    "l40s": _gpu("l40s", 362, 32, 12.5, 32),
    "rtx4090": _gpu("rtx4090", 165, 32, 12.5, 32),
    # two cores, one a rank (as the tests run 2 ranks: a 1-rank run on both cores goes about twice as fast as
    # planned); gloo between processes; "offload" copies within host memory. Figures that order the settings,
    # fitted to the steps bench/plan_order.py measured here on 2026-11-28 (bench/plan_fit.py: least squares on
    # log(measured / planned) over 48 settings at 2 ranks; BENCHMARKS.md, "The planner's order against measured
    # steps"), rounded: the data do not pin each one down (FLOP/s trades against the operators' and the micro
    # step's costs), so they are no measurement of the machine one by one. The host's work does not overlap the
    # "device's" (the same cores do both). CPU Adam's cost is below the noise of these steps (the fit drives it
    # to zero): 2e9 a second stands for "cheap". `network` is not fitted (2 ranks never leave the node): taken
    # as slow as the peers.
    "cpu": Machine(
        name="cpu",
        flops=60e9,
        peers=0.3 * GB,
        network=0.3 * GB,
        host_link=0.75 * GB,
        cpu_adam=2e9,
        nvme=1 * GB,
        op_s=80e-6,
        zero3_tensor_s=0.7e-3,
        overlap=False,
        micro_s=45e-3,
        collective_s=1.3e-3,
    ),
}

# torch.cuda.get_device_name()'s words (upper case) -> the profile: the first whose words are all in the name. A PCIe
# or NVL card matches its own profile or none (never its SXM sibling's); anything else: the H100's, said so
NAMES = (
    (("H200", "NVL"), "h200-nvl"), (("H100", "NVL"), "h100-nvl"), (("H100", "PCIE"), "h100-pcie"),
    (("A100", "PCIE"), "a100-pcie"), (("H200",), "h200"), (("H100",), "h100"), (("A100",), "a100"),
    (("L40S",), "l40s"), (("4090",), "rtx4090"),
)  # fmt: skip
CARDS, SXM = ("PCIE", "NVL"), ("h100", "h200", "a100")  # a card's words; the SXM modules' profiles

# strategy.hardware's keys -> (the Machine field, the factor from the key's unit)
KEYS = {"tflops": ("flops", 1e12), "peer_gbs": ("peers", GB), "network_gbs": ("network", GB),
        "host_gbs": ("host_link", GB), "cpu_adam": ("cpu_adam", 1e9), "nvme_gbs": ("nvme", GB)}  # fmt: skip


def profile_for(device_type: str, gpu: str = "auto", device_name: str | None = None) -> tuple[str, str]:
    """(profile name, why): the CPU's on a CPU run (where strategy.hardware.gpu is refused: no GPU to time); else
    strategy.hardware.gpu, else the device's name, else the H100 (planning for another machine)."""
    if device_type != "cuda":
        if gpu != "auto":  # nothing the user gave is dropped in silence
            raise UserError(
                f"strategy.hardware.gpu: {gpu} times the plan on that GPU, and this is a CPU run (no GPU here and "
                "no strategy.device_memory); to plan for a machine of those GPUs give strategy.device_memory (e.g. "
                "80GB), else set strategy.hardware.gpu: auto"
            )
        return "cpu", "a CPU run"
    if gpu != "auto":
        return gpu, "strategy.hardware.gpu"
    if device_name:
        words = device_name.upper()
        found = next((p for keys, p in NAMES if all(k in words for k in keys)), None)
        if found and not (found in SXM and any(k in words for k in CARDS)):
            return found, f"this machine's {device_name}"
        return "h100", f"{device_name} has no profile: the H100's figures (set strategy.hardware)"
    return "h100", "planning for another machine (set strategy.hardware.gpu)"


def machine(device_type: str, hardware: Any = None, device_name: str | None = None) -> tuple[Machine, str]:
    """The machine to time a plan on and a line that says where its figures come from: the profile, with
    every strategy.hardware key that is not auto over it."""
    gpu = getattr(hardware, "gpu", "auto") if hardware is not None else "auto"
    name, why = profile_for(device_type, gpu, device_name)
    m = PROFILES[name]
    given = {}
    for key, (attr, unit) in KEYS.items():
        value = getattr(hardware, key, "auto") if hardware is not None else "auto"
        if value != "auto":
            given[attr] = float(value) * unit
    if given:
        m = replace(m, **given)
        why += "; " + ", ".join(f"{k} {getattr(hardware, k)}" for k in KEYS if getattr(hardware, k) != "auto")
    return m, f"{name} ({why})"


def describe(m: Machine) -> str:
    """The figures, as --plan shows them."""
    return (
        f"{m.flops / 1e12:g} TFLOP/s achieved, peers {m.peers / GB:g} GB/s, network {m.network / GB:g} GB/s a "
        f"device, host link {m.host_link / GB:g} GB/s, CPU Adam {m.cpu_adam / 1e9:g}e9 parameters/s a node"
    )
