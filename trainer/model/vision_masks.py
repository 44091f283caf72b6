"""Gemma 3's attention masks for packed rows with images (transformers 5.24, models/gemma3/modeling_gemma3.py
`create_masks_for_vision_model`).

Gemma 3 lets an image's tokens attend to each other both ways (its "blocks", from token_type_ids). On its full
attention layers transformers ORs the blocks into the causal mask after the packed rows' remapping (masking_utils
`create_causal_mask(block_sequence_ids=...)`); on its sliding-window layers it passes them as an
`or_mask_function`, which `remap_positions_for_packed_sequence` then calls with each token's position within its
example instead of its index in the row: a packed row's second example's image tokens look up the blocks of the
first example's tokens at those positions, and attend otherwise than alone (measured: loss 3.1e-4, gradients 0.38
relative on a small Gemma 3; with every layer full attention the same rows match exactly).

`install` wraps the function so that, for packed rows only (position ids that restart), the sliding layers' mask
is made as the full layers' is: the blocks ORed after the remapping, the window ANDed before it. That is the same
mask wherever an image's block is no longer than the window (Gemma 3's 256 tokens an image against a window of
512 or 1,024; where an image's tokens outnumber the window, packing images is refused before training:
vision_packing.verdict). Rows that are not packed get transformers' masks unchanged.
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    """Wrap Gemma 3's mask function once a process (see the module docstring)."""
    from transformers.models.gemma3 import modeling_gemma3 as gemma3

    original = gemma3.create_masks_for_vision_model
    if getattr(original, "packed_rows_fixed", False):
        return

    def masks(config: Any, inputs_embeds: Any, attention_mask: Any, cache: Any, position_ids: Any,
              block_sequence_ids: Any) -> dict:  # fmt: skip
        out = original(config, inputs_embeds, attention_mask, cache, position_ids, block_sequence_ids)
        if not _packed(position_ids, block_sequence_ids, config):
            return out
        from transformers.masking_utils import create_causal_mask, sliding_window_overlay

        sliding = getattr(cache, "is_sliding", None)
        out["sliding_attention"] = create_causal_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids, block_sequence_ids=block_sequence_ids,
            and_mask_function=sliding_window_overlay(config.sliding_window),
            layer_idx=sliding.index(True) if sliding and True in sliding else 0,
        )  # fmt: skip
        return out

    masks.packed_rows_fixed = True  # type: ignore[attr-defined]
    masks.original = original  # type: ignore[attr-defined]
    gemma3.create_masks_for_vision_model = masks


def _packed(position_ids: Any, block_sequence_ids: Any, config: Any) -> bool:
    """Packed rows (position ids that restart) whose image blocks are no longer than the sliding window."""
    if position_ids is None or position_ids.dim() != 2 or block_sequence_ids is None:
        return False
    from transformers.masking_utils import find_packed_sequence_indices

    if find_packed_sequence_indices(position_ids) is None:
        return False
    import torch

    longest = max((int(torch.bincount(row[row >= 0]).max()) for row in block_sequence_ids if (row >= 0).any()),
                  default=0)  # fmt: skip
    return longest <= int(config.sliding_window or 0)
