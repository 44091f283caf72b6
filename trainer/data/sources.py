"""Where training text comes from: local files (globs; text, json/jsonl, parquet) or a hub dataset,
read with Hugging Face datasets; and what identifies a source's content for the cache."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from trainer.config import DataSource
from trainer.errors import UserError

FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def resolve_files(src: DataSource, key: str) -> tuple[list[str], str]:
    """Expand the globs; every glob must match; one format for all files."""
    files: list[str] = []
    for pattern in src.files or []:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matched = [m for m in matched if os.path.isfile(m)]
        if not matched:
            raise UserError(
                f"{key}.files: '{pattern}' matches no file (relative paths are resolved against {Path.cwd()}); "
                "check the path or the glob"
            )
        files += matched
    fmt = src.format
    if fmt == "auto":
        kinds = set()
        for f in files:
            suffixes = [s for s in Path(f).suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
            kind = FORMATS.get(suffixes[-1].lower() if suffixes else "")
            if kind is None:
                raise UserError(
                    f"{key}.files: cannot tell the format of '{f}' from its extension; set {key}.format to "
                    "text, json or parquet"
                )
            kinds.add(kind)
        if len(kinds) > 1:
            raise UserError(
                f"{key}.files: mixed formats ({', '.join(sorted(kinds))}); use one format per source"
            )
        fmt = kinds.pop()
    return files, fmt


def source_key(src: DataSource, key: str) -> dict[str, Any]:
    """What identifies a source's content for the cache: file stats, or the hub id."""
    if src.files is not None:
        files, fmt = resolve_files(src, key)
        stats = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
        return {"files": stats, "format": fmt, **_fields(src), "sample_by": src.sample_by}
    return {"hub": src.hub, "name": src.name, "split": src.split, **_fields(src)}


def _fields(src: DataSource) -> dict[str, Any]:
    """The columns a source's kind reads and how (text: only text_field, so text caches keep their key)."""
    from trainer.config import thaw
    from trainer.data.formats import required_columns

    if src.kind == "text":
        return {"text_field": src.text_field}
    return {"kind": src.kind, "columns": [c for _, c in required_columns(src)], "tools": src.tools_field,
            "formatting": src.formatting, "format_map": thaw(src.format_map)}  # fmt: skip


def open_text(path: str) -> Any:
    """A text file, decompressed by its extension (.gz, .bz2, .xz)."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(Path(path).suffix, open)
    return opener(path, "rt", encoding="utf-8")


def load_raw(src: DataSource, key: str) -> Any:
    import datasets

    if src.files is not None:
        files, fmt = resolve_files(src, key)
        if all(os.path.getsize(f) == 0 for f in files):
            raise UserError(
                f"{key}: the dataset is empty (every file is 0 bytes: {', '.join(files[:3])}); point it at data"
            )
        kwargs: dict[str, Any] = (
            {"sample_by": src.sample_by, "keep_linebreaks": True} if fmt == "text" else {}
        )
        try:
            ds = datasets.load_dataset(fmt, data_files=files, split="train", **kwargs)
        except Exception as e:  # datasets raises many kinds; all mean "this file is not what you said"
            raise UserError(
                f"{key}.files: cannot read {fmt} data from {', '.join(files[:3])}: {type(e).__name__}: {e}; check the "
                f"file contents or set {key}.format"
            ) from None
    else:
        try:
            ds = datasets.load_dataset(src.hub, src.name, split=src.split)
        except Exception as e:
            raise UserError(
                f"{key}.hub: cannot load '{src.hub}' (split {src.split}): {str(e).splitlines()[0]}"
            ) from None
    from trainer.data.formats import required_columns

    for name, column in required_columns(src):
        if column not in ds.column_names:
            how = f"{key}.formatting: {src.formatting}" if src.formatting else f"{key}.kind: {src.kind}"
            raise UserError(
                f"{key}.{name}: '{column}' is not a column of the data ({how}); its columns are "
                f"{', '.join(ds.column_names)}"
            )
    return ds


def _where(src: DataSource) -> str:
    return ", ".join(src.files) if src.files else str(src.hub)
