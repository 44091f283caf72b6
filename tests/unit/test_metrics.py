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


def test_flops_per_token_is_what_a_training_step_computes_with_and_without_frozen_weights():
    """MFU's FLOPs per token against torch's own count of a forward and backward (FlopCounterMode,
    eager attention so that its matmuls are counted too) on a 4-layer GPT-2, trained whole and with
    LoRA adapters on the frozen model. Whole: 6 N + 12 L H Q T (N without the position embedding, which is
    looked up, not multiplied). LoRA: the frozen weights get no gradient, so 4 N + 2 N_trainable + ...; 6 N
    would overstate a LoRA run's MFU by half. The formula counts, with LoRA, the first layer's gradient with
    respect to the embeddings (not computed: nothing below it trains): within 5% here, never under (every
    family: tests/unit/test_plan_census.py)."""
    import dataclasses

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainer import config, model
    from trainer.strategy import flops_per_token

    cfg = {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 64, "vocab_size": 64,
           **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0)}  # fmt: skip
    for lora in (None, {"r": 8}):
        section = config.ModelSection.model_validate(
            {"config": cfg, "attn_implementation": "eager", **({"lora": lora} if lora else {})}
        )
        m = model.build(section, vocab_size=None, eos_id=None, seq_len=32)
        info = model.info(section)
        x = torch.randint(0, 64, (2, 32))
        with FlopCounterMode(display=False) as counted:
            m(input_ids=x, labels=x).loss.backward()
        measured = counted.get_total_flops() / x.numel()
        formula = flops_per_token(info, 32)
        assert 0.95 <= measured / formula <= 1.0, (lora, measured, formula)
        if lora:
            assert (
                measured / flops_per_token(dataclasses.replace(info, trainable=None), 32) < 0.7
            )  # 6 N: far off
