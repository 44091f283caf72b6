"""Which checkpoint a resume, a restart, pruning and export take: a pure function of the journal
(journal.py) and a scan of the checkpoints directory. No torch, no DeepSpeed, no writes here: what
follows from a decision is done by trainer/checkpoint/directory.py.

A line is a sequence of checkpoints trained one from the other. Every checkpoint records its line and
its parent (the checkpoint its training continued) in its manifest, and the journal records each
commit, each fork (a resume of anything but the line's newest: a new line), each set-aside and prune.
The current line is the line of the journal's last commit or fork; its head is that commit (or the
fork's source). A checkpoint committed on the current line whose journal record a crash prevented
(renamed into place, then killed) names the head as its parent and the current line: it is adopted as
the new head. The invariants (docs/checkpoints.md), which tests/unit/test_lineage_crashes.py checks after
every operation and every crash:

- a plain resume continues the newest intact checkpoint of the current line: the head, else down its
  parents, each verified (a damaged one is named once and set aside);
- no intact checkpoint of the current line is removed but by `keep_last`, which keeps that many intact;
- a line left by a rollback is never resumed or pruned into the current one unless named;
- a plain resume refuses (exit 2) where damage to the journal could hide the current line, never guesses.

A run directory written before journals existed is read by the rules of that time (`legacy_latest`),
and gets a journal at its next start.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint import journal
from trainer.checkpoint.disk import (
    DAMAGED,
    LATEST,
    STEP_DIR,
    Entry,
    Found,
    entry,
    named_by_latest,
    scan,
    verify,
)
from trainer.checkpoint.doubt import gone, refuse_a_cut_line, refuse_unsure, unrecorded
from trainer.checkpoint.fs import LOCAL, LocalFS
from trainer.common.errors import UserError

log = logging.getLogger("trainer")


@dataclass
class View:
    """A checkpoints directory as read once: its journal and its step_* directories."""

    root: Path
    fs: LocalFS
    log: journal.Parsed
    disk: list[Entry]

    @classmethod
    def read(cls, root: Path, fs: LocalFS = LOCAL) -> View:
        root = Path(root)
        return cls(root, fs, journal.read(root, fs), scan(root, fs))

    # ----------------------------------------------------------------- the graph
    @property
    def records(self) -> list[journal.Record]:
        return self.log.records

    @property
    def journaled(self) -> bool:
        """The directory keeps a journal: whole records, or a journal damaged or cut short to none, or gone
        where it left evidence (`gone`): never read as a directory from before journals, since the line it
        held is unknown, not the old rules'."""
        return bool(self.records or self.log.damaged or self.unsure([]))

    def unsure(self, damaged: list[int]) -> bool:
        """Journal damage could hide the current line: a record damaged after the one naming it (`current`'s
        third value), the journal cut short, gone, or older than the checkpoints here."""
        return bool(damaged or journal.cut_short(self.log) or gone(self) or unrecorded(self))

    def events(self, *kinds: str) -> list[journal.Record]:
        return [r for r in self.records if r.event in kinds]

    def pruned(self) -> set[str]:
        """Checkpoints a prune recorded (gone, or going: never resumed, removed at the next start), but
        for one named again since (a fork's source: resumed by path after its prune was recorded)."""
        out: set[str] = set()
        for r in self.events("prune", "fork"):
            if r.event == "prune":
                out |= {i["id"] for i in r.get("items", []) if i.get("id")}
            else:
                out.discard((r.get("source") or {}).get("id"))
        return out

    @functools.cached_property
    def index(self) -> dict[str, dict[str, Any]]:
        """The journal and the scan by id, built once: by_id (here), commit (its record), import_prev,
        tag (what a record names it), source (a fork's path), source_parent (the parent a fork's source or a
        pruned one had: the line below it when it is gone), moved (where a record set one aside), unreadable
        (here, by tag)."""
        return _index(self)

    def by_id(self) -> dict[str, Entry]:
        return self.index["by_id"]

    def current(self) -> tuple[str | None, str | None, list[int]]:
        """(the current line, its head's id, journal lines damaged after the record that says so)."""
        line = head = None
        at = 0
        for r in self.records:
            if r.event == "commit":
                line, head, at = r.get("line"), r.get("id"), r.n
            elif r.event == "fork":
                line, head, at = r.get("line"), (r.get("source") or {}).get("id"), r.n
            elif r.event == "import":
                chain = r.get("chain") or []
                line, head, at = r.get("line"), chain[-1]["id"] if chain else None, r.n
        # a head set aside as damaged by a resume: the line goes on below it
        items = [i for r in self.events("aside") if r.get("kind") == DAMAGED for i in r.get("items", [])]
        passed = {i.get("id") for i in items}
        # one whose state could not be read is recorded by its tag alone: the head of that tag, not here
        unread = {i.get("tag") for i in items if i.get("id") is None}
        while head is not None and (
            head in passed or self.index["tag"].get(head) in unread and self.locate(head) is None
        ):
            head = self.parent_of(head, self.locate(head))
        recorded = set(self.index["commit"])
        while line is not None:  # committed here, its journal record lost to a crash: adopted
            kids = [e for e in self.disk if e.id not in recorded and e.id is not None
                    and e.lineage("line") == line and e.lineage("parent") == head]  # fmt: skip
            if not kids:
                break
            kid = max(kids, key=lambda e: e.step)
            head = kid.id
            recorded.add(head)
        return line, head, [n for n in self.log.damaged if n > at]

    def parent_of(self, ident: str, located: Entry | None) -> str | None:
        rec = self.index["commit"].get(ident)
        if rec is not None:
            return rec.get("parent")
        if located is not None and located.state is not None and located.lineage("line") is not None:
            return located.lineage("parent")
        if ident in self.index["source_parent"]:
            return self.index["source_parent"][ident]
        if ident in self.index["import_prev"]:
            return self.index["import_prev"][ident]
        if located is not None and located.state is not None and located.path.parent == self.root:
            # a checkpoint from before lineages: the line as the old rules read it (the next older one)
            older = [
                e
                for e in self.disk
                if e.state is not None and e.lineage("line") is None and e.step < located.step
            ]
            return older[-1].id if older else None
        return None

    def locate(self, ident: str) -> Entry | None:
        """Where the checkpoint `ident` is now: in this directory, or a fork's source elsewhere."""
        here = self.index["by_id"].get(ident)
        if here is not None:
            return here
        path = self.index["source"].get(ident)  # a fork's source: here (relative) or elsewhere (absolute)
        if path is not None:
            e = entry(self.root / path, self.fs, any_name=True)  # an absolute path stays what it is
            if e is not None and e.id in (ident, None):
                return e
        moved = self.index["moved"].get(
            ident
        )  # set aside by a record (one the journal never saw committed too)
        if moved is not None:
            e = entry(self.root / moved, self.fs, any_name=True)
            if e is not None and e.id == ident:
                return e
        tag = self.index["tag"].get(ident)  # its manifest damaged: known by its tag, where it was committed
        if tag is not None and tag in self.index["unreadable"] and path in (None, tag):
            return self.index["unreadable"][tag]
        return None  # never guessed from abandoned/: only a fork's record makes one of those current

    def chain(self, head: str | None, first: Entry | None = None) -> list[tuple[str, Entry | None]]:
        """The line below `head`, newest first: (id, where it is now or None). `first`: where the head
        is, when known (a checkpoint named by path)."""
        out, seen, pruned = [], set(), self.pruned()
        while head is not None and head not in seen:
            seen.add(head)
            if first is not None and not out:
                where = first
            else:  # a pruned one is looked for only where it may still be (a crash after its record)
                where = self.index["by_id"].get(head) if head in pruned else self.locate(head)
            out.append((head, where))
            head = self.parent_of(head, where)
        return out

    def ancestors(self, found: Found) -> set[str]:
        """The ids on `found`'s line (itself included)."""
        ids = {i for i, _ in self.chain(found.id, Entry(found.path, found.step, found.state))}
        if found.lineage("line") is None:  # from before lineages: the older ones here
            ids |= {e.id for e in self.disk if e.id is not None and e.step < found.step}
        return ids


