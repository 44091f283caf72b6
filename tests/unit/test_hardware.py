"""The step's time model prices what DeepSpeed does (issue 61; trainer/strategy/planning/speed.py) on the machine
strategy.hardware describes (hardware.py): ZeRO's collectives over the whole world it shards over, ZeRO-2/3's
reductions at every micro step and ZeRO-0/1's at the boundary, Ulysses' all-to-alls inside a node, CPU Adam
shared by a node's ranks; the profiles by the GPU's name and the keys over them; bad values refused (exit 2)."""

import shutil

import pytest

from trainer import config, model
from trainer.run.cli import main
from trainer.strategy.planning.candidates import Candidate
from trainer.strategy.planning.hardware import PROFILES, machine
from trainer.strategy.planning.levers import Levers
from trainer.strategy.planning.speed import step_time

QLORA = "configs/experiments/llama3-8b-qlora.yaml"
FULL = ["model.lora=null", "train.micro_batch_size=1", "train.grad_accum=1", "train.global_batch_size=null"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    exp = config.load(QLORA, FULL)
    cache = tmp_path_factory.mktemp("counts")  # bench/plan_matrix.py's counts, copied (none written back)
    shutil.copytree("bench/results/plan_matrix", cache, dirs_exist_ok=True)
    return exp, model.info(exp.model, 257, 256, cache_dir=cache)


def t(job, levers, c, world, node=8, accum=1, m=None):
    exp, info = job
    return step_time(exp, info, levers, c, world_size=world, gpus_per_node=node, device_type="cuda", lp=2,
                     accum=accum, hardware=m or PROFILES["h100"])  # fmt: skip


def test_zero_shards_and_reduces_over_the_whole_world_also_under_sequence_parallelism(job):
    """Sequence parallel 16 on 16 ranks leaves one data-parallel rank, but ZeRO-3 still partitions over all 16
    (as the memory plan counts): its gathers and reduce-scatters cross the network as they do without it."""
    grads = 8_030_261_248 * 2
    sp16 = t(job, Levers(sp=16), Candidate(3), 16)
    one = t(job, Levers(), Candidate(3), 16)
    assert sp16.reductions == pytest.approx(grads * 15 / 16 / 50e9)  # H100 nodes: 50 GB/s a GPU between them
    gathers = 2 * grads * 15 / 16 / 50e9  # the bf16 parameters in the forward and the backward
    assert one.transfers == pytest.approx(gathers) and sp16.transfers > gathers  # and Ulysses' all-to-alls
    assert one.reductions == sp16.reductions


def test_zero2_and_3_reduce_at_every_micro_step_zero0_and_1_at_the_boundary(job):
    """DeepSpeed's engine: ZeRO stage >= 2 communicates at every micro step; 0 and 1 once a step (an all-reduce,
    or a reduce-scatter and the updated parameters' all-gather). 16 ranks, accumulation 1 and 16."""
    r = {
        (s, a): t(job, Levers(), Candidate(s), 16, accum=a).reductions for s in (0, 1, 2, 3) for a in (1, 16)
    }
    one = 8_030_261_248 * 2 * 15 / 16 / 50e9  # a reduce-scatter (or an all-gather) of the bf16 gradients
    assert r[0, 1] == r[0, 16] == r[1, 16] == pytest.approx(2 * one)
    assert r[2, 1] == pytest.approx(2 * one) and r[2, 16] == pytest.approx(17 * one)
    assert r[3, 16] == pytest.approx(16 * one)


def test_sequence_parallel_groups_sit_inside_a_node(job):
    """Ulysses' groups are consecutive ranks: at degree 8 its all-to-alls cross NVLink whatever the world (they
    had been priced at the network's rate past 8 ranks); at 16 they span two nodes and cross the network."""
    inside = t(job, Levers(sp=8), Candidate(0), 8).transfers
    assert t(job, Levers(sp=8), Candidate(0), 64).transfers == pytest.approx(inside)
    across = t(job, Levers(sp=16), Candidate(0), 16).transfers  # half the tokens a rank, over the network
    assert across == pytest.approx(inside / 2 * (15 / 16) / (7 / 8) * 450 / 50, rel=1e-6)


def test_a_sequence_parallel_group_that_straddles_two_nodes_crosses_the_network(job):
    """Review of issue 61, finding 7: with 6 GPUs a node, Ulysses' groups of 4 consecutive ranks are 0-3, 4-7
    (4-5 on the first node, 6-7 on the second), 8-11: two of three cross the network, and the all-to-all runs at
    the rate of its slowest link. It had been priced at NVLink's rate because 4 <= 6."""
    inside = t(job, Levers(sp=4), Candidate(0), 8).transfers
    assert t(job, Levers(sp=4), Candidate(0), 12, node=6).transfers == pytest.approx(inside * 450 / 50)
    assert t(job, Levers(sp=2), Candidate(0), 12, node=6).transfers == pytest.approx(
        t(job, Levers(sp=2), Candidate(0), 8).transfers
    )  # groups of 2 tile a node of 6


def test_cpu_adam_is_a_node_s_shared_by_its_ranks(job):
    """Each of 16 ranks updates 1/16 of the parameters on the host, but the 8 ranks of a node share its CPU:
    the node updates half of them, at the node's rate (hardware.cpu_adam)."""
    c = Candidate(2, "cpu")
    eight = t(job, Levers(), c, 16, node=8).optimizer
    assert eight == pytest.approx(8_030_261_248 / 2 / 4e9)
    assert t(job, Levers(), c, 16, node=1).optimizer == pytest.approx(eight / 8)


@pytest.mark.parametrize(
    "name, profile",
    [("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
     ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA H100 80GB HBM3", "h100"),
     ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H200", "h200")],
)  # fmt: skip
def test_pcie_and_nvl_cards_have_their_own_profiles(name, profile):
    """Review of issue 61, finding 6: "H100 PCIe", "H100 NVL" and "A100-PCIE-40GB" had been matched to the SXM
    profiles (989 TFLOP/s and NVLink's 450 GB/s each way for an H100 PCIe: 756 and PCIe's 64)."""
    m, why = machine("cuda", None, name)
    assert m.name == profile and name in why, why


def test_the_pcie_profiles_figures_are_the_datasheets():
    mfu = 0.45
    for name, tflops, peers, host in (("h100-pcie", 756, 64, 64), ("h100-nvl", 835, 64, 64),
                                      ("h200-nvl", 835, 64, 64), ("a100-pcie", 312, 32, 32)):  # fmt: skip
        m = PROFILES[name]
        assert (m.flops, m.peers, m.host_link) == (mfu * tflops * 1e12, peers * 1e9, host * 1e9), name


def test_an_unknown_pcie_card_is_matched_to_no_profile_and_says_so():
    """A PCIe or NVL card without a profile of its own is never timed as its SXM sibling."""
    m, why = machine("cuda", None, "NVIDIA H800 PCIe")
    assert m.name == "h100" and "has no profile" in why and "H800 PCIe" in why, why


def test_a_gpu_profile_on_a_cpu_run_exits_2_naming_the_key(job):
    """Review of issue 61, finding 10: strategy.hardware.gpu on a CPU run (no GPU here, no strategy.device_memory)
    had been dropped without a word: the plan timed the CPU's profile."""
    from trainer import strategy
    from trainer.common.errors import UserError

    exp = config.load("configs/experiments/tiny.yaml", ["strategy.hardware.gpu=h100"])
    with pytest.raises(UserError) as e:
        machine("cpu", exp.strategy.hardware)
    text = str(e.value)
    assert (
        text.startswith("strategy.hardware.gpu: h100") and "CPU" in text and "strategy.device_memory" in text
    ), text
    info = model.info(exp.model, 257, 256)
    with pytest.raises(UserError, match="strategy.hardware.gpu: h100"):
        strategy.plan(exp, info, world_size=1, gpus_per_node=1, device_type="cpu", device_memory=8 * 2**30,
                      host_memory=8 * 2**30, precision="fp32")  # fmt: skip
    # the figures over the CPU's profile are taken (they are no GPU's): network_gbs on a CPU run
    cpu = config.load("configs/experiments/tiny.yaml", ["strategy.hardware.network_gbs=3"]).strategy.hardware
    assert machine("cpu", cpu)[0].network == 3e9


def test_the_gpu_profile_by_name_and_the_keys_over_it(job):
    assert machine("cuda", None, "NVIDIA H200")[0].name == "h200"
    assert machine("cuda", None, "NVIDIA A100-SXM4-80GB")[0].name == "a100"
    assert machine("cuda", None, "NVIDIA GeForce RTX 4090")[0].name == "rtx4090"
    m, why = machine("cuda", None, "Tesla V100-SXM2-32GB")
    assert m.name == "h100" and "has no profile" in why
    assert machine("cpu", None, "NVIDIA H100 80GB HBM3")[0].name == "cpu"
    exp = config.load(QLORA, ["strategy.hardware.gpu=a100", "strategy.hardware.network_gbs=12.5",
                              "strategy.hardware.tflops=100"])  # fmt: skip
    m, why = machine("cuda", exp.strategy.hardware, "NVIDIA H100 80GB HBM3")
    assert (m.name, m.network, m.flops, m.peers) == ("a100", 12.5e9, 100e12, 300e9)
    assert "strategy.hardware.gpu" in why and "network_gbs 12.5" in why
    slow = t(job, Levers(), Candidate(3), 16, m=m)
    fast = t(job, Levers(), Candidate(3), 16, m=PROFILES["a100"])
    assert slow.reductions == pytest.approx(2 * fast.reductions)  # half the network: twice the time


@pytest.mark.parametrize(
    "value, needle",
    [
        (
            "strategy.hardware.tflops=fast",
            "strategy.hardware.tflops: must be auto or TFLOP/s from 0.001 to 10,000; got 'fast'",
        ),
        (
            "strategy.hardware.network_gbs=0",
            "strategy.hardware.network_gbs: must be auto or GB/s from 0.001 to 10,000; got 0",
        ),
        ("strategy.hardware.cpu_adam=-1", "strategy.hardware.cpu_adam: must be auto or billions of"),
        (
            "strategy.hardware.host_gbs=",
            "strategy.hardware.host_gbs: must be auto or GB/s from 0.001 to 10,000; got None",
        ),
        ("strategy.hardware.gpu=v100", "strategy.hardware.gpu: must be one of: auto, h100, h200, a100, l40s"),
        ("strategy.hardware=fast", "strategy.hardware: must be a valid dictionary"),
        ("strategy.offload_params=maybe", "strategy.offload_params: must be one of: auto, true, false"),
    ],
)
def test_bad_hardware_and_offload_params_values_exit_2_naming_the_key(capsys, value, needle):
    assert main(["configs/experiments/tiny.yaml", "--set", value, "--print-config"]) == 2
    out = capsys.readouterr()
    text = out.err + out.out
    assert (
        text.startswith("error: configs/experiments/tiny.yaml: 1 problem found") and "Traceback" not in text
    )
    assert needle in text, text


@pytest.mark.parametrize(
    "key, value",
    [("tflops", ".inf"), ("peer_gbs", "-.inf"), ("network_gbs", ".nan"), ("host_gbs", "1.0e+300"),
     ("cpu_adam", "1.0e-300"), ("nvme_gbs", "1000000"), ("tflops", "0.0000001")],
)  # fmt: skip
def test_hardware_figures_out_of_range_exit_2_naming_the_key_value_and_range(capsys, key, value):
    """Review of issue 61, finding 5: an infinity (YAML's .inf) or an absurd figure had been taken, timing every
    setting at 0 s (or forever)."""
    assert (
        main(["configs/experiments/tiny.yaml", "--set", f"strategy.hardware.{key}={value}", "--print-config"])
        == 2
    )
    text = capsys.readouterr().err
    assert f"strategy.hardware.{key}: must be auto or" in text and "from 0.001 to 10,000" in text, text
    assert "got " in text and "Traceback" not in text, text


def test_hardware_figures_within_range_are_taken():
    from trainer import config

    hw = config.load("configs/experiments/tiny.yaml", ["strategy.hardware.tflops=0.001",
                                                       "strategy.hardware.nvme_gbs=10000"]).strategy.hardware  # fmt: skip
    assert (hw.tflops, hw.nvme_gbs) == (0.001, 10000.0)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["strategy.offload_params=true", "strategy.offload=none"], "true applies to ZeRO stage 3 with offload"),
        (["strategy.offload_params=false", "strategy.zero_stage=2"], "set strategy.offload_params: auto, or"),
        (["strategy.offload_params=false", "strategy.offload=nvme", "strategy.nvme_path=/nvme"],
         "false with offload nvme"),
    ],
)  # fmt: skip
def test_offload_params_that_contradicts_the_stage_or_offload_exits_2(capsys, sets, needle):
    args = ["configs/experiments/tiny.yaml"]
    for s in sets:
        args += ["--set", s]
    assert main([*args, "--print-config"]) == 2
    text = capsys.readouterr().err
    assert "strategy.offload_params: " in text and needle in text and "Traceback" not in text, text


def test_offload_at_stage_0_or_1_exits_2_naming_the_stages_it_runs_at(capsys):
    """Offload is a rung at stages 2 and 3 only: zero_stage 1 with offload cpu had been taken, then refused by the
    plan as 'nothing fits ... only NVMe offload fits the device' (no candidate matched the pin)."""
    for stage in (0, 1):
        args = [
            "configs/experiments/tiny.yaml",
            "--set",
            f"strategy.zero_stage={stage}",
            "--set",
            "strategy.offload=cpu",
        ]
        assert main([*args, "--print-config"]) == 2
        text = capsys.readouterr().err
        assert (
            "strategy.offload: offload cpu runs at ZeRO stage 2 or 3" in text
            and "set zero_stage to 2, 3" in text
        )
