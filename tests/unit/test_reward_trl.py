"""train.objective reward (issue 74 item 1) against TRL 1.16's RewardTrainer, its code called, never copied: the
loss and every parameter's gradient equal `compute_loss`'s on the same pairs (TRL's own tokenization of chat and
text pairs with Qwen3's published tokenizer, its collator's right padding) at its defaults, with a margin column,
with center_rewards_coefficient, and with both; our data pipeline renders each response as TRL tokenizes it, and
reads its score at the same token; the metrics are TRL's accuracy and margin. fp64."""

import collections
import functools
import json
import types

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

from helpers import tokenizer_dir  # noqa: E402

from trainer.config.schema import RewardSection  # noqa: E402
from trainer.data.pack import IGNORE  # noqa: E402
from trainer.data.stream import Pairs  # noqa: E402
from trainer.model.score import pad_of  # noqa: E402
from trainer.objectives.reward import Reward  # noqa: E402

CHAT = [
    {"prompt": [{"role": "user", "content": "Name the section on loops."}],
     "chosen": [{"role": "assistant", "content": "The for statement"}],
     "rejected": [{"role": "assistant", "content": "Class definitions, in some detail"}], "margin": 0.5},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And on errors?"}],
     "chosen": [{"role": "assistant", "content": "Exceptions"}],
     "rejected": [{"role": "assistant", "content": "Modules"}], "margin": -0.25},
    {"prompt": [{"role": "user", "content": "Which section covers imports?"}],
     "chosen": [{"role": "assistant", "content": "The import system"}],
     "rejected": [{"role": "assistant", "content": "Lexical analysis"}], "margin": 1.5},
]  # fmt: skip
TEXT = [{"prompt": "Q: loops? A:", "chosen": " for", "rejected": " class", "margin": 0.5},
        {"prompt": "Q: errors? A:", "chosen": " exceptions", "rejected": " modules and packages", "margin": 0.0}]  # fmt: skip


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))


def model(tok):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=len(tok),
                               num_labels=1, pad_token_id=pad_of(tok))  # fmt: skip
    m = AutoModelForSequenceClassification.from_config(cfg).double()
    with torch.no_grad():
        m.score.weight.normal_(
            0, 1.0
        )  # (TRL's head starts as small as ours: rewards apart, a loss of some size)
    return m


@functools.cache
def tokenized(data):
    return trl_ids(CHAT if data == "chat" else TEXT, tokenizer())


def trl_ids(rows, tok):
    """TRL's tokenization of each pair (RewardTrainer._prepare_dataset's, its code called)."""
    from trl.trainer.reward_trainer import RewardTrainer

    t = RewardTrainer.__new__(RewardTrainer)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None)
    import datasets

    ds = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "margin"} for r in rows])
    out = t._prepare_dataset(ds, tok, args, "train")
    return [(r["chosen_ids"], r["rejected_ids"]) for r in out]


def trl_loss(m, ids, pad, margins=None, center=None):
    from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

    t = RewardTrainer.__new__(RewardTrainer)
    t.args = types.SimpleNamespace(center_rewards_coefficient=center)
    t.model = m
    acc = types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
    t.accelerator = acc
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t._total_train_tokens, t._tp_size = 0, 1
    examples = [{"chosen_ids": c, "rejected_ids": r} | ({"margin": g} if margins is not None else {})
                for (c, r), g in zip(ids, margins if margins is not None else [0] * len(ids), strict=True)]  # fmt: skip
    inputs = DataCollatorForPreference(pad_token_id=pad)(examples)
    if margins is not None:
        inputs["margin"] = inputs["margin"].double()
    return RewardTrainer.compute_loss(t, m, inputs), t._metrics["train"]


