"""Vision-language models: the families verified here, what of them is frozen, the inputs a micro batch of
rows with images gives the model, and the idle image that keeps every rank's vision tower in step.

- **Families** (`FAMILIES`): Qwen2-VL and Qwen2.5-VL (multimodal RoPE: `mm_token_type_ids` and the three
  position rows per packed example), Gemma 3 (`token_type_ids`: bidirectional attention within an image; its
  sliding layers' masks of packed rows mended: vision_masks.py), LLaVA
  (a CLIP or SigLIP tower, a projector, any causal language model: the image's features in its tokens' places,
  the text model's own positions and causal mask), Idefics3 (an image split into tiles and a global view, each
  tile's patches shuffled into tokens; pixel values (1, tiles, C, H, W) with their mask: `stacked`), Llama 3.2
  Vision (one token an image, its tiles attended by cross-attention layers: `cross`, vision_cross.py).
  Another vision-language model type is refused with the reason; a text model given images is refused by the
  data (trainer/data/images.py: the tokenizer's directory has no image processor).
- **Freezing** (`model.freeze`): `vision_tower`, `projector`, `language_model` name each family's modules; by
  default the vision tower is frozen (as LLaMA-Factory's `freeze_vision_tower`), the projector and the language
  model train.
- **Inputs** (`Inputs`): pixel tensors as the processor made them (every image of the micro batch end to end),
  per-token types made again from the ids (the data checked they are exactly the image token's positions),
  and for multimodal RoPE each packed example's positions computed by the model's own `get_rope_index` on that
  example alone, with the text positions as the first row (transformers' packed form: the attention stays
  within each example).
- **The idle image**: a micro batch without an image on one rank would skip the vision tower there and not on
  the others. Under ZeRO-3 every rank gathers each module's weights in the same order, so that hangs
  (LLaMA-Factory #5616, Qwen3-VL #126); at ZeRO 1-2 the projector's gradient is reduced on some ranks only. Here
  every micro batch runs the vision tower: one without images runs it on a small blank image right after the
  embeddings (where the model runs it for real images) and adds 0 x its features to them, so that the order of
  the modules, the weights gathered and the gradients reduced are the same on every rank, and the loss is
  unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.common.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str
    vision_tower: tuple[str, ...]  # module prefixes (under the ForConditionalGeneration model)
    projector: tuple[str, ...]
    language_model: tuple[str, ...]
    mrope: bool = False  # multimodal RoPE: 3 position rows from the image grids
    # pixel values (1, images, C, H, W) and their mask (Idefics3): the micro batch's tiles as one row
    stacked: bool = False
    # images attended by cross-attention layers, one token an image (Llama 3.2 Vision: vision_cross.py)
    cross: bool = False


_LM = ("model.language_model.", "lm_head.")
_QWEN = dict(
    vision_tower=("model.visual.",), projector=("model.visual.merger.",), language_model=_LM, mrope=True
)
# a tower and a projector beside the language model (Gemma 3's SigLIP, LLaVA's CLIP or SigLIP)
_TOWER = dict(
    vision_tower=("model.vision_tower.",), projector=("model.multi_modal_projector.",), language_model=_LM
)
FAMILIES = {
    "qwen2_vl": Family("Qwen2-VL", **_QWEN),
    "qwen2_5_vl": Family("Qwen2.5-VL", **_QWEN),
    "gemma3": Family("Gemma 3", **_TOWER),
    "idefics3": Family(
        "Idefics3",
        vision_tower=("model.vision_model.",),
        projector=("model.connector.",),
        language_model=("model.text_model.", "lm_head."),
        stacked=True,
    ),  # fmt: skip
    "llava": Family("LLaVA", **_TOWER),
    "mllama": Family(
        "Llama 3.2 Vision",
        vision_tower=("model.vision_model.",),
        projector=("model.multi_modal_projector.",),
        language_model=_LM,
        cross=True,
    ),  # fmt: skip
}
# vision-language model types transformers has and this project has not verified: refused with the reason
NOT_VERIFIED = {
    "llava_next": "LLaVA-NeXT",
    "smolvlm": "SmolVLM",
    "qwen3_vl": "Qwen3-VL",
    "pixtral": "Pixtral",
    "mistral3": "Mistral 3",
    "internvl": "InternVL",
    "paligemma": "PaliGemma",
}
PARTS = ("vision_tower", "projector", "language_model")


def family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


def is_vision(model_type: str | None) -> bool:
    return model_type in FAMILIES or model_type in NOT_VERIFIED


def check(model_type: str | None, has_images: bool, where: str = "model") -> Family | None:
    """The family of a model trained on data with images (exit 2 for one not verified, or a text model)."""
    if model_type in NOT_VERIFIED:
        raise UserError(
            f"{where}: {NOT_VERIFIED[model_type]} ({model_type}) is a vision-language model this project has not "
            f"verified (its inputs, masks and positions are not tested here); the verified ones are "
            f"{', '.join(f.name for f in FAMILIES.values())}"
        )
    fam = family(model_type)
    if has_images and fam is None:
        raise UserError(
            f"data: the training data has images but the model ({model_type}) is a text model; train a "
            f"vision-language model ({', '.join(f.name for f in FAMILIES.values())}) or remove the images"
        )
    return fam


def unquantized(model_type: str | None) -> list[str]:
    """The modules QLoRA leaves in the training precision for a vision-language model: its vision tower and
    projector (bitsandbytes' skip list, by name), and the LM head as transformers leaves it; [] for a text model."""
    fam = family(model_type)
    if fam is None:
        return []
    return sorted({p.rstrip(".") for p in fam.vision_tower + fam.projector}) + ["lm_head"]


def frozen_parts(fam: Family | None, freeze: Any) -> tuple[str, ...]:
    """model.freeze as set; null: the vision tower (a vision-language model), nothing (a text model)."""
    if freeze is not None:
        return tuple(freeze)
    return ("vision_tower",) if fam is not None else ()


def freeze(model: Any, fam: Family, parts: tuple[str, ...]) -> int:
    """requires_grad off for the parameters of each named part (the projector stays trainable under a frozen
    vision tower when not named); returns how many parameters were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if freeze_part(fam, name) in parts:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def freeze_part(fam: Family, name: str) -> str | None:
    """The model.freeze part a parameter belongs to (the projector apart from the tower that may hold it)."""
    if name.startswith(fam.projector):
        return "projector"
    if name.startswith(fam.vision_tower):
        return "vision_tower"
    return "language_model" if name.startswith(fam.language_model) else None


# --------------------------------------------------------------------------------------------- the inputs


class Inputs:
    """What a vision-language model takes besides the ids, for each micro batch (see the module docstring)."""

    def __init__(self, model: Any, fam: Family, token_types: dict[str, int], idle: dict[str, Any],
                 image_token: int | None = None) -> None:  # fmt: skip
        # (under LoRA, peft's wrapper: the transformers model inside it)
        self.model = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.fam, self.token_types = fam, token_types
        self.idle = idle  # the blank image's tensors (None: the data has no image, no rank runs the tower)
        self.idle_now = False
        self.image_token, self.skip = image_token, None  # (cross) the image token, the tokens that skip
        if fam.cross:
            from trainer.model.vision_cross import install

            install()
        if self.model.config.model_type == "gemma3":  # its sliding layers' masks of packed rows with images
            from trainer.model.vision_masks import install

            install()

    def install(self) -> None:
        """The idle image's hook on the embeddings, after DeepSpeed's own hooks (build_model calls it after
        deepspeed.initialize): ZeRO-3 wraps the embeddings' output for its backward before this hook adds the
        image's features, as the model's own forward adds them after the embeddings, so that backward gathers
        the modules' weights in the same order on every rank (a hook before DeepSpeed's made it gather the
        embeddings first on a rank without images, the vision tower first on one with: gloo's "collective
        mismatch")."""
        if self.fam.cross:  # (the idle image is in the forward's arguments: vision_cross.inputs)
            from trainer.model.vision_cross import cross_layers, skip_hook

            for layer in cross_layers(self.model):
                layer.register_forward_hook(skip_hook(self))
        elif self.idle is not None:
            self.model.get_input_embeddings().register_forward_hook(self._idle_features)

    def apply(self, batch: Any, extra: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        """(the rows, the forward's keyword arguments) of a micro batch: rows with images (VisionBatch), or
        text rows of a vision-language model."""
        rows, images = (batch.rows, batch.images) if hasattr(batch, "images") else (batch, {})
        return rows, {**(extra or {}), **self.kwargs(rows, images)}

    def kwargs(self, rows: Any, images: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the model's forward for fine-tuning rows (B, 3, S) and their images' tensors
        (on the device already): the images', the per-token types, the positions (multimodal RoPE)."""
        import torch

        ids, pos = rows[:, 0], rows[:, 2]
        if self.fam.cross:
            from trainer.model.vision_cross import inputs

            out, self.skip = inputs(ids, pos, images, self.image_token, self.idle)
            return out
        out: dict[str, Any] = self.stack(images)
        for key, token in self.token_types.items():
            out[key] = (ids == token).to(torch.long)
        if self.fam.mrope:
            out["position_ids"] = self.positions(ids, pos, images.get("image_grid_thw"), out)
        self.idle_now = self.idle is not None and not images
        return out

    def stack(self, images: dict[str, Any]) -> dict[str, Any]:
        """The tensors as the model takes them (Idefics3: every tile of the micro batch in one row)."""
        if not self.fam.stacked:
            return dict(images)
        return {k: v[None] if k in ("pixel_values", "pixel_attention_mask") else v for k, v in images.items()}

    def positions(self, ids: Any, pos: Any, grids: Any, out: dict[str, Any]) -> Any:
        """(4, B, S): the text positions (restarting at each packed example), then each example's multimodal
        positions from the model's get_rope_index on that example alone."""
        import torch

        types = out.get("mm_token_type_ids")
        if types is None:
            types = torch.zeros_like(ids)
        rope = pos[None].repeat(3, 1, 1)
        merge = self.model.config.vision_config.spatial_merge_size
        base = self.model.model if hasattr(self.model.model, "get_rope_index") else self.model
        at = 0  # the next image's grid
        for b in range(ids.shape[0]):
            starts = (pos[b] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for s, e in zip(starts[:-1], starts[1:], strict=True):
                n = int((types[b, s:e] != 0).sum())
                if n == 0:
                    continue
                take, tokens = 0, 0
                while tokens < n:
                    tokens += int(grids[at + take].prod()) // merge**2
                    take += 1
                got, _ = base.get_rope_index(
                    ids[b : b + 1, s:e], types[b : b + 1, s:e], image_grid_thw=grids[at : at + take]
                )
                rope[:, b, s:e] = got[:, 0]
                at += take
        return torch.cat([pos[None], rope], dim=0)

    def _idle_features(self, module: Any, args: Any, output: Any) -> Any:
        if not self.idle_now:
            return output
        self.idle_now = False
        import torch

        inner = self.model.model if hasattr(self.model.model, "get_image_features") else self.model
        out = inner.get_image_features(**{k: v.to(output.device) for k, v in self.stack(self.idle).items()})
        feats = getattr(out, "pooler_output", out)
        feats = torch.cat(list(feats)) if isinstance(feats, list | tuple) else feats
        # the model's own step for images (masked_scatter into the embeddings), at no position: the same graph
        return output.masked_scatter(torch.zeros_like(output, dtype=torch.bool), feats.to(output.dtype))
