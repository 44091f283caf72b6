"""Every damaged file of a checkpoint (issue 54): each file a checkpoint holds, damaged in place at the same
size and also truncated. A plain `--resume` falls back to the previous complete checkpoint naming the file;
`--resume PATH` stops with exit 2 naming it (checked on the damage in place, the harder to see). The digests are checked before anything else of the
checkpoint is read: a damaged experiment.yaml stopped a resume with a user error before the digest check
could fall back (finding 3), and a trainer_state.json damaged in place that still parsed was trusted.

One trained run directory (LoRA adapters at ZeRO-2, so that the checkpoint holds an adapter, model states
and optimizer states apart, RNG state, the metadata and the manifest; checkpoints at steps 2 and 4) is
shared by every case; each case copies it and damages one file of step 4.
"""

import shutil

import pytest
from helpers import FAST, cli

pytestmark = pytest.mark.e2e

SMALL = {**FAST, "model.config.n_layer": 1, "data.eval_fraction": 0, "train.micro_batch_size": 2,
         "data.seq_len": 64, "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.save_final": True,
         "checkpoint.async": False, "strategy.zero_stage": 2,
         "model.lora": {"r": 4, "alpha": 8, "target_modules": ["c_attn"]}}  # fmt: skip

FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "rng_rank00000.pt",
    "adapter/adapter_model.safetensors",
    "adapter/adapter_config.json",
    "experiment.yaml",
    "ds_config.json",
    "trainer_state.json",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("damaged") / "base"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 4})
    assert code == 0, out[-3000:]
    held = {str(p.relative_to(run_dir / "checkpoints" / "step_00000004"))
            for p in (run_dir / "checkpoints" / "step_00000004").rglob("*") if p.is_file()}  # fmt: skip
    assert set(FILES) <= held, f"the checkpoint holds {sorted(held)}"
    return run_dir


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # in place, the same size: 16 bytes in the middle inverted
        mid = len(data) // 2
        data[mid : mid + 16] = bytes(255 - b for b in data[mid : mid + 16])
        path.write_bytes(bytes(data))


# damage in place for every file; truncation (caught by the manifest's sizes, one check for every file) for a
# shard, the metadata read first and the manifest itself
CASES = [(n, "in place") for n in FILES] + [
    (n, "truncated") for n in (FILES[0], "experiment.yaml", "trainer_state.json")
]


@pytest.mark.parametrize("name,how", CASES)
def test_a_damaged_file_is_named_and_the_previous_checkpoint_resumed(trained, tmp_path, name, how):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step4 = run_dir / "checkpoints" / "step_00000004"
    damage(step4 / name, how)
    if how == "in place":  # the explicit resume stops at the check, before training: once a file is enough
        code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 5}, "--resume", step4)
        assert code == 2 and "Traceback" not in out, out[-3000:]
        assert f"--resume {step4}" in out and str(step4 / name) in out, out[-3000:]
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 5}, "--resume")
    assert code == 0, out[-3000:]
    assert str(step4 / name) in out and "damaged" in out, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'}" in out, out[-3000:]
    assert "rollback" not in out
    print(f"{name:44} {how:9}: named, resumed from step_00000002")


@pytest.mark.parametrize("how", ["in place", "truncated"])
def test_a_damaged_latest_is_named_and_not_needed(trained, tmp_path, how):
    """`latest` is a pointer a plain resume does not need (it takes the newest complete checkpoint)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    damage(run_dir / "checkpoints" / "latest", how)
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": 5}, "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'}" in out, out[-3000:]
    if how == "in place":
        assert f"{run_dir / 'checkpoints' / 'latest'} is damaged" in out, out[-3000:]
