"""Checkpoints set aside: the lines left by rollbacks in `abandoned/`, the checkpoints passed over as
damaged in `damaged/` (never resumed, never a rollback, kept for a look), each move recorded in the
journal before it is made, each directory named so that two moves in the same second never collide,
and both bounded by `checkpoint.keep_abandoned` / `keep_damaged` (the oldest deleted first, recorded).
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.checkpoint import journal
from trainer.checkpoint.disk import ABANDONED, DAMAGED, Entry, entry

CheckpointDir = Any  # trainer/checkpoint/directory.py's, which imports this module

ASIDE_NAME = re.compile(r"^(?P<tag>.+?)-(?P<time>\d{8}-\d{6})(?:-(?P<uid>[0-9a-f]+))?$")


def aside_dir(cd: CheckpointDir, kind: str, tag: str) -> Path:
    """A new directory under abandoned/ or damaged/: never the name of an earlier one (the time to the
    nanosecond and a random part), in the order they were made."""
    ns = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(ns // 10**9))
    return cd.root / kind / f"{tag}-{stamp}-{ns % 10**9:09d}{uuid.uuid4().hex[:3]}"


def set_aside(
    cd: CheckpointDir, entries: list[Entry], kind: str, why: str, to: Path | None = None
) -> Path | None:
    """Move checkpoints to `kind`/ (damaged or abandoned): recorded first, then moved."""
    entries = [e for e in entries if cd.fs.exists(e.path)]
    if not entries:
        return None
    to = to or aside_dir(cd, kind, entries[0].tag)
    journal.append(cd.root, "aside", cd.fs, kind=kind, why=why, to=str(to.relative_to(cd.root)),
                   items=[{"id": e.id, "tag": e.tag, "step": e.step} for e in entries])  # fmt: skip
    move(cd, entries, to)
    return to


def move(cd: CheckpointDir, entries: list[Entry], to: Path) -> None:
    fs = cd.fs
    fs.mkdir(to)
    fs.fsync_dir(to.parent)
    for n, e in enumerate(entries):
        dst = to / e.tag
        if fs.exists(dst):
            dst = to / f"{e.tag}-{uuid.uuid4().hex[:6]}"
        fs.rename(e.path, dst)
        if n == 0 and cd.faults is not None:
            cd.faults.at("killfork", 0)  # tests: killed inside a fork, after its first move
    fs.fsync_dir(to)
    fs.fsync_dir(cd.root)


def evict(cd: CheckpointDir, protect: list[Path] = (), ids: set[str] = frozenset()) -> list[str]:
    """Keep `keep_abandoned` lines in abandoned/ and `keep_damaged` checkpoints in damaged/ (the
    newest), never one holding a `protect`ed checkpoint (the current line's: a rollback to a checkpoint
    in abandoned/ continues from there) nor one whose id is in `ids` (the line's, where no record says where
    it is: the journal that did was lost); each deletion recorded first. Returns what was deleted."""
    out = []
    for kind, keep in ((ABANDONED, cd.keep_abandoned), (DAMAGED, cd.keep_damaged)):
        guarded = {Path(p).resolve() for p in protect}

        def holds_line(d: Path) -> bool:
            return any(
                (e := entry(d / n, cd.fs, any_name=True)) is not None and e.id in ids
                for n in cd.fs.listdir(d)
            )

        names = [
            n
            for n in held(cd, kind)
            if not any((cd.root / kind / n).resolve() in q.parents for q in guarded)
            and not (ids and holds_line(cd.root / kind / n))
        ]
        for name in names[: max(0, len(names) - keep)]:
            journal.append(cd.root, "drop", cd.fs, dir=f"{kind}/{name}")
            cd.fs.rmtree(cd.root / kind / name)
            # gone before the next drop's record: a power loss keeps their order
            cd.fs.fsync_dir(cd.root / kind)
            out.append(f"{kind}/{name}")
    return out


def held(cd: CheckpointDir, kind: str) -> list[str]:
    """What abandoned/ or damaged/ holds, oldest first: in the order the journal recorded the moves that made
    them (a fork's or a set-aside's `to`), never by the time in their names, which is the local time of the
    process that moved them (another time zone, a clock that jumped or differs between nodes would reorder
    them); directories no record names (a journal from before, or lost) first, by name."""
    names = [n for n in cd.fs.listdir(cd.root / kind) if cd.fs.is_dir(cd.root / kind / n)]
    made: dict[str, int] = {}
    for r in journal.read(cd.root, cd.fs).records:
        to = r.get("to") if r.event in ("fork", "aside") else None
        if isinstance(to, str) and to.startswith(f"{kind}/"):
            made.setdefault(to.split("/", 1)[1], r.n)

    def order(name: str) -> tuple[int, str, str]:
        m = ASIDE_NAME.match(name)
        return made.get(name, 0), *((m.group("time"), m.group("uid") or "") if m else ("", name))

    return sorted(names, key=order)


def set_aside_dirs(cd: CheckpointDir) -> list[str]:
    """What abandoned/ and damaged/ hold ('abandoned/<name>'), for a fork's record: a line chosen by the user
    (--resume PATH) vouches for the directories set aside before it, whatever journal made them (one lost, or
    restored from a backup since), so that they are no evidence of a journal older than the disk after it."""
    return [f"{kind}/{n}" for kind in (ABANDONED, DAMAGED) for n in sorted(cd.fs.listdir(cd.root / kind))]


def describe(cd: CheckpointDir) -> str | None:
    """What abandoned/ and damaged/ hold, for the banner (None: nothing)."""
    parts = []
    for kind, keep, what in (
        (ABANDONED, cd.keep_abandoned, "line"),
        (DAMAGED, cd.keep_damaged, "checkpoint"),
    ):
        names = held(cd, kind)
        if names:
            parts.append(f"{cd.root / kind} holds {len(names)} {what}{'s' if len(names) != 1 else ''} "
                         f"({', '.join(names[-3:])}; checkpoint.keep_{kind}: {keep})")  # fmt: skip
    return "; ".join(parts) or None
