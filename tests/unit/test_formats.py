"""The data formats people have (trainer/data/formats.py), each mapped by a declared preset or map and
passed to the template as the data holds it: ShareGPT, Alpaca, OpenAI messages with content parts and
tool calls, TRL's conversational prompt/completion; nothing dropped, stringified or guessed."""

import json

import pytest

from trainer import config
from trainer.common.errors import UserError
from trainer.data import build
from trainer.data.chat import check_conversation
from trainer.data.formats import conversation
from trainer.data.preview import examples_of
from trainer.data.sources import locator

TINY = "configs/experiments/tiny.yaml"


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def exp_for(tmp_path, path, *sets):
    return config.load(TINY, [f"data.train.files={path}", "data.eval_fraction=0", f"data.cache_dir={tmp_path / 'c'}",
                              "data.seq_len=256", "train.eval_every=0", *sets])  # fmt: skip


def trained(tmp_path, path, *sets):
    """The training rows' examples: (text, target text) each, in order."""
    exp = exp_for(tmp_path, path, *sets)
    d = build(exp.data, exp.seed)
    tok = d.tokenizer
    out = []
    for row in d.train:
        for ex in examples_of(row):
            out.append(
                (tok.decode(ex.ids), tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t]))
            )
    return out, d


def test_sharegpt(tmp_path):
    rows = [{"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."},
                                                        {"from": "human", "value": "Bye?"}, {"from": "gpt", "value": "Bye."}]}]  # fmt: skip
    out, d = trained(
        tmp_path, jsonl(tmp_path / "s.jsonl", rows), "data.train.kind=chat", "data.train.formatting=sharegpt"
    )
    ((text, targets),) = out
    assert text.startswith("<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\nHello.")
    assert targets == "Hello.<|endoftext|>Bye.<|endoftext|>"
    assert d.finetune["template"]["strategy"] == "all"


def test_sharegpt_function_calls_become_tool_calls_and_observations_tool_turns(tmp_path):
    row = {"conversations": [{"from": "human", "value": "Weather?"},
                             {"from": "function_call", "value": '{"name": "w", "arguments": {"city": "Oslo"}}'},
                             {"from": "observation", "value": "rain"}, {"from": "gpt", "value": "It rains."}],
           "tools": '[{"type": "function", "function": {"name": "w"}}]'}  # fmt: skip
    src = exp_for(tmp_path, jsonl(tmp_path / "s.jsonl", [row]), "data.train.kind=chat",
                  "data.train.formatting=sharegpt").data.train  # fmt: skip
    messages, tools, _ = conversation(row, src, "s.jsonl:1")
    conv = check_conversation(messages, "s.jsonl:1", tools)
    assert conv.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}  # fmt: skip
    assert conv.messages[2] == {"role": "tool", "content": "rain"} and conv.trained == (1, 3)
    assert conv.tools == [{"type": "function", "function": {"name": "w"}}]  # decoded from its JSON string


def test_format_map_renames_the_keys_and_roles(tmp_path):
    rows = [{"dialog": [{"speaker": "A", "text": "Hi?"}, {"speaker": "B", "text": "Hello."}]}]
    out, _ = trained(tmp_path, jsonl(tmp_path / "m.jsonl", rows), "data.train.kind=chat", "data.train.messages_field=dialog",
                     'data.train.format_map={"role": "speaker", "content": "text", "roles": {"A": "user", "B": "assistant"}}')  # fmt: skip
    assert out == [("<|user|>\nHi?\n<|assistant|>\nHello.<|endoftext|>\n", "Hello.<|endoftext|>")]


def test_alpaca(tmp_path):
    rows = [{"instruction": "Add.", "input": "2 and 3", "output": "5", "history": [["Hi?", "Hello."]]},
            {"instruction": "Say yes.", "input": "", "output": "Yes.", "system": "Be kind."}]  # fmt: skip
    out, _ = trained(
        tmp_path, jsonl(tmp_path / "a.jsonl", rows), "data.train.kind=chat", "data.train.formatting=alpaca"
    )
    assert out[0] == ("<|user|>\nHi?\n<|assistant|>\nHello.<|endoftext|>\n<|user|>\nAdd.\n2 and 3\n<|assistant|>\n"
                      "5<|endoftext|>\n", "Hello.<|endoftext|>5<|endoftext|>")  # fmt: skip
    assert out[1][0].startswith("<|system|>\nBe kind.\n<|user|>\nSay yes.\n<|assistant|>")


def test_content_parts_render_as_their_text_never_as_a_list(tmp_path):
    """The byte tokenizer's template reads content as a string: the text parts are joined with a
    newline (as vLLM serves them), where the list would have rendered as its Python repr."""
    parts = [{"type": "text", "text": "Two parts:"}, {"type": "text", "text": "one, two."}]
    rows = [
        {
            "messages": [
                {"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
            ]
        }
    ]
    out, d = trained(tmp_path, jsonl(tmp_path / "p.jsonl", rows), "data.train.kind=chat")
    assert out == [
        ("<|user|>\nTwo parts:\none, two.\n<|assistant|>\nYes.<|endoftext|>\n", "Yes.<|endoftext|>")
    ]
    assert "'type'" not in out[0][0] and d.finetune["template"]["parts"] is False


def test_trl_conversational_prompt_completion_trains_the_completion_only(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "Name?"}],
             "completion": [{"role": "assistant", "content": "Ann."}]}]  # fmt: skip
    out, _ = trained(tmp_path, jsonl(tmp_path / "t.jsonl", rows), "data.train.kind=prompt_completion")
    assert out == [("<|user|>\nHi?\n<|assistant|>\nHello.<|endoftext|>\n<|user|>\nName?\n<|assistant|>\nAnn.<|endoftext|>\n",
                    "Ann.<|endoftext|>")]  # fmt: skip


def test_a_training_false_turn_is_context_only(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Bad.", "training": False},
                          {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Good."}]}]  # fmt: skip
    out, _ = trained(tmp_path, jsonl(tmp_path / "f.jsonl", rows), "data.train.kind=chat")
    assert out[0][1] == "Good.<|endoftext|>" and "Bad." in out[0][0]


def test_keys_the_template_never_reads_are_reported(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Hi?", "lang": "en"},
                {"role": "assistant", "content": "Yo."},
            ]
        }
    ]
    _, d = trained(tmp_path, jsonl(tmp_path / "k.jsonl", rows), "data.train.kind=chat")
    assert d.finetune["template"]["unread_keys"] == {"lang": 1}
    from trainer.data.examples import describe_template

    assert "message keys the template never reads, so not rendered: lang (1 rows)" in describe_template(
        d.finetune
    )


def test_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yo."}]}
    path.write_text(json.dumps(good) + '\n\n{"messages": [{"content": "Hi?"}]}\n')
    src = exp_for(tmp_path, path, "data.train.kind=chat").data.train
    where = locator(src, "data.train")
    assert str(where(0)) == f"{path}:1" and f"{where(1)}" == f"{path}:3"  # the blank line is not a row
    with pytest.raises(UserError, match=f"{path}:3: message 0 is not a"):
        build(exp_for(tmp_path, path, "data.train.kind=chat").data, 0)
