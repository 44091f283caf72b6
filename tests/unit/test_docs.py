"""The documentation runs: every `bin/train` command in a fenced block of README.md and docs/*.md that
names a shipped experiment runs in its cheap form (`--plan`, `--print-config` or `--preview-data` as
written, else `--print-config` in place of what would train or launch), and docs/reference.md is
what scripts/update_reference.py writes from the schema and the parser."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHEAP = ("--plan", "--print-config", "--preview-data", "--describe-config")
# what would train, launch or supervise: dropped (with its value) for the cheap form
# (--prepare-teacher: run as documented by tests/e2e/test_tiny.py, on the teacher `make tiny` trains)
RUNS = {"--check": 0, "--overfit-batch": 0, "--profile": 0, "--dry-run": 0, "--prepare-data": 0, "--prepare-teacher": 0,
        "--launcher": 1, "--hostfile": 1, "--max-restarts": 1, "--nproc-per-node": 1}  # fmt: skip
STARTS = (
    "bin/train",
    "./bin/train",
    "deepspeed",
    "torchrun",
    "srun",
    ".venv/bin/python",
    "python",
    "python3",
)


def commands(text: str) -> list[list[str]]:
    """bin/train's arguments in each command line of the fenced blocks of `text` that names a shipped
    experiment (configs/experiments/*.yaml)."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").split("\n"):
            line = line.strip().removeprefix("$ ")
            if "bin/train " not in line or line.split()[0] not in STARTS:
                continue
            words = shlex.split(line, comments=True)
            args = words[next(i for i, w in enumerate(words) if w.endswith("bin/train")) + 1 :]
            if args and args[0].startswith("configs/experiments/") and (ROOT / args[0]).is_file():
                out.append(args)
    return out


def cheap(args: list[str]) -> list[str]:
    """The command's cheap form: what it runs instead of training."""
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in RUNS:
            skip = RUNS[a]
            if a == "--nproc-per-node":  # planned for the ranks it would launch
                out += ["--world-size", args[i + 1]]
        elif a == "--resume":
            skip = int(i + 1 < len(args) and not args[i + 1].startswith("--"))
        else:
            out.append(a)
    return out if any(a in CHEAP for a in out) else [*out, "--print-config"]


def run(args: list[str], tmp: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """bin/train in this process (no interpreter start per example), in a scratch run dir and data
    cache, planned for 80 GB GPUs with 1 TB hosts unless the example says; a model that `make tiny`
    would export is a small one of the same shape here."""
    from trainer.run.cli import main

    sets = ["--set", f"run_dir={tmp / 'run'}", "--set", f"data.cache_dir={tmp / 'cache'}"]
    for key, value in (("strategy.device_memory", "80GB"), ("strategy.host_memory", "1TB")):
        if not any(a.startswith(key) for a in args):  # planned for the GPU machines the docs are about
            sets += ["--set", f"{key}={value}"]
    text = (ROOT / args[0]).read_text()
    made = re.search(r"pretrained: (runs/tiny[\w-]*/export)", text)  # tiny's, tiny-sft-small's (make targets)
    if made and not (ROOT / made.group(1) / "config.json").exists():
        sets += ["--set", f"model.pretrained={tiny_export(tmp)}"]
    if "tokenizer: .cache/tiny-vlm" in text and not (ROOT / ".cache/tiny-vlm/tokenizer.json").exists():
        from tests.vision_helpers import TINY_VLM  # as `make tiny-vlm` assembles it

        TINY_VLM.make_processor()
    capsys.readouterr()
    code = main([*args, *sets])
    got = capsys.readouterr()
    return code, got.out + got.err


def tiny_export(tmp: Path) -> Path:
    """A directory with tiny's model config, as `make tiny` exports it (the planner reads the config)."""
    path = tmp / "export"
    if not (path / "config.json").exists():
        from transformers import GPT2Config

        GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=256, vocab_size=257).save_pretrained(path)
    return path


EXAMPLES = [(p.relative_to(ROOT).as_posix(), args) for p in DOCS for args in commands(p.read_text())]


def test_the_docs_show_commands_to_run():
    assert len(EXAMPLES) >= 10 and {p for p, _ in EXAMPLES} >= {"README.md", "docs/launching.md"}


@pytest.mark.parametrize(("page", "args"), EXAMPLES, ids=[f"{p}:{' '.join(a)[:60]}" for p, a in EXAMPLES])
def test_every_command_in_the_docs_runs(page, args, tmp_path, capsys):
    code, out = run(cheap(args), tmp_path, capsys)
    assert code == 0, f"{page}: bin/train {' '.join(args)}\n{out[-3000:]}"


def test_a_broken_example_fails():
    """What the test above catches: a key that does not exist, a config that is not there."""
    text = "```\nbin/train configs/experiments/tiny.yaml --set train.max_stepz=1\n```\n"
    (args,) = commands(text)
    from trainer.run.cli import main

    assert main(cheap(args)) == 2
    assert (
        commands("```\nbin/train configs/experiments/nope.yaml\n```\n") == []
    )  # not a shipped config: skipped
    assert cheap(["x.yaml", "--resume", "runs/x", "--launcher", "deepspeed", "--max-restarts", "3"]) == [
        "x.yaml",
        "--print-config",
    ]


def test_the_reference_is_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    from update_reference import REFERENCE, text

    assert REFERENCE.read_text() == text(), (
        "docs/reference.md is stale: run python scripts/update_reference.py"
    )


# Where the repository's text may point: its own files only (not a page beside a checkout nobody else has).
TEXTS = [
    *(ROOT / name for name in ("README.md", "BENCHMARKS.md", "Makefile", "pyproject.toml", ".ci/run")),
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "bin").iterdir()),
    *sorted((ROOT / "scripts").iterdir()),
    *sorted(p for d in ("trainer", "tests", "bench") for p in (ROOT / d).rglob("*.py")),
]


def named_elsewhere(path: Path, text: str) -> list[str]:
    """The pages (`*.md`) and the relative links of markdown outside its code blocks that `text` names
    and the repository does not hold: neither beside `path`, nor from the root, nor in docs/."""
    text = re.sub(r"[a-z]+://\S+", "", text)
    links = (
        re.findall(r"\]\(([^)\s#]+)", re.sub(r"```.*?```", "", text, flags=re.S))
        if path.suffix == ".md"
        else []
    )
    pages = re.findall(r"[\w./-]*\w\.md\b", text)
    out = []
    for name in dict.fromkeys([*pages, *links]):
        places = [path.parent / name] + ([ROOT / name, ROOT / "docs" / name] if name in pages else [])
        if not any(p.resolve().is_relative_to(ROOT) and p.exists() for p in places):
            out.append(name)
    return out


def test_the_repository_points_only_to_its_own_files():
    missing = [
        f"{p.relative_to(ROOT)}: {n}" for p in TEXTS if p.is_file() for n in named_elsewhere(p, p.read_text())
    ]
    assert not missing, "\n".join(missing)
    outside = "../shared/BLUEPRINT" + ".md"  # (spelt in two, or this file would name it)
    assert named_elsewhere(ROOT / "README.md", f"the blueprint: {outside}; [it](../x.py)") == [
        outside,
        "../x.py",
    ]
