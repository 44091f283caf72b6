"""What a resume may change, and what it must refuse.

The model, the data and the seed must be the checkpoint's (`check_compatible` names every
difference); logging, `max_steps`, checkpoint cadence, batch split, strategy and `dist.*` may change
(`HARMLESS`). The training data is compared by content (`Resume.check_data`), the checkpoint every
rank found by identity (`Resume.identity`, gathered at start), and the LR schedule continues as
saved (`trainer.strategy.schedule`, from `Resume.ds_config`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from trainer.checkpoint.disk import Entry, Found
from trainer.common.errors import Problem, UserError
from trainer.config import Experiment, validate

# Changing these between save and resume is fine: they do not change what was learned.
HARMLESS = (
    "name",
    "run_dir",
    "logging",
    "checkpoint",
    "strategy",
    "dist",  # timeouts, watchdog, consistency checks
    "train.max_steps",
    "optim.schedule_steps",  # re-plans the LR schedule on purpose (see strategy.schedule)
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.compile",
    "train.compile_mode",
    "model.attn_implementation",  # the same attention, another kernel (auto: eager on CPU in bf16)
    "model.cudnn_attention",  # the same attention, another kernel
    "model.lora.kernels",  # the same adapters, computed fused or module by module
    "model.chunked_loss",  # the same loss, computed in chunks
    "model.activation_checkpointing",
    "model.tiled_mlp",  # the same MLP, run in shards
    "model.offload_activations",
    "train.micro_batch_size",
    "train.grad_accum",
    "data.num_workers",
    "data.pin_memory",
    "data.persistent_workers",
    "data.num_proc",
    "data.cache_dir",
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ between two experiments (dotted paths)."""
    a, b = _flatten(saved), _flatten(current)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check_compatible(found: Found, exp: Experiment) -> list[str]:
    """Raise if the model or data differ from the checkpoint's; return the harmless differences."""
    path = found.path / "experiment.yaml"
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"--resume: cannot read {path}: {e}") from None
    # A key added to the schema since the save compares at its default, not as missing; if a key
    # was removed or renamed since, the saved file does not validate and compares as written.
    with contextlib.suppress(UserError):
        saved = validate(saved, source=str(path)).to_dict()
    diffs = differences(saved, exp.to_dict())
    harmful = [k for k in diffs if not any(k == h or k.startswith(h + ".") for h in HARMLESS)]
    from trainer.checkpoint import frozen

    if "model.pretrained" in harmful and (frozen.saved(found.state) or {}).get("digest"):
        harmful.remove("model.pretrained")  # moved weights: the frozen-weights digest checks what loads there
    if harmful:
        a, b = _flatten(saved), _flatten(exp.to_dict())
        raise UserError(
            f"--resume: the experiment differs from the one that wrote {found.path} in what the model learned "
            "from; resume with the same model and data, or start a new run_dir",
            [
                Problem(k, f"checkpoint has {a.get(k)!r}, the experiment now has {b.get(k)!r}")
                for k in harmful
            ],
        )
    return diffs


