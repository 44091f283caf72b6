"""Supervised runs: build the launcher command, run it, and on a retryable failure run it again.

    bin/train EXP.yaml --launcher deepspeed|torchrun|none [--nproc-per-node G] [--hostfile H] --max-restarts N

Each attempt resumes from the latest complete checkpoint (or, before the first one exists, from
the `--resume PATH` the job was started with). A failure that a restart cannot fix is not retried:
a configuration or input error (exit 2: a bad value, a checkpoint that does not load into this job,
changed data, a run directory another job holds) and a non-finite loss (exit 4: the same weights
and data reach it again). Launchers report their own exit code (torchrun: 1), so the rank that
fails records why in the file `TRAINER_FAILURE_FILE` names (one per attempt) and the supervisor
reads it. SIGTERM/SIGINT are forwarded to the running attempt; during the back-off between
attempts they end the supervisor. After an out-of-memory with `strategy.on_oom: escalate`, the rank that hit it records the
failed candidate in `<run_dir>/escalation.json` and the next attempt runs one rung higher on the
ladder (0 -> 2 -> 3 -> 3+cpu -> 3+nvme), with the escalation as its justification. Every attempt is
recorded in `<run_dir>/attempts.jsonl`. The supervisor never runs inside a launcher: it is the thing
that starts one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.common.errors import EXIT_NONFINITE, EXIT_USER_ERROR, UserError
from trainer.common.files import write_atomic
from trainer.strategy.planning import next_rung

log = logging.getLogger("trainer")

ESCALATION = "escalation.json"
ATTEMPTS = "attempts.jsonl"
ENV_FAILURE_FILE = "TRAINER_FAILURE_FILE"
FINAL_EXITS = {
    EXIT_USER_ERROR: "a configuration or input error",
    EXIT_NONFINITE: "a non-finite loss (the same weights and data would reach it again)",
}
TRAIN = Path(__file__).resolve().parents[2] / "bin" / "train"


def unresolvable(host: str) -> str | None:
    """Why `host` has no address (None: it has one): the name ssh would connect to (its config's
    HostName for an alias, `ssh -G`) looked up as the launcher's ssh will."""
    import socket

    name = host
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["ssh", "-G", host], capture_output=True, text=True, timeout=10).stdout
        name = next(
            (line.split(None, 1)[1] for line in out.splitlines() if line.startswith("hostname ")), host
        )
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror as e:
        return e.strerror or str(e)
    return None


def check_resolves(hosts: list[tuple[str, int]], path: str | None) -> None:
    """Every host of the hostfile has an address (a UserError naming those without)."""
    bad = [
        f"host '{h}' does not resolve ({why})" for h, why in ((h, unresolvable(h)) for h, _ in hosts) if why
    ]
    if bad:
        raise UserError(
            f"--hostfile {path}: {'; '.join(bad)}; fix the name or the resolver (DNS, /etc/hosts, ~/.ssh/config)"
        )


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Hosts and slots of a deepspeed hostfile; every problem (missing file, a malformed line, a host
    named twice) is an error, where the deepspeed runner alone would warn and train locally."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"--hostfile {path} does not exist (resolved against {Path.cwd()}); the deepspeed runner would only warn "
            "and train on this machine alone. Write one line per node: '<host> slots=<ranks on that node>'"
        )
    hosts: list[tuple[str, int]] = []
    problems = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = parts[1][len("slots=") :] if len(parts) == 2 and parts[1].startswith("slots=") else ""
        if not slots.isdigit() or int(slots) < 1:
            problems.append(f"line {n}: '{raw.strip()}' is not '<host> slots=<N>' with N >= 1")
            continue
        host = parts[0]
        if host in seen:
            problems.append(f"line {n}: host '{host}' is already named on line {seen[host]}")
            continue
        seen[host] = n
        hosts.append((host, int(slots)))
    if not hosts and not problems:
        problems.append("it names no host")
    if problems:
        raise UserError(f"--hostfile {path}: " + "; ".join(problems))
    return hosts


def writable(run_dir: Path) -> None:
    """The run directory exists and this user can write it (a UserError naming it and the fix)."""
    probe = Path(run_dir) / f".write-check-{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        for where in (Path(run_dir), Path(run_dir) / "checkpoints"):
            if where.is_dir():
                probe = where / f".write-check-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
    except OSError as e:
        from trainer.checkpoint.fs import describe

        raise UserError(
            f"run_dir {Path(run_dir)} cannot be written (nothing could be saved there): "
            + describe(e, e.filename or probe, "writing a file in it")
        ) from None


