"""What GRPO's reward functions log and where it goes (issue 60 and its review): log_metric's scalars in the log
line, log_extra's columns in completions.jsonl, each reward's metrics and column under a label of its own,
the run's own fields never replaced by what a function logs, and bin/report's completions lines from any
completions.jsonl."""

import json
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from test_grpo_rewards import IDS, TEXTS, batch  # noqa: E402

from trainer.rl import rewards as R  # noqa: E402


def test_log_metric_and_log_extra_reach_the_log_line_and_the_completions_log(tmp_path):
    from trainer.objectives.grpo_metrics import RLMetrics
    from trainer.rl.completions import CompletionLog

    def scorer(completions, log_metric, log_extra, **kw):
        log_metric("think_share", 0.25)
        log_extra("verdict", ["ok", "no", "no", "ok"])
        return [1.0, 0.0, 0.0, 1.0]

    rl = SimpleNamespace(weights=lambda: [1.0], dynamic_sampling=False, loss_type="dapo", beta=0.0)
    m = RLMetrics(rl)
    m.completions = CompletionLog(
        tmp_path, 2, True, step=lambda: 7, prompt_of=lambda i: f"prompt {i}", group=2
    )
    logged = {}
    b = batch()
    b = R.Batch(b.prompts, b.completions, b.completion_ids, b.columns, b.trainer_state, b.where,
                log_extra=lambda c, v: logged.__setitem__(c, v), log_metric=m.log_metric)  # fmt: skip
    values = torch.tensor(R.score([R.Reward("scorer", scorer, 1.0, {})], b), dtype=torch.float64).T
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    scored = SimpleNamespace(extra={"step": (values, torch.zeros(4, dtype=torch.bool), adv)}, prompts=[0, 1],
                             completions=[(i, True) for i in IDS], seconds=0.1, rewards=values, texts=TEXTS,
                             logged=logged, advantages=adv)  # fmt: skip
    m.count_generation(scored, [SimpleNamespace(name="scorer", label="scorer", weight=1.0)])
    out = m.flush(1)
    assert out["think_share"] == 0.25
    import json

    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["step"] == 7 and rows[0]["verdict"] == "ok"
    assert (
        rows[1]["prompt"] == "prompt 0"
        and rows[1]["completion"] == TEXTS[1]
        and rows[1]["rewards"] == {"scorer": 0.0}
    )
    assert rows[0]["advantage"] == 1.0 and rows[0]["reward"] == 1.0


