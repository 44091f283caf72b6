"""train.distill: distillation from a teacher (train.objective: distill; docs/distillation.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from trainer.config.fields import Section, choice

# the divergence's working set (trainer/objectives/divergence.py), which the plan counts (planning/teacher.py)
CHUNK = 8192  # vocabulary entries a chunk (Llama 3's 128,256: 16 chunks)
TOKENS = 2048  # tokens a block: a chunk's fp32 logits are TOKENS x CHUNK x 4 bytes (64 MiB)


class GenerationSection(Section):
    """How the on-policy completions (train.distill.lmbda) and the teacher's (seq_kd) are sampled: GRPO's sampling
    (trainer/rl/generate.py), at train.distill.temperature (TRL's: the divergence's and the sampling's)."""

    max_new_tokens: int = Field(
        128,
        ge=1,
        description="a completion's longest (GKD's max_new_tokens 128; TRL's DistillationConfig's "
        "max_completion_length 512); a completion is also cut where its row would pass data.seq_len",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling (1 = off; TRL's top_p)")
    top_k: int = Field(
        0,
        ge=0,
        description="top-k sampling (0 = off; TRL's DistillationConfig top_k, not train.distill.top_k)",
    )
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="min-p sampling: tokens under min_p x the likeliest's probability dropped",
    )
    temperature: float | None = Field(
        None,
        ge=0.01,
        le=100.0,
        description="sampling's temperature; null = train.distill.temperature (TRL's DistillationTrainer: one for "
        "the sampling and the divergence). GKD samples at its temperature and takes the divergence at 1: set "
        "train.distill.temperature: 1 and this",
    )
    stop_at_end_of_turn: bool = Field(
        True,
        description="chat data and chat prompts: a completion also ends at the chat template's end-of-turn token "
        "where it is not an EOS id (a base model's ChatML <|im_end|>); false = TRL's (its EOS ids only)",
    )
    batch: int | None = Field(
        None,
        ge=1,
        description="prompts a generate call samples together; null = all of a rank's prompts of the step (the "
        "fewest decode passes); lower it where their key/value cache does not fit. On CPU in fp32 the completions "
        "do not depend on it",
    )


class DistillSection(Section):
    """The teacher and the divergence the student is trained on (TRL's DistillationTrainer's and GKD's names)."""

    teacher: str | None = Field(
        None,
        description="the teacher: a local directory or hub id of a causal LM with the student's vocabulary "
        "(frozen, in eval mode, no optimizer state)",
    )
    beta: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="0 = the forward KL(teacher || student), 1 = the reverse KL(student || teacher), between: the "
        "generalized Jensen-Shannon divergence with the mixture (1 - beta) p_student + beta p_teacher (TRL's; its "
        "DistillationConfig's default 1.0, GKDConfig's 0.5)",
    )
    temperature: float = Field(
        1.0,
        ge=0.01,
        le=100.0,
        description="divides both models' logits before the divergence (TRL's; no T^2 factor); 0.01 to 100",
    )
    temperature_squared: bool = Field(
        False,
        description="multiply the divergence by temperature^2 (DistillKit's and Hinton's convention; TRL has none)",
    )
    lmbda: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="the share of steps trained on the student's own completions of the data's prompts "
        "(on-policy; drawn a step from train.seed and the step's place in the data, the same on every rank and "
        "in a resumed run); 0 = the data's completions (off-policy); 1 = on-policy only (TRL's "
        "DistillationTrainer; GKD's default 0.5)",
    )
    seq_kd: bool = Field(
        False,
        description="the steps that are not on-policy train on the teacher's own completions of the data's prompts "
        "(GKD's seq_kd: sequence-level distillation) instead of the data's",
    )
    generation: GenerationSection = Field(
        default_factory=GenerationSection,
        description="the sampling of the on-policy (lmbda) and the teacher's (seq_kd) completions",
    )
    disable_dropout: bool = Field(
        True, description="turn every dropout of the student off (TRL's default); false keeps it"
    )
    quantization: choice("none", "4bit") = Field(
        "none",
        description="the teacher's linear layers in 4 bits (bitsandbytes' NF4 with double quantization, as QLoRA's "
        "base; computing in the run's precision): a whole copy a rank at every ZeRO stage, its embeddings and head "
        "in the run's precision; none = all of it in the run's precision",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="null = the teacher's whole distribution; k = its k most probable tokens a target token and the "
        "rest as train.distill.missing says (DistillKit's sparse distillation; what offline stores)",
    )
    missing: choice("zero", "uniform") = Field(
        "uniform",
        description="with top_k, the teacher's mass outside its top-k (DistillKit's missing_probability_handling): "
        "uniform = one bucket against the student's mass outside the same tokens (DistillKit's symmetric_uniform; "
        "every beta); zero = none (its top-k renormalised; DistillKit's default; beta below 1)",
    )
    offline: bool = Field(
        False,
        description="true = the teacher's top-k read from the store `bin/train EXP.yaml --prepare-teacher` wrote "
        "(no teacher in memory while training; needs top_k); false = the teacher runs beside the student",
    )
    store: str | None = Field(
        None,
        description="with offline: the stored teacher's directory (one prepared elsewhere; checked against this "
        "run's data, tokenizer, teacher, top_k and temperature); null = in the data cache",
    )


