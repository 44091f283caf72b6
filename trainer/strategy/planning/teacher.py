"""Distillation's teacher in the plan (train.objective distill; trainer/objectives/distill.py): a whole copy a rank
at ZeRO 0-2, partitioned as the student is at ZeRO-3 (its own inference engine, as TRL's: each rank's share, and
a layer and the head gathered at once), held for the whole run, among every candidate's buffers:

- its weights in the run's compute precision (its parameters counted on the meta device from its config); with
  train.distill.quantization 4bit its linear layers packed in 4 bits with their quantization state, as the
  student's QLoRA base is counted (trainer/model/quantized.py), a whole copy a rank at every stage;
- its forward, without gradients: one layer's working set in flight a micro batch (its hidden states, the
  attention's projections and the MLP's widest activation, in the compute precision), and its last hidden
  states, which the divergence keeps for backward;
- the divergence's working set (trainer/objectives/divergence.py `working_bytes`: a block of tokens' chunk of both
  models' logits and what is made of them, in fp32; the student head's gradient is written into the head's own
  precision a chunk at a time, as the token loss's would be);
- on the host, while the ranks load it: a whole copy each (`teacher_host_bytes`, on a GPU machine).

Offline (train.distill.offline: its top-k read from a store) none of it: a micro batch's stored entries (ids and
log-probabilities, k a token, and what the divergence makes of them) and the student's chunk of logits.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def _meta(spec: str) -> Any:
    """The causal LM at `spec` built on the meta device (no memory), once for every count below; None where its
    config does not read (the run then stops at load, naming it)."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(spec)
            )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=8)
def _shape(spec: str) -> tuple[int, int, int, int]:
    """(parameters, hidden size, MLP width, vocabulary) of the causal LM at `spec`, counted on the meta device; zeros
    where it does not read."""
    model = _meta(spec)
    if model is None:
        return 0, 0, 0, 0
    text = model.config.get_text_config()
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    width = int(getattr(text, "intermediate_size", 0) or getattr(text, "n_inner", 0) or 4 * hidden)
    params = sum(p.numel() for p in model.parameters())
    return params, hidden, width, int(getattr(text, "vocab_size", 0) or 0)


@functools.lru_cache(maxsize=8)
def _four_bit(spec: str) -> tuple[int, float]:
    """(the elements of the linear layers bitsandbytes stores in 4 bits, their packed bytes and quantization state)
    of the causal LM at `spec` (as trainer/model/quantized.py counts a QLoRA base: NF4 with double quantization);
    zeros where its config does not read."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from trainer.strategy.planning.candidates import nf4

    model = _meta(spec)
    if model is None:
        return 0, 0.0
    head = (
        model.get_output_embeddings()
    )  # (transformers converts every linear layer but it, GPT-2's Conv1D too)
    sizes = tuple(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Linear | Conv1D) and m is not head)  # fmt: skip
    q = nf4(sizes)
    return q.elements, q.elements * q.packed + q.state_bytes()


def teacher_bytes(exp: Any, lp: int, stage: int = 0, ranks: int = 1, offloaded: bool = False) -> int:
    """The teacher's bytes a rank (module docstring) beside a student at ZeRO `stage` over `ranks` (`offloaded`: its
    parameters offloaded to the host, the teacher's share with them); 0 for another objective."""
    if exp.train.objective != "distill" or not exp.train.distill.teacher:
        return 0
    from trainer.config.distill_schema import working_bytes

    params, hidden, width, vocab = _shape(exp.train.distill.teacher)
    tokens = (
        exp.train.micro_batch_size * exp.data.seq_len if isinstance(exp.train.micro_batch_size, int) else 0
    )
    if (
        exp.train.distill.offline
    ):  # the store's entries (ids and log-probs a token) and the student's chunk alone
        return tokens * exp.train.distill.top_k * 16 + working_bytes(tokens, vocab) * 3 // 8
    in_flight = tokens * (4 * hidden + 2 * width) * lp
    weights = params * lp
    share = -(-params // max(ranks, 1)) * lp
    gathered = (
        4 * hidden * hidden + 3 * hidden * width + vocab * hidden
    ) * lp  # a layer (attention, gated MLP), head
    if (
        exp.train.distill.quantization == "4bit"
    ):  # a whole copy a rank: its linear layers packed, the rest in lp
        elements, packed = _four_bit(exp.train.distill.teacher)
        weights = int((params - elements) * lp + packed)
    elif (
        stage == 3
    ):  # its share (on the host where the student's parameters are), and what its forward gathers
        weights = (0 if offloaded else share) + gathered
    return weights + in_flight + tokens * hidden * lp + working_bytes(tokens, vocab)


def teacher_host_bytes(exp: Any, lp: int, ranks_per_node: int) -> int:
    """The host memory a node needs while its ranks load the teacher (each a whole copy in the compute precision,
    on the host until its first forward moves it to the device); 0 for another objective."""
    if exp.train.objective != "distill" or not exp.train.distill.teacher or exp.train.distill.offline:
        return 0
    return ranks_per_node * _shape(exp.train.distill.teacher)[0] * lp


def teacher_line(exp: Any, lp: int, stage: int = 0, ranks: int = 1, offloaded: bool = False) -> str:
    """--plan's line for distill."""
    from trainer.config import format_size

    params = _shape(exp.train.distill.teacher)[0]
    if exp.train.distill.offline:
        return (f"teacher: {exp.train.distill.teacher}'s top-{exp.train.distill.top_k} read from its store "
                f"(train.distill.offline): no teacher in memory; {format_size(teacher_bytes(exp, lp))} among the "
                "buffers (the stored entries a micro batch, the divergence's chunk of the student's logits)")  # fmt: skip
    if not params:
        return (f"teacher: {exp.train.distill.teacher}: its config does not read here, so the plan holds nothing "
                "for it (the run stops at load, naming it)")  # fmt: skip
    where = (
        "a whole copy a rank"
        if stage != 3
        else f"sharded at ZeRO-3 over {ranks} rank(s) as the student is"
        + (", its share on the host with the student's parameters" if offloaded else "")
    )
    if exp.train.distill.quantization == "4bit":
        where, stage = "its linear layers in 4 bits (NF4), a whole copy a rank", 0
    return (
        f"teacher: {exp.train.distill.teacher} ({params / 1e6:,.1f}M parameters), {where}: "
        f"{format_size(teacher_bytes(exp, lp, stage, ranks, offloaded))} among the buffers (its weights in the compute precision"
        f"{', a layer and its head gathered' if stage == 3 else ''}, its forward without gradients, the divergence's "
        "chunk of both models' logits)"
    )
