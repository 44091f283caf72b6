"""Fine-tuning on what users bring: the tokenizers and chat templates that Meta (Llama 3.2), Qwen
(Qwen3), Google (Gemma 3) and Mistral (Nemo) publish (fetched at set-up, scripts/fetch_tokenizers.py),
a tiny model of each family with its vocabulary, chat data of 1-3 exchanges with system prompts, tool
calls on Qwen3, packing on.

The targets are checked token by token against a computation of the test's own: each trained answer
tokenized on its own (after the family's known prefix: Qwen3's empty `<think>` block), then the
family's end-of-turn token; one example per conversation where the template renders every turn the
same (Llama, Gemma: multi_turn all), one per answer where it does not (Qwen3 adds the `<think>` block
to the last turn only; Mistral moves the system prompt to the last user turn: multi_turn each)."""

import json

import pytest
from helpers import FAMILIES, TINY, family_sets, real_chat_data, tokenizer_dir, train, yaml_value

pytestmark = pytest.mark.e2e

# (the answer's rendering before its content, end-of-turn token, the strategy auto must choose)
EXPECTED = {
    "llama3_2": ("", "<|eot_id|>", "all"),
    "qwen3": ("<think>\n\n</think>\n\n", "<|im_end|>", "each"),
    "gemma3": ("", "<end_of_turn>", "all"),
    "mistral_nemo": ("", "</s>", "each"),
}


def data_for(name, tmp_path, rows=30):
    # Mistral's template puts the system prompt in the last user turn only, and drops it once the
    # conversation ends with an answer: refused (test_a_template_that_drops_the_system_prompt_...).
    return real_chat_data(
        tmp_path / f"{name}.jsonl", rows=rows, system=name != "mistral_nemo", tools=name == "qwen3"
    )


def sets_for(name, path, tmp_path, **kw):
    seq = {"data.seq_len": 384} if name == "qwen3" else {}  # the tool schemas take 200 tokens
    return family_sets(name, path, **{"data.cache_dir": str(tmp_path / "cache"), **seq, **kw})


def built(name, path, tmp_path, **sets):
    from trainer import config, data

    exp = config.load(
        str(TINY), [f"{k}={yaml_value(v)}" for k, v in sets_for(name, path, tmp_path, **sets).items()]
    )
    return exp, data.build(exp.data, exp.seed)


def runs(ex):
    """The example's targets as runs of consecutive target tokens."""
    out, cur = [], []
    for i, t in zip(ex.ids, ex.targets, strict=True):
        if t:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


def answer_text(message):
    if message.get("tool_calls"):  # Qwen3's rendering of a call (the only family given tools here)
        f = message["tool_calls"][0]["function"]
        return (
            f'<tool_call>\n{{"name": "{f["name"]}", "arguments": {json.dumps(f["arguments"])}}}\n</tool_call>'
        )
    return message["content"]


