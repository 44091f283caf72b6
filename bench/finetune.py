"""Fine-tuning an 8B on one GPU, ours against the Hugging Face recipe (issue 55; `bench/gpu.sh OUT finetune`).

    python bench/finetune.py base DIR                 # a Llama-3-8B with random bf16 weights, saved to DIR
    python bench/finetune.py hf NAME --base DIR --quant 4bit|none --json OUT/NAME.json [--steps 8] [--micro 1|2|4]
    python bench/finetune.py unsloth NAME --base DIR ... [--checkpointing unsloth|true]   # the same, Unsloth's way
    python bench/finetune.py collect OUT              # OUT/*.json and OUT/*.jsonl -> OUT/finetune.json

`base` builds configs/models/llama-3-8b's architecture on the GPU with random weights (nothing can be
downloaded there) and saves it with save_pretrained, so that both sides load the same checkpoint.

`hf` is the recipe the tutorials give (transformers' Trainer + peft + bitsandbytes): the base loaded in
4-bit NF4 with double quantization computing in bf16 (`--quant 4bit`) or in bf16 (`none`),
`prepare_model_for_kbit_training` (4-bit), rank-16 adapters on every projection (alpha 32, dropout
0.05, as configs/experiments/llama3-8b-qlora.yaml), gradient checkpointing, AdamW (torch), bf16, micro
batch 1 x accumulation 4 of 2,048-token rows: 8,192 tokens a step, the same as ours (`--micro 2` or 4:
2 x 2 or 4 x 1, the same tokens, to find the recipe's best micro batch). Its rows are
plain text blocks (causal, no mask: its fastest attention path). Step times are taken at each
optimizer step after a CUDA synchronisation; NVML's utilisation is sampled every 0.2 s over the timed
steps; the peak is torch's max_memory_allocated.

`unsloth` is Unsloth's way to the same job (FastLanguageModel's 4-bit load and adapters, its own
gradient checkpointing), timed by the same Trainer loop; it needs Unsloth's own packages (transformers
<= 5.17), so bench/gpu.sh runs it from a site of its own.

`collect` reads our runs' metrics.jsonl (bin/train, one line a step: tokens/s, step time, MFU, NVML
utilisation, peak) and log (the plan's bytes and levers) and the recipe's JSON, takes medians over the
steps after the first WARMUP, and writes finetune.json with the ratios of tokens per second: ours over the
recipe at 1 x 4 (ratio_qlora, ratio_lora), over the recipe at its best micro batch (ratio_*_best) and
over Unsloth at its best (ratio_*_unsloth), and the peaks' ratio (peak_ratio_*).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 3  # steps left out of the medians (allocator growth, first kernels' selection)
SEQ, MICRO, ACCUM = 2048, 1, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t = time.time()
    cfg = AutoConfig.from_pretrained(str(ROOT / "configs/models/llama-3-8b"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")
    n = sum(p.numel() for p in model.parameters())
    print(f"base: {n:,} parameters, random bf16, saved to {out} in {time.time() - t:.1f} s", flush=True)


class Utilisation:
    """NVML's GPU utilisation sampled every `every` seconds while on."""

    def __init__(self, every: float = 0.2) -> None:
        import torch

        self.samples: list[float] = []
        self.error: str | None = None
        self.on = False
        self.stop = False
        self.read = lambda: torch.cuda.utilization() if torch.cuda.is_available() else None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.every = every

    def _run(self) -> None:
        while not self.stop:
            if self.on:
                try:
                    u = self.read()
                except Exception as e:  # noqa: BLE001 (no NVML: no figure, and why)
                    self.error = f"{type(e).__name__}: {e}"
                    return
                if u is None:
                    return
                self.samples.append(u / 100)
            time.sleep(self.every)

    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def text_rows(n: int) -> list[list[int]]:
    lines = (ROOT / "data/tiny/python_docs.jsonl").read_text().splitlines()
    data = b"".join(json.loads(line)["text"].encode() for line in lines)
    return [list(data[i * SEQ : (i + 1) * SEQ]) for i in range(n)]


def hf(name: str, base: str, quant: str, steps: int, out: str, dropout: float, micro: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    t0 = time.time()
    kwargs = {}
    if quant == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )  # fmt: skip
    cuda = torch.cuda.is_available()  # the CPU runs this only to try the script
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16, device_map={"": 0 if cuda else "cpu"}, **kwargs
    )
    if quant == "4bit":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=TARGETS, task_type="CAUSAL_LM"),
    )
    levers = "Trainer: gradient checkpointing, sdpa (torch's choice of kernel), adamw_torch, bf16" + (
        ", prepare_model_for_kbit_training" if quant == "4bit" else ""
    )
    timed(model, name=name, side="hf", quant=quant, dropout=dropout, micro=micro, steps=steps, out=out,
          levers=levers, load_s=time.time() - t0, trainer_checkpointing=True)  # fmt: skip


