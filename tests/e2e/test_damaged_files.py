"""Every damaged file of a checkpoint (issue 54): each file a checkpoint holds, damaged in place at the same
size and also truncated. A plain `--resume` falls back to the previous complete checkpoint naming the file;
`--resume PATH` stops with exit 2 naming it (checked on the damage in place, the harder to see). The digests are checked before anything else of the
checkpoint is read: a damaged experiment.yaml stopped a resume with a user error before the digest check
could fall back (finding 3), and a trainer_state.json damaged in place that still parsed was trusted.

One trained run directory (LoRA adapters at ZeRO-2, so that the checkpoint holds an adapter, model states
and optimizer states apart, RNG state, the metadata and the manifest; a checkpoint at every step) holds
every case at once: each damaged file in a checkpoint of its own (the newest ones), the oldest intact. One
plain `--resume` then walks down from the newest, naming each damaged file, and resumes the intact one;
`--resume PATH` is refused for each (the resolution the CLI runs, in this process; through the CLI for the
metadata it read first, finding 3). One process for every case instead of two a case.
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


# damage in place for every file; truncation (caught by the manifest's sizes, one check for every file) for a
# shard, the metadata read first and the manifest itself
CASES = [(n, "in place") for n in FILES] + [
    (n, "truncated") for n in (FILES[0], "experiment.yaml", "trainer_state.json")
]
STEPS = len(CASES) + 1  # the first checkpoint intact, then one damaged file a checkpoint


def tag(step):
    return f"step_{step:08d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("damaged") / "base"
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": STEPS, "checkpoint.every_steps": 1})
    assert code == 0, out[-3000:]
    held = {str(p.relative_to(run_dir / "checkpoints" / tag(STEPS)))
            for p in (run_dir / "checkpoints" / tag(STEPS)).rglob("*") if p.is_file()}  # fmt: skip
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


def test_each_damaged_file_is_named_and_the_newest_intact_checkpoint_resumed(trained, tmp_path):
    from trainer.checkpoint import resolve_resume
    from trainer.checkpoint.disk import verify_digests
    from trainer.common.errors import UserError

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    root = run_dir / "checkpoints"
    damaged = {}  # checkpoint -> its damaged file
    for step, case in enumerate(CASES, start=2):
        damage(root / tag(step) / case[0], case[1])
        damaged[root / tag(step)] = case
    for ckpt, (name, _) in damaged.items():  # --resume PATH: what the CLI checks before anything loads
        try:
            found, _ = resolve_resume(str(ckpt), "never", run_dir)  # the manifest, sizes, metadata digests
            problems = verify_digests(
                found
            )  # then every file's digest (checkpoint/policy.undamaged, every rank a share)
        except UserError as e:
            problems = [str(e)]
        assert any(str(ckpt / name) in p for p in problems), (name, problems)
    for name in ("experiment.yaml", FILES[0]):  # through the CLI: the metadata read first, and a shard
        path = root / tag(2 + CASES.index((name, "in place")))
        code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": STEPS + 1}, "--resume", path)
        assert code == 2 and "Traceback" not in out, out[-3000:]
        assert f"--resume {path}" in out and str(path / name) in out, out[-3000:]
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": STEPS + 1}, "--resume")
    assert code == 0, out[-3000:]
    for ckpt, (name, how) in damaged.items():
        assert str(ckpt / name) in out, f"{name} ({how}) in {ckpt.name} not named:\n{out[-4000:]}"
        print(f"{name:44} {how:9}: named, skipped")
    assert f"resumed from {root / tag(1)}" in out, out[-3000:]
    assert "rollback" not in out


@pytest.mark.parametrize("how", ["in place", "truncated"])
def test_a_damaged_latest_is_named_and_not_needed(trained, tmp_path, how):
    """`latest` is a cache of the journal (issue 59) that no decision reads: damaged, it changes nothing,
    and the start writes it again."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    damage(run_dir / "checkpoints" / "latest", how)
    code, out = cli({**SMALL, "run_dir": run_dir, "train.max_steps": STEPS + 1}, "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / tag(STEPS)}" in out and "rollback" not in out, out[
        -3000:
    ]
    assert (run_dir / "checkpoints" / "latest").read_text() == tag(STEPS + 1) + "\n"
