"""The start of a run in its checkpoints directory (rank 0, before the first step), after the resume
was decided (lineage.py) and its bytes verified (policy.undamaged):

1. leftovers of crashed saves and prunes removed (staging and trash directories; checkpoints a recorded
   prune had not yet removed);
2. a resume of anything but the current line's newest (a rollback, a checkpoint from elsewhere) forks a
   new line: recorded first, then every checkpoint here that is not on the new line moved to
   `abandoned/<tag>-<time>-<id>/` (`checkpoint.on_rollback: keep`) or removed;
   otherwise the line goes on, and what is here but not on it (the rest of an interrupted fork) is moved
   to abandoned/ likewise;
3. checkpoints passed over as damaged set aside in `damaged/` (recorded, never resumed, never a rollback);
4. a directory from before journals gets its first record (`import`: its line as the old rules read it);
   a fresh start in a directory with a journal records a fork from nothing;
5. the `latest` cache, and abandoned/ and damaged/ bounded (`keep_abandoned`, `keep_damaged`).

Each move is recorded in the journal before it is made, so a kill anywhere in here is finished by the
next start, which reads the same decision from the journal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.checkpoint import journal
from trainer.checkpoint.aside import aside_dir, describe, evict, move, set_aside, set_aside_dirs
from trainer.checkpoint.disk import ABANDONED, DAMAGED, STAGING_PREFIX, STEP_DIR, TRASH_PREFIX, Entry, Found
from trainer.checkpoint.lineage import Lineage, View, is_head, new_line

CheckpointDir = Any  # trainer/checkpoint/directory.py's, which imports this module


def start(cd: CheckpointDir, found: Found | None, *, explicit: bool, skipped: list[Entry], on_rollback: str,
          job: str | None) -> list[str]:  # fmt: skip
    fs, root = cd.fs, cd.root
    cd.ensure()
    fs.write(root / ".write-check", b"")  # a read-only checkpoints directory: an error before training
    fs.unlink(root / ".write-check")
    here = found is not None and found.path.parent.resolve() == root.resolve()
    cd.clean_leftovers(keep=found.path.name if here and found.path.name.startswith(STAGING_PREFIX) else "")
    view = View.read(root, fs)
    notes: list[str] = []
    pruned = view.pruned()
    done = [e for e in view.disk if e.id in pruned and (found is None or e.path != found.path)]
    for e in done:  # a prune recorded, killed before it removed these
        fs.rename(e.path, root / (TRASH_PREFIX + e.tag))
        fs.rmtree(root / (TRASH_PREFIX + e.tag))
    view = View.read(root, fs) if done else view
    if found is None:
        line = new_line()
        if view.journaled:  # a fresh start where a journal is: the line changes here
            journal.append(root, "fork", fs, line=line, source=None, leaving=[], to=None, job=job,
                           seen=set_aside_dirs(cd))  # fmt: skip
        cd.lineage = Lineage(line, None, job)
        cd.write_latest(None)
    elif explicit and not is_head(view, found):
        notes += _fork(cd, view, found, on_rollback, job)
    else:
        notes += _continue(cd, view, found, skipped, job)
    if (
        found is not None
    ):  # `latest` names committed checkpoints only (not a staging directory resumed by name)
        cd.write_latest(found.tag if here and STEP_DIR.match(found.tag) else None)
    chain = View.read(root, fs).chain(found.id if found else None)
    # never a directory holding a checkpoint of the line
    dropped = evict(cd, protect=[e.path for _, e in chain if e is not None], ids={i for i, _ in chain})
    if dropped:
        notes.append(f"deleted {', '.join(dropped)} (checkpoint.keep_abandoned / keep_damaged)")
    held = describe(cd)
    if held:
        notes.append(f"set aside: {held}")
    return notes


def _off_line(view: View, found: Found) -> tuple[list[Entry], list[Entry]]:
    """Checkpoints here that are not on `found`'s line: (intact, unreadable newer than `found`)."""
    on = view.ancestors(found)
    intact = [e for e in view.disk if e.state is not None and e.id not in on and e.path != found.path]
    bad = [e for e in view.disk if e.state is None and e.step > found.step and e.path != found.path]
    return intact, bad


