#!/usr/bin/env python3
"""What a GPU lease carries (issue 62): the wheels the device image lacks, in `.whl/`, under the 64 MiB a call.

    python bench/carry.py finetune|grpo|unsloth [--dir .whl] [--cuda 130] [--python 3.12]

The device machine reaches no package registry and has torch, transformers, peft, accelerate, triton
and the hub's libraries, but not DeepSpeed (the device tool's list of its image). bench/gpu.sh installs
`.whl/*.whl` into /tmp/site with --no-deps (what the image has is used as it is), and for `unsloth`
`.whl/unsloth/*.whl` into a site of its own (Unsloth caps transformers at 5.17 and trl at 1.15, and wants
datasets < 5; the image's transformers serves it, ours 5.24 stays in /tmp/site).

- every lease: DeepSpeed built here as a wheel (`DS_BUILD_OPS=0`: its ops are JIT-built there), and the
  versions of transformers, datasets, pydantic, peft, bitsandbytes and their small needs that this
  checkout's .venv has (what CI tests), so a lease runs what the tests ran;
- grpo: TRL as the venv has it (the GRPOTrainer beside ours), and Qwen3's tokenizer (`qwen3-tokenizer.tar.xz`);
- unsloth: unsloth and unsloth_zoo (2026.10.9), trl 1.15.0, datasets 4.8.5 and the small packages they
  require that the image lacks, and Llama 3's tokenizer (`llama3-tokenizer.tar.xz`, from
  .cache/tokenizers/llama3_2: FastLanguageModel loads one with the base; it has the 8B's vocabulary).

Two wheels are trimmed, or the unsloth lease would not fit (72 MB of the two alone): bitsandbytes keeps the
library of the device's CUDA (`--cuda`, 130 for torch 2.11+cu130; 43 MB to about 4) and unsloth drops
`studio/`, its web app (28 MB to about 3). RECORD is rewritten to match. At the end the whole that would
travel (the checkout's files that git does not ignore, and `.whl`) is summed against the limit.

Use then: the `run` tool with `carry: [".whl"]` and `bash bench/gpu.sh $OUT <lease>`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20  # the working tree a call carries, .whl in it
PLATFORM = ["--only-binary=:all:", "--implementation", "cp"] + [
    a for p in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014")
    for a in ("--platform", f"{p}_x86_64")
]  # fmt: skip
# Ours on the device: what the image lacks or has at another version than CI tests (the venv's).
OURS = ["transformers", "datasets", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
        "hjson", "dill", "multiprocess", "peft", "bitsandbytes"]  # fmt: skip
GRPO = ["trl"]
UNSLOTH = ["unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "trl==1.15.0", "datasets==4.8.5", "torchao==0.18.0",
           "cut_cross_entropy==25.1.1", "tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.1",
           "msgspec==0.22.0", "json5==0.17.3", "nest_asyncio==1.6.0", "structlog==26.1.0", "hf_transfer==0.1.9", "bitsandbytes", "pydantic", "pydantic_core",
           "annotated_types", "typing_inspection", "dill", "multiprocess"]  # fmt: skip
# the published tokenizer a lease's job reads (from .cache/tokenizers, make tokenizers), packed beside the wheels
TOKENIZERS = {"unsloth": ("llama3_2", "llama3-tokenizer.tar.xz"), "grpo": ("qwen3", "qwen3-tokenizer.tar.xz")}


def pinned(name: str) -> str:
    """`name==version` as this checkout's venv has it (a name already pinned is kept)."""
    if "==" in name:
        return name
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"bench/carry.py: {name} is not in this venv: pin it in the list (name==version)"
        ) from None


def download(specs: list[str], into: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "--python-version", python,
           "-d", str(into), *specs]  # fmt: skip
    subprocess.run(cmd, check=True)


def build_deepspeed(into: Path) -> None:
    """DeepSpeed as a wheel of Python alone: its ops (FusedAdam, CPU Adam) are JIT-built on the device."""
    env = dict(os.environ, DS_BUILD_OPS="0")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(into)]
    subprocess.run([*cmd, pinned("deepspeed")], check=True, env=env)