def _index(view: View) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        k: {} for k in ("by_id", "commit", "import_prev", "tag", "source", "source_parent", "moved")
    }
    out["by_id"] = {e.id: e for e in view.disk if e.id is not None}
    out["unreadable"] = {e.tag: e for e in view.disk if e.state is None}
    for r in view.records:
        if r.event == "commit":
            out["commit"][r.get("id")] = r
            out["tag"][r.get("id")] = r.get("tag")
        elif r.event == "import":
            ids = [c["id"] for c in r.get("chain") or []]
            out["import_prev"].update({i: (ids[n - 1] if n else None) for n, i in enumerate(ids)})
            out["tag"].update({c["id"]: c["tag"] for c in r.get("chain") or []})
        if r.event == "fork" and (r.get("source") or {}).get("path"):
            out["source"][r.get("source")["id"]] = r.get("source")["path"]
            if "parent" in r.get("source"):  # the line below a source pruned since, or elsewhere and gone
                out["source_parent"][r.get("source")["id"]] = r.get("source")["parent"]
        if r.event == "prune":  # the line below one pruned whose commit another journal recorded
            for i in r.get("items") or []:
                if i.get("id") and "parent" in i:
                    out["source_parent"].setdefault(i["id"], i["parent"])
        if r.event in ("fork", "aside") and r.get("to") not in (None, "removed"):
            for i in r.get("leaving") or r.get("items") or []:
                if i.get("id"):
                    out["moved"][i["id"]] = f"{r.get('to')}/{i.get('tag')}"
    return out


