"""When a checkpoints directory's journal cannot be taken as it reads: gone (where something says there was
one), older than the checkpoints here (a copy restored from a backup), damaged after the record naming the
current line, or a line cut where neither a record nor a manifest says what is below. lineage.plain refuses
there (exit 2, naming why and the way on: --resume PATH), never guessing a line; these are its rules and
their messages.
"""

from __future__ import annotations

from typing import Any

from trainer.checkpoint import journal
from trainer.checkpoint.disk import ABANDONED, DAMAGED, Entry, entry
from trainer.common.errors import UserError

View = Any  # trainer/checkpoint/lineage.py's, which imports this module


def gone(view: View) -> str | None:
    """The journal file is gone, where something says there was one (returned, for the message): `journal.last`
    (written after every append); a checkpoint whose manifest names a parent (its parent's commit, or the fork
    from it, was recorded durably before it was trained); a checkpoint of a line set aside in abandoned/ or
    damaged/ (a fork's or an aside's record came first). (A line's first checkpoint may be here without a
    journal: a crash between its rename and the journal's first record, which the next start adopts.)"""
    if view.log.exists:
        return None
    if view.log.tail is not None:
        return "journal.last names the last record appended to it"
    if any(e.lineage("parent") is not None for e in view.disk):
        return "a checkpoint here names its parent in its manifest, whose record a run keeping a journal wrote first"
    fs, root = view.fs, view.root
    for kind in (ABANDONED, DAMAGED):
        for d in fs.listdir(root / kind):
            if any(
                (e := entry(root / kind / d / n, fs, any_name=True)) and e.lineage("line")
                for n in fs.listdir(root / kind / d)
            ):
                return f"{kind}/{d} holds a checkpoint a journal's record set aside"
    return None


def unrecorded(view: View) -> list[Entry]:
    """Checkpoints here the journal never recorded, off its current line (which adopts the one commit a
    crash can leave unrecorded: renamed into place, its record not yet appended; not where a checkpoint
    the journal records of the line is gone with no prune or set-aside recorded, which a crash there could
    not have made), and checkpoints it recorded committed that sit in abandoned/ or damaged/ where no record
    of it moved them: the journal is older than they are (a copy restored from a backup, journal.last with
    it). Reading on would resume an older checkpoint, or another line, and set the newer ones aside (or say
    one gone that a rollback set aside)."""
    if not view.records:
        return []
    named = set(view.index["commit"]) | set(view.index["import_prev"]) | set(view.index["source"])
    moved = set()  # set aside or pruned by a record: gone from here as the journal says
    for r in view.events("fork", "aside", "prune"):
        moved |= {i.get("id") for i in (r.get("leaving") or r.get("items") or [])}
    named |= moved
    odd = [
        e for e in view.disk if e.state is not None and e.lineage("line") is not None and e.id not in named
    ]
    chain = view.chain(view.current()[1])  # (plain's own walk of the line; the set-aside check's too)
    # adopted (above the line's newest record) only as a crash leaves one: before the prune that follows its
    # record, so every checkpoint the journal records of the line is still here, or recorded pruned or set aside
    commits = view.index["commit"]
    above = []  # the line above its newest fork's source: a line chosen since vouches for what is below it
    for i, where in chain:
        if i in view.index["source"]:
            break
        above.append((i, where))
    older = any(where is None and i in commits and i not in moved for i, where in above)
    on = {i for i, _ in chain} - (_adopted(view, chain) if older else set())
    return [e for e in odd if e.id not in on] + _moved_unrecorded(view, named, chain)


def _adopted(view: View, chain: list[tuple[str, Entry | None]]) -> set[str]:
    """The ids a plain resume adopts: the line's checkpoints above its newest record (a commit, a fork's source,
    an import)."""
    out = set()
    for i, _ in chain:
        if i in view.index["commit"] or i in view.index["source"] or i in view.index["import_prev"]:
            break
        out.add(i)
    return out


