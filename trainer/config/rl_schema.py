"""train.rl: online reinforcement learning with verifiable rewards (train.objective: grpo; docs/rl.md)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator

from trainer.config.fields import FrozenMapping, Section, choice


class RewardSpec(Section):
    """One reward function and its weight."""

    function: str = Field(
        description="a built-in (answer, format, length), model (a local reward model: options.path) or a user "
        "function 'package.module:function' called as TRL calls reward functions (prompts=, completions=, "
        "completion_ids=, trainer_state=, log_extra=, log_metric= and every other column of the rows), returning "
        "a number or None a completion; one that takes no completions is a factory, called once with the options"
    )
    weight: float = Field(1.0, description="its weight in the combined reward")
    options: FrozenMapping = Field(
        default_factory=dict,
        description="the built-in's settings (answer: column, pattern, numeric, tolerance; format: pattern; "
        "length: target, scale; model: path, batch_size); passed to a user function as keyword arguments too "
        "(a factory's: to the factory)",
    )


class RLSection(Section):
    """GRPO and its relatives (docs/rl.md: the loss types and their normalisations written out)."""

    num_generations: int = Field(8, ge=2, description="completions a prompt (G): a group")
    advantage: choice("group", "rloo") = Field(
        "group",
        description="group = GRPO's (a completion's reward minus its group's mean, scaled by scale_rewards); rloo "
        "= TRL's RLOOTrainer: the reward minus beta x the completion's summed log-ratio to the reference, minus "
        "the mean of the other completions of its group (leave-one-out), and a clipped ratio of the whole "
        "completion's log-probability, averaged over the step's completions (docs/rl.md)",
    )
    normalize_advantages: bool = Field(
        False, description="rloo: the step's advantages (every rank's) to mean 0 and std 1 (+1e-4), TRL's"
    )
    reward_clip_range: tuple[float, float] | None = Field(
        None,
        description="rloo: each completion's combined reward clipped to [min, max] before the KL (TRL's)",
    )
    loss_type: choice("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo") = Field(
        "dapo",
        description="dapo = tokens of the step; grpo = each completion's token mean, then over completions; "
        "dr_grpo = over completions x max_new_tokens; bnpo = each micro batch's token mean (TRL's); cispo = "
        "the clipped ratio as a weight of logp (MiniMax-M1; epsilon_high is its cap); sapo = a soft gate "
        "instead of the clip; luspo = each completion's token sum, over completions (with "
        "importance_sampling_level: sequence); vespo = a gamma weight of the sequence's ratio (docs/rl.md)",
    )
    importance_sampling_level: choice("token", "sequence") = Field(
        "token", description="the ratio a token's (token) or the completion's mean log-ratio (sequence: GSPO)"
    )
    multi_objective_aggregation: choice("sum_then_normalize", "normalize_then_sum") = Field(
        "sum_then_normalize",
        description="sum the weighted rewards, then normalise by scale_rewards; or normalise each function's "
        "within its group, sum them weighted, and normalise the sums over the step (GDPO; scale_rewards unused)",
    )
    scale_rewards: choice("group", "batch", "none") = Field(
        "group",
        description="advantages over the group's reward std, the step's (every rank), or not scaled; true and false "
        "are group and none (TRL's GRPOConfig maps them so)",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_scale_rewards(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

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
        None, gt=0.0, description="the ratio's clip above 1 (DAPO's clip-higher); cispo: the ratio's cap"
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="the KL term times the ratio (DeepSeek-V3.2; TRL's default): its gradient the "
        "unbiased reverse KL's, also where the ratio is 1",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="the policy term on the tokens at or above this top quantile of "
        "entropy only (0.2: the top 20%; 1 = every token), of a micro batch's tokens over every rank as TRL's",
    )
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="sapo: the gate's temperature where A > 0")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="sapo: the gate's temperature where A <= 0")
    vespo_k_pos: float = Field(2.0, ge=0.0, description="vespo: the power k of the weight where A >= 0")
    vespo_lambda_pos: float = Field(
        3.0, gt=0.0, description="vespo: the decay lambda of the weight where A >= 0"
    )
    vespo_k_neg: float = Field(3.0, ge=0.0, description="vespo: the power k of the weight where A < 0")
    vespo_lambda_neg: float = Field(
        2.0, gt=0.0, description="vespo: the decay lambda of the weight where A < 0"
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
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="min-p sampling: tokens under min_p x the likeliest's probability "
        "dropped (null = off); as top_p and top_k, the loss's log-probs are of logits / temperature (TRL's)",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description="refused unless 1: the loss's log-probs would not be of the distribution sampled "
        "(docs/rl.md)",
    )
    max_new_tokens: int = Field(64, ge=1, description="a completion's longest (truncated there)")
    stop_at_end_of_turn: bool = Field(
        True,
        description="chat prompts: a completion also ends at the chat template's end-of-turn token where it is not "
        "an EOS id (a base model's ChatML <|im_end|>); false = TRL's: at the tokenizer's and the generation "
        "config's EOS ids only (it generates past the turn's end)",
    )
    generation_batch: int | None = Field(
        None,
        ge=1,
        description="prompts a generate call samples together, G completions each; null = all of a rank's "
        "prompts of the step (the fewest decode passes); lower it where their key/value cache does not fit. "
        "On CPU in fp32 the completions do not depend on it (docs/rl.md)",
    )
    generation_cache: choice("dynamic", "static") = Field(
        "dynamic",
        description="the key/value cache of generation: dynamic (grows a token at a time) or static (made at "
        "its full length once, so that on a GPU transformers compiles the decode step and replays it as a CUDA "
        "graph: the launches of a decode step paid once); the same completions on CPU in fp32. ZeRO 0-2 "
        "(at ZeRO-3 the weights are gathered for each forward)",
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
    log_completions: int = Field(
        0,
        ge=0,
        description="at every log step, N of the last generation's prompts, completions and rewards "
        "to <run_dir>/completions.jsonl (and a wandb table); 0 = none",
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
    out += rloo_problems(rl)
    if rl.beta > 0 and exp.model.lora is None:
        out.append(("train.rl.beta", "a KL penalty without LoRA needs a second copy of the weights as the reference, "
                    "which is not supported yet; use LoRA (the reference is the model with its adapters off) or "
                    "beta: 0"))  # fmt: skip
    if t.eval_every:
        out.append(
            ("train.eval_every", "grpo has no eval loss (its metrics are the step's rewards); set it to 0")
        )
    if len(d.sources) > 1:  # (the data cache's mixture path renders its rows as conversations: a traceback)
        out.append(("data.train", "a mixture of prompt sources is not built for grpo; give one source"))
    if d.eval is not None or (d.eval_fraction > 0 and "eval_fraction" in d.model_fields_set):
        out.append(("data.eval", "grpo holds no prompts out for an eval loss (its metrics are the step's rewards); "
                    "remove data.eval and data.eval_fraction"))  # fmt: skip
    if exp.model.chunked_loss is True:
        out.append(("model.chunked_loss", "grpo takes each completion token's log-prob from the whole logits, which "
                    "the tiled loss does not give; set it to false or auto"))  # fmt: skip
    if rl.repetition_penalty != 1.0:
        out.append(("train.rl.repetition_penalty", "a repetition penalty reshapes the distribution sampled by each "
                    "completion's history, while the loss takes its log-probs from softmax(logits / temperature) "
                    "(TRL samples with it and computes them without it); exact log-probs would need the history "
                    "over the vocabulary at every trained token, not planned; remove it (1.0)"))  # fmt: skip
    if (
        rl.multi_objective_aggregation == "normalize_then_sum" and rl.scale_rewards != "group"
    ):  # (not the default)
        out.append(("train.rl.scale_rewards", "normalize_then_sum normalises each reward function within its group "
                    "and the sums over the step, whatever scale_rewards says (as TRL's); remove scale_rewards or "
                    "use sum_then_normalize"))  # fmt: skip
    for i, r in enumerate(rl.rewards):
        if not math.isfinite(r.weight):
            out.append((f"train.rl.rewards[{i}].weight", f"{r.weight}: give a finite number (the weight of its "
                        "values in each completion's reward; 0 logs the function without training on it)"))  # fmt: skip
    models = [i for i, r in enumerate(rl.rewards) if r.function == "model"]
    for i in models:
        path = rl.rewards[i].options.get("path")
        if not isinstance(path, str) or not path:
            out.append((f"train.rl.rewards[{i}].options.path", "function: model needs options.path: the directory "
                        "of a sequence-classification model and its tokenizer (save_pretrained's)"))  # fmt: skip
        bs = rl.rewards[i].options.get("batch_size", 8)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            out.append((f"train.rl.rewards[{i}].options.batch_size", f"{bs!r}: give a whole number >= 1 (completions "
                        "the reward model scores a forward)"))  # fmt: skip
        extra = set(rl.rewards[i].options) - {"path", "batch_size"}
        if extra:
            out.append((f"train.rl.rewards[{i}].options", f"function: model takes path and batch_size, not "
                        f"{', '.join(sorted(extra))}"))  # fmt: skip
    if t.micro_batch_size == "auto":
        out.append(("train.micro_batch_size", "auto is not available for grpo yet (the completions' lengths are "
                    "only known once generated); give the number of completions a micro step"))  # fmt: skip
    return out


def rl_warnings(exp: Any) -> list[str]:
    """Legal grpo settings that are probably not meant (TRL warns of the same)."""
    rl = exp.train.rl
    out = []
    if exp.train.objective != "grpo":
        return out
    if rl.loss_type == "cispo" and rl.epsilon_high is None:
        out.append(f"train.rl.loss_type cispo caps the ratio at epsilon_high, unset: epsilon {rl.epsilon:g} (TRL's); "
                   "MiniMax-M1 and ScaleRL use epsilon_high: 5.0")  # fmt: skip
    if rl.loss_type == "luspo" and rl.importance_sampling_level != "sequence":
        out.append("train.rl.loss_type luspo is a sequence-level loss: set importance_sampling_level: sequence as "
                   "its paper does")  # fmt: skip
    if rl.loss_type == "vespo" and rl.importance_sampling_level != "token":
        out.append("train.rl.loss_type vespo weighs the sequence's ratio itself: importance_sampling_level should "
                   "be token")  # fmt: skip
    if rl.importance_sampling_level == "sequence" and rl.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        out.append(f"train.rl.importance_sampling_level sequence with loss_type {rl.loss_type}: the per-token sum "
                   "weighs each completion by its length; GSPO's setup is loss_type: grpo")  # fmt: skip
    return out


def static_generation(exp: Any) -> bool:
    """GRPO sampling with a static key/value cache (on a GPU a compiled, graphed decode step): the weights
    must stay in place, ZeRO 0-2 (config/rules.py refuses a pinned stage 3, the planner the stage-3 rungs)."""
    return exp.train.objective == "grpo" and exp.train.rl.generation_cache == "static"


# the keys of GRPO's loss and advantages that RLOO (TRL's RLOOTrainer) does not have
NOT_RLOO = ("loss_type", "importance_sampling_level", "multi_objective_aggregation", "scale_rewards",
            "use_bias_correction_kl", "top_entropy_quantile", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
            "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "dynamic_sampling")  # fmt: skip


def rloo_problems(rl: Any) -> list[tuple[str, str]]:
    """advantage: rloo takes TRL's RLOOTrainer's keys only; its own keys need it."""
    out: list[tuple[str, str]] = []
    default = RLSection()  # (a key as written, or as a saved experiment holds it: its default is no key)
    if rl.advantage != "rloo":
        for k in ("normalize_advantages", "reward_clip_range"):
            if getattr(rl, k) != getattr(default, k):
                out.append(
                    (
                        f"train.rl.{k}",
                        "is RLOO's (TRL's RLOOTrainer): set train.rl.advantage: rloo, or remove it",
                    )
                )
        return out
    for k in NOT_RLOO:
        if getattr(rl, k) != getattr(default, k):
            out.append((f"train.rl.{k}", "advantage: rloo is TRL's RLOOTrainer: a leave-one-out baseline and a clipped "
                        "ratio of each whole completion, with the KL in the reward; it has no such key (GRPO's: "
                        f"advantage: group); remove it (or leave it at its default, {getattr(default, k)!r})"))  # fmt: skip
    clip = rl.reward_clip_range
    if clip is not None and not (math.isfinite(clip[0]) and math.isfinite(clip[1]) and clip[0] < clip[1]):
        out.append(
            ("train.rl.reward_clip_range", f"{list(clip)}: give [min, max], two finite numbers, min < max")
        )
    return out
