#!/usr/bin/env python3
"""The peer side of `bench/bench.py peer`: the Hugging Face Trainer with DeepSpeed on the same job as
bin/train (the same model config and seed, the packed token blocks of bin/train's data cache, the
global batch, precision, AdamW hyperparameters, LR schedule and clipping), as a user of the Trainer
writes it: `TrainingArguments(deepspeed=ds_config)` with the Trainer's documented DeepSpeed config
for the stage (`--peer-config minimal`: only `zero_optimization: {stage: N}` and the "auto" batch
keys, DeepSpeed's own defaults for the rest; `hf-docs`: the Trainer documentation's ZeRO-2/ZeRO-3
example, with its "auto" bucket sizes). Launched by the deepspeed launcher; rank 0 writes the step
times (a TrainerCallback at every optimizer step) to the spec's `out`.

    deepspeed --num_gpus N bench/hf_peer.py --spec SPEC.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if os.environ.get("TRAINER_CPU") == "1":  # bench.py --cpu: the deepspeed launcher made the GPUs
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # visible again; hide them before torch sees them

import numpy as np


def hf_ds_config(stage: int, kind: str, precision: str) -> dict:
    """The DeepSpeed config given to the Trainer: what its documentation shows for this stage."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
    }
    if kind == "hf-docs" and stage in (2, 3):
        z = cfg["zero_optimization"]
        z.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"})
        if stage == 2:
            z.update({"allgather_partitions": True, "allgather_bucket_size": 2e8, "reduce_scatter": True})
        else:
            z.update({"sub_group_size": 1e9, "stage3_prefetch_bucket_size": "auto",
                      "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                      "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True})  # fmt: skip
    return cfg


def blocks(train: np.ndarray):
    """The packed token blocks as the Trainer's dataset: input_ids and labels, the same row."""
    import torch
    from torch.utils.data import Dataset

    class Blocks(Dataset):
        def __len__(self) -> int:
            return len(train)

        def __getitem__(self, i: int) -> dict:
            row = torch.from_numpy(np.asarray(train[i]).astype(np.int64))
            return {"input_ids": row, "labels": row}

    return Blocks()


def training_kwargs(spec: dict, cuda: bool, bf16: bool, hf_args: dict) -> dict:
    """TrainingArguments for bin/train's job (batch, AdamW, schedule, clipping, precision, loader), with
    the Trainer's DeepSpeed config for the stage, then the variant's own options (hf_args) on top."""
    ours = spec["ds_config"]
    opt = ours["optimizer"]["params"]
    kwargs = dict(
        output_dir=spec["work"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=opt["lr"],
        weight_decay=spec["weight_decay"],
        adam_beta1=opt["betas"][0],
        adam_beta2=opt["betas"][1],
        adam_epsilon=opt["eps"],
        max_grad_norm=ours.get("gradient_clipping", 1.0),
        lr_scheduler_type="cosine" if spec.get("schedule", "cosine") == "cosine" else "linear",
        warmup_steps=spec["warmup_steps"],  # the experiment's (the JSON's is DeepSpeed's, at least 2)
        bf16=bf16,
        use_cpu=not cuda,
        deepspeed=hf_ds_config(spec["stage"], spec["peer_config"], "bf16" if bf16 else "fp32"),
        logging_steps=spec["log_every"],
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=spec["num_workers"],
        dataloader_pin_memory=cuda,
        dataloader_persistent_workers=spec["num_workers"] > 0,
        dataloader_drop_last=True,
        seed=spec["seed"],
        disable_tqdm=True,
    )
    kwargs.update(hf_args)
    return kwargs


def clock(log_every: int, cuda: bool, times: list[dict]):
    """A TrainerCallback that appends to `times` the mean step time of every log_every optimizer steps."""
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        t = None
        last = 0

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if state.global_step % log_every == 0:
                if self.t is not None:
                    times.append({"step": state.global_step,
                                  "step_time_s": (now - self.t) / (state.global_step - self.last)})  # fmt: skip
                self.t, self.last = now, state.global_step

    return Clock()


def write_out(spec: dict, times: list[dict], log_history: list[dict]) -> None:
    """Rank 0's results: the step-time intervals, the logged losses and the DeepSpeed config given."""
    with open(spec["out"], "w") as f:
        json.dump(
            {
                "intervals": times,
                "losses": [{"step": h["step"], "loss": h["loss"]} for h in log_history if "loss" in h],
                "ds_config": hf_ds_config(spec["stage"], spec["peer_config"], ""),
            },
            f,
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    a = p.parse_args()
    with open(a.spec) as f:
        spec = json.load(f)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    if not cuda:  # as bin/train and the raw loop: DeepSpeed's CPU backend skips its shm op build
        import deepspeed.comm.torch  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    threads = spec.get("threads")
    if threads:
        torch.set_num_threads(threads)

    train = np.load(spec["data"], mmap_mode="r")
    bf16 = bool(spec["ds_config"].get("bf16", {}).get("enabled"))
    torch.manual_seed(spec["seed"])
    hf_args = dict(spec.get("hf_args", {}))  # bench.py peer --hf-variants: the Trainer's own speed options
    attn_impl = hf_args.pop(
        "attn_implementation", spec.get("hf_attn_implementation")
    )  # from_config's, not TrainingArguments'
    attn = {"attn_implementation": attn_impl} if attn_impl else {}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]), **attn)
    args = TrainingArguments(**training_kwargs(spec, cuda, bf16, hf_args))
    times: list[dict] = []
    callbacks = [clock(spec["log_every"], cuda, times)]
    trainer = Trainer(model=model, args=args, train_dataset=blocks(train), callbacks=callbacks)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        write_out(spec, times, trainer.state.log_history)
    # every rank leaves together and takes its process group down before the interpreter exits (a
    # rank exiting with gloo's threads alive while the other still writes can abort with SIGABRT)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
