"""Consistency across ranks: the agreement at start, parameter digests, the preflight and
first-step checks, consumed-sample records, and the memory census and optimizer-state dumps the
tests ask for.

Used by `--check` and the preflight (identical weights on every rank), and by the tests (which
ask, through TRAINER_DEBUG_DIR, for every rank's digest and the samples it consumed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.cluster.dist import all_gather


def param_digest(module: Any) -> str:
    """sha256 of every parameter's full value (gathered under ZeRO-3), in name order."""
    import torch

    params = list(module.named_parameters())
    ctx: Any = contextlib.nullcontext()
    if params and hasattr(params[0][1], "ds_id"):  # ZeRO-3 partitioned parameters
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    h = hashlib.sha256()
    with ctx, torch.no_grad():
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def agree_at_start(
    world_size: int,
    *,
    run_dir: str,
    host: str,
    resume: dict[str, Any] | None,
    data_digest: str,
) -> list[str]:
    """What every rank must share before it builds anything, in one gather (rank 0 holds the run directory
    already: run/rundir.py's hold): every rank resumes from the same checkpoint (`resume`: its tag and save
    time, as this rank found it) and sees the same training data. A disagreement is an error on every rank,
    naming the ranks. Returns every rank's host."""
    from trainer.common.errors import UserError

    facts = all_gather({"host": host, "resume": resume, "data": data_digest}, world_size)

    def by_value(key: str, show: Any) -> str:
        groups: dict[str, list[int]] = {}
        for r, f in enumerate(facts):
            groups.setdefault(show(f[key]), []).append(r)
        return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {v}" for v, rs in groups.items())

    if len({json.dumps(f["resume"], sort_keys=True) for f in facts}) > 1:
        raise UserError(
            "the ranks found different checkpoints to resume from ("
            + by_value("resume", lambda r: "none" if r is None else f"{r['tag']} saved {r['saved_at']}")
            + f"). Every rank must see the same {run_dir}: a node-local run_dir or a stale network "
            "filesystem gives each node its own; put run_dir on a filesystem every node shares, or pass the "
            "same --resume PATH",
            everywhere=True,
        )
    if len({f["data"] for f in facts}) > 1:
        raise UserError(
            "the ranks see different training data (digest of the packed tokens: "
            + by_value("data", lambda d: d[:12])
            + "). Every node must read the same files (data.train) with the same tokenizer",
            everywhere=True,
        )
    return [f["host"] for f in facts]


def _ranks(rs: list[int]) -> str:
    return (
        f"{rs[0]}-{rs[-1]}"
        if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1))
        else ", ".join(map(str, rs))
    )


def write_debug_report(
    directory: str, rank: int, world_size: int, module: Any, samples: list[str], extra: dict | None = None
) -> None:
    """Each rank writes rank<R>.json: its parameter digest, all ranks' digests, its consumed samples."""
    digest = param_digest(module)
    digests = all_gather(digest, world_size)
    out = {
        "rank": rank,
        "param_digest": digest,
        "all_param_digests": digests,
        "samples": samples,
        **(extra or {}),
    }
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{rank}.json").write_text(json.dumps(out))


def full_optimizer_state(engine: Any, names: list[list[str]]) -> dict[str, dict[str, Any]]:
    """Every parameter's whole fp32 master weight and optimizer state, as the live engine holds them at
    any ZeRO stage (gathered from the partitions: every rank must call it). Tests compare the state a
    resumed engine holds with the state the uninterrupted one saved."""
    from trainer.checkpoint import stage0

    ds = engine.ds
    if ds.zero_optimization_stage() == 0:
        module = {k: v.detach() for k, v in ds.module.state_dict().items()}
        params, _ = stage0.read(ds.optimizer.state_dict(), module, names)
        return {n: {"fp32": p.fp32, **p.state} for n, p in params.items()}
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = ds.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 link each parameter to its optimizer state once, after the first group's first
        # update, before the other groups have state (DeepSpeed 0.19): link again, now that they do.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    base = getattr(ds, "basic_optimizer", None) or opt
    first = next(iter(base.state.values()), {})
    # Sorted: every rank asks for them in the same order (each call is a collective).
    keys = sorted(k for k, v in first.items() if k != "step" and hasattr(v, "dim") and v.dim() > 0)
    out: dict[str, dict[str, Any]] = {}
    by_name = dict(ds.module.named_parameters())
    for name in (n for group in names for n in group):
        p = by_name[name]
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3: the parameter is a placeholder
        full = {"fp32": safe_get_full_fp32_param(p)}
        full.update({k: safe_get_full_optimizer_state(p, k) for k in keys})
        out[name] = {k: v.detach().float().cpu().reshape(shape).clone() for k, v in full.items()}
    return out