def new_line() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class Lineage:
    """What the next commit records: its line, its parent (the checkpoint training continued), the job."""

    line: str
    parent: str | None = None
    job: str | None = None


# --------------------------------------------------------------------------------------------- decisions


@dataclass
class Decision:
    """What a resume starts from, and what it passed over."""

    found: Found | None
    fallbacks: list[Found] = field(default_factory=list)  # the line below `found`, newest first
    warnings: list[str] = field(default_factory=list)
    skipped: list[Entry] = field(default_factory=list)  # newer on the line, damaged: set aside at start


def _said(e: Entry, why: list[str] | str) -> str:
    text = why if isinstance(why, str) else "; ".join(why[:3])
    return f"checkpoint {e.path} is damaged ({text}); skipping it"


def plain(view: View) -> Decision:
    """`--resume` (and a restart, and checkpoint.resume: auto): the newest intact checkpoint of the
    current line. Raises UserError where journal damage could hide which line is current."""
    if not view.journaled:  # no journal (or only a torn first append): the rules from before journals
        return legacy_latest(view)
    line, head, damaged = view.current()
    if view.unsure(damaged):
        refuse_unsure(view, damaged)
    pruned = view.pruned()
    out = Decision(None)
    chain = view.chain(head)
    line_entries = [(i, e) for i, e in chain if e is not None and i not in pruned]
    for n, (_, e) in enumerate(line_entries):
        why = [e.why] if e.state is None else verify(e.path, e.state, view.fs)
        if not why:
            out.found = e.found
            out.fallbacks = [x.found for _, x in line_entries[n + 1 :] if x.state is not None]
            break
        out.skipped.append(e)
        out.warnings.append(_said(e, why))
    if out.found is None:
        refuse_a_cut_line(view, chain)
    out.warnings[:0] = _gone_and_latest(view, chain, pruned, out.found)
    return out


def _gone_and_latest(
    view: View, chain: list[tuple[str, Entry | None]], pruned: set[str], found: Found | None
) -> list[str]:
    """What a plain resume says beside its choice: checkpoints of the line newer than the one it resumes that
    are gone though no prune removed them (by hand, or by another process), and a `latest` that names another
    checkpoint (edited by hand: the journal decides; the way to roll back)."""
    said, tags, newer = [], view.index["tag"], set()
    for i, e in chain:
        if found is not None and e is not None and e.path == found.path:
            break
        newer.add(e.tag if e is not None else tags.get(i))  # said otherwise (damaged, gone): not latest's
        if e is None and i not in pruned:
            said.append(f"checkpoint {tags.get(i) or i[:12]} of the current line is gone from {view.root} (no prune "
                        "removed it: by hand, or another process); resuming past it")  # fmt: skip
    named = named_by_latest(view.root, view.fs)
    if (
        found is not None
        and named
        and named not in (found.tag, *newer)
        and STEP_DIR.match(named)
        and view.fs.exists(view.root / named)
    ):
        said.append(f"{view.root / LATEST} names {named}, not {found.tag}, the newest of the current line, which "
                    "this resume continues: the journal decides (latest is its cache, rewritten at the next save); "
                    f"to roll back, name it: --resume {view.root / named}")  # fmt: skip
    return said


