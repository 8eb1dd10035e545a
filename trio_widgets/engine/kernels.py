"""A decode step's large linears on CPU: oneDNN, with each weight packed once.

At a decode's few rows MKL's sgemm (what `F.linear` runs on CPU) packs the weight again on every
call, and reading and writing a large weight once more costs about as much as the product. With
the weight packed once in oneDNN's layout, a Llama 8 x 512's MLP ran 1.2-1.5x and its
32,000-token head 1.9x faster at 32 rows (benchmarks/sampling.py measures the decode).

A packed weight is a second copy of it, so only float32 CPU weights of at least `MIN_ELEMENTS`
are packed (smaller ones ran no faster), and only while every packed copy in the process fits
`budget_bytes()`. Everything else, and a torch without these ops, goes through `F.linear`.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MIN_ELEMENTS", "PackedLinears", "budget_bytes", "onednn_works", "pack_weight", "packed_bytes",
           "packed_product"]

MIN_ELEMENTS = 1 << 20  # 512 x 2048: a Llama 8 x 512's MLP and head, not its attention
_MAX_BUDGET = 1 << 30

_lock = threading.Lock()
_held = 0  # bytes of packed copies alive in this process
_works: bool | None = None


def budget_bytes() -> int:
    """What packed copies may hold in all: an eighth of the memory this process may use (the
    machine's, or its cgroup's limit when lower), at most 1 GiB; 128 MiB where neither can be
    read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        total = 8 * (128 << 20)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            total = min(total, int(f.read()))
    except (OSError, ValueError):  # no cgroup v2 limit ("max", or not Linux)
        pass
    return min(_MAX_BUDGET, total // 8)


def packed_bytes() -> int:
    """Bytes of packed weights alive in this process."""
    return _held


def _release(nbytes: int) -> None:
    global _held
    with _lock:
        _held -= nbytes


def pack_weight(weight: torch.Tensor) -> Any:
    """`weight` [out, in] in oneDNN's layout for products of about 32 rows (any row count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def packed_product(x: torch.Tensor, packed: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through `pack_weight(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_works() -> bool:
    """Whether this torch packs and multiplies through oneDNN, agreeing with F.linear within
    float32 rounding (checked once, on a small product)."""
    global _works
    if _works is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
            out = packed_product(x, pack_weight(w), b)
            # each output sums 64 products and a bias: a few float32 roundings of their magnitude each
            bound = 66 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T + b.abs())
            _works = bool(((out - F.linear(x, w, b)).abs() <= bound).all())
        except Exception:  # no oneDNN in this build, or ops renamed
            _works = False
    return _works


class PackedLinears:
    """One base model's packed weights, made as a decode first meets each weight and dropped
    with the model (weights are frozen, so a copy never goes stale)."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[torch.Tensor, Any]] = {}  # id(weight) -> (weight, packed or None)
        self.nbytes = 0
        self._finalizer = weakref.finalize(self, _release, 0)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, through a packed copy of `weight` where one is kept."""
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = (weight, self._pack(weight))
            self._packed[id(weight)] = entry
        packed = entry[1]
        if packed is None or x.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, weight, bias)
        return packed_product(x.contiguous(), packed, bias)

    def _pack(self, weight: torch.Tensor) -> Any:
        global _held
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
                or weight.numel() < MIN_ELEMENTS or not onednn_works()):
            return None
        nbytes, budget = weight.numel() * weight.element_size(), budget_bytes()
        with _lock:
            if _held + nbytes > budget:
                return None
            _held += nbytes
        try:
            packed = pack_weight(weight.detach())
        except Exception:  # a weight oneDNN will not take (a layout the check product did not have)
            _release(nbytes)
            return None
        self.nbytes += nbytes
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self.nbytes)
        return packed
