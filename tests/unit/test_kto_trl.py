"""train.objective kto (issue 74 item 2) against TRL 1.16's KTOTrainer, its code called, never copied: our unpaired
rows and their mismatched pairs are the token sequences TRL's `_prepare_dataset` makes (plain text with the byte
tokenizer, chat with Qwen3's published one); the loss, the metrics and every parameter's gradient equal
`compute_loss`'s for both loss types, with class weights, against a reference other than the policy (1e-6); the
step's KL is the same however the step is cut into micro batches (KLStream); TRL's imbalance warning's bounds."""

import functools
import types

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

from helpers import tokenizer_dir  # noqa: E402

from trainer import config  # noqa: E402
from trainer.common.errors import UserError  # noqa: E402
from trainer.data import byte_tokenizer  # noqa: E402
from trainer.data.stream import _collate  # noqa: E402
from trainer.objectives import make  # noqa: E402
from trainer.objectives.kto import KLStream, imbalance  # noqa: E402
from trainer.objectives.pairs import response_logps  # noqa: E402

TEXT = [{"prompt": "Which section covers assert?\n", "completion": 'The "assert" statement', "label": True},
        {"prompt": "Where do I read about yield?\n", "completion": "Literals and more", "label": False},
        {"prompt": "Name the section on pass.\n", "completion": 'The "pass" statement', "label": True},
        {"prompt": "Explain lambda.\n", "completion": "Lambdas, at some length", "label": False}]  # fmt: skip
CHAT = [{"prompt": [{"role": "user", "content": r["prompt"].strip()}],
         "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]} for r in TEXT]  # fmt: skip


def experiment(*sets):
    return config.load(
        "configs/experiments/tiny.yaml", ["data.train.kind=unpaired", "train.objective=kto", *sets]
    )


def our_rows(data, tok, *sets):
    import datasets

    from trainer.data.examples import build_rows

    exp = experiment(*sets)
    src = exp.data.train.model_copy(update={"files": None, "hub": "in-memory"})
    return build_rows(datasets.Dataset.from_list(data), tok, exp.data, src, "data.train")


def trl_prepared(data, tok, batch=4):
    """TRL's tokenization of the rows and its mismatched completions (KTOTrainer._prepare_dataset, the whole data
    one batch of per_device_train_batch_size)."""
    import datasets
    from trl.trainer.kto_trainer import KTOTrainer

    t = KTOTrainer.__new__(KTOTrainer)
    t._tokenizer, t.calculate_KL, t.desirable_weight, t.undesirable_weight = tok, True, 1.0, 1.0
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=batch)
    return list(t._prepare_dataset(datasets.Dataset.from_list(data), tok, args, "train"))


def real(side):
    """A row's tokens before its padding (the padding's positions restart at 0)."""
    restart = np.flatnonzero(side[2, 1:] == 0)
    return side[0, : restart[0] + 1 if len(restart) else side.shape[1]].tolist()


@functools.cache
def qwen3():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))


def targets(side):
    return int((side[1] != -100).sum())


@pytest.mark.parametrize("data", ["text", "chat"])
def test_each_row_and_its_mismatched_pair_are_trls_tokens_and_completion_mask(data):
    """The tokens and, as targets, TRL's completion mask: every token after the prompt (chat: ChatML's newline after
    <|im_end|> too, which the review found left out)."""
    tok = byte_tokenizer() if data == "text" else qwen3()
    rows_in = TEXT if data == "text" else CHAT
    rows, stats = our_rows(rows_in, tok)
    theirs = trl_prepared(rows_in, tok)
    assert rows.shape[:2] == (4, 2) and stats["desirable"] == 2 and stats["kind"] == "unpaired"
    # the labels, stored where the pairs' margins are
    assert stats["margins"].tolist() == [1.0, 0.0, 1.0, 0.0]
    for ours, t in zip(rows, theirs, strict=True):
        assert real(ours[0]) == t["prompt_ids"] + t["completion_ids"]
        assert real(ours[1]) == t["prompt_ids"] + t["KL_completion_ids"]
        first = int(np.argmax(ours[0, 1] != -100))
        assert first == len(t["prompt_ids"]) and int(np.argmax(ours[1, 1] != -100)) == first
        assert (targets(ours[0]), targets(ours[1])) == (len(t["completion_ids"]), len(t["KL_completion_ids"]))


