"""The start-up reference for `bench/bench.py startup`: import DeepSpeed, build the same model from its
transformers config, deepspeed.initialize with the same JSON, take one step on a batch, and say so.
No config file, no data set, no checks: the least any DeepSpeed script does before its first step.

    python bench/bare_start.py --spec SPEC.json      (SPEC: ds_config, model_config, micro, seq_len)
"""

import json
import os
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

spec = json.loads(Path(sys.argv[sys.argv.index("--spec") + 1]).read_text())
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=spec["ds_config"])
batch = torch.randint(0, 256, (spec["micro"], spec["seq_len"]), device=engine.device)
loss = engine(input_ids=batch, labels=batch).loss
engine.backward(loss)
engine.step()
print(f"first step done: loss {loss.item():.4f} after {time.perf_counter() - T0:.2f} s", flush=True)
