"""The data cache's key (trainer/data/cache.py: cache_key) is a property of everything that determines
the cached tokens: change any one input (every option of the data section and of a source, every file
of the tokenizer, the chat template, the data files) and the key changes; the options that do not
determine tokens (NOT_IN_THE_TOKENS) leave it as it is. A key that missed one served a stale cache,
and a resume did not notice either (tokenizer_config.json's eos_token edited gave the same key)."""

import hashlib
import json
import shutil

import pytest
from helpers import tokenizer_dir

from trainer import config
from trainer.data.cache import NOT_IN_THE_TOKENS, cache_key
from trainer.data.tokenizer import load_tokenizer


def digest(section, tok=None):
    tok = tok or load_tokenizer(section.tokenizer)
    return hashlib.sha256(json.dumps(cache_key(section, tok), sort_keys=True).encode()).hexdigest()


@pytest.fixture
def base(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        + "\n"
    )
    template = tmp_path / "t.jinja"
    from trainer.data.templates import BYTE_TEMPLATE

    template.write_text(BYTE_TEMPLATE)
    return {"train": {"files": str(chat), "kind": "chat"}, "cache_dir": str(tmp_path / "cache"),
            "chat_template": str(template)}  # fmt: skip


# For every option, a valid other value (a callable of the base section's value where it depends on it).
SECTION = {
    "eval": {"files": "EVAL", "kind": "chat"}, "eval_fraction": 0.2, "tokenizer": "TOKENIZER", "seq_len": 64,
    "append_eos": False, "num_workers": 3, "pin_memory": False, "persistent_workers": False, "num_proc": 2,
    "shuffle": False, "cache_dir": "OTHER_CACHE", "chat_template": "TEMPLATE", "train_on_prompt": True,
    "multi_turn": "each", "chat_template_kwargs": {"enable_thinking": False}, "group_by_length": True,
    "packing": False, "separate_documents": True, "truncation": "drop",
}  # fmt: skip
SOURCE = {
    "files": "FILES", "hub": None, "name": "cfg", "split": "validation", "format": "json", "text_field": "body",
    "kind": "prompt_completion", "prompt_field": "question", "completion_field": "answer", "chosen_field": "good",
    "rejected_field": "bad", "messages_field": "conversation", "tools_field": "functions", "formatting": "sharegpt",
    "format_map": {"roles": {"human": "user"}}, "weight": 2.0, "sample_by": "line",
}  # fmt: skip


def test_every_option_is_listed_here():
    """A new option must say whether it keys the cache: this test lists every option with another value."""
    assert set(SECTION) | {"train"} == set(config.DataSection.model_fields)
    assert set(SOURCE) == set(config.DataSource.model_fields)


@pytest.mark.parametrize("name", sorted(SECTION))
def test_each_data_option_changes_the_key_unless_it_leaves_the_tokens_alone(base, tmp_path, name):
    value = SECTION[name]
    files = {"EVAL": base["train"]["files"], "OTHER_CACHE": str(tmp_path / "c2")}
    if value == "TOKENIZER":
        d = tmp_path / "tok"
        load_tokenizer("byte").save_pretrained(d)
        value = str(d)
    elif value == "TEMPLATE":
        other = tmp_path / "other.jinja"
        other.write_text((tmp_path / "t.jinja").read_text().replace("\\n", "\\n\\n"))
        value = str(other)
    elif isinstance(value, dict) and "files" in value:
        value = {**value, "files": files[value["files"]]}
    elif isinstance(value, str) and value in files:
        value = files[value]
    before = digest(config.DataSection.model_validate(base))
    after = digest(config.DataSection.model_validate({**base, name: value}))
    assert (after != before) == (name not in NOT_IN_THE_TOKENS), name


@pytest.mark.parametrize("name", sorted(SOURCE))
def test_each_source_option_changes_the_key(base, tmp_path, name):
    value = SOURCE[name]
    train = dict(base["train"])
    if name in ("files", "hub"):  # another file of the same content; a hub id instead of files
        other = tmp_path / "same.jsonl"
        shutil.copy(train["files"], other)
        value = str(other)
    if name == "hub":
        train.pop("files")
        value = "someone/dataset"
    if name == "kind":
        (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    before = digest(config.DataSection.model_validate(
        {**base, "train": {**train, "hub": "someone/other"} if name == "hub" else train}))  # fmt: skip
    after = digest(config.DataSection.model_validate({**base, "train": {**train, name: value}}))
    assert after != before, name


def test_the_data_files_key_by_content_stamp(base, tmp_path):
    """An edit of a data file (another size, or the same size later) is another key."""
    section = config.DataSection.model_validate(base)
    before = digest(section)
    path = tmp_path / "chat.jsonl"
    path.write_text(path.read_text().replace('"a"', '"b"'))  # the same size
    import os

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert digest(section) != before


EDITS = {  # the Llama 3.2 tokenizer's files, each edited as a user would, each edit changing the tokens
    "tokenizer_config.json eos_token": ("tokenizer_config.json", lambda d: {**d, "eos_token": "<|end_of_text|>"}),
    "tokenizer_config.json chat_template": (
        "tokenizer_config.json", lambda d: {**d, "chat_template": d["chat_template"].replace("\n\n", "\n")}),
    "tokenizer.json post_processor (no BOS)": ("tokenizer.json", lambda d: {**d, "post_processor": None}),
    "tokenizer.json normalizer": ("tokenizer.json", lambda d: {**d, "normalizer": {"type": "NFKC"}}),
    "tokenizer.json an added token's special flag": ("tokenizer.json", lambda d: {
        **d, "added_tokens": [{**t, "special": not t["special"]} if t["id"] == 128010 else t for t in d["added_tokens"]]}),
    "tokenizer.json merges": ("tokenizer.json", lambda d: {
        **d, "model": {**d["model"], "merges": d["model"]["merges"][1:] + d["model"]["merges"][:1]}}),
}  # fmt: skip


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_each_tokenizer_file_edit_changes_the_key(base, tmp_path, edit):
    src = tokenizer_dir("llama3_2")
    d = tmp_path / "llama"
    shutil.copytree(src, d)
    section = config.DataSection.model_validate({**base, "tokenizer": str(d), "chat_template": None})
    before = digest(section)
    name, change = EDITS[edit]
    data = json.loads((d / name).read_text())
    (d / name).write_text(json.dumps(change(data)))
    assert digest(section) != before, edit