def _fork(cd: CheckpointDir, view: View, found: Found, on_rollback: str, job: str | None) -> list[str]:
    fs, root = cd.fs, cd.root
    leaving, bad = _off_line(view, found)
    line = new_line()
    keep = on_rollback == "keep"
    to = aside_dir(cd, ABANDONED, found.tag) if keep and leaving else None
    journal.append(root, "fork", fs, line=line, job=job,
                   source={"id": found.id, "tag": found.tag, "step": found.step, "path": _where(found.path, root),
                           "parent": found.lineage("parent")},
                   leaving=[{"id": e.id, "tag": e.tag, "step": e.step} for e in leaving],
                   to=str(to.relative_to(root)) if to else ("removed" if leaving else None),
                   seen=set_aside_dirs(cd))  # fmt: skip
    said = []
    if bad:
        where = set_aside(cd, bad, DAMAGED, "unreadable, passed over by a rollback")
        said.append(f"damaged checkpoint(s) {', '.join(e.tag for e in bad)} moved to {where}")
    if leaving and keep:
        move(cd, leaving, to)
    for e in leaving if not keep else ():
        fs.rename(e.path, root / (TRASH_PREFIX + e.tag))
        fs.rmtree(root / (TRASH_PREFIX + e.tag))
    fs.fsync_dir(root)
    cd.lineage = Lineage(line, found.id, job)
    if leaving:
        where = f"moved to {to}" if keep else "removed (checkpoint.on_rollback: remove)"
        said.append(f"rollback: resumed from {found.tag}, not the newest of this run directory's line; the "
                    f"abandoned line's {', '.join(sorted(e.tag for e in leaving))} {where}, so that no restart "
                    f"resumes it; `latest` names {found.tag if found.path.parent.resolve() == root.resolve() else 'nothing here yet'}")  # fmt: skip
    elif found.path.parent.resolve() != root.resolve():
        inside = not Path(_where(found.path, root)).is_absolute()  # abandoned/ or damaged/ of this directory
        said.append(
            f"a new line from {found.path} ({'set aside in' if inside else 'outside'} this run directory)"
        )
    return said


def _continue(
    cd: CheckpointDir, view: View, found: Found, skipped: list[Entry], job: str | None
) -> list[str]:
    fs, root = cd.fs, cd.root
    said = []
    damaged = [e for e in skipped if fs.exists(e.path) and e.path.parent == root]
    if damaged:
        where = set_aside(cd, damaged, DAMAGED, "damaged: passed over by a resume")
        said.append(f"damaged checkpoint(s) {', '.join(e.tag for e in damaged)} moved to {where}")
        view = View.read(root, fs)
    stray, bad = _off_line(view, found)
    if bad:
        where = set_aside(cd, bad, DAMAGED, "unreadable, newer than the checkpoint resumed")
        said.append(f"damaged checkpoint(s) {', '.join(e.tag for e in bad)} moved to {where}")
    if stray:  # the rest of an interrupted fork, or a line the journal does not continue
        last = next((r for r in reversed(view.events("fork")) if r.get("to") not in (None, "removed")), None)
        listed = {i.get("id") for i in (last.get("leaving") if last else [])}
        to = root / last.get("to") if last and all(e.id in listed for e in stray) else None
        where = set_aside(cd, stray, ABANDONED, "no part of the line being resumed", to=to)
        said.append(f"checkpoint(s) {', '.join(e.tag for e in stray)} are no part of the line resumed "
                    f"({found.tag}'s): moved to {where}")  # fmt: skip
    if view.journaled:
        line = view.current()[0]
    else:  # a directory from before journals: its line as the old rules read it, recorded
        line = new_line()
        chain = sorted((e for e in view.disk if e.id in view.ancestors(found)), key=lambda e: e.step)
        journal.append(root, "import", fs, line=line,
                       chain=[{"id": e.id, "tag": e.tag, "step": e.step} for e in chain])  # fmt: skip
    cd.lineage = Lineage(line or new_line(), found.id, job)
    return said


def _where(path: Path, root: Path) -> str:
    """A fork source's path as the journal records it: relative to the checkpoints directory where it lies
    inside it (a copy of the run directory then reads its own), absolute elsewhere."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(Path(path).resolve())