def test_a_truncated_rows_completion_makes_its_neighbours_pair_whole_then_cut_as_trls_collator():
    """seq_len 40: TRL's collator cuts prompt + the other row's whole completion at max_length; the review found the
    pair built from the other row's already-truncated completion (22 targets where TRL's has 49)."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    data = [
        dict(TEXT[0], completion="a long answer " * 6),
        TEXT[3],
        TEXT[1],
        TEXT[2],
    ]  # (row 1: a short prompt)
    tok = byte_tokenizer()
    rows, _ = our_rows(data, tok, "data.seq_len=40")
    theirs = DataCollatorForUnpairedPreference(pad_token_id=256, max_length=40)(trl_prepared(data, tok))
    for ours, ids, mask, kl_ids, kl_mask, attn, kl_attn in zip(rows, theirs["input_ids"], theirs["completion_mask"],
            theirs["KL_input_ids"], theirs["KL_completion_mask"], theirs["attention_mask"], theirs["KL_attention_mask"],
            strict=True):  # fmt: skip
        assert real(ours[0]) == ids[attn.bool()].tolist() and targets(ours[0]) == int(mask.sum())
        assert real(ours[1]) == kl_ids[kl_attn.bool()].tolist() and targets(ours[1]) == int(kl_mask.sum())
    assert targets(rows[1][1]) > targets(rows[0][0])  # the long completion, cut only by the pair's end


def test_preference_pairs_as_unpaired_rows_are_taken_apart_pair_by_pair():
    """kind unpaired over pairs (prompt, chosen, rejected): TRL's unpair_preference_dataset's rows, token for token,
    with their labels, but pair by pair (a held-out tail holds both classes: the review found an eval of rejected
    responses only, their chosen twins in training); and TRL's mismatched pairs, each row with the previous pair's
    response of its own side (the second review: every pair took a rejected response, chosen ones never)."""
    pairs = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": f"Not {r['completion']}"} for r in TEXT
    ]
    tok = byte_tokenizer()
    rows, stats = our_rows(pairs, tok)
    theirs = trl_prepared(pairs, tok, batch=8)
    assert stats["margins"].tolist() == [1.0, 0.0] * 4 and stats["examples"] == 8
    assert [t["label"] for t in theirs] == [True] * 4 + [False] * 4
    # our rows 2k, 2k + 1: TRL's k (chosen) and 4 + k (rejected), with TRL's mismatched pairs: the previous pair's
    # response of the same side (TRL's block wraps round from the other side's last: its first pair's differ)
    for k in range(4):
        for ours, t in ((rows[2 * k], theirs[k]), (rows[2 * k + 1], theirs[4 + k])):
            assert real(ours[0]) == t["prompt_ids"] + t["completion_ids"]
            if k:
                assert real(ours[1]) == t["prompt_ids"] + t["KL_completion_ids"]
    for side in (0, 1):  # the first pair's: its side's last
        assert (
            real(rows[side][1])[len(theirs[4 * side]["prompt_ids"]) :]
            == theirs[4 * side + 3]["completion_ids"]
        )


def test_the_mismatched_pairs_skip_a_run_of_one_prompt_in_one_pass():
    """Rows answering one prompt side by side take the completion of the nearest row before the run (the review: a
    search from each row was quadratic in a run's length, 13 s for 16k rows of one prompt)."""
    from trainer.data.unpaired import others

    assert others(["a", "b", "b", "b", "c"]) == [4, 0, 0, 0, 3]
    assert others(["a", "a", "b", "a"]) == [2, 2, 1, 2]  # (cyclic: the run wraps round the end)
    assert others(["a"] * 3) == [2, 0, 1]  # one prompt throughout: the previous row
    import time

    t = time.perf_counter()
    assert others(["x"] * 100_000 + ["y"])[:2] == [100_000, 100_000]
    assert time.perf_counter() - t < 5  # (linear: ~0.1 s; the quadratic search took hours at this size)


def step_start(objective, model, batches):
    """A KLStream over `batches` (one step's micro batches, this rank's) with the step begun: kto's KL over their
    pairs set (apo_zero_unpaired: none)."""
    it = iter(batches)
    stream = KLStream(types.SimpleNamespace(next=lambda: next(it), loss_denominator=lambda k: None,
                                            step_tokens=lambda k: None))  # fmt: skip
    stream.objective, stream.engine = objective, types.SimpleNamespace(ds=model, device="cpu")
    if objective.loss_type == "kto":
        stream.loss_denominator(len(batches))
    return stream


def tiny_model(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=257, n_positions=128, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=256, bos_token_id=256)  # fmt: skip
    return GPT2LMHeadModel(cfg).double()


def trl_trainer(policy, ref, tmp_path, peft_config=None, data=TEXT, tok=None, **kto):
    import datasets
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4,
                     max_length=None, disable_dropout=True, bf16=False, fp16=False, gradient_checkpointing=False,
                     **kto)  # fmt: skip
    return KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(data),
                      processing_class=tok or byte_tokenizer(), peft_config=peft_config)  # fmt: skip


