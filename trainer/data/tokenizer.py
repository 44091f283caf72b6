"""Tokenizers: the built-in byte tokenizer (no files), or any transformers tokenizer by path or hub id;
their shape (vocabulary, EOS) for planning without loading them twice, and their identity for the
data cache's key."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.common.files import write_atomic

EOS = "<|endoftext|>"
BYTE_VOCAB, BYTE_EOS_ID = 257, 256  # the built-in byte tokenizer: 256 bytes + EOS


def byte_tokenizer() -> Any:
    """A byte-level tokenizer that needs no files: ids 0..255 are the UTF-8 bytes, 256 is EOS.
    It is a real transformers tokenizer, so it saves with a checkpoint export."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(256)}
    vocab[EOS] = BYTE_EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, model_max_length=1 << 30)


def load_tokenizer(spec: str) -> Any:
    if spec == "byte":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise UserError(
            f"data.tokenizer: cannot load '{spec}': {str(e).splitlines()[0]}. Use 'byte', a local tokenizer "
            "directory, or a hub id on a machine with network access"
        ) from None


@functools.lru_cache(maxsize=16)
def special_edges(tok: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts around a text by default (`add_special_tokens=True`, as
    serving and transformers' own pipelines tokenize): Llama 3's, Gemma's and Mistral's BOS before,
    nothing after for most; ([], []) for Qwen's and the byte tokenizer."""
    probe = "probe text"
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe)["input_ids"]
    for at in range(len(full) - len(plain) + 1):
        if full[at : at + len(plain)] == plain:
            return list(full[:at]), list(full[at + len(plain) :])
    return [], []


def describe_edges(tok: Any) -> str:
    """The banner's words for special_edges (empty when the tokenizer adds nothing)."""
    before, after = special_edges(tok)
    if not before and not after:
        return ""
    parts = [f"{tok.decode(before)} before" if before else "", f"{tok.decode(after)} after" if after else ""]
    return " and ".join(p for p in parts if p)


def tokenizer_shape(spec: str, cache_dir: str | Path | None = None) -> tuple[int, int | None]:
    """(vocabulary size, EOS id) of a tokenizer, for planning. The byte tokenizer's are constants; a
    local tokenizer directory's are cached by its files' names, sizes and times, so that planning a
    model seen before does not import transformers."""
    if spec == "byte":
        return BYTE_VOCAB, BYTE_EOS_ID
    path = None
    local = Path(spec).expanduser()
    if cache_dir and local.is_dir():
        stamp = sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in local.iterdir() if f.is_file()
        )
        key = hashlib.sha256(json.dumps([str(local.resolve()), stamp]).encode()).hexdigest()[:24]
        path = Path(cache_dir).expanduser() / "model-info" / f"tokenizer-{key}.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            d = json.loads(path.read_text())
            return d["vocab"], d["eos"]
    tok = load_tokenizer(spec)
    shape = len(tok), tok.eos_token_id
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"vocab": shape[0], "eos": shape[1]}))
    return shape


# a tokenizer directory's files that are no part of the tokenizer (a model directory's weights)
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def _plain(value: Any) -> Any:
    """JSON for a tokenizer setting that is not: an AddedToken's content and flags; of other objects
    (a tokenizer object given in code) only the type, never an address that differs by process."""
    state = getattr(value, "__getstate__", None)
    if type(value).__name__ == "AddedToken" and state is not None:
        return state()
    return type(value).__name__


def tokenizer_id(tok: Any, spec: str) -> str:
    """The tokenizer's identity for the data cache's key, by content: its whole state as loaded (the
    vocabulary, merges, normaliser, pre-tokenizer, post-processor, decoder and added tokens with their
    flags), the special tokens and every setting of its config (chat template included), and for a local
    directory the bytes of each of its files but model weights. An edit of any of them (say
    tokenizer_config.json's eos_token) makes another key."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode()
        if backend is not None
        else json.dumps(sorted(tok.get_vocab().items())).encode()
    )
    settings = {k: v for k, v in getattr(tok, "init_kwargs", {}).items() if k != "name_or_path"}
    h.update(json.dumps([settings, tok.special_tokens_map, getattr(tok, "chat_template", None)],
                        sort_keys=True, default=_plain).encode())  # fmt: skip
    local = Path(spec).expanduser()
    if spec != "byte" and local.is_dir():
        for f in sorted(local.rglob("*")):
            if f.is_file() and not f.name.endswith(_NOT_TOKENIZER) and ".cache" not in f.parts:
                h.update(f.relative_to(local).as_posix().encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return f"{spec}:{len(tok)}:{h.hexdigest()[:16]}"
