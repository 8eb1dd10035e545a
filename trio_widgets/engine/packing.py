"""One pass over a shared base model for many tenants.

A micro-batch is a flat row of tokens: every sequence of every tenant, back to back,
with no padding. Two pieces make that row behave like separate sequences:

* `packed_attention` (registered as a transformers attention implementation) runs
  causal attention inside each sequence only;
* `MultiLoRALinear` wraps a frozen `nn.Linear` and adds each tenant's LoRA delta on
  that tenant's token segment only.

Both read the active `PackPlan` from a context variable that the engine sets around
the forward pass; with no plan active the model behaves exactly like the plain model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .lora import LoRAAdapter

ATTN_IMPLEMENTATION = "trio_packed"


@dataclass
class Segment:
    """Rows [start, end) of the flattened input belong to `adapter` (None: base only)."""

    start: int
    end: int
    adapter: LoRAAdapter | None


@dataclass
class PackPlan:
    segments: list[Segment]
    # Lengths of the packed sequences, in order; None when the input is an ordinary
    # [batch, length] tensor whose attention needs no special handling (sampling).
    seq_lens: list[int] | None = None
    _groups: list[tuple[int, torch.Tensor | None]] | None = field(default=None, repr=False)
    _cu_seqlens: torch.Tensor | None = field(default=None, repr=False)
    # (an autograd leaf of this pass, the gradient views [rows, cols] it feeds, whose rows lie in its own
    # in order: a stacked A or B of one layer's segments [S, r, in], or tenants' A's side by side)
    grad_leaves: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list, repr=False)
    # Decoding: one token per row, each row through its own adapter (then `segments` is unused)
    rows: RowLoRA | None = None

    def flush_grads(self) -> None:
        """Add what the backward left on this pass's stacked LoRA weights into each adapter's
        pass buffer. Done after the backward, not inside it, so that the backward runs
        entirely in C++ and never waits for the GIL (a notebook's kernel thread holds it)."""
        for leaf, sinks in self.grad_leaves:
            if leaf.grad is not None:  # the sinks' rows lie in the leaf's rows in order: [S, r, in] -> S x [r, in]
                rows = leaf.grad.reshape(-1, leaf.shape[-1])
                torch._foreach_add_(sinks, list(rows.split([sink.shape[0] for sink in sinks])))
        self.grad_leaves.clear()

    def cumulative_lengths(self, device: torch.device) -> torch.Tensor:
        """[0, l0, l0+l1, ...] as int32 on `device`: where each packed sequence starts (varlen kernels)."""
        if self._cu_seqlens is None or self._cu_seqlens.device != device:
            assert self.seq_lens is not None
            starts = [0]
            for n in self.seq_lens:
                starts.append(starts[-1] + n)
            self._cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
        return self._cu_seqlens

    def length_groups(self, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """Sequences grouped by length, as (length, token index or None if contiguous)."""
        if self._groups is None:
            assert self.seq_lens is not None
            if len(set(self.seq_lens)) == 1:
                self._groups = [(self.seq_lens[0], None)]
            else:
                offsets, by_len = 0, dict[int, list[torch.Tensor]]()
                for n in self.seq_lens:
                    by_len.setdefault(n, []).append(torch.arange(offsets, offsets + n))
                    offsets += n
                self._groups = [(n, torch.cat(idx).to(device)) for n, idx in by_len.items()]
        return self._groups


_ACTIVE_PLAN: contextvars.ContextVar[PackPlan | None] = contextvars.ContextVar("trio_pack_plan", default=None)


@contextlib.contextmanager
def active_plan(plan: PackPlan) -> Iterator[None]:
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence (query/key/value: [1, heads, T, dim])."""
    plan = _ACTIVE_PLAN.get()
    if plan is None or plan.seq_lens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if query.is_cuda and _varlen_works(query.device, query.dtype):
        # one FlashAttention call over the whole row, each sequence attending to itself only
        from torch.nn.attention.varlen import varlen_attn

        cu = plan.cumulative_lengths(query.device)
        longest = max(plan.seq_lens)
        whole = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, cu,
                            longest, longest, scale=scaling, window_size=(-1, 0),
                            enable_gqa=key.shape[1] != query.shape[1])
        assert isinstance(whole, torch.Tensor)  # (no aux requested)
        return whole.unsqueeze(0), None
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    heads, total = query.shape[1], query.shape[2]
    groups = plan.length_groups(query.device)
    out = query.new_empty(heads, total, value.shape[-1]) if len(groups) > 1 else None
    for length, index in groups:
        def split(t: torch.Tensor, index: torch.Tensor | None = index, length: int = length) -> torch.Tensor:
            t = t[0] if index is None else t[0].index_select(1, index)
            return t.reshape(t.shape[0], -1, length, t.shape[-1]).transpose(0, 1)  # [n, H, L, D]

        attn = F.scaled_dot_product_attention(split(query), split(key), split(value),
                                              is_causal=True, scale=scaling)
        flat = attn.transpose(0, 1).reshape(heads, -1, attn.shape[-1])  # [H, n*L, D]
        if out is None or index is None:  # one group: the row in order
            return flat.transpose(0, 1).unsqueeze(0).contiguous(), None
        out = out.index_copy(1, index, flat)
    assert out is not None  # several groups: every one was copied in
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


_Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]  # A^T, B^T, scales, output widths


class RowLoRA:
    """Per-row adapters of a decode batch ([rows, 1, in] inputs), for many decode steps.

    Each adapter's A and B are stacked once (ranks zero-padded to the largest: a zero row of A
    and column of B add exact zeros) and kept for the whole decode; each step the rows are
    scattered into [adapters, slots, in] (the rows of one adapter side by side, zero padding
    after) and go through two batched matmuls, whatever the mix of adapters and however many
    rows have finished. The per-step cost is a few tensor ops per layer, none per row.
    """

    def __init__(self, adapters: list[LoRAAdapter | None], device: torch.device):
        distinct: dict[int, LoRAAdapter] = {}
        for adapter in adapters:
            if adapter is not None:
                distinct.setdefault(id(adapter), adapter)
        self.adapters = list(distinct.values())
        index = {key: i for i, key in enumerate(distinct)}
        # a row without an adapter goes through an all-zero one (its delta is exactly 0)
        self.zero = any(a is None for a in adapters)
        count = len(self.adapters) + self.zero
        self.row_adapter = torch.tensor([index[id(a)] if a is not None else count - 1 for a in adapters],
                                        dtype=torch.long, device=device)
        self.count = count
        self.device = device
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        self._stacked_groups: dict[tuple[str, ...], _Group | None] = {}
        self._out_features: dict[str, int] = {}
        self._slots: torch.Tensor | None = None
        self._in_place = False
        self._width = 0
        self.select(torch.arange(len(adapters), device=device))

    def select(self, rows: torch.Tensor) -> None:
        """The rows of the next steps (indices into the rows this was made with, in batch order)."""
        which = self.row_adapter.index_select(0, rows)
        counts = torch.bincount(which, minlength=self.count)
        order = torch.sort(which, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts
        ranked = which.index_select(0, order)
        self._width = max(1, int(counts.max()))
        slot_sorted = ranked * self._width + (torch.arange(len(order), device=self.device)
                                               - starts.index_select(0, ranked))
        self._slots = torch.empty_like(slot_sorted).index_copy_(0, order, slot_sorted)
        # every adapter's rows side by side, as many each: the rows are the padded layout already
        self._in_place = len(order) == self.count * self._width and bool(
            (self._slots == torch.arange(len(order), device=self.device)).all())

    def _weights(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A^T [adapters, in, rank] and B^T [adapters, rank, out] of layer `name`, contiguous
        (the batched matmuls read them as they are), and each adapter's scale [adapters, 1, 1]."""
        if name not in self._stacked:
            pairs = [a.weights.get(name) for a in self.adapters]
            present = [p for p in pairs if p is not None]
            if not present:
                self._stacked[name] = None
            else:
                rank = max(a.shape[0] for a, _ in present)
                a0, b0 = present[0]
                a_t = a0.new_zeros(self.count, a0.shape[1], rank)
                b_t = b0.new_zeros(self.count, rank, b0.shape[0])
                scale = a0.new_zeros(self.count, 1, 1)
                for i, (adapter, pair) in enumerate(zip(self.adapters, pairs)):
                    if pair is not None:
                        a_t[i, :, :pair[0].shape[0]] = pair[0].t()
                        b_t[i, :pair[1].shape[1]] = pair[1].t()
                        scale[i] = adapter.scale
                self._stacked[name] = (a_t, b_t, scale)
        return self._stacked[name]

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output) plus each row's own delta; added in the LoRA dtype and
        rounded once, as the packed path does."""
        return self.apply_group((name,), x, [out])[0]

    def _group(self, names: tuple[str, ...]) -> _Group | None:
        """Layers fed the same input (q/k/v, gate/up) as one: A^T side by side [adapters, in,
        sum of ranks] and B^T block-diagonal [adapters, sum of ranks, sum of outputs] (the
        zero blocks add exact zeros), so the group costs two batched matmuls, not two per layer."""
        if names not in self._stacked_groups:
            parts = [self._weights(name) for name in names]
            if all(p is None for p in parts):
                self._stacked_groups[names] = None
            elif len(names) == 1:
                a_t, b_t, scale = parts[0]  # type: ignore[misc]
                self._stacked_groups[names] = (a_t, b_t, scale, [b_t.shape[-1]])
            else:
                present = [p for p in parts if p is not None]
                a0, b0, scale = present[0]
                outs = [self._out_features[name] for name in names]
                ranks = [p[0].shape[-1] if p is not None else 0 for p in parts]
                a_cat = a0.new_zeros(self.count, a0.shape[1], sum(ranks))
                b_cat = b0.new_zeros(self.count, sum(ranks), sum(outs))
                r_at = o_at = 0
                for p, rank, out in zip(parts, ranks, outs):
                    if p is not None:
                        a_cat[:, :, r_at:r_at + rank] = p[0]
                        b_cat[:, r_at:r_at + rank, o_at:o_at + out] = p[1]
                        scale = torch.maximum(scale, p[2])  # an adapter's scale is one for all its layers
                    r_at, o_at = r_at + rank, o_at + out
                self._stacked_groups[names] = (a_cat, b_cat, scale, outs)
        return self._stacked_groups[names]

    def apply_group(self, names: tuple[str, ...], x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of `outs` (the base outputs of layers `names`, all fed `x`) plus each row's delta."""
        for name, out in zip(names, outs):
            self._out_features.setdefault(name, out.shape[-1])
        group = self._group(names)
        if group is None:
            return outs
        a_t, b_t, scale, widths = group
        assert self._slots is not None
        flat = x.reshape(-1, x.shape[-1]).to(a_t.dtype)
        if not self._in_place:
            flat = flat.new_zeros(self.count * self._width, flat.shape[-1]).index_copy_(0, self._slots, flat)
        # alpha/rank applied to the rank-sized activations, as `lora_delta` does
        hidden = torch.bmm(flat.view(self.count, self._width, -1), a_t) * scale
        delta = torch.bmm(hidden, b_t).view(-1, b_t.shape[-1])
        if not self._in_place:
            delta = delta.index_select(0, self._slots)
        if len(outs) == 1:
            return [(outs[0].to(a_t.dtype) + delta.view(outs[0].shape)).to(outs[0].dtype)]
        return [(out.to(a_t.dtype) + d.reshape(out.shape)).to(out.dtype)
                for out, d in zip(outs, delta.split(widths, dim=-1))]