def record_oom(
    run_dir: str | Path, *, stage: int, offload: str, step: int, rank: int, attempt: int, error: str,
    levers: str = "none", next_overrides: list[str] | None = None, next_name: str | None = None,
) -> None:  # fmt: skip
    """Called by the rank that ran out of memory (before it exits): the failed (levers, rung), and what
    the plan ranks next (`next_overrides`, `next_name`; None: nothing after it)."""
    path = Path(run_dir) / ESCALATION
    rec = {
        "stage": stage,
        "offload": offload,
        "levers": levers,
        "next": next_overrides,
        "next_name": next_name,
        "step": step,
        "rank": rank,
        "attempt": attempt,
        "error": error[:500],
        "time": time.time(),
    }
    write_atomic(path, json.dumps(rec, indent=2) + "\n", writer=rank)


def record_failure(code: int, message: str, rank: int) -> None:
    """Called by a rank that ends with an exit a restart cannot fix (FINAL_EXITS), when a supervisor
    asked for it (`TRAINER_FAILURE_FILE`): what failed, for the supervisor to report."""
    path = os.environ.get(ENV_FAILURE_FILE)
    if not path or code not in FINAL_EXITS:
        return
    p = Path(path)
    with contextlib.suppress(OSError):
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            p, json.dumps({"exit": code, "rank": rank, "message": message[:2000]}) + "\n", writer=rank
        )


def launcher_program(script: str, module: str) -> list[str]:
    """The launcher beside this interpreter (`.venv/bin/torchrun`), or its module where no script was
    installed; an error that says how to run bin/train where this Python has neither."""
    import importlib.util

    path = Path(sys.executable).parent / script
    if path.exists():
        return [str(path)]
    if all(importlib.util.find_spec(m) is not None for m in ("torch", "deepspeed")):
        return [sys.executable, "-m", module]
    raise UserError(
        f"--launcher {script}: this Python ({sys.executable}) has no `{script}` beside it and cannot import "
        "torch and deepspeed; run bin/train with the project's environment: `source .venv/bin/activate` "
        "first, or `.venv/bin/python bin/train ...`"
    )


def back_off(delay: float, stopping: Any) -> bool:
    """Sleep `delay` seconds between attempts unless `stopping()` (a signal) says to stop: True at once then.
    Polled, so that the signal handler only stores the signal: a threading.Event set from the handler could
    deadlock with the main thread it interrupts inside the same Event's wait."""
    deadline = time.monotonic() + delay
    while not stopping() and time.monotonic() < deadline:
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
    return bool(stopping())


