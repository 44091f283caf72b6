"""Packing fine-tuning examples (trainer/data/pack.py: pack_examples): a packed row trains exactly
as its examples one by one (loss and gradients, token-weighted, fp32), for gpt2 and llama with sdpa
and eager attention, because the position ids restart at each example; without them the examples
attend to each other and the loss differs. And packing loses no token."""

import random

import numpy as np
import pytest
import torch

from trainer.data.chat import Example
from trainer.data.pack import IGNORE, pack_examples

VOCAB = 97


def model_for(family: str, attn: str):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                         eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    else:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                          eos_token_id=0)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float().train()


def examples(lengths, prompts, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(lengths, prompts, strict=True):
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        out.append(Example(ids, [False] * p + [True] * (n - p)))
    return out


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_packed_row_trains_as_its_examples_one_by_one(family, attn):
    exs = examples([7, 12, 9], [3, 8, 2])  # very different target counts: 4, 4, 7
    row = {k: torch.from_numpy(v.astype(np.int64)) for k, v in pack_examples(exs, 32, pad_id=0).items()}
    assert row["input_ids"].shape == (1, 32)

    model = model_for(family, attn)
    packed = model(**row, use_cache=False).loss
    packed.backward()
    g_packed = grads(model)

    model.zero_grad()
    total, count = 0.0, 0
    for ex in exs:  # token-weighted: the sum of each example's target losses over all targets
        labels = torch.tensor(
            [IGNORE] + [t if m else IGNORE for t, m in zip(ex.ids[1:], ex.targets[1:], strict=True)]
        )
        n = int((labels[1:] != IGNORE).sum())
        out = model(input_ids=torch.tensor([ex.ids]), labels=labels[None], use_cache=False)
        total = total + out.loss * n
        count += n
    alone = total / count
    alone.backward()
    g_alone = grads(model)

    assert count == 15 and int((row["labels"] != IGNORE).sum()) == 15  # first tokens are never targets
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)
    assert torch.allclose(g_packed, g_alone, rtol=1e-5, atol=1e-5 * g_alone.abs().max().item())

    # Without the per-example positions the examples attend to each other: another loss.
    with torch.no_grad():
        crossed = model(input_ids=row["input_ids"], labels=row["labels"], use_cache=False).loss
    assert abs(crossed.item() - alone.item()) > 1e-3 * alone.item()


def test_packing_loses_no_token_and_keeps_the_order():
    rnd = random.Random(0)
    lengths = [rnd.randint(1, 64) for _ in range(500)]
    exs = examples(lengths, [rnd.randint(0, n - 1) for n in lengths])
    rows = pack_examples(exs, 64, pad_id=0)
    ids, labels, pos = rows["input_ids"], rows["labels"], rows["position_ids"]
    # Cut every row at its position resets: the pieces are the examples, in order, then padding.
    pieces = []
    for r in range(len(ids)):
        starts = [i for i in range(64) if pos[r, i] == 0] + [64]
        pieces += [ids[r, a:b].tolist() for a, b in zip(starts, starts[1:], strict=False)]
    real = [p for p in pieces if any(p)]  # padding is all pad_id 0; example ids are >= 1
    assert real == [e.ids for e in exs], "every token of every example, once, in order"
    assert sum(len(p) for p in real) == sum(lengths)
    targets = sum(sum(e.targets[1:]) for e in exs)
    assert int((labels != IGNORE).sum()) == targets
    assert len(ids) <= sum(lengths) / 64 * 1.5  # greedy packing wastes little here
    with pytest.raises(ValueError, match="truncate it first"):
        pack_examples(examples([65], [1]), 64, pad_id=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_padded_last_text_block_trains_as_its_real_tokens(family):
    """Text packing keeps the corpus' last tokens in a padded block (pack.fill_blocks); a batch drawing
    it becomes rows (pack.as_rows) whose padding is neither input nor target: with the step's target
    count as num_items, the loss and gradients of [a full block, the padded one] equal the token-
    weighted ones of the full block and the real tokens alone."""
    from trainer.data.pack import as_rows

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(1, VOCAB, (2, 16), generator=g).numpy().astype(np.int32)
    blocks[1, 5:] = IGNORE  # 5 real tokens: 4 targets
    rows = torch.from_numpy(as_rows(blocks).astype(np.int64))
    assert (rows[:, 0] >= 0).all() and (rows[1, 1, 5:] == IGNORE).all()

    model = model_for(family, "sdpa")
    ids, labels, pos = rows[:, 0], rows[:, 1], rows[:, 2]
    model(
        input_ids=ids, labels=labels, position_ids=pos, use_cache=False, num_items_in_batch=15 + 4
    ).loss.backward()
    g_rows = grads(model)
    model.zero_grad()
    full = torch.from_numpy(blocks[:1].astype(np.int64))
    part = torch.from_numpy(blocks[1:, :5].astype(np.int64))
    ref = model(input_ids=full, labels=full).loss * 15 + model(input_ids=part, labels=part).loss * 4
    (ref / 19).backward()
    assert torch.allclose(g_rows, grads(model), rtol=1e-5, atol=1e-7)
    model.zero_grad()
    with torch.no_grad():
        got = model(
            input_ids=ids, labels=labels, position_ids=pos, use_cache=False, num_items_in_batch=19
        ).loss
    assert got.item() == pytest.approx(ref.item() / 19, rel=1e-6)
