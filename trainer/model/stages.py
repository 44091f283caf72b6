"""The transformers model as pipeline stages for DeepSpeed's pipeline engine (planning/stages.py says what and why).

Each item is one module over the model's own submodules, the same tensors (a pretrained directory loads into the
model as ever, then into its stages): the token embedding (tied to the head on the last stage by DeepSpeed's
TiedLayerSpec), GPT-2's position embedding, each decoder layer, the final norm, the head. A decoder layer runs
through the family's own model forward over a view of the model that holds that layer alone (its mask for the
layer's attention kind, its rotary embedding for the layer's type, the family's own code): no family's forward is
rewritten here, and a family joins FAMILIES only once its stages train as the whole model does.

Between stages travel (hidden states, position ids); the inputs are (input ids, position ids) and the labels go to
the last stage, where `Loss` computes the model's own loss over the logits: the targets' summed loss over the
step's targets a micro batch (the loop's `num_items`), as the model without stages does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

LAYER_LISTS = ("layers", "h")  # decoder layers: Llama-style families, GPT-2
FINAL_NORMS = ("norm", "ln_f")


def _base(lm: Any) -> Any:
    return lm.base_model


def _layer_list(base: Any) -> str:
    return next(a for a in LAYER_LISTS if isinstance(getattr(base, a, None), nn.ModuleList))


class Tokens(nn.Module):
    """(input ids, position ids) -> (the embedded tokens, position ids)."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.embed = lm.get_input_embeddings()

    def forward(self, inputs: tuple[Any, Any]) -> tuple[Any, Any]:
        ids, pos = inputs
        return self.embed(ids), pos


class Positions(nn.Module):
    """GPT-2's learned positions added, then its embedding dropout."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        base = _base(lm)
        self.wpe, self.drop = base.wpe, base.drop

    def forward(self, inputs: tuple[Any, Any]) -> tuple[Any, Any]:
        h, pos = inputs
        return self.drop(h + self.wpe(pos)), pos


class _NoPositions(nn.Module):
    """GPT-2's position embedding inside a layer's view: added once, by `Positions`."""

    def forward(self, pos: Any) -> Any:
        return torch.zeros((), device=pos.device)


class Layer(nn.Module):
    """Decoder layer `i` through the family's model forward over a view holding that layer alone."""

    def __init__(self, lm: Any, i: int) -> None:
        super().__init__()
        base = _base(lm)
        attr = _layer_list(base)
        self.layer = getattr(base, attr)[i]
        self.rotary = getattr(base, "rotary_emb", None)  # buffers only (moved with the stage)
        view = copy.copy(base)  # its own module table: the layer alone, no embedding, no final norm
        view._parameters, view._buffers = {}, dict(base._buffers)
        view._modules = dict(base._modules)
        view._modules[attr] = nn.ModuleList([self.layer])
        for name in FINAL_NORMS:
            if name in view._modules:
                view._modules[name] = nn.Identity()
        for name, stand_in in (
            ("embed_tokens", None),
            ("wte", None),
            ("wpe", _NoPositions()),
            ("drop", nn.Identity()),
        ):
            if name in view._modules:
                view._modules[name] = stand_in
        cfg = copy.copy(base.config)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:  # the layer's attention kind (sliding, full)
            cfg.layer_types = [base.config.layer_types[i]]
        view.config = cfg
        object.__setattr__(self, "view", view)  # not a submodule: the stage holds the layer once

    def forward(self, inputs: tuple[Any, Any]) -> tuple[Any, Any]:
        h, pos = inputs
        return self.view(inputs_embeds=h, position_ids=pos, use_cache=False).last_hidden_state, pos


class Norm(nn.Module):
    """The final norm: (hidden states, position ids) -> hidden states."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        base = _base(lm)
        self.norm = next(getattr(base, n) for n in FINAL_NORMS if getattr(base, n, None) is not None)

    def forward(self, inputs: tuple[Any, Any]) -> Any:
        return self.norm(inputs[0])


def _cap(lm: Any) -> float | None:
    """Gemma 2's final logit soft-capping (None: none), which its causal LM applies after the head."""
    return getattr(lm.config.get_text_config(), "final_logit_softcapping", None)


