#!/usr/bin/env python3
"""The memory DeepSpeed's optimizer step allocates for itself, measured on CPU, against the planner's
`step_bytes`: one process, one rank, bf16, the DeepSpeed JSON bin/train would build (the tiny
experiment widened to 768, micro 1 x 32 tokens, so that the activations are small beside the
parameters). Prints a JSON line per case:

    bench/step_memory.py 0:torch 0:deepspeed 2:torch      # STAGE:optim.implementation[:PRECISION[:GRAD_ACCUM]]
    bench/step_memory.py 2:torch:fp32 3:torch 2:torch:bf16:2
    bench/step_memory.py --cuda 0:auto 2:auto 0:torch     # on GPU 0 (bench/gpu.sh OUT stepmem)

"measured" is the most bytes malloc had handed out during `engine.step()` (a thread samples glibc's
mallinfo2: live allocations, not the pages the heap keeps; with --cuda, the CUDA allocator's peak)
less what was live when the step began, the highest over steps 3 and 4 (the optimizer's state
exists from the first step). "forward_backward" is the peak of a step's forward and backward passes
(all its micro batches) above the bytes live before its first.
"""

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def live() -> int:
    """Bytes malloc has handed out and not had back (small blocks and mmapped ones)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class Peak:
    """The highest `live()` between `reset` and `since`, sampled by a thread (torch's kernels release
    the GIL). The thread sleeps outside those windows: each sample takes malloc's arena locks, which
    slowed everything else (the set-up included) on a loaded machine."""

    def __init__(self) -> None:
        self.value = live()
        self.on = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.on.wait():
            value = live()
            if value > self.value:
                self.value = value
            time.sleep(0.0002)

    def reset(self) -> int:
        self.on.clear()
        time.sleep(0.01)  # the sample in flight lands before the new start
        now = live()
        self.value = now
        self.on.set()
        return now

    def since(self, start: int) -> int:
        time.sleep(0.02)  # the sampler sees the end of what ran
        self.on.clear()
        return max(self.value, live()) - start


class CudaPeak:
    """The CUDA caching allocator's own count of allocated bytes and its peak."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda

    def reset(self) -> int:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        return self.cuda.memory_allocated()

    def since(self, start: int) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated() - start


def case(
    stage: int, implementation: str, precision: str, accum: int, peak: Peak | CudaPeak, device: str
) -> dict:
    import deepspeed
    import torch

    from trainer import config, model, strategy

    exp = config.load(
        "configs/experiments/tiny.yaml",
        [f"strategy.zero_stage={stage}", f"optim.implementation={implementation}", f"train.precision={precision}",
         f"train.grad_accum={accum}",
         "train.micro_batch_size=1", "data.seq_len=32", "model.config.n_embd=768", "model.config.n_head=12",
         "strategy.justification=measuring", "checkpoint.async=false"],
    )  # fmt: skip
    info = model.info(exp.model, 257, 256)
    plan = strategy.plan(
        exp, info, world_size=1, gpus_per_node=1, device_type=device, device_memory=64 * 2**30,
        host_memory=64 * 2**30, precision=precision,
    )  # fmt: skip
    path, template = strategy.template_for(exp, plan.candidate)
    ds = strategy.ds_config(exp, plan, info, template, path)
    torch.manual_seed(0)
    module = model.build(exp.model, vocab_size=257, eos_id=256, seq_len=32, ds_config=ds)
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=model.param_groups(module, exp.optim.weight_decay), config=ds
    )
    x = torch.randint(0, 257, (1, 32), device=engine.device)
    backward, step = [], []
    for _ in range(4):
        start = peak.reset()
        for micro in range(accum):
            engine.backward(engine(input_ids=x, labels=x).loss)
            if micro < accum - 1:
                engine.step()  # not a boundary: nothing is applied
        backward.append(peak.since(start))
        start = peak.reset()
        engine.step()
        step.append(peak.since(start))
    engine.destroy()
    return {
        "stage": stage,
        "implementation": implementation,
        "precision": precision,
        "grad_accum": accum,
        "optimizer": type(engine.optimizer).__name__,
        "params": info.params,
        "measured": max(step[2:]),
        "planned": plan.estimate.step,
        "planned_grads": plan.estimate.grads,
        "forward_backward": max(backward[2:]),
    }


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    args = sys.argv[1:]
    device = "cuda" if "--cuda" in args else "cpu"
    args = [a for a in args if a != "--cuda"]
    if device == "cpu":  # a CPU run on a GPU machine too: DeepSpeed's CPU accelerator, no CUDA
        os.environ.update(TRAINER_CPU="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    import torch

    from trainer.common.deepspeed_patches import (
        build_ops_without_debug_info,
        import_muon_lazily,
        skip_inference_shm_op,
    )

    # DeepSpeed as bin/train starts it (trainer/cluster/dist.py): on CPU without the inference-only shared-
    # memory op, which it would otherwise JIT-compile here (50 s of CPU on a fresh machine: CI's).
    if device == "cpu":
        skip_inference_shm_op()
    import_muon_lazily()
    build_ops_without_debug_info()
    torch.set_num_threads(1)
    peak = CudaPeak() if device == "cuda" else Peak()
    for arg in args or ["0:torch", "0:deepspeed", "2:torch"]:
        parts = arg.split(":")
        stage, implementation = parts[:2]
        precision = parts[2] if len(parts) > 2 else "bf16"
        accum = parts[3] if len(parts) > 3 else "1"
        out = case(int(stage), implementation, precision, int(accum), peak, device)
        p = out["params"]
        print(json.dumps(out), f"# step: {out['measured'] / p:.2f} bytes a parameter measured, "
              f"{out['planned'] / p:.2f} planned", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