def save_optimizer_state(directory: str, name: str, engine: Any, names: list[list[str]], rank: int) -> None:
    """Tests (TRAINER_DEBUG_DIR): rank 0 writes `full_optimizer_state` to <directory>/<name>.pt."""
    import torch

    state = full_optimizer_state(engine, names)
    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(directory) / f"{name}.pt")


# ----------------------------------------------------------------------------- memory census


def _storages(tensors: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage") and t.numel() > 0:
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flatten(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _flatten(v)]
    return [x]


def quantization_state(module: Any) -> list[Any]:
    """The tensors bitsandbytes keeps beside its quantized weights (model.lora.quantization): 4-bit
    absmax, code and offset, and the second level's (double quantization); 8-bit row scales."""
    out: list[Any] = []
    for p in module.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [state.absmax, state.code, getattr(state, "offset", None)]
            state = getattr(state, "state2", None)
        out.append(getattr(p, "SCB", None))
    return [t for t in out if t is not None]


def census(ds: Any) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer states, counted from the
    engine's tensors (each storage once). Parameters: the module's weights (ZeRO-3: their
    partitions, and the whole tensors it keeps resident below the persistence threshold), with
    bitsandbytes' quantization state where the base is quantized. Optimizer: fp32 master copies (ZeRO) and Adam's moments. Gradients: the module's
    .grad at stage 0, ZeRO's gradient partitions otherwise; module .grad left at stage >= 1 are
    gradients still waiting in a communication bucket, reported as `bucket`."""
    import torch

    module = ds.module
    stage = ds.zero_optimization_stage()
    opt = ds.optimizer
    base = getattr(ds, "basic_optimizer", None) or opt
    param_store = _storages(getattr(p, "ds_tensor", p.data) for p in module.parameters())
    # ZeRO-3 keeps parameters below stage3_param_persistence_threshold whole as well, never released
    param_store.update(
        _storages(p.data for p in module.parameters() if getattr(p, "ds_persist", False) and p.data.numel())
    )
    param_store.update(_storages(quantization_state(module)))
    for flat in getattr(opt, "bit16_groups_flat", None) or []:
        param_store.update(_storages([flat]))
    if stage == 0:
        masters = [p for g in base.param_groups for p in g["params"]]
    else:
        masters = list(
            getattr(opt, "single_partition_of_fp32_groups", None)
            or getattr(opt, "fp32_partitioned_groups_flat", [])
        )
    optim_store = {k: v for k, v in _storages(masters).items() if k not in param_store}
    moments = (t for st in base.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    optim_store.update(_storages(moments))
    module_grads = _storages(p.grad for p in module.parameters())
    zero_grads = [getattr(m, "grad", None) for m in masters]
    for name in ("grads_in_partition", "grad_partitions_flat_buffer", "averaged_gradients"):
        zero_grads += _flatten(getattr(opt, name, None))
    zero_store = _storages(t for t in zero_grads if torch.is_tensor(t))
    grads = module_grads if stage == 0 else zero_store
    bucket = {} if stage == 0 else {k: v for k, v in module_grads.items() if k not in zero_store}
    return {
        "params": sum(param_store.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(optim_store.values()),
        "bucket": sum(bucket.values()),
    }


class MemoryCensus:
    """Takes the census after backward passes: gradients at the first one that ends an accumulation
    (they are reduced and partitioned then), parameters and optimizer states at the first one after
    the first optimizer step (Adam allocates its moments in that step)."""

    def __init__(self) -> None:
        self.result: dict[str, int] = {}

    def __call__(self, engine: Any) -> None:
        ds = engine.ds
        if "optimizer" in self.result:
            return
        if "grads" not in self.result and ds.is_gradient_accumulation_boundary():
            c = census(ds)
            self.result.update(grads=c["grads"], bucket=c["bucket"])
        elif "grads" in self.result and ds.global_steps >= 1:
            c = census(ds)
            self.result.update(params=c["params"], optimizer=c["optimizer"])


class SavedActivations:
    """Tests (TRAINER_DEBUG_ACTIVATIONS): what autograd keeps for backward in the first training
    forward pass, counted by saved-tensor hooks, each storage once, parameters left out: the bytes saved
    inside the decoder layers (the model's longest ModuleList) and elsewhere (embeddings, final norm,
    head, loss). Every rank writes DIR/activations_rank{R}.json. (ZeRO-3 gathers the weights into other
    storages, which would count: measure at stages 0-2.)"""

    def __init__(self, directory: str, rank: int, model: Any) -> None:
        import torch

        self.directory, self.rank, self.done = directory, rank, False
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        self.layers = list(max(lists, key=len)) if lists else []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        import torch

        if self.done or not torch.is_grad_enabled():  # the first training forward pass, not an eval's
            yield
            return

        seen: dict[int, tuple[str, int]] = {}
        where = ["other"]

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.params and ptr not in seen:
                seen[ptr] = (where[0], storage.nbytes())
            return t

        handles = []
        for layer in self.layers:
            handles.append(layer.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layers")))
            handles.append(layer.register_forward_hook(lambda *_: where.__setitem__(0, "other")))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
        self.done = True
        out = {k: sum(n for w, n in seen.values() if w == k) for k in ("layers", "other")}
        out["count"] = len(self.layers)
        from trainer.common.files import write_atomic

        Path(self.directory).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(self.directory) / f"activations_rank{self.rank}.json", json.dumps(out))


class GradDump:
    """Tests (TRAINER_DEBUG_GRADS=STEP): after the backward pass that ends step STEP's accumulation,
    every parameter's whole gradient as the optimizer gets it (reduced, gathered from the ZeRO
    partitions: DeepSpeed's safe_get_full_grad on every rank), written by rank 0 to
    DIR/grads_stepSTEP.pt."""

    def __init__(self, directory: str, step: int, rank: int) -> None:
        self.directory, self.step, self.rank, self.done = directory, step, rank, False

    def __call__(self, engine: Any) -> None:
        ds = engine.ds
        if self.done or ds.global_steps != self.step - 1 or not ds.is_gradient_accumulation_boundary():
            return
        import torch
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        dims = {}
        if _axes(engine)[0] > 1:  # tensor parallelism: each rank's shard joined with its group's
            from trainer.model.axes import shard_dims

            dims = shard_dims(ds.module)
        for name, p in ds.module.named_parameters():
            g = safe_get_full_grad(p)
            if g is not None and name in dims:
                from trainer.model.axes import whole

                g = whole(g, dims[name])
            if g is not None:
                grads[name] = g.detach().float().cpu().clone()
        if getattr(engine, "pipe", None) is not None:  # each stage's, by the model's names, joined on rank 0
            import torch.distributed as dist

            from trainer.model.stages import model_names

            grads = {model_names(ds.module).get(n, n): g for n, g in grads.items()}
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, grads)
            grads = {k: v for part in every for k, v in part.items()}
        if self.rank == 0:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            torch.save(grads, Path(self.directory) / f"grads_step{self.step}.pt")
        self.done = True


# ----------------------------------------------------------------------------- preflight


class CheckFailed(Exception):
    """A consistency check failed; the message names the ranks. Raised on every rank."""


def fingerprint(module: Any) -> Any:
    """Per-parameter (sum, sum of squares) in float64, on the device: cheap, and equal across ranks
    exactly when the weights are (ZeRO-3 partitions differ by design and are not compared)."""
    import torch

    rows = [
        torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
        for p in module.parameters()
    ]
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _odd_ranks(values: list[Any]) -> list[int]:
    """Ranks whose value differs from the majority (rank 0's when there is no majority)."""
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    reference = max(counts, key=lambda v: (counts[v], v == values[0]))
    return [r for r, v in enumerate(values) if v != reference]


def preflight(engine: Any, world_size: int, hosts: list[str]) -> list[str]:
    """At start: every rank can all-reduce, and holds the same weights. Returns log lines."""
    import torch
    import torch.distributed as dist

    lines = []
    if world_size > 1:
        t = torch.ones(1, device=engine.device)
        dist.all_reduce(t)
        if int(t.item()) != world_size:
            raise CheckFailed(
                f"all-reduce sanity check failed: sum of ones over {world_size} ranks gave {t.item()}"
            )
        lines.append(f"preflight: all-reduce across {world_size} ranks on {len(set(hosts))} host(s) ok")
    lines += _same_weights(engine, world_size, hosts, "at start")
    return lines


def _same_weights(engine: Any, world_size: int, hosts: list[str], when: str) -> list[str]:
    tp, ep = _axes(engine)
    held = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()) if tp * ep > 1 else 0
    if engine.ds.zero_optimization_stage() == 3:
        axes = (
            f" (tensor parallel {tp}, expert parallel {ep}; rank 0 holds {held:,} parameters)"
            if tp * ep > 1
            else ""
        )
        return [f"preflight: weights {when}: ZeRO-3 partitions differ by design; not compared{axes}"]
    fp = fingerprint(engine.module).cpu().numpy().tobytes()
    prints = all_gather(fp, world_size)
    # tensor and expert parallelism: a rank holds its group's shard; it is compared with the ranks of the same
    # shards (the same place in their tensor- and expert-parallel groups: consecutive ranks, trainer/strategy/
    # planning/axes.py's layout)
    # planning/axes.py's layout); a pipeline's stage is world / pp consecutive ranks (DeepSpeed's topology)
    odd, per_stage = [], world_size // _stages(engine)
    for key in {(r % tp, r % ep, r // per_stage) for r in range(world_size)}:
        same = [r for r in range(world_size) if (r % tp, r % ep, r // per_stage) == key]
        odd += [same[i] for i in _odd_ranks([prints[r] for r in same])]
    odd.sort()
    if tp * ep * _stages(engine) > 1 and not odd:
        return [f"preflight: weights identical {when} on the ranks of each shard ({world_size} ranks, tensor "
                f"parallel {tp}, expert parallel {ep}, pipeline stages {_stages(engine)}; rank 0 holds "
                f"{sum(p.numel() for p in engine.module.parameters()):,} parameters)"]  # fmt: skip
    if odd:
        who = ", ".join(f"rank {r} ({hosts[r] if r < len(hosts) else '?'})" for r in odd)
        raise CheckFailed(
            f"parameters differ across ranks {when}: {who} differ from the others. Ranks must start from the same "
            "weights (same seed, same checkpoint) and stay in step"
        )
    return [f"preflight: weights identical on all {world_size} ranks {when}"]


def _stages(engine: Any) -> int:
    """The engine's pipeline stages (1 without them)."""
    return int(engine.ds.num_stages) if getattr(engine, "pipe", None) is not None else 1


def _axes(engine: Any) -> tuple[int, int]:
    """The engine's tensor- and expert-parallel degrees (1, 1 without them)."""
    from trainer.strategy.planning.axes import parallel_degrees

    return parallel_degrees(getattr(engine, "ds_config", None))


def after_first_step(engine: Any, world_size: int, hosts: list[str]) -> list[str]:
    """After the first optimizer step: the global gradient norm and the weights agree everywhere."""
    norm = engine.grad_norm
    norms = all_gather(None if norm is None else round(float(norm), 6), world_size)
    odd = _odd_ranks(norms)
    if odd:
        who = ", ".join(f"rank {r} ({hosts[r] if r < len(hosts) else '?'}): {norms[r]}" for r in odd)
        raise CheckFailed(
            f"gradient norms disagree after the first step ({who}; others {norms[0]}): ranks are out of sync"
        )
    lines = [f"check: gradient norm after the first step agrees on all ranks ({norms[0]})"]
    return lines + _same_weights(engine, world_size, hosts, "after the first step")
