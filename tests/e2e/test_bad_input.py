"""Bad input through the real CLI: exit code 2, no traceback, a message naming the key and the fix."""

import json

import pytest
from helpers import TINY, bin_train, data_cache

pytestmark = pytest.mark.e2e


def run(args, tmp_path):
    p = bin_train(*args)
    return p.returncode, p.stderr + p.stdout


def tiny(tmp_path, *sets):
    # The session's data cache: tiny's model shape is counted once there, so the cases that fail at
    # planning or later do not each build the model (the data cases key their own entries).
    args = [TINY, "--set", f"run_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={data_cache()}"]
    for s in sets:
        args += ["--set", s]
    return args


def yaml_file(tmp_path, text, name="exp.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def template(tmp_path, d):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(d) if isinstance(d, dict) else d)
    return p


BASE = (
    "model: {config: {model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2, n_positions: 64}}\n"
    "data: {train: {files: data/tiny/python_docs.jsonl}, seq_len: 32}\ntrain: {max_steps: 2}\n"
)

BAD_JSON = '{"zero_optimization": {"stage": 2,}}'

CASES = {
    # name: (args builder, substrings that must appear: key, and the fix)
    "unknown top-level key": (
        lambda t: [yaml_file(t, BASE + "trian: {}\n")],
        ["trian", "Did you mean 'train'"],
    ),
    "typo in a nested key": (
        lambda t: [yaml_file(t, BASE.replace("max_steps: 2", "max_steps: 2, micro_batchsize: 2"))],
        ["train.micro_batchsize", "Did you mean 'micro_batch_size'"],
    ),
    "wrong type": (
        lambda t: [yaml_file(t, BASE.replace("max_steps: 2", "max_steps: two"))],
        ["train.max_steps", "valid integer", "optimizer steps to train"],
    ),
    "negative batch": (
        lambda t: tiny(t, "train.micro_batch_size=-4"),
        ["train.micro_batch_size", "must be auto or a number of sequences >= 1"],
    ),
    "stage 5": (lambda t: tiny(t, "strategy.zero_stage=5"), ["strategy.zero_stage", "auto, 0, 1, 2, 3"]),
    "sequence parallel over more ranks than run": (
        lambda t: tiny(t, "strategy.sequence_parallel=2"),
        [
            "strategy.sequence_parallel: 2 cannot run this job: 1 rank(s) are not a multiple of 2",
            "or 1 (off)",
        ],
    ),
    "sequence parallel not dividing the heads": (
        lambda t: tiny(t, "strategy.sequence_parallel=3", "data.seq_len=129"),
        [
            "strategy.sequence_parallel: 3",
            "4 attention heads do not divide by 3",
            "give a degree that divides",
        ],
    ),
    "sequence parallel not dividing the sequence": (
        lambda t: tiny(t, "strategy.sequence_parallel=2", "data.seq_len=127"),
        ["strategy.sequence_parallel", "2 does not divide data.seq_len 127", "give a degree that divides it"],
    ),
    "sequence parallel for a family Ulysses cannot wrap": (
        lambda t: tiny(
            t,
            "strategy.sequence_parallel=2",
            "model.attn_implementation=sdpa",
            "model.config={model_type: falcon, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4}",
        ),
        [
            "strategy.sequence_parallel: 2",
            "model type 'falcon'",
            "do not call transformers' attention functions",
            "set it to 1 (off)",
        ],
    ),  # fmt: skip
    "missing data files": (
        lambda t: tiny(t, "data.train.files=nope/*.jsonl"),
        ["data.train.files", "'nope/*.jsonl' matches no file", "check the path"],
    ),
    "empty dataset": (
        lambda t: [*tiny(t, f"data.train.files={_empty(t)}")],
        ["data.train", "empty", "point it at data"],
    ),
    "too little data for seq_len": (
        lambda t: [*tiny(t, f"data.train.files={_short(t)}")],
        ["data.train makes 1 sequence(s) of data.seq_len 128", "add data or lower data.seq_len"],
    ),
    "seq_len beyond the model's positions": (
        lambda t: tiny(t, "data.seq_len=512"),
        ["data.seq_len", "n_positions=256", "lower data.seq_len"],
    ),
    "template contradicts the experiment": (
        lambda t: tiny(
            t,
            f"strategy.deepspeed={template(t, {'train_micro_batch_size_per_gpu': 2, 'zero_optimization': {'stage': 2}})}",
        ),
        ["train_micro_batch_size_per_gpu: template says 2, the experiment says 8", "one source of truth"],
    ),
    "malformed YAML": (
        lambda t: [yaml_file(t, "model:\n  config: {model_type: gpt2\ndata: x\n")],
        ["exp.yaml:3", "invalid YAML"],
    ),
    "unknown template path": (
        lambda t: tiny(t, "strategy.deepspeed=configs/deepspeed/zero9.json"),
        ["strategy.deepspeed", "does not exist", "configs/deepspeed/zero2.json"],
    ),
    "--set of a missing key": (
        lambda t: tiny(t, "train.max_stepz=3"),
        ["train.max_stepz", "Did you mean 'max_steps'"],
    ),
    "unknown top-level key in a DeepSpeed template": (
        lambda t: tiny(
            t,
            f"strategy.deepspeed={template(t, {'train_batch_sizee': 32, 'zero_optimization': {'stage': 0}})}",
        ),
        ["train_batch_sizee", "Did you mean 'train_batch_size'", "allow_deepspeed_keys"],
    ),
    "template JSON syntax": (
        lambda t: tiny(t, "strategy.deepspeed=" + str(template(t, BAD_JSON))),
        ["ds.json:1: invalid JSON"],
    ),
    "offload without ZeRO": (
        lambda t: tiny(t, "strategy.zero_stage=0", "strategy.offload=cpu"),
        ["strategy.offload", "set zero_stage to 2, 3 or auto"],
    ),
    "duplicate key": (lambda t: [yaml_file(t, BASE + "train: {max_steps: 3}\n")], ["train", "duplicate key"]),
    "experiment file missing": (lambda t: [t / "nope.yaml"], ["nope.yaml does not exist"]),
    "--set without =": (lambda t: tiny(t, "train.max_steps"), ["expected KEY=VALUE"]),
    "two model sources": (
        lambda t: tiny(t, "model.pretrained=gpt2"),
        ["model", "exactly one of model.config, model.pretrained"],
    ),
    "unknown tokenizer path": (
        lambda t: tiny(t, f"data.tokenizer={t / 'no-tokenizer'}"),
        ["data.tokenizer", "cannot load"],
    ),
    "fp16 on a machine without a GPU": (
        lambda t: tiny(t, "train.precision=fp16"),
        ["tiny.yaml", "train.precision: fp16 needs a CUDA GPU", "--set train.precision=bf16"],
    ),
    "run_dir is a file": (
        lambda t: tiny(t, f"run_dir={_empty(t)}"),
        ["run_dir", "is a file, not a directory", "choose another run_dir"],
    ),
    "json field missing": (
        lambda t: tiny(t, "data.train.text_field=body"),
        ["data.train.text_field", "'body' is not a column", "topic, text"],
    ),
    "chat data without its column": (
        lambda t: tiny(t, "data.train.kind=chat"),
        [
            "data.train.messages_field",
            "'messages' is not a column of the data (data.train.kind: chat)",
            "topic, text",
        ],
    ),
    "packing on an unverified model type": (
        lambda t: tiny(
            t,
            f"data.train.files={_chat(t)}",
            "data.train.kind=chat",
            "model.config.model_type=opt",
            "model.config.hidden_size=32",
            "model.config.num_hidden_layers=1",
            "model.config.ffn_dim=64",
            "model.config.num_attention_heads=2",
            "model.config.word_embed_proj_dim=32",
            "model.config.max_position_embeddings=256",
        ),  # fmt: skip
        [
            "data.packing",
            "model type 'opt'",
            "does not train as its examples one by one",
            "set data.packing: false",
        ],
    ),
    "a chat template that is not Jinja": (
        lambda t: tiny(
            t,
            f"data.train.files={_chat(t)}",
            "data.train.kind=chat",
            f"data.chat_template={_text(t, 'bad.jinja', '{% for m in %}{{ m }}{% endfor %}')}",
        ),  # fmt: skip
        ["data.chat_template", "bad.jinja", "is not valid Jinja", "line 1"],
    ),
    "a conversation with an unknown role names its file and line": (
        lambda t: tiny(t, f"data.train.files={_bad_chat(t)}", "data.train.kind=chat"),
        ["bad_chat.jsonl:3", "message 1 has role 'bot'", "format_map.roles"],
    ),
    "a tool call the template never reads": (
        lambda t: tiny(t, f"data.train.files={_tool_chat(t)}", "data.train.kind=chat"),
        [
            "tool_chat.jsonl:1",
            "message 1 has 'tool_calls', which the chat template never renders",
            "data.chat_template",
        ],
    ),
    "formatting on text": (
        lambda t: tiny(t, "data.train.formatting=sharegpt"),
        ["data.train.formatting", "set data.train.kind: chat"],
    ),
    "a format_map key the formatting does not have": (
        lambda t: tiny(
            t,
            f"data.train.files={_chat(t)}",
            "data.train.kind=chat",
            "data.train.formatting=sharegpt",
            'data.train.format_map={"speaker": "who"}',
        ),  # fmt: skip
        ["data.train.format_map.speaker", "not a key of formatting sharegpt", "role, content, roles, system"],
    ),
    "a role map to no role": (
        lambda t: tiny(
            t,
            f"data.train.files={_chat(t)}",
            "data.train.kind=chat",
            'data.train.format_map={"roles": {"bot": "robot"}}',
        ),  # fmt: skip
        ["data.train.format_map.roles.bot", "'robot' is not a role"],
    ),
    "multi_turn nonsense": (
        lambda t: tiny(t, "data.multi_turn=sometimes"),
        ["data.multi_turn", "all", "each", "last"],
    ),
    "group_by_length with packing": (
        lambda t: tiny(
            t, f"data.train.files={_chat(t)}", "data.train.kind=chat", "data.group_by_length=true"
        ),
        ["data.group_by_length", "data.packing: false"],
    ),
    "a pretrained directory without config.json": (
        lambda t: [
            *tiny(t, "model.config=null", f"model.pretrained={_dir(t, 'empty_model', 'weights.bin')}"),
            "--plan",
        ],
        [
            "model.pretrained",
            "empty_model",
            "the directory has no config.json (it holds weights.bin)",
            "save_pretrained",
        ],
    ),
    "a hostfile host that does not resolve": (
        lambda t: [
            *tiny(t),
            "--launcher",
            "deepspeed",
            "--hostfile",
            _text(t, "hostfile", "127.0.0.1 slots=1\nno-such-node.invalid slots=1\n"),
        ],
        ["--hostfile", "host 'no-such-node.invalid' does not resolve", "fix the name or the resolver"],
    ),
    "a tokenizer directory without a tokenizer": (
        lambda t: tiny(t, f"data.tokenizer={_dir(t, 'tok', 'notes.txt')}"),
        ["data.tokenizer", "cannot load", "a local tokenizer directory"],
    ),  # fmt: skip
    "a pair with an empty response": (
        lambda t: [
            *tiny(
                t,
                f"data.train.files={_prefs(t, rejected='')}",
                "data.train.kind=preference",
                "train.objective=dpo",
            ),
            "--preview-data",
            "1",
        ],
        ["prefs.jsonl:3", "rejected is empty", "a pair needs two responses"],
    ),
    "a pair whose prompts do not match": (
        lambda t: [
            *tiny(
                t,
                f"data.train.files={_prefs(t, mismatched=True)}",
                "data.train.kind=preference",
                "train.objective=dpo",
            ),
            "--preview-data",
            "1",
        ],
        ["prefs.jsonl:3", "chosen and rejected do not begin with the same prompt", "prompts do not match"],
    ),
    "preference data under objective sft": (
        lambda t: tiny(t, f"data.train.files={_prefs(t)}", "data.train.kind=preference"),
        ["train.objective", "data is of kind preference", "set train.objective: dpo"],
    ),
    "a preference objective on text": (
        lambda t: tiny(t, "train.objective=dpo"),
        ["data.train.kind", "train.objective dpo trains on pairs", "give data of kind preference"],
    ),
    "a beta of zero": (
        lambda t: tiny(
            t,
            f"data.train.files={_prefs(t)}",
            "data.train.kind=preference",
            "train.objective=dpo",
            "train.preference.beta=0",
        ),
        ["train.preference.beta", "greater than 0"],
    ),  # fmt: skip
    "a negative preview": (
        lambda t: [*tiny(t), "--preview-data", "-1"],
        ["--preview-data", "give a count of 0 or more"],
    ),
}


def _text(t, name, text):
    p = t / name
    p.write_text(text)
    return p


def _dir(t, name, file):
    d = t / name
    d.mkdir(exist_ok=True)
    (d / file).write_text("x")
    return d


def _prefs(t, rejected="a wrong answer", mismatched=False):
    """Four pairs; the third with `rejected` as its rejected response, or (`mismatched`) as whole
    conversations that begin with different prompts."""
    row = {"prompt": "q?", "chosen": "the answer", "rejected": "a wrong answer"}
    third = {**row, "rejected": rejected}
    if mismatched:  # TRL's implicit prompt: whole conversations, their shared beginning the prompt
        turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
        row = {
            "chosen": turn("user", "q") + turn("assistant", "a"),
            "rejected": turn("user", "q") + turn("assistant", "b"),
        }
        third = {
            "chosen": turn("user", "q1") + turn("assistant", "a"),
            "rejected": turn("user", "q2") + turn("assistant", "b"),
        }
    return _text(t, "prefs.jsonl", "\n".join(json.dumps(x) for x in (row, row, third, row)) + "\n")


def _bad_chat(t):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
    return _text(t, "bad_chat.jsonl", "\n".join(json.dumps(x) for x in (good, good, bad, good)) + "\n")


def _tool_chat(t):
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    row = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
    }
    return _text(t, "tool_chat.jsonl", json.dumps(row) + "\n")


def _chat(t):
    from helpers import chat_data

    return chat_data(t / "chat.jsonl", rows=40)


def _empty(t):
    p = t / "empty.jsonl"
    p.write_text("")
    return p


def _short(t):
    p = t / "short.jsonl"
    p.write_text(json.dumps({"text": "too short"}) + "\n")
    return p


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_a_clear_message(tmp_path, name):
    build, needles = CASES[name]
    code, out = run(build(tmp_path), tmp_path)
    assert code == 2, f"exit {code}\n{out}"
    assert "Traceback" not in out, out
    assert out.lstrip().startswith("error:"), out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


def test_no_experiment_is_a_usage_error(tmp_path):
    code, out = run([], tmp_path)
    assert code == 2 and "no experiment file given" in out


def test_a_malformed_port_range_exits_2_naming_the_variable(tmp_path):
    p = bin_train(*tiny(tmp_path, "train.max_steps=1"), env={"TRAINER_PORTS": "29500"})
    out = p.stderr + p.stdout
    assert p.returncode == 2 and "Traceback" not in out, out
    assert "error: TRAINER_PORTS='29500': expected LO-HI, the first and last port, e.g. 20000-20999" in out
