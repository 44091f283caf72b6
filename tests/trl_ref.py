"""TRL's GRPOTrainer (1.16) as a reference the GRPO tests call: an instance made without its __init__ (no
model, data or accelerator to set up), its attributes set from a GRPOConfig's defaults (TRL's dataclass
read, not copied) and the test's overrides, as its __init__ sets them; its own methods then run:
`_compute_loss` (its model's forward replaced by the given per-token log-probs and entropies),
`_calculate_rewards`, and `_generate_and_score_completions` (generation replaced by the given completions,
the rewards by the given values), on one process."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import types
from typing import Any

import torch
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer


def config_defaults() -> dict[str, Any]:
    """GRPOConfig's defaults (its fields with a plain default)."""
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


class Accelerator:
    """One process: gather, reduce and pad are the identity."""

    num_processes, process_index, is_main_process, sync_gradients = 1, 0, True, True
    device = torch.device("cpu")

    def gather(self, x: Any) -> Any:
        return x

    gather_for_metrics = gather

    def reduce(self, x: Any, reduction: str = "sum") -> Any:
        return x

    def pad_across_processes(self, x: Any, dim: int = 0, pad_index: Any = 0) -> Any:
        return x


def trainer(**over: Any) -> Any:
    """A GRPOTrainer at GRPOConfig's defaults but `over`, its attributes as __init__ sets them from its args."""
    args = types.SimpleNamespace(**{**config_defaults(), "steps_per_generation": 1, "gradient_accumulation_steps": 1,
                                    "device": torch.device("cpu"), "past_index": -1, **over})  # fmt: skip
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = args
    for name in ("loss_type", "beta", "num_generations", "scale_rewards", "importance_sampling_level",
                 "top_entropy_quantile", "multi_objective_aggregation", "mask_truncated_completions",
                 "off_policy_mask_threshold", "num_iterations", "temperature", "use_vllm",
                 "vllm_importance_sampling_correction", "log_completions"):  # fmt: skip
        setattr(t, name, getattr(args, name))
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.max_completion_length = args.max_completion_length
    t.accelerator = Accelerator()
    t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.current_gradient_accumulation_steps = 1
    t.aux_loss_enabled, t._entropy_bonus_enabled = False, False
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t._pending_extra_logs, t._pending_metrics = collections.defaultdict(list), collections.defaultdict(list)
    t.environments, t.environment_factories, t.tools, t.rollout_func = None, None, None, None
    t.chat_template_kwargs = {}
    t.is_deepspeed_enabled = False
    t._past = None
    return t


def compute_loss(logps: Any, mask: Any, adv: Any, old: Any = None, ref: Any = None, entropies: Any = None,
                 **over: Any) -> tuple[Any, dict[str, list[float]]]:  # fmt: skip
    """TRL's `_compute_loss` on one micro batch of one process (fp64), and the metrics it logged."""
    t = trainer(**over)
    B, T = logps.shape
    ent = entropies if entropies is not None else torch.zeros_like(logps)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, ent, None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "num_items_in_batch": mask.sum()}  # fmt: skip
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(t, None, inputs), dict(t._metrics["train"])


_loop: asyncio.AbstractEventLoop | None = None


def async_loop() -> asyncio.AbstractEventLoop:
    """An event loop in a thread, as GRPOTrainer's __init__ starts one for async reward functions."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, daemon=True).start()
    return _loop


def calculate_rewards(funcs: list[Any], inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any],
                      completion_ids: list[list[int]], *, processing_classes: list[Any] | None = None,
                      state: Any = None, **over: Any) -> tuple[Any, Any]:  # fmt: skip
    """TRL's `_calculate_rewards`: (completions, functions) rewards, and the trainer (its pending logs)."""
    from trl.trainer.utils import get_config_model_id

    t = trainer(**over)
    t.reward_funcs = funcs
    t.reward_processing_classes = processing_classes or [None] * len(funcs)
    t.reward_func_names = [get_config_model_id(f.config).split("/")[-1] if isinstance(f, torch.nn.Module)
                           else getattr(f, "__name__", type(f).__name__) for f in funcs]  # fmt: skip
    t.state = state if state is not None else types.SimpleNamespace(global_step=0, epoch=0.0)
    t.async_loop = async_loop()
    return t._calculate_rewards(inputs, prompts, completions, completion_ids), t


