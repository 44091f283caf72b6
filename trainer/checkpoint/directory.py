"""The operations that change a checkpoints directory, each recorded in the journal (journal.py) before
the directories it explains are moved or deleted, each through an `FS` (fs.py) so that the crash test
can stop it at any file-system operation:

- a save's staging directory and its manifest; the commit (rename into place, the journal's `commit`
  record, the `latest` cache);
- pruning to `keep_last` (lineage.prune_plan: the current line only);
- the start of a run (rank 0, before the first step): leftovers of crashed saves removed, a rollback's
  fork (the checkpoints off the new line moved to `abandoned/` or removed), damaged checkpoints set
  aside in `damaged/`, the rest of an interrupted fork or prune finished, `abandoned/` and `damaged/`
  bounded by `checkpoint.keep_abandoned` / `keep_damaged`.

What to do is decided in lineage.py; here it is done.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint import journal
from trainer.checkpoint.disk import (
    ABANDONED,
    DAMAGED,
    LATEST,
    LINEAGE,
    STAGING_PREFIX,
    STATE,
    STATE_DIGEST,
    TRASH_PREFIX,
    Entry,
    Found,
    entry,
    named_by_latest,
    state_digest,
)
from trainer.checkpoint.fs import LOCAL, LocalFS
from trainer.checkpoint.lineage import Lineage, View, is_head, new_line, prune_plan

log = logging.getLogger("trainer")


@dataclass
class CheckpointDir:
    """A run's checkpoints directory (<run_dir>/checkpoints) as saves and starts change it. Rank 0 calls
    all but `staging`."""

    root: Path
    fs: LocalFS = LOCAL
    lineage: Lineage | None = None  # set by `start` (a fresh line where a save comes first, as --check's)
    keep_abandoned: int = 2
    keep_damaged: int = 2
    background_deletes: bool = True  # pruned directories deleted on a thread (the crash test: inline)
    faults: Any = None  # tests: trainer/common/faults.py's kill points of a start (killfork)
    _deleting: Any = field(default=None, repr=False)
    _pending: list[Path] = field(default_factory=list, repr=False)  # what the `_deleting` thread removes
    _entry_durable: bool = field(default=False, repr=False)  # checkpoints/' and run_dir's entries fsynced

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def staging(self, tag: str) -> Path:
        """The hidden directory every rank writes a save of `tag` into."""
        return self.root / (STAGING_PREFIX + tag)

    def prepare(self, tag: str) -> Path:
        """Before every rank writes a save of `tag`: the directory exists, leftovers of crashed saves and
        prunes are gone, the staging directory is empty."""
        stage = self.staging(tag)
        self.ensure()
        self.clean_leftovers(keep="")
        return stage

    def ensure(self) -> None:
        """The directory exists, and durably so: its entry in the run directory fsynced once by each process,
        made or found (a process killed between the mkdir and the fsync leaves it there, not yet durable)."""
        if not self.fs.is_dir(self.root):
            self.fs.mkdir(self.root)
        if not self._entry_durable:  # and the run directory's, made by `mkdir -p` at start
            self.fs.fsync_dir(self.root.parent)
            self.fs.fsync_dir(self.root.parent.parent)
            self._entry_durable = True

    def clean_leftovers(self, keep: str) -> None:
        """Remove staging and trash directories left by crashed saves or prunes (`keep`: a staging
        directory a resume names; a fork's source, which the journal names: a checkpoint of a line, pruned as
        one); not the trash this process's own prune is still deleting in the background (no interrupted save
        left it: it is not said to be one)."""
        spared = {p.name for p in self._pending} if self._deleting and self._deleting.is_alive() else set()
        names = [n for n in self.fs.listdir(self.root) if n.startswith((STAGING_PREFIX, TRASH_PREFIX))]
        if any(n.startswith(STAGING_PREFIX) for n in names):
            spared |= {(r.get("source") or {}).get("path") for r in journal.read(self.root, self.fs).records
                         if r.event == "fork"}  # fmt: skip
        for name in names:
            if name != keep and name not in spared and self.fs.is_dir(self.root / name):
                log.info(f"removing {self.root / name} (left by an interrupted save)")
                self.fs.rmtree(self.root / name)

    # ----------------------------------------------------------------- a save
    def write_manifest(self, stage_dir: Path, meta: dict[str, Any], ds_config: Any, exp_yaml: str,
                       reported: list[dict[str, tuple[int, str]]] = ()) -> dict[str, Any]:  # fmt: skip
        """The metadata and manifest of a save whose files are all written (`manifest`); returns the state."""
        return manifest(self, stage_dir, meta, ds_config, exp_yaml, reported)

    def commit(self, stage_dir: Path, tag: str, state: dict[str, Any], renamed: Any = None) -> Path:
        """The commit: the staging directory renamed to its final name (the commit point), its journal
        record, the `latest` cache. `renamed`: called after the rename (tests: a crash there)."""
        fs, final = self.fs, self.root / tag
        if fs.exists(final):  # a checkpoint of no line holds the name (start sets such ones aside): keep it
            from trainer.checkpoint.aside import set_aside

            stray = entry(final, fs)
            set_aside(self, [stray] if stray else [], DAMAGED if stray is None or stray.state is None else ABANDONED,
                           f"{tag} was in the way of a new commit of the same step")  # fmt: skip
        fs.rename(stage_dir, final)
        fs.fsync_dir(self.root)
        if renamed is not None:
            renamed()
        lin = self.lineage or self._fresh_line()
        ident = state[STATE_DIGEST]
        journal.append(self.root, "commit", fs, tag=tag, step=int(state["step"]), id=ident, parent=lin.parent,
                       line=lin.line, job=lin.job)  # fmt: skip
        lin.parent = ident
        self.write_latest(tag)
        return final

    def write_latest(self, tag: str | None) -> None:
        """The `latest` cache (DeepSpeed's loaders and people read it; decisions never do)."""
        if tag is None:
            self.fs.unlink(self.root / LATEST)
            self.fs.fsync_dir(self.root)
        elif named_by_latest(self.root, self.fs) != tag:
            self.fs.durable_write(self.root / LATEST, (tag + "\n").encode(), tmp_name=".latest.tmp")

    def _fresh_line(self) -> Lineage:
        self.lineage = Lineage(new_line())
        return self.lineage

    # ----------------------------------------------------------------- retention
    def prune(self, keep_last: int, renamed: Any = None) -> list[str]:
        """Keep the newest `keep_last` intact checkpoints of the current line (0 = all), after a commit:
        the prune recorded, each old one renamed to its trash name (atomic: never a half-deleted
        "complete" checkpoint), then deleted. `renamed`: called after the first rename (tests)."""
        old = prune_plan(View.read(self.root, self.fs), keep_last)
        readers = self.fs.leased(self.root) if old else {}  # read leases: kept while read
        for e in (e for e in old if e.tag in readers):
            log.info(f"keeping {e.tag} past checkpoint.keep_last while {readers[e.tag]} reads it")
        old = [e for e in old if e.tag not in readers]
        if not old:
            return []
        journal.append(
            self.root,
            "prune",
            self.fs,
            items=[{"id": e.id, "tag": e.tag, "step": e.step, "parent": e.lineage("parent")} for e in old],
        )
        trash = []
        for e in old:
            trash.append(self.root / (TRASH_PREFIX + e.tag))
            self.fs.rmtree(trash[-1])
            self.fs.rename(e.path, trash[-1])
            if renamed is not None and len(trash) == 1:
                renamed()
        self.fs.fsync_dir(self.root)
        self._delete(trash)
        return [e.tag for e in old]

    def _delete(self, paths: list[Path]) -> None:
        if not self.background_deletes:
            for p in paths:
                self.fs.rmtree(p)
            return
        self.wait_deletes()  # unlinking gigabytes can take a second: not on the training thread
        self._pending = list(paths)
        self._deleting = threading.Thread(target=lambda: [self.fs.rmtree(p) for p in paths], name="prune",
                                          daemon=True)  # fmt: skip
        self._deleting.start()

    def wait_deletes(self) -> None:
        """Until the pruned checkpoints are deleted (the end of training; a kill leaves a `.trash-`
        directory, which the next start removes)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    # ----------------------------------------------------------------- the start of a run
    def start(self, found: Found | None, *, explicit: bool, skipped: list[Entry] = (), on_rollback: str = "keep",
              job: str | None = None) -> list[str]:  # fmt: skip
        """Rank 0, before the first step: make the directory what the decision says (module docstring)
        and set the line the saves commit to. Returns what it did, for the banner."""
        from trainer.checkpoint.begin import start

        return start(self, found, explicit=explicit, skipped=list(skipped), on_rollback=on_rollback, job=job)


def manifest(
    cd: CheckpointDir, stage_dir: Path, meta: dict[str, Any], ds_config: Any, exp_yaml: str,
    reported: list[dict[str, tuple[int, str]]] = (),
) -> dict[str, Any]:  # fmt: skip
    """ds_config.json, experiment.yaml, then trainer_state.json (`meta`, the lineage and the manifest)
    written durably. The manifest holds every file each rank `reported` (its path in the checkpoint:
    (bytes, digest), written and fsynced by that rank), and what rank 0 finds here that no rank reported
    (its metadata, DeepSpeed's script), fsynced and digested here. Returns the state written."""
    fs = cd.fs
    fs.write(stage_dir / "ds_config.json", (json.dumps(ds_config, indent=2) + "\n").encode())
    fs.write(stage_dir / "experiment.yaml", exp_yaml.encode())
    files, digests, writers = {}, {}, {}
    for rank, rows in enumerate(reported):
        for rel, (size, digest) in rows.items():
            files[rel], digests[rel], writers[rel] = size, digest, rank
    for rel in fs.files_under(stage_dir):
        if rel != STATE and rel not in files:
            fs.fsync(stage_dir / rel)
            files[rel], digests[rel], writers[rel] = fs.size(stage_dir / rel), fs.digest(stage_dir / rel), 0
    fs.fsync_dir(stage_dir)
    lin = cd.lineage or cd._fresh_line()
    state = json.loads(json.dumps({
        **meta, "files": files, "digests": digests, "writers": writers,
        "previous": named_by_latest(cd.root, fs),  # read by the rules from before journals
        LINEAGE: {"line": lin.line, "parent": lin.parent, "job": lin.job},
    }))  # fmt: skip
    state[STATE_DIGEST] = state_digest(state)  # of the contents as they read back (keys as strings)
    fs.durable_write(stage_dir / STATE, (json.dumps(state, indent=2) + "\n").encode())
    return state


def salvage(cd: CheckpointDir, stage_dir: Path, tag: str, meta: dict[str, Any], ds_config: Any, exp_yaml: str,
            world: int, mine: dict[str, tuple[int, str]]) -> Path | None:  # fmt: skip
    """Rank 0, on the way out of a failed step: commit a background save every rank finished writing (each
    rank's report in the staging directory, `reports`; rank 0's own files: `mine`), with no collective (the
    other ranks may be anywhere). None where a rank's report is missing."""
    got = reports(stage_dir, world, cd.fs)
    if got is None:
        return None
    got[0] = mine
    return cd.commit(stage_dir, tag, cd.write_manifest(stage_dir, meta, ds_config, exp_yaml, got))


def wait_for_reports(stage_dir: Path, world: int, quiet_s: float = 10.0) -> None:
    """Until every rank's report of a save is in its staging directory, or nothing was written there for
    `quiet_s` seconds (a rank died, or is stuck: its save stays uncommitted)."""
    seen, quiet = None, time.monotonic() + quiet_s
    while reports(stage_dir, world) is None and time.monotonic() < quiet:
        now = sum(f.stat().st_size for f in Path(stage_dir).rglob("*") if f.is_file())
        if now != seen:
            seen, quiet = now, time.monotonic() + quiet_s
        time.sleep(0.2)


REPORT = ".written-rank{rank:05d}.json"  # a rank's files of a background save, written when they are durable


def write_report(
    stage_dir: Path, rank: int, written: dict[str, tuple[int, str]], fs: LocalFS = LOCAL
) -> None:
    """A rank's files of a save (relative path: (bytes, digest)), durably, once they are fsynced: what
    rank 0 commits from when the step after the save fails (CheckpointDir.salvage)."""
    rows = {str(Path(k).resolve().relative_to(Path(stage_dir).resolve())) if Path(k).is_absolute() else k: list(v)
            for k, v in written.items()}  # fmt: skip
    fs.durable_write(Path(stage_dir) / REPORT.format(rank=rank), json.dumps(rows).encode())


def reports(stage_dir: Path, world: int, fs: LocalFS = LOCAL) -> list[dict[str, tuple[int, str]]] | None:
    """Every rank's report of a save (None: one is missing or unreadable)."""
    out = []
    for rank in range(world):
        try:
            rows = json.loads(fs.read_bytes(Path(stage_dir) / REPORT.format(rank=rank)).decode())
        except (OSError, ValueError):
            return None
        out.append({k: (int(v[0]), str(v[1])) for k, v in rows.items()})
    return out


__all__ = [
    "CheckpointDir",
    "Lineage",
    "is_head",
    "manifest",
    "new_line",
    "reports",
    "salvage",
    "write_report",
]