def distill_problems(exp: Any) -> list[tuple[str, str]]:
    """What a distill experiment must hold together (the config's rules call it), and train.distill set for
    another objective."""
    t, d, ds = exp.train, exp.data, exp.train.distill
    if t.objective != "distill":
        if ds != DistillSection():  # (as written; a saved experiment holds the defaults)
            return [("train.distill", f"is train.objective distill's; the objective is {t.objective}: remove it or "
                     "set train.objective: distill")]  # fmt: skip
        return []
    out: list[tuple[str, str]] = []
    if not ds.teacher:
        out.append(("train.distill.teacher", "distill needs its teacher: a local directory or hub id of a causal LM "
                    "with the student's vocabulary"))  # fmt: skip
    kinds = {s.kind for _, s in d.sources} | ({d.eval.kind} if d.eval is not None else set())
    if "preference" in kinds:
        out.append(("data.train.kind", "distill trains the student on the teacher's distribution at an answer: give "
                    "chat, prompt_completion, text or (on-policy) prompt data, not preference pairs"))  # fmt: skip
    if "prompt" in kinds and ds.lmbda < 1 and not ds.seq_kd:
        out.append(("data.train.kind", f"prompt data has no answers for the steps that are not on-policy (lmbda "
                    f"{ds.lmbda:g}): set train.distill.lmbda: 1 (every step on the student's own answers, TRL's "
                    "DistillationTrainer) or seq_kd: true (the teacher's), or give chat or prompt_completion data"))  # fmt: skip
    out += _generated(exp, kinds)
    if ds.offline and ds.top_k is None:
        out.append(("train.distill.offline", "the store holds the teacher's top-k a token: set train.distill.top_k "
                    "(32 keeps 256 bytes a target token) or offline: false"))  # fmt: skip
    if ds.store and not ds.offline:
        out.append(
            ("train.distill.store", "is where offline reads the teacher from: set offline: true or remove it")
        )
    if ds.top_k is not None and ds.missing == "zero" and ds.beta == 1:
        out.append(("train.distill.missing", "zero gives the teacher no mass outside its top-k, where the student has "
                    "some: the reverse KL (beta 1) is infinite there; set missing: uniform or beta below 1"))  # fmt: skip
    if exp.model.chunked_loss is True:
        out.append(("model.chunked_loss", "distill computes its own divergence a vocabulary chunk at a time (no "
                    "whole logits); set it to auto or false"))  # fmt: skip
    if exp.strategy.sequence_parallel not in ("auto", 1):
        out.append(("strategy.sequence_parallel", "distill with sequence parallelism is not verified yet; set it to 1 "
                    "or auto"))  # fmt: skip
    if exp.model.kernels == "liger":
        out.append(
            ("model.kernels", "liger's fused loss is not the divergence distill trains on; set it to none")
        )
    return out


