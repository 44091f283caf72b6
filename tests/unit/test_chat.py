"""Loss masking for fine-tuning data (trainer/data/chat.py): on three chat templates of different
styles, multi-turn, with system prompts and truncation, the targets are exactly the assistant
contents plus their end-of-turn tokens."""

import pytest

from trainer.common.errors import UserError
from trainer.data.chat import Example, check_conversation, render_chat, render_prompt_completion
from trainer.data.templates import BYTE_TEMPLATE, template_for
from trainer.data.tokenizer import byte_tokenizer

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# ChatML-like, with generation markers around each assistant turn (content and <|im_end|>).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3-like, no generation markers: headers, content, <|eot_id|>.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# A user's .jinja file, Mistral-like: the system prompt folded into the first user turn, [INST]
# markers in plain text, each answer closed by EOS.
MISTRAL_FILE = """\
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
{%- for message in messages if message['role'] != 'system' -%}
{%- if message['role'] == 'user' -%}
[INST] {% if loop.first and system %}{{ system }}\n\n{% endif %}{{ message['content'] }} [/INST]
{%- else %} {{ message['content'] }}{{ eos_token }}
{%- endif -%}
{%- endfor -%}
"""

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What does len() return?"},
    {"role": "assistant", "content": "The number of items in a container."},
    {"role": "user", "content": "And for a str?"},
    {"role": "assistant", "content": "The number of code points."},
]
ANSWERS = ["The number of items in a container.", "The number of code points."]


@pytest.fixture(scope="module")
def tok():
    t = byte_tokenizer()
    t.add_special_tokens({"additional_special_tokens": SPECIAL})
    return t


def targets_text(ex: Example, tok) -> str:
    return tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t])


def prompt_text(ex: Example, tok) -> str:
    return tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if not t])