def scoring(t: Any, per_function: Any, weights: list[float]) -> None:
    """What `_generate_and_score_completions` reads of a trainer (GRPO's or RLOO's) beside its generation:
    the reward functions (their values given), the tokenizer's pad and EOS ids (0 and 1), the state and logs."""
    t.reward_funcs = [None] * per_function.shape[1]
    t.reward_func_names = [f"f{i}" for i in range(per_function.shape[1])]
    t.reward_weights = torch.tensor(weights, dtype=torch.float32)
    t._tokenizer = types.SimpleNamespace(pad_token_id=0)
    t.processing_class = t._tokenizer
    t.eos_token_ids = [1]
    t.num_generations_eval = t.num_generations
    t.state = types.SimpleNamespace(num_input_tokens_seen=0, global_step=0)
    t._logs = {"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
               "extra": collections.defaultdict(list), "images": []}  # fmt: skip


def generate_and_score(rows: list[dict[str, Any]], completions: list[str], per_function: Any, weights: list[float],
                       **over: Any) -> tuple[dict[str, Any], dict[str, list[float]]]:  # fmt: skip
    """TRL's `_generate_and_score_completions` on `rows` (each repeated G times, as its sampler gives them) with
    its generation replaced by `completions` (text prompts, one token a completion) and its rewards by
    `per_function` (completions, functions): its output (advantages) and its metrics."""
    t = trainer(**over)
    n = len(rows)
    scoring(t, per_function, weights)
    t.pad_to_multiple_of = None
    t._generate = lambda prompts: ([[2]] * n, [[3, 1]] * n, None, list(completions), None, {}, None, [])
    t._calculate_rewards = lambda *a: per_function.to(torch.float32)
    out = t._generate_and_score_completions(rows)
    return out, dict(t._metrics["train"])


def rloo_trainer(**over: Any) -> Any:
    """TRL's RLOOTrainer at RLOOConfig's defaults but `over`, its attributes as its __init__ sets them."""
    from trl import RLOOConfig
    from trl.trainer.rloo_trainer import RLOOTrainer

    defaults = {
        f.name: f.default for f in dataclasses.fields(RLOOConfig) if f.default is not dataclasses.MISSING
    }
    args = types.SimpleNamespace(**{**defaults, "steps_per_generation": 1, "gradient_accumulation_steps": 1,
                                    "device": torch.device("cpu"), "past_index": -1, "per_device_train_batch_size": 8,
                                    **over})  # fmt: skip
    t = RLOOTrainer.__new__(RLOOTrainer)
    t.args = args
    for name in ("beta", "num_generations", "normalize_advantages", "reward_clip_range", "mask_truncated_completions",
                 "num_iterations", "temperature", "use_vllm", "log_completions"):  # fmt: skip
        setattr(t, name, getattr(args, name))
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.accelerator = Accelerator()
    t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.ref_model = types.SimpleNamespace(training=False)
    t.aux_loss_enabled = False
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t._pending_extra_logs, t._pending_metrics = collections.defaultdict(list), collections.defaultdict(list)
    t.chat_template_kwargs = {}
    t.log_multimodal = False
    t.pad_to_multiple_of = None
    return t


def rloo_generate_and_score(completion_ids: list[list[int]], per_function: Any, weights: list[float], old: Any,
                            ref: Any, **over: Any) -> tuple[dict[str, Any], dict[str, list[float]]]:  # fmt: skip
    """TRL's RLOOTrainer `_generate_and_score_completions` with its generation replaced by `completion_ids` (EOS
    id 1; a completion not ending in it was truncated), its rewards by `per_function` (completions, functions)
    and the policy's and the reference's per-token log-probs by `old` and `ref`: its output and its metrics."""
    t = rloo_trainer(**over)
    n = len(completion_ids)
    scoring(t, per_function, weights)
    t._generate = lambda prompts: ([[2]] * n, completion_ids, ["c"] * n)
    t._get_per_token_logps_and_entropies = lambda model, *a, **k: (
        old if model is t.model else ref,
        None,
        None,
    )
    t._calculate_rewards = lambda *a: per_function.to(torch.float32)
    out = t._generate_and_score_completions([{"prompt": f"p{i}"} for i in range(n)])
    return out, dict(t._metrics["train"])


def rloo_compute_loss(logps: Any, mask: Any, adv: Any, old_logps: Any, **over: Any) -> Any:
    """TRL's RLOOTrainer `_compute_loss` on one micro batch of one process (its forward replaced by `logps`)."""
    from trl.trainer.rloo_trainer import RLOOTrainer

    t = rloo_trainer(**over)
    B, T = logps.shape
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_logps": old_logps}  # fmt: skip
    return RLOOTrainer._compute_loss(t, None, inputs)
