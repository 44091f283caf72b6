"""Preference training's pieces: the data (pairs kept together, the prompt shared, the checks), and
the objectives against TRL's DPOTrainer (TRL a test-only dependency) and their closed forms."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from trainer import config
from trainer.common.errors import UserError
from trainer.data import byte_tokenizer
from trainer.data.stream import _collate
from trainer.objectives import make
from trainer.objectives.pairs import response_logps

TINY = "configs/experiments/tiny.yaml"
PAIRS = [
    {
        "prompt": "Which section covers assert?\n",
        "chosen": 'The "assert" statement',
        "rejected": "Coroutines",
    },
    {
        "prompt": "Where do I read about yield?\n",
        "chosen": 'The "yield" statement',
        "rejected": "Literals and more",
    },
    {"prompt": "Name the section on pass.\n", "chosen": 'The "pass" statement', "rejected": "Slicings"},
    {"prompt": "Explain lambda.\n", "chosen": "Lambdas", "rejected": 'The "del" statement, at length'},
]


def exp_with(*sets):
    return config.load(
        TINY, ["data.train.kind=preference", "train.objective=dpo", "data.packing=false", *sets]
    )


def pair_rows(pairs=PAIRS, *sets):
    """Our cache's rows for `pairs` (plain text), through data/preference.py as training builds them."""
    import datasets

    from trainer.data.examples import build_rows

    exp = config.load(TINY, ["data.train.kind=preference", "train.objective=dpo", *sets])
    src = exp.data.train.model_copy(update={"files": None, "hub": "in-memory"})
    rows, stats = build_rows(datasets.Dataset.from_list(pairs), byte_tokenizer(), exp.data, src, "data.train")
    return rows, stats


def tiny_model(seed=0, layers=2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=257, n_positions=128, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=256, bos_token_id=256)  # fmt: skip
    return GPT2LMHeadModel(cfg).float()


def test_a_pair_is_two_rows_with_the_same_prompt_and_each_response_trained():
    rows, stats = pair_rows()
    assert rows.shape == (4, 2, 3, 128) and stats["kept"] == 4 and stats["kind"] == "preference"
    tok = byte_tokenizer()
    for (chosen, rejected), pair in zip(rows, PAIRS, strict=True):
        prompt = len(tok(pair["prompt"], add_special_tokens=False)["input_ids"])
        assert (chosen[0, :prompt] == rejected[0, :prompt]).all()  # the same prompt tokens
        for row, text in ((chosen, pair["chosen"]), (rejected, pair["rejected"])):
            targets = row[0][row[1] != -100].tolist()
            assert tok.decode(targets) == text + "<|endoftext|>"  # the response and its end, nothing else


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "q", "chosen": "a", "rejected": "  "}, "rejected is empty"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "chosen is empty"),
        ({"chosen": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]},
         "the pair's prompts do not match"),
        ({"prompt": [{"role": "user", "content": "q1"}],
          "chosen": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "the pair's prompts do not match"),
        # the same system prompt, then different questions: the shared prefix is no prompt of both
        ({"chosen": [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2+2?"},
                     {"role": "assistant", "content": "4"}],
          "rejected": [{"role": "system", "content": "S"}, {"role": "user", "content": "Name a colour"},
                       {"role": "assistant", "content": "Red"}]},
         "share their first 1 message.*chosen goes on with a user turn .message 1.*answer different prompts"),
        ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "q"}]}, "then rejected ends"),
    ],
)  # fmt: skip
def test_bad_pairs_are_refused_naming_the_row_and_the_key(row, says):
    with pytest.raises(UserError, match=says) as e:
        pair_rows([row])
    assert "row 0" in str(e.value)


def test_an_implicit_prompt_is_the_conversations_shared_beginning():
    from trainer.data.preference import split_pair

    src = exp_with().data.train
    q = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    prompt, chosen, rejected = split_pair(
        {"chosen": [*q, {"role": "assistant", "content": "a"}], "rejected": [*q, {"role": "assistant", "content": "b"}]},
        src, "here",
    )  # fmt: skip
    assert prompt == q and chosen == [{"role": "assistant", "content": "a"}]


