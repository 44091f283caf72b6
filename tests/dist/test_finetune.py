"""Fine-tuning data through bin/train: chat rows, masked to the assistant turns, packed with
per-example positions. A step's loss is the mean over every target token of the step, however the
global batch is split into micro batches, accumulation and ranks (and with the chunked loss)."""

import pytest
from helpers import chat_data, split_losses, train

pytestmark = pytest.mark.dist

NO_DROPOUT = {f"model.config.{k}": 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}


def sft_sets(data, **kw):
    return {
        "data.train.files": str(data),
        "data.train.kind": "chat",
        "data.eval_fraction": 0,
        "data.num_workers": 0,
        "model.config.n_layer": 2,
        "train.max_steps": 6,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.eval_prompts": [],
        "checkpoint.save_final": False,
        **NO_DROPOUT,
        **kw,
    }


def test_the_step_loss_does_not_depend_on_how_the_batch_is_split(tmp_path):
    """4 packed rows per step (their target counts differ): micro 4 x 1 rank, micro 1 x accumulation
    4, micro 2 x 2 ranks (torchrun) log the same losses at every step (1e-6 relative): the
    same updates, as each step's loss depends on the weights the steps before left; and the same
    with model.chunked_loss. Without the normalization, a mean of per-micro-batch means, micro 1 x 4
    differs from micro 4 x 1 from the first step (see the closing note of issue 18)."""
    data = chat_data(tmp_path / "chat.jsonl")

    def counted(r):
        assert "fine-tuning data (chat): 400 of 400 examples" in r.output

    ref = split_losses(tmp_path, lambda split: sft_sets(data, **split), check=counted)["micro4"]
    assert sorted(ref) == list(range(1, 7)) and ref[6] < ref[1]
    chunked = split_losses(tmp_path / "chunked", lambda split: sft_sets(data, **split, **{"model.chunked_loss": True}),
                           names=("micro4", "accum4"))  # fmt: skip
    for step, value in chunked["micro4"].items():
        assert value == pytest.approx(ref[step], rel=1e-5), step  # the chunked loss is the same loss


def test_chat_fine_tuning_learns_the_answers_and_to_stop(tmp_path):
    """One rank, tiny's model on the chat additions: the banner counts the examples and shows one
    with its targets marked, the eval loss (answer tokens only) falls, and at the end the greedy
    completions of the eval prompts, rendered as user turns, end with the end-of-turn token."""
    data = chat_data(tmp_path / "chat.jsonl")
    sets = {**sft_sets(data, **{"model.config.n_layer": 4}), "train.max_steps": 200, "train.log_every": 50,
            "train.eval_every": 100, "data.eval_fraction": 0.05, "train.eval_batches": 4,
            "train.eval_prompts": ["12+30?", "What is 7 plus 5?"]}  # fmt: skip
    r = train(tmp_path, sets, debug=False)
    assert "fine-tuning data (chat): 400 of 400 examples in 400 sequences (0 truncated" in r.output
    assert "target tokens 7,614 = 27.2% of 28,027" in r.output, r.output[-3000:]
    assert (
        "example (targets in [[ ]]): <|user|>\\nWhat is 24 plus 48?\\n<|assistant|>\\n"
        "[[24 plus 48 is 72, as 48 plus 24 is.<|endoftext|>]]\\n" in r.output
    )
    evals, first = r.eval_losses, r.losses[50]
    assert evals[200] < evals[100] < 0.5 * first, (first, evals)
    samples = [m for m in r.metrics if "samples" in m][-1]["samples"]
    assert samples[0]["prompt"] == "<|user|>\n12+30?\n<|assistant|>\n" and any(s["ended"] for s in samples), samples