def trl_batch(rows, labels, pad=256):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    examples = []
    for pair, label in zip(rows, labels, strict=True):
        first = int(np.argmax(pair[0, 1] != -100))
        mine, other = real(pair[0]), real(pair[1])
        examples.append({"prompt_ids": mine[:first], "completion_ids": mine[first:],
                         "KL_completion_ids": other[first:], "label": bool(label)})  # fmt: skip
    return DataCollatorForUnpairedPreference(pad_token_id=pad)(examples)


def reference_table(ref, rows):
    batch = _collate((rows, np.arange(len(rows))), 1)
    with torch.no_grad():
        logps, _ = response_logps(ref, batch.rows)
    m = len(rows)
    return np.stack([logps[:m].numpy(), logps[m:].numpy()], axis=1).astype(np.float64)


CASES = {
    "defaults": ([], {}),
    "weighted, beta 0.3": (["train.preference.beta=0.3", "train.kto.desirable_weight=1.5",
                            "train.kto.undesirable_weight=0.7"], {"beta": 0.3, "desirable_weight": 1.5,
                                                                  "undesirable_weight": 0.7}),
    "apo_zero_unpaired": (["train.kto.loss_type=apo_zero_unpaired", "train.preference.beta=0.2"],
                          {"loss_type": "apo_zero_unpaired", "beta": 0.2}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_metrics_and_gradients_equal_trls(case, tmp_path):
    """One batch of the 4 rows (2 desirable, 2 not) on one rank: TRL's KL over the batch's mismatched pairs is the
    step's; a reference with its own weights (the KL not clamped to 0 by accident: checked non-zero)."""
    sets, kto = CASES[case]
    rows, stats = our_rows(TEXT, byte_tokenizer())
    labels = stats["margins"]
    policy, ref = tiny_model(0), tiny_model(2)  # (seed 2: the pairs' mean log-ratio 0.16, not clamped to 0)
    objective = make(experiment(*sets))
    objective.reference = {"train": reference_table(ref, rows)}
    objective.labels = {"train": labels}
    import copy

    mine = copy.deepcopy(policy)
    stream = step_start(objective, mine, [_collate((rows, np.arange(len(rows))), 1)])
    loss = objective.loss(mine, stream.next())
    loss.backward()
    ours = objective.flush(1)
    trainer = trl_trainer(policy, ref, tmp_path, **kto)
    theirs = trainer.compute_loss(trainer.model, trl_batch(rows, labels))
    theirs.backward()
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(loss.item() - theirs.item()) <= 1e-6, (loss.item(), theirs.item())
    if objective.loss_type == "kto":
        assert m["kl"] > 1e-3 and abs(ours["kl"] - m["kl"]) <= 1e-6, (ours["kl"], m["kl"])
    else:
        assert "kl" not in ours and m["kl"] == 0
    for k in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert abs(ours[k.replace("/", "_").replace("margins", "reward_margin").replace("rewards_reward", "reward")]
                   - m[k]) <= 1e-5, k  # fmt: skip
    worst = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(mine.parameters(), trainer.model.parameters(), strict=True))  # fmt: skip
    assert worst <= 1e-6, worst
    print(
        f"kto {case} vs TRL: loss {loss.item():.10f} vs {theirs.item():.10f}, worst gradient difference {worst:.1e}"
    )


def qwen3_model(seed, vocab):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).double()


