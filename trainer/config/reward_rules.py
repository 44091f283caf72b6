"""The rules of train.objective reward (a reward model: model.head score; docs/preference.md) and of kto, registered
with rules.py's others. Its data, chunked loss, packing and sequence parallelism are the preference objectives' rules
(rules.py: _objective); tensor and pipeline parallelism axes_rules.py's."""

from __future__ import annotations

from trainer.config.rules import contradiction
from trainer.config.schema import Experiment


@contradiction
def _reward(exp: Experiment) -> list[tuple[str, str]]:
    """A score head goes with train.objective reward, and with what it is built on."""
    m, t, out = exp.model, exp.train, []
    if t.objective != "reward":
        if m.head == "score":
            out.append(("model.head", f"score is train.objective reward's head (one number a sequence); "
                        f"{t.objective} trains the language model's: remove model.head or set train.objective: "
                        "reward"))  # fmt: skip
        for key, src in [
            *exp.data.sources,
            *([("data.eval", exp.data.eval)] if exp.data.eval is not None else []),
        ]:
            if src.margin_field != "margin":
                out.append((f"{key}.margin_field", f"is train.objective reward's (a pair's margin); {t.objective} "
                            "has no margin: remove it"))  # fmt: skip
        if t.reward != type(t.reward)():  # (as written; a saved experiment holds the defaults)
            out.append(
                ("train.reward", f"is train.objective reward's; the objective is {t.objective}: remove it")
            )
        return out
    if m.head != "score":
        out.append(("model.head", "train.objective reward trains a score head (AutoModelForSequenceClassification, "
                    "one label); remove model.head (reward sets score) or set it to score"))  # fmt: skip
    if m.factory is not None:
        out.append(("model.factory", "a reward model is a transformers model with a score head (config: or "
                    "pretrained:); a factory's module has none"))  # fmt: skip
    if m.kernels != "none":
        out.append(("model.kernels", "Liger's kernels patch the language model's head and loss, which a reward "
                    "model has not: set none"))  # fmt: skip
    if t.micro_batch_size == "auto":
        out.append(("train.micro_batch_size", "auto is not planned for a reward model yet; give the pairs a micro "
                    "step"))  # fmt: skip
    return out


@contradiction
def _kto(exp: Experiment) -> list[tuple[str, str]]:
    """train.kto goes with train.objective kto; kto's data is one source of unpaired rows, the prompt not trained."""
    t, d = exp.train, exp.data
    if t.objective != "kto":
        if t.kto != type(t.kto)():  # (as written; a saved experiment holds the defaults)
            return [("train.kto", f"is train.objective kto's; the objective is {t.objective}: remove it")]
        return []
    out = []
    if len(d.sources) > 1:
        out.append(("data.train", "kto reads one source (each row's label is kept beside it); give one file or hub "
                    "dataset, or concatenate them"))  # fmt: skip
    if d.train_on_prompt:
        out.append(("data.train_on_prompt", "kto scores a response after its prompt (each row's mismatched pair "
                    "takes another row's response from its first target); set it false"))  # fmt: skip
    return out


@contradiction
def _preference_keys(exp: Experiment) -> list[tuple[str, str]]:
    """train.preference's keys that reward and kto have no use for are refused, not ignored (as written: a saved
    experiment holds the defaults)."""
    t, owner = exp.train, {"beta": "the pair objectives", "label_smoothing": "dpo", "gamma": "simpo"}
    unused = {"reward": ("beta", "label_smoothing", "gamma"), "kto": ("label_smoothing", "gamma")}
    default = type(t.preference)()
    return [(f"train.preference.{k}", f"{t.objective} has no {k} ({owner[k]}'s); remove it")
            for k in unused.get(t.objective, ()) if getattr(t.preference, k) != getattr(default, k)]  # fmt: skip