def segment_scales(adapters: list[LoRAAdapter], dtype: torch.dtype, device: torch.device
                   ) -> float | torch.Tensor:
    """Each segment's own LoRA scale (alpha / rank of its adapter): one number when they
    agree, else a [S, 1, 1] column, so a group never borrows a neighbour's scale."""
    scales = [adapter.scale for adapter in adapters]
    if all(s == scales[0] for s in scales):
        return scales[0]
    return torch.tensor(scales, dtype=dtype, device=device).view(-1, 1, 1)


_VARLEN_CHECKED: dict[tuple[str, torch.dtype], bool] = {}


def _varlen_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's varlen FlashAttention runs on this device and dtype and agrees with SDPA,
    forward and backward: checked once on two short sequences, else the grouped SDPA path."""
    key_ = (str(device), dtype)
    if key_ not in _VARLEN_CHECKED:
        ok = False
        try:
            from torch.nn.attention.varlen import varlen_attn

            g = torch.Generator(device="cpu").manual_seed(0)
            lens, heads, dim = [5, 3], 2, 64
            q, k, v = (torch.randn(sum(lens), heads, dim, generator=g).to(device, dtype).requires_grad_()
                       for _ in range(3))
            cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
            out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0))
            assert isinstance(out, torch.Tensor)
            def causal(s: int, e: int) -> torch.Tensor:  # one sequence alone, in fp32: the reference
                qs, ks, vs = (t[s:e].transpose(0, 1)[None].float() for t in (q, k, v))
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)

            ref = torch.cat([causal(0, 5), causal(5, 8)])
            out.float().sum().backward()
            # A sum of `dim` terms of O(1) values in this dtype: well within 8·dim·eps of the fp32 reference.
            tol = 8 * dim * torch.finfo(dtype).eps
            ok = bool((out.float() - ref).abs().max() <= tol) and all(
                t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
        except Exception:  # no kernel for this device or dtype: the portable path it is
            ok = False
        _VARLEN_CHECKED[key_] = ok
    return _VARLEN_CHECKED[key_]


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def lora_delta(base: torch.Tensor | None, xs: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scale: float | torch.Tensor) -> torch.Tensor:
    """base + LoRA delta (just the delta when `base` is None), per segment: xs [S, L, in],
    lora_a [S, r, in], lora_b [S, out, r], base [S, L, out]; `scale` is one number or one
    per segment ([S, 1, 1])."""
    # alpha/rank applied to the rank-sized activations, the smallest tensor here
    hidden = torch.bmm(xs, lora_a.transpose(1, 2)) * scale
    up = lora_b.transpose(1, 2)
    # baddbmm adds into the base output inside the matmul: no delta-sized temporary
    return torch.bmm(hidden, up) if base is None else torch.baddbmm(base, hidden, up)


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus, per segment, that segment's tenant's LoRA delta."""

    def __init__(self, base: nn.Linear, name: str):
        super().__init__()
        self.base = base
        self.name = name

    @property
    def weight(self) -> torch.Tensor:  # transformers' weight tying looks for it
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        plan = _ACTIVE_PLAN.get()
        if plan is None:
            return out
        if plan.rows is not None:
            return plan.rows.apply(self.name, x, out)
        flat = x.reshape(-1, x.shape[-1])
        # Segments of equal length and rank go through one batched matmul pair: far fewer
        # ops than one pair per tenant, which is what small per-tenant batches pay for.
        # (segment index, segment, its adapter) by (length, rank): segments with a LoRA here
        groups: dict[tuple[int, int], list[tuple[int, Segment, LoRAAdapter]]] = {}
        for i, seg in enumerate(plan.segments):
            if seg.adapter is not None and self.name in seg.adapter.weights:
                rank = seg.adapter.weights[self.name][0].shape[0]
                groups.setdefault((seg.end - seg.start, rank), []).append((i, seg, seg.adapter))
        if not groups:
            return out
        pieces: list[torch.Tensor | None] = [None] * len(plan.segments)
        lora_dtype = out.dtype
        for (length, _rank), group in groups.items():
            members = [i for i, _, _ in group]
            segs = [seg for _, seg, _ in group]
            adapters = [adapter for _, _, adapter in group]
            pairs = [adapter.weights[self.name] for adapter in adapters]
            if len(plan.segments) == 1:  # one tenant, the whole row: plain matmuls (bmm of one is slower)
                return _single_delta(plan, self.name, out, flat, adapters[0])
            if len(segs) == 1:
                lora_a, lora_b = pairs[0][0][None], pairs[0][1][None]
            else:
                lora_a = torch.stack([a for a, _ in pairs])  # [S, r, in]
                lora_b = torch.stack([b for _, b in pairs])  # [S, out, r]
            sinks = [a.pass_grad[self.name] for a in adapters if a.pass_grad is not None]
            if torch.is_grad_enabled() and len(sinks) == len(adapters):
                # This pass's stacked weights are autograd leaves; their gradients go to the
                # adapters in `flush_grads`, so no per-tenant node is in the graph.
                lora_a, lora_b = lora_a.detach().requires_grad_(), lora_b.detach().requires_grad_()
                plan.grad_leaves += [(lora_a, [ga for ga, _ in sinks]), (lora_b, [gb for _, gb in sinks])]
            whole_row = len(segs) == len(plan.segments)  # one group covering the row in order: a view
            xs = flat.view(len(segs), length, flat.shape[-1]) if whole_row else torch.stack(
                [flat[s.start:s.end] for s in segs])
            scale = segment_scales(adapters, lora_a.dtype, lora_a.device)
            if whole_row:  # (the .to()s are no-ops in fp32; a bf16 base adds in fp32, rounds once)
                fused = lora_delta(out.view(len(segs), length, out.shape[-1]).to(lora_a.dtype),
                                   xs.to(lora_a.dtype), lora_a, lora_b, scale)
                return fused.view(out.shape).to(out.dtype)
            delta = lora_delta(None, xs.to(lora_a.dtype), lora_a, lora_b, scale)
            lora_dtype = delta.dtype
            for i, d in zip(members, delta.unbind(0)):
                pieces[i] = d
        # Added in the LoRA dtype and rounded once, as the whole-row path does: a bf16 base would
        # otherwise round each delta to bf16 before adding it (and a tenant's result would depend
        # on whether its neighbours share its rank and length, by up to a bf16 rounding).
        filled = [p if p is not None else out.new_zeros(seg.end - seg.start, out.shape[-1], dtype=lora_dtype)
                  for p, seg in zip(pieces, plan.segments)]
        return (out.to(lora_dtype) + torch.cat(filled, dim=0).view_as(out)).to(out.dtype)


def _single_delta(plan: PackPlan, name: str, out: torch.Tensor, flat: torch.Tensor,
                  adapter: LoRAAdapter) -> torch.Tensor:
    lora_a, lora_b = adapter.weights[name]
    if torch.is_grad_enabled() and adapter.pass_grad is not None:
        ga, gb = adapter.pass_grad[name]
        lora_a, lora_b = lora_a.detach().requires_grad_(), lora_b.detach().requires_grad_()
        plan.grad_leaves += [(lora_a, [ga]), (lora_b, [gb])]
    hidden = F.linear(flat.to(lora_a.dtype), lora_a)
    fused = torch.addmm(out.reshape(-1, out.shape[-1]).to(lora_a.dtype), hidden, lora_b.t(), alpha=adapter.scale)
    return fused.view(out.shape).to(out.dtype)
