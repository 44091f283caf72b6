"""Stage-0 optimizer state in every layout DeepSpeed writes, converted to the universal format and
back into any other layout (trainer/checkpoint/stage0.py, trainer/checkpoint/reshard.py).

The fp16/bf16 states come from DeepSpeed's own wrappers, FP16_Optimizer (flat fp32 masters, the GPU
layout with FusedAdam) and FP16_UnfusedOptimizer (per-parameter masters), run for a few steps on CPU
around torch's AdamW, in this process (a one-rank gloo group: the wrappers ask for the rank). fp16
training itself cannot run here (DeepSpeed's CPU engine refuses it), but its saved layouts can.
"""

import copy

import pytest
import torch

from trainer.checkpoint import reshard, stage0, universal

WRAPPERS = {"fused": "FP16_Optimizer", "unfused": "FP16_UnfusedOptimizer"}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A one-rank gloo group for the wrappers, in this process; the environment it needs (RANK,
    MASTER_PORT...) is put back afterwards: the jobs other tests start inherit this process's."""
    import os

    import deepspeed
    import torch.distributed as tdist

    from trainer.cluster.dist import free_port, skip_inference_shm_op

    saved = dict(os.environ)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    skip_inference_shm_op()
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


class Tiny(torch.nn.Module):
    """Two groups (decay / no decay) and a tied weight, like a causal LM."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.fc = torch.nn.Linear(4, 5)
        self.out = torch.nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.emb(x))[..., :4])).float().pow(2).mean()


def make(kind: str, dtype=torch.float16, seed=0):
    """A model, its param groups and a trained optimizer of `kind` (torch | fused | unfused)."""
    torch.manual_seed(seed)
    model = Tiny().to(dtype if kind != "torch" else torch.float32)
    groups = [
        {"params": [model.emb.weight, model.fc.weight], "weight_decay": 0.1},
        {"params": [model.fc.bias], "weight_decay": 0.0},
    ]
    layout = reshard.names_and_aliases(model, groups)
    inner = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    if kind == "torch":
        opt = inner
    else:
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        cls = FP16_Optimizer if kind == "fused" else FP16_UnfusedOptimizer
        opt = cls(inner, dynamic_loss_scale=dtype == torch.float16, clip_grad=1.0,
                  dynamic_loss_args={"init_scale": 2**8, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
                                     "consecutive_hysteresis": False})  # fmt: skip
    return model, opt, layout


def train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randint(0, 7, (3, 5), generator=g))
        if hasattr(opt, "backward"):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()


def masters(model, opt, layout):
    """name -> (fp32 master, exp_avg, exp_avg_sq) as the live optimizer holds them."""
    names, _ = layout
    sd = copy.deepcopy(opt.state_dict())
    module = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params, _ = stage0.read(sd, module, names)
    return {n: (p.fp32, p.state["exp_avg"], p.state["exp_avg_sq"], p.step) for n, p in params.items()}


@pytest.mark.parametrize(("kind", "dtype"), [("fused", torch.float16), ("unfused", torch.float16),
                                             ("unfused", torch.bfloat16), ("fused", torch.bfloat16)])  # fmt: skip
def test_read_gives_the_wrappers_fp32_masters_and_moments(kind, dtype):
    model, opt, layout = make(kind, dtype)
    train(model, opt, 3)
    sd = opt.state_dict()
    assert stage0.kind_of(sd) == kind and stage0.live_kind(opt) == kind
    got = masters(model, opt, layout)
    inner = opt.optimizer  # torch AdamW over the wrapper's fp32 masters
    if kind == "unfused":
        live = {n: opt.fp32_groups[g][i] for g, grp in enumerate(layout[0]) for i, n in enumerate(grp)}
    else:
        live = {}
        for g, grp in enumerate(layout[0]):
            flat, off = opt.fp32_groups_flat[g], 0
            for n in grp:
                k = model.state_dict()[n].numel()
                live[n] = flat[off : off + k]
                off += k
    for name, (fp32, m, v, step) in got.items():
        assert fp32.dtype == torch.float32 and torch.equal(fp32.reshape(-1), live[name].reshape(-1))
        # the module holds the masters rounded to the low precision
        assert torch.equal(fp32.to(dtype), model.state_dict()[name])
        assert m.abs().sum() > 0 and v.abs().sum() > 0 and step == 3 + 1  # + the wrapper's initial zero step
    assert len(inner.state) == (len(layout[0]) if kind == "fused" else sum(map(len, layout[0])))


@pytest.mark.parametrize("src", ["fused", "unfused", "torch"])
@pytest.mark.parametrize("dst", ["fused", "unfused", "torch"])
def test_any_layout_loads_into_any_other(src, dst):
    """The state of a trained `src` optimizer, rebuilt in `dst`'s layout and loaded into a fresh `dst`
    optimizer (of other initial weights), gives it the same masters, moments, step and per-group
    weight decay."""
    dtype = torch.float16
    model_a, opt_a, layout = make(src, dtype)
    train(model_a, opt_a, 3)
    saved = masters(model_a, opt_a, layout)
    params, hparams = stage0.read(copy.deepcopy(opt_a.state_dict()), model_a.state_dict(), layout[0])

    model_b, opt_b, _ = make(dst, dtype, seed=5)  # other initial weights: everything must come from the state
    osd = stage0.build(
        dst, params, layout[0], hparams, torch_states=True, fields=stage0.wrapper_fields(opt_b)
    )
    with torch.no_grad():  # the module gets the masters (rounded to its dtype), as a DeepSpeed load does
        for n, p in model_b.named_parameters():
            p.copy_(params[n].fp32)
    if dst == "torch":
        opt_b.load_state_dict(osd)
    else:
        opt_b.load_state_dict(osd, load_optimizer_states=True)
    got = masters(model_b, opt_b, layout)
    for name, (fp32, m, v, step) in saved.items():
        g = got[name]
        assert torch.equal(g[0], fp32) and torch.equal(g[1], m) and torch.equal(g[2], v) and g[3] == step, (
            name
        )
    assert [g["weight_decay"] for g in opt_b.param_groups] == [0.1, 0.0]


def test_the_universal_round_trip_on_disk(tmp_path):
    """A stage-0 bf16 checkpoint file (FP16_UnfusedOptimizer around AdamW, as DeepSpeed's CPU engine
    writes it) -> universal directory -> stage-0 checkpoints in the fused (fp16) and torch (fp32)
    layouts: the masters, moments, step and group hyperparameters survive; the module gets the fp32
    masters, tied aliases included."""
    model, opt, layout = make("unfused", torch.bfloat16)
    train(model, opt, 2)
    names, aliases = layout
    assert aliases == {"out.weight": "emb.weight"}
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    ds_config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}
    torch.save({"module": model.state_dict(), "optimizer": opt.state_dict(), "param_shapes": None,
                "ds_config": ds_config, "dp_world_size": 2, "lr_scheduler": {"last_batch_iteration": 1}},
               ckpt / "mp_rank_00_model_states.pt")  # fmt: skip
    assert reshard.saved_layout(ckpt) == (0, 2)
    saved = masters(model, opt, layout)
    uni = tmp_path / "universal"
    uni.mkdir()
    universal.stage0_to_universal(ckpt, uni, names, workers=2)
    for kind in ("fused", "torch"):
        _, live, _ = make(kind, torch.float16 if kind == "fused" else torch.float32)
        target = {"stage0": True, "kind": kind, "fields": stage0.wrapper_fields(live), "torch_states": True}
        out = tmp_path / reshard.target_tag(target)
        out.mkdir()
        universal.universal_to_stage0(uni, out, names, aliases, target, workers=2)
        sd = torch.load(out / "mp_rank_00_model_states.pt", weights_only=False)
        assert stage0.kind_of(sd["optimizer"]) == kind
        assert sd["lr_scheduler"] == {"last_batch_iteration": 1}
        params, hparams = stage0.read(sd["optimizer"], sd["module"], names)
        assert [h["weight_decay"] for h in hparams] == [0.1, 0.0]
        for name, (fp32, m, v, step) in saved.items():
            p = params[name]
            assert torch.equal(p.fp32, fp32) and torch.equal(p.state["exp_avg"], m)
            assert torch.equal(p.state["exp_avg_sq"], v)
            assert p.step == step and torch.equal(sd["module"][name], fp32)
        assert torch.equal(sd["module"]["out.weight"], saved["emb.weight"][0])
    assert reshard.target_tag({"stage0": True, "kind": "unfused", "fields": {"cur_scale": 1.0}, "torch_states": True}) != \
        reshard.target_tag({"stage0": True, "kind": "unfused", "fields": {"cur_scale": 65536}, "torch_states": True})  # fmt: skip


def test_master_weights_prefer_the_optimizers_fp32_copies():
    """Export's view of a bf16 stage-0 checkpoint: the optimizer's fp32 masters, not the module's
    bf16 copies (which are the masters rounded)."""
    model, opt, layout = make("unfused", torch.bfloat16)
    train(model, opt, 2)
    sd = {"module": model.state_dict(), "optimizer": opt.state_dict()}
    w = stage0.master_weights(sd, *layout)
    assert all(v.dtype == torch.float32 for v in w.values())
    assert torch.equal(w["fc.weight"], opt.fp32_groups[0][1]) and not torch.equal(
        w["fc.weight"], sd["module"]["fc.weight"].float()
    )
    assert torch.equal(w["out.weight"], w["emb.weight"])
    fp32_model, fp32_opt, fp32_layout = make("torch")
    plain = stage0.master_weights(
        {"module": fp32_model.state_dict(), "optimizer": fp32_opt.state_dict()}, *fp32_layout
    )
    assert torch.equal(plain["fc.weight"], fp32_model.fc.weight)


def test_an_unknown_layout_is_named():
    with pytest.raises(ValueError, match="unknown stage-0 optimizer state layout"):
        stage0.kind_of({"something": 1})