def _softcap(cap: float | None, logits: Any) -> Any:
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Head(nn.Module):
    """An untied LM head: hidden states -> logits."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.head, self.cap = lm.get_output_embeddings(), _cap(lm)

    def forward(self, h: Any) -> Any:
        return _softcap(self.cap, self.head(h))


class TiedHead:
    """A tied head: the token embedding's weight on the last stage (TiedLayerSpec's forward_fn)."""

    def __init__(self, lm: Any) -> None:
        self.cap = _cap(lm)
        if getattr(lm.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("a tied head with a bias of its own")

    def __call__(self, tokens: Tokens, h: Any) -> Any:
        return _softcap(self.cap, torch.nn.functional.linear(h, tokens.embed.weight))


class Loss:
    """The model's own loss over a micro batch's logits: its targets' summed loss over `num_items` (set by the
    engine each step: the step's targets over the data-parallel ranks and micro batches; 1.0 in evaluation: the
    sum)."""

    def __init__(self, lm: Any) -> None:
        self.loss, self.num_items = lm.loss_function, 1.0  # (a function of the config's loss type, not bound)
        self.vocab = lm.config.get_text_config().vocab_size

    def __call__(self, logits: Any, labels: Any) -> Any:
        return self.loss(logits, labels, vocab_size=self.vocab, num_items_in_batch=self.num_items)


def items(lm: Any) -> tuple[list[Any], dict[str, dict[str, str]]]:
    """The model's pipeline items in order (planning/stages.py's `kinds`), and each item's parameter names as the
    model has them ({item index, as trainer_state.json keys it: {the item's name: the model's}}: what bin/export
    reads the layer files by)."""
    from deepspeed.pipe import TiedLayerSpec

    base = _base(lm)
    tied = lm.get_output_embeddings() is not None and (
        lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    )
    spec = lambda **kw: TiedLayerSpec("embed", Tokens, lm, tied_weight_attr=["embed.weight"], **kw)  # noqa: E731
    out: list[Any] = [spec() if tied else Tokens(lm)]
    if hasattr(base, "wpe"):
        out.append(Positions(lm))
    out += [Layer(lm, i) for i in range(len(getattr(base, _layer_list(base))))]
    out.append(Norm(lm))
    out.append(spec(forward_fn=TiedHead(lm)) if tied else Head(lm))
    owner = {id(p): n for n, p in lm.named_parameters()}  # (a tied weight: its first name, the embedding's)
    names: dict[str, dict[str, str]] = {}
    for i, item in enumerate(out):
        module = Tokens(lm) if isinstance(item, TiedLayerSpec) else item
        if isinstance(item, TiedLayerSpec) and i > 0:
            continue  # the tied head holds no file of its own: the embedding's, on the first stage
        names[str(i)] = {n: owner[id(p)] for n, p in module.named_parameters()}
    return out, names


def pipeline(lm: Any, pp: int, parts: list[int], tp: int = 1) -> Any:
    """The model as a PipelineModule of `pp` stages cut at `parts` (planning/stages.py's bounds), stages outermost
    (DeepSpeed's pipe-data topology; with `tp` > 1 its pipe-data-model one, a stage's tensor-parallel ranks
    innermost: `tensor_parallel`), with its loss (`Loss`) and the model's names of each item's parameters
    (`.names`)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class Stages(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    layers, names = items(lm)
    if len(parts) != pp + 1 or parts[-1] != len(layers):
        raise ValueError(f"bounds {parts} for {pp} stages of {len(layers)} items")
    # dynamic_shape: fine-tuning batches are as wide as their longest row, which changes from one micro batch to the next
    if tp > 1:
        world = torch.distributed.get_world_size()
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
        module = Stages(layers, topology=topology, loss_fn=Loss(lm), dynamic_shape=True)
        tensor_parallel(module, lm)
    else:
        module = Stages(layers, num_stages=pp, loss_fn=Loss(lm), dynamic_shape=True)
    module.names = names
    module.unapplied = unapplied(getattr(lm, "generation_config", None))
    for i, spec in enumerate(module._layer_specs):  # other stages' items: not held past the build
        if hasattr(spec, "module_args"):
            spec.module_args = ()
        elif not module._local_start <= i < module._local_stop:
            module._layer_specs[i] = nn.Identity()
    return module


def tensor_parallel(module: Any, lm: Any) -> None:
    """Tensor parallelism inside each stage (3D), before deepspeed.initialize shards the items with AutoTP:

    - AutoTP's plan is the model's own (transformers' base_model_tp_plan, as without stages) by the items' names
      (`layers.*.self_attn.q_proj` -> `layer.self_attn.q_proj`), and an untied head by the vocabulary with its
      logits gathered (the causal LM's own `lm_head: colwise_gather_output`); a tied head stays whole, the
      embedding it is. Without this, AutoTP's plan names nothing in a PipelineModule and shards nothing, silently.
    - DeepSpeed's process groups come from the pipeline's grid: AutoTP would build a (world / tp, tp) mesh whose
      data-parallel groups span the stages; its model-parallel group is a pipeline's stages x tensor-parallel
      ranks, over which ZeRO-1 sums the gradients' norm (the slice alone clipped each stage by its own norm:
      measured, PP 2 x TP 2 against one rank)."""
    from deepspeed.utils import groups

    plan = getattr(lm.config, "base_model_tp_plan", None) or {}
    if any(not k.startswith("layers.*.") for k in plan):
        raise ValueError(f"a tensor-parallel plan beyond the decoder layers: {sorted(plan)}")
    config = copy.copy(lm.config)
    config.base_model_tp_plan = {"layer." + k[len("layers.*.") :]: v for k, v in plan.items()}
    head = lm.get_output_embeddings()
    if head is not None and head.weight is not lm.get_input_embeddings().weight:
        config.base_model_tp_plan["head"] = "colwise_gather_output"
    module.config = config
    grid = module._grid
    groups._TENSOR_MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
    groups._MODEL_PARALLEL_GROUP = grid.get_model_parallel_group()
    groups._DATA_PARALLEL_GROUP = grid.get_data_parallel_group()


def after_initialize(ds: Any) -> None:
    """A PipelineEngine with AutoTP, once deepspeed.initialize has built it: AutoTP made DeepSpeed's groups
    module the engine's mpu, where the pipeline engine needs its grid (its pipe groups, to broadcast the loss);
    and AutoTP's check that a tensor-parallel group's first inputs agree compares nested tuples, as a
    pipeline's ((input ids, position ids), labels) are, with `!=` on tensors (it raises): removed, the rows
    a tensor-parallel group reads being the same by construction (trainer/run/build.py). Its files are named by
    its place in the pipeline's stages x tensor-parallel ranks (mp_rank_{stage x tp + tensor rank}, stages x tp
    of them): DeepSpeed counted the tensor-parallel ranks alone, and the stages wrote over each other's files."""
    hook = getattr(ds, "first_dataloader_check", None)
    if hook is not None:
        hook.remove()
        ds.first_dataloader_check = None
    ds.mpu = ds.grid
    ds.checkpoint_mp_rank = ds.grid.get_model_parallel_rank()
    ds.mp_world_size = ds.grid.get_model_parallel_world_size()


def model_names(module: Any) -> dict[str, str]:
    """A PipelineModule's parameter names ('3.layer.mlp.up_proj.weight', 'tied_modules.embed.embed.weight') as the
    model without stages has them ('model.layers.1.mlp.up_proj.weight', 'model.embed_tokens.weight')."""
    return {name: model_name(module.names, name) for name, _ in module.named_parameters()}


def model_name(names: dict[str, dict[str, str]], name: str) -> str:
    """A PipelineModule's parameter name ('3.layer.mlp.up_proj.weight', 'tied_modules.embed.embed.weight') as the
    model without stages has it, from a checkpoint's recorded names ({item index: {item's name: model's}})."""
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        return names["0"][rest.partition(".")[2]]
    return names[head][rest]


# What transformers' generate applies to greedy decoding from a model's generation_config, beyond the argmax
GREEDY = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
          "begin_suppress_tokens": None, "sequence_bias": None, "min_length": 0, "min_new_tokens": None,
          "forced_bos_token_id": None, "forced_eos_token_id": None, "encoder_repetition_penalty": 1.0}  # fmt: skip


def unapplied(generation_config: Any) -> list[str]:
    """The settings of a model's generation_config that its greedy samples under stages do not apply (the engine's
    Pipeline.greedy takes the argmax of the logits, where transformers' generate would apply them)."""
    if generation_config is None:
        return []
    return [
        f"{k}={getattr(generation_config, k, v)}"
        for k, v in GREEDY.items()
        if getattr(generation_config, k, v) not in (v, [], None)
    ]
