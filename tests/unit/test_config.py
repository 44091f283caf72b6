"""Experiment loading: typed tree, overrides, and every problem reported at once."""

import textwrap

import pytest
from helpers import TINY
from pydantic import ValidationError

from trainer import config
from trainer.common.errors import ConfigError, UserError


def write(tmp_path, text, name="exp.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_tiny_loads_into_a_typed_immutable_tree():
    exp = config.load(TINY)
    assert exp.train.max_steps == 200 and exp.model.config["model_type"] == "gpt2"
    with pytest.raises(ValidationError, match="frozen"):
        exp.train.max_steps = 5
    with pytest.raises(TypeError):
        exp.model.config["n_layer"] = 1  # read-only mapping


def test_overrides_are_typed_by_the_field(tmp_path):
    exp = config.load(
        TINY,
        [
            "train.max_steps=7",
            "name=123",
            "strategy.zero_stage=2",
            "optim.lr=1e-3",
            "model.config.n_layer=2",
            "data.train.files=a.jsonl",
            "logging.progress=false",
        ],
    )
    assert exp.train.max_steps == 7 and exp.name == "123"  # str field keeps the text
    assert exp.strategy.zero_stage == 2 and exp.optim.lr == 1e-3
    assert exp.model.config["n_layer"] == 2  # free-form mapping: any sub-key
    assert exp.data.train.files == ["a.jsonl"] and exp.logging.progress is False


def test_defaults_yaml_set_precedence(tmp_path):
    p = write(
        tmp_path,
        """
        model: {config: {model_type: gpt2}}
        data: {train: {files: x.txt}}
        train: {max_steps: 5, micro_batch_size: 2}
    """,
    )
    exp = config.load(p, ["train.micro_batch_size=3"])
    assert exp.train.micro_batch_size == 3  # --set beats YAML
    assert exp.train.grad_accum == 1  # default
    assert exp.run_dir == "runs/experiment"


def test_every_problem_is_reported_at_once_with_lines(tmp_path):
    p = write(
        tmp_path,
        """\
        name: bad
        modle: {}
        model:
          confg: {model_type: gpt2}
        data:
          train: {files: x.txt}
          num_workers: -1
        train:
          micro_batch_size: -8
          max_steps: ten
          precision: fp8
        strategy:
          zero_stage: 5
          offload: cpu
    """,
    )
    with pytest.raises(ConfigError) as e:
        config.load(p)
    text = e.value.render()
    for needle in [
        ":2: modle: unknown top-level key. Did you mean 'model'?",
        ":4: model.confg: unknown key. Did you mean 'config'?",
        ":7: data.num_workers: must be auto or a whole number >= 0; got -1",
        ":9: train.micro_batch_size: must be auto or a number of sequences >= 1; got -8",
        ":10: train.max_steps: must be a valid integer",
        ":11: train.precision: must be one of: auto, fp32, bf16, fp16; got 'fp8'",
        ":13: strategy.zero_stage: must be one of: auto, 0, 1, 2, 3; got 5",
    ]:
        assert needle in text, f"missing {needle!r} in\n{text}"
    assert len(e.value.problems) == 7


def test_contradictions_are_reported_with_the_key_to_change(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(
            TINY,
            [
                "strategy.zero_stage=0",
                "strategy.offload=cpu",
                "model.config.n_positions=64",
                "model.pretrained=gpt2",
                "train.eval_every=5",
                "data.eval_fraction=0",
            ],
        )
    text = e.value.render()
    assert "strategy.offload: offload cpu runs at ZeRO stage 2 or 3" in text
    assert "give exactly one of model.config, model.pretrained, model.factory" in text
    assert "train.eval_every: evaluation is asked for but there is no eval data" in text


def test_compile_over_liger_kernels_is_refused():
    """torch.compile over Liger's Triton kernels trained the 1B Llama to a non-finite loss on an H100:
    the pair is refused with the reason, each alone is accepted."""
    with pytest.raises(ConfigError, match=r"train.compile: torch.compile over Liger-Kernel"):
        config.load(TINY, ["train.compile=true", "model.kernels=liger"])
    assert config.load(TINY, ["model.kernels=liger"]).model.kernels == "liger"
    assert config.load(TINY, ["train.compile=true"]).train.compile


def test_a_compile_mode_without_compile_is_refused():
    """train.compile_mode names a mode of torch.compile: without train.compile it would do nothing,
    silently; with it, the experiment loads."""
    with pytest.raises(ConfigError, match=r"train.compile_mode: reduce-overhead is a mode of torch.compile"):
        config.load(TINY, ["train.compile_mode=reduce-overhead"])
    assert (
        config.load(TINY, ["train.compile=true", "train.compile_mode=max-autotune"]).train.compile_mode
        == "max-autotune"
    )


def test_seq_len_longer_than_positions(tmp_path):
    with pytest.raises(ConfigError, match=r"data.seq_len: 128 is longer than the model's n_positions=64"):
        config.load(TINY, ["model.config.n_positions=64"])


def test_yaml_syntax_error_carries_the_line(tmp_path):
    p = write(tmp_path, "model:\n  config: {a: 1\ndata: x\n")
    with pytest.raises(ConfigError) as e:
        config.load(p)
    assert e.value.problems[0].line == 3 and "invalid YAML" in e.value.render()


def test_duplicate_keys_are_errors(tmp_path):
    p = write(tmp_path, "train: {max_steps: 1}\ntrain: {max_steps: 2}\n")
    with pytest.raises(ConfigError, match="duplicate key"):
        config.load(p)


def test_set_of_a_missing_key_names_the_nearest(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(TINY, ["train.max_stepz=3"])
    assert "no such key 'max_stepz' in train. Did you mean 'max_steps'?" in e.value.render()
    assert "[--set]" in e.value.render()


def test_set_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="is a value, not a section"):
        config.load(TINY, ["train.max_steps.x=3"])


def test_missing_file():
    with pytest.raises(UserError, match="does not exist"):
        config.load("nope/exp.yaml")


def test_sizes_parse():
    assert config.parse_size("80GB") == 80 * 2**30
    assert config.parse_size("512 MiB") == 512 * 2**20
    assert config.parse_size(1000) == 1000
    with pytest.raises(ValueError):
        config.parse_size("lots")


def test_resolved_yaml_round_trips(tmp_path):
    exp = config.load(TINY, ["train.max_steps=9"])
    p = tmp_path / "resolved.yaml"
    p.write_text(exp.to_yaml())
    assert config.load(p) == exp


def test_describe_covers_every_field():
    keys = {row[0] for row in config.describe()}
    assert {"train.micro_batch_size", "strategy.zero_stage", "logging.wandb.mode", "data.train.files"} <= keys
    assert all(row[3] for row in config.describe()), "every field has a description"


def test_the_lock_wait_stays_below_the_collective_timeout():
    """checkpoint.lock_wait_s (issue 69): the other ranks wait for rank 0's lock in a collective, which
    dist.timeout_s bounds; a wait as long is refused naming both keys, a negative one by its type."""
    assert config.load(TINY, ["checkpoint.lock_wait_s=0"]).checkpoint.lock_wait_s == 0
    with pytest.raises(ConfigError) as e:
        config.load(TINY, ["checkpoint.lock_wait_s=600"])
    assert "checkpoint.lock_wait_s" in str(e.value) and "dist.timeout_s" in str(e.value)
    assert (
        config.load(TINY, ["checkpoint.lock_wait_s=600", "dist.timeout_s=900"]).checkpoint.lock_wait_s == 600
    )
    with pytest.raises(ConfigError, match="checkpoint.lock_wait_s"):
        config.load(TINY, ["checkpoint.lock_wait_s=-1"])
    # unset, it follows a short dist.timeout_s (a test's 15 s was refused over a default the user never wrote)
    from trainer.run.rundir import lock_wait

    short = config.load(TINY, ["dist.timeout_s=15"])
    assert (
        short.checkpoint.lock_wait_s is None and lock_wait(None, 15) == 7.5 and lock_wait(None, 1800) == 300
    )
