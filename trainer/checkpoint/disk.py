"""Checkpoints you can trust: the layout on disk, and reading and verifying one checkpoint.

    <run_dir>/checkpoints/
      journal.jsonl           the lineage: one record per commit, rollback, set-aside, prune, conversion
                              (trainer/checkpoint/journal.py); the only truth about which line is current
      latest                  "step_00000500": a cache of the journal's newest (for DeepSpeed and people)
      step_00000500/
        ds_config.json        exactly the dict given to deepspeed.initialize
        experiment.yaml       the resolved experiment
        trainer_state.json    step, samples, tokens, data position, world size, stage, plan, versions,
                              wall time, metrics, the training data's fingerprint (compared on resume),
                              parameter names per optimizer group, its lineage (line, parent, job), and
                              the manifest (every file with its size and digest), with the digest of
                              its own contents: the checkpoint's id
        rng_rank00000.pt ...  per-rank RNG states (python, numpy, torch CPU and CUDA)
        ...DeepSpeed's files  mp_rank_00_model_states.pt, *_optim_states.pt
        universal/            made by a resume on another stage or world size; its CONVERTED marker
                              holds every file's digest (reshard.py)
      abandoned/, damaged/    checkpoints that left the line (rollbacks) or were passed over as damaged

Staging leftovers (`.tmp-step_...`) and the directories of pruned checkpoints (`.trash-step_...`) are
never taken for checkpoints; the next start removes them. Which checkpoint a resume takes, what pruning
removes and what a rollback moves: trainer/checkpoint/lineage.py (decisions) and directory.py (doing them).

Reading a checkpoint checks the manifest first, before anything else of it is read: trainer_state.json
against the digest of its own contents, every file present with its size, and the metadata read before
the load (experiment.yaml, ds_config.json) against their digests (`verify`); then, before the load,
every file's bytes against its writer's digest (`verify_digests`: the ranks sharing the reads). Every
read goes through an `FS` (fs.py), so the crash test can run it on a simulated file system.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.fs import LOCAL, LocalFS

STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST = "latest"
STATE = "trainer_state.json"
ABANDONED = "abandoned"
DAMAGED = "damaged"
STATE_DIGEST = "state_digest"  # trainer_state.json's digest of its own other contents: the checkpoint's id
LINEAGE = "lineage"  # trainer_state.json: {"line", "parent", "job"}
META = ("experiment.yaml", "ds_config.json")  # read before the load: checked against their digests first


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def state_digest(state: Mapping[str, Any]) -> str:
    """The digest of trainer_state.json's contents but this one (canonical JSON)."""
    import xxhash

    rest = {k: v for k, v in state.items() if k != STATE_DIGEST}
    return xxhash.xxh3_128(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def ident(state: Mapping[str, Any]) -> str:
    """A checkpoint's id: the digest of its trainer_state.json (unique: it holds the save's time)."""
    return state.get(STATE_DIGEST) or state_digest(state)


@dataclass(frozen=True)
class Found:
    """A checkpoint whose trainer_state.json can be trusted."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def tag(self) -> str:
        return self.path.name

    @property
    def id(self) -> str:
        return ident(self.state)

    def lineage(self, key: str) -> Any:
        return (self.state.get(LINEAGE) or {}).get(key)


@dataclass(frozen=True)
class Entry:
    """A step_* directory as a scan sees it: its state (None where it cannot be trusted, and why)."""

    path: Path
    step: int
    state: dict[str, Any] | None
    why: str | None = None

    @property
    def tag(self) -> str:
        return self.path.name

    @property
    def id(self) -> str | None:
        return ident(self.state) if self.state is not None else None

    def lineage(self, key: str) -> Any:
        return ((self.state or {}).get(LINEAGE) or {}).get(key)

    @property
    def found(self) -> Found:
        assert self.state is not None
        return Found(self.path, self.state)


def load_state(path: Path, fs: LocalFS = LOCAL) -> tuple[dict[str, Any] | None, str | None]:
    """(trainer_state.json of a checkpoint, None) where it can be trusted, else (None, why): missing, not
    JSON, or not the contents its own digest was taken of (a file damaged in place that still parses).
    One read."""
    f = Path(path) / STATE
    try:
        state = json.loads(fs.read_bytes(f).decode())
    except FileNotFoundError:
        return None, f"{f} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{f} cannot be read ({type(e).__name__}: {str(e)[:80]}): damaged or truncated"
    if not isinstance(state, dict) or "step" not in state:
        return None, f"{f} holds no checkpoint state: damaged"
    if STATE_DIGEST in state and state[STATE_DIGEST] != state_digest(state):
        return None, f"{f} holds other contents than were written (its digest differs)"
    return state, None


def state_problem(path: Path, fs: LocalFS = LOCAL) -> str | None:
    """Why `path`/trainer_state.json cannot be trusted (None: it can)."""
    return load_state(path, fs)[1]


def read_state(path: Path, fs: LocalFS = LOCAL) -> dict[str, Any] | None:
    """trainer_state.json of a checkpoint, or None where it cannot be trusted (`load_state`)."""
    return load_state(path, fs)[0]


def verify(path: Path, state: Mapping[str, Any], fs: LocalFS = LOCAL) -> list[str]:
    """Problems with a checkpoint's files: missing or with another size than the manifest says, and the
    metadata read before the load (META) with other bytes than their writer's digest."""
    out = []
    for rel, size in state.get("files", {}).items():
        f = Path(path) / rel
        try:
            actual = fs.size(f)
        except FileNotFoundError:
            out.append(f"{f} is missing")
            continue
        except OSError as e:
            out.append(f"{f}: {e.strerror or e}")
            continue
        if actual != size:
            out.append(f"{f} has {actual} bytes, the manifest says {size} (truncated or overwritten)")
    digests = state.get("digests") or {}
    for rel in META:
        if rel in digests and not any(p.startswith(str(Path(path) / rel)) for p in out):
            try:
                if fs.digest(Path(path) / rel) != digests[rel]:
                    out.append(
                        f"{Path(path) / rel} holds other bytes than were written (corrupted in place: its digest differs)"
                    )
            except OSError as e:
                out.append(f"{Path(path) / rel}: {e.strerror or e}")
    return out


def verify_digests(found: Found, rank: int = 0, world: int = 1, fs: LocalFS = LOCAL) -> list[str]:
    """Problems with the bytes of a checkpoint's files against the digests their writers recorded
    (a file zeroed or overwritten in place keeps its size): this rank's share of them (every
    `world`-th file from `rank`), so that the ranks read the checkpoint once between them."""
    digests = found.state.get("digests") or {}
    out = []
    for rel in sorted(digests)[rank::world]:
        path = found.path / rel
        try:
            got = fs.digest(path)
        except OSError as e:
            out.append(f"{path}: {e.strerror or e}")
            continue
        if got != digests[rel]:
            out.append(f"{path} holds other bytes than were written (corrupted in place: its digest differs)")
    return out


def problems(found: Found, fs: LocalFS = LOCAL, digests: bool = False) -> list[str]:
    """Everything wrong with a checkpoint (`verify`; with `digests` every file's bytes too)."""
    out = verify(found.path, found.state, fs)
    if not out and digests:
        out = verify_digests(found, fs=fs)
    return out


def entry(path: Path, fs: LocalFS = LOCAL, any_name: bool = False) -> Entry | None:
    """The step_* directory at `path` as a scan sees it (None: not a step directory). `any_name`: a checkpoint
    named by path (a fork's source: a staging directory resumed by name, one elsewhere under another name),
    its step from its state."""
    m = STEP_DIR.match(Path(path).name)
    if not fs.is_dir(path) or not (m or any_name and fs.exists(Path(path) / STATE)):
        return None
    state, why = load_state(path, fs)
    step = int(m.group(1)) if m else int((state or {}).get("step", -1))
    return Entry(Path(path), step, state, why)


def scan(root: Path, fs: LocalFS = LOCAL) -> list[Entry]:
    """Every committed checkpoint directory (final names) under a checkpoints directory, oldest first;
    each trainer_state.json read once."""
    out = [e for name in fs.listdir(root) if (e := entry(Path(root) / name, fs)) is not None]
    return sorted(out, key=lambda e: (e.step, e.tag))


def complete(root: Path, fs: LocalFS = LOCAL) -> list[Found]:
    """Checkpoints whose trainer_state.json can be trusted, oldest first (final names only)."""
    return [e.found for e in scan(root, fs) if e.state is not None]


def unreadable(root: Path, fs: LocalFS = LOCAL) -> list[tuple[int, str]]:
    """(step, why) of the committed checkpoints whose trainer_state.json cannot be trusted."""
    return [(e.step, e.why or "") for e in scan(root, fs) if e.state is None]


def named_by_latest(root: Path, fs: LocalFS = LOCAL) -> str | None:
    """What `latest` names (its text, stripped; None when there is none)."""
    try:
        return fs.read_bytes(Path(root) / LATEST).decode(errors="replace").strip()
    except OSError:
        return None


def before(found: Found) -> Found | None:
    """The complete checkpoint before `found` in its directory, if any (by step)."""
    older = [f for f in complete(found.path.parent) if f.step < found.step]
    return older[-1] if older else None
