"""GRPO's reward functions get what TRL's GRPOTrainer gives them, and score as there (issue 60), TRL's own
`_calculate_rewards` called beside ours on the same completions (tests/trl_ref.py): the keyword arguments
(prompts, completions as strings or one assistant message for chat prompts, completion_ids, trainer_state,
log_extra, log_metric, the columns); every function of `trl.rewards` by path (its factories called with the
options); async functions awaited together; numpy numbers, bools, None and NaN; a local reward model
(function: model) scores as TRL scores a sequence-classification model, batched, without gradients; the user's
modules import from the directories bin/train adds; and the built-in answer reward reads numbers as a table
says."""

import asyncio
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
import trl_ref  # noqa: E402

from trainer.common.errors import UserError  # noqa: E402
from trainer.rl import rewards as R  # noqa: E402

CHAT = [[{"role": "user", "content": "What is 1/3 of 1?"}], [{"role": "user", "content": "And 2 + 2?"}]]
TEXTS = [r"<think>a third</think> The answer is \boxed{\frac{1}{3}}", "<think>sum</think>4",
         "the the the the answer is 5", "<think>no end"]  # fmt: skip
IDS = [[5, 6, 7, 1], [8, 1], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22]]
SOLUTIONS = [r"$\frac{1}{3}$", "$4$", "$4$", r"$\frac{1}{3}$"]


def batch(chat=True, **columns):
    prompts = [CHAT[0], CHAT[1], CHAT[1], CHAT[0]] if chat else ["What is 1/3 of 1?", "And 2 + 2?"] * 2
    given = [[{"role": "assistant", "content": t}] for t in TEXTS] if chat else list(TEXTS)
    cols = {"solution": SOLUTIONS, **columns}
    return R.Batch(prompts, given, IDS, cols, R.TrainerState(3, 0.5, 10), "rows 0, 1 of data.train")


def theirs(funcs, b):
    """TRL's `_calculate_rewards` on the same batch: (completions, functions), NaN for None."""
    inputs = [{"prompt": p, **{k: v[i] for k, v in b.columns.items()}} for i, p in enumerate(b.prompts)]
    state = SimpleNamespace(global_step=b.trainer_state.global_step, epoch=b.trainer_state.epoch)
    out, _ = trl_ref.calculate_rewards(funcs, inputs, b.prompts, b.completions, b.completion_ids, state=state)
    return out.to(torch.float64)


def ours(specs, b):
    return torch.tensor(R.score(R.load([SimpleNamespace(**s) for s in specs]), b), dtype=torch.float64).T


def same(a, b, tol=1e-6):
    assert a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


@pytest.mark.parametrize("chat", [True, False])
def test_a_reward_function_gets_what_trl_gives_it(chat):
    seen = {}

    def probe(**kwargs):
        seen.setdefault("calls", []).append(kwargs)
        return [0.0] * len(kwargs["completions"])

    b = batch(chat, answer=["1", "2", "3", "4"])
    R.score([R.Reward("probe", probe, 1.0, {})], b)
    theirs([probe], b)
    mine, trl_s = seen["calls"]
    assert set(mine) == set(trl_s), set(mine) ^ set(trl_s)
    for k in ("prompts", "completions", "completion_ids", "solution", "answer"):
        assert mine[k] == trl_s[k], k
    assert mine["trainer_state"].global_step == trl_s["trainer_state"].global_step == 3
    assert mine["trainer_state"].epoch == 0.5 and callable(mine["log_extra"]) and callable(mine["log_metric"])
    if chat:  # TRL's conversational completions: one assistant message
        assert mine["completions"][0] == [{"role": "assistant", "content": TEXTS[0]}]


TRL_REWARDS = {  # every function trl.rewards has, by path, with the options its factories take
    "think_format_reward": {},
    "accuracy_reward": {},
    "reasoning_accuracy_reward": {},
    "get_cosine_scaled_reward": {"max_len": 8},
    "get_repetition_penalty_reward": {"ngram_size": 2, "max_penalty": -1.0},
    "get_soft_overlong_punishment": {"max_completion_len": 8, "soft_punish_cache": 4},
}


def test_the_table_names_every_function_of_trl_rewards():
    import trl.rewards

    shipped = {n for names in trl.rewards._import_structure.values() for n in names}
    assert shipped == set(TRL_REWARDS)


