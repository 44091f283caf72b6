"""The supervisor's inputs: hostfiles are checked before anything starts; launcher commands."""

import pytest

from trainer.common.errors import UserError
from trainer.run.supervisor import Supervisor, read_hostfile


def test_a_good_hostfile(tmp_path):
    p = tmp_path / "hostfile"
    p.write_text("# two nodes\nnode-a slots=8\n\nnode-b slots=8  # the second\n")
    assert read_hostfile(str(p)) == [("node-a", 8), ("node-b", 8)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node-a slots=8\nnode-a slots=8\n", "line 2: host 'node-a' is already named on line 1"),
        ("node-a 8\n", "line 1: 'node-a 8' is not '<host> slots=<N>'"),
        ("node-a slots=0\n", "with N >= 1"),
        ("node-a slots=two\n", "is not '<host> slots=<N>'"),
        ("# nothing\n", "it names no host"),
    ],
)
def test_bad_hostfiles(tmp_path, text, message):
    p = tmp_path / "hostfile"
    p.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_hostfile(str(p))


def test_a_missing_hostfile_is_an_error_not_a_local_run(tmp_path):
    with pytest.raises(UserError, match="does not exist.*would only warn and train on this machine alone"):
        read_hostfile(str(tmp_path / "nope"))


def test_commands(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("10.0.0.1 slots=4\n10.0.0.2 slots=4\n")
    s = Supervisor("exp.yaml", ["train.max_steps=5"], tmp_path, launcher="deepspeed", hostfile=str(hf))
    cmd = s.command(s.overrides, "latest", 29555)
    assert cmd[1:7] == ["--hostfile", str(hf), "--master_addr", "10.0.0.1", "--master_port", "29555"]
    assert cmd[-3:] == ["--set", "train.max_steps=5", "--resume"]
    t = Supervisor("exp.yaml", [], tmp_path, launcher="torchrun", nproc_per_node=4).command([], None, 1234)
    assert t[1:5] == ["--nproc_per_node", "4", "--master_port", "1234"] and "--resume" not in t


def test_the_launcher_is_found_beside_the_interpreter_or_run_as_a_module(tmp_path, monkeypatch):
    import importlib.util
    import sys

    from trainer.run.supervisor import launcher_program

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text("")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    assert launcher_program("torchrun", "torch.distributed.run") == [str(bindir / "torchrun")]
    assert launcher_program("deepspeed", "deepspeed.launcher.runner") == [
        str(bindir / "python"), "-m", "deepspeed.launcher.runner"
    ]  # fmt: skip
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # a Python without torch
    with pytest.raises(UserError, match="source .venv/bin/activate"):
        launcher_program("deepspeed", "deepspeed.launcher.runner")