def ours(objective, model, rows, ref_table):
    """Our loss and rewards of one micro batch of every pair in `rows` (gradients in `model`)."""
    batch = _collate((rows, np.arange(len(rows))), 1)
    objective.reference = {"train": ref_table}
    objective.sums = None
    loss = objective.loss(model, batch)
    loss.backward()
    stats = objective.flush(1)
    return loss.item(), stats


def reference_table(model, rows):
    batch = _collate((rows, np.arange(len(rows))), 1)
    with torch.no_grad():
        logps, _ = response_logps(model, batch.rows)
    m = len(rows)
    return torch.stack([logps[:m], logps[m:]], dim=1).double().numpy()


def trl_batch(rows):
    """TRL's collator's batch of the same tokens: prompt_ids + chosen_ids / rejected_ids."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = []
    for chosen, rejected in rows:
        first = int(np.argmax(chosen[1] != -100))  # the first target: the response starts there
        end_c = first + int((chosen[1] != -100).sum())
        end_r = first + int((rejected[1] != -100).sum())
        examples.append({"prompt_ids": chosen[0, :first].tolist(), "chosen_ids": chosen[0, first:end_c].tolist(),
                         "rejected_ids": rejected[0, first:end_r].tolist()})  # fmt: skip
    return DataCollatorForPreference(pad_token_id=256)(examples)


def trl_trainer(model, ref_model, tmp_path, beta, peft_config=None):
    import datasets
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), beta=beta, report_to=[], use_cpu=True, per_device_train_batch_size=4,
                     max_length=None, disable_dropout=True, bf16=False, fp16=False, gradient_checkpointing=False)  # fmt: skip
    data = datasets.Dataset.from_list(PAIRS)
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=data,
                      processing_class=byte_tokenizer(), peft_config=peft_config)  # fmt: skip


def test_dpo_loss_rewards_and_gradients_equal_trls(tmp_path):
    """One batch of 4 pairs, beta 0.3, a reference other than the policy (its own weights): the loss,
    the mean rewards, margin, accuracy and every gradient equal TRL's DPOTrainer's (fp32, 1e-6)."""
    pytest.importorskip("trl")
    rows, _ = pair_rows()
    policy, ref = tiny_model(0), tiny_model(1)
    table = reference_table(ref, rows)
    objective = make(exp_with("train.preference.beta=0.3"))
    mine = copy.deepcopy(policy)
    loss, stats = ours(objective, mine, rows, table)
    trainer = trl_trainer(policy, ref, tmp_path, 0.3)
    theirs = trainer.compute_loss(trainer.model, trl_batch(rows))
    theirs.backward()
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(loss - theirs.item()) <= 1e-6, (loss, theirs.item())
    assert abs(stats["rewards_chosen"] - m["rewards/chosen"]) <= 1e-6
    assert abs(stats["rewards_rejected"] - m["rewards/rejected"]) <= 1e-6
    assert abs(stats["reward_margin"] - m["rewards/margins"]) <= 1e-6
    assert stats["reward_accuracy"] == m["rewards/accuracies"]
    assert abs(stats["logps_chosen"] - m["logps/chosen"]) <= 1e-5 * abs(m["logps/chosen"])
    worst = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(mine.parameters(), trainer.model.parameters(), strict=True)
    )
    assert worst <= 1e-6, worst
    print(f"dpo vs TRL: loss {loss:.8f} vs {theirs.item():.8f}, worst gradient difference {worst:.2e}")


def test_lora_dpo_equals_trls_with_the_adapters_disabled_as_the_reference(tmp_path):
    """LoRA: the reference is the base (the adapters disabled; new adapters add nothing at the start),
    computed once by us, by TRL in each step; the adapters then made nonzero (as after some steps), so
    that policy and reference differ: the loss, the margin and the adapters' gradients equal TRL's."""
    pytest.importorskip("trl")
    from peft import LoraConfig

    rows, _ = pair_rows()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = trl_trainer(tiny_model(0), None, tmp_path, 0.2, peft_config=lora)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    with trainer.model.disable_adapter():
        table = reference_table(trainer.model, rows)
    model = trainer.model
    model.base_model.model.gradient_checkpointing_disable()  # the same arithmetic on both sides
    lora = [p for p in model.parameters() if p.requires_grad]
    objective = make(exp_with("train.preference.beta=0.2"))
    loss, stats = ours(objective, model, rows, table)
    mine = [p.grad.clone() for p in lora]
    model.zero_grad(set_to_none=True)
    theirs = trainer.compute_loss(model, trl_batch(rows))
    theirs.backward()
    assert abs(loss - theirs.item()) <= 1e-6 and abs(loss - 0.6931472) > 1e-3, (loss, theirs.item())
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(stats["reward_margin"] - m["rewards/margins"]) <= 1e-6
    assert len(lora) == 4  # A and B of 2 layers
    worst = max((a - b.grad).abs().max().item() for a, b in zip(mine, lora, strict=True))
    assert worst <= 1e-6, worst
    print(
        f"LoRA dpo vs TRL: loss {loss:.8f} vs {theirs.item():.8f}, worst adapter gradient difference {worst:.2e}"
    )


def test_the_objectives_closed_forms():
    """Each objective's loss and rewards of one pair by hand: the formulas of the papers (IPO as TRL
    normalises it)."""
    import math

    c, r, nc, nr = torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([4.0]), torch.tensor([5.0])
    ref = torch.tensor([[-3.5, -4.5]])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    cases = {
        "dpo": (-math.log(sig(0.1 * (0.5 + 0.5))), 0.05, -0.05),
        "ipo": ((0.5 / 4 + 0.5 / 5 - 1 / (2 * 0.1)) ** 2, 0.05, -0.05),
        "simpo": (-math.log(sig(2.0 * (-3 / 4 + 5 / 5) - 0.5)), 2.0 * -3 / 4, 2.0 * -5 / 5),
    }
    ac, ar = -3 / 4, -5 / 5
    odds = (ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))
    cases["orpo"] = (-ac - 0.1 * math.log(sig(odds)), 0.1 * ac, 0.1 * ar)
    for name, (loss, rc, rr) in cases.items():
        o = make(exp_with(f"train.objective={name}"))
        got = o.pair_losses(c, r, nc, nr, ref if o.needs_reference else None)
        assert all(
            math.isclose(float(x), y, rel_tol=1e-6, abs_tol=1e-7)
            for x, y in zip(got, (loss, rc, rr), strict=True)
        ), name
    smooth = make(exp_with("train.preference.label_smoothing=0.2"))
    d = 0.1 * 1.0
    want = -0.8 * math.log(sig(d)) - 0.2 * math.log(sig(-d))
    assert abs(float(smooth.pair_losses(c, r, nc, nr, ref)[0]) - want) < 1e-6


def test_a_micro_batchs_loss_is_the_mean_of_its_pairs_however_the_batch_is_split():
    """The loss of 4 pairs equals the mean of the losses of 2 + 2 and of 1 + 1 + 1 + 1 (what DeepSpeed's
    mean over micro batches and ranks then gives: the split invariance at the heart of the 2-rank test)."""
    rows, _ = pair_rows()
    model, table = tiny_model(0), None
    table = reference_table(tiny_model(1), rows)
    o = make(exp_with())
    o.reference = {"train": table}
    whole = o.loss(model, _collate((rows, np.arange(4)), 1)).item()
    halves = [o.loss(model, _collate((rows[i : i + 2], np.arange(i, i + 2)), 1)).item() for i in (0, 2)]
    ones = [o.loss(model, _collate((rows[i : i + 1], np.arange(i, i + 1)), 1)).item() for i in range(4)]
    assert abs(whole - sum(halves) / 2) < 1e-6 and abs(whole - sum(ones) / 4) < 1e-6


def test_the_reference_is_keyed_by_the_weights_content_not_their_files_times(tmp_path):
    """A copy of model.pretrained elsewhere (another path, other times) keeps the reference's key, so a
    resume from it is not refused as "data changed"; the same file rewritten in place with other bytes
    of the same size changes it. Digests are computed once per file (cached by path, size and time)."""
    import os
    import shutil
    import types

    from trainer.objectives.reference import reference_key

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    data = types.SimpleNamespace(fingerprint={"train_digest": "d"}, eval=None)

    def key(path):
        exp = exp_with(
            f"model.pretrained={path}", "model.config=null", f"data.cache_dir={tmp_path / 'cache'}"
        )
        return reference_key(exp, data, "fp32", 0, 1)

    first = key(model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy, copy_function=shutil.copy)  # new times
    assert key(copy) == first
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 4  # two files in each directory
    weights = copy / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(bytes(64 * 256))  # zeros: the same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert key(copy) != first


def test_two_nodes_writing_the_reference_table_to_a_shared_cache_never_share_a_temporary_file(
    tmp_path, monkeypatch
):
    """Every node's first rank writes the same table into a shared cache_dir; containers give those
    processes the same pid, so the temporary file is named by host and pid: two writers of one pid
    on two hosts, racing, always leave a whole table (a shared name lost one's file mid-write)."""
    import socket
    import threading

    from trainer.objectives import reference

    local = threading.local()
    monkeypatch.setattr(socket, "gethostname", lambda: getattr(local, "host", "main"))
    monkeypatch.setattr(reference.os, "getpid", lambda: 4242)
    path = tmp_path / "reference" / "key.npz"
    table = {"train": np.arange(20000, dtype=np.float64).reshape(-1, 2)}
    errors = []

    def node(name):
        local.host = name
        try:
            for _ in range(30):
                reference.write_table(path, table)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=node, args=(f"node-{i}",)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    with np.load(path) as saved:
        assert np.array_equal(saved["train"], table["train"])


def test_chat_pairs_targets_are_trls_completion_mask():
    """Chat pairs with Qwen3's published tokenizer: our rows are TRL's DPOTrainer._prepare_dataset tokens, and the
    targets are TRL's completion mask, every token after the prompt (the newline after <|im_end|> too: left out
    before, so a chat response's log-prob differed from TRL's by that token's)."""
    pytest.importorskip("trl")
    import types

    import datasets
    from helpers import tokenizer_dir
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DPOTrainer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
    pairs = [{"prompt": [{"role": "user", "content": p["prompt"].strip()}],
              "chosen": [{"role": "assistant", "content": p["chosen"]}],
              "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in PAIRS]  # fmt: skip
    from trainer.data.examples import build_rows

    exp = config.load(TINY, ["data.train.kind=preference", "train.objective=dpo"])
    src = exp.data.train.model_copy(update={"files": None, "hub": "in-memory"})
    rows, _ = build_rows(datasets.Dataset.from_list(pairs), tok, exp.data, src, "data.train")
    t = DPOTrainer.__new__(DPOTrainer)
    t._tokenizer = tok
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    theirs = list(t._prepare_dataset(datasets.Dataset.from_list(pairs), tok, args, "train"))
    for pair, th in zip(rows, theirs, strict=True):
        for side, key in zip(pair, ("chosen_ids", "rejected_ids"), strict=True):
            first = int(np.argmax(side[1] != -100))
            real = int((side[2, 1:] != 0).argmin()) + 1 if (side[2, 1:] == 0).any() else side.shape[1]
            assert side[0, :real].tolist() == th["prompt_ids"] + th[key] and first == len(th["prompt_ids"])
            assert int((side[1] != -100).sum()) == len(th[key])
