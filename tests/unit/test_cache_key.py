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
from trainer.data.keys import NOT_IN_THE_TOKENS, cache_key
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
    "packing": False, "separate_documents": True, "truncation": "drop", "image_max_pixels": 4096,
    "image_min_pixels": 64, "max_images": 2,
}  # fmt: skip
SOURCE = {
    "files": "FILES", "hub": None, "name": "cfg", "split": "validation", "format": "json", "text_field": "body",
    "kind": "prompt_completion", "prompt_field": "question", "completion_field": "answer", "chosen_field": "good",
    "rejected_field": "bad", "messages_field": "conversation", "tools_field": "functions", "formatting": "sharegpt",
    "format_map": {"roles": {"human": "user"}}, "weight": 2.0, "sample_by": "line", "images_field": "pictures",
    "image_field": "picture", "margin_field": "score", "label_field": "liked",
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


def test_the_key_covers_the_code_that_makes_the_tokens(tmp_path):
    """Issue 54, finding 2: the end-of-turn fix changed the tokens a conversation produces (250 targets
    became 500) under the same key, so a cache built before was reused and a resume saw no data change.
    The key holds the digest of every module that makes the tokens: a change to any of them (even a
    comment) changes it."""
    from pathlib import Path

    from trainer.data import keys as cache

    src = Path(cache.__file__).parent
    copy = tmp_path / "data"
    shutil.copytree(src, copy)
    before = cache.code_digest(copy)
    assert before == cache.code_digest(src)
    for name in cache.TOKEN_MODULES:
        f = copy / f"{name}.py"
        original = f.read_bytes()
        f.write_bytes(original + b"\n# changed\n")
        assert cache.code_digest(copy) != before, f"{name}.py changed and the key did not"
        f.write_bytes(original)
    assert cache.code_digest(copy) == before
    schema = tmp_path / "data_schema.py"  # the roles and column maps the formats read
    schema.write_bytes(cache.SCHEMA.read_bytes() + b"\n# changed\n")
    assert cache.code_digest(copy, schema) != before


# trainer modules a cache build runs that do not shape tokens: configuration, errors, files and locks, the
# cores to use
NOT_TOKEN_CODE = {
    "trainer",
    "trainer.config",
    "trainer.config.schema",
    "trainer.config.data_schema",
    "trainer.config.fields",
    "trainer.config.loading",
    "trainer.config.rules",
    "trainer.common.errors",
    "trainer.common.files",
    "trainer.cluster.dist",
    "trainer.common.units",
    "trainer.data",
    "trainer.data.stream",
    "trainer.data.preview",
    "trainer.data.keys",
}  # fmt: skip  (keys: the key itself)


def test_every_module_a_cache_build_runs_is_in_the_key(tmp_path, base):
    """The modules whose functions run while a chat cache and a text cache are built: each either keys the
    cache (TOKEN_MODULES) or is listed above as not shaping tokens. A module added to the token path
    without joining the key fails here."""
    import sys

    from trainer.data import cache

    ran = set()

    def tracer(frame, event, arg):
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            if mod.startswith("trainer"):
                ran.add(mod)
        return None

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello world " * 40}) + "\n")
    sections = [
        {**base, "eval_fraction": 0},
        {
            "train": {"files": str(text)},
            "cache_dir": str(tmp_path / "cache2"),
            "seq_len": 16,
            "eval_fraction": 0,
        },
    ]
    sys.setprofile(tracer)
    try:
        for sec in sections:
            cache.build(config.DataSection(**sec), seed=0, num_proc=1, progress=False)
    finally:
        sys.setprofile(None)
    from trainer.data.keys import TOKEN_MODULES

    keyed = {f"trainer.data.{m}" for m in TOKEN_MODULES}
    assert ran - keyed - NOT_TOKEN_CODE == set(), "modules that run in a cache build but do not key it"
    assert {"trainer.data.pack", "trainer.data.chat", "trainer.data.cache"} <= ran


def test_a_rebuilt_cache_says_why(tmp_path, base):
    """The first cache of some files is built silently; one built again for the same files (its key
    changed) says what changed since the newest earlier cache."""
    from trainer.data import cache

    section = config.DataSection(**base, eval_fraction=0)
    first = cache.build(section, seed=0, num_proc=1, progress=False)
    assert first.built and first.rebuilt is None
    again = cache.build(section, seed=0, num_proc=1, progress=False)
    assert not again.built
    from trainer.data import keys

    keys._CODE[:] = ["0" * 20]  # as if trainer/data's code had changed
    try:
        changed = cache.build(section, seed=0, num_proc=1, progress=False)
    finally:
        keys._CODE.clear()
    assert changed.built and changed.cache_path != first.cache_path
    assert changed.rebuilt == keys.WHY["code"], changed.rebuilt  # that alone: not the files, not the template
