"""Export a checkpoint of any ZeRO stage to a Hugging Face model directory.

    bin/export CHECKPOINT OUT_DIR [--dtype fp32|bf16] [--adapter]

CHECKPOINT is a step_XXXXXXXX directory, a checkpoints directory or a run directory (the newest
intact checkpoint of its current line). Every file's bytes are checked against the digests their writers
recorded before anything is read: a damaged step directory is refused naming the file; a run directory
falls back down its line to the newest intact checkpoint, saying so. The weights exported are the fp32 master weights the optimizer holds, whatever
the training precision: ZeRO stages 1-3 through DeepSpeed's zero_to_fp32 from the partitions; stage
0 from the module in fp32 training, from the optimizer's master copies in bf16/fp16 (the module
holds rounded copies). They are loaded into the model the checkpoint's experiment.yaml describes and
written with save_pretrained in fp32, or rounded to bf16 with `--dtype bf16`, together with the
tokenizer and the checkpoint's ds_config.json, experiment.yaml and trainer_state.json (in training/).
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` then loads it (a vision-language model:
`AutoModelForImageTextToText`, its processor's files beside it for `AutoProcessor`). A LoRA run (model.lora) exports the
adapters merged into the base weights; `--adapter` writes the adapter alone in peft's format
(`PeftModel.from_pretrained(base, OUT_DIR)`), its config naming the base model. Runs on CPU, with no
process group.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from trainer.common.errors import EXIT_USER_ERROR, UserError


def saved_experiment(ckpt: Path) -> Any:
    """The checkpoint's experiment.yaml, validated."""
    import yaml

    from trainer import config

    path = ckpt / "experiment.yaml"
    return config.validate(yaml.safe_load(path.read_text()), source=str(path))


def consolidated_state_dict(
    ckpt: Path, layout: tuple[list[list[str]], dict[str, str]] | None = None, exp: Any = None
) -> dict[str, Any]:
    """Full fp32 master weights from a checkpoint of any stage and precision. `layout`: parameter
    names per optimizer group and tied aliases, needed for a mixed-precision stage-0 checkpoint;
    default: as recorded in its trainer_state.json. `exp`: its experiment, where already read."""
    from trainer.checkpoint import frozen, read_state
    from trainer.checkpoint.reshard import saved_layout

    stage, _ = saved_layout(ckpt)
    state = read_state(ckpt) or {}
    rec = frozen.saved(state)
    if rec is not None and rec.get("omitted"):  # model.lora: the frozen base comes from model.pretrained
        base = frozen.base_state(ckpt, exp or saved_experiment(ckpt), rec)
        return {**base, **_saved_weights(ckpt, stage, state, layout)}
    return _saved_weights(ckpt, stage, state, layout)


def _saved_weights(
    ckpt: Path, stage: int, state: dict[str, Any], layout: tuple[list[list[str]], dict[str, str]] | None
) -> dict[str, Any]:
    from trainer.checkpoint.reshard import saved_axes

    if layout is None:
        layout = (state.get("param_groups") or [], state.get("tied") or {})
    staged = (state.get("plan") or {}).get("pipeline")
    if staged:  # pipeline stages: each stage's masters, by the model's names
        weights = _stage_weights(ckpt, stage, layout, staged["names"])
        return {**weights, **{alias: weights[name] for alias, name in layout[1].items() if name in weights}}
    if saved_axes(ckpt) != (1, 1):  # tensor or expert parallelism: shards, joined (sharded.py)
        from trainer.checkpoint.sharded import whole_weights

        return whole_weights(ckpt, stage, layout, read=_whole_weights)
    return _whole_weights(ckpt, stage, layout)