def unsloth(
    name: str, base: str, quant: str, steps: int, out: str, dropout: float, micro: int, ckpt: str
) -> None:
    """Unsloth as its notebooks write it: `FastLanguageModel.from_pretrained` (4-bit NF4 on load, or bf16)
    and `FastLanguageModel.get_peft_model` with the same adapters, its own gradient checkpointing
    (`ckpt`: "unsloth", its offloaded default, or "true"), then the same Trainer loop and clock as `hf`
    (Unsloth patches transformers' Trainer on import; its notebooks use TRL's SFTTrainer, a subclass).
    It must be imported before transformers and peft, in a process of its own (bench/gpu.sh unsloth)."""
    import os

    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # it downloads a README from the hub otherwise
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    from unsloth import FastLanguageModel  # noqa: I001 (first: it patches transformers and peft)
    import torch

    model, _ = FastLanguageModel.from_pretrained(
        model_name=base, max_seq_length=SEQ, dtype=torch.bfloat16, load_in_4bit=quant == "4bit",
    )  # fmt: skip
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=dropout, target_modules=TARGETS, bias="none",
        use_gradient_checkpointing="unsloth" if ckpt == "unsloth" else True, random_state=0, max_seq_length=SEQ,
    )  # fmt: skip
    version = getattr(__import__("unsloth"), "__version__", "?")
    levers = f"Unsloth {version}: FastLanguageModel, gradient checkpointing {ckpt!r}, adamw_torch, bf16"
    timed(model, name=name, side="unsloth", quant=quant, dropout=dropout, micro=micro, steps=steps, out=out,
          levers=levers, load_s=time.time() - t0, trainer_checkpointing=False)  # fmt: skip


def timed(model, *, name: str, side: str, quant: str, dropout: float, micro: int, steps: int, out: str,
          levers: str, load_s: float, trainer_checkpointing: bool) -> None:  # fmt: skip  # noqa: ANN001
    """transformers' Trainer over `micro` x (ACCUM // micro) rows of SEQ text tokens a step (the same
    8,192 tokens at every micro batch), timed at each optimizer step after a CUDA synchronisation."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    accum = MICRO * ACCUM // micro
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = text_rows(MICRO * ACCUM * (steps + 1))

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.tensor(rows[i])
            return {"input_ids": ids, "labels": ids.clone()}

    util = Utilisation()
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if not times:
                sync()
                times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            sync()
            times.append(time.perf_counter())
            util.on = state.global_step >= WARMUP

    targs = TrainingArguments(
        output_dir=f"/tmp/{side}-{name}", per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        max_steps=steps, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=trainer_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if trainer_checkpointing else None,
        learning_rate=2e-4, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, lr_scheduler_type="constant",
    )  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[Clock()]).train()
    util.stop = True
    step = [b - a for a, b in zip(times, times[1:], strict=False)]
    timed_steps = step[WARMUP:] or step
    step_s = statistics.median(timed_steps)
    tokens = MICRO * ACCUM * SEQ
    result = {
        "name": name, "side": side, "quant": quant, "dropout": dropout, "micro": micro, "accumulation": accum,
        "steps": len(step), "step_times_s": step, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "tokens_per_step": tokens, "gpu_utilisation": util.mean(), "gpu_utilisation_error": util.error,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "plan_bytes": None, "load_s": load_s,
        "levers": f"{levers}; micro {micro} x {accum}",
    }  # fmt: skip
    result["mfu"] = mfu(
        result["tokens_per_s"], trainable=sum(p.numel() for p in model.parameters() if p.requires_grad)
    )
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "step_times_s"}), flush=True)


def mfu(tokens_per_s: float, trainable: int) -> float:
    """As bin/train counts it (trainer/metrics/measure.py: 4 N + 2 N_trainable + 12 L H T, over the H100/H200
    dense bf16 peak), for the Llama-3-8B shape."""
    n, layers, hidden = 8_030_261_248, 32, 4096
    return tokens_per_s * (4 * n + 2 * trainable + 12 * layers * hidden * SEQ) / 989.4e12


def ours(path: Path) -> dict:
    """One of our runs: OUT/NAME.jsonl (metrics.jsonl) and OUT/NAME.log (bin/train's output)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if '"tokens_per_s"' in x]
    log = path.with_suffix(".log").read_text() if path.with_suffix(".log").exists() else ""
    timed = rows[WARMUP:] or rows

    def med(key: str) -> float | None:
        vals = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    plan = re.search(r"memory per rank \(estimate\): ([\d.]+) (TB|GB|MB)", log)
    scale = {"TB": 2**40, "GB": 2**30, "MB": 2**20}
    strategy = re.search(r"strategy: ([^\n]*)", log)
    model = re.search(r"model: ([^\n]*)", log)
    return {
        "name": path.stem, "side": "ours", "steps": len(rows), "step_s": med("step_time_s"),
        "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"), "gpu_utilisation": med("gpu_utilisation"),
        "peak_bytes": max((r.get("peak_memory_bytes") or 0) for r in rows) if rows else None,
        "plan_bytes": float(plan.group(1)) * scale[plan.group(2)] if plan else None,
        "levers": (strategy.group(1) if strategy else "") + ("; " + model.group(1) if model else ""),
        "losses": [r.get("loss") for r in rows],
    }  # fmt: skip