@pytest.mark.parametrize("name", list(TRL_REWARDS))
def test_every_trl_reward_runs_by_path_and_scores_as_in_trl(name):
    if "accuracy" in name or "cosine" in name:
        pytest.importorskip("math_verify")
    import trl.rewards

    options = TRL_REWARDS[name]
    fn = getattr(trl.rewards, name)
    theirs_fn = fn(**options) if name.startswith("get_") else fn  # TRL's users call the factories themselves
    b = batch(chat=True)
    got = ours([{"function": f"trl.rewards:{name}", "weight": 1.0, "options": options}], b)
    same(got, theirs([theirs_fn], b))
    assert not torch.isnan(got).all()
    print(f"{name}: {got.squeeze(1).tolist()}")


def test_async_rewards_are_awaited_together_as_in_trl():
    async def slow_length(completions, **kw):
        await asyncio.sleep(0.4)
        return [float(len(c[0]["content"])) for c in completions]

    async def slow_ids(completion_ids, **kw):
        await asyncio.sleep(0.4)
        return [len(i) for i in completion_ids]

    b = batch()
    t = time.perf_counter()
    got = torch.tensor(R.score([R.Reward("a", slow_length, 1.0, {}), R.Reward("b", slow_ids, 1.0, {})], b)).T
    took = time.perf_counter() - t
    assert took < 0.75, f"{took:.2f} s: awaited one after the other"
    same(got.to(torch.float64), theirs([slow_length, slow_ids], b))


def test_an_async_reward_keeps_one_event_loop_for_the_run_as_in_trl():
    """The finding: a new event loop every generation (asyncio.run per call), so a reward keeping one
    httpx.AsyncClient for the process (the LLM-judge pattern) failed at the second generation with 'Event
    loop is closed'. TRL runs one loop in a thread for the run; so do we, closed at the end."""
    import http.server
    import threading

    httpx = pytest.importorskip("httpx")

    class Judge(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept-alive connections: the client's pool holds them on its loop

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"score": len(body["text"]) / 10}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def a_judge():  # one client for the process, as a judge's module makes it (one each: ours, TRL's)
        client, loops = httpx.AsyncClient(), []

        async def judge(completions, **kw):
            loops.append(asyncio.get_running_loop())
            replies = await asyncio.gather(
                *(client.post(url, json={"text": c[0]["content"]}) for c in completions)
            )
            return [r.json()["score"] for r in replies]

        return judge, loops

    (ours_judge, loops), (trl_judge, _) = a_judge(), a_judge()
    try:
        b = batch()
        for _ in range(3):  # three generations
            got = R.score([R.Reward("judge", ours_judge, 1.0, {})], b)
            same(torch.tensor(got, dtype=torch.float64).T, theirs([trl_judge], b))
        assert loops[1] is loops[0] and loops[2] is loops[0] and loops[0].is_running()
        R.close_loop()  # the run's end
        assert loops[0].is_closed()
        again, seen = a_judge()  # another run in the process: a loop of its own
        R.score([R.Reward("judge", again, 1.0, {})], b)
        assert seen[0] is not loops[0] and seen[0].is_running()
    finally:
        R.close_loop()
        server.shutdown()


def test_numpy_numbers_bools_none_and_nan_are_taken_as_trl_takes_them():
    def odd(**kw):
        return np.array([np.float32(0.5), np.int64(2), True, np.nan])

    def mixed(**kw):
        return [np.float64(0.25), None, np.bool_(False), 1]

    b = batch()
    rewards = [R.Reward("odd", odd, 1.0, {}), R.Reward("mixed", mixed, 1.0, {})]
    got = torch.tensor(R.score(rewards, b), dtype=torch.float64).T
    same(got, theirs([odd, mixed], b))
    assert got[:, 0].tolist()[:3] == [0.5, 2.0, 1.0] and math.isnan(got[3, 0]) and math.isnan(got[1, 1])


def test_the_forms_trl_accepts_are_accepted_as_trl_reads_them():
    """Issue 74 item 6: an (n, 1) tensor, a generator and a list of one-element tensors were refused here; TRL's
    `_calculate_rewards` takes each (its list comprehension, then torch.tensor): the same rewards now."""

    def column(**kw):
        return torch.tensor([[0.5], [1.0], [0.0], [2.0]])

    def generator(**kw):
        return (float(len(c)) for c in kw["completion_ids"])

    def one_element(**kw):
        return [torch.tensor([0.25]), torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([3.0])]

    b = batch()
    funcs = [column, generator, one_element]
    got = torch.tensor(R.score([R.Reward(f.__name__, f, 1.0, {}) for f in funcs], b), dtype=torch.float64).T
    same(got, theirs([column, generator, one_element], b))
    assert got[:, 1].tolist() == [4.0, 2.0, 6.0, 8.0]
    with pytest.raises(UserError, match="returned array"):  # (two elements: not a number, as TRL's error)
        R.score([R.Reward("two", lambda **kw: [np.array([1.0, 2.0])] * 4, 1.0, {})], b)


