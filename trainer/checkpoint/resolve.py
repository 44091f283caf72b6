"""What a resume starts from, by what the user named: `--resume` / `checkpoint.resume` (`resolve`, on the
lineage's decision: the current line's newest intact checkpoint, or a named one, which forks a new line
unless it is the head), the newest intact checkpoint of a directory (`latest`), and the checkpoint
`bin/export` reads (`export_source`). Pure functions of the journal and a scan, as trainer/checkpoint/lineage.py."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from trainer.checkpoint import journal
from trainer.checkpoint.disk import (
    LATEST,
    STATE,
    STEP_DIR,
    Found,
    checkpoints_dir,
    ident,
    load_state,
    scan,
    verify,
)
from trainer.checkpoint.fs import LOCAL, LocalFS
from trainer.checkpoint.lease import Lease
from trainer.checkpoint.lineage import Decision, View, plain
from trainer.common.errors import UserError

log = logging.getLogger("trainer")


def explicit(path: Path, fs: LocalFS = LOCAL) -> Found:
    """`--resume PATH` of a step directory: the checkpoint, or a UserError naming what is damaged."""
    state, why = load_state(path, fs)
    if why is not None:
        raise UserError(f"--resume {path}: the checkpoint is damaged: {why}")
    problems = verify(path, state, fs)
    if problems:
        raise UserError(f"--resume {path}: the checkpoint is damaged: " + "; ".join(problems))
    return Found(Path(path), state)


def refuse_fresh(view: View) -> None:
    """A fresh start in a directory holding checkpoints, readable or not, or whose journal's line goes on
    from one elsewhere (a rollback into abandoned/ not yet saved), would mix two runs."""
    elsewhere = None
    if not view.disk and view.journaled:
        with contextlib.suppress(UserError):
            elsewhere = plain(view).found
    if elsewhere is not None:
        raise UserError(
            f"{view.root}: the run's line continues from {elsewhere.path} (resumed, not yet saved again); starting "
            "fresh would abandon it. Resume with --resume, or choose another run_dir (--set run_dir=...)"
        )
    if view.disk:
        bad = [e.tag for e in view.disk if e.state is None]
        said = f" ({len(bad)} of them unreadable: {', '.join(bad[:4])})" if bad else ""
        raise UserError(
            f"{view.root} already holds checkpoints (newest: {view.disk[-1].tag}){said}; starting fresh would mix "
            "runs and replace them. Resume with --resume (or checkpoint.resume: auto), or name one with "
            f"--resume PATH, or choose another run_dir (--set run_dir=...), or move {view.root} away"
        )


def resolve(arg: str | None, mode: str, run_dir: str | Path, fs: LocalFS = LOCAL) -> tuple[Decision, bool]:
    """What to resume from: `--resume` (arg 'latest'), `--resume PATH`, or checkpoint.resume: auto.
    Returns (the decision, whether the checkpoint was named explicitly)."""
    root = checkpoints_dir(run_dir)
    view = View.read(root, fs)
    if arg is None and mode == "never":
        refuse_fresh(view)
        return Decision(None), False
    if arg is None or arg == "latest":
        d = plain(view)
        if d.found is not None:
            return d, False
        if arg is None and not view.disk:  # auto: nothing there yet, start fresh
            return d, False
        if arg is None:  # auto over checkpoints none of which can be resumed: never start over them
            raise UserError(
                f"checkpoint.resume: auto: {root} holds checkpoints but none can be resumed ("
                + " ".join(d.warnings)[:600]
                + "); starting fresh there would prune and mix them. Repair them, resume one with --resume PATH, "
                "or choose another run_dir"
            )
        looked = f"looked in {root.resolve()} for the journal, '{LATEST}' and step_* directories"
        raise UserError(
            f"--resume: nothing to resume: no complete checkpoint ({looked}). " + " ".join(d.warnings)
        )
    path = Path(arg)
    if fs.exists(path / STATE) or (STEP_DIR.match(path.name) and fs.is_dir(path)):
        return Decision(explicit(path, fs)), True  # a damaged one stops the run; a rollback if not the head
    for guess in (path, path / "checkpoints"):  # a checkpoints dir or a run dir: its newest
        if fs.exists(guess / journal.JOURNAL) or fs.exists(guess / LATEST) or scan(guess, fs):
            d = plain(View.read(guess, fs))
            if d.found is not None:
                if guess.resolve() == root.resolve():
                    return d, False
                return Decision(d.found, [], d.warnings), True
    if STEP_DIR.match(path.name) and not fs.exists(path):
        newest = None
        with contextlib.suppress(UserError):  # its journal damaged: the message without the newest
            newest = plain(View.read(path.parent, fs)).found if fs.is_dir(path.parent) else None
        raise UserError(
            f"--resume {arg}: no such checkpoint"
            + (f" ({path.parent} holds {newest.tag} now: a job writing that run directory pruned it, or it was "
               "deleted)" if newest is not None else "")
            + "; name one that is there, or its run directory for its newest"
        )  # fmt: skip
    raise UserError(
        f"--resume {arg}: not a checkpoint (no {STATE} in it) and no complete checkpoint below it; pass a "
        "step_XXXXXXXX directory, a checkpoints directory or a run directory"
    )


def resolve_resume(arg: str | None, mode: str, run_dir: str | Path) -> tuple[Found | None, list[str]]:
    """(the checkpoint to resume from, warnings): `resolve` for callers that need no more."""
    d, _ = resolve(arg, mode, run_dir)
    return d.found, d.warnings


def latest(root: Path, fs: LocalFS = LOCAL) -> tuple[Found | None, list[str]]:
    """The checkpoint a plain resume of `root` continues, and warnings naming what was skipped."""
    d = plain(View.read(root, fs))
    return d.found, d.warnings


def export_source(arg: str, fs: LocalFS = LOCAL) -> tuple[Found, list[str], Lease]:
    """The checkpoint bin/export reads, every file's bytes verified, with a read lease on it (lease.py: a job
    writing that run directory keeps it until the export is done; released by the caller): a step directory
    must be intact (else a UserError naming the file); a run or checkpoints directory gives its line's newest
    intact. A checkpoint gone while looked at (pruned by the job writing it) is said, never a traceback."""
    from trainer.checkpoint.disk import problems

    path = Path(arg)
    if fs.exists(path / STATE) or (STEP_DIR.match(path.name) and fs.is_dir(path)):
        lease = fs.lease(path, "bin/export")
        try:
            found = explicit(path, fs)
            bad = problems(found, fs, digests=True)
        except FileNotFoundError as e:
            lease.release()
            raise UserError(f"{path}: {gone(e)}; export it again, or another checkpoint") from None
        if bad:
            lease.release()
            raise UserError(
                f"{path}: the checkpoint is damaged: " + "; ".join(bad[:5]) + "; export another one"
            )
        return found, [], lease
    for guess in (path / "checkpoints", path):
        if not (fs.exists(guess / journal.JOURNAL) or scan(guess, fs)):
            continue
        d = plain(View.read(guess, fs))
        warnings = list(d.warnings)
        for found in [f for f in [d.found, *d.fallbacks] if f is not None]:
            lease = fs.lease(found.path, "bin/export")
            try:
                bad = problems(found, fs, digests=True)
            except FileNotFoundError as e:
                bad = [gone(e)]
            if not bad:
                return found, warnings, lease
            lease.release()
            warnings.append(f"checkpoint {found.path} is damaged or gone ({'; '.join(bad[:3])}); skipping it")
        raise UserError(f"{arg}: no intact checkpoint to export. " + " ".join(warnings))
    raise UserError(f"{arg}: not a checkpoint (no {STATE} in it) and no checkpoint below it")


def gone(e: OSError) -> str:
    """A checkpoint's file that vanished while read: what happened, as a reader can say it."""
    return (
        f"{e.filename or 'a file of it'} is gone: the checkpoint was removed while it was read (a job writing its "
        "run directory pruned it or set it aside, or it was deleted)"
    )


def unmoved(found: Found, fs: LocalFS = LOCAL) -> bool:
    """`found` is still what its path holds, after a reader read it: a lease keeps a prune away, not a start of
    the job writing that run directory, whose rollback (or fresh start) moves the line's checkpoints to
    abandoned/ and may commit another under the same name; what was read by path then mixes two checkpoints.
    (No checkpoint moves back to where it was: the same id there means nothing moved.)"""
    state, _ = load_state(found.path, fs)
    return state is not None and ident(state) == found.id