def _generated(exp: Any, kinds: set[str]) -> list[tuple[str, str]]:
    """What on-policy steps (lmbda > 0) and the teacher's completions (seq_kd) need: prompts in the data, a teacher
    that runs, and the levers generation is verified with."""
    ds, key = (
        exp.train.distill,
        "train.distill.lmbda" if exp.train.distill.lmbda > 0 else "train.distill.seq_kd",
    )
    if ds.lmbda == 0 and not ds.seq_kd:
        if ds.generation != GenerationSection():
            return [("train.distill.generation", "samples the on-policy (lmbda > 0) and the teacher's (seq_kd) "
                     "completions, and neither is asked for: remove it or set lmbda or seq_kd")]  # fmt: skip
        return []
    what = f"{key} ({ds.lmbda if key.endswith('lmbda') else 'true'})"
    out: list[tuple[str, str]] = []
    if ds.lmbda == 1 and ds.seq_kd:
        out.append(("train.distill.seq_kd", "does nothing at lmbda 1 (every step is on the student's completions): "
                    "set it false, or lmbda below 1"))  # fmt: skip
    if "prompt" in kinds:
        out += _prompt_only(exp)
    if exp.data.train_on_prompt:
        out.append(("data.train_on_prompt", f"{what} samples each example's answer from what comes before it, and "
                    "with train_on_prompt every token but the first is a target (no prompt is left): set it false"))  # fmt: skip
    if "text" in kinds:
        out.append(("data.train.kind", f"{what} completes the data's prompts: give chat or prompt_completion data "
                    "(a block of text has no prompt)"))  # fmt: skip
    if ds.offline:
        out.append(("train.distill.offline", f"{what}: the store holds the teacher at the data's completions only, "
                    "and the generated ones are new each step; set offline: false, or lmbda 0 and seq_kd false"))  # fmt: skip
    s = exp.strategy
    levers = [n for n, on in (("strategy.tensor_parallel", s.tensor_parallel not in ("auto", 1)),
                              ("strategy.pipeline_stages", s.pipeline_stages not in ("auto", 1)),
                              ("train.compile", exp.train.compile)) if on]  # fmt: skip
    if levers:
        out.append((levers[0], f"{what}: generation with it is not verified; set it off (or lmbda 0 and seq_kd "
                    "false)"))  # fmt: skip
    return out


def _prompt_only(exp: Any) -> list[tuple[str, str]]:
    """Prompt-only data (on-policy): no answers for an eval loss, one source (a mixture of prompt sources is not
    built)."""
    t, d = exp.train, exp.data
    out = []
    if t.eval_every:
        out.append(("train.eval_every", "prompt data has no answers to take an eval divergence at; set it to 0, or "
                    "give chat or prompt_completion data"))  # fmt: skip
    if d.eval is not None or (d.eval_fraction > 0 and "eval_fraction" in d.model_fields_set):
        out.append(("data.eval", "distill over prompt data holds no prompts out for an eval loss; remove data.eval "
                    "and data.eval_fraction"))  # fmt: skip
    if t.eval_prompts:
        out.append(
            ("train.eval_prompts", "distill over prompt data has no evaluator to sample them; set it to []")
        )
    if len(d.sources) > 1:
        out.append(("data.train", "a mixture of prompt sources is not built for distill; give one source"))
    return out


def working_bytes(tokens: int, vocab: int) -> int:
    """The most the divergence holds at once beside its inputs for `tokens` tokens over `vocab` entries: a block's
    chunk of both models' logits and what is made of them (log-probabilities, probabilities, the mixture, the
    gradient: 8 fp32 tensors of a block by a chunk)."""
    return 8 * min(TOKENS, tokens) * min(CHUNK, vocab) * 4
