"""User-facing errors.

A `UserError` is a problem the user can fix by editing their experiment, their command line
or their files. The CLI prints it without a traceback and exits with status 2; anything else
is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

# Exit statuses of bin/train (the supervisor reads them).
EXIT_CHECK_FAILED = 1  # a consistency check failed (the message names the ranks)
EXIT_USER_ERROR = 2  # bad config or input: not retried
EXIT_OOM = 3  # out of memory with strategy.on_oom: escalate
EXIT_NONFINITE = 4  # a NaN/inf loss stopped every rank


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input: where it is, what was found, how to fix it."""

    key: str  # dotted key path, e.g. "train.micro_batch_size"; "" for the file as a whole
    message: str  # what is wrong and what is allowed / how to fix it
    line: int | str | None = None  # line in the file, or where else the value came from ("--set")

    def render(self, source: str | None) -> str:
        where = source or "<config>"
        if isinstance(self.line, int):
            where = f"{where}:{self.line}"
        elif self.line:
            where = f"{where} [{self.line}]"
        key = f" {self.key}:" if self.key else ""
        return f"{where}:{key} {self.message}"


class UserError(Exception):
    """An error in the user's input. Printed without traceback; exit status 2."""

    def __init__(
        self,
        message: str,
        problems: Iterable[Problem] = (),
        source: str | None = None,
        everywhere: bool | None = None,
    ):
        self.problems = list(problems)
        self.source = source
        # Whether every rank raises this same error (then rank 0 alone prints it): True when it
        # comes from facts every rank shares; None = decided by where it is raised (before the
        # process group: from the same inputs on every rank; after it: this rank's own).
        self.everywhere = everywhere
        super().__init__(message)

    def __str__(self) -> str:
        return "\n".join([str(self.args[0]), *(f"  - {p.render(self.source)}" for p in self.problems)])

    def render(self) -> str:
        return f"error: {self}"


class ResumeError(UserError):
    """A checkpoint cannot be loaded into this job: a restart would fail the same way."""


class ConfigError(UserError):
    """One or more problems in an experiment file (all of them, reported at once)."""

    def __init__(self, source: str | None, problems: Iterable[Problem]):
        problems = list(problems)
        n = len(problems)
        what = source or "the experiment"
        super().__init__(f"{what}: {n} problem{'s' if n != 1 else ''} found", problems, source)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' did you mean 'x'?' for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""
