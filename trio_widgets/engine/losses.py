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

from ..protocol.losses import (  # noqa: F401 - the specs, re-exported beside the functions
    CONFIG_KEYS,
    FLOAT_INPUTS,
    IGNORE_TARGET,
    LOSS_NAMES,
    REQUIRED_INPUTS,
    UNAVAILABLE_LOSSES,
    normalise_loss_name,
    resolved_config,
)
from ..protocol.losses import check_loss_inputs as _check_loss_inputs

LossInputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, LossInputs, dict], torch.Tensor]

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


LOSSES: dict[str, LossFn] = {  # one per name of trio_widgets.protocol.losses.LOSS_NAMES
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}


def datum_loss(loss_fn: str, logp: torch.Tensor, inputs: LossInputs, config: dict,
               target_tokens: torch.Tensor) -> torch.Tensor:
    """One datum's per-token loss. A position whose target is IGNORE_TARGET (-100, pytrio's
    rule) is not read: its loss is 0 with no gradient (as a weight of 0 gives), and gspo's
    sequence ratio leaves it out. (Its logp is 0 already: the packed pass's cross-entropy
    ignores -100.) `target_tokens` stays on the CPU: finding the ignored ones costs no device sync."""
    ignored = target_tokens == IGNORE_TARGET
    if not bool(ignored.any()):
        return LOSSES[loss_fn](logp, inputs, config)
    read = (~ignored).to(logp.device)
    if "sequence_ratio_mask" in inputs:
        inputs = {**inputs, "sequence_ratio_mask": torch.where(read, inputs["sequence_ratio_mask"], 0.0)}
    return torch.where(read, LOSSES[loss_fn](logp, inputs, config), torch.zeros((), dtype=logp.dtype,
                                                                                  device=logp.device))


def check_loss_inputs(loss_fn: str, inputs: LossInputs) -> None:
    """The protocol's check (trio_widgets.protocol.losses), for tensors."""
    _check_loss_inputs(loss_fn, {k: v.reshape(-1).tolist() for k, v in inputs.items()})


assert tuple(LOSSES) == LOSS_NAMES, "every loss the protocol names has its function here"
