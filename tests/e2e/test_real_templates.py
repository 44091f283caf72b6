"""Fine-tuning on what users bring: the tokenizers and chat templates that Meta (Llama 3.2), Qwen
(Qwen3), Google (Gemma 3) and Mistral (Nemo) publish (fetched at set-up, scripts/fetch_tokenizers.py),
a tiny model of each family with its vocabulary, chat data of 1-3 exchanges with system prompts, tool
calls on Qwen3, packing on.

The targets are checked token by token against a computation of the test's own: each trained answer
tokenized on its own (after the family's known prefix: Qwen3's empty `<think>` block), then the
family's end-of-turn token; one example per conversation where the template renders every turn the
same (Llama, Gemma, Mistral: multi_turn all), one per answer where it does not (Qwen3 adds the `<think>`
block to the last turn only: multi_turn each; Mistral puts the system prompt in the last user turn
only: a conversation with one is rendered turn by turn, the system prompt in each turn's prompt)."""

import json

import pytest
from helpers import (
    EXPECTED,
    FAMILIES,
    TINY,
    data_for,
    real_chat_data,
    sets_for,
    tokenizer_dir,
    yaml_value,
)

pytestmark = pytest.mark.e2e


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
        messages = json.loads(line)["messages"]
        answers = [m for m in messages if m["role"] == "assistant"]
        turns = [
            tok(head + answer_text(m), add_special_tokens=False)["input_ids"] + [eot_id] for m in answers
        ]
        by_turn = name == "mistral_nemo" and messages[0]["role"] == "system"
        out += [turns] if strategy == "all" and not by_turn else [[t] for t in turns]
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
    if name == "mistral_nemo":  # each turn's prompt holds the system prompt, as inference renders it
        systems = sum(json.loads(x)["messages"][0]["role"] == "system" for x in path.read_text().splitlines())
        assert d.finetune["template"]["turn_by_turn"] == systems > 0
        with_system = [
            ex for row in d.train for ex in examples_of(row) if "You answer" in d.tokenizer.decode(ex.ids)
        ]
        assert all(d.tokenizer.decode(ex.ids).count("You answer") == 1 for ex in with_system)


def test_the_preview_shows_a_tool_calls_tokens_as_targets(tmp_path):
    """Qwen3, a conversation with the tools' schemas, an assistant tool call, its result and the answer
    (test_real_templates_train.py trains on such):
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


# What each family's tokenizer begins a text with by default (serving tokenizes a plain prompt so).
BOS = {"llama3_2": [128000], "qwen3": [], "gemma3": [2], "mistral_nemo": [1]}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plain_text_and_prompts_begin_as_the_tokenizer_begins_them(name):
    """Text documents and prompt/completion strings get the special tokens the family's tokenizer adds
    by default (Gemma 3's own tokenizer gives [2, ...]; this pipeline gave [2202, ...] before), once,
    then EOS after a document; chat data keeps what its template renders (the template writes BOS)."""
    import datasets
    from transformers import AutoTokenizer

    from trainer import config
    from trainer.data.chat import render_chat, render_prompt_completion
    from trainer.data.pack import tokenize_documents
    from trainer.data.tokenizer import special_edges

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    assert special_edges(tok) == (BOS[name], [])
    section = config.load(str(TINY), []).data
    docs = datasets.Dataset.from_dict({"text": ["Hello world.", "Second document."]})
    ids, _ = tokenize_documents(docs, tok, section, "text", 1)
    assert ids["ids"][0] == tok("Hello world.")["input_ids"] + [tok.eos_token_id]
    assert (
        ids["ids"][0][: len(BOS[name]) + 1]
        == BOS[name] + tok("Hello", add_special_tokens=False)["input_ids"][:1]
    )
    ex = render_prompt_completion("Q: 2+2?", " 4", tok)
    assert ex.ids == tok("Q: 2+2?")["input_ids"] + tok(" 4", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id
    ]
    (chat,) = render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tok,
                          tok.chat_template, kwargs={"date_string": "26 Jul 2024"})  # fmt: skip
    assert chat.ids[: len(BOS[name])] == BOS[name] and chat.ids.count(BOS[name][0] if BOS[name] else -1) <= 1
