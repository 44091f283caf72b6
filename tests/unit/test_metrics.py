"""Metrics kept in memory stay bounded (metrics.jsonl and wandb keep the history)."""

from pathlib import Path

from trainer.metrics import HISTORY, Metrics


def metrics(tmp_path: Path, is_main: bool) -> Metrics:
    return Metrics(tmp_path, is_main=is_main, world_size=2, log_every=1, max_steps=10, samples_per_step=8,
                   tokens_per_step=1024, device=None, hosts=["a", "b"])  # fmt: skip


def test_the_in_memory_history_is_bounded_and_on_rank_0_only(tmp_path):
    main, other = metrics(tmp_path / "0", True), metrics(tmp_path / "1", False)
    for step in range(1, 10_001):
        for m in (main, other):
            m.record({"step": step, "loss": 1.0 / step})
    assert len(main.history) == HISTORY and not other.history
    assert main.recent()["step"] == 10_000
    assert len((tmp_path / "0" / "metrics.jsonl").read_text().splitlines()) == 10_000
    main.close()