def test_chatml_with_generation_markers(tok):
    (ex,) = render_chat(CONVERSATION, tok, CHATML)
    assert targets_text(ex, tok) == "".join(a + "<|im_end|>" for a in ANSWERS)
    # transformers' own mask from the generation markers: the same tokens
    hf = tok.apply_chat_template(
        CONVERSATION, chat_template=CHATML, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert hf["input_ids"] == ex.ids and [bool(x) for x in hf["assistant_masks"]] == ex.targets
    assert "Answer in one sentence." in prompt_text(ex, tok) and "And for a str?" in prompt_text(ex, tok)


def test_llama3_without_generation_markers(tok):
    (ex,) = render_chat(CONVERSATION, tok, LLAMA3)
    assert targets_text(ex, tok) == "".join(a + "<|eot_id|>" for a in ANSWERS)
    assert (
        ex.ids
        == tok.apply_chat_template(CONVERSATION, chat_template=LLAMA3, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    assert "assistant<|end_header_id|>" in prompt_text(ex, tok)  # the header is the template's, not a target


# Meta-Llama-3-8B-Instruct's template as first published: the assistant header after every rendering,
# with or without add_generation_prompt (bos_token written out: the test tokenizer has none).
LLAMA3_0 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
    "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


@pytest.mark.parametrize("multi_turn", ["auto", "each", "last"])
def test_what_a_template_renders_after_the_end_of_turn_is_not_trained(tok, multi_turn):
    """Llama 3.0's published template appends the assistant header to every rendering: a turn's targets
    end at its <|eot_id|>, the header after it is never trained, and the probe does not take it for a
    rewritten history (auto renders the conversation once)."""
    examples = render_chat(CONVERSATION, tok, LLAMA3_0, multi_turn=multi_turn)
    assert [targets_text(ex, tok) for ex in examples] == {
        "auto": ["".join(a + "<|eot_id|>" for a in ANSWERS)],
        "each": [a + "<|eot_id|>" for a in ANSWERS],
        "last": [ANSWERS[-1] + "<|eot_id|>"],
    }[multi_turn]
    from trainer.data.templates import profile

    p = profile(tok, LLAMA3_0, {}, "auto", "test")
    assert p.eot == "<|eot_id|>" and p.strategy == "all", p.why


def test_a_users_jinja_file(tok, tmp_path):
    path = tmp_path / "mistral.jinja"
    path.write_text(MISTRAL_FILE)
    (ex,) = render_chat(CONVERSATION, tok, path.read_text())
    eos = tok.eos_token
    assert targets_text(ex, tok) == "".join(f" {a}{eos}" for a in ANSWERS)
    prompt = prompt_text(ex, tok)
    assert prompt.startswith("[INST] Answer in one sentence.\n\nWhat does len() return? [/INST]")
    assert "[INST] And for a str? [/INST]" in prompt


def test_the_built_in_template_of_the_byte_tokenizer():
    tok = byte_tokenizer()
    assert template_for(tok, None) == BYTE_TEMPLATE
    (ex,) = render_chat(CONVERSATION, tok, BYTE_TEMPLATE)
    assert targets_text(ex, tok) == "".join(a + "<|endoftext|>" for a in ANSWERS)
    assert ex.show(tok).startswith("<|system|>\\nAnswer in one sentence.\\n<|user|>\\n")
    assert "<|assistant|>\\n[[The number of items in a container.<|endoftext|>]]\\n" in ex.show(tok)


def test_a_tokenizer_without_a_template_needs_one(tok):
    with pytest.raises(UserError, match="data.chat_template: FILE.jinja"):
        template_for(tok, None)  # the byte tokenizer with extra tokens is not the built-in one


def test_truncation_keeps_the_start_and_as_much_of_the_answer_as_fits(tok):
    (ex,) = render_chat(CONVERSATION[:3], tok, CHATML)
    first = ex.targets.index(True)
    cut = ex.truncated(first + 10)
    assert cut.ids == ex.ids[: first + 10] and targets_text(cut, tok) == ANSWERS[0][:10]
    assert ex.truncated(first).n_targets == 0  # nothing of the answer fits: the caller drops it


def test_train_on_prompt_trains_on_every_token(tok):
    """Every token up to the last turn's end of turn; the newline the template writes after it is not."""
    (ex,) = render_chat(CONVERSATION, tok, CHATML, train_on_prompt=True)
    assert ex.ids == render_chat(CONVERSATION, tok, CHATML)[0].ids
    assert all(ex.targets[:-1]) and not ex.targets[-1] and tok.decode(ex.ids[-2:]) == "<|im_end|>\n"


@pytest.mark.parametrize(("template", "multi_turn"), [("REWRITING", "auto"), ("CHATML", "each"),
                                                      ("LLAMA3_0", "each")])  # fmt: skip
def test_train_on_prompt_trains_each_token_of_a_conversation_once(tok, template, multi_turn):
    """One example a turn would train the system prompt and first exchange once per later answer (k
    times in a conversation of k answers): with data.train_on_prompt a conversation is one example, its
    last turn as inference sees it, every token of it a target once; the template's tail after the last
    end of turn (Llama 3.0's appended header) is not trained."""
    text = globals()[template]
    three = CONVERSATION + [
        {"role": "user", "content": "And a list?"},
        {"role": "assistant", "content": "Its items."},
    ]
    examples = render_chat(three, tok, text, multi_turn=multi_turn, train_on_prompt=True)
    assert len(examples) == 1, [tok.decode(e.ids) for e in examples]
    (ex,) = examples
    (last,) = render_chat(three, tok, text, multi_turn="last")
    assert ex.ids == last.ids  # the conversation as inference sees its last turn
    trained = tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t])
    assert trained.count("Answer in one sentence.") == 1 and trained.count("What does len() return?") == 1
    assert trained.endswith("Its items." + ("<|eot_id|>" if template == "LLAMA3_0" else "<|im_end|>"))


# Only the last assistant turn is shown in full (as templates that drop earlier reasoning do).
REWRITING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n...<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_rewrites_history_trains_each_turn_as_inference_sees_it(tok):
    """auto picks `each` by probing the template: turn 1 is trained in a conversation that ends with
    it; turn 2 after the history as the template renders history ('...'), as a second request would."""
    first, second = render_chat(CONVERSATION, tok, REWRITING)
    assert targets_text(first, tok) == ANSWERS[0] + "<|im_end|>"
    assert targets_text(second, tok) == ANSWERS[1] + "<|im_end|>"
    assert "<|im_start|>assistant\n...<|im_end|>" in prompt_text(second, tok)
    assert "And for a str?" not in tok.decode(first.ids)
    (last,) = render_chat(CONVERSATION, tok, REWRITING, multi_turn="last")
    assert last.ids == second.ids and last.targets == second.targets
    with pytest.raises(UserError, match="set data.multi_turn: each"):
        render_chat(CONVERSATION, tok, REWRITING, multi_turn="all")


def test_a_consistent_template_renders_once_under_every_strategy_but_last(tok):
    (one,) = render_chat(CONVERSATION, tok, CHATML, multi_turn="all")
    assert render_chat(CONVERSATION, tok, CHATML) == [one]
    each = render_chat(CONVERSATION, tok, CHATML, multi_turn="each")
    assert [targets_text(e, tok) for e in each] == [a + "<|im_end|>" for a in ANSWERS]
    assert each[1].ids == one.ids  # the last turn's example is the whole conversation
    (last,) = render_chat(CONVERSATION, tok, CHATML, multi_turn="last")
    assert last.ids == one.ids and targets_text(last, tok) == ANSWERS[1] + "<|im_end|>"


def test_prompt_completion(tok):
    ex = render_prompt_completion("Q: 2+2?\nA:", " 4", tok)
    assert targets_text(ex, tok) == " 4" + tok.eos_token and prompt_text(ex, tok) == "Q: 2+2?\nA:"
    assert all(render_prompt_completion("Q", "A", tok, train_on_prompt=True).targets)


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "x"}], "not a {role, content} mapping"),
        ([{"role": "user"}], "neither content nor tool_calls"),
        ([{"role": "bot", "content": "x"}], "role 'bot'"),
        ([{"role": "user", "content": "x"}], "no assistant message"),
        ([{"role": "assistant", "content": "x"}], "nothing before it to answer"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "content is int"),
        (
            [
                {"role": "user", "content": [{"type": "image", "url": "x"}]},
                {"role": "assistant", "content": "x"},
            ],
            "of type 'image'",
        ),
        (
            [{"role": "user", "content": "x", "training": True}, {"role": "assistant", "content": "x"}],
            "only assistant turns are targets",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x", "training": False}],
            "no assistant message",
        ),
    ],
)
def test_bad_conversations_are_named(messages, error):
    with pytest.raises(UserError, match=error) as e:
        check_conversation(messages, "data/chat.jsonl:3")
    assert "data/chat.jsonl:3" in str(e.value)


def test_an_answer_that_quotes_the_end_of_turn_token_is_trained_whole(tok):
    """A turn ends at its last end-of-turn token: an answer quoting the token (Mistral's `</s>` closes
    HTML strikethrough, `<s>old</s>`) keeps the rest of its text and its real end of turn as targets."""
    quoting = [{"role": "user", "content": "How do I end a turn?"},
               {"role": "assistant", "content": "Write <|im_end|> and then stop."}]  # fmt: skip
    for multi_turn in ("auto", "each"):
        (ex,) = render_chat(quoting, tok, CHATML, multi_turn=multi_turn)
        assert targets_text(ex, tok) == "Write <|im_end|> and then stop.<|im_end|>"
