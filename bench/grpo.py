#!/usr/bin/env python3
"""grpo: one GRPO step of bin/train against TRL's GRPOTrainer on the same job (issue 56 item 8), on CPU.

The job is configs/experiments/tiny-grpo.yaml's: the same GPT-2 shape drawn from the same seed, the same
byte tokenizer, prompts (data/tiny/count_prompts.jsonl), rewards (the format and answer built-ins of
trainer/rl/rewards.py, wrapped as TRL calls reward functions), completions a step (2 prompts x 8), sampling
(temperature 1, no top-p/top-k), max_new_tokens, loss (dapo, beta 0, epsilon 0.2, one iteration), AdamW at
a constant lr, fp32, one process. TRL as its users write it: `GRPOConfig(use_cpu=True, ...)` and
`GRPOTrainer(model, reward_funcs, args, train_dataset, processing_class)`; its step time is taken by a
TrainerCallback at every optimizer step. Both sides generate with transformers' `generate` on the trained
module (no vLLM on CPU) and count the same tokens: a step's completions and their prompts.

Interleaved rounds (ours, TRL; TRL, ours; ...); each round's median step time after the warm-up; the ratio
ours/TRL in tokens/s is TRL's step time over ours (the same tokens a step, the completions' lengths
reported beside).

    .venv/bin/python bench/grpo.py [--rounds 3] [--steps 30] [--max-new-tokens 16] [--per-group] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, TRAIN, env_for, interleave, overrides, ratio  # noqa: E402

EXP = ROOT / "configs" / "experiments" / "tiny-grpo.yaml"
WARMUP = 5


def ours(a: argparse.Namespace, work: Path, r: int, generation_batch: int | None = None) -> dict:
    run_dir = work / f"ours-{r}-{generation_batch}"
    sets = {"train.max_steps": a.steps, "train.log_every": 1, "checkpoint.every_steps": 0,
            "checkpoint.save_final": False, "train.rl.max_new_tokens": a.max_new_tokens, "run_dir": str(run_dir),
            "data.cache_dir": str(work / "cache"), "data.num_workers": 0}  # fmt: skip
    if generation_batch:
        sets["train.rl.generation_batch"] = generation_batch
    p = subprocess.run([sys.executable, str(TRAIN), str(EXP), *overrides(sets)], cwd=ROOT, env=env_for(1),
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    if p.returncode:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "reward" in x and x["step"] > WARMUP]
    return {"step_s": statistics.median(x["step_time_s"] for x in steps),
            "completion_length": statistics.mean(x["completion_length"] for x in steps),
            "reward_first": rows[0].get("reward"), "reward_last": steps[-1]["reward"]}  # fmt: skip


def trl(a: argparse.Namespace, work: Path, r: int) -> dict:
    out = work / f"trl-{r}.json"
    p = subprocess.run([sys.executable, __file__, "--trl-side", str(out), "--steps", str(a.steps),
                        "--max-new-tokens", str(a.max_new_tokens)], cwd=ROOT, env=env_for(1),
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    if p.returncode:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    return json.loads(out.read_text())


def trl_side(out: Path, steps: int, max_new_tokens: int) -> None:
    """TRL's GRPOTrainer on tiny-grpo's job (see the module's doc); writes the step times to `out`."""
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.data.tokenizer import byte_tokenizer
    from trainer.rl.rewards import answer, format_  # the same built-ins as ours

    exp = yaml.safe_load(EXP.read_text())
    rewards = exp["train"]["rl"]["rewards"]
    fmt_opts, ans_opts = rewards[0]["options"], rewards[1]["options"]

    def format_reward(prompts, completions, **kw):
        return format_(prompts, completions, **fmt_opts)

    def answer_reward(prompts, completions, answer=None, **kw):  # noqa: A002
        return answer_fn(prompts, completions, answer=answer, **ans_opts)

    answer_fn = answer
    cfg = dict(exp["model"]["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=257, **cfg)
    torch.manual_seed(exp["seed"])
    model = AutoModelForCausalLM.from_config(config)
    tok = byte_tokenizer()
    tok.pad_token = tok.eos_token
    rows = [
        json.loads(x) for x in (ROOT / exp["data"]["train"]["files"]).read_text().splitlines() if x.strip()
    ]
    data = Dataset.from_list(rows)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(out.parent / "trl-out"), use_cpu=True, per_device_train_batch_size=16, num_generations=8,
        gradient_accumulation_steps=1, max_completion_length=max_new_tokens, learning_rate=exp["optim"]["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=exp["seed"], beta=0.0, loss_type="dapo", temperature=1.0,
        disable_dropout=True, dataloader_num_workers=0, reward_weights=[1.0, 1.0], bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[format_reward, answer_reward], args=args,
                          train_dataset=data, processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    step_s = [b - a for a, b in zip(times, times[1:], strict=False)][WARMUP - 1 :]
    lengths = [x.get("completions/mean_length", float("nan")) for x in logs[WARMUP:]]
    out.write_text(json.dumps({"step_s": statistics.median(step_s), "completion_length": statistics.mean(lengths),
                               "reward_first": logs[0]["reward"], "reward_last": logs[-1]["reward"]}))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--per-group",
        action="store_true",
        help="also ours with train.rl.generation_batch 1 (a generate call a group: the sampling before 2026-11-28)",
    )
    p.add_argument("--trl-side", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.trl_side:
        trl_side(Path(a.trl_side), a.steps, a.max_new_tokens)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    sides = {"ours": lambda r: ours(a, work, r), "trl": lambda r: trl(a, work, r),
             "ours_per_group": lambda r: ours(a, work, r, generation_batch=1)}  # fmt: skip
    names = ["ours", "trl", *(["ours_per_group"] if a.per_group else [])]
    runs = interleave(names, a.rounds, lambda side, r: sides[side](r), alternate=True)
    # tokens/s ours / TRL = TRL's step time / ours (the same completions and prompts a step)
    res = {"job": f"tiny-grpo, 2 prompts x 8 completions a step, max_new_tokens {a.max_new_tokens}, CPU fp32",
           "rounds": runs, **ratio([x["step_s"] for x in runs["trl"]], [x["step_s"] for x in runs["ours"]])}  # fmt: skip
    res["ours_over_trl_tokens_per_s"] = res.pop("ratio")
    if a.per_group:  # the one generate call a rank's step against a call a group
        per_group = [x["step_s"] for x in runs["ours_per_group"]]
        res["batched_over_per_group"] = ratio(per_group, [x["step_s"] for x in runs["ours"]])["ratio"]
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
