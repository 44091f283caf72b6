"""The preference objectives' sections of train (dpo, ipo, simpo, orpo; reward; kto): docs/preference.md."""

from __future__ import annotations

from pydantic import Field

from trainer.config.fields import Section, choice


class PreferenceSection(Section):
    """The preference objectives' settings (train.objective dpo, ipo, simpo, orpo; kto's beta and dropout)."""

    beta: float | None = Field(
        None,
        gt=0.0,
        description="the objective's temperature; null = its usual value: dpo 0.1, ipo 0.1 (the margin "
        "1 / (2 beta)), simpo 2.0, orpo 0.1 (the odds-ratio term's weight), kto 0.1",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo: the share of pairs assumed flipped (conservative DPO)"
    )
    gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin")
    disable_dropout: bool = Field(
        True,
        description="turn every dropout of the model off (as TRL's DPOConfig does by default): the reference's "
        "log-probs are computed without dropout, so a policy trained with it differs from its reference from "
        "the first step; false keeps the model's dropout in training",
    )


class RewardSection(Section):
    """train.objective reward's settings (TRL's RewardConfig's)."""

    center_rewards_coefficient: float | None = Field(
        None,
        ge=0.0,
        allow_inf_nan=False,
        description="adds this x the mean of (chosen reward + rejected reward)^2 to the loss, centring the rewards "
        "on 0 (TRL's; 0.01 recommended there); null = none",
    )


class KTOSection(Section):
    """train.objective kto's settings (TRL's KTOConfig's; its beta is train.preference.beta, 0.1 by default)."""

    loss_type: choice("kto", "apo_zero_unpaired") = Field(
        "kto",
        description="kto = 1 - sigmoid(beta (log-ratio - KL)) for a desirable response, 1 - sigmoid(beta (KL - "
        "log-ratio)) for an undesirable one, KL the reference point estimated over the step's mismatched pairs; "
        "apo_zero_unpaired = 1 - sigmoid(beta log-ratio) / sigmoid(beta log-ratio), no KL (TRL's two)",
    )
    desirable_weight: float = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="the desirable responses' losses are multiplied by this"
    )
    undesirable_weight: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="the undesirable responses' losses are multiplied by this",
    )
