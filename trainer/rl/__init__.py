"""Online reinforcement learning with verifiable rewards (train.objective: grpo; docs/rl.md): the rewards
(`rewards.py`, `answers.py`, `reward_model.py`), generation from the trained weights (`generate.py`, the seam
an inference engine would implement), the stream of a run's rollouts (`rollout.py`) and the completions log
(`completions.py`); the loss is an objective (trainer/objectives/grpo.py). `prepare` wires them to the engine
once it exists."""

from __future__ import annotations

from typing import Any


def prepare(
    exp: Any, env: Any, engine: Any, data: Any, stream: Any, mets: Any = None, state: Any = None
) -> list[str]:
    """The run's rewards (imported now: an error stops it before training), its sampler and objective, wired
    to the stream; the banner's lines."""
    from trainer.rl.generate import ModelSampler, Sampling, pad_id, stop_tokens

    rl, tok = exp.train.rl, data.tokenizer
    objective = engine.objective
    objective.world, objective.engine, objective.device = env.world_size, engine, engine.device
    rewards = load_rewards(exp, engine)
    eot = ""
    if (data.finetune or {}).get(
        "chat"
    ) and rl.stop_at_end_of_turn:  # chat prompts' answers end at the turn's end
        from trainer.data.examples import chat_profile

        eot = chat_profile(exp.data, tok).eot
    module = engine.ds.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    stop = stop_tokens(tok, eot, getattr(base, "generation_config", None))
    sampling = Sampling(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                        top_k=rl.top_k, min_p=rl.min_p, stop=stop, pad=pad_id(tok), width=stream.longest + 1)  # fmt: skip
    # (width: the data's longest prompt and one more, so that every row of every call is padded: transformers
    # drops an attention mask of ones, and its attention would then take another path for some calls)
    stage3 = engine.ds.zero_optimization_stage() == 3
    synced = env.world_size > 1 and stage3
    if rl.generation_cache == "static" and stage3:
        from trainer.common.errors import UserError

        raise UserError(
            "train.rl.generation_cache: static needs the weights in place, at ZeRO 0-2: at ZeRO-3 each layer is "
            "gathered for every forward (a compiled, graphed decode step would hold the gathered weights); use "
            "train.rl.generation_cache: dynamic, or strategy.zero_stage: 2"
        )
    prompts = rl.generation_batch or stream.per_rank  # a generate call's
    sampler = ModelSampler(
        engine, sampling, synced, batch=prompts * rl.num_generations, cache=rl.generation_cache
    )
    stream.attach(sampler, objective, rewards)
    stream.steps_done = (lambda: state.step) if state is not None else (lambda: 0)
    stream.max_steps, stream.log_metric = exp.train.max_steps, objective.metrics.log_metric
    if mets is not None:  # the names a reward's log_metric may not take: every field of the run's record
        objective.metrics.reserved |= set(mets.tags)  # (recorder.FIELDS and GRPO's own already)
    if rl.log_completions:
        from trainer.rl.completions import CompletionLog

        wandb = next((s for s in (mets.sinks if mets is not None else []) if hasattr(s, "table")), None)
        objective.metrics.completions = CompletionLog(
            exp.run_dir, rl.log_completions, env.rank == 0, step=stream.steps_done, prompt_of=stream.columns_prompt,
            group=rl.num_generations, wandb=wandb,
        )  # fmt: skip
    names = ", ".join(f"{r.name} x {r.weight:g}" for r in rewards)
    stops = ", ".join(repr(tok.decode([t])) for t in sampling.stop) or "none"
    min_p = f", min_p {rl.min_p:g}" if rl.min_p is not None else ""
    kept = len(stream.prompts)
    long = (f"; {stream.left_out:,} of {kept + stream.left_out:,} prompts left out: longer than data.seq_len "
            f"{exp.data.seq_len} - max_new_tokens {rl.max_new_tokens} (TRL keeps them: raise data.seq_len to)"
            if stream.left_out else "")  # fmt: skip
    return [
        f"objective: {objective.describe()}; rewards: {names}{long}",
        optimizer_line(exp.optim),
        f"generation: {stream.per_rank} prompt(s) x {rl.num_generations} completions a rank a step, "
        f"{min(prompts, stream.per_rank)} prompt(s) a generate call, at most "
        f"{rl.max_new_tokens} new tokens (temperature {rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k or 'off'}"
        f"{min_p}), stopping at {stops}; {rl.generation_cache} cache; from the trained weights ({'ZeRO-3 gathered, ranks in step' if synced else 'in place'})",
    ]


def optimizer_line(o: Any) -> str:
    """The banner's optimizer line (a script ported from TRL leaves the rate at GRPOConfig's 1e-6: here it is
    optim.lr's, docs/rl.md's table)."""
    return (f"optimizer: AdamW, lr {o.lr:.0e} (peak), betas ({o.betas[0]:g}, {o.betas[1]:g}), {o.schedule} schedule, "
            f"{o.warmup_steps} warmup steps (TRL's GRPOConfig: 1e-06, betas (0.9, 0.999), linear: optim.lr, "
            "optim.betas, optim.schedule)")  # fmt: skip


def load_rewards(exp: Any, engine: Any) -> list[Any]:
    """train.rl.rewards, a reward model (function: model) on the run's device in its precision."""
    from trainer.rl.rewards import load

    def model(i: int, options: dict[str, Any]) -> Any:
        import torch

        from trainer.rl.reward_model import RewardModel

        params = engine.ds.module.parameters()  # the run's compute precision (the policy's floating weights)
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        return RewardModel(options["path"], device=engine.device, dtype=dtype, batch_size=options.get("batch_size", 8),
                           template_kwargs=exp.data.chat_template_kwargs, key=f"train.rl.rewards[{i}]")  # fmt: skip

    return load(exp.train.rl.rewards, model)
