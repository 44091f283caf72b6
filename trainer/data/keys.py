"""The data cache's key (trainer/data/cache.py): what determines the tokens a cache holds -- every data option
that shapes them, the source files, the tokenizer, the chat template, the cache's format and the code that
makes the tokens -- and, when a cache is built though one of the same files exists, what changed since."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainer.config import DataSection
from trainer.data.sources import source_key
from trainer.data.tokenizer import tokenizer_id

CACHE_VERSION = 5  # 5: the key holds the code's digest (4: a chat turn's targets end at its end-of-turn
# token; 3: text packed across map batches, last block padded; 2: .npy files; 1: Arrow)

# The modules whose code makes the tokens a row holds (reading, formatting, rendering, tokenizing, packing,
# writing the cache): their source is in the key, so that a cache built by other code is never reused
# (issue 54: a turn-end fix changed 250 targets to 500 under the same key). tests/unit/test_cache_key.py
# holds that every trainer module a cache build runs is here or in NOT_TOKEN_CODE.
TOKEN_MODULES = (
    "cache",
    "chat",
    "cross_mask",
    "examples",
    "formats",
    "image_rows",
    "images",
    "pack",
    "preference",
    "prompts",
    "sources",
    "templates",
    "tokenizer",
    "unpaired",
)


# beside them: the roles and column maps the formats read (trainer/config/data_schema.py), and the libraries
# that render and cut the tokens (a chat template's rendering, the offsets the targets are cut by)
SCHEMA = Path(__file__).parent.parent / "config" / "data_schema.py"
LIBRARIES = ("transformers", "tokenizers", "jinja2")


def code_digest(root: Path | None = None, schema: Path | None = None) -> str:
    """The digest of the source of TOKEN_MODULES (in trainer/data, or `root`), of the data schema's
    (SCHEMA, or `schema`), and of LIBRARIES' versions."""
    import importlib.metadata

    root = Path(__file__).parent if root is None else root
    h = hashlib.sha256()
    for name in TOKEN_MODULES:
        h.update(name.encode() + b"\0" + (root / f"{name}.py").read_bytes() + b"\0")
    h.update((schema or SCHEMA).read_bytes() + b"\0")
    for lib in LIBRARIES:
        try:
            h.update(f"{lib}={importlib.metadata.version(lib)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{lib}=none\0".encode())
    return h.hexdigest()[:20]


# data options that do not change the tokens the cache holds (how they are read, batched and ordered at
# run time, or where the cache lives); every other option of the data section and of each source is in
# the key, so that an option added later keys the cache until it is listed here
NOT_IN_THE_TOKENS = frozenset(
    {"num_workers", "pin_memory", "persistent_workers", "num_proc", "shuffle", "cache_dir", "group_by_length"}
)


def cache_key(section: DataSection, tok: Any) -> dict[str, Any]:
    """What determines the cached tokens: every data option (NOT_IN_THE_TOKENS aside) with each source's
    files by path, size and modification time, the tokenizer by content (tokenizer_id), the chat
    template's rendering and the cache's format."""
    options = section.model_dump(mode="json", exclude=set(NOT_IN_THE_TOKENS))
    key: dict[str, Any] = {
        "version": CACHE_VERSION,
        "code": _code(),
        "options": options,
        "train": (
            [{**source_key(s, k), "weight": s.weight} for k, s in section.sources]
            if section.mixture
            else source_key(section.train, "data.train")
        ),
        "eval": source_key(section.eval, "data.eval") if section.eval is not None else None,
        "tokenizer": tokenizer_id(tok, section.tokenizer),
    }
    if section.kind != "text" or section.separate_documents:
        from trainer.data.examples import chat_template

        key["finetune"] = {
            "template": chat_template(section, tok),  # the template, its kwargs and multi_turn
            "row_targets": True,  # targets.npy beside train.npy
        }
        if section.kind == "chat":  # images: the processor's settings (the image bytes: meta.json's stamps)
            from trainer.data.images import load_processor, processor_id

            proc = processor_id(load_processor(section.tokenizer))
            if proc is not None:
                key["finetune"]["processor"] = proc
    return key


_CODE: list[str] = []


def _code() -> str:
    if not _CODE:
        _CODE.append(code_digest())
    return _CODE[0]


# What a rebuilt cache's key differs in, in the words the banner uses
WHY = {
    "version": "the cache format changed",
    "code": "the code that makes the tokens changed (trainer/data: " + ", ".join(TOKEN_MODULES) + ")",
    "options": "data options changed",
    "train": "the training files changed",
    "eval": "the eval files changed",
    "tokenizer": "the tokenizer changed",
    "finetune": "the chat template changed",
}