def _stage_weights(ckpt: Path, stage: int, layout: Any, names: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The fp32 master weights of a checkpoint of pipeline stages (`names`: each layer file's names as the model has
    them, trainer_state.json's), by the model's names: at ZeRO-1 each stage's optimizer partitions over its
    data-parallel ranks, read as one rank's (sharded.one_rank); at ZeRO-0 (fp32 only under stages) the layer
    files."""
    from trainer.checkpoint.sharded import one_rank
    from trainer.checkpoint.stages import saved_stages, saved_tp, tensor_parallel_info, whole_weights
    from trainer.checkpoint.universal import joined
    from trainer.model.stages import model_name

    info = tensor_parallel_info(ckpt)
    layers = {k: v.float() for k, v in whole_weights(ckpt, names, info).items()}
    if stage == 0:
        return layers
    out: dict[str, Any] = {}
    tp = saved_tp(ckpt)  # (a model-states file a stage's tensor rank: mp_rank_{stage x tp + rank})
    for s in range(saved_stages(ckpt)):
        shards = [one_rank(ckpt, s * tp + t, stage, layout, _whole_weights, staged=True) for t in range(tp)]
        for name in shards[0]:
            out[model_name(names, name)] = joined([part[name] for part in shards], name, info)
    params = {m for item in names.values() for m in item.values()}
    return {
        **{k: v for k, v in layers.items() if k not in params},
        **out,
    }  # (buffers: DeepSeek-V3's router bias)


def _whole_weights(ckpt: Path, stage: int, layout: tuple[list[list[str]], dict[str, str]]) -> dict[str, Any]:
    """The fp32 master weights of a checkpoint of one tensor-parallel rank (or a tensor-parallel rank's files seen
    as one: sharded.py)."""
    import torch

    from trainer.checkpoint import stage0

    if stage == 0:
        sd = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return stage0.master_weights(sd, *layout)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name))
    if stage == 1:
        # DeepSpeed rebuilds the weights from the optimizer's fp32 partitions, which hold only the
        # trainable ones, and saves the frozen ones (model.lora's base) apart only at stages 2-3. At
        # stage 1 every rank holds them whole in the module's state: take them from there.
        module = (
            torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
            or {}
        )  # (pipeline stages: the module's weights are in its layer files)
        sd.update({k: v.float() for k, v in module.items() if k not in sd and v.is_floating_point()})
    return sd


def export(ckpt: Path, out: Path, dtype: str = "fp32", adapter: bool = False) -> Path:
    """The checkpoint as a Hugging Face model directory. With LoRA (model.lora): the adapters merged
    into the base weights, or with `adapter` the adapter alone in peft's format (plus, when the base
    is no pretrained model one can name, the base weights in OUT/base, which the adapter's config then
    names)."""
    import torch

    from trainer import data, model

    exp = saved_experiment(ckpt)
    if exp.model.factory is not None:
        raise UserError(
            f"{ckpt}: the model comes from a factory ({exp.model.factory}), which has no Hugging Face config to "
            "export; load consolidated weights with trainer.checkpoint.export.consolidated_state_dict instead"
        )
    if adapter and exp.model.lora is None:
        raise UserError(
            f"{ckpt}: --adapter: this run trained the whole model (no model.lora); export without it"
        )
    tok = data.load_tokenizer(exp.data.tokenizer)
    cfg = model.hf_config(exp.model, len(tok), tok.eos_token_id)
    # A base stored quantized (a bnb-4bit upload) brings its quantization_config; the weights written here
    # are dequantized (merged, or the base of an adapter), so from_pretrained must not build quantized
    # layers around them (it failed at the first forward)
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    from trainer.model.create import auto_class

    with torch.device("meta"):
        module = auto_class(cfg, exp.model.head).from_config(
            cfg
        )  # (a vision-language model's image-text-to-text class)
        if exp.model.lora is not None:
            from trainer.model import adapters

            module = adapters.apply(module, exp.model.lora)
    from trainer.checkpoint.reshard import names_and_aliases

    state = consolidated_state_dict(
        ckpt, names_and_aliases(module, model.param_groups(module, exp.optim.weight_decay)), exp
    )
    if exp.model.lora is not None and exp.model.lora.quantization in ("4bit", "8bit"):
        # bitsandbytes quantizes GPT-2's Conv1D (in, out) weights as linear layers (out, in)
        for name, m in module.named_modules():
            if type(m).__name__ == "Conv1D" and f"{name}.weight" in state:
                state[f"{name}.weight"] = state[f"{name}.weight"].t().contiguous()
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    tied = {k for k in missing if k in _tied_keys(module)}
    if set(missing) - tied or unexpected:
        raise UserError(
            f"{ckpt}: the weights do not fit the model of its experiment.yaml (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    module.tie_weights()
    if exp.model.head == "score":  # a reward model finds its last token by the tokenizer's pad (as trained)
        _score_pad(module, tok)
    module = module.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        # The base the adapter's config names: the pretrained model, or a config's random init, whose
        # frozen weights are written to OUT/base.
        base_name = exp.model.pretrained or str((out / "base").resolve())
        module.peft_config["default"].base_model_name_or_path = base_name
        module.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
        if exp.model.pretrained is None:
            module.unload().save_pretrained(out / "base", safe_serialization=True)
            tok.save_pretrained(out / "base")
    else:
        if exp.model.lora is not None:
            module = module.merge_and_unload()
        module.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _save_processor(exp.data.tokenizer, out)
    meta = out / "training"
    meta.mkdir(exist_ok=True)
    for name in ("ds_config.json", "experiment.yaml", "trainer_state.json"):
        if (ckpt / name).exists():
            shutil.copy2(ckpt / name, meta / name)
    return out


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")  # fmt: skip


def _save_processor(spec: str, out: Path) -> None:
    """A vision-language model's processor beside the weights, as its directory has it (AutoProcessor loads it):
    the files copied from a local directory, else saved from the loaded processor; nothing for a text model."""
    local = Path(spec).expanduser()
    if local.is_dir():
        for name in PROCESSOR_FILES:
            if (local / name).is_file():
                shutil.copyfile(local / name, out / name)
        return
    from trainer.data.images import load_processor

    proc = load_processor(spec)
    if proc is not None:
        proc.save_pretrained(out)


def _tied_keys(module: Any) -> set[str]:
    names = {id(p): n for n, p in module.named_parameters()}
    return {k for k, t in module.state_dict(keep_vars=True).items() if id(t) in names and names[id(t)] != k}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a step_XXXXXXXX directory, a checkpoints directory or a run directory")
    p.add_argument("out_dir", help="where to write the Hugging Face model directory")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the exported weights")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA runs: write the adapter alone (peft's format; PeftModel.from_pretrained(base, OUT_DIR)) "
        "instead of the merged model",
    )
    args = p.parse_args(argv)
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # export runs on CPU; DeepSpeed need not guess
    from trainer.model.quantized import quiet_bitsandbytes

    quiet_bitsandbytes()  # as bin/train does
    try:
        from trainer.checkpoint.resolve import export_source, gone, unmoved

        # every file's bytes verified (or the error names it), and a read lease: a job writing that run
        # directory does not prune it while it is exported
        found, warnings, lease = export_source(args.checkpoint)
        with lease:
            for w in warnings:
                print(f"warning: {w}", file=sys.stderr)
            try:
                out = export(found.path, Path(args.out_dir), args.dtype, adapter=args.adapter)
            except (
                FileNotFoundError
            ) as e:  # removed anyway (by hand, or without locks): said, not a traceback
                raise UserError(f"{found.path}: {gone(e)}; export it again") from None
            if not unmoved(found):
                raise UserError(f"{found.path}: the checkpoint was moved while it was read (a rollback or a fresh "
                                f"start of the job writing its run directory set it aside); what {out} holds may "
                                "mix two checkpoints: export it again")  # fmt: skip
        print(f"exported {found.path} (step {found.step}) to {out}")
        return 0
    except UserError as e:
        print(e.render().replace("--resume", "bin/export"), file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())


def _score_pad(module: Any, tok: Any) -> None:
    from trainer.model.score import set_pad

    set_pad(module, tok)
