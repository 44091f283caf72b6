"""The lineage journal: `<run_dir>/checkpoints/journal.jsonl`, one record per event, appended and
fsynced before the directories it explains are moved or deleted. It is the only truth about which
line of checkpoints a run directory is on; `latest` is a cache derived from it.

Each record is one line of JSON with the event, its fields, and `crc`: the xxh3-64 of the canonical JSON
of the rest, so that a record damaged in place is told from one written whole. The events:

- `commit`: a checkpoint was committed (renamed to its final name): tag, step, id (its manifest's
  digest), parent (the id it continues; null for a fresh start), line, job (the supervisor's job id);
- `fork`: a resume of a checkpoint other than the line's newest (a rollback, or a checkpoint from
  elsewhere): the new line, its source (id, tag, step, path), and the checkpoints that leave this
  directory (`leaving`, moved to `to` or removed);
- `aside`: checkpoints set aside at start, to `damaged/` (damaged) or `abandoned/` (no part of the
  line: the rest of an interrupted fork);
- `prune`: checkpoints `keep_last` removes (recorded before the first is renamed away);
- `convert`: a checkpoint's universal files (their marker's digest, which holds every file's digest);
- `import`: the first record of a run directory written before journals existed: its line as the old
  rules read it (oldest first);
- `drop`: a set-aside directory deleted by `keep_abandoned` / `keep_damaged`.

A crash during an append leaves a torn last line (bytes after the last newline): it was never
acknowledged, so it is ignored, and the next append first cuts it off. A whole line that is not a record
(its crc fails) is damage after the fact, wherever it is: readers are told (`Parsed.damaged`), and a plain
resume refuses when the damage could hide the current line. `journal.last` names the last record appended
(its crc and where its line ends, written durably after it): a journal cut short or damaged at its end,
which would otherwise read as a shorter journal, is told by it (`cut_short`), and a plain resume refuses
then too.
No torch, no DeepSpeed: tests/unit/test_lineage*.py exercise it on a simulated file system.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.checkpoint.fs import LOCAL, LocalFS

JOURNAL = "journal.jsonl"
LAST = "journal.last"  # a copy of the last record appended: a journal cut short is told from a torn append
EVENTS = ("commit", "fork", "aside", "prune", "convert", "import", "drop")


def _crc(fields: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_64(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode(event: str, fields: dict[str, Any]) -> bytes:
    if event not in EVENTS:
        raise ValueError(f"unknown journal event {event!r}")
    rec = {"event": event, **fields, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    rec["crc"] = _crc(rec)
    return (json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any] | None:
    """A record, or None where the line is not one written whole."""
    try:
        rec = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("event") not in EVENTS:
        return None
    rest = {k: v for k, v in rec.items() if k != "crc"}
    return rec if rec.get("crc") == _crc(rest) else None


@dataclass(frozen=True)
class Record:
    n: int  # line number in the journal (1-based)
    event: str
    data: dict[str, Any]
    end: int = 0  # the byte offset just after its line

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


@dataclass
class Parsed:
    records: list[Record] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)  # whole lines that are not records: damaged in place
    torn: bool = False  # bytes after the last newline (a crash during an append)
    good_end: int = 0  # byte offset just after the last newline
    tail: tuple[str, int] | None = None  # journal.last: (crc, end offset) of a record appended, durably
    exists: bool = False


@functools.lru_cache(maxsize=8)  # a start reads the same journal a few times (readers never change a Parsed)
def parse(raw: bytes | None) -> Parsed:
    """Whole lines that are not records (their crc fails) are damage, wherever they are; bytes after the
    last newline are a torn append (a crash before its fsync returned: never acknowledged)."""
    out = Parsed(exists=raw is not None)
    if not raw:
        return out
    lines = raw.split(b"\n")
    lines.pop()  # after the last newline: b"" when the file ends with one, else a torn line
    offset = 0
    for i, line in enumerate(lines, 1):
        rec = decode(line)
        offset += len(line) + 1
        if rec is None:
            out.damaged.append(i)
        else:
            out.records.append(Record(i, rec["event"], rec, offset))
    out.good_end = offset
    out.torn = len(raw) > out.good_end
    return out


def read(root: Path, fs: LocalFS = LOCAL) -> Parsed:
    """The journal as it is, with `journal.last`'s record of the last append (read even where the journal is
    gone: a journal deleted is told from a directory that never had one). journal.last is read first: a writer
    appends, then writes it, so the journal read after it holds what it names (read the other way round, an
    append between the two reads looked like a journal cut short)."""
    tail = _tail(Path(root), fs)
    path = Path(root) / JOURNAL
    try:
        raw = fs.read_bytes(path)
    except FileNotFoundError:
        raw = None
    return dataclasses.replace(parse(raw), tail=tail)


def _tail(root: Path, fs: LocalFS) -> tuple[str, int] | None:
    try:
        last = json.loads(fs.read_bytes(root / LAST).decode())
        return str(last["crc"]), int(last["end"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none (a journal from before it), or damaged: the journal is read as it is


def _write_tail(root: Path, fs: LocalFS, crc: str, end: int) -> None:
    fs.durable_write(root / LAST, json.dumps({"crc": crc, "end": end}).encode(), tmp_name=f".{LAST}.tmp")


def cut_short(parsed: Parsed) -> bool:
    """The journal lost records after they were written (cut short, or its end damaged): `journal.last`,
    written after each append, names a record (its crc, where its line ends) the journal does not hold
    there. (A crash before journal.last was written leaves it naming an earlier record: that holds.)"""
    if parsed.tail is None:
        return False
    crc, end = parsed.tail
    return not any(r.end == end and r.data.get("crc") == crc for r in parsed.records)


def append(root: Path, event: str, fs: LocalFS = LOCAL, **fields: Any) -> Record:
    """Append one record and fsync it (rank 0). A torn tail left by a crash is cut off first; the
    first record of a journal also makes its directory entry durable."""
    root = Path(root)
    path = root / JOURNAL
    try:
        raw = fs.read_bytes(path)
    except FileNotFoundError:
        raw = None
    now = parse(raw)
    if now.torn:  # a crash during the last append: that record was never acknowledged
        raw = raw[: now.good_end]
        fs.durable_write(path, raw)
    tail = _tail(root, fs)
    if (
        not now.exists and tail is not None
    ):  # a deleted journal's: this one starts over (a fork the user chose)
        fs.unlink(root / LAST)
        fs.fsync_dir(root)
        tail = None
    newest = now.records[-1] if now.records else None
    if newest is not None and (
        tail is None or tail[1] < newest.end and not cut_short(dataclasses.replace(now, tail=tail))
    ):
        # journal.last behind (a crash after an append, before it was written): caught up first, so that it
        # never lags more than the one append in flight (a journal cut short across several would read whole)
        _write_tail(root, fs, newest.data.get("crc"), newest.end)
    line = encode(event, fields)
    fs.append(path, line)
    fs.fsync(path)
    if not now.exists:
        fs.fsync_dir(root)
    # what the journal must hold there from now on
    _write_tail(root, fs, decode(line[:-1])["crc"], len(raw or b"") + len(line))
    return Record((raw or b"").count(b"\n") + 1, event, decode(line[:-1]) or {})