@dataclass
class Resume:
    found: Found
    warnings: list[str]
    differences: list[str]
    explicit: bool = False  # `--resume PATH`: a damaged checkpoint stops the run (no fall back)
    skipped: list[Entry] = field(
        default_factory=list
    )  # newer on the line, passed over as damaged (set aside)
    fallbacks: list[Found] = field(default_factory=list)  # the line below `found`, newest first (lineage.py)
    verified: bool = False  # every file's bytes checked against its digest (policy.undamaged)
    lease: Any = None  # a read lease on a checkpoint of another run directory (lease.py), until it is loaded

    def done(self, exp: Experiment, rank: int) -> bool:
        """The checkpoint is at train.max_steps already (said by rank 0)."""
        if self.found.step < exp.train.max_steps:
            return False
        if rank == 0:
            print(
                f"{self.found.path} is at step {self.found.step}, train.max_steps is {exp.train.max_steps}: nothing to do"
            )
        return True

    @property
    def identity(self) -> dict[str, Any]:
        """What tells this checkpoint apart from another of the same tag (another run's)."""
        return {"tag": self.found.tag, "saved_at": self.found.state.get("saved_at")}

    def check_data(self, now: dict[str, Any], policy: str) -> list[str]:
        """Refuse (policy 'error') or note (policy 'continue') training data that differs from the
        data the checkpoint was trained on."""
        from trainer.data import data_changes

        saved = self.found.state.get("data")
        changes = data_changes(saved, now) if saved else []
        if not changes:
            return []
        pos = self.found.state["data_position"]
        if policy == "error":
            raise UserError(
                f"--resume: the training data differs from the data {self.found.path} was trained on; its data "
                f"position (epoch {pos['epoch']}, sample {pos['sample']}) would point into other data. Resume with "
                "the data as it was, or continue on purpose with checkpoint.on_data_change: continue "
                "(--set checkpoint.on_data_change=continue). What changed in data.train:"
                + "".join(f"\n  - {c}" for c in changes),
                everywhere=True,
            )
        return [
            f"warning: the training data changed since {self.found.tag} ({'; '.join(changes)}); continuing as "
            f"checkpoint.on_data_change asks: at epoch {pos['epoch']}, sample {pos['sample']} of the new data's "
            "shuffled order, so in this epoch some sequences may come twice and others not at all; from the next "
            "epoch on each comes once per epoch"
        ]

    @property
    def ds_config(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.found.path / "ds_config.json").read_text())
        except (OSError, ValueError):
            return None


def decide(arg: str | None, exp: Experiment, faults: Any) -> Resume | None:
    """The resume this run starts from (resolve.resolve: `--resume`, `--resume PATH`, checkpoint.resume),
    checked against the experiment (`check_compatible`); None: a fresh start."""
    from trainer.checkpoint.disk import before, checkpoints_dir
    from trainer.checkpoint.resolve import resolve

    decision, explicit = resolve(arg, exp.checkpoint.resume, exp.run_dir)
    found = decision.found
    if found is not None and faults.stale_resume():
        found = before(found)  # tests: this rank sees an older run_dir
    if found is None:
        return None
    lease = None
    if found.path.parent.resolve() != checkpoints_dir(exp.run_dir).resolve():  # another run directory's
        from trainer.checkpoint.lease import Lease

        lease = Lease(found.path, "a resume")  # its writer keeps it until this run has loaded it
        if not found.path.is_dir():
            lease.release()
            raise UserError(f"--resume {found.path}: the checkpoint is gone (removed while this run looked at it: "
                            "a job writing its run directory pruned it, or it was deleted); name another one")  # fmt: skip
    return Resume(found, decision.warnings, check_compatible(found, exp), explicit=explicit,
                  skipped=decision.skipped, fallbacks=decision.fallbacks, lease=lease)  # fmt: skip


def undamaged(exp: Experiment, env: Any, resume: Any) -> Any:
    """The checkpoint to resume from, its files' bytes checked against their writers' digests before
    anything loads (every rank a share; disk.verify_digests): a damaged one stops a `--resume PATH` run
    naming the file, and otherwise every rank falls back down the line (lineage.verified) to the newest
    checkpoint that passes, saying so once (a file zeroed in place kept its size, and torch's zip CRC
    failed only while loading, which ended the run)."""
    from trainer.checkpoint.disk import verify_digests
    from trainer.checkpoint.lineage import verified
    from trainer.cluster.dist import all_gather

    if resume is None or resume.verified:
        return resume

    def digest_problems(found: Any) -> list[str]:
        shares = all_gather(verify_digests(found, env.rank, env.world_size), env.world_size)
        return sum(shares, [])

    found, below, skipped, said = verified(resume.found, resume.fallbacks, resume.explicit, digest_problems)
    if found is not resume.found:
        resume = Resume(found, [*resume.warnings, *said], check_compatible(found, exp), skipped=[*resume.skipped, *skipped],
                        fallbacks=below, lease=resume.lease)  # fmt: skip
    resume.verified = True
    return resume