def verified(
    found: Found,
    fallbacks: list[Found],
    explicit: bool,
    digest_problems: Callable[[Found], list[str]],
    fs: LocalFS = LOCAL,
) -> tuple[Found, list[Found], list[Entry], list[str]]:
    """The first of `found` and its line below it whose every file's bytes match their digests
    (`digest_problems(found)` -> problems; the ranks share the reads in build): (it, the line below it,
    the ones passed over as damaged, what was said). A damaged checkpoint named by path stops the run."""
    skipped, said = [], []
    line = [found, *fallbacks]
    for n, f in enumerate(line):
        bad = (
            digest_problems(f) if n == 0 or not verify(f.path, f.state, fs) else ["its manifest check failed"]
        )
        if not bad:
            return f, line[n + 1 :], skipped, said
        if explicit:
            raise UserError(
                f"--resume {f.path}: the checkpoint is damaged: " + "; ".join(bad[:5]), everywhere=True
            )
        skipped.append(Entry(f.path, f.step, f.state))
        nxt = next((x for x in line[n + 1 :] if not verify(x.path, x.state, fs)), None)
        said.append(f"checkpoint {f.path} is damaged ({'; '.join(bad[:3])}); "
                    + (f"resuming from {nxt.tag} instead" if nxt else "no earlier checkpoint of its line is left"))  # fmt: skip
    raise UserError(f"{found.path} is damaged and no earlier checkpoint of its line is intact ({' '.join(said)[:800]}); "
                    "start fresh in another run_dir", everywhere=True)  # fmt: skip


def legacy_latest(view: View) -> Decision:
    """A directory without a journal, read by the rules from before journals: `latest` names the
    checkpoint, unless a save was committed and stopped before replacing `latest` (the one newer
    checkpoint whose `previous` is what `latest` names); without a usable `latest`, the newest.
    Newer checkpoints that are not that are another line (moved aside at start)."""
    root, fs = view.root, view.fs
    done = [e for e in view.disk if e.state is not None]
    named = named_by_latest(root, fs)
    by_tag = {e.tag: e for e in done}
    start, out = done, Decision(None)
    if named is not None and named in by_tag:
        target = by_tag[named]
        newer = [e for e in done if e.step > target.step]
        if not (len(newer) == 1 and newer[0].state.get("previous") == named) and newer:
            start = [e for e in done if e.step <= target.step]
            out.warnings.append(f"{root / LATEST} names {named}, older than {', '.join(e.tag for e in newer)}: "
                                f"resuming from {named} as `latest` says (the newer ones are another line)")  # fmt: skip
    elif named is not None and done:
        what = "names no checkpoint" if not STEP_DIR.match(named) else "names no complete checkpoint"
        out.warnings.append(f"{root / LATEST} is damaged or stale ({named[:40]!r} {what}); it is not needed: "
                            "resuming from the newest complete checkpoint")  # fmt: skip
    top = max((e.step for e in start), default=-1)
    bad = [e for e in view.disk if e.state is None and e.step <= (top if start is not done else 1 << 62)]
    line = sorted([*start, *bad], key=lambda e: -e.step)
    said = []
    for n, e in enumerate(line):
        why = [e.why] if e.state is None else verify(e.path, e.state, fs)
        if not why:
            out.found = e.found
            out.fallbacks = [x.found for x in line[n + 1 :] if x.state is not None]
            break
        out.skipped.append(e)
        said.append(_said(e, why))
    out.warnings[:0] = said
    return out


def is_head(view: View, found: Found) -> bool:
    """`found` is what a plain resume of `view` continues (no rollback)."""
    if not view.journaled:
        legacy = legacy_latest(view).found
        return legacy is not None and legacy.path.resolve() == found.path.resolve()
    _, head, damaged = view.current()
    if view.unsure(damaged):  # the line is unknown: a checkpoint named starts a new one
        return False
    return head == found.id


def prune_plan(view: View, keep_last: int) -> list[Entry]:
    """The checkpoints `keep_last` removes: those of the current line older than its newest
    `keep_last` intact ones (the files the manifest lists, with their sizes). Never another line's."""
    if keep_last <= 0:
        return []
    _, head, damaged = view.current()
    if view.unsure(damaged):
        return []  # the line is uncertain: remove nothing
    pruned = view.pruned()
    line = [
        e for i, e in view.chain(head) if e is not None and i not in pruned and e.path.parent == view.root
    ]
    intact = [e for e in line if e.state is not None and not verify(e.path, e.state, view.fs)]
    keep = intact[:keep_last]
    if len(keep) < keep_last:
        return []
    floor = min(e.step for e in keep)
    kept = {e.path for e in keep}
    return [e for e in line if e.path not in kept and e.step < floor]