def our_rows(ids, pad, width):
    """The pairs as our rows: [input_ids, labels, position_ids], padding after a response with its positions
    restarting at 0 (pack.pack_examples), chosen rows then rejected."""
    seqs = [c for c, _ in ids] + [r for _, r in ids]
    rows = torch.full((len(seqs), 3, width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        rows[i, 0] = pad
        rows[i, 0, : len(s)] = torch.tensor(s)
        rows[i, 2, : len(s)] = torch.arange(len(s))
        rows[i, 2, len(s) :] = torch.arange(width - len(s))
    return rows


@pytest.mark.parametrize("data", ["chat", "text"])
@pytest.mark.parametrize("margin,center", [(False, None), (True, None), (False, 0.01), (True, 0.01)])
def test_the_loss_and_its_gradient_are_reward_trainer_s(data, margin, center):
    tok = tokenizer()
    rows = CHAT if data == "chat" else TEXT
    ids = tokenized(data)
    pad = pad_of(tok)
    m = model(tok)
    margins = [r["margin"] for r in rows] if margin else None
    theirs, metrics = trl_loss(m, ids, pad, margins, center)
    g_theirs = torch.autograd.grad(theirs, list(m.parameters()))
    ours_obj = Reward(RewardSection(center_rewards_coefficient=center))
    ours_obj.pad_id = pad
    if margin:
        ours_obj.margins["train"] = np.asarray(margins, dtype=np.float32)
    width = max(len(s) for pair in ids for s in pair) + 3  # (our rows are seq_len wide: padding beyond TRL's)
    batch = Pairs(our_rows(ids, pad, width), torch.arange(len(ids)))
    ours = ours_obj.loss(m, batch)
    g_ours = torch.autograd.grad(ours, list(m.parameters()))
    assert abs(float(theirs)) > 0.1
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6 if margin else 1e-12)  # (TRL's margins: fp32)
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-12), (a - b).abs().max()
    got = ours_obj.flush(1)
    assert got["reward_accuracy"] == pytest.approx(metrics["accuracy"][0], rel=1e-6)  # (TRL's: an fp32 mean)
    assert got["reward_margin"] == pytest.approx(metrics["margin"][0], rel=1e-9)
    assert "logps_chosen" not in got


@pytest.mark.parametrize("data", ["chat", "text"])
def test_our_data_renders_each_response_as_trl_tokenizes_it(data, tmp_path):
    """The rows our preference data makes for the pairs (data.train kind preference) hold TRL's token ids, each row
    up to its padding: the same text, and so the same last token for the score."""
    from trainer.config import DataSection
    from trainer.data import build

    rows = CHAT if data == "chat" else TEXT
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = DataSection(train={"files": str(path), "kind": "preference"}, tokenizer=str(tokenizer_dir("qwen3")),
                          seq_len=64, eval_fraction=0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    d = build(section, seed=0)
    from trainer.objectives.reward import real_lengths

    got = torch.from_numpy(np.asarray(d.train, dtype=np.int64))  # (pairs, 2, 3, seq_len)
    for (c, r), pair in zip(tokenized(data), got, strict=True):
        n = real_lengths(pair)
        assert [pair[0, 0, : n[0]].tolist(), pair[1, 0, : n[1]].tolist()] == [c, r]
    assert np.allclose(d.margins, [r["margin"] for r in rows])


def test_a_micro_batch_scores_each_response_at_its_own_last_token_as_the_model_alone_does(tmp_path):
    """Rows of a micro batch are cut to their longest (stream._collate): a response's tail after its targets
    (Qwen3's template's newline after <|im_end|>) is kept for every row, so each row's score in the batch is the
    model's score of that response's tokens alone (what the export gives GRPO's `function: model`). The cut at the
    last target dropped the longest row's tail: its score was read at <|im_end|>, the others' at the newline."""
    from trainer.config import DataSection
    from trainer.data import build
    from trainer.data.stream import _collate
    from trainer.objectives.reward import real_lengths

    tok = tokenizer()
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    section = DataSection(train={"files": str(path), "kind": "preference"}, tokenizer=str(tokenizer_dir("qwen3")),
                          seq_len=64, eval_fraction=0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    d = build(section, seed=0)
    batch = _collate((np.asarray(d.train), np.arange(len(CHAT))))
    m = model(tok)
    obj = Reward(RewardSection())
    obj.pad_id = pad_of(tok)
    with torch.no_grad():
        together = obj.scores(m, batch.rows)
        lengths = real_lengths(batch.rows)
        alone = [
            float(m(input_ids=row[0, :n].unsqueeze(0)).logits[0, 0])
            for row, n in zip(batch.rows, lengths, strict=True)
        ]
    assert tok.decode(batch.rows[int(lengths.argmax()), 0, int(lengths.max()) - 1]) == "\n"
    assert torch.allclose(together, torch.tensor(alone, dtype=together.dtype), rtol=1e-9, atol=1e-12)
