"""Online reinforcement learning with verifiable rewards (train.objective: grpo; docs/rl.md): the rewards
(`rewards.py`), generation from the trained weights (`generate.py`, the seam an inference engine would
implement) and the stream of a run's rollouts (`rollout.py`); the loss is an objective
(trainer/objectives/grpo.py). `prepare` wires them to the engine once it exists."""

from __future__ import annotations

from typing import Any


def prepare(exp: Any, env: Any, engine: Any, data: Any, stream: Any) -> list[str]:
    """The run's rewards (imported now: an error stops it before training), its sampler and objective, wired
    to the stream; the banner's lines."""
    from trainer.rl.generate import ModelSampler, Sampling, stop_tokens
    from trainer.rl.rewards import load

    rl, tok = exp.train.rl, data.tokenizer
    rewards = load(rl.rewards)
    objective = engine.objective
    objective.world, objective.engine, objective.device = env.world_size, engine, engine.device
    eot = ""
    if (data.finetune or {}).get("chat"):  # prompts of chat messages: their answers end at the turn's end
        from trainer.data.examples import chat_profile

        eot = chat_profile(exp.data, tok).eot
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    sampling = Sampling(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                        top_k=rl.top_k, stop=stop_tokens(tok, eot), pad=int(pad), width=stream.longest + 1)  # fmt: skip
    # (width: the data's longest prompt and one more, so that every row of every call is padded: transformers
    # drops an attention mask of ones, and its attention would then take another path for some calls)
    synced = env.world_size > 1 and engine.ds.zero_optimization_stage() == 3
    prompts = rl.generation_batch or stream.per_rank  # a generate call's
    stream.attach(
        ModelSampler(engine, sampling, synced, batch=prompts * rl.num_generations), objective, rewards
    )
    names = ", ".join(f"{r.name} x {r.weight:g}" for r in rewards)
    stops = ", ".join(tok.decode([t]) for t in sampling.stop) or "none"
    return [
        f"objective: {objective.describe()}; rewards: {names}",
        f"generation: {stream.per_rank} prompt(s) x {rl.num_generations} completions a rank a step, "
        f"{min(prompts, stream.per_rank)} prompt(s) a generate call, at most "
        f"{rl.max_new_tokens} new tokens (temperature {rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k or 'off'}), "
        f"stopping at {stops}; from the trained weights ({'ZeRO-3 gathered, ranks in step' if synced else 'in place'})",
    ]