def best(runs: dict, side: str, quant: str, dropout: float = 0.05) -> dict | None:
    """The fastest of a side's runs at `quant` and `dropout`, at any micro batch (its best micro batch)."""
    mine = [r for r in runs.values() if r.get("side") == side and r.get("quant") == quant
            and r.get("dropout") == dropout and r.get("tokens_per_s")]  # fmt: skip
    return max(mine, key=lambda r: r["tokens_per_s"], default=None)


def collect(out: str) -> dict:
    """The table and the issue's ratios: ours (micro auto) over the recipe at 1 x 4 and over the recipe at
    its best micro batch, over Unsloth at its best, bf16 LoRA likewise; the peaks' ratio (ours over the
    recipe's) and each of our runs' plan over its measured peak."""
    d = Path(out)
    runs = {}
    for p in sorted(d.glob("*.jsonl")):
        if p.stem.startswith("ours_"):
            runs[p.stem] = ours(p)
    for pattern in ("hf_*.json", "unsloth_*.json"):
        for p in sorted(d.glob(pattern)):
            runs[p.stem] = json.loads(p.read_text())
            runs[p.stem].setdefault("micro", MICRO)  # recordings from before --micro
            runs[p.stem].setdefault("dropout", 0.05)
    for r in runs.values():
        if r.get("side") == "ours":
            r["quant"] = "4bit" if "in 4-bit" in r.get("levers", "") else "none"  # the log's model line
            r["plan_over_peak"] = (
                r["plan_bytes"] / r["peak_bytes"] if r.get("plan_bytes") and r.get("peak_bytes") else None
            )

    def tps(name: str) -> float | None:
        return runs.get(name, {}).get("tokens_per_s")

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    result: dict = {"runs": runs}
    for kind, quant in (("qlora", "4bit"), ("lora", "none")):
        mine = tps(f"ours_{kind}")
        result[f"ratio_{kind}"] = over(mine, tps(f"hf_{kind}"))  # the recipe at 1 x 4
        for side in ("hf", "unsloth"):
            b = best(runs, side, quant)
            key = f"ratio_{kind}_best" if side == "hf" else f"ratio_{kind}_unsloth"
            result[key] = over(mine, b and b["tokens_per_s"])
            result[key + "_against"] = b and b["name"]
    result["ratio_qlora_unsloth_d0"] = over(
        tps("ours_qlora_d0"), (best(runs, "unsloth", "4bit", 0.0) or {}).get("tokens_per_s")
    )
    for kind in ("qlora", "lora"):
        ours_peak = runs.get(f"ours_{kind}", {}).get("peak_bytes")
        result[f"peak_ratio_{kind}"] = over(ours_peak, runs.get(f"hf_{kind}", {}).get("peak_bytes"))
    (d / "finetune.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'run':32} {'step s':>7} {'tok/s':>8} {'mfu':>6} {'util':>5} {'peak GiB':>8} {'plan GiB':>8}")
    for name, r in runs.items():

        def f(x, fmt):  # noqa: ANN001, ANN202
            return format(x, fmt) if isinstance(x, int | float) else "-"

        print(f"{name:32} {f(r.get('step_s'), '7.3f')} {f(r.get('tokens_per_s'), '8.0f')} {f(r.get('mfu'), '6.1%')} "
              f"{f(r.get('gpu_utilisation'), '5.0%')} {f((r.get('peak_bytes') or 0) / 2**30, '8.2f')} "
              f"{f((r.get('plan_bytes') or 0) / 2**30, '8.2f')}  {r.get('levers', '')[:110]}")  # fmt: skip
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k != "runs"})
    return result


