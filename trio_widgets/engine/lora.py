"""One tenant's LoRA adapter, its accumulated gradient and its own AdamW state."""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field

import torch

from ..types import AdamParams, AdapterSnapshot

LORA_ALPHA = 32.0  # scale = alpha / rank, as in PEFT with lora_alpha=32


@dataclass
class AdamState:
    step: int = 0
    exp_avg: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    exp_avg_sq: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The same moments as flat vectors (exp_avg / exp_avg_sq are views into them), so a
    # step needn't gather them again; None after a load, rebuilt by the next step.
    flat: tuple[torch.Tensor, torch.Tensor] | None = None


def all_finite(tensor: torch.Tensor) -> bool:
    """One reduction and no temporary (NaN propagates through min/max; a sum could overflow)."""
    return finite_flags([tensor])[0]


def finite_flags(tensors: list[torch.Tensor | None]) -> list[bool]:
    """Whether each tensor is all finite (None: yes), with one device-to-host sync for all of
    them: on a GPU each `float(...)` of a reduction would wait for the device."""
    present = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel() > 0]
    flags = [True] * len(tensors)
    if present:
        extremes = torch.stack([torch.stack(torch.aminmax(t)) for _, t in present])
        for (i, _), ok in zip(present, torch.isfinite(extremes).all(dim=1).tolist()):
            flags[i] = bool(ok)
    return flags


_scratch = threading.local()


