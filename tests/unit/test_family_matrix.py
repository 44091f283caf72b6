"""The family matrix, in one process (the two-rank half: tests/dist/test_family_matrix.py): a tiny model
of every family users bring (helpers.MATRIX: llama, mistral with a window, qwen2 with
use_sliding_window, qwen3, qwen3_moe, mixtral, gemma3_text with local and global layers, phi3, gpt2,
olmo2, gpt_oss, deepseek_v3), its special features on and windows shorter than the rows. Each shows,
or is refused with the measured reason:

- packed = one by one: the project's packing check (trainer/model/packing.py), the verdict data.packing
  follows: a packed row's loss and gradients against its examples alone;
- chunked loss = plain loss: model.chunked_loss's loss and every gradient against the model's own, on a
  packed row and a row of one example (fp32), or the refusal the run would give."""

import copy

import pytest
import torch
from helpers import MATRIX, matrix_config, matrix_rows
from transformers import AutoModelForCausalLM

from trainer.common.errors import UserError
from trainer.config import chunked_loss_problem
from trainer.engine import plain_loss
from trainer.model import loss, packing

# what the families cannot do here, with the reason measured (None: they can)
PACKING_REFUSED = {"gpt_oss": "does not train as its examples one by one"}  # its sinks: measured 7e-3 apart
ATTENTION = {"gpt_oss": "eager"}  # transformers has no sdpa path for its attention sinks


@pytest.mark.parametrize("model_type", list(MATRIX))
def test_packed_rows_train_as_their_examples_one_by_one_or_are_refused(model_type):
    v = packing.verdict(matrix_config(model_type), ATTENTION.get(model_type, "sdpa"))
    print(model_type, v["why"])
    if model_type in PACKING_REFUSED:
        assert not v["packs"] and PACKING_REFUSED[model_type] in v["why"], v
    else:
        assert v["packs"], v["why"]


@pytest.mark.parametrize("model_type", list(MATRIX))
def test_the_chunked_loss_is_the_models_own_or_is_refused(model_type):
    cfg = matrix_config(model_type)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=ATTENTION.get(model_type, "sdpa")
    ).float()
    chunked = copy.deepcopy(plain)
    problem = chunked_loss_problem(model_type, cfg)
    if problem is not None:
        with pytest.raises(UserError, match="model.chunked_loss"):
            loss.attach(chunked)
        print(model_type, "refused:", problem)
        return
    loss.attach(chunked)
    rows = matrix_rows()
    targets = float((rows[:, 1, 1:] != -100).sum())
    a, b = plain_loss(plain, rows, targets), plain_loss(chunked, rows, targets)
    a.backward()
    b.backward()
    worst = max(((p.grad - q.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(plain.parameters(), chunked.parameters(), strict=True) if p.grad is not None)  # fmt: skip
    print(f"{model_type}: loss {abs(a.item() - b.item()) / a.item():.1e}, gradients {worst:.1e} relative")
    assert b.item() == pytest.approx(a.item(), rel=1e-6) and worst <= 1e-5
