#!/usr/bin/env python3
"""Stage 0 on 2 CPU ranks: DeepSpeed's gradient all-reduce (after backward: flatten every gradient
into one buffer, all-reduce, copy back) against an all-reduce overlapped with backward, as
PyTorch's DDP does it (gradients copied into flat buckets as autograd produces them, each bucket
all-reduced asynchronously as soon as it is full, in order, waited for after backward). Both in
one pair of processes, alternating every 4 steps, so that both see the same machine; the median
step time of each and its ratio to DeepSpeed's (BENCHMARKS.md, "Overlapping the stage-0 all-reduce"):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/allreduce_step.py [gpt2|tiny|llama] [MiB ...]

The bucket sizes (MiB, default 25 4 1) are the overlapped variants; a bucket at least as large as
the gradients is one all-reduce after backward without DeepSpeed's two copies. Micro 8 x 128 tokens,
fused AdamW, clipping at 1.0, fp32, the peer benchmark's shapes.
"""

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402

from bench.peer import step_config  # noqa: E402  (bench/peer.py, beside this script)

shape = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
sizes = [float(x) for x in sys.argv[2:]] or [25.0, 4.0, 1.0]
steps = int(os.environ.get("STEPS", "240"))
logging.set_verbosity_error()
torch.manual_seed(0)
config = step_config(shape)
model = AutoModelForCausalLM.from_config(config)
ds_config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)


class Overlapped:
    """DDP's scheme on a DeepSpeed engine: buckets in reverse parameter order (the order backward
    produces gradients), launched in order as they fill; `finish` waits and averages."""

    def __init__(self, mib: float) -> None:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        self.active = False
        self.buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in reversed(params):
            if size >= mib * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.view, self.index = {}, {}
        for i, (bucket, flat) in enumerate(zip(self.buckets, self.flat, strict=True)):
            offset = 0
            for p in bucket:
                self.view[p], self.index[p] = flat[offset : offset + p.numel()].view_as(p), i
                offset += p.numel()
            for p in bucket:
                p.register_post_accumulate_grad_hook(self.ready)
        self.reset()

    def reset(self) -> None:
        self.pending, self.launched, self.works = [len(b) for b in self.buckets], 0, []

    def ready(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        if p.grad is not self.view[p]:
            self.view[p].copy_(p.grad)
            p.grad = self.view[p]
        self.pending[self.index[p]] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self.works.append(dist.all_reduce(self.flat[self.launched], async_op=True))
            self.launched += 1

    def finish(self) -> None:
        for w in self.works:
            w.wait()
        for f in self.flat:
            f.mul_(1.0 / dist.get_world_size())
        self.reset()


variants = {f"overlapped {s:g} MiB": Overlapped(s) for s in sizes}
names = ["DeepSpeed", *variants]
times: dict[str, list[float]] = {n: [] for n in names}
gen = torch.Generator().manual_seed(dist.get_rank())
for step in range(steps):
    name = names[(step // 4) % len(names)]
    current = variants.get(name)
    for v in variants.values():
        v.active = v is current
    engine.enable_backward_allreduce = current is None
    x = torch.randint(0, config.vocab_size, (8, 128), generator=gen)
    t0 = time.perf_counter()
    engine.backward(engine(input_ids=x, labels=x, use_cache=False).loss)
    if current is not None:
        current.finish()
    engine.step()
    if step >= 16 and step % 4:  # the first step after a switch is left out
        times[name].append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    base = statistics.median(times["DeepSpeed"])
    grads = sum(p.numel() * 4 for p in engine.module.parameters()) / 2**20
    print(f"{shape} ({grads:.1f} MiB of gradients, buckets per variant: "
          f"{ {n: len(v.buckets) for n, v in variants.items()} })")  # fmt: skip
    for n in names:
        med = statistics.median(times[n])
        print(f"  {n:22} {med * 1000:7.1f} ms  DeepSpeed / this {base / med:.3f}  ({len(times[n])} steps)")
dist.destroy_process_group()
