"""Checkpoints you can trust: the layout on disk, finding and verifying checkpoints, and the
directory operations of a save (the manifest, the commit's renames and `latest`, retention).

Layout (one directory per checkpoint, `latest` names the newest complete one):

    <run_dir>/checkpoints/
      latest                  "step_00000500": replaced atomically, only after every rank finished
      step_00000500/
        ds_config.json        exactly the dict given to deepspeed.initialize
        experiment.yaml       the resolved experiment
        trainer_state.json    step, samples, tokens, data position, world size, stage, plan, versions,
                              wall time, metrics, the training data's fingerprint (compared on resume),
                              parameter names per optimizer group, and the manifest (every file with
                              its size)
        rng_rank00000.pt ...  per-rank RNG states (python, numpy, torch CPU and CUDA)
        ...DeepSpeed's files  mp_rank_00_model_states.pt, *_optim_states.pt

Staging leftovers (`.tmp-step_...`) and the directories of replaced or pruned checkpoints
(`.trash-step_...`) are never taken for checkpoints; the next save removes them. How a save uses
this directory (every rank, the barrier, the commit): trainer/checkpoint/store.py.

Resuming checks the manifest first, before anything else of the checkpoint is read: trainer_state.json
against the digest of its own contents, every file present with its size, and the metadata read before
the load (experiment.yaml, ds_config.json) against their digests; then, before the load, every file's
bytes against its writer's digest (trainer/build.py: undamaged, the ranks sharing the reads). A damaged
checkpoint is named with the file; `--resume`/auto then fall back to the previous complete checkpoint
and say so, `--resume PATH` stops (exit 2).

A plain resume takes the newest complete checkpoint whatever `latest` says: a crash between the commit's
rename and the write of `latest` leaves the newest complete but unnamed (a rollback's newer line is moved
away by `fork`, so the newest here is always the line being trained).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import UserError
from trainer.files import fsync_dir, write_atomic

log = logging.getLogger("trainer")

STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST = "latest"
STATE = "trainer_state.json"

# ----------------------------------------------------------------------------- discovery (no torch)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


@dataclass(frozen=True)
class Found:
    """A complete checkpoint on disk."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def tag(self) -> str:
        return self.path.name


STATE_DIGEST = "state_digest"  # trainer_state.json's digest of its own other contents
META = ("experiment.yaml", "ds_config.json")  # read before the load: checked against their digests first


