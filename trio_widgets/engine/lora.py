"""One tenant's LoRA adapter, its accumulated gradient and its own AdamW state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..types import AdamParams

LORA_ALPHA = 32.0  # scale = alpha / rank, as in PEFT with lora_alpha=32


@dataclass
class AdamState:
    step: int = 0
    exp_avg: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    exp_avg_sq: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The same moments as flat vectors (exp_avg / exp_avg_sq are views into them), so a
    # step needn't gather them again; None after a load, rebuilt by the next step.
    flat: tuple[torch.Tensor, torch.Tensor] | None = None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """One reduction instead of a check per tensor (NaN and inf survive the sum of |x|)."""
    if not tensors:
        return True
    return bool(torch.isfinite(torch.cat([t.reshape(-1) for t in tensors]).abs().sum()))


class LoRAAdapter:
    """A, B per wrapped linear: A [rank, in] from `seed` (PEFT's kaiming-uniform), B [out, rank] zero."""

    def __init__(self, targets: dict[str, tuple[int, int]], rank: int, seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, alpha: float = LORA_ALPHA):
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.seed = seed
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in sorted(targets):
            fan_in, fan_out = targets[name]
            # kaiming_uniform_(a=sqrt(5)) on [rank, fan_in] draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(fan_in)
            lora_a = (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            lora_b = torch.zeros(fan_out, rank, dtype=torch.float64)
            self.weights[name] = (lora_a.to(dtype).to(device).requires_grad_(True),
                                  lora_b.to(dtype).to(device).requires_grad_(True))
        self.grad: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # accumulated, until optim_step
        self.adam = AdamState()

    @classmethod
    def from_weights(cls, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float = LORA_ALPHA,
                     seed: int = 0, device: torch.device | str = "cpu") -> "LoRAAdapter":
        """A frozen adapter holding copies of `weights` (A [rank, in], B [out, rank], float32)."""
        adapter = cls.__new__(cls)
        adapter.rank = int(rank)
        adapter.alpha = float(alpha)
        adapter.scale = adapter.alpha / adapter.rank
        adapter.seed = int(seed)
        adapter.weights = {
            name: (a.detach().to(device=device, dtype=torch.float32).clone(),
                   b.detach().to(device=device, dtype=torch.float32).clone())
            for name, (a, b) in sorted(weights.items())}
        adapter.grad = None
        adapter.adam = AdamState()
        return adapter

    def snapshot(self) -> "LoRAAdapter":
        """An immutable copy of the current weights (no gradient, no optimizer state): what a
        sampling client samples from, untouched by later training."""
        return LoRAAdapter.from_weights(self.weights, self.rank, self.alpha, self.seed, self.parameters()[0].device)

    # -- parameters ------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.weights.values() for t in pair]

    def zero_param_grads(self) -> None:
        for p in self.parameters():
            p.grad = None

    def take_param_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The gradient the last backward left on the parameters (zeros where none flowed).

        The buffers autograd made are handed over, not copied: the parameters let go of them.
        """
        out = {}
        for name, (a, b) in self.weights.items():
            ga = a.grad if a.grad is not None else torch.zeros_like(a)
            gb = b.grad if b.grad is not None else torch.zeros_like(b)
            out[name] = (ga, gb)
        self.zero_param_grads()
        return out

    def accumulate(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.grad is None:
            self.grad = grads
            return
        self.grad = {n: (ga + grads[n][0], gb + grads[n][1]) for n, (ga, gb) in self.grad.items()}


    # -- optimizer ---------------------------------------------------------------
    def adamw_step(self, params: AdamParams) -> dict[str, float]:
        """torch.optim.AdamW's update (decoupled weight decay), with this call's hyperparameters.

        All new tensors are computed first and swapped in only at the end, so an
        exception leaves weights and moments as they were.
        """
        grads = self.grad if self.grad is not None else {
            n: (torch.zeros_like(a), torch.zeros_like(b)) for n, (a, b) in self.weights.items()}
        step = self.adam.step + 1
        b1, b2, lr, eps, wd = params.beta1, params.beta2, params.learning_rate, params.eps, params.weight_decay
        names = list(self.weights)
        ps = [t for n in names for t in self.weights[n]]
        sizes = [p.numel() for p in ps]

        def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([t.reshape(-1) for t in tensors])

        # One flat vector per quantity and torch's fused AdamW kernel: a few passes over
        # memory per step instead of a dozen ops per tensor (what dominated small adapters).
        # It updates in place, so it runs on fresh vectors; the weights are copied back
        # only once every new value is known to be finite.
        with torch.no_grad():
            g = flat([t for n in names for t in grads[n]])
            norm = float(g.norm(dtype=torch.float64))
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                g = g * (params.grad_clip_norm / (norm + 1e-6))
            if self.adam.flat is not None:
                m, v = self.adam.flat[0].clone(), self.adam.flat[1].clone()
            elif self.adam.exp_avg:
                m = flat([t for n in names for t in self.adam.exp_avg[n]])
                v = flat([t for n in names for t in self.adam.exp_avg_sq[n]])
            else:
                m, v = torch.zeros_like(g), torch.zeros_like(g)
            w = flat(ps)
            torch._fused_adamw_([w], [g], [m], [v], [], [torch.tensor(float(step), device=w.device)],
                                lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            # nothing is overwritten until every new value is known to be finite
            if not bool(torch.isfinite(w.sum())):
                raise FloatingPointError("optim_step produced non-finite weights")
            torch._foreach_copy_(ps, [x.view_as(p) for x, p in zip(w.split(sizes), ps)])

        def pairs(vector: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            parts = [x.view_as(p) for x, p in zip(vector.split(sizes), ps)]
            return {n: (parts[2 * i], parts[2 * i + 1]) for i, n in enumerate(names)}

        new_m, new_v = pairs(m), pairs(v)
        self.adam.exp_avg, self.adam.exp_avg_sq, self.adam.step = new_m, new_v, step
        self.adam.flat = (m, v)
        self.grad = None
        return {"grad_norm:mean": norm, "learning_rate:mean": lr, "step:max": float(step)}

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "rank": self.rank, "alpha": self.alpha, "seed": self.seed,
            "weights": {n: (a.detach().cpu().clone(), b.detach().cpu().clone()) for n, (a, b) in self.weights.items()},
            "adam_step": self.adam.step,
            "exp_avg": {n: tuple(t.cpu().clone() for t in pair) for n, pair in self.adam.exp_avg.items()},
            "exp_avg_sq": {n: tuple(t.cpu().clone() for t in pair) for n, pair in self.adam.exp_avg_sq.items()},
        }

    def load_state_dict(self, state: dict, with_optimizer: bool) -> None:
        if set(state["weights"]) != set(self.weights):
            raise ValueError("checkpoint adapter targets do not match this client's LoRA targets")
        with torch.no_grad():
            for name, (a, b) in self.weights.items():
                src_a, src_b = state["weights"][name]
                if src_a.shape != a.shape or src_b.shape != b.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(src_a.shape)}, expected {tuple(a.shape)}")
            for name, (a, b) in self.weights.items():
                a.copy_(state["weights"][name][0])
                b.copy_(state["weights"][name][1])
        device = self.parameters()[0].device
        if with_optimizer:
            self.adam = AdamState(
                step=int(state["adam_step"]),
                exp_avg={n: tuple(t.to(device) for t in p) for n, p in state["exp_avg"].items()},
                exp_avg_sq={n: tuple(t.to(device) for t in p) for n, p in state["exp_avg_sq"].items()},
            )
        else:
            self.adam = AdamState()
        self.grad = None
