"""Host memory in the plan (review of issue 61, findings 3 and 4): an offload rung loads the model on the host as
the rung below it does, so it is never taken for a host that cannot hold that; and when nothing fits, the message
gives the host figure the fit was judged by (without the copy an asynchronous save takes, unless
checkpoint.async: true counts it) and the fix for the resource that blocks the job."""

import re
import shutil

import pytest

from trainer import config, model, strategy
from trainer.common.errors import UserError

GiB = 2**30
QLORA = "configs/experiments/llama3-8b-qlora.yaml"
B70_FULL = ("model.pretrained=configs/models/llama-3-70b", "model.lora=null", "train.global_batch_size=64")


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    cache = tmp_path_factory.mktemp("counts")  # bench/plan_matrix.py's counts, copied (none written back)
    shutil.copytree("bench/results/plan_matrix", cache, dirs_exist_ok=True)
    return str(cache)


def planned(counts, world, device, host, *sets):
    exp = config.load(QLORA, list(sets))
    info = model.info(exp.model, 257, 256, cache_dir=counts)
    return strategy.plan(exp, info, world_size=world, gpus_per_node=min(world, 8), device_type="cuda",
                         device_memory=device * GiB, host_memory=host * GiB, precision="bf16")  # fmt: skip


def refused(counts, *args) -> str:
    with pytest.raises(UserError) as e:
        planned(counts, *args)
    return str(e.value).splitlines()[0]


def test_an_offload_rung_is_never_chosen_for_a_host_that_cannot_load_the_model(counts):
    """LoRA of an 8B (bf16 base) on one 24 GB GPU with 40 GB of host memory: zero0 fits the device but not the
    host, which loads the 8B's weights first (45.65 GB a node); ZeRO-Offload (zero2+cpu) loads them the same way,
    but its host need had counted the adapters' optimizer states alone (1.48 GB), and it was taken."""
    p = planned(counts, 1, 24, 40, "model.lora.quantization=none")
    by = {e.candidate.name: e for e in p.estimates}
    assert by["zero2+cpu"].host >= by["zero2"].host and not by["zero2+cpu"].fits_host, p.table()
    assert p.candidate.name != "zero2+cpu" and p.estimate.fits_host, p.reason


def _host_figure(first: str) -> str:
    found = re.search(r"needs ([\d.]+ [KMGT]?B) (?:of host memory )?a node", first)
    assert found, first
    return found.group(1)


def test_the_host_figure_is_the_one_the_fit_was_judged_by(counts):
    """The 70B in full on one 80 GB GPU with 256 GB of host memory: host memory blocks it. Under checkpoint.async:
    auto the copy of a save is not counted in the fit (auto saves synchronously where it does not fit), yet the
    message had given the need with it (2.63 TB) and advised checkpoint.async: false, which changes nothing."""
    auto = refused(counts, 1, 80, 256, *B70_FULL)
    off = refused(counts, 1, 80, 256, *B70_FULL, "checkpoint.async=false")
    assert "host memory blocks it" in auto and _host_figure(auto) == _host_figure(off), (auto, off)
    assert "checkpoint.async" not in auto, auto
    on = refused(counts, 1, 80, 256, *B70_FULL, "checkpoint.async=true")  # the copy counts: said, and its fix
    assert _host_figure(on) != _host_figure(auto) and "checkpoint.async" in on, on


def test_the_fix_names_the_resource_that_blocks_it(counts):
    """On one 16 GB GPU at 8k the smallest setting misses the device by 0.4 GB and the host by 2 TB: the advice
    had been the device's alone (a smaller micro batch, the levers, NVMe offload, which needs the device memory
    of zero3+cpu), while no setting on the device fixes the host."""
    first = refused(counts, 1, 16, 256, *B70_FULL, "data.seq_len=8192")
    assert "device memory blocks it" in first and "host memory too" in first, first
    fix = first.split("To fit: ", 1)[1]
    assert "host memory" in fix and "nvme" not in fix.lower(), fix


def test_a_pinned_rung_that_misses_the_host_says_so(counts):
    """zero0 pinned for the 8B LoRA on 24 GB with 40 GB of host memory fits the device: the message had given its
    bytes per rank "against 21.60 GB usable" as if the device were short."""
    first = refused(counts, 1, 24, 40, "model.lora.quantization=none", "strategy.zero_stage=0")
    assert (
        "the pinned zero0 is predicted not to fit: it needs" in first and "of host memory a node" in first
    ), first
    assert "usable" not in first, first