def _scratch_vectors(like: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` reusable vectors like `like`, one set per thread (a pool's clock thread):
    allocating fresh ones of this size costs a page fault per 4 KiB, more than the step."""
    cache = _scratch.__dict__.setdefault("cache", {})
    key = (like.numel(), like.dtype, like.device, count)
    if key not in cache:
        if len(cache) >= 4:  # a handful of adapter sizes at once; bounded either way
            cache.pop(next(iter(cache)))
        cache[key] = [torch.empty_like(like) for _ in range(count)]
    return cache[key]


def _check_args(rank: int, alpha: float, seed: int) -> None:
    """A ValueError naming the argument, not a ZeroDivisionError or a bare overflow later."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer of at least 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
        raise ValueError(f"LoRA alpha must be a finite number above 0, got {alpha!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1 (what torch takes), got {seed!r}")


class LoRAAdapter:
    """A, B per wrapped linear: A [rank, in] from `seed` (PEFT's kaiming-uniform), B [out, rank] zero.

    Every A and B is a view into one flat vector, and so is the gradient: the optimizer
    step, the finiteness checks and the hand-over of a pass's gradient are then a few
    whole-vector operations instead of one per tensor (what dominated small adapters).
    """

    def __init__(self, targets: dict[str, tuple[int, int]], rank: int, seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, alpha: float = LORA_ALPHA):
        _check_args(rank, alpha, seed)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        weights = {}
        for name in sorted(targets):
            fan_in, fan_out = targets[name]
            # kaiming_uniform_(a=sqrt(5)) on [rank, fan_in] draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(fan_in)
            lora_a = (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            weights[name] = (lora_a, torch.zeros(fan_out, rank, dtype=torch.float64))
        self._init(weights, rank, alpha, seed, device, dtype)

    def _init(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float, seed: int,
              device: torch.device | str, dtype: torch.dtype) -> None:
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.scale = self.alpha / self.rank
        self.seed = int(seed)
        self._shapes = [(name, tuple(a.shape), tuple(b.shape)) for name, (a, b) in sorted(weights.items())]
        self._sizes = [math.prod(shape) for _, sa, sb in self._shapes for shape in (sa, sb)]
        self.flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, pair in sorted(weights.items())
                               for t in pair]).to(device)
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = self.views(self.flat)
        self._grad: torch.Tensor | None = None  # accumulated, until optim_step
        self.pass_grad: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # the running pass's sinks
        self._pass_flat: torch.Tensor | None = None
        self._spare_grad: torch.Tensor | None = None
        self.adam = AdamState()

    @classmethod
    def from_weights(cls, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float = LORA_ALPHA,
                     seed: int = 0, device: torch.device | str = "cpu") -> LoRAAdapter:
        """A frozen adapter holding copies of `weights` (A [rank, in], B [out, rank], float32)."""
        _check_args(rank, alpha, seed)
        adapter = cls.__new__(cls)
        adapter._init(weights, rank, alpha, seed, device, torch.float32)
        return adapter

    def snapshot(self) -> LoRAAdapter:
        """An immutable copy of the current weights (no gradient, no optimizer state): what a
        sampling client samples from, untouched by later training."""
        return LoRAAdapter.from_weights(self.weights, self.rank, self.alpha, self.seed, self.flat.device)

    def views(self, vector: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`vector` (laid out like `flat`) as name -> (A-shaped view, B-shaped view)."""
        parts = vector.split(self._sizes)
        return {name: (parts[2 * i].view(sa), parts[2 * i + 1].view(sb))
                for i, (name, sa, sb) in enumerate(self._shapes)}

    def flatten(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for name, _, _ in self._shapes for t in tensors[name]])

    # -- gradients ---------------------------------------------------------------
    @property
    def grad(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """The gradient accumulated since the last optim_step (views), or None."""
        return None if self._grad is None else self.views(self._grad)

    def begin_pass(self) -> None:
        """Give the next backward a zeroed flat buffer to add this adapter's gradient into."""
        buffer, self._spare_grad = self._spare_grad, None
        self._pass_flat = buffer.zero_() if buffer is not None else torch.zeros_like(self.flat)
        self.pass_grad = self.views(self._pass_flat)

    def end_pass(self) -> torch.Tensor:
        """The gradient the pass's backward left (flat); the adapter lets go of the buffer."""
        assert self._pass_flat is not None, "end_pass() without begin_pass()"
        grad, self._pass_flat, self.pass_grad = self._pass_flat, None, None
        return grad

    def accumulate(self, grads: torch.Tensor | dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        flat = grads if isinstance(grads, torch.Tensor) else self.flatten(grads)
        if self._grad is None:
            self._grad = flat
        else:
            self._grad.add_(flat)
            self._spare_grad = flat  # reused by the next pass (buffers this size are slow to allocate)

    # -- optimizer ---------------------------------------------------------------
    def adamw_step(self, params: AdamParams) -> dict[str, float]:
        """torch.optim.AdamW's update (decoupled weight decay), with this call's hyperparameters.

        The update runs on scratch copies and is copied back only when every new weight is
        finite, so a failed step leaves weights, moments and the pending gradient as they were.
        """
        step = self.adam.step + 1
        with torch.no_grad():
            scratch = _scratch_vectors(self.flat, 4)
            w, m, v, g = scratch
            if self._grad is None:
                g.zero_()
            else:  # the step only reads it; a clipped copy keeps the pending gradient as it was
                g = self._grad
            norm = float(torch.linalg.vector_norm(g))
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                g = torch.mul(g, params.grad_clip_norm / (norm + 1e-6), out=scratch[3])
            if self.adam.flat is not None:
                m.copy_(self.adam.flat[0])
                v.copy_(self.adam.flat[1])
            elif self.adam.exp_avg:
                m.copy_(self.flatten(self.adam.exp_avg))
                v.copy_(self.flatten(self.adam.exp_avg_sq))
            else:
                m.zero_()
                v.zero_()
            w.copy_(self.flat)
            # torch's fused AdamW kernel: one pass over memory for the whole adapter
            torch._fused_adamw_([w], [g], [m], [v], [], [torch.tensor(float(step), device=w.device)],
                                lr=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                                weight_decay=params.weight_decay, eps=params.eps, amsgrad=False, maximize=False)
            if not all_finite(w):
                raise FloatingPointError("optim_step produced non-finite weights")
            self.flat.copy_(w)
            # the new moments are kept as they are and the old ones become the scratch: no copy back
            # (the weights are copied: every A and B the engine holds is a view of `flat`)
            old = self.adam.flat
            scratch[1], scratch[2] = (old if old is not None else (torch.empty_like(m), torch.empty_like(v)))
            self.adam.flat = (m, v)
            self.adam.exp_avg, self.adam.exp_avg_sq = self.views(m), self.views(v)
        self.adam.step = step
        self._spare_grad, self._grad = self._grad, None
        return {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate, "step:max": float(step)}

    # -- state -----------------------------------------------------------------
    def snapshot_state(self, client_id: str, base_model: str) -> AdapterSnapshot:
        """Copies of everything a user may inspect (see `AdapterSnapshot`)."""
        def copy(table: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            return {n: (a.detach().to("cpu", torch.float32, copy=True), b.detach().to("cpu", torch.float32, copy=True))
                    for n, (a, b) in table.items()}
        return AdapterSnapshot(client_id=client_id, base_model=base_model, rank=self.rank, alpha=self.alpha,
                               seed=self.seed, step=self.adam.step, weights=copy(self.weights),
                               grad=copy(self.views(self._grad)) if self._grad is not None else None,
                               exp_avg=copy(self.adam.exp_avg), exp_avg_sq=copy(self.adam.exp_avg_sq))

    def state_dict(self) -> dict:
        return {
            "rank": self.rank, "alpha": self.alpha, "seed": self.seed,
            "weights": {n: (a.detach().cpu().clone(), b.detach().cpu().clone()) for n, (a, b) in self.weights.items()},
            "adam_step": self.adam.step,
            "exp_avg": {n: tuple(t.cpu().clone() for t in pair) for n, pair in self.adam.exp_avg.items()},
            "exp_avg_sq": {n: tuple(t.cpu().clone() for t in pair) for n, pair in self.adam.exp_avg_sq.items()},
        }

    def load_state_dict(self, state: dict, with_optimizer: bool) -> None:
        """Everything is checked and staged before the first write: a rejected state changes nothing."""
        if set(state["weights"]) != set(self.weights):
            raise ValueError("checkpoint adapter targets do not match this client's LoRA targets")
        for name, (a, b) in self.weights.items():
            src_a, src_b = state["weights"][name]
            if src_a.shape != a.shape or src_b.shape != b.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(src_a.shape)}, "
                                 f"expected {tuple(a.shape)}")
        device = self.flat.device
        adam = AdamState()
        if with_optimizer:
            step = state["adam_step"]
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise ValueError(f"the optimizer step must be a non-negative integer, got {step!r}")
            adam = AdamState(
                step=int(step),
                exp_avg={n: tuple(t.to(device) for t in p) for n, p in state["exp_avg"].items()},
                exp_avg_sq={n: tuple(t.to(device) for t in p) for n, p in state["exp_avg_sq"].items()},
            )
            for table in (adam.exp_avg, adam.exp_avg_sq):
                for name, pair in table.items():
                    if name not in self.weights or any(m.shape != w.shape for m, w in zip(pair, self.weights[name])):
                        raise ValueError(f"checkpoint optimizer state of {name} does not fit this adapter")
        with torch.no_grad():
            for name, (a, b) in self.weights.items():
                a.copy_(state["weights"][name][0])
                b.copy_(state["weights"][name][1])
        self.adam = adam
        self._grad = None