@dataclass
class Supervisor:
    experiment: str
    overrides: list[str]
    run_dir: Path
    launcher: str = "none"  # none | deepspeed | torchrun
    nproc_per_node: int = 1
    hostfile: str | None = None
    max_restarts: int = 0
    resume: str | None = None
    extra_args: list[str] = field(default_factory=list)
    backoff_s: float = 2.0
    min_nodes: int | None = None  # elastic continuation (elastic.py); None: every node of the hostfile
    # Set by elastic.py under --min-nodes: the survivors' hostfile for this attempt (None: the hostfile
    # as given) and the train.grad_accum override that keeps the global batch on them.
    survivors: str | None = field(default=None, init=False)
    kept_accum: str | None = field(default=None, init=False)
    _child: subprocess.Popen | None = None
    _stopping: int | None = None  # the signal that asked us to stop
    job: str = field(default_factory=lambda: supervised_job())  # recorded with every commit

    def hosts(self) -> list[tuple[str, int]]:
        return read_hostfile(self.hostfile) if self.hostfile else []

    def command(self, overrides: list[str], resume: str | None, port: int) -> list[str]:
        return launch_command(self, overrides, resume, port)

    def run(self) -> int:
        from trainer.checkpoint import checkpoints_dir, latest
        from trainer.checkpoint.restart import restart_resume

        # a missing, malformed or unresolvable hostfile: an error before anything starts
        check_resolves(self.hosts(), self.hostfile)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        writable(self.run_dir)  # attempts.jsonl, failure records, checkpoints: an input error, never retried
        overrides = list(self.overrides)
        resume = self.resume
        attempt = 0
        while True:
            overrides = self._elastic(attempt, overrides)
            if overrides is None:
                return 1
            rc, escalated, failure = self._attempt(attempt, overrides, resume)
            if rc == 0 or self._stopping:
                return rc
            final = failure["exit"] if failure else rc if rc in FINAL_EXITS else None
            if final is not None:
                what = failure["message"].splitlines()[0] if failure else FINAL_EXITS[final]
                self.say(
                    f"attempt {attempt} failed with {FINAL_EXITS[final]} (exit {final}): {what}\n"
                    "[supervisor] not restarting: another attempt would fail the same way"
                )
                return final
            if attempt >= self.max_restarts:
                self.say(f"attempt {attempt} failed (exit {rc}); no restarts left")
                return rc
            if escalated is not None:
                overrides = self._escalate(escalated, overrides, attempt)
                if overrides is None:
                    return rc
            # What the job was started from until it committed a checkpoint of its own (a rollback killed
            # before its fork or first save is done again); then the newest of its line (lineage.py).
            resume = restart_resume(self.run_dir, self.resume, self.job)
            found = latest(checkpoints_dir(self.run_dir))[0] if resume == "latest" else None
            start = f"from {found.tag}" if found else f"from {resume}" if resume else "from scratch"
            delay = min(self.backoff_s * 2**attempt, 60.0)
            self.say(f"attempt {attempt} failed (exit {rc}); restarting in {delay:.0f} s {start}")
            if back_off(delay, lambda: bool(self._stopping)):
                name = signal.Signals(self._stopping).name if self._stopping else "a signal"
                self.say(f"{name} during the back-off: stopping, no further attempt")
                return 128 + (self._stopping or signal.SIGTERM)
            attempt += 1

    def _attempt(
        self, attempt: int, overrides: list[str], resume: str | None
    ) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None]:
        """Run one attempt to its end: (exit status, the out-of-memory record it left, the failure a
        rank recorded). Recorded in attempts.jsonl."""
        from trainer.cluster.dist import free_port

        escalation_before = self._escalation_mtime()
        cmd = self.command(overrides, resume, free_port())
        failure_file = self.run_dir / ".supervisor" / f"attempt-{attempt}-{os.getpid()}.json"
        failure_file.unlink(missing_ok=True)
        env = attempt_env(attempt, failure_file, self.launcher, self.hostfile, self.run_dir, self.job)
        self.say(f"attempt {attempt}: {' '.join(cmd)}")
        t0 = time.time()
        self._child = subprocess.Popen(cmd, env=env, start_new_session=True)
        rc = self._child.wait()
        self._child = None
        escalated = self._escalation() if self._escalation_mtime() != escalation_before else None
        failure = self._read_json(failure_file)
        self._record(attempt, cmd, rc, time.time() - t0, escalated, failure)
        return rc, escalated, failure

    def _elastic(self, attempt: int, overrides: list[str]) -> list[str] | None:
        """--min-nodes: this attempt's overrides on the nodes that answer (elastic.py; None: stop)."""
        from trainer.cluster.elastic import on_survivors

        return on_survivors(self, attempt, overrides)

    def _escalate(self, escalated: dict[str, Any], overrides: list[str], attempt: int) -> list[str] | None:
        """The overrides of the next attempt, one rung above the one that ran out of memory (None:
        it was the last rung)."""
        out, said = escalated_overrides(escalated, overrides, attempt)
        self.say(said)
        return out

    @staticmethod
    def say(line: str) -> None:
        print(f"[supervisor] {line}", flush=True)

    def _forward(self, signum: int, _frame: Any) -> None:
        self._stopping = signum  # only a store (an Event set here can deadlock with the wait it interrupts)
        if self._child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._child.pid, signum)

    def _escalation_mtime(self) -> float | None:
        try:
            return (self.run_dir / ESCALATION).stat().st_mtime
        except OSError:
            return None

    def _escalation(self) -> dict[str, Any] | None:
        return self._read_json(self.run_dir / ESCALATION)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _record(
        self,
        attempt: int,
        cmd: list[str],
        rc: int,
        seconds: float,
        escalated: dict | None,
        failure: dict | None,
    ) -> None:
        hosts = read_hostfile(self.survivors) if self.survivors else self.hosts()  # this attempt's nodes
        ranks = sum(n for _, n in hosts) or (1 if self.launcher == "none" else self.nproc_per_node)
        rec = {"attempt": attempt, "exit": rc, "seconds": round(seconds, 1), "ranks": ranks,
               "device_hours": ranks * seconds / 3600, "command": cmd, "oom": escalated, "failure": failure}  # fmt: skip
        with open(self.run_dir / ATTEMPTS, "a") as f:
            f.write(json.dumps(rec) + "\n")


