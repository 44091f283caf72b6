"""Llama 3.2 Vision (transformers' mllama): images the language model attends by cross-attention layers.

An image is one `<|image|>` token in the text. The tower encodes each image as tiles (the processor pads every
image to `max_image_tiles`), and the language model's cross-attention layers attend each text token to the tiles
of the images it sees: `cross_attention_mask` (B, S, images, tiles), made by the processor from the image tokens'
places (`spans`: an image from its token to the next image's, consecutive images together, the last to the end)
and each image's real tiles.

What transformers does besides, and why a batch or a packed row needs more than the processor's mask to give
each example what it gives the example alone:

- **A token that sees no image** (before an example's first image): its mask row is all zeros, and transformers
  then lets it attend to every tile of its row and zeroes only its MLP's output (`full_text_row_masked_out_mask`),
  not its attention's (`_prepare_cross_attention_mask`). Alone, that is every tile of the example's own images; in
  a packed row or a batch padded to more images, the other examples' and the padding's too. Here such a token's
  mask holds 2 over its own example's images' tiles (`SEES_ALL`): `install` makes transformers read 2 as "attends,
  row masked out", which alone is what the all-zero row gives.
- **An example without an image**: alone, transformers skips the cross-attention layers (no pixel values). In a row
  or batch with images they would run for its tokens; here their output is their input at those tokens (`skip`, a
  forward hook on each cross-attention layer: trainer/model/vision.py `Inputs.install`), so that every example's
  logits are its own alone (measured: packed rows of examples with and without images against each alone, 1e-7).
- **The idle image**: a micro batch without an image still runs the tower and every cross-attention layer (on
  the blank image, every token skipping), so that under ZeRO-3 every rank gathers the same modules in the same
  order, and the loss is the one without images.
"""

from __future__ import annotations

from typing import Any

from trainer.data.cross_mask import spans

SEES_ALL = 2  # a mask entry: attends, as a token that sees no image attends, its row's MLP masked out


def inputs(ids: Any, pos: Any, images: dict[str, Any], image_token: int, idle: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """(the forward's image arguments, the tokens whose example has no image (B, S) bool) for rows (B, S) and
    their images' tensors, every image's end to end (pixel values (N, tiles, C, H, W), aspect ratio ids (N,) and
    mask (N, tiles)): each row's images in their own slots (padded as the processor pads a batch), the mask of
    each packed example (positions restarting) over its own images. Without images, the idle image in each row's
    slot and every token skipping (None: no image arguments)."""
    import torch

    b, s = ids.shape
    skip = torch.ones((b, s), dtype=torch.bool, device=ids.device)
    if not images:
        if idle is None:
            return {}, None
        n = {k: v.to(ids.device) for k, v in idle.items()}
        tiles = n["pixel_values"].shape[1]
        return {"pixel_values": n["pixel_values"][None].expand(b, *n["pixel_values"].shape).contiguous(),
                "aspect_ratio_ids": n["aspect_ratio_ids"][None].expand(b, -1).contiguous(),
                "aspect_ratio_mask": n["aspect_ratio_mask"][None].expand(b, -1, -1).contiguous(),
                "cross_attention_mask": torch.zeros((b, s, 1, tiles), dtype=torch.long, device=ids.device)}, skip  # fmt: skip
    pixels, ratio_ids, ratio_mask = (
        images["pixel_values"],
        images["aspect_ratio_ids"],
        images["aspect_ratio_mask"],
    )
    tiles = pixels.shape[1]
    counts = (ids == image_token).sum(dim=1).tolist()
    if sum(counts) != pixels.shape[0]:
        raise RuntimeError(f"{sum(counts)} image tokens in the micro batch, {pixels.shape[0]} images")
    most = max(max(counts), 1)
    # padding as the processor pads a batch: zero pixels, aspect ratio id 0, the first tile marked
    out_pixels = pixels.new_zeros((b, most, *pixels.shape[1:]))
    out_ids = ratio_ids.new_zeros((b, most))
    out_mask = ratio_mask.new_zeros((b, most, tiles))
    out_mask[:, :, 0] = 1
    cross = torch.zeros((b, s, most, tiles), dtype=torch.long, device=ids.device)
    real = ratio_mask.sum(dim=1).tolist()
    at = 0
    for r in range(b):
        out_pixels[r, : counts[r]] = pixels[at : at + counts[r]]
        out_ids[r, : counts[r]] = ratio_ids[at : at + counts[r]]
        out_mask[r, : counts[r]] = ratio_mask[at : at + counts[r]]
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [s]
        slot = 0  # the row's next image
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            found = spans(ids[r, start:end].tolist(), image_token)
            if not found:
                continue
            skip[r, start:end] = False
            cross[r, start : start + found[0][0], slot : slot + len(found)] = SEES_ALL
            for j, (a, e) in enumerate(found):
                cross[r, start + a : start + e, slot + j, : real[at + slot + j]] = 1
            slot += len(found)
        at += counts[r]
    kwargs = {"pixel_values": out_pixels, "aspect_ratio_ids": out_ids, "aspect_ratio_mask": out_mask,
              "cross_attention_mask": cross}  # fmt: skip
    return kwargs, skip


def install() -> None:
    """Make transformers' mllama read `SEES_ALL` in a cross-attention mask (see the module docstring); a mask of
    0 and 1 gives what it gave before."""
    from transformers.models.mllama import modeling_mllama as mllama

    original = mllama._prepare_cross_attention_mask
    if getattr(original, "sees_all", False):
        return

    def prepare(cross_attention_mask: Any, num_vision_tokens: int, dtype: Any) -> tuple[Any, Any]:
        import torch

        if not bool((cross_attention_mask == SEES_ALL).any()):
            return original(cross_attention_mask, num_vision_tokens, dtype)
        b, s = cross_attention_mask.shape[:2]
        mask = cross_attention_mask.repeat_interleave(num_vision_tokens, dim=3).view(b, s, -1).unsqueeze(1)
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive = additive.masked_fill(mask == 0, torch.finfo(dtype).min)
        rows = (mask == 1).any(dim=-1).to(dtype)[..., None]
        # a row that sees nothing at all (padding after the examples): transformers' all-zero row
        none = (mask == 0).all(dim=-1, keepdim=True)
        return additive.masked_fill(none, 0), rows

    prepare.sees_all = True  # type: ignore[attr-defined]
    prepare.original = original  # type: ignore[attr-defined]
    mllama._prepare_cross_attention_mask = prepare


def skip_hook(state: Any) -> Any:
    """A cross-attention layer's forward hook: its input where `state.skip` (B, S) marks a token."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        skip = state.skip
        if skip is None:
            return output
        import torch

        return torch.where(skip[..., None], args[0], output)

    return hook


def cross_layers(model: Any) -> list[Any]:
    """The language model's cross-attention decoder layers."""
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    return [m for m in model.modules() if isinstance(m, MllamaCrossAttentionDecoderLayer)]
