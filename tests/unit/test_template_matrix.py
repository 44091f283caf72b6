"""The template matrix: for every chat template the tests hold (the four families' published ones,
Llama 3.0's as first published, and a small synthetic one of each shape: generation markers, content
trimmed, a generation prompt after every rendering, the system prompt in the last user turn only,
history rewritten), every conversation shape (one exchange; a system prompt and two; three), and
every data.multi_turn strategy: each trained assistant turn's targets are exactly the text the
template renders for that turn, its content (as the template writes it) up to and including its
end-of-turn token and nothing after it; a turn trained on its own follows the prompt inference sees,
`apply_chat_template(messages[:i], add_generation_prompt=True)`; and where the template has
`{% generation %}` markers the targets are transformers' own assistant mask."""

import pytest
from helpers import tokenizer_dir
from test_chat import CHATML, LLAMA3, LLAMA3_0, REWRITING, SPECIAL

from trainer.common.errors import UserError
from trainer.data.chat import render_chat
from trainer.data.tokenizer import byte_tokenizer

# The system prompt in the last user turn only (Mistral's published templates do so), EOS after answers.
SYSTEM_LAST = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' -%}"
    "{%- set loop_messages = messages[1:] if system else messages -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}[INST] {% if loop.last and system %}{{ system }}\n\n{% endif %}{{ m['content'] }} [/INST]"
    "{%- else %} {{ m['content'] }}<|im_end|>{% endif -%}{%- endfor -%}"
)

# name -> (tokenizer, template (None: the tokenizer's), what a trained turn renders: (prefix, end of turn)
# of the turn's content, whether the content is trimmed)
TEMPLATES = {
    "markers": ("test", CHATML, ("", "<|im_end|>")),
    "trimmed": ("test", LLAMA3, ("", "<|eot_id|>")),
    "generation prompt always": ("test", LLAMA3_0, ("", "<|eot_id|>")),
    "system in the last user turn": ("test", SYSTEM_LAST, (" ", "<|im_end|>")),
    "history rewritten": ("test", REWRITING, ("", "<|im_end|>")),
    "llama3_2": ("llama3_2", None, ("", "<|eot_id|>")),
    "llama3_0 published": (
        "llama3_2",
        LLAMA3_0.replace("'<|begin_of_text|>'", "bos_token"),
        ("", "<|eot_id|>"),
    ),
    "qwen3": ("qwen3", None, ("<think>\n\n</think>\n\n", "<|im_end|>")),
    "gemma3": ("gemma3", None, ("", "<end_of_turn>")),
    "mistral_nemo": ("mistral_nemo", None, ("", "</s>")),
}
SHAPES = {
    "one exchange": [("user", "What does len() return?"), ("assistant", "  The number of items. ")],
    "system and two": [("system", "Answer briefly."), ("user", "Hi"), ("assistant", "Hello."), ("user", "And 2 + 2?"),
                       ("assistant", "Four.")],
    "three exchanges": [("user", "One?"), ("assistant", "1."), ("user", "Two?"), ("assistant", "2."), ("user", "Three?"),
                        ("assistant", "3.")],
}  # fmt: skip
KWARGS = {"date_string": "26 Jul 2024"}  # Llama 3.2's template dates its system prompt
_tokenizers = {}


def tokenizer(name):
    if name not in _tokenizers:
        if name == "test":
            t = byte_tokenizer()
            t.add_special_tokens({"additional_special_tokens": SPECIAL})
        else:
            from transformers import AutoTokenizer

            t = AutoTokenizer.from_pretrained(tokenizer_dir(name))
        _tokenizers[name] = t
    return _tokenizers[name]


def runs(ex, tok):
    """The example's targets as the texts of its runs of consecutive target tokens."""
    out, cur = [], []
    for i, t in zip(ex.ids, ex.targets, strict=True):
        if t:
            cur.append(i)
        elif cur:
            out, cur = out + [tok.decode(cur)], []
    return out + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("multi_turn", ["auto", "all", "each", "last"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_turns_targets_are_the_text_the_template_renders_for_it(name, shape, multi_turn):
    tok_name, template, (head, eot) = TEMPLATES[name]
    tok = tokenizer(tok_name)
    template = template or tok.chat_template
    messages = [{"role": r, "content": c} for r, c in SHAPES[shape]]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trim = name in ("trimmed", "generation prompt always", "llama3_0 published", "llama3_2", "gemma3")

    def turn_text(i):
        content = messages[i]["content"].strip() if trim else messages[i]["content"]
        return head + content + eot

    try:
        examples = render_chat(messages, tok, template, multi_turn=multi_turn, kwargs=KWARGS)
    except UserError as e:  # a strategy the template cannot serve must say so, not train otherwise
        assert multi_turn == "all", str(e)
        return
    got = [runs(ex, tok) for ex in examples]
    if len(examples) == 1 and multi_turn != "last" and len(answers) > 1:  # rendered once: every turn
        assert got == [[turn_text(i) for i in answers]], (got, name)
    else:  # one example a turn (each; last: the final one), after the prompt inference sees for it
        trained = answers[-1:] if multi_turn == "last" else answers
        assert got == [[turn_text(i)] for i in trained], (got, name)
        for ex, i in zip(examples, trained, strict=True):
            prompt = tok.apply_chat_template(messages[:i], chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **KWARGS)  # fmt: skip
            first = ex.targets.index(True)
            assert tok.decode(ex.ids[:first]) == prompt, (tok.decode(ex.ids[:first]), prompt)
    if "{% generation %}" in template and multi_turn != "last":  # transformers' own mask: the same tokens
        hf = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)  # fmt: skip
        whole = [ex for ex in examples if len(ex.ids) == len(hf["input_ids"])]
        if len(examples) == 1:
            assert whole[0].ids == hf["input_ids"] and whole[0].targets == [
                bool(x) for x in hf["assistant_masks"]
            ]