def launch_command(sup: Supervisor, overrides: list[str], resume: str | None, port: int) -> list[str]:
    """The command of one attempt: bin/train under the supervisor's launcher."""
    args = [str(TRAIN), sup.experiment]
    for o in overrides:
        args += ["--set", o]
    if resume:
        args += ["--resume"] + ([] if resume == "latest" else [resume])
    args += sup.extra_args
    if sup.launcher == "none":
        return [sys.executable, *args]
    if sup.launcher == "deepspeed":
        head = launcher_program("deepspeed", "deepspeed.launcher.runner")
        hostfile = sup.survivors or sup.hostfile  # the survivors' under --min-nodes (elastic.py)
        if hostfile:
            head += ["--hostfile", hostfile, "--master_addr", read_hostfile(hostfile)[0][0]]
        else:
            head += ["--num_gpus", str(sup.nproc_per_node)]
        return [*head, "--master_port", str(port), *args]
    if sup.launcher == "torchrun":
        return [*launcher_program("torchrun", "torch.distributed.run"), "--nproc_per_node", str(sup.nproc_per_node),
                "--master_port", str(port), *args]  # fmt: skip
    raise UserError(f"--launcher: unknown launcher '{sup.launcher}'; use deepspeed, torchrun or none")


def supervised_job() -> str:
    """The supervised job's id, recorded with every commit: a new one, within Slurm's job where Slurm runs it
    (a requeue restarts this supervisor with the same command line: the same job; cluster/dist.slurm_job)."""
    import uuid

    from trainer.cluster.dist import slurm_job

    own = uuid.uuid4().hex[:12]
    return slurm_job(own) if os.environ.get("SLURM_JOB_ID") else own


def attempt_env(
    attempt: int,
    failure_file: Path,
    launcher: str,
    hostfile: str | None,
    run_dir: Path,
    job: str | None = None,
) -> dict[str, str]:
    """The environment of one attempt: its number, the job's id, where a rank records a failure, and what
    the launchers need passed on."""
    from trainer.cluster.devices import ENV_CPU, gpus_hidden
    from trainer.cluster.dist import remote_env

    env = dict(os.environ, TRAINER_ATTEMPT=str(attempt), **{ENV_FAILURE_FILE: str(failure_file.resolve())})
    if job:
        env["TRAINER_JOB"] = job
    if gpus_hidden():  # GPUs hidden here stay hidden in the ranks (the deepspeed launcher resets them)
        env[ENV_CPU] = "1"
    if launcher == "torchrun":  # pytorch#135712: gloo needs it to rendezvous again
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if hostfile:  # the runner forwards only PYTHON*/MV2*/UCX* to the nodes
        env_file = run_dir / ".deepspeed_env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in remote_env(env).items()))
        env["DS_ENV_FILE"] = str(env_file.resolve())
    return env


def escalated_overrides(
    escalated: dict[str, Any], overrides: list[str], attempt: int
) -> tuple[list[str] | None, str]:
    """(the overrides of the attempt after an out-of-memory: one rung above, or None on the last rung;
    what the supervisor says)."""
    offload = "" if escalated["offload"] == "none" else "+" + escalated["offload"]
    levers = escalated.get("levers") or "none"
    where = f"zero{escalated['stage']}{offload}" + ("" if levers == "none" else f" with {levers}")
    why = f"escalated after out-of-memory on {where} at step {escalated['step']} (attempt {attempt})"
    if "next" in escalated:  # what the plan ranks next: a ZeRO rung or an activation lever
        if not escalated["next"]:
            return None, f"out of memory on {where}, the last the plan ranks: nothing to escalate to"
        pinned = tuple(o.split("=", 1)[0] + "=" for o in escalated["next"]) + ("strategy.justification=",)
        said = f"{why}: next attempt on {escalated['next_name']}"
        return [o for o in overrides if not o.startswith(pinned)] + [
            *escalated["next"],
            f"strategy.justification={why}",
        ], said
    rung = next_rung(escalated["stage"], escalated["offload"])  # a record from before the levers
    if rung is None:
        return None, "out of memory on the last rung of the ladder: nothing to escalate to"
    pinned = ("strategy.zero_stage=", "strategy.offload=", "strategy.justification=")
    said = f"{why}: next attempt on zero{rung[0]}{'' if rung[1] == 'none' else '+' + rung[1]}"
    return [o for o in overrides if not o.startswith(pinned)] + [
        f"strategy.zero_stage={rung[0]}",
        f"strategy.offload={rung[1]}",
        f"strategy.justification={why}",
    ], said
