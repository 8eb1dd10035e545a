"""Built-in losses, as sums over tokens (Tinker's definitions).

Each takes the model's log-probabilities of the target tokens for one datum and that
datum's loss inputs, and returns the per-token loss; the datum's loss is its sum. A loss
must not raise: it runs inside a cycle's shared pass, where an exception fails every
tenant; a value it cannot compute is NaN, which fails its own tenant only.

Not here: tinker's `stable_reinforce`. Its objective is not published (neither the tinker
0.38 package nor its docs give the formula or the `kl_coeff` default), and it needs
stability information recorded by the hosted sampler, so it is refused with that reason.
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
    "gspo": (*_RL_INPUTS, "sequence_ratio_mask"),
}
FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")
CONFIG_KEYS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    # tinker's GSPO page clips to [1 - eps_low, 1 + eps_high] without naming its config
    # keys; these are the PPO/CISPO keys and defaults (eps = 0.2), which the same docs and
    # the SDK's Datum key list (clip_low_threshold / clip_high_threshold) use.
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
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


def gspo(logp: torch.Tensor, inputs: LossInputs, config: dict) -> torch.Tensor:
    """GSPO-token (tinker docs, losses/gspo): one sequence ratio s = exp(mean over the tokens
    `sequence_ratio_mask` marks of (logp - q)), carried by every token with the gradient of
    its own logp; then PPO's clipped objective, token-wise. An empty mask gives NaN."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())  # value s, gradient s * d(logp)
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}

# Names the hosted services know that the local pool refuses, and why.
UNAVAILABLE_LOSSES = {
    "stable_reinforce": "tinker's stable_reinforce is not available in the local pool: its objective is not "
                        "published, and it needs stability information recorded by tinker's sampler "
                        "(record_stability_info); use ppo, cispo or gspo for off-policy RL",
    "custom": "the 'custom' loss names a server-side loss handle; here, pass your loss function to "
              "forward_backward_custom",
}


def normalise_loss_name(name: object) -> str:
    """The built-in loss `name` means. pytrio lower-cases and strips names, tinker passes them
    as they are; every built-in name is lower-case, so folding case is unambiguous.
    Raises ValueError naming the choices (or why a hosted-only loss is refused)."""
    if not isinstance(name, str):
        raise ValueError(f"loss_fn must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in LOSSES:
        return key
    if key in UNAVAILABLE_LOSSES:
        raise ValueError(UNAVAILABLE_LOSSES[key])
    raise ValueError(f"unknown loss_fn {name!r}; choose one of {', '.join(LOSSES)}")


def check_loss_inputs(loss_fn: str, inputs: LossInputs) -> None:
    """Checks of one datum's inputs beyond presence, length and finiteness (which the client
    does). Raises ValueError naming the key: a loss must not find out inside the cycle."""
    if loss_fn == "gspo" and not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise ValueError("loss_fn_inputs['sequence_ratio_mask'] marks no token: gspo's sequence ratio is a "
                         "mean over the marked tokens (mark the sampled tokens with 1)")


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