def trim(wheel: Path, drop) -> tuple[int, int]:  # noqa: ANN001 (drop: a name -> bool)
    """Rewrite `wheel` without the members `drop` names; RECORD lists what is left. Returns the sizes
    before and after."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept: list[str] = []
        for info in src.infolist():
            if info.filename == record or drop(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            kept.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record, "\n".join([*kept, f"{record},,"]) + "\n")
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def cuda_tag(value: str) -> str:
    """bitsandbytes' name for a CUDA version: "130" from 130, "13.0" (as torch.version.cuda prints it) or cu130."""
    digits = value.strip().lower().removeprefix("cu").replace(".", "")
    if not digits.isdigit() or not 3 <= len(digits) <= 4:
        raise SystemExit(f"bench/carry.py: --cuda {value!r}: a CUDA version, as 13.0, 130 or cu130")
    return digits


def bnb_drop(cuda: str):  # noqa: ANN201
    """bitsandbytes' native libraries other than the one for CUDA `cuda` (and the CPU's)."""

    def drop(name: str) -> bool:
        base = name.rsplit("/", 1)[-1]
        return base.startswith("libbitsandbytes_") and base not in (
            f"libbitsandbytes_cuda{cuda}.so",
            "libbitsandbytes_cpu.so",
        )

    return drop  # fmt: skip


def unsloth_drop(name: str) -> bool:
    return name.startswith("studio/")


def trim_all(folder: Path, cuda: str) -> None:
    for wheel in sorted(folder.glob("*.whl")):
        name = wheel.name.split("-")[0].lower()
        drop = bnb_drop(cuda) if name == "bitsandbytes" else unsloth_drop if name == "unsloth" else None
        if drop is not None:
            if name == "bitsandbytes":  # keep nothing but the CPU's and the lease is lost: refuse
                with zipfile.ZipFile(wheel) as z:
                    libs = sorted(n.rsplit("/", 1)[-1] for n in z.namelist() if "libbitsandbytes_cuda" in n)
                if f"libbitsandbytes_cuda{cuda}.so" not in libs:
                    raise SystemExit(f"bench/carry.py: {wheel.name} has no library for CUDA {cuda} (--cuda); it has "
                                     f"{', '.join(libs)}")  # fmt: skip
            before, after = trim(wheel, drop)
            if after < before:
                print(f"  {wheel.name}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


def travelling_bytes(whl: Path) -> int:
    """What a call sends: the files git tracks or leaves unignored, and `whl` (carried)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout  # fmt: skip
    files = {ROOT / f for f in out.decode().split("\0") if f}
    files |= {p for p in whl.rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lease", choices=["finetune", "grpo", "unsloth"])
    ap.add_argument("--dir", default=str(ROOT / ".whl"))
    ap.add_argument(
        "--cuda", default="130", help="the device torch's CUDA, as bitsandbytes names its library"
    )
    ap.add_argument("--python", default="3.12", help="the device's python (3.11 to try a lease here, on CPU)")
    a = ap.parse_args()
    cuda = cuda_tag(a.cuda)
    whl = Path(a.dir).resolve()
    if not whl.is_relative_to(ROOT):
        raise SystemExit(f"bench/carry.py: --dir {a.dir}: outside the checkout, a call cannot carry it")
    unknown = (
        [p for p in whl.iterdir() if p.name != "unsloth" and not p.name.endswith((".whl", ".tar.xz"))]
        if whl.is_dir()
        else []
    )
    if unknown:  # it replaces the folder: only one it made
        raise SystemExit(
            f"bench/carry.py: --dir {a.dir} holds {unknown[0].name}, not only wheels; name another folder"
        )
    new = whl.with_name(whl.name + ".new")  # built aside: a failed build leaves the old folder as it was
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    build_deepspeed(new)
    download([pinned(n) for n in OURS + (GRPO if a.lease == "grpo" else [])], new, a.python)
    if a.lease == "unsloth":
        download([pinned(n) for n in UNSLOTH], new / "unsloth", a.python)
        trim_all(new / "unsloth", cuda)
    if a.lease in TOKENIZERS:
        folder, packed = TOKENIZERS[a.lease]
        with tarfile.open(new / packed, "w:xz") as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                tar.add(ROOT / ".cache" / "tokenizers" / folder / name, arcname=name)
    trim_all(new, cuda)
    shutil.rmtree(whl, ignore_errors=True)
    new.rename(whl)
    for p in sorted(whl.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size / 1e6:8.2f} MB  {p.relative_to(whl)}")
    total = travelling_bytes(whl)
    print(f"a call would carry {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} (the checkout and {whl.name})")
    return 0 if total <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
