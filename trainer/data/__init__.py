"""Data: sources -> tokenized -> packed into seq_len blocks -> cached -> per-rank, resumable batches.

- `sources.py`: local files or a hub dataset;
- `tokenizer.py`: the byte tokenizer or a transformers one;
- `pack.py`: tokenize and pack;
- `cache.py`: the tokenized cache and the training data's fingerprint (`build` -> `Data`);
- `stream.py`: the global, world-size-independent order and each rank's batches.
"""

from trainer.data.cache import Data, build, data_changes, file_digest
from trainer.data.sources import resolve_files
from trainer.data.stream import Position, RankSampler, TrainStream, eval_batches, make_loader
from trainer.data.tokenizer import (
    BYTE_EOS_ID,
    BYTE_VOCAB,
    EOS,
    byte_tokenizer,
    load_tokenizer,
    tokenizer_shape,
)

__all__ = [
    "BYTE_EOS_ID",
    "BYTE_VOCAB",
    "EOS",
    "Data",
    "Position",
    "RankSampler",
    "TrainStream",
    "build",
    "byte_tokenizer",
    "data_changes",
    "eval_batches",
    "file_digest",
    "load_tokenizer",
    "make_loader",
    "resolve_files",
    "tokenizer_shape",
]