def test_what_a_reward_logs_never_replaces_the_run_s_own_fields(tmp_path, caplog):
    """The finding: log_metric('step' / 'loss' / 'lr' / 'reward') replaced the run's values in metrics.jsonl
    and on the console; log_extra('step' / 'advantage') replaced the completions log's, and bin/report then
    crashed. A name the run writes itself is the function's under log_metric/<name> or log_extra/<name>."""
    import logging

    from trainer.metrics import Metrics
    from trainer.metrics.recorder import FIELDS
    from trainer.objectives.grpo_metrics import RLMetrics
    from trainer.rl.completions import CompletionLog, shown

    def clash(completions, log_metric, log_extra, **kw):
        for name in ("step", "loss", "lr", "reward", "reward_clash", "zero_std_share", "world_size", "mine"):
            log_metric(name, 1000.0)
        log_extra("step", ["x"] * len(completions))
        log_extra("advantage", ["n/a"] * len(completions))
        log_extra("rewards", ["r"] * len(completions))
        log_extra("verdict", ["ok"] * len(completions))
        return [1.0, 0.0, 0.0, 1.0]

    rl = SimpleNamespace(weights=lambda: [1.0], dynamic_sampling=False, loss_type="dapo", beta=0.0)
    m = RLMetrics(rl)
    m.completions = CompletionLog(tmp_path, 2, True, step=lambda: 1, prompt_of=lambda i: f"p{i}", group=2)
    logged = {}
    b = batch()
    b = R.Batch(b.prompts, b.completions, b.completion_ids, b.columns, b.trainer_state, b.where,
                log_extra=lambda c, v: logged.__setitem__(c, v), log_metric=m.log_metric)  # fmt: skip
    (r,) = R.load([SimpleNamespace(function="format", weight=1.0, options={"pattern": "x"})])
    r.fn, r.options, r.label = clash, {}, "clash"
    values = torch.tensor(R.score([r], b), dtype=torch.float64).T
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    scored = SimpleNamespace(extra={"step": (values, torch.zeros(4, dtype=torch.bool), adv)}, prompts=[0, 1],
                             completions=[(i, True) for i in IDS], seconds=0.1, rewards=values, texts=TEXTS,
                             logged=logged, advantages=adv)  # fmt: skip
    m.count_generation(scored, [r])
    mets = Metrics(tmp_path, is_main=True, world_size=1, log_every=1, max_steps=10, samples_per_step=4,
                   tokens_per_step=64, device=None, tags={"world_size": 1})  # fmt: skip
    mets.reduced = lambda: m.flush(1)
    engine = SimpleNamespace(grad_norm=0.5, skipped_steps=0)
    with caplog.at_level(logging.INFO, logger="trainer"):
        mets.step(1, 0.25, 0.0, engine, lr=3e-4)
    mets.close()
    (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (rec["step"], rec["loss"], rec["lr"], rec["reward"], rec["world_size"]) == (1, 0.25, 3e-4, 0.5, 1)
    assert rec["reward_clash"] == 0.5 and rec["zero_std_share"] == 0.0 and rec["mine"] == 1000.0
    for name in ("step", "loss", "lr", "reward", "reward_clash", "zero_std_share", "world_size"):
        assert rec[f"log_metric/{name}"] == 1000.0, name
    assert "step      1/10  loss 0.2500  lr 3.000e-04" in caplog.text and "reward 0.500" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["advantage"] == 1.0 and rows[0]["rewards"] == {"clash": 1.0}
    assert rows[0]["log_extra/step"] == "x" and rows[0]["log_extra/advantage"] == "n/a"
    assert rows[0]["log_extra/rewards"] == "r" and rows[0]["verdict"] == "ok"
    lines = shown(tmp_path)
    assert lines[0].startswith("completions at step 1") and "advantage 1" in lines[2], lines
    plain = Metrics(tmp_path / "plain", is_main=True, world_size=1, log_every=1, max_steps=10, samples_per_step=4,
                    tokens_per_step=64, device=None, tags={"strategy": "zero2"})  # fmt: skip
    assert set(plain.step(1, 0.25, 0.0, engine, lr=3e-4)) <= {*FIELDS, *plain.tags}  # reserved: every field
    plain.close()


def test_bin_report_shows_a_completions_log_whatever_its_rows_hold(tmp_path):
    """A file written before the fix (a function's 'advantage' and 'step' columns over the run's), or cut
    or edited: bin/report shows what it can, never a traceback."""
    from trainer.rl.completions import shown

    rows = [{"step": "x", "prompt": "p", "completion": "c", "ended": True, "rewards": {"f": 1.0}, "reward": 1.0,
             "advantage": "n/a"},
            {"step": "x", "prompt": [{"role": "user", "content": "q"}], "completion": None, "rewards": "r",
             "reward": "?", "advantage": None},
            {"step": "x", "prompt": 3, "rewards": {"f": "bad", "g": None}},
            ["not", "a", "row"]]  # fmt: skip
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    lines = shown(tmp_path)
    assert lines[0] == f"completions at step x ({tmp_path / 'completions.jsonl'}):", lines
    assert "advantage -" in lines[2] and "(f 1)" in lines[2], lines
    assert len(lines) == 7 and "'q' -> None" in lines[3], lines


def test_every_reward_has_a_metric_and_a_column_of_its_own_where_names_repeat(tmp_path):
    """The finding: two built-ins of one name (two format patterns, two answer columns) shared one metric and
    one completions column, the first lost. Every reward's label is unique: the name, then _2, _3..."""
    from trainer.objectives.grpo_metrics import RLMetrics
    from trainer.rl.completions import CompletionLog

    specs = [SimpleNamespace(function="format", weight=1.0, options={"pattern": "<think>"}),
             SimpleNamespace(function="format", weight=1.0, options={"pattern": "^the"}),
             SimpleNamespace(function="answer", weight=1.0, options={"column": "a"}),
             SimpleNamespace(function="answer", weight=1.0, options={"column": "b"}),
             SimpleNamespace(function="trl.rewards:think_format_reward", weight=1.0, options={}),
             SimpleNamespace(function="trl.rewards:think_format_reward", weight=1.0, options={})]  # fmt: skip
    rewards = R.load(specs)
    labels = [r.label for r in rewards]
    assert labels == ["format", "format_2", "answer", "answer_2", "think_format_reward",
                      "think_format_reward_2"], labels  # fmt: skip
    two = R.load([SimpleNamespace(function="trl.rewards:think_format_reward", weight=1.0, options={}),
                  SimpleNamespace(function="trl.rewards.format_rewards:think_format_reward", weight=1.0, options={}),
                  SimpleNamespace(function="format", weight=1.0, options={"pattern": "x"})])  # fmt: skip
    assert [r.label for r in two] == [r.name for r in two[:2]] + ["format"]  # two paths, one function name
    b = batch(chat=True, a=["1", "4", "5", "3"], b=["3", "2", "5", "9"])
    values = torch.tensor(R.score(rewards, b), dtype=torch.float64).T
    rl = SimpleNamespace(weights=lambda: [1.0] * 6, dynamic_sampling=False, loss_type="dapo", beta=0.0)
    m = RLMetrics(rl)
    m.completions = CompletionLog(tmp_path, 4, True, step=lambda: 1, prompt_of=lambda i: f"p{i}", group=2)
    adv = torch.zeros(4, dtype=torch.float64)
    scored = SimpleNamespace(extra={"step": (values, torch.zeros(4, dtype=torch.bool), adv)}, prompts=[0, 1],
                             completions=[(i, True) for i in IDS], seconds=0.1, rewards=values, texts=TEXTS,
                             logged={}, advantages=adv)  # fmt: skip
    m.count_generation(scored, rewards)
    out = m.flush(1)
    for j, label in enumerate(labels):
        assert out[f"reward_{label}"] == pytest.approx(float(values[:, j].mean())), label
    assert out["reward_format"] != out["reward_format_2"] and out["reward_answer"] != out["reward_answer_2"]
    row = json.loads((tmp_path / "completions.jsonl").read_text().splitlines()[0])
    assert list(row["rewards"]) == labels and row["rewards"]["format"] != row["rewards"]["format_2"]


def test_a_log_line_where_every_function_gave_none_logs_no_reward_and_shows_a_dash(caplog):
    """TRL logs None where no value was valid; the log line then says '-' (it read a missing key before)."""
    import logging

    from trainer.metrics.sinks import ConsoleSink
    from trainer.objectives.grpo_metrics import RLMetrics

    rl = SimpleNamespace(weights=lambda: [1.0], dynamic_sampling=False, loss_type="dapo", beta=0.0)
    m = RLMetrics(rl)
    nan = torch.full((4, 1), float("nan"), dtype=torch.float64)
    scored = SimpleNamespace(extra={"step": (nan, torch.ones(4, dtype=torch.bool), torch.zeros(4))},
                             completions=[([1], True)] * 4, seconds=0.0)  # fmt: skip
    m.count_generation(scored, [SimpleNamespace(name="f", label="f")])
    out = m.flush(1)
    assert "reward" not in out and "reward_f" not in out and out["zero_std_share"] == 1.0
    rec = dict(step=1, loss=0.0, lr=1e-3, grad_norm=0.0, tokens_per_s=1.0, step_time_s=0.1, data_wait_share=0.0,
               mfu=None, peak_memory_bytes=1, eta_s=0.0, **out)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trainer"):
        ConsoleSink(1, False).write(rec)
    assert "reward - (std -)" in caplog.text
