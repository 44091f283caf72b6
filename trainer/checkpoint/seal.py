"""Files made from a checkpoint after its commit (a conversion's `universal/` and stage-0 directories:
reshard.py) are trusted only as far as their marker vouches for them.

`seal(dir)`: every file fsynced and digested, then the marker (`CONVERTED`: JSON with every file's size
and digest, and its own crc) written durably, before the directory is renamed into place. `problems(dir)`:
what is wrong with a sealed directory (no marker, a marker from before digests, a file missing, of
another size, or with other bytes), each rank checking a share of the files. A damaged one is rebuilt
from the verified checkpoint (reshard.load). `record`: the conversion in the run's journal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.fs import LOCAL, LocalFS

MARKER = "CONVERTED"


def _crc(files: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_64(json.dumps(files, sort_keys=True).encode()).hexdigest()


def seal(path: Path, fs: LocalFS = LOCAL) -> str:
    """Make a directory's files durable and write its marker last; returns the marker's digest."""
    files, dirs = {}, {Path(path)}
    for rel in fs.files_under(path):
        if rel == MARKER:
            continue
        f = Path(path) / rel
        fs.fsync(f)
        files[rel] = [fs.size(f), fs.digest(f)]
        dirs.add(f.parent)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        fs.fsync_dir(d)
    body = json.dumps({"files": files, "crc": _crc(files)}, sort_keys=True).encode()
    fs.durable_write(Path(path) / MARKER, body)
    return fs.digest(Path(path) / MARKER)


def marker(path: Path, fs: LocalFS = LOCAL) -> tuple[dict[str, list[Any]] | None, str | None]:
    """(the files a marker vouches for, None), or (None, why it vouches for nothing)."""
    try:
        raw = fs.read_bytes(Path(path) / MARKER)
    except FileNotFoundError:
        return None, f"{Path(path) / MARKER} is missing (an interrupted conversion)"
    except OSError as e:
        return None, f"{Path(path) / MARKER}: {e.strerror or e}"
    try:
        body = json.loads(raw.decode())
        files = body["files"]
        ok = body.get("crc") == _crc(files)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None, f"{Path(path) / MARKER} holds no digests (made before they were recorded, or damaged)"
    return (files, None) if ok else (None, f"{Path(path) / MARKER} is damaged (its crc differs)")


def problems(
    path: Path, rank: int = 0, world: int = 1, fs: LocalFS = LOCAL, digests: bool = True
) -> list[str]:
    """What is wrong with a sealed directory: its marker, then this rank's share of its files (every
    `world`-th from `rank`: sizes, and with `digests` the bytes)."""
    files, why = marker(path, fs)
    if files is None:
        return [why or ""]
    out = []
    for rel in sorted(files)[rank::world]:
        size, digest = files[rel]
        f = Path(path) / rel
        try:
            if fs.size(f) != size:
                out.append(f"{f} has {fs.size(f)} bytes, its marker says {size}")
            elif digests and fs.digest(f) != digest:
                out.append(f"{f} holds other bytes than were written (its digest differs)")
        except FileNotFoundError:
            out.append(f"{f} is missing")
        except OSError as e:
            out.append(f"{f}: {e.strerror or e}")
    return out


def record(root: Path, ckpt: Path, tag: str, fs: LocalFS = LOCAL) -> None:
    """The conversion of `ckpt` (a checkpoint of the run whose checkpoints directory is `root`) into
    `<ckpt>/<tag>` in the run's journal: which checkpoint, which directory, its marker's digest."""
    from trainer.checkpoint import journal
    from trainer.checkpoint.disk import ident, read_state

    if Path(ckpt).parent.resolve() != Path(root).resolve():
        return  # a checkpoint of another run directory: its journal is not ours to write
    state = read_state(ckpt, fs)
    journal.append(root, "convert", fs, id=ident(state) if state else None, tag=Path(ckpt).name, dir=tag,
                   marker=fs.digest(Path(ckpt) / tag / MARKER))  # fmt: skip


def build_sealed(final: Path, make: Callable[[Path], None], force: bool = False, fs: LocalFS = LOCAL,
                 before_seal: Callable[[], None] | None = None) -> bool:  # fmt: skip
    """`final` made by `make` in a hidden directory beside it, sealed, renamed into place (its parent
    fsynced); kept where a marker vouches for it, unless `force`. Returns whether it was made."""
    if not force and marker(final, fs)[0] is not None:
        return False
    final = Path(final)
    fs.rmtree(final)  # damaged, incomplete, or from before markers held digests
    tmp = final.with_name(f".convert-tmp-{final.name}")
    fs.rmtree(tmp)
    fs.mkdir(tmp)
    make(tmp)
    if before_seal is not None:
        before_seal()
    seal(tmp, fs)
    fs.rename(tmp, final)
    fs.fsync_dir(final.parent)
    return True
