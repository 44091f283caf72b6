#!/usr/bin/env python3
"""QLoRA against bf16 LoRA on CPU (issue 49): the same job, one process, bin/train on a Llama of
hidden 1024, 8 layers (113M parameters in its linear layers: 226 MB in bf16, 57 MB packed in 4 bits),
the tiny corpus, micro 4 x 256 tokens, bf16, rank-16 adapters on every projection. Each side is a
whole bin/train run, the two interleaved for `--rounds`; the step time is the median of the logged
steps after the first (metrics.jsonl); the peak is the process's maximum resident set (getrusage)
above a bare `import torch, transformers, deepspeed, bitsandbytes` process's, beside what the plan
said for the run (its 'memory per rank (estimate)' line).

    bench/qlora.py [--steps 8] [--rounds 2] [--threads 2]
    bench/qlora.py --memory 4bit|none [--stage 0]

`--memory` measures in one process, as bench/step_memory.py does (glibc's live allocations sampled by a
thread): the engine bin/train would build for the job (one rank), then 4 steps of micro 1 x 256; the
bytes live after the first step above those before the model was built (the model states: planned
params + grads + optimizer), and the highest over steps 2-4 (planned: the total per rank, less the
buffers, which are the GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def base(tmp: Path) -> Path:
    out = tmp / "base"
    code = (
        "import torch; from transformers import AutoConfig, AutoModelForCausalLM; torch.manual_seed(0); "
        "c = AutoConfig.for_model('llama', hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, "
        "num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512, vocab_size=257, "
        f"bos_token_id=256, eos_token_id=256); AutoModelForCausalLM.from_config(c).save_pretrained('{out}')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return out


WRAP = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(p.returncode)"
)


def peak_of(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run `args` under a fresh wrapper process: (the result, its maximum resident set in bytes)."""
    p = subprocess.run([sys.executable, "-c", WRAP, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    return p, int(p.stderr.strip().splitlines()[-1]) * 1024


def job(tmp: Path, quantization: str, steps: int, pretrained: Path, env: dict[str, str]) -> dict:
    run = tmp / f"run-{quantization}"
    sets = {"model.config": "null", "model.pretrained": str(pretrained),
            "model.lora": f"{{r: 16, alpha: 32, dropout: 0.0, quantization: {quantization}}}",
            "data.seq_len": 256, "data.eval_fraction": 0, "data.num_workers": 0, "train.micro_batch_size": 4,
            "train.precision": "bf16", "train.max_steps": steps, "train.log_every": 1, "train.eval_every": 0,
            "optim.warmup_steps": 0, "optim.lr": "1e-3", "checkpoint.every_steps": 0, "checkpoint.save_final": "false",
            "run_dir": str(run), "data.cache_dir": str(tmp / "cache"), "strategy.justification": "benchmark"}  # fmt: skip
    args = [sys.executable, str(ROOT / "bin" / "train"), str(ROOT / "configs" / "experiments" / "tiny.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    p, peak = peak_of(args, env)
    if p.returncode:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "step_time_s" in r and r.get("step", 0) > 1]
    plan = re.search(r"memory per rank \(estimate\): ([\d.]+ [KMG]?B)", p.stdout)
    subprocess.run(["rm", "-rf", str(run)])
    return {"step_s": statistics.median(r["step_time_s"] for r in steps_), "loss": steps_[-1]["loss"],
            "peak": peak, "plan": plan.group(1) if plan else None}  # fmt: skip


def memory(quantization: str, stage: int, threads: int) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29617", TRAINER_CPU="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")  # fmt: skip
    sys.path.insert(0, str(ROOT))
    import torch

    from bench.step_memory import Peak, live
    from trainer.common.deepspeed_patches import (
        build_ops_without_debug_info,
        import_muon_lazily,
        skip_inference_shm_op,
    )

    skip_inference_shm_op()
    import_muon_lazily()
    build_ops_without_debug_info()
    torch.set_num_threads(threads)
    import deepspeed

    from trainer import config, model, strategy

    with tempfile.TemporaryDirectory() as d:
        pretrained = base(Path(d))
        exp = config.load(
            "configs/experiments/tiny.yaml",
            ["model.config=null", f"model.pretrained={pretrained}",
             f"model.lora={{r: 16, alpha: 32, dropout: 0.0, quantization: {quantization}}}",
             f"strategy.zero_stage={stage}", "train.precision=bf16", "train.micro_batch_size=1", "data.seq_len=256",
             "strategy.justification=measuring", "checkpoint.async=false", "model.chunked_loss=false"],
        )  # fmt: skip
        info = model.info(exp.model, 257, 256)
        plan = strategy.plan(exp, info, world_size=1, gpus_per_node=1, device_type="cpu", device_memory=64 * 2**30,
                             host_memory=64 * 2**30, precision="bf16")  # fmt: skip
        path, template = strategy.template_for(exp, plan.candidate)
        ds = strategy.ds_config(exp, plan, info, template, path)
        peak = Peak()
        before = live()
        torch.manual_seed(0)
        module = model.build(exp.model, vocab_size=257, eos_id=256, seq_len=256, ds_config=ds)
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=model.param_groups(module, exp.optim.weight_decay), config=ds
        )
        x = torch.randint(0, 257, (1, 256))
        highs = []
        for i in range(4):
            start = peak.reset()
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            highs.append(peak.since(start) + start - before)
            if i == 0:
                resident = live() - before
        e = plan.estimate
        out = {"quantization": quantization, "stage": stage, "resident": resident,
               "planned_states": e.params - e.gather + e.grads + e.optimizer, "peak": max(highs[1:]),
               "planned_peak": e.total - e.buffers}  # fmt: skip
        print(json.dumps(out), f"# model states {resident / 2**20:.1f} MiB measured, {out['planned_states'] / 2**20:.1f} "
              f"planned ({resident / out['planned_states'] - 1:+.1%}); peak {out['peak'] / 2**20:.1f} MiB, planned "
              f"{out['planned_peak'] / 2**20:.1f} ({out['peak'] / out['planned_peak'] - 1:+.1%})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory", choices=["4bit", "none"])
    ap.add_argument("--stage", type=int, default=0)
    a = ap.parse_args()
    if a.memory:
        return memory(a.memory, a.stage, a.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        bare, bare_peak = peak_of(
            [sys.executable, "-c", "import torch, transformers, deepspeed, bitsandbytes"], env
        )
        pretrained = base(tmp)
        got: dict[str, list[dict]] = {"4bit": [], "none": []}
        for r in range(a.rounds):
            for q in ("none", "4bit"):
                x = job(tmp, q, a.steps, pretrained, env)
                got[q].append(x)
                print(f"round {r}: {q} {x['step_s'] * 1000:.0f} ms a step, peak {(x['peak'] - bare_peak) / 2**20:.0f} MiB "
                      f"above a bare process ({x['peak'] / 2**20:.0f} MiB), plan {x['plan']}, last loss {x['loss']:.4f}",
                      flush=True)  # fmt: skip
        med = {q: {"step_s": statistics.median(x["step_s"] for x in xs), "peak_above_bare": statistics.median(
            x["peak"] - bare_peak for x in xs), "plan": xs[0]["plan"]} for q, xs in got.items()}  # fmt: skip
        print(json.dumps({**med, "bare_peak": bare_peak, "step 4bit/none": med["4bit"]["step_s"] / med["none"]["step_s"],
                          "peak 4bit/none": med["4bit"]["peak_above_bare"] / med["none"]["peak_above_bare"]}))  # fmt: skip


if __name__ == "__main__":
    main()
