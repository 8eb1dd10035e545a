"""Built-in losses, as sums over tokens (Tinker's definitions).

Each takes the model's log-probabilities of the target tokens for one datum and that
datum's loss inputs, and returns the per-token loss; the datum's loss is its sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossInputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, LossInputs, dict], torch.Tensor]

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

# Inputs each loss needs; `weights` is optional for cross_entropy (all ones).
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
}
FLOAT_INPUTS = ("weights", "logprobs", "advantages")
CONFIG_KEYS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}


def cross_entropy(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    weights = inputs.get("weights")
    return -logp if weights is None else -(weights * logp)


def importance_sampling(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -(ratio * inputs["advantages"])


def ppo(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(clipped * logp * inputs["advantages"])


def dro(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    penalty = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * penalty)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


def resolved_config(loss_fn: str, loss_fn_config: dict | None) -> dict[str, float]:
    """Defaults filled in; unknown keys are an error (a typo would silently do nothing)."""
    defaults = CONFIG_KEYS[loss_fn]
    config = dict(defaults)
    for key, value in (loss_fn_config or {}).items():
        if key not in defaults:
            allowed = ", ".join(defaults) or "none"
            raise KeyError(f"unknown key {key!r} for loss {loss_fn!r} (allowed: {allowed})")
        config[key] = float(value)
    return config