def test_the_columns_reach_the_functions_with_their_types(tmp_path):
    """Issue 74 item 4: a parquet's datetime and bytes columns reached the reward functions as strings (the cache's
    JSON wrote what it has no type for as its str); they come back as the data gave them now (numpy's numbers and
    arrays as Python's, as datasets gives them)."""
    import datetime
    import decimal

    from trainer.data.prompts import build_prompts, read_columns, write_columns

    when = datetime.datetime(2026, 11, 30, 18, 30, 5, 123456, tzinfo=datetime.UTC)
    values = {"at": when, "day": datetime.date(2026, 11, 30), "clock": datetime.time(7, 5), "took": datetime.timedelta(
        seconds=1.5), "raw": b"\x00\xffpng", "price": decimal.Decimal("1.10"), "n": np.int64(3), "x": np.float32(0.5),
        "arr": np.array([1, 2]), "nested": {"when": [when], "t": (1, "a")}, "none": None, "flag": True}  # fmt: skip
    tok = SimpleNamespace(bos_token=None, eos_token=None, __call__=None)
    section = SimpleNamespace(train=SimpleNamespace(prompt_field="prompt"), seq_len=64)
    from unittest import mock

    with mock.patch("trainer.data.prompts.prompt_ids", lambda *a: [1, 2, 3]):
        _, columns, _ = build_prompts([{"prompt": "q", **values}], tok, section)
    write_columns(tmp_path, columns)
    (back,) = read_columns(tmp_path)
    want = {**values, "n": 3, "x": 0.5, "arr": [1, 2], "nested": {"when": [when], "t": [1, "a"]}}
    assert {k: back[k] for k in values} == want
    assert (
        type(back["at"]) is datetime.datetime
        and type(back["day"]) is datetime.date
        and type(back["n"]) is int
    )


def test_scale_rewards_true_and_false_are_trls_group_and_none():
    """Issue 74 item 6: TRL's GRPOConfig maps scale_rewards True / False to group / none; a ported config keeps it."""
    from trainer.config.rl_schema import RLSection

    assert RLSection(scale_rewards=True).scale_rewards == "group"
    assert RLSection(scale_rewards=False).scale_rewards == "none"
    assert RLSection(scale_rewards="batch").scale_rewards == "batch"


def test_completions_no_function_scored_are_warned_about_naming_one(caplog):
    """Issue 74 item 7: rows whose every reward is None trained on advantage 0 without a word (TRL warns, naming
    the first); warned now, with their count, the rows and one prompt and completion."""
    import logging

    from trainer.rl.rollout import scored_by

    def some(**kw):
        return [1.0, None, 0.5, None]

    def none_of_them(**kw):
        return [None] * 4

    b = batch()
    comps = [(ids, True) for ids in IDS]
    with caplog.at_level(logging.WARNING, logger="trainer"):
        values, _ = scored_by([R.Reward("some", some, 1.0, {}), R.Reward("none", none_of_them, 1.0, {})], b.prompts,
                              TEXTS, comps, {}, b.trainer_state, "rows 0, 1 of data.train", lambda *a: None)  # fmt: skip
    assert torch.isnan(values).all(dim=1).tolist() == [False, True, False, True]
    (line,) = [r.message for r in caplog.records if "returned None" in r.message]
    assert "every reward function returned None for 2 of 4 completions (rows 0, 1 of data.train)" in line
    assert "<think>sum</think>4" in line and "advantage of 0" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        scored_by([R.Reward("some", lambda **kw: [1.0] * 4, 1.0, {})], b.prompts, TEXTS, comps, {}, b.trainer_state,
                  "rows", lambda *a: None)  # fmt: skip
    assert not [r for r in caplog.records if "returned None" in r.message]