def test_chat_rows_loss_and_gradients_equal_trls(tmp_path):
    """Chat rows with Qwen3's published tokenizer and a tiny Qwen3: the loss, the KL and every gradient equal TRL's
    (the review: the newline after <|im_end|> outside our targets made the log-probs -119.1 against TRL's -131.1)."""
    tok = qwen3()
    rows, stats = our_rows(CHAT, tok)
    policy, ref = qwen3_model(0, len(tok)), qwen3_model(SEED_CHAT, len(tok))
    objective = make(experiment())
    objective.reference, objective.labels = {"train": reference_table(ref, rows)}, {"train": stats["margins"]}
    import copy

    mine = copy.deepcopy(policy)
    stream = step_start(objective, mine, [_collate((rows, np.arange(len(rows))), 1)])
    loss = objective.loss(mine, stream.next())
    loss.backward()
    trainer = trl_trainer(policy, ref, tmp_path, data=CHAT, tok=tok)
    theirs = trainer.compute_loss(trainer.model, trl_batch(rows, stats["margins"], tok.pad_token_id))
    theirs.backward()
    kl = trainer._metrics["train"]["kl"][-1]
    # (the KL a difference of log-probs near -130 in fp32 on both sides: to 1e-4)
    assert abs(loss.item() - theirs.item()) <= 1e-6 and kl > 1e-3 and abs(objective.kl - kl) <= 1e-4, (
        loss,
        kl,
    )
    worst = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(mine.parameters(), trainer.model.parameters(), strict=True))  # fmt: skip
    assert worst <= 1e-6, worst


SEED_CHAT = 1


def test_lora_kto_equals_trls_with_the_adapters_disabled_as_the_reference(tmp_path):
    """LoRA: the reference is the base (the adapters disabled), computed once by us for the rows and their pairs,
    by TRL in the step; the adapters made nonzero (as after some steps): the loss, the KL and the adapters'
    gradients equal TRL's."""
    from peft import LoraConfig

    rows, stats = our_rows(TEXT, byte_tokenizer())
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = trl_trainer(tiny_model(0), None, tmp_path, beta=0.5, peft_config=lora)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model = trainer.model
    with model.disable_adapter():
        table = reference_table(model, rows)
    model.base_model.model.gradient_checkpointing_disable()
    objective = make(experiment("train.preference.beta=0.5"))
    objective.reference, objective.labels = {"train": table}, {"train": stats["margins"]}
    stream = step_start(objective, model, [_collate((rows, np.arange(len(rows))), 1)])
    loss = objective.loss(model, stream.next())
    loss.backward()
    adapters = [p for p in model.parameters() if p.requires_grad]
    mine = [p.grad.clone() for p in adapters]
    model.zero_grad(set_to_none=True)
    theirs = trainer.compute_loss(model, trl_batch(rows, stats["margins"]))
    theirs.backward()
    kl = trainer._metrics["train"]["kl"][-1]
    assert abs(loss.item() - theirs.item()) <= 1e-6 and kl > 1e-3 and abs(objective.kl - kl) <= 1e-6, (
        loss,
        kl,
    )
    assert len(adapters) == 4
    worst = max((a - b.grad).abs().max().item() for a, b in zip(mine, adapters, strict=True))
    assert worst <= 1e-6, worst