def check() -> dict:
    """The CUDA paths against their references, before anything is timed: varlen attention (packed rows
    of grouped-query heads, with and without a sliding window) against each example alone through sdpa,
    forward and backward in bf16; the fused LoRA branch against peft's layer (fp32 and bf16)."""
    import copy

    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from trainer.model import varlen
    from trainer.model.lora_kernels import install

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    out: dict = {}
    lengths = [700, 1, 300, 1047]  # one row of 2,048 tokens, four examples
    seq, heads, kv, size = sum(lengths), 32, 8, 128
    q = torch.randn(1, heads, seq, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv, seq, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv, seq, size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu, longest = varlen.lengths_from_positions(pos)
    attn = torch.nn.Module()
    attn.num_key_value_groups = heads // kv  # what transformers' sdpa (the CPU path) reads off the layer
    for window in (None, 256):
        got, _ = varlen.varlen_attention_forward(
            attn, q, k, v, None, scaling=size**-0.5, sliding_window=window,
            cu_seq_lens_q=cu.to(dev), max_length_q=longest,
        )  # fmt: skip
        g = torch.randn_like(got)
        dq, dk, dv = torch.autograd.grad(got, (q, k, v), g)
        ref, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            mask = None
            if window is not None:
                i = torch.arange(n, device=dev)
                mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
            ref.append(F.scaled_dot_product_attention(
                q[:, :, s].float(), k[:, :, s].float(), v[:, :, s].float(), attn_mask=mask,
                is_causal=mask is None, enable_gqa=True).transpose(1, 2))  # fmt: skip
            start += n
        ref = torch.cat(ref, 1)
        rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g.float())
        err = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
        out[f"varlen_window_{window}"] = {"out": err(got, ref), "dq": err(dq, rq), "dk": err(dk, rk), "dv": err(dv, rv),
                                          "fast": got.is_cuda}  # fmt: skip
    cfg = __import__("transformers").AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512,
    )  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        base = __import__("transformers").AutoModelForCausalLM.from_config(cfg).to(dev, dtype)
        a = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
        for n, p in a.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        b = copy.deepcopy(a)
        install(b)
        ids = torch.randint(0, 512, (2, 256), device=dev)
        res = []
        for m in (a, b):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            res.append(
                (
                    loss.item(),
                    torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None]),
                )
            )
        out[f"lora_{str(dtype)[6:]}"] = {"loss_peft": res[0][0], "loss_fused": res[1][0],
                                         "grad_rel": ((res[0][1] - res[1][1]).abs().max() / res[0][1].abs().max()).item()}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base")
    b.add_argument("dir")
    for side in ("hf", "unsloth"):
        h = sub.add_parser(side)
        h.add_argument("name")
        h.add_argument("--base", required=True)
        h.add_argument("--quant", choices=["4bit", "none"], default="4bit")
        h.add_argument("--steps", type=int, default=8)
        h.add_argument("--dropout", type=float, default=0.05)
        h.add_argument("--json", required=True)
        h.add_argument(
            "--micro", type=int, default=MICRO, help="rows a micro step; accumulation makes the 4 rows a step"
        )
        if side == "unsloth":
            h.add_argument("--checkpointing", choices=["unsloth", "true"], default="unsloth")
    c = sub.add_parser("collect")
    c.add_argument("out")
    sub.add_parser("check")
    a = ap.parse_args(argv)
    micro = getattr(a, "micro", MICRO)  # hf and unsloth only
    if micro < 1 or (MICRO * ACCUM) % micro:  # before minutes of loading, not after
        ap.error(f"--micro {micro}: must divide {MICRO * ACCUM}, the rows a step (the same 8,192 tokens)")
    return a


def main() -> None:
    a = parse()
    if a.cmd == "check":
        check()
    elif a.cmd == "base":
        make_base(a.dir)
    elif a.cmd == "hf":
        hf(a.name, a.base, a.quant, a.steps, a.json, a.dropout, a.micro)
    elif a.cmd == "unsloth":
        unsloth(a.name, a.base, a.quant, a.steps, a.json, a.dropout, a.micro, a.checkpointing)
    else:
        collect(a.out)


if __name__ == "__main__":
    sys.exit(main())