@pytest.mark.parametrize(
    "values,needle",
    [(["good"] * 4, "returned 'good' (a str) for completion 0"), ([1.0, math.inf, 0.0, 0.0], "returned inf"),
     ([1.0, 2.0], "returned 2 values for 4 completions")],
)  # fmt: skip
def test_what_is_not_a_number_a_completion_stops_the_run_naming_the_function(values, needle):
    with pytest.raises(UserError) as e:
        R.score([R.Reward("mine", lambda **kw: values, 1.0, {})], batch())
    assert needle in str(e.value) and "mine" in str(e.value) and "rows 0, 1" in str(e.value)


def test_a_factory_is_called_with_its_options_and_its_errors_are_named():
    (r,) = R.load([SimpleNamespace(function="trl.rewards:get_soft_overlong_punishment", weight=1.0,
                                   options={"max_completion_len": 8, "soft_punish_cache": 4})])  # fmt: skip
    assert r.options == {} and r.fn.max_completion_len == 8
    with pytest.raises(UserError, match="called as a factory with options .* raised TypeError"):
        R.load([SimpleNamespace(function="trl.rewards:get_soft_overlong_punishment", weight=1.0,
                                options={"max_len": 8})])  # fmt: skip


def test_the_user_s_module_imports_from_the_directories_bin_train_adds(tmp_path):
    from trainer.common import dotted

    (tmp_path / "beside_yaml_rewards.py").write_text(
        "def short(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    with pytest.raises(UserError, match="cannot import 'beside_yaml_rewards'"):
        dotted.load_callable("beside_yaml_rewards:short", "train.rl.rewards[0]")
    dotted.search(tmp_path)
    assert dotted.load_callable("beside_yaml_rewards:short", "train.rl.rewards[0]")(completions=["a"]) == [
        0.0
    ]


BROKEN_MODULES = {  # a module that fails as it is imported: its source, what the message says of the cause
    "raises": ("import os\nraise RuntimeError('needs OPENAI_API_KEY\\nset it first')\n",
               "RuntimeError: needs OPENAI_API_KEY"),
    "syntax": ("def f(completions, **kw)\n    return [0.0]\n", "SyntaxError: expected ':' ("),
    "exits": ("import sys\nsys.exit('no key')\n", "SystemExit: no key"),
    "a dependency missing": ("import not_a_module_xyz\n", "it imports 'not_a_module_xyz', which is not installed"),
}  # fmt: skip


@pytest.mark.parametrize("key", ["train.rl.rewards[0]", "model.factory"])
@pytest.mark.parametrize("case", list(BROKEN_MODULES))
def test_a_module_that_fails_at_import_is_a_user_error_naming_the_key_the_module_and_the_cause(
    tmp_path, case, key
):
    """The finding: only ImportError was caught; a module raising at import (an API key missing) or with a
    syntax error gave exit 1 and a traceback. The reward's loader and model.factory's are the same."""
    from trainer.common import dotted

    source, cause = BROKEN_MODULES[case]
    name = f"broken_{case.replace(' ', '_')}_{key[0]}"
    (tmp_path / f"{name}.py").write_text(source)
    dotted.search(tmp_path)
    with pytest.raises(UserError) as e:
        dotted.load_callable(f"{name}:f", key)
    text = str(e.value)
    assert text.startswith(f"{key}: importing '{name}'"), text
    assert cause in text and "\n" not in text, text
    assert "OPENAI_API_KEY" not in text or "set it first" not in text  # the cause's first line only


ANSWERS = [  # completion, expected (the row's), as strings, with numeric: true
    ("The answer is 42, since it is six sevens.", "42", 1.0, 1.0),
    ("1,234", "1234", 1.0, 1.0),
    ("In all: 1,234.", "1,234", 1.0, 1.0),
    ("It costs $1,000.", "1000", 1.0, 1.0),
    ("So it is -3.", "-3", 1.0, 1.0),
    (r"Thus \boxed{17} apples, not 18", "17", 1.0, 1.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0, 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0, 1.0),
    ("#### 1,080", "1080", 1.0, 1.0),
    ("3.5 hours", "3.50", 0.0, 1.0),
    ("42 or 420", "42", 0.0, 0.0),
    ("The answer is 7", "8", 0.0, 0.0),
    ("no number here", "8", 0.0, 0.0),
    ("10, 20", "20", 1.0, 1.0),
    # the review's: a leading-dot decimal read 5, a Unicode minus read 3, a fraction read as its denominator
    ("The probability is .5", "5", 0.0, 0.0),
    ("The probability is .5", "0.5", 1.0, 1.0),
    ("It is 0.5.", ".5", 1.0, 1.0),
    ("So it is -.25", "-0.25", 1.0, 1.0),
    ("The answer is \u22123", "3", 0.0, 0.0),
    ("The answer is \u22123", "-3", 1.0, 1.0),
    ("#### \u22121,080", "-1080", 1.0, 1.0),
    ("x = 1/2", "2", 0.0, 0.0),
    ("Answer: 1/2", "1/2", 1.0, 1.0),
    ("Answer: 1/2", "0.5", 0.0, 1.0),
    ("Answer: \u22123/4.", "-0.75", 0.0, 1.0),
]


@pytest.mark.parametrize(("text", "expected", "as_string", "as_number"), ANSWERS)
def test_the_answer_reward_reads_numbers_as_the_table_says(text, expected, as_string, as_number):
    from trainer.rl.answers import answer

    assert answer([None], [text], answer=[expected]) == [as_string]
    assert answer([None], [text], answer=[expected], numeric=True, tolerance=1e-9) == [as_number]
    assert answer([None], [[{"role": "assistant", "content": text}]], answer=[expected]) == [as_string]


def test_the_answer_reward_skips_rows_without_an_answer_and_names_a_missing_column():
    from trainer.rl.answers import answer

    assert answer([None], ["4"], answer=[None]) == [None]
    with pytest.raises(UserError, match="reads the column 'solution'.*set options.column"):
        answer([None], ["4"], column="solution", answer=["4"])


# ----------------------------------------------------------------------------- a local reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainer.data.tokenizer import byte_tokenizer

    path = tmp_path_factory.mktemp("reward_model")
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), num_labels=1, max_position_embeddings=256)  # fmt: skip
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("chat", [True, False])
def test_a_reward_model_scores_as_trl_s_reward_model_batched_without_gradients(reward_model_dir, chat):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainer.rl.reward_model import RewardModel

    b = batch(chat)
    ours_model = RewardModel(
        str(reward_model_dir), device=torch.device("cpu"), dtype=torch.float32, batch_size=3
    )
    (r,) = R.load([SimpleNamespace(function="model", weight=1.0, options={"path": str(reward_model_dir)})],
                  model=lambda i, options: ours_model)  # fmt: skip
    got = torch.tensor(R.score([r], b), dtype=torch.float64).T
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    tok.pad_token = tok.eos_token  # (TRL's __init__ does so for a tokenizer without a pad token)
    model.config.pad_token_id = tok.pad_token_id
    out, _ = trl_ref.calculate_rewards([model], [{"prompt": p} for p in b.prompts], b.prompts, b.completions,
                                       b.completion_ids, processing_classes=[tok])  # fmt: skip
    same(got, out.to(torch.float64), tol=1e-5)
    assert got.std() > 0 and not any(p.requires_grad for p in ours_model.model.parameters())
    assert not ours_model.model.training
    print(f"reward model ({'chat' if chat else 'text'}): ours {got.squeeze(1).tolist()}")