def rebuilt_why(root: Path, key: dict[str, Any], digest: str) -> str | None:
    """Why the cache for `key` is built though caches of the same training files are in `root`: what the
    newest of them was keyed on that differs (None: no cache of these files was built before)."""

    def paths(k: Any) -> str:  # the training files by path (or hub id), not by size and time
        train = k.get("train")
        rows = train if isinstance(train, list) else [train]
        return json.dumps([sorted(f[0] for f in r["files"]) if (r or {}).get("files") else (r or {}).get("hub")
                           for r in rows])  # fmt: skip

    key = json.loads(json.dumps(key))  # as meta.json holds it (tuples as lists)
    mine, best = paths(key), None
    for meta in root.glob("*/meta.json"):
        if meta.parent.name == digest:
            continue
        try:
            old = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if paths(old) == mine and (best is None or meta.stat().st_mtime > best[0]):
            best = (meta.stat().st_mtime, old)
    if best is None:
        return None
    old = best[1].get("key", best[1])  # the key as stored (older caches: the meta, whose finetune is stats)
    differ = [
        WHY[k] for k in WHY if old.get(k) != key.get(k) and not (k == "finetune" and "key" not in best[1])
    ]
    return "; ".join(differ) or "its key changed"


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file's bytes (the data cache's train_digest)."""
    from trainer.common.files import hash_file

    return hash_file(path, hashlib.sha256(), chunk)


def side_digests(directory: Path) -> dict[str, str]:
    """What the training rows hold beside their tokens, digested for the fingerprint (a resume over other values
    is other data): the images' pixels (images_digest), the unpaired rows' labels or the pairs' margins
    (margins_digest, margins.npy; None where there are none)."""
    from trainer.data.image_rows import images_digest

    margins = directory / "margins.npy"
    held = margins.exists() and _any_value(margins)
    return {**images_digest(directory), "margins_digest": file_digest(margins) if held else None}


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the training data differs from the data a checkpoint was trained on (both `Data.fingerprint`),
    each difference in words; [] when the packed sequences are the same (a file that was only touched
    or re-tokenized to the same tokens is no change)."""
    out = [f"{what}: {saved.get(key)} at the checkpoint, {now[key]} now{why}" for key, what, why in (
        ("reference", "the reference's log-probs (train.objective dpo or ipo) computed for",
         " (another model, precision or data); a resumed run keeps its reference"),
        ("teacher", "the teacher (train.distill.teacher)", "")) if key in now and saved.get(key) != now[key]]  # fmt: skip
    if saved.get("images_digest") != now.get("images_digest"):
        out.append("the images' pixels differ from the checkpoint's (an image file changed since)")
    # (a checkpoint older than the labels' digest has none: not a difference)
    if "margins_digest" in saved and saved["margins_digest"] != now.get("margins_digest"):
        out.append("the rows' labels (unpaired data) or the pairs' margins differ from the checkpoint's")
    if (
        saved.get("train_digest") == now["train_digest"]
        and saved.get("train_sequences") == now["train_sequences"]
    ):
        return out
    if saved.get("train_sequences") != now["train_sequences"]:
        out.append(
            f"training sequences: {saved.get('train_sequences')} at the checkpoint, {now['train_sequences']} now"
        )
    else:
        out.append(f"the same number of training sequences ({now['train_sequences']}) with other tokens")
    if saved.get("tokenizer") != now["tokenizer"]:
        out.append(f"tokenizer: {saved.get('tokenizer')} at the checkpoint, {now['tokenizer']} now")
    before, after = saved.get("sources") or {}, now["sources"]
    if "files" in before and "files" in after:
        old = {f[0]: (f[1], f[2]) for f in before["files"]}
        new = {f[0]: (f[1], f[2]) for f in after["files"]}
        for path in sorted(old.keys() - new.keys()):
            out.append(f"{path}: gone")
        for path in sorted(new.keys() - old.keys()):
            out.append(f"{path}: new ({new[path][0]:,} bytes)")
        for path in sorted(old.keys() & new.keys()):
            (s0, t0), (s1, t1) = old[path], new[path]
            if s0 != s1:
                out.append(f"{path}: {s0:,} bytes at the checkpoint, {s1:,} now")
            elif t0 != t1:
                out.append(f"{path}: modified since the checkpoint (same size)")
    elif before != after:
        out.append(f"source: {before} at the checkpoint, {after} now")
    return out


def _any_value(margins: Path) -> bool:
    """margins.npy holds a label or a margin (pairs without a margin column hold NaN alone)."""
    import numpy as np

    return bool(np.isfinite(np.load(margins)).any())