def expected_examples(name, path, tok):
    head, eot, strategy = EXPECTED[name]
    eot_id = tok.convert_tokens_to_ids(eot)
    out = []
    for line in path.read_text().splitlines():
        answers = [m for m in json.loads(line)["messages"] if m["role"] == "assistant"]
        turns = [
            tok(head + answer_text(m), add_special_tokens=False)["input_ids"] + [eot_id] for m in answers
        ]
        out += [turns] if strategy == "all" else [[t] for t in turns]
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_targets_are_the_answers_and_their_end_of_turn_token_by_token(name, tmp_path):
    from trainer.data.preview import examples_of

    path = data_for(name, tmp_path)
    exp, d = built(name, path, tmp_path)
    assert d.finetune["template"]["strategy"] == EXPECTED[name][2], d.finetune["template"]
    assert d.finetune["truncated"] == 0 and d.finetune["dropped_no_target"] == 0
    got = [runs(ex) for row in d.train for ex in examples_of(row)]  # packing keeps the file's order
    want = expected_examples(name, path, d.tokenizer)
    assert len(got) == len(want) and len(d.train) < len(want)  # packed: several examples a row
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (k, [d.tokenizer.decode(x) for x in g], [d.tokenizer.decode(x) for x in w])
    # the prompts are there, untrained: every user turn and (where given) the system prompt
    text = d.tokenizer.decode([i for row in d.train for ex in examples_of(row) for i in ex.ids])
    for line in path.read_text().splitlines()[:6]:
        for m in json.loads(line)["messages"]:
            if m["role"] in ("user", "system"):
                assert m["content"] in text, m


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_packed(name, tmp_path):
    """bin/train on the family's tokenizer and template, packed: the banner names the strategy and why,
    and the project's own packing check for the family; the loss falls."""
    path = data_for(name, tmp_path, rows=40)
    r = train(
        tmp_path, sets_for(name, path, tmp_path, **{"train.max_steps": 12, "train.log_every": 4}), debug=False
    )
    assert f"chat template: multi_turn {EXPECTED[name][2]} (auto: " in r.output, r.output[-3000:]
    model_type = FAMILIES[name]["model_type"]
    assert (
        f"packing: model type '{model_type}' with sdpa attention: a packed row trains as its examples one by one"
        in r.output
    )
    steps = sorted(r.losses)
    print(name, {k: round(v, 3) for k, v in r.losses.items()})
    assert r.losses[steps[-1]] < r.losses[steps[0]] - 2, r.losses  # from ln(vocab), about 12


def test_a_template_that_drops_the_system_prompt_from_answered_turns_is_refused(tmp_path):
    """Mistral Nemo's template puts the system prompt in the last user turn, and drops it when the
    conversation ends with an answer: where the prompt of a turn lies cannot be known. Refused with the
    file and line, not trained without the system prompt."""
    path = real_chat_data(tmp_path / "m.jsonl", rows=4, system=True)
    r = train(tmp_path, family_sets("mistral_nemo", path, **{"train.max_steps": 1}), debug=False, check=False)
    assert r.returncode == 2 and "Traceback" not in r.output, r.output[-3000:]
    assert (
        f"{path}:2: the chat template renders the prompt of assistant turn 2 otherwise once the turn follows it"
        in r.output
    )


def test_masking_learns_fixed_answers_to_random_questions_and_train_on_prompt_cannot(tmp_path):
    """A black box: user turns of random letters, every answer the same, Qwen3 (one example per turn,
    with its <think> block). With the answers as targets the loss falls below 0.1; training on the
    random prompts too, it stays above 1."""
    path = real_chat_data(tmp_path / "b.jsonl", rows=120, system=True, random_users=True)
    sets = family_sets("qwen3", path, **{"train.max_steps": 35, "train.micro_batch_size": 4, "data.seq_len": 128,
                                         "model.config.hidden_size": 64, "model.config.intermediate_size": 128,
                                         "optim.schedule": "constant",
                                         "data.cache_dir": str(tmp_path / "cache")})  # fmt: skip
    masked = train(tmp_path / "masked", sets, debug=False)
    everything = train(tmp_path / "all", {**sets, "data.train_on_prompt": True}, debug=False)
    print("answers only:", {k: round(v, 3) for k, v in masked.losses.items()})
    print("train_on_prompt:", {k: round(v, 3) for k, v in everything.losses.items()})
    assert masked.losses[max(masked.losses)] < 0.1, masked.losses
    assert min(everything.losses.values()) > 1, everything.losses


