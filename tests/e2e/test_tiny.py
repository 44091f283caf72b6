"""The embedded default experiment, run as the README says: bin/train configs/experiments/tiny.yaml."""

import json
import math
import re
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, TRAIN, env_for, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """`bin/train configs/experiments/tiny.yaml`, as the README says (only run_dir and the data cache
    are moved into the test's directory)."""
    return train(tmp_path_factory.mktemp("tiny"), {}, launcher="none", debug=False)


def test_tiny_trains_and_the_loss_falls(tiny):
    first = tiny.metrics[0]["loss"]
    evals = tiny.eval_losses
    assert sorted(evals) == [100, 200]
    assert evals[200] <= 0.7 * first, (
        f"final eval loss {evals[200]:.3f} not 30% below the first logged {first:.3f}"
    )
    assert "ZeRO stage 0, offload none -- zero0 is the first rung that fits" in tiny.output
    assert "batch: micro 8 x world 1 x grad_accum 1 = 8 sequences = 1,024 tokens per step" in tiny.output
    assert (
        "checkpoints: " in tiny.output
        and "(every 100 steps, at the end; keep 2; written in the background, a host copy of " in tiny.output
    )
    assert "); fresh start" in tiny.output


def test_metrics_lines_carry_every_field_that_applies_on_cpu(tiny):
    lines = [m for m in tiny.metrics if "loss" in m]
    assert [m["step"] for m in lines] == list(range(10, 201, 10))
    for m in lines:
        for key in (
            "lr",
            "grad_norm",
            "tokens_per_s",
            "samples_per_s",
            "tokens_per_s_per_rank",
            "samples_per_s_per_rank",
            "step_time_s",
            "data_wait_share",
            "peak_memory_bytes",
            "skipped_steps",
            "eta_s",
            "tokens",
        ):
            assert m[key] is not None, key
        assert m["tokens_per_s"] > 0 and m["samples_per_s"] > 0 and m["step_time_s"] > 0
        assert 0 <= m["data_wait_share"] <= 1 and m["grad_norm"] > 0 and m["lr"] > 0
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 128)
        assert m["tokens"] == m["step"] * 1024
        assert m["mfu"] is None and m["memory_kind"] == "host_rss"  # MFU is a GPU figure
        assert 50 * 2**20 < m["peak_memory_bytes"] < 8 * 2**30
        assert m["skipped_steps"] == 0
    assert lines[-1]["eta_s"] == 0 and lines[0]["eta_s"] > lines[-2]["eta_s"]
    evals = [m for m in tiny.metrics if "eval_loss" in m]
    assert all(m["eval_ppl"] == pytest.approx(math.exp(m["eval_loss"])) for m in evals)
    # train.eval_prompts: greedy completions at each eval, logged and printed
    for m in evals:
        assert [s["prompt"] for s in m["samples"]] == ["def ", "The "]
        assert all(
            isinstance(s["completion"], str) and s["completion"] and isinstance(s["ended"], bool)
            for s in m["samples"]
        )
        assert f"sample step {m['step']}: 'def ' -> " in tiny.output
    # Not a terminal: plain log lines, no progress bar
    assert "step     10/200  loss" in tiny.output and "eta " in tiny.output and "it/s" not in tiny.output