def test_prompt_completion_data_and_truncation_are_counted(tmp_path):
    """prompt_completion rows: the loss on the completions; rows longer than seq_len truncated (or
    dropped with data.truncation: drop), and a row whose answer does not fit is dropped, counted."""
    import json

    rows = [{"prompt": f"Q{i}: " + "x" * (10 if i % 10 else 60), "completion": " yes" * (1 + i % 3)} for i in range(100)]
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    sets = sft_sets(path, **{"data.train.kind": "prompt_completion", "data.seq_len": 64, "train.max_steps": 2})
    r = train(tmp_path / "right", sets, debug=False)
    # 10 rows have a 64-character prompt: cut at 64 tokens, nothing of their answer is left
    assert "fine-tuning data (prompt_completion): 90 of 100 examples" in r.output, r.output[-3000:]
    assert "(0 truncated, 0 too long dropped, 10 with no target left dropped)" not in r.output
    assert "(10 truncated, 0 too long dropped, 10 with no target left dropped)" in r.output
    d = train(tmp_path / "drop", {**sets, "data.truncation": "drop"}, debug=False)
    assert "(0 truncated, 10 too long dropped, 0 with no target left dropped)" in d.output


# Two of the six precision x stage pairs: what this test adds (the mixture's and the packer's position
# mid-epoch, the masks, the per-source token counts) is the data side, the same at every stage; the
# engine's own exact resume at every stage in both precisions is test_stages.py::test_stop_and_resume_is_exact
# and test_bf16_stages.py::test_bf16_stop_and_resume_is_exact. bf16 at ZeRO-2 is the usual fine-tune.
@pytest.mark.parametrize(("precision", "stage"), [("bf16", 2), ("fp32", 3)], ids=["bf16-2", "fp32-3"])
def test_a_packed_chat_mixture_resumes_bit_for_bit_mid_epoch_on_two_ranks(tmp_path, stage, precision):
    """2 ranks (torchrun), a two-source chat mixture (weights 3:1), packed: run A to step 12
    with a checkpoint at 6; run B resumes from it (mid-epoch) and logs A's losses bit for bit, ends
    with A's weights and reports the same tokens per source; the sources' shares follow the weights."""
    import json

    first = chat_data(tmp_path / "a.jsonl", rows=160)
    second = tmp_path / "b.jsonl"  # the second source: the same conversations with other numbers
    second.write_text(first.read_text().replace("plus", "and"))
    mixture = json.dumps([{"files": str(first), "kind": "chat", "weight": 3}, {"files": str(second), "kind": "chat"}])
    sets = sft_sets(first, **{"data.train": mixture, "strategy.zero_stage": stage, "train.precision": precision,
                              "train.max_steps": 12, "checkpoint.every_steps": 6, "checkpoint.keep_last": 0,
                              "train.micro_batch_size": 2, "train.grad_accum": 2, "optim.warmup_steps": 2})  # fmt: skip
    sets.pop("data.train.files"), sets.pop("data.train.kind")
    a = train(tmp_path / "a", sets, launcher="torchrun")
    assert max(a.losses[s] for s in (11, 12)) < min(a.losses[s] for s in (1, 2)), a.losses  # it trains
    assert "mixture: data.train[0]" in a.output and "(weight 3, " in a.output, a.output[-3000:]
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "step_00000006"
    b = train(tmp_path / "b", sets, launcher="torchrun", extra_args=["--resume", str(ckpt)])
    assert f"resumed from {ckpt} at step 6" in b.output
    assert {s: v for s, v in b.losses.items() if s > 6} == {s: v for s, v in a.losses.items() if s > 6}
    assert b.rank_reports()[0]["param_digest"] == a.rank_reports()[0]["param_digest"]
    last_a = [m for m in a.metrics if "tokens_by_source" in m][-1]["tokens_by_source"]
    last_b = [m for m in b.metrics if "tokens_by_source" in m][-1]["tokens_by_source"]
    assert last_a == last_b and sum(last_a.values()) == 12 * 8 * 128, last_a
    share = list(last_a.values())[0] / sum(last_a.values())
    assert abs(share - 0.75) < 0.1, last_a  # 96 sequences drawn: the weight's 75% up to sampling
