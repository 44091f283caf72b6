"""sequence: what Ulysses sequence parallelism costs where it is not needed. The same global batch on
the same ranks, interleaved: sequence parallel 1 (each rank its own rows: micro 1 on every
data-parallel rank) against N (the rows shared: micro N on one data-parallel group, each rank holding
seq_len / N of every row). Both do the same arithmetic; N adds four all-to-alls per layer and its
matmuls are over shorter sequences. The median step times' ratio SP N / SP 1, and each side's planned
activation bytes per rank (the point of paying it)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    TINY,
    TRAIN,
    cache_dir,
    env_for,
    interleave,
    launch,
    median_after,
    overrides,
    ratio,
    run_sets,
)

# A Llama shape (grouped-query attention, SwiGLU) small enough for CPU steps of about a second
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 16384}  # fmt: skip


def sequence(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-sequence-"))
    n = a.nproc
    base = {
        **run_sets(a.steps, a.log_every, work / "run", cache_dir(a)),
        "model.config": json.dumps(LLAMA),
        "model.attn_implementation": "sdpa",
        "data.seq_len": a.seq_len,
        "train.precision": a.precision,
        "train.eval_prompts": [],
        "model.activation_checkpointing": False,
        "model.chunked_loss": False,
        "model.tiled_mlp": False,
    }
    sides = {"sp1": {"strategy.sequence_parallel": 1, "train.micro_batch_size": 1},
             f"sp{n}": {"strategy.sequence_parallel": n, "train.micro_batch_size": n}}  # fmt: skip
    planned: dict[str, str] = {}

    def run(name: str, r: int) -> float:
        shutil.rmtree(work / "run", ignore_errors=True)
        p = launch([str(TRAIN), str(TINY), *overrides({**base, **sides[name]})], n, env_for(n))
        lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        med = median_after([m for m in lines if "loss" in m], a.warmup, a.log_every)
        found = re.search(r"activations ([\d.]+ [KMGT]?B)", p.stdout)
        planned[name] = found.group(1) if found else "?"
        print(
            f"  {name:5} round {r}: median step {med * 1000:.0f} ms, activations {planned[name]} a rank",
            flush=True,
        )
        return med

    results = interleave(tuple(sides), a.rounds, run, alternate=True)
    shutil.rmtree(work, ignore_errors=True)
    r = ratio(results[f"sp{n}"], results["sp1"])
    print(
        f"\n# sequence: Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} at {a.seq_len} tokens, "
        f"{a.precision}, {n} ranks, global batch {n} rows: SP {n} {r['num'] * 1000:.0f} ms/step, SP 1 "
        f"{r['den'] * 1000:.0f} ms/step: ratio {r['ratio']:.2f} (rounds {r['ratio_min']:.2f}-{r['ratio_max']:.2f}); "
        f"activations a rank {planned[f'sp{n}']} against {planned['sp1']}"
    )
    return {"sequence": {**results, "ratio": r, "activations": planned, "seq_len": a.seq_len}}