def test_report_plots_the_run_and_prints_a_summary(tiny, tmp_path):
    out = tmp_path / "report.png"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "report"), str(tiny.run_dir), "--out", str(out)],
        cwd=ROOT,
        env=env_for(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    for row in (
        "steps",
        "200",
        "tokens",
        "204,800",
        "wall time",
        "mean tokens/s",
        "first / final loss",
        "final eval loss (ppl)",
        "peak memory per rank (host RSS)",
        "step_00000100, step_00000200",
        "latest step_00000200",
        "2 written in the background: training blocked",
    ):
        assert row in p.stdout, row
    import matplotlib.image

    img = matplotlib.image.imread(out)  # a real PNG, four panels of drawn curves, not a blank canvas
    assert img.shape[0] > 500 and img.shape[1] > 900 and img[..., :3].std() > 0.05


def test_overfit_batch_drives_the_loss_to_zero(tmp_path):
    """One fixed batch of tiny: the loss falls below 0.5 (a batch of 4 sequences is at about 0.13
    after 80 steps on CPU; see the README's Modes for tiny's own settings)."""
    r = train(
        tmp_path,
        {"train.max_steps": 80, "train.micro_batch_size": 4, "data.num_workers": 0},
        extra_args=["--overfit-batch"],
        debug=False,
    )
    metrics = [
        json.loads(x) for x in (tmp_path / "run" / "overfit-batch" / "metrics.jsonl").read_text().splitlines()
    ]
    last = [m for m in metrics if "loss" in m][-1]
    assert last["step"] == 80 and last["loss"] < 0.5, last
    assert (
        "the pipeline learns" in r.output and "run dir " + str(tmp_path / "run" / "overfit-batch") in r.output
    )
    assert not (tmp_path / "run" / "overfit-batch" / "checkpoints").exists()


def test_profile_writes_a_chrome_trace_and_the_top_operators(tmp_path):
    sets = {
        "model.config.n_layer": 2,
        "train.micro_batch_size": 4,
        "data.num_workers": 0,
        "train.log_every": 2,
        "logging.progress": True,
    }
    r = train(tmp_path, sets, extra_args=["--profile"], debug=False)
    trace = json.loads((tmp_path / "run" / "profile" / "trace_rank00000.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and len(trace["traceEvents"]) > 1000
    assert all("ph" in e and "ts" in e for e in trace["traceEvents"] if e.get("ph") == "X")
    assert "top operators by self time" in r.output and "Self CPU time total" in r.output
    by_kind = re.search(r"profile: CPU operator time by kind: (.*)", r.output).group(1)
    shares = dict(re.findall(r"([a-z][a-z ]*) (\d+)%", by_kind))
    # (the optimizer is about 1% of tiny's operator time: under CI load it falls below the 0.5% shown)
    assert {"matmul", "elementwise and reductions"} <= set(shares), by_kind
    assert 97 <= sum(map(int, shares.values())) <= 103 and int(shares["matmul"]) >= 10
    assert "8/8 [" in r.output and "step/s" in r.output  # the progress bar (forced on: not a terminal)
    assert not (tmp_path / "run" / "profile" / "checkpoints").exists()


def test_dry_run_builds_everything_and_takes_no_step(tmp_path):
    r = train(
        tmp_path, {"model.config.n_layer": 1, "data.num_workers": 0}, extra_args=["--dry-run"], debug=False
    )
    assert (
        "dry run: everything is built; no step taken" in r.output
        and "preflight: weights identical" in r.output
    )
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
    )


def run_cli(*args):
    return subprocess.run(
        [sys.executable, str(TRAIN), *map(str, args)],
        cwd=ROOT,
        env=env_for(1),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_print_config_shows_the_resolved_experiment_and_deepspeed_json():
    p = run_cli(TINY, "--print-config", "--world-size", "4", "--set", "train.grad_accum=2")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "# experiment (resolved)" in out and "grad_accum: 2" in out
    ds_text = out[out.index("# DeepSpeed config") :]
    ds = json.loads(ds_text[ds_text.index("{") :])
    assert ds["train_batch_size"] == 8 * 4 * 2 and ds["gradient_accumulation_steps"] == 2


def test_describe_config_lists_every_key():
    p = run_cli("--describe-config")
    assert p.returncode == 0
    assert "train.micro_batch_size" in p.stdout and "strategy.zero_stage" in p.stdout


def test_local_rank_argument_is_accepted():
    p = run_cli(TINY, "--local_rank=0", "--print-config")
    assert p.returncode == 0, p.stderr


def export(*pairs):
    """bin/export's main on each (run directory, out directory) pair, in one process (its start-up once); the last
    out directory."""
    script = (
        "import sys\nfrom trainer.checkpoint.export import main\nfor a, b in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    assert main([a, b]) == 0, a\n"
    )  # fmt: skip
    args = [str(x) for pair in zip(pairs[::2], pairs[1::2], strict=True) for x in pair]
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env_for(1), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return pairs[-1]


@pytest.fixture(scope="module")
def tiny_sft(tiny, tmp_path_factory):
    """`make tiny-sft`'s steps on the tiny run above: bin/export, then configs/experiments/tiny-sft.yaml from the
    exported model (model.pretrained): (the run, its export)."""
    tmp = tmp_path_factory.mktemp("tiny-sft")
    r = train(tmp, {"model.pretrained": str(export(tiny.run_dir, tmp / "export"))},
              experiment=ROOT / "configs" / "experiments" / "tiny-sft.yaml", launcher="none", debug=False)  # fmt: skip
    return r, export(r.run_dir, tmp / "sft-export")


def test_tiny_sft_fine_tunes_the_exported_model_to_answer_and_stop(tiny_sft):
    """tiny-sft on data/tiny/python_qa.jsonl: the banner counts the conversations, the answer-token loss falls, and
    the eval prompts' completions end with the end-of-turn token."""
    r, _ = tiny_sft
    assert "fine-tuning data (chat): 331 of 331 examples in 149 sequences" in r.output, r.output[-3000:]
    assert '[[The "assert" statement<|endoftext|>]]' in r.output
    losses = [m["loss"] for m in r.metrics if "loss" in m]
    assert losses[-1] < 0.8 * losses[0], losses
    final = [m for m in r.metrics if "samples" in m][-1]
    assert final["step"] == 300 and all(s["ended"] for s in final["samples"]), final["samples"]


def test_tiny_distill_ends_closer_to_the_teacher_than_the_same_student_trained_on_the_text(tiny, tmp_path):
    """`make tiny-distill`'s steps on the tiny run above: its export teaches configs/experiments/tiny-distill.yaml's
    student (a quarter of its size) on the same text; the same student trained by sft on the same tokens, in the same
    order, for as many steps, ends farther from the teacher: the mean forward KL(teacher || student) a token over
    text neither saw in training (the eval split) is lower for the distilled one."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from trainer.objectives import divergence

    teacher = tmp_path / "teacher"
    p = subprocess.run([sys.executable, str(ROOT / "bin" / "export"), str(tiny.run_dir), str(teacher)],
                       cwd=ROOT, env=env_for(1), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    example = ROOT / "configs" / "experiments" / "tiny-distill.yaml"
    cache = tmp_path / "cache"
    distilled = train(tmp_path / "distill", {"train.distill.teacher": str(teacher), "train.eval_every": 200},
                      experiment=example, launcher="none", debug=False, cache=cache)  # fmt: skip
    assert "(the divergence to the teacher)" in distilled.output and "teacher: " not in distilled.output
    # docs/distillation.md's offline example: the teacher's top-32 stored once, then no teacher in memory
    stored = {"train.distill.teacher": str(teacher), "train.eval_every": 200, "train.distill.offline": True,
              "train.distill.top_k": 32}  # fmt: skip
    prep = train(tmp_path / "prep", stored, experiment=example, extra_args=["--prepare-teacher"], debug=False,
                 cache=cache)  # fmt: skip
    assert "teacher: top-32 log-probabilities of" in prep.output, prep.output[-2000:]
    offline = train(tmp_path / "offline", stored, experiment=example, debug=False, cache=cache)
    assert "no teacher in memory" in offline.output
    plain = yaml.safe_load(example.read_text())
    plain["train"].pop("distill")
    plain["train"]["objective"] = "sft"
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(plain))
    sft = train(tmp_path / "sft", {"train.eval_every": 200}, experiment=tmp_path / "sft.yaml", launcher="none",
                debug=False, cache=cache)  # fmt: skip
    import numpy as np

    kl = {}
    (held_out,) = set(cache.glob("**/eval.npy"))  # one cache: the same tokens, the same split, for both
    rows = torch.from_numpy(np.load(held_out)[:16].astype(np.int64))
    t = AutoModelForCausalLM.from_pretrained(teacher).eval()
    runs = (("distill", distilled), ("offline", offline), ("sft", sft))
    export(*[x for name, run in runs for x in (run.run_dir, tmp_path / f"{name}-export")])
    for name, _ in runs:
        s = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-export").eval()
        with torch.no_grad():
            h_s = s.base_model(input_ids=rows)[0].reshape(-1, 64)
            h_t = t.base_model(input_ids=rows)[0].reshape(-1, 128)
            kl[name] = divergence.per_token(h_s, s.lm_head.weight, h_t, t.lm_head.weight, 0.0).mean().item()
    print(
        f"KL(teacher || student) a token: distilled {kl['distill']:.4f}, from the stored top-32 "
        f"{kl['offline']:.4f}, trained on the text {kl['sft']:.4f}"
    )
    assert kl["distill"] < 0.9 * kl["sft"] and kl["offline"] < 0.9 * kl["sft"], kl


def _kl_on_answers(student, teacher, rows, prompts):
    """The mean forward KL(teacher || student) a token (trainer/objectives/divergence.py, beta 0) at the held-out
    rows' answers, and at the student's own answers to their questions (8 sampled a question at temperature 1, the
    distribution it answers from)."""
    import torch

    from trainer.data.pack import IGNORE
    from trainer.objectives import divergence

    def kl(ids, labels, pos):
        with torch.no_grad():
            h_s = student.base_model(input_ids=ids, position_ids=pos)[0][:, :-1]
            h_t = teacher.base_model(input_ids=ids, position_ids=pos)[0][:, :-1]
        at = labels[:, 1:] != IGNORE
        return divergence.per_token(h_s[at], student.lm_head.weight, h_t[at], teacher.lm_head.weight, 0.0)

    answers = kl(rows[:, 0], rows[:, 1], rows[:, 2]).mean().item()
    torch.manual_seed(0)
    own = []
    for (
        p
    ) in prompts:  # a question's 8 answers in one call (an answer ends at its first EOS, padding after it)
        with torch.no_grad():
            out = student.generate(torch.tensor([p]), do_sample=True, top_k=0, max_new_tokens=32, eos_token_id=256,
                                   pad_token_id=0, num_return_sequences=8)  # fmt: skip
        answer = out[:, len(p) :]
        ended = (answer == 256).int().cumsum(dim=1)
        labels = torch.cat([torch.full((8, len(p)), IGNORE), answer.masked_fill((ended - (answer == 256).int()) > 0,
                                                                                IGNORE)], dim=1)  # fmt: skip
        own.append(kl(out, labels, torch.arange(out.shape[1]).expand(8, -1)))
    return answers, torch.cat(own).mean().item()


def test_tiny_distill_chat_on_policy_ends_closer_on_its_own_answers(tiny_sft, tmp_path):
    """`make tiny-distill-chat`'s steps: tiny-sft's export teaches configs/experiments/tiny-sft-small.yaml's student
    (a quarter of its size, fine-tuned on the same questions) by configs/experiments/tiny-distill-chat.yaml: on half
    of the steps on its own answers (on-policy, lmbda 0.5). From the same student, as many steps of sft on the data's
    answers end farther from the teacher on the student's own answers to the held-out questions (what it says when
    used); off-policy distillation (lmbda 0) ends closer than sft on the data's answers."""
    import numpy as np
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from trainer.objectives.on_policy import prompts_of

    _, teacher = tiny_sft
    cache = tmp_path / "cache"
    small = train(tmp_path / "small", {}, experiment=ROOT / "configs" / "experiments" / "tiny-sft-small.yaml",
                  debug=False, cache=cache)  # fmt: skip
    student = export(small.run_dir, tmp_path / "small-export")
    example = ROOT / "configs" / "experiments" / "tiny-distill-chat.yaml"
    sets = {"train.distill.teacher": str(teacher), "model.pretrained": str(student)}
    on = train(tmp_path / "on", sets, experiment=example, debug=False, cache=cache)
    shares = [m["on_policy"] for m in on.metrics if "on_policy" in m]
    assert 0.3 < np.mean(shares) < 0.7 and "each example's last reply sampled anew" in on.output, shares
    runs = {"on-policy": on}
    for name, change in (("off-policy", {"lmbda": 0.0}), ("sft", None)):
        exp = yaml.safe_load(example.read_text())
        if change is None:
            exp["train"].pop("distill")
            exp["train"]["objective"] = "sft"
        else:
            exp["train"]["distill"].update(change)
            exp["train"]["distill"].pop("generation")
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(exp))
        more = {k: v for k, v in sets.items() if change is not None or k == "model.pretrained"}
        runs[name] = train(
            tmp_path / name, more, experiment=tmp_path / f"{name}.yaml", debug=False, cache=cache
        )
    (held_out,) = {p for p in cache.glob("**/eval.npy") if np.load(p, mmap_mode="r").ndim == 3}
    rows = np.load(held_out).astype(np.int64)
    t = AutoModelForCausalLM.from_pretrained(teacher).eval()
    kl = {}
    export(*[x for name, run in runs.items() for x in (run.run_dir, tmp_path / f"{name}-export")])
    for name in runs:
        s = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-export").eval()
        kl[name] = _kl_on_answers(s, t, torch.from_numpy(rows), prompts_of(rows))
    print("KL(teacher || student) a token, on the held-out answers / on the student's own: "
          + ", ".join(f"{n} {a:.4f} / {o:.4f}" for n, (a, o) in kl.items()))  # fmt: skip
    assert kl["on-policy"][1] < 0.95 * kl["sft"][1], kl
    assert kl["off-policy"][0] < kl["sft"][0], kl