def state_digest(state: Mapping[str, Any]) -> str:
    """The digest of trainer_state.json's contents but this one (canonical JSON)."""
    import xxhash

    rest = {k: v for k, v in state.items() if k != STATE_DIGEST}
    return xxhash.xxh3_128(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def load_state(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(trainer_state.json of a checkpoint, None) where it can be trusted, else (None, why): missing, not
    JSON, or not the contents its own digest was taken of (a file damaged in place that still parses).
    One read."""
    f = path / STATE
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        return None, f"{f} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{f} cannot be read ({type(e).__name__}: {str(e)[:80]}): damaged or truncated"
    if not isinstance(state, dict):
        return None, f"{f} holds no checkpoint state: damaged"
    if STATE_DIGEST in state and state[STATE_DIGEST] != state_digest(state):
        return None, f"{f} holds other contents than were written (its digest differs)"
    return state, None


def state_problem(path: Path) -> str | None:
    """Why `path`/trainer_state.json cannot be trusted (None: it can)."""
    return load_state(path)[1]


def read_state(path: Path) -> dict[str, Any] | None:
    """trainer_state.json of a checkpoint, or None where it cannot be trusted (`load_state`)."""
    return load_state(path)[0]


def verify(path: Path, state: Mapping[str, Any]) -> list[str]:
    """Problems with a checkpoint's files: missing or with another size than the manifest says, and the
    metadata read before the load (META) with other bytes than their writer's digest."""
    from trainer.checkpoint.writer import file_digest

    out = []
    for rel, size in state.get("files", {}).items():
        f = path / rel
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            out.append(f"{f} is missing")
            continue
        if actual != size:
            out.append(f"{f} has {actual} bytes, the manifest says {size} (truncated or overwritten)")
    digests = state.get("digests") or {}
    for rel in META:
        if rel in digests and not any(p.startswith(str(path / rel)) for p in out):
            try:
                if file_digest(path / rel) != digests[rel]:
                    out.append(
                        f"{path / rel} holds other bytes than were written (corrupted in place: its digest differs)"
                    )
            except OSError as e:
                out.append(f"{path / rel}: {e.strerror or e}")
    return out


def verify_digests(found: Found, rank: int = 0, world: int = 1) -> list[str]:
    """Problems with the bytes of a checkpoint's files against the digests their writers recorded
    (a file zeroed or overwritten in place keeps its size): this rank's share of them (every
    `world`-th file from `rank`), so that the ranks read the checkpoint once between them."""
    from trainer.checkpoint.writer import file_digest

    digests = found.state.get("digests") or {}
    out = []
    for rel in sorted(digests)[rank::world]:
        path = found.path / rel
        try:
            got = file_digest(path)
        except OSError as e:
            out.append(f"{path}: {e.strerror or e}")
            continue
        if got != digests[rel]:
            out.append(f"{path} holds other bytes than were written (corrupted in place: its digest differs)")
    return out


def scan(root: Path) -> tuple[list[Found], list[tuple[int, str]]]:
    """One pass over a checkpoints directory's committed checkpoints (final names): the complete ones,
    oldest first, and (step, why) of those whose trainer_state.json cannot be trusted (a commit writes it
    before the rename, so these were damaged after). Each trainer_state.json read once."""
    found, bad = [], []
    if not root.is_dir():
        return found, bad
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if d.is_dir() and m:
            state, why = load_state(d)
            if state is not None:
                found.append(Found(d, state))
            else:
                bad.append((int(m.group(1)), why))
    return sorted(found, key=lambda f: f.step), bad


def complete(root: Path) -> list[Found]:
    """Complete checkpoints under a checkpoints directory, oldest first (final names only)."""
    return scan(root)[0]


def unreadable(root: Path) -> list[tuple[int, str]]:
    """(step, why) of the committed checkpoints whose trainer_state.json cannot be trusted."""
    return scan(root)[1]


def named_by_latest(root: Path) -> str | None:
    """What `latest` names (its text, stripped; None when there is none)."""
    with contextlib.suppress(OSError):
        return (root / LATEST).read_bytes().decode(errors="replace").strip()
    return None


def latest(root: Path) -> tuple[Found | None, list[str]]:
    """The checkpoint a plain resume continues from, and warnings naming what was skipped and why.

    `latest` names it, unless a save was committed and stopped before replacing `latest`: then the one
    checkpoint newer than what `latest` names, whose save began with `latest` naming that one (its
    `previous`), is the newest complete and is taken. Newer checkpoints that are not that (a rollback
    that wrote `latest` by hand, a line abandoned before rollbacks were moved aside) are left for the
    resume's rollback handling (`fork`, which moves them aside and says so). Without a `latest` that
    names a complete checkpoint: the newest. Each candidate is verified (`verify`); a damaged one is
    named and the one before it taken."""
    warnings: list[str] = []
    done, bad = scan(root)
    skipped = [
        (step, f"checkpoint {root / tag_for(step)} is damaged ({why}); skipping it") for step, why in bad
    ]
    named = named_by_latest(root)
    by_tag = {f.tag: f for f in done}
    start = done
    if named is not None and named in by_tag:
        target = by_tag[named]
        newer = [f for f in done if f.step > target.step]
        if len(newer) == 1 and newer[0].state.get("previous") == named:
            log.info(f"{newer[0].tag} is complete and newer than what {root / LATEST} names ({named}): a save was "
                     "committed and stopped before `latest` was replaced; resuming from it")  # fmt: skip
        elif newer:
            start = [f for f in done if f.step <= target.step]
            warnings.append(f"{root / LATEST} names {named}, older than {', '.join(f.tag for f in newer)}: resuming "
                            f"from {named} as `latest` says (the newer ones are another line: see the rollback note)")  # fmt: skip
    elif named is not None and done:
        what = "names no checkpoint" if not STEP_DIR.match(named) else "names no complete checkpoint"
        warnings.append(f"{root / LATEST} is damaged or stale ({named[:40]!r} {what}); it is not needed: resuming "
                        "from the newest complete checkpoint")  # fmt: skip
    found_ok = None
    for found in sorted(start, key=lambda f: -f.step):
        problems = verify(found.path, found.state)
        if not problems:
            found_ok = found
            break
        skipped.append(
            (found.step, f"checkpoint {found.path} is damaged ({'; '.join(problems[:3])}); skipping it")
        )
    floor = found_ok.step if found_ok is not None else -1
    top = max((f.step for f in start), default=-1) if start is not done else float("inf")
    warnings[:0] = [w for step, w in sorted(skipped, key=lambda x: -x[0]) if floor < step <= max(top, floor)]
    return found_ok, warnings


def before(found: Found) -> Found | None:
    """The complete checkpoint before `found` in its directory, if any."""
    older = [f for f in complete(found.path.parent) if f.step < found.step]
    return older[-1] if older else None


def resolve_resume(arg: str | None, mode: str, run_dir: str | Path) -> tuple[Found | None, list[str]]:
    """What to resume from: `--resume` (arg 'latest'), `--resume PATH`, or checkpoint.resume: auto."""
    root = checkpoints_dir(run_dir)
    if arg is None and mode == "never":
        existing = complete(root)
        if existing:
            raise UserError(
                f"{root} already holds checkpoints (newest: {existing[-1].tag}); starting fresh would mix runs. "
                f"Resume with --resume (or checkpoint.resume: auto), or choose another run_dir "
                f"(--set run_dir=...), or remove {root}"
            )
        return None, []
    if arg is None or arg == "latest":
        found, warnings = latest(root)
        if found is None:
            done, bad = scan(root)
            if arg is None and not done and not bad:  # auto: nothing there yet, start fresh
                return None, warnings
            if arg is None:  # auto over checkpoints none of which can be resumed: never start over them
                raise UserError(
                    f"checkpoint.resume: auto: {root} holds checkpoints but none can be resumed ("
                    + " ".join(warnings)[:600]
                    + "); starting fresh there would prune and mix them. Repair them, resume one with --resume PATH, "
                    "or choose another run_dir"
                )
            looked = f"looked in {root.resolve()} for '{LATEST}' and step_* directories"
            raise UserError(
                f"--resume: nothing to resume: no complete checkpoint ({looked}). " + " ".join(warnings)
            )
        return found, warnings
    path = Path(arg)
    if (path / STATE).exists() or STEP_DIR.match(path.name) and path.is_dir():
        why = state_problem(path)
        if why is not None:
            raise UserError(f"--resume {arg}: the checkpoint is damaged: {why}")
        state = read_state(path)
        problems = verify(path, state)
        if problems:
            raise UserError(f"--resume {arg}: the checkpoint is damaged: " + "; ".join(problems))
        return Found(path, state), []
    for root_guess in (path, path / "checkpoints"):  # a checkpoints dir or a run dir: take its latest
        if (root_guess / LATEST).exists() or complete(root_guess):
            found, warnings = latest(root_guess)
            if found is not None:
                return found, warnings
    raise UserError(
        f"--resume {arg}: not a checkpoint (no {STATE} in it) and no complete checkpoint below it; pass a "
        "step_XXXXXXXX directory, a checkpoints directory or a run directory"
    )


def fork(root: Path, found: Found, keep: bool, damaged_tags: tuple[str, ...] = ()) -> str | None:
    """A resume from `found` while `root` holds newer checkpoints (a rollback: `--resume
    .../step_00000020` after training went on to 60): those belong to the abandoned line. They are
    moved to `root/abandoned/<found's tag>-<time>/` (`keep`) or deleted, and `latest` names `found`
    (or, when it lies in another directory, the newest left here), so that neither a plain `--resume`
    (the supervisor's restart) nor pruning ever takes the abandoned line for this one. Rank 0, before
    the first step. Returns what it did, for the banner (None: nothing newer)."""
    import time as _time

    done, bad = scan(root)
    newer = [f for f in done if f.step > found.step and f.path.resolve() != found.path.resolve()]
    damaged = [f for f in newer if f.tag in damaged_tags or verify(f.path, f.state)]
    newer = [f for f in newer if f not in damaged]
    damaged_paths = [f.path for f in damaged] + [root / tag_for(step) for step, _ in bad if step > found.step]
    said = []
    if damaged_paths:  # passed over as damaged: kept aside for a look, never resumed, not a rollback
        aside = root / "damaged"
        aside.mkdir(parents=True, exist_ok=True)
        for path in damaged_paths:
            os.rename(path, aside / f"{path.name}-{_time.strftime('%Y%m%d-%H%M%S')}")
        fsync_dir(root)
        said.append(f"damaged checkpoint(s) {', '.join(p.name for p in damaged_paths)} moved to {aside}")
    if not newer:
        return "; ".join(said) or None
    names = [f.tag for f in newer]
    aside = root / "abandoned" / f"{found.tag}-{_time.strftime('%Y%m%d-%H%M%S')}"
    if keep:
        aside.mkdir(parents=True, exist_ok=True)
    for item in newer:
        path = item.path
        if keep:
            os.rename(path, aside / path.name)
        else:
            trash = root / (TRASH_PREFIX + path.name)
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
    here = [f for f in complete(root) if f.step <= found.step]
    target = found.tag if found.path.parent.resolve() == root.resolve() else (here[-1].tag if here else None)
    if target is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(root / LATEST)
    else:
        write_atomic(root / LATEST, target + "\n", durable=True)
    fsync_dir(root)
    where = f"moved to {aside}" if keep else "removed (checkpoint.on_rollback: remove)"
    return "; ".join([*said,
        f"rollback: resumed from {found.tag}, older than this run directory's newest; the abandoned line's "
        f"{', '.join(sorted(names))} {where}, so that no restart resumes it; `latest` names {target or 'nothing yet'}"
    ])  # fmt: skip


# ----------------------------------------------------------------------------- the commit, retention


@dataclass
class CheckpointDir:
    """A run's checkpoints directory (<run_dir>/checkpoints) as a save sees it: staging directories,
    the manifest, the commit's renames and `latest`, pruning. Rank 0 calls all but `staging`."""

    root: Path
    _deleting: Any = None  # the thread deleting pruned checkpoints

    def staging(self, tag: str) -> Path:
        """The hidden directory every rank writes a save of `tag` into."""
        return self.root / (STAGING_PREFIX + tag)

    def write_manifest(
        self, stage_dir: Path, meta: dict[str, Any], ds_config: Any, exp: Any,
        reported: list[dict[str, tuple[int, str]]] = (),
    ) -> None:  # fmt: skip
        """The metadata of a save whose files are all written: ds_config.json, experiment.yaml, then
        trainer_state.json (`meta` and the manifest) written atomically. The manifest holds every
        file each rank `reported` (its path in the checkpoint: (bytes, digest), written and fsynced by
        that rank), and what rank 0 finds here that no rank reported (its metadata, DeepSpeed's
        script), fsynced and digested here: `files` (sizes), `digests` and `writers` (the reporting rank)."""
        from trainer.checkpoint.writer import file_digest

        (stage_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        (stage_dir / "experiment.yaml").write_text(exp.to_yaml())
        files, digests, writers = {}, {}, {}
        for rank, rows in enumerate(reported):
            for rel, (size, digest) in rows.items():
                files[rel], digests[rel], writers[rel] = size, digest, rank
        for p in sorted(stage_dir.rglob("*")):
            rel = str(p.relative_to(stage_dir))
            if p.is_file() and p.name != STATE and rel not in files:
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
                files[rel], digests[rel], writers[rel] = p.stat().st_size, file_digest(p), 0
        # `previous`: what `latest` named as this save was committed (a plain resume tells a commit stopped
        # before `latest` from a line `latest` was moved off: `latest`)
        previous = named_by_latest(self.root)
        state = json.loads(json.dumps({**meta, "files": files, "digests": digests, "writers": writers,
                                       "previous": previous}))  # fmt: skip
        state[STATE_DIGEST] = state_digest(state)  # of the contents as they read back (keys as strings)
        write_atomic(stage_dir / STATE, json.dumps(state, indent=2) + "\n", durable=True)

    def publish(self, stage_dir: Path, tag: str, renamed: Any = None) -> Path:
        """The commit: `stage_dir` (with its manifest) renamed to its final name, then `latest`
        replaced (write, fsync, rename); returns the final path. `renamed`: called between the two
        (tests: a crash there)."""
        final = self.root / tag
        if final.exists():  # an older run reached this step too: replace it
            trash = self.root / (TRASH_PREFIX + tag)
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(stage_dir, final)
        fsync_dir(self.root)
        if renamed is not None:
            renamed()
        write_atomic(self.root / LATEST, tag + "\n", durable=True)
        shutil.rmtree(self.root / (TRASH_PREFIX + tag), ignore_errors=True)  # the replaced one
        return final

    def clean_leftovers(self, keep: str) -> None:
        """Remove staging and trash directories left by crashed saves or prunes."""
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and d.name != keep:
                log.info(f"removing {d} (left by an interrupted save)")
                shutil.rmtree(d, ignore_errors=True)

    def prune(self, keep_last: int, keep: str, renamed: Any = None) -> None:
        """Keep the newest `keep_last` complete checkpoints (`keep` among them; 0 = all), after the commit.
        `renamed`: called after the first old one is renamed to its trash name (tests: a crash there)."""
        n = keep_last
        if n <= 0:
            return
        done = [f for f in complete(self.root) if f.tag != keep]
        trash = []
        for old in done[: max(0, len(done) - (n - 1))]:
            trash.append(self.root / (TRASH_PREFIX + old.tag))
            os.rename(old.path, trash[-1])  # atomic: never a half-deleted "complete" checkpoint
            if renamed is not None and len(trash) == 1:
                renamed()
        if trash:  # unlinking gigabytes can take a second: not on the training thread
            import threading

            self.wait_deletes()
            self._deleting = threading.Thread(
                target=lambda: [shutil.rmtree(t, ignore_errors=True) for t in trash],
                name="prune",
                daemon=True,
            )
            self._deleting.start()

    def wait_deletes(self) -> None:
        """Until the pruned checkpoints are deleted (the end of training; a kill leaves a `.trash-`
        directory, which the next save removes)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None
