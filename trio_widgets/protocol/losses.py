"""The built-in losses as data: their names, the inputs each needs, their config keys with
defaults, and the model-free checks of a datum's inputs. Torch-free: the client checks a batch
with these before anything is sent; the engine computes the losses (engine/losses.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["CONFIG_KEYS", "FLOAT_INPUTS", "IGNORE_TARGET", "LOSS_NAMES", "REQUIRED_INPUTS", "UNAVAILABLE_LOSSES",
           "check_loss_inputs", "forward_metrics", "normalise_loss_name", "resolved_config", "tokens_read"]

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
#: A target token that marks its position as not read (pytrio's rule, and PyTorch's `ignore_index`):
#: it adds nothing to any loss, gradient or count, as a weight of 0 would. Any other negative id
#: is refused.
IGNORE_TARGET = -100

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


#: The built-in losses (engine/losses.py has a function for each).
LOSS_NAMES: tuple[str, ...] = tuple(CONFIG_KEYS)


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
    if key in LOSS_NAMES:
        return key
    if key in UNAVAILABLE_LOSSES:
        raise ValueError(UNAVAILABLE_LOSSES[key])
    raise ValueError(f"unknown loss_fn {name!r}; choose one of {', '.join(LOSS_NAMES)}")


def check_loss_inputs(loss_fn: str, inputs: Mapping[str, Sequence[float]],
                      targets: Sequence[int] | None = None) -> None:
    """Checks of one datum's inputs beyond presence, length and finiteness (which the client
    does). Raises ValueError naming the key: a loss must not find out inside the cycle."""
    if loss_fn == "gspo":
        read = [t != IGNORE_TARGET for t in targets] if targets is not None else None
        mask = inputs["sequence_ratio_mask"]
        if not any(v != 0 and (read is None or read[i]) for i, v in enumerate(mask)):
            also = " other than those whose target_tokens is -100 (ignored)" if read is not None and not all(read) \
                else ""
            raise ValueError(f"loss_fn_inputs['sequence_ratio_mask'] marks no token{also}: gspo's sequence ratio is "
                             f"a mean over the marked tokens (mark the sampled tokens with 1)")


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


def tokens_read(loss_fn: str, length: int, weights: Sequence[float] | None,
                targets: Sequence[int] | None = None) -> int:
    """pytrio's `token_count` of one datum: the target tokens the loss reads. A target of
    IGNORE_TARGET (-100) is never read; for cross_entropy neither is one of weight 0 (without
    `weights` every other one is); the other losses read every other target."""
    read = [t != IGNORE_TARGET for t in targets] if targets is not None else [True] * length
    if loss_fn == "cross_entropy" and weights is not None:
        read = [r and w != 0 for r, w in zip(read, weights)]
    return sum(read)


def forward_metrics(loss_sum: float, token_count: int) -> dict[str, float]:
    """A forward's metrics: tinker's `loss:sum` and pytrio's three (the loss is a sum in both;
    loss_mean is a metric only). Only `loss:sum` travels (the SDK refuses other keys): over HTTP
    the client adds pytrio's from the data it sent."""
    return {"loss:sum": loss_sum, "loss_sum": loss_sum, "token_count": token_count,
            "loss_mean": loss_sum / token_count if token_count else 0.0}
