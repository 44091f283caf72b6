"""Asynchronous saves, the parts below the launchers: the host copy is the state at the step boundary
(later changes to the live tensors do not reach it), shared tensors stay shared, the buffers are
reused from save to save; the writer thread reports done, or the error of a failed write."""

import collections
import time

import pytest
import torch

from trainer.checkpoint.writer import DONE, FAILED, WRITING, HostCopier, Writer
from trainer.common.faults import Faults


def state():
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = torch.zeros(10)
    return (
        {
            "module": collections.OrderedDict(weight=w, tied=w, view=flat[2:6]),
            "optimizer": {
                "state": {0: {"exp_avg": torch.ones(4), "step": torch.tensor(7.0)}},
                "groups": [{"lr": 1e-3}],
            },
            "shapes": (torch.Size([3, 4]),),
            "global_steps": 7,
        },
        w,
        flat,
    )


def test_the_copy_is_the_state_when_it_was_taken():
    copier = HostCopier()
    live, w, flat = state()
    snap = copier.copy(live)
    w.add_(100.0)  # the next optimizer step changes the live tensors ...
    flat.fill_(5.0)
    live["optimizer"]["state"][0]["exp_avg"].mul_(3)
    live["optimizer"]["groups"][0]["lr"] = 0.5  # ... and the scheduler its values
    assert torch.equal(snap["module"]["weight"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(snap["module"]["view"], torch.zeros(4))
    assert torch.equal(snap["optimizer"]["state"][0]["exp_avg"], torch.ones(4))
    assert snap["optimizer"]["groups"][0]["lr"] == 1e-3 and snap["global_steps"] == 7
    assert type(snap["module"]) is collections.OrderedDict and snap["shapes"] == (torch.Size([3, 4]),)
    assert snap["module"]["tied"] is snap["module"]["weight"], "tied weights stay one tensor in the file"
    assert copier.bytes == (12 + 4 + 4 + 1) * 4


def test_the_buffers_are_reused_from_save_to_save():
    copier = HostCopier()
    live, w, _ = state()
    first = copier.copy(live)["module"]["weight"]
    ptr = first.data_ptr()
    copier.release()  # the write is done
    w.add_(1.0)
    second = copier.copy(live)["module"]["weight"]
    assert second.data_ptr() == ptr, "the second save copies into the first save's buffer"
    assert torch.equal(second, w)


def test_the_writer_writes_every_file_and_reports_done(tmp_path):
    copier = HostCopier()
    live, _, _ = state()
    files = [(tmp_path / "a.pt", copier.copy(live)), (tmp_path / "b.pt", {"x": torch.ones(3)})]
    w = Writer(files, copier=copier, faults=Faults(spec=""), step=3)
    w.wait()
    assert w.status == DONE and w.error is None and w.bytes == sum(f.stat().st_size for f, _ in files)
    loaded = torch.load(tmp_path / "a.pt", weights_only=False)
    assert torch.equal(loaded["module"]["weight"], live["module"]["weight"])
    assert not w.files, "the host copy is dropped once written"


def test_a_failed_write_is_reported_not_raised(tmp_path):
    copier = HostCopier()
    w = Writer(
        [(tmp_path / "a.pt", {"x": torch.ones(3)})], copier=copier, faults=Faults(spec="failsave@3"), step=3
    )
    w.wait()
    assert w.status == FAILED and "No space left on device" in w.describe_error()
    missing = Writer(
        [(tmp_path / "no" / "such" / "dir.pt", {})], copier=copier, faults=Faults(spec=""), step=4
    )
    missing.wait()
    assert missing.status == FAILED and "FileNotFoundError" in missing.describe_error()


def test_the_status_is_writing_until_the_write_ends(tmp_path):
    w = Writer(
        [(tmp_path / "a.pt", {})], copier=HostCopier(), faults=Faults(spec="slowsave@1:ms=300"), step=1
    )
    assert w.status == WRITING
    t0 = time.perf_counter()
    w.wait(poll_s=0.05)
    assert w.status == DONE and time.perf_counter() - t0 >= 0.2


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), ("auto", "auto")])
def test_checkpoint_async_is_a_yaml_key(value, expected):
    from helpers import TINY

    from trainer import config

    exp = config.load(TINY, [f"checkpoint.async={value}"])
    assert exp.checkpoint.async_ == expected
    assert exp.to_dict()["checkpoint"]["async"] == expected  # experiment.yaml in every checkpoint


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("how", ["write_file", "writer", "recording"])
def test_the_digest_is_of_the_bytes_on_disk_whatever_the_serialization(tmp_path, zipfile, how):
    """DeepSpeed's checkpoint.checkpoint_serialization: false makes torch's legacy format write tensor
    data straight to the file descriptor, past a wrapper's write(): the digest must still be of what is
    on disk (issue 54, finding 1: every such checkpoint was "damaged" and none could be resumed)."""
    from trainer.checkpoint.writer import file_digest, recording_engine, write_file

    live, _, _ = state()
    big = {"w": torch.randn(300, 300), **live}  # large enough for the legacy writer's direct path
    path = tmp_path / "shard.pt"
    if how == "write_file":
        size, digest = write_file(path, big, zipfile)
    elif how == "writer":
        w = Writer([(path, big)], copier=HostCopier(), faults=Faults(spec=""), step=1, zipfile=zipfile)
        w.wait(poll_s=0.01)
        assert w.status == DONE, w.describe_error()
        size, digest = w.written[str(path)]
    else:
        record = {}

        class Base:
            zipfile_serialization = zipfile

        recording_engine(Base(), record).save(big, str(path))
        size, digest = record[str(path)]
    assert size == path.stat().st_size
    assert digest == file_digest(path)
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["w"], big["w"])