def test_a_tool_call_trains_and_the_preview_shows_its_tokens_as_targets(tmp_path):
    """Qwen3, a conversation with the tools' schemas, an assistant tool call, its result and the answer:
    --preview-data shows the schemas and the result as prompt, the call (with the empty <think> block the
    template gives a last turn) and the answer as targets, token by token."""
    path = real_chat_data(tmp_path / "t.jsonl", rows=1, system=False, tools=True)  # row 0: the tool call
    sets = sets_for("qwen3", path, tmp_path, run_dir=str(tmp_path / "run"))
    from helpers import bin_train

    args = [TINY]
    for k, v in sets.items():
        args += ["--set", f"{k}={yaml_value(v)}"]
    p = bin_train(*args, "--preview-data", "2")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert (
        "chat template: multi_turn each (auto: the template renders the last assistant turn otherwise" in out
    )
    call = '<tool_call>\\n{"name": "get_weather", "arguments": {"city": '
    assert f"<|im_start|>assistant\\n[[<think>\\n\\n</think>\\n\\n{call}" in out, out
    assert '{"type": "function", "function": {"name": "get_weather"' in out  # the schema, in the prompt
    assert "[[<think>\\n\\n</think>\\n\\nIt is sunny in " in out and "<tool_response>\\nsunny in " in out
    assert "tokens: |<|im_start|>|" in out and "|[[<think>|" in out
    tokenizer_dir("qwen3")


def test_gemma3_without_packing_pads_each_micro_batch_to_its_longest(tmp_path):
    """data.packing: false on Gemma 3's chat data: each example alone in a row of seq_len, but a micro
    batch is only as wide as its longest example (and data.group_by_length makes them alike): the
    banner reports the padding share both ways, the run trains on the narrower batches."""
    import re

    from helpers import bin_train

    path = data_for("gemma3", tmp_path, rows=48)
    sets = sets_for("gemma3", path, tmp_path, **{"data.packing": False, "train.micro_batch_size": 4,
                                                 "train.max_steps": 4, "train.log_every": 2})  # fmt: skip
    args = [TINY, *[x for k, v in sets.items() for x in ("--set", f"{k}={yaml_value(v)}")]]
    p = bin_train(*args, "--set", f"run_dir={tmp_path / 'p'}", "--preview-data", "0")
    plain = re.search(
        r"padding: ([\d.]+)% of the first epoch's tokens padded to seq_len, ([\d.]+)% as fed", p.stdout
    )
    assert p.returncode == 0 and plain, p.stdout + p.stderr
    r = train(tmp_path, {**sets, "data.group_by_length": True}, debug=False)
    grouped = re.search(
        r"padding: ([\d.]+)% of an epoch's tokens padded to seq_len 192, ([\d.]+)% as fed", r.output
    )
    assert grouped, r.output[-3000:]
    print(
        f"padding: to seq_len {plain[1]}%, to the micro batch's longest {plain[2]}%, grouped by length {grouped[2]}%"
    )
    assert float(plain[1]) > 50 and float(grouped[1]) == float(plain[1])
    assert float(grouped[2]) < float(plain[2]) < float(plain[1]) and float(grouped[2]) < 25
    tokens = [m["tokens"] for m in r.metrics if "tokens" in m]
    assert tokens[-1] < 4 * 4 * 192 * 0.75  # counted as fed: the batches were narrower than seq_len


def test_the_shipped_qwen3_chat_example_previews(tmp_path):
    """configs/experiments/qwen3-chat.yaml, as README: Fine-tuning data shows it."""
    from helpers import ROOT, bin_train

    tokenizer_dir("qwen3")
    p = bin_train(ROOT / "configs/experiments/qwen3-chat.yaml", "--set", f"data.cache_dir={tmp_path}",
                  "--set", f"run_dir={tmp_path / 'run'}", "--preview-data", "2")  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "fine-tuning data (chat): 140 of 140 examples made from 60 rows" in out, out  # 60 conversations
    assert "chat template: multi_turn each (auto: " in out and "packing: model type 'qwen3'" in out
    assert out.count("\nexample ") == 2 and "[[<think>\\n\\n</think>\\n\\n" in out


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_content_parts_render_as_their_text(name):
    """Gemma 3's template reads content parts itself; Qwen3's reads content as a string, so the parts
    are joined first: either way the same tokens and targets as the plain strings, never a list's repr."""
    from transformers import AutoTokenizer

    from trainer.data.chat import render_chat

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    plain = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Four."}]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in plain]
    assert render_chat(parts, tok, tok.chat_template) == render_chat(plain, tok, tok.chat_template)
