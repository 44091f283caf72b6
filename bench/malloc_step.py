#!/usr/bin/env python3
"""One process, one thread: training steps of a 4-layer 256-wide GPT-2 (or the peer benchmark's Llama
with grouped-query attention: `llama`; micro 8 x 128 tokens, fused AdamW, clipping) with glibc's
malloc defaults or with what bin/train sets on CPU (trainer.cluster.dist.keep_freed_memory): median step
time, page faults and kernel time per step. Run it in fresh processes, interleaved (BENCHMARKS.md):

    for i in 1 2 3 4 5 6; do bench/malloc_step.py glibc; bench/malloc_step.py kept; done
    for i in 1 2 3 4 5 6; do bench/malloc_step.py glibc llama; bench/malloc_step.py kept llama; done
"""

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.peer import step_config  # noqa: E402  (bench/peer.py, beside this script)
from trainer.cluster.dist import keep_freed_memory  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "kept"
shape = sys.argv[2] if len(sys.argv) > 2 else "gpt2"
if mode not in ("glibc", "kept") or shape not in ("gpt2", "llama"):
    raise SystemExit("usage: bench/malloc_step.py glibc|kept [gpt2|llama]")
torch.set_num_threads(1)
applied = keep_freed_memory() if mode == "kept" else False

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
torch.manual_seed(0)
config = step_config(shape)
model = AutoModelForCausalLM.from_config(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randint(0, 257, (8, 128))


def step() -> None:
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


for _ in range(5):
    step()
times = []
before = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(30):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
after = resource.getrusage(resource.RUSAGE_SELF)
print(
    f"{shape} {mode:5} (applied: {applied}): median step {sorted(times)[15] * 1000:.1f} ms, "
    f"{(after.ru_minflt - before.ru_minflt) / 30:.0f} page faults and "
    f"{(after.ru_stime - before.ru_stime) / 30 * 1000:.1f} ms of kernel time a step"
)
