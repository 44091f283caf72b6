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

On a GPU, bench/gpu.sh grpo runs TRL's side on its job (`--trl-side OUT --job JSON`: the Qwen3-0.6B shape,
8 prompts x G 8, 256 new tokens, bf16) beside bin/train's, and `--collect OUT --shape JSON` makes
OUT/grpo.json: ours/TRL, generation's share, and the decode step against its floor (`decode_floor`).
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


def trl_side(out: Path, steps: int, max_new_tokens: int, job: dict | None = None) -> None:
    """TRL's GRPOTrainer on tiny-grpo's job (see the module's doc); writes the step times to `out`.

    `job` (bench/gpu.sh grpo, on a GPU) replaces the tiny model and batch with the GPU job's: `shape` (a
    transformers config as JSON, random weights in `precision`), `tokenizer` (a folder, or "byte"), `micro`
    completions a micro step x `accum` micro steps (one generate call a step, as ours), `generations` a prompt.
    Generation's share of the step is timed around the model's `generate` (a CUDA synchronisation each side)."""
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.data.tokenizer import load_tokenizer
    from trainer.rl.rewards import answer, format_  # the same built-ins as ours

    if steps <= WARMUP:
        raise SystemExit(f"--steps {steps}: more than {WARMUP} (the steps left out of the medians)")
    job = job or {}
    cuda = torch.cuda.is_available() and bool(job)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    exp = yaml.safe_load(EXP.read_text())
    rewards = exp["train"]["rl"]["rewards"]
    fmt_opts, ans_opts = rewards[0]["options"], rewards[1]["options"]

    def format_reward(prompts, completions, **kw):
        return format_(prompts, completions, **fmt_opts)

    def answer_reward(prompts, completions, answer=None, **kw):  # noqa: A002
        return answer_fn(prompts, completions, answer=answer, **ans_opts)

    answer_fn = answer
    name = job.get("tokenizer", "byte")
    tok = load_tokenizer(name if name == "byte" else str(ROOT / name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    cfg = dict(json.loads(job["shape"]) if "shape" in job else exp["model"]["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=len(tok), **cfg)
    torch.manual_seed(exp["seed"])
    dtype = torch.bfloat16 if job.get("precision") == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if cuda:
        model = model.cuda()
    rows = [
        json.loads(x) for x in (ROOT / exp["data"]["train"]["files"]).read_text().splitlines() if x.strip()
    ]
    data = Dataset.from_list(rows)
    times: list[float] = []
    generating: list[float] = [0.0]  # seconds in generate since the last optimizer step
    per_step: list[float] = []
    plain_generate = model.generate

    def timed_generate(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        sync()
        t = time.perf_counter()
        try:
            return plain_generate(*args, **kw)
        finally:
            sync()
            generating[0] += time.perf_counter() - t

    model.generate = timed_generate  # TRL calls the unwrapped model's generate: this instance's

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter())
            per_step.append(generating[0])
            generating[0] = 0.0

    args = GRPOConfig(
        output_dir=str(out.parent / "trl-out"), use_cpu=not cuda, per_device_train_batch_size=job.get("micro", 16),
        num_generations=job.get("generations", 8), gradient_accumulation_steps=job.get("accum", 1),
        max_completion_length=max_new_tokens, learning_rate=exp["optim"]["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=exp["seed"], beta=0.0, loss_type="dapo", temperature=1.0,
        disable_dropout=True, dataloader_num_workers=0, reward_weights=[1.0, 1.0], bf16=cuda and dtype == torch.bfloat16,
        gradient_checkpointing=False,  # TRL's default is on; ours is pinned off too (bench/gpu.sh grpo): the same work
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[format_reward, answer_reward], args=args,
                          train_dataset=data, processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    step_s = [b - a for a, b in zip(times, times[1:], strict=False)][WARMUP - 1 :]
    gen_s = per_step[WARMUP:]
    lengths = [x.get("completions/mean_length", float("nan")) for x in logs[WARMUP:]]
    result = {"step_s": statistics.median(step_s), "completion_length": statistics.mean(lengths),
              "reward_first": logs[0]["reward"], "reward_last": logs[-1]["reward"]}  # fmt: skip
    if job:
        result.update(job=job, device="cuda" if cuda else "cpu", gradient_checkpointing=trainer.args.gradient_checkpointing, step_times_s=step_s, generation_s=statistics.median(gen_s),
                      generation_share=statistics.median(g / t for g, t in zip(gen_s, step_s, strict=False)),
                      peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)  # fmt: skip
    out.write_text(json.dumps(result))


BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s of HBM, the makers' figures


def decode_floor(shape: str, tokenizer: str, rows: int, new_tokens: int, bytes_per: int = 2) -> dict:
    """What a decode step must read at least: every weight once (the tied embedding once, through the
    output layer) and the KV cache of every row at its mean length over the decode (the widest prompt and
    one more, where every row starts, plus half the new tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer if tokenizer == "byte" else str(ROOT / tokenizer))
    cfg = dict(json.loads(shape))
    config = AutoConfig.for_model(cfg.pop("model_type"), vocab_size=len(tok), **cfg)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    prompts = [
        json.loads(x)["prompt"]
        for x in (ROOT / "data/tiny/count_prompts.jsonl").read_text().splitlines()
        if x.strip()
    ]
    width = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) + 1
    # the config's own head_dim (Qwen3's 128, not hidden / heads = 64), over the mean length a decode step reads
    # (the planner's kv_cache_bytes counts the whole cache at its longest)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head * bytes_per
    kv = rows * (width + new_tokens / 2) * kv_token
    return {"parameters": n, "weight_bytes": n * bytes_per, "kv_bytes_mean": kv, "prompt_width": width,
            "rows": rows, "bytes_a_decode_step": n * bytes_per + kv}  # fmt: skip


def collect(
    out: Path, shape: str, new_tokens: int, tokenizer: str, rows: int = 64, precision: str = "bf16"
) -> dict:
    """bench/gpu.sh grpo's figures: ours (one generate call a step, and a call a group), TRL, ours/TRL in
    tokens/s (TRL's step time over ours: the same prompts and completions a step, their lengths beside), and
    each side's decode step (its generation time over the new tokens: every row runs to the longest) against
    the floor at the GPU's bandwidth."""
    res: dict = {}
    for name in ("grpo_batched", "grpo_static", "grpo_per_group"):
        f = out / f"{name}.jsonl"
        got = (
            [json.loads(x) for x in f.read_text().splitlines() if '"generation_share"' in x]
            if f.exists()
            else []
        )
        got = [r for r in got if r["step"] > WARMUP]  # as TRL's side: steps after the 5th
        if got:
            res[name] = {k: statistics.median(r[k] for r in got)
                         for k in ("step_time_s", "tokens_per_s", "generation_share", "generation_s")}  # fmt: skip
            res[name]["completion_length"] = statistics.mean(r["completion_length"] for r in got)
    if (out / "trl.json").exists():
        t = json.loads((out / "trl.json").read_text())
        res["trl"] = {"step_time_s": t["step_s"], "generation_share": t.get("generation_share"),
                      "generation_s": t.get("generation_s"), "completion_length": t["completion_length"]}  # fmt: skip
    if "grpo_batched" in res and "grpo_per_group" in res:
        res["batched_over_per_group"] = (
            res["grpo_per_group"]["step_time_s"] / res["grpo_batched"]["step_time_s"]
        )
    if "grpo_batched" in res and "grpo_static" in res:
        res["static_over_dynamic"] = res["grpo_batched"]["step_time_s"] / res["grpo_static"]["step_time_s"]
    for name in ("grpo_batched", "grpo_static"):
        if name in res and "trl" in res:
            suffix = "" if name == "grpo_batched" else "_static"
            res[f"ours{suffix}_over_trl_tokens_per_s"] = res["trl"]["step_time_s"] / res[name]["step_time_s"]
    gpu = (out / "gpu.txt").read_text() if (out / "gpu.txt").exists() else ""
    bandwidth = next((v for k, v in BANDWIDTH.items() if k in gpu), None)
    floor = decode_floor(shape, tokenizer, rows, new_tokens, bytes_per=2 if precision == "bf16" else 4)
    res["decode_floor"] = {**floor, "bandwidth": bandwidth,
                           "floor_s": floor["bytes_a_decode_step"] / bandwidth if bandwidth else None}  # fmt: skip
    for name in ("grpo_batched", "grpo_static", "trl"):
        if res.get(name, {}).get("generation_s") and bandwidth:
            step = res[name]["generation_s"] / new_tokens
            res[name]["decode_step_s"] = step
            res[name]["decode_over_floor"] = step / res["decode_floor"]["floor_s"]
    print(json.dumps(res, indent=1))
    return res


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
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # bench/gpu.sh grpo's job, JSON (trl_side)
    p.add_argument(
        "--collect", default=None, help="bench/gpu.sh grpo's OUT: its figures as JSON (with --shape)"
    )
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default="byte", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.collect:
        collect(Path(a.collect), a.shape, a.new_tokens, a.tokenizer, precision=a.precision)
        return 0
    if a.trl_side:
        trl_side(Path(a.trl_side), a.steps, a.max_new_tokens, json.loads(a.job) if a.job else None)
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
