"""train.rl: online reinforcement learning with verifiable rewards (train.objective: grpo; docs/rl.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from trainer.config.fields import FrozenMapping, Section, choice


class RewardSpec(Section):
    """One reward function and its weight."""

    function: str = Field(
        description="a built-in (answer, format, length) or a user function 'package.module:function' called "
        "with prompts=, completions= and every other column of the rows, returning a float or None a completion"
    )
    weight: float = Field(1.0, description="its weight in the combined reward")
    options: FrozenMapping = Field(
        default_factory=dict,
        description="the built-in's settings (answer: column, pattern, numeric, tolerance; format: pattern; "
        "length: target, scale); passed to a user function as keyword arguments too",
    )


class RLSection(Section):
    """GRPO and its relatives (docs/rl.md: the loss types and their normalisations written out)."""

    num_generations: int = Field(8, ge=2, description="completions a prompt (G): a group")
    loss_type: choice("dapo", "grpo", "bnpo", "dr_grpo") = Field(
        "dapo",
        description="dapo = tokens of the step; grpo = each completion's token mean, then over completions; "
        "dr_grpo = over completions x max_new_tokens; bnpo = each micro batch's token mean (TRL's)",
    )
    scale_rewards: choice("group", "batch", "none") = Field(
        "group", description="advantages over the group's reward std, the step's (every rank), or not scaled"
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="the KL penalty against the reference; 0 = no reference built (with LoRA the reference "
        "is the model with its adapters off)",
    )
    epsilon: float = Field(
        0.2, gt=0.0, lt=1.0, description="the ratio's clip below 1 (and above, unless epsilon_high)"
    )
    epsilon_high: float | None = Field(
        None, gt=0.0, description="the ratio's clip above 1 (DAPO's clip-higher)"
    )
    delta: float | None = Field(None, gt=1.0, description="two-sided clipping: the ratio capped at delta too")
    num_iterations: int = Field(
        1,
        ge=1,
        description="optimizer steps on each generation (its log-probs kept as the old ones when > 1)",
    )
    mask_truncated_completions: bool = Field(
        False, description="completions that hit max_new_tokens count in neither the loss nor its normaliser"
    )
    temperature: float = Field(
        1.0, gt=0.0, description="sampling's (the log-probs are of logits / temperature)"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling (1 = off)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_new_tokens: int = Field(64, ge=1, description="a completion's longest (truncated there)")
    generation_batch: int | None = Field(
        None,
        ge=1,
        description="prompts a generate call samples together, G completions each; null = all of a rank's "
        "prompts of the step (the fewest decode passes); lower it where their key/value cache does not fit. "
        "On CPU in fp32 the completions do not depend on it (docs/rl.md)",
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal (no learning signal) and refill the step with "
        "more prompts (DAPO's dynamic sampling), up to max_resamples rounds",
    )
    max_resamples: int = Field(4, ge=1, description="dynamic_sampling: rounds of generation a step at most")
    rewards: list[RewardSpec] = Field(
        default_factory=list, description="the reward functions (at least one), each with a weight"
    )

    def weights(self) -> list[float]:
        return [r.weight for r in self.rewards]


def rl_problems(exp: Any) -> list[tuple[str, str]]:
    """What a grpo experiment must hold together (the config's rules call it)."""
    t, d, rl = exp.train, exp.data, exp.train.rl
    out: list[tuple[str, str]] = []
    if t.objective != "grpo":
        return out
    kinds = {s.kind for _, s in d.sources}
    if kinds != {"prompt"}:
        out.append(("data.train.kind", "grpo generates completions of prompts: give data of kind prompt (a "
                    f"prompt column, a string or chat messages), not {', '.join(sorted(kinds - {'prompt'}))}"))  # fmt: skip
    if not rl.rewards:
        out.append(("train.rl.rewards", "grpo needs at least one reward function (a built-in: answer, format, "
                    "length; or package.module:function)"))  # fmt: skip
    micro = t.micro_batch_size
    if isinstance(micro, int) and (micro * t.grad_accum) % rl.num_generations:
        out.append(("train.rl.num_generations", f"a rank's completions a step (micro_batch_size {micro} x grad_accum "
                    f"{t.grad_accum}) must hold whole groups of {rl.num_generations}: make them a multiple"))  # fmt: skip
    if exp.strategy.sequence_parallel not in ("auto", 1):
        out.append(("strategy.sequence_parallel", "grpo with sequence parallelism is not supported (generation "
                    "runs whole sequences on each rank); set it to 1 or auto"))  # fmt: skip
    if rl.beta > 0 and exp.model.lora is None:
        out.append(("train.rl.beta", "a KL penalty without LoRA needs a second copy of the weights as the reference, "
                    "which is not supported yet; use LoRA (the reference is the model with its adapters off) or "
                    "beta: 0"))  # fmt: skip
    if t.eval_every:
        out.append(
            ("train.eval_every", "grpo has no eval loss (its metrics are the step's rewards); set it to 0")
        )
    if d.eval is not None or (d.eval_fraction > 0 and "eval_fraction" in d.model_fields_set):
        out.append(("data.eval", "grpo holds no prompts out for an eval loss (its metrics are the step's rewards); "
                    "remove data.eval and data.eval_fraction"))  # fmt: skip
    if exp.model.chunked_loss is True:
        out.append(("model.chunked_loss", "grpo takes each completion token's log-prob from the whole logits, which "
                    "the tiled loss does not give; set it to false or auto"))  # fmt: skip
    if t.micro_batch_size == "auto":
        out.append(("train.micro_batch_size", "auto is not available for grpo yet (the completions' lengths are "
                    "only known once generated); give the number of completions a micro step"))  # fmt: skip
    return out
