"""Llama 3.2 Vision's cross-attention mask as its processor makes it (trainer/model/vision_cross.py says what the
model side adds): which tokens of an example see which image's tiles. The data checks the processor's mask of
every example against it, so that the model side, which makes it again for packed rows and batches, gives each
example what the processor gives it."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.common.errors import UserError


def spans(ids: Any, image_token: int) -> list[tuple[int, int]]:
    """[start, end) of the tokens that see each image of an example (the processor's
    `get_cross_attention_token_mask`): from its token to the next image's, consecutive images together to the
    end of the last one's, the last image's to the end."""
    at = [i for i, t in enumerate(np.asarray(ids).tolist()) if t == image_token]
    if not at:
        return []
    ends = at[1:] + [len(ids)]
    out = [[s, e] for s, e in zip(at, ends, strict=True)]
    last = len(ids)
    for span in reversed(out):
        if span[1] == span[0] + 1:  # an image followed at once by another: it sees as far as that one
            span[1] = last
        last = span[1]
    return [(s, e) for s, e in out]


def example_mask(ids: Any, image_token: int, tiles: list[int], max_tiles: int) -> np.ndarray:
    """The processor's cross_attention_mask of one example (S, images, max_tiles): 1 where a token sees a tile."""
    out = np.zeros((len(ids), len(tiles), max_tiles), dtype=np.int64)
    for j, (s, e) in enumerate(spans(ids, image_token)):
        out[s:e, j, : tiles[j]] = 1
    return out


def checked(tensors: dict[str, Any], ids: list[int], image_token: int, where: Any) -> dict[str, Any]:
    """The processor's tensors of one example without its cross_attention_mask (1, S, images, tiles), once that
    is the mask `example_mask` makes from the ids and each image's tiles (aspect_ratio_mask); refused where not."""
    theirs = tensors.pop("cross_attention_mask", None)
    if theirs is None:
        return tensors
    tiles = np.asarray(tensors["aspect_ratio_mask"]).reshape(-1, theirs.shape[-1]).sum(axis=1).tolist()
    ours = example_mask(ids, image_token, [int(t) for t in tiles], theirs.shape[-1])
    if theirs.shape[1:] != ours.shape or not np.array_equal(np.asarray(theirs)[0] != 0, ours != 0):
        raise UserError(f"{where}: the processor's cross_attention_mask is not the one its image tokens give; this "
                        "processor is not verified")  # fmt: skip
    return tensors
