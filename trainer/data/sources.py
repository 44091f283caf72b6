"""Where training text comes from: local files (globs; text, json/jsonl, parquet) or a hub dataset,
read with Hugging Face datasets; what identifies a source's content for the cache; and where a row
came from (`locator`: file and line for JSON lines, file and item for a JSON array, file and row for
parquet), for the errors that name an example."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.common.errors import UserError
from trainer.config import DataSource, thaw
from trainer.data.formats import paired, required_columns

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
    if src.kind == "text":
        return {"text_field": src.text_field}
    pairs = [src.chosen_field, src.rejected_field] if src.kind == "unpaired" else []  # (pairs taken apart)
    return {"kind": src.kind, "columns": [c for _, c in required_columns(src)] + pairs, "tools": src.tools_field,
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
    for name, column in required_columns(src):
        if column not in ds.column_names and not (src.kind == "unpaired" and paired(src, ds.column_names)):
            how = f"{key}.formatting: {src.formatting}" if src.formatting else f"{key}.kind: {src.kind}"
            raise UserError(
                f"{key}.{name}: '{column}' is not a column of the data ({how}); its columns are "
                f"{', '.join(ds.column_names)}"
            )
    return ds


def _where(src: DataSource) -> str:
    return ", ".join(src.files) if src.files else str(src.hub)


class Place:
    """Where row `n` of a source is, worked out only when shown (an error message): 'FILE:LINE' for JSON
    lines, 'FILE item K' for a JSON array, 'FILE row K' for parquet, the key and the row for a hub
    dataset."""

    def __init__(self, files: Callable[[], list[tuple[str, str, int]]], key: str, n: int) -> None:
        self.files, self.key, self.n = files, key, n

    def __str__(self) -> str:
        n = self.n
        for name, kind, rows in self.files():
            if n < rows:
                return f"{name}:{_line(name, n)}" if kind == "lines" else f"{name} {kind} {n}"
            n -= rows
        return f"{self.key} row {self.n}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731 (f-strings)

    @property
    def file(self) -> str | None:
        """The file row `n` is in (None: a hub dataset): relative image paths are resolved against its folder."""
        n = self.n
        for name, _, rows in self.files():
            if n < rows:
                return name
            n -= rows
        return None


def locator(src: DataSource, key: str) -> Callable[[int], Place]:
    """Row number -> its Place; the files are read once, at the first Place shown."""
    found: list[tuple[str, str, int]] = []

    def files() -> list[tuple[str, str, int]]:
        if src.files is not None and not found:
            found.extend(_rows_of_files(src, key))
        return found

    return lambda n: Place(files, key, n)


def _rows_of_files(src: DataSource, key: str) -> list[tuple[str, str, int]]:
    """(file, 'lines' | 'item' | 'row', rows) for each file of a source, in the order datasets reads them."""
    files, fmt = resolve_files(src, key)
    out = []
    for f in files:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            out.append((f, "row", pq.ParquetFile(f).metadata.num_rows))
            continue
        with open_text(f) as fh:
            text = fh.read()
        if text.lstrip().startswith("["):
            try:
                out.append((f, "item", len(json.loads(text))))
            except json.JSONDecodeError:
                out.append((f, "item", 0))
        else:
            out.append((f, "lines", sum(1 for line in text.split("\n") if line.strip())))
    return out


def _line(path: str, n: int) -> int:
    """The line number of the n-th non-blank line (JSON lines: datasets skips blank lines)."""
    with open_text(path) as fh:
        for i, line in enumerate(fh.read().split("\n"), 1):
            if line.strip():
                if n == 0:
                    return i
                n -= 1
    return -1