def _moved_unrecorded(view: View, named: set[str], chain: list[tuple[str, Entry | None]]) -> list[Entry]:
    """Checkpoints in a directory of abandoned/ or damaged/ no record of the journal made (a fork's or an aside's
    `to`: each is appended before its move) that the journal records committed, or that it never named though
    their parent is one of its commits, or one it adopts (trained on its line, then set aside: both recorded
    after the copy). A fork records the directories set aside when it was made (`seen`): a line the user chose
    since (--resume PATH, as the refusal asks) vouches for them, as for those of a journal deleted before it."""
    if view.log.damaged:
        return []  # a damaged record may be the one that made them (damage before the current line is read around)
    made = {r.get("to") for r in view.events("fork", "aside")}
    for r in view.events("fork"):  # the line chosen since vouches for what was set aside before it
        made |= set(r.get("seen") or [])
    commits = view.index["commit"]
    ours = set(commits) | _adopted(view, chain)  # ...and the commits it adopts
    fs, root, out = view.fs, view.root, []
    for kind in (ABANDONED, DAMAGED):
        for d in fs.listdir(root / kind):
            if f"{kind}/{d}" in made:
                continue
            found = (entry(root / kind / d / n, fs, any_name=True) for n in fs.listdir(root / kind / d))
            out += [
                e
                for e in found
                if e is not None
                and e.id is not None
                and (e.id in commits or e.id not in named and e.lineage("parent") in ours)
            ]
    return out


def refuse_unsure(view: View, damaged: list[int]) -> None:
    """The refusal where `View.unsure` holds, saying which of its reasons."""
    what = (
        (f"line {damaged[0]} is" if len(damaged) == 1 else f"lines {', '.join(map(str, damaged))} are")
        + (" damaged (not as written) after the record that says which line of checkpoints is current")
        if damaged
        else f"it is missing ({why})"
        if (why := gone(view))
        else "its end is missing (journal.last holds a record it no longer has: cut short or damaged)"
        if journal.cut_short(view.log)
        else f"it is older than the checkpoints here (it never recorded {', '.join(_here(view, e) for e in unrecorded(view)[:3])}"
        ", off the line it names: a copy restored from a backup?)"
    )  # fmt: skip
    raise UserError(
        f"{view.root / journal.JOURNAL}: {what}, so a plain resume cannot tell which line to continue. Name "
        "the checkpoint to continue with --resume PATH (a step_* directory; that starts a new line in the "
        "journal), or restore the journal from a backup"
    )


def refuse_a_cut_line(view: View, chain: list[tuple[str, Entry | None]]) -> None:
    """Nothing of the line resumable as far as it can be followed, and it cannot be followed further: its oldest
    known checkpoint's parent is in neither a record (lost with the journal, or damaged) nor its state (gone,
    pruned, or damaged), while checkpoints here may be below it. Refused with the reason, not 'nothing to
    resume'."""
    if not chain:
        return
    ident, last = chain[-1]
    known = ident in view.index["commit"] or ident in view.index["import_prev"]
    if known or (last is not None and last.state is not None):
        return
    on = {i for i, _ in chain}
    others = [e for e in view.disk if e.state is not None and e.id not in on]
    if not (others or view.log.damaged):
        return
    tag = last.tag if last is not None else view.index["tag"].get(ident) or f"checkpoint {ident[:8]}"
    n = view.log.damaged
    why = [f"line {n[0]} is damaged (not as written)"] if len(n) == 1 else []
    why += [f"lines {', '.join(map(str, n))} are damaged (not as written)"] if len(n) > 1 else []
    why.append(
        f"{tag}'s state cannot be read ({last.why})"
        if last is not None
        else f"{tag}, a parent on the line, is gone and the journal has no record of it"
    )
    raise UserError(
        f"{view.root / journal.JOURNAL}: {', and '.join(why)}, so a plain resume cannot tell which "
        f"checkpoints are below {tag} on its line"
        + (f" ({', '.join(e.tag for e in others[-3:])} here may be)" if others else "")
        + ". Name the checkpoint to continue with --resume PATH (a step_* directory; that starts a new line in the "
        "journal), or restore the journal from a backup"
    )


def _here(view: View, e: Entry) -> str:
    """A checkpoint the journal never saw as it is: its tag here, its path in abandoned/ or damaged/."""
    rel = e.path.relative_to(view.root) if e.path.is_relative_to(view.root) else e.path
    return str(rel) + (" set aside" if len(rel.parts) > 1 else "")