def test_a_reward_model_path_that_is_not_a_model_is_refused(tmp_path):
    from trainer.rl.reward_model import RewardModel

    with pytest.raises(UserError, match=r"train.rl.rewards\[0\].options.path: .* is not a model directory"):
        RewardModel(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32, key="train.rl.rewards[0]")


def not_a_reward_model(path, kind):
    """A directory that loads as a sequence-classification model but is no reward model: a 2-label classifier
    or a causal LM (no score head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from trainer.data.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok.save_pretrained(path)
    cfg = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    if kind == "two labels":
        LlamaForSequenceClassification(LlamaConfig(num_labels=2, **cfg)).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "kind,why",
    [("two labels", "its head has 2 labels"), ("a causal LM", "its score head would be newly initialised")],
)
def test_a_reward_model_that_is_not_one_label_or_has_no_score_head_is_refused(tmp_path, kind, why):
    """The finding: a 2-label classifier was scored by its logit 0 (TRL loads with num_labels=1 and raises on
    the size), a causal LM got a random score head (noise, no warning). Loaded as TRL loads it; refused."""
    from transformers import AutoModelForSequenceClassification

    from trainer.rl.reward_model import RewardModel

    path = not_a_reward_model(tmp_path / kind.replace(" ", "_"), kind)
    if kind == "two labels":  # TRL's load (its __init__: num_labels=1) refuses it too
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    with pytest.raises(UserError) as e:
        RewardModel(path, device=torch.device("cpu"), dtype=torch.float32, key="train.rl.rewards[1]")
    text = str(e.value)
    assert text.startswith(f"train.rl.rewards[1].options.path: {path}: "), text
    assert why in text and "one label" in text, text


def test_the_plan_holds_the_reward_model_s_weights_on_every_rank(reward_model_dir, tmp_path, capsys):
    from helpers import ROOT
    from transformers import AutoModelForSequenceClassification

    from trainer import config
    from trainer.run.cli import main
    from trainer.strategy.planning.generation import reward_model_bytes

    params = sum(
        p.numel() for p in AutoModelForSequenceClassification.from_pretrained(reward_model_dir).parameters()
    )
    rewards = json.dumps([{"function": "model", "options": {"path": str(reward_model_dir), "batch_size": 4}}])
    sets = [
        f"train.rl.rewards={rewards}",
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    exp = config.load(ROOT / "configs/experiments/tiny-grpo.yaml", sets)
    assert reward_model_bytes(exp, 4) == params * 4 and reward_model_bytes(exp, 2) == params * 2
    args = [str(ROOT / "configs/experiments/tiny-grpo.yaml"), "--plan"]
    for s in sets:
        args += ["--set", s]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reward model(s): " in out and "held through the run" in out, out[-2000:]


def test_an_option_or_a_column_named_as_what_trl_gives_is_refused_not_overwritten():
    with pytest.raises(
        UserError, match=r"train.rl.rewards\[0\].options: completion_ids is what every reward"
    ):
        R.load([SimpleNamespace(function="length", weight=1.0, options={"target": 3, "completion_ids": []})])
    import numpy as np

    from trainer.data.pack import IGNORE
    from trainer.data.tokenizer import byte_tokenizer
    from trainer.rl.rollout import RolloutStream

    prompts = np.full((4, 3), IGNORE, dtype=np.int32)
    prompts[:, :2] = 65
    data = SimpleNamespace(train=prompts, columns=[{"prompt": "p", "trainer_state": 1}] * 4)
    rl = SimpleNamespace(num_generations=2, max_new_tokens=2)
    with pytest.raises(UserError, match="the column.s. trainer_state have the names"):
        RolloutStream(data, SimpleNamespace(shuffle=True), rl, rank=0, world=1, micro=2, accum=1, seed=7, seq_len=16,
                      tokenizer=byte_tokenizer())  # fmt: skip


def test_a_tokenizer_with_a_response_template_gives_the_parsed_completions_as_trl():
    """Issue 74 item 3: where the tokenizer ships a response template (Gemma 4's repositories do; here Qwen3's
    tokenizer with TRL's qwen3 template), TRL 1.16 gives its reward functions the parsed completion
    ({"role", "reasoning_content", "content"}) and we gave the raw text: think_format_reward scored 1.0 where TRL's
    scores 0.0. The parse is TRL's parse_response (its code called), a malformed one falls back to the text."""
    from helpers import ROOT
    from transformers import AutoTokenizer
    from trl.chat_template_utils import parse_response, qwen3_template
    from trl.rewards import think_format_reward

    from trainer.data.tokenizer import byte_tokenizer
    from trainer.rl.rollout import parse_responses, scored_by

    tok = AutoTokenizer.from_pretrained(ROOT / ".cache" / "tokenizers" / "qwen3")
    tok.response_template = qwen3_template
    prompt = list(tok.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=True)["input_ids"])
    raw = [
        "<think>\nadd them\n</think>\n\n4<|im_end|>",
        "just 4<|im_end|>",
        "<think>\nunclosed 4",
        "<|im_end|>",
    ]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in raw]
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    parsed = parse_responses(tok, [prompt] * 4, ids, texts, chat=True)
    assert parsed == [parse_response(tok, i, prefix=prompt) for i in ids]
    assert parsed[0] == {"role": "assistant", "reasoning_content": "add them", "content": "4"}
    values, _ = scored_by([R.Reward("think", think_format_reward, 1.0, {})], [CHAT[0]] * 4, texts,
                          [(i, True) for i in ids], {}, R.TrainerState(0, 0.0, 1), "rows", lambda *a: None, parsed)  # fmt: skip
    assert values[:, 0].tolist() == think_format_reward([[p] for p in parsed])
    assert values[0, 0] == 0.0 and think_format_reward([[{"role": "assistant", "content": texts[0]}]]) == [
        1.0
    ]
    assert parse_responses(tok, [prompt] * 4, ids, texts, chat=False) is None  # (string prompts: the text)
    assert (
        parse_responses(byte_tokenizer(), [[1]], [[2]], ["x"], chat=True) is None
    )  # (no template: the text)