def test_the_steps_kl_and_loss_do_not_depend_on_its_micro_batches():
    """4 rows as 1 micro batch of 4, 2 of 2 and 4 of 1 (DeepSpeed's mean over the micro steps): the KL, the loss and
    the gradients are one step's. TRL's per-micro-batch KL would differ (the printed figures)."""
    rows, stats = our_rows(TEXT, byte_tokenizer())
    ref = tiny_model(2)
    results = {}
    for micro in (4, 2, 1):
        policy = tiny_model(0)
        objective = make(experiment())
        objective.reference, objective.labels = (
            {"train": reference_table(ref, rows)},
            {"train": stats["margins"]},
        )
        batches = [_collate((rows[i : i + micro], np.arange(i, i + micro)), 1) for i in range(0, 4, micro)]
        stream = step_start(objective, policy, batches)
        total = 0.0
        for _ in batches:
            loss = objective.loss(policy, stream.next()) / len(batches)
            loss.backward()
            total += loss.item()
        own = [float(objective.pair_kl(policy, b)[0]) / b.pairs for b in batches]
        results[micro] = (
            objective.kl,
            total,
            torch.cat([p.grad.flatten() for p in policy.parameters()]),
            own,
        )
    for micro in (2, 1):
        assert results[micro][0] == pytest.approx(results[4][0], abs=1e-12)
        assert results[micro][1] == pytest.approx(results[4][1], abs=1e-6)  # (the log-probs in fp32)
        assert (results[micro][2] - results[4][2]).abs().max().item() <= 1e-6
    assert max(results[1][3]) - min(results[1][3]) > 1e-2  # each micro batch's own KL (TRL's) differs
    print("the step's KL", results[4][0], "; each row's own (TRL's at micro 1):", results[1][3])


def test_the_imbalance_warning_has_trls_bounds():
    """TRL's own figures for 3 desirable rows and 1 undesirable (its log line, read from _prepare_dataset):
    desirable_weight in [0.33, 0.44] or undesirable_weight in [2.26, 3.0]."""
    text = imbalance(3, 1, 1.0, 1.0)
    assert (
        "train.kto.desirable_weight in [0.33, 0.44]" in text and "undesirable_weight in [2.26, 3.0]" in text
    )
    assert (
        imbalance(3, 1, 0.4, 1.0) is None
        and imbalance(3, 1, 1.0, 2.5) is None
        and imbalance(2, 2, 1, 5) is None
    )
    # no desirable row: TRL counts one (max(sum, 1)) and the rest undesirable (the review: our bounds differed)
    assert imbalance(0, 2, 1.0, 1.0) is None and "desirable_weight in [2.0, 2.66]" in imbalance(
        0, 3, 1.0, 1.0
    )


def test_labels_as_numbers_one_and_zero_are_read_as_trls():
    """TRL takes the label column as bool tensors: 1.0 and 0.0 (a float column) are true and false here too."""
    rows = [dict(TEXT[0], label=1.0), dict(TEXT[1], label=0.0)]
    assert our_rows(rows, byte_tokenizer())[1]["margins"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": "Q\n", "completion": "A", "label": None}, "label: the row has no label"),
        ({"prompt": "Q\n", "completion": "A", "label": "yes"}, "label is 'yes'"),
        ({"prompt": "Q\n", "completion": "A", "label": 2}, "label is 2"),
        ({"prompt": "Q\n", "completion": "A", "label": 0.5}, "label is 0.5"),
        ({"prompt": "Q\n", "completion": "  ", "label": True}, "completion is empty"),
        ({"prompt": [{"role": "user", "content": "Q"}], "completion": "A", "label": True}, "both strings"),
    ],
)
def test_a_bad_row_is_refused_naming_its_place(row, says):
    with pytest.raises(UserError) as e:
        our_rows([row], byte_tokenizer())  # (alone: a column of one type, as a file of such rows)
    assert "data.train" in str(e.value) and says in str(e.value), str(e.value)
