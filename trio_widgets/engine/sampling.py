"""Sampling and prompt log-probabilities, run by the clock like any other request.

Every `sample` and `compute_logprobs` request of a cycle on one base model is served
by one batch (cut only to respect the pool's token budget): the distinct prompts are
left-padded into one [jobs, length] prefill (each prompt once, whatever its
`num_samples`), the KV cache is then expanded to one row per sample, and a single decode
loop advances all rows together, each row through its own tenant's LoRA delta
(`_DecodeLoRA`, a `packing.RowLoRA`: every adapter's weights stacked once, batched matmuls
per layer: one for a group's A side, one per member's B).
Rows that stop are dropped from the batch, so finished samples cost nothing.

Determinism: row j of a request with seed s draws its uniforms from its own generator
seeded by (s, j), and a token is picked by inverse CDF over the filtered distribution
(over token ids in order when nothing is filtered out; over the tokens by descending
probability, stable, once top-k or top-p cuts it), so the same seed gives the same
samples whatever else shares the cycle and however the decode is cut into cycles.

`logprobs` are the model's own log-probabilities (temperature 1, no top-k / top-p),
the quantity importance-sampling losses need and what `compute_logprobs` returns.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import RequestErrorCategory, RequestFailedError
from ..types import PromptAltTokens, SampledSequence, SampleResponse, TensorData
from ..validation import SampleSpec
from .llama import is_llama as _is_llama
from .llama import rms_norm, rotary, rotate
from .lora import LoRAAdapter
from .models import BaseModel
from .packing import MultiLoRALinear, PackPlan, RowLoRA, Segment, active_plan
from .tenants import Later

__all__ = ["SampleCarry", "StepBudget", "forward_logits", "run_sample_batch"]


# -- the batched forward ------------------------------------------------------------------

def _segments(adapters: Sequence[LoRAAdapter | None], row_len: int) -> list[Segment]:
    """One segment per run of consecutive rows with the same adapter, over the flattened rows."""
    segments: list[Segment] = []
    for i, adapter in enumerate(adapters):
        if segments and segments[-1].adapter is adapter:
            segments[-1].end += row_len
        else:
            segments.append(Segment(i * row_len, (i + 1) * row_len, adapter))
    return segments


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x called it `past_key_values`."""
    kind = type(model)
    if kind not in _CACHE_KWARG:
        params = inspect.signature(model.forward).parameters
        _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[kind]


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def _forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             adapters: Sequence[LoRAAdapter | None], cache=None, last_only: bool = False) -> torch.Tensor:
    """Logits [n, L, vocab]; `last_only` (a Llama): of the last position only, [n, 1, vocab] (the
    head over every prompt position cost 3% of a Llama 8 x 512 sample when nobody asked for them)."""
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                                  use_cache=cache is not None)
    with torch.no_grad():
        if last_only and _is_llama(model):
            inner: Any = model.model
            if cache is not None:
                kwargs[_cache_kwarg(inner)] = cache
            with active_plan(PackPlan(segments=_segments(adapters, ids.shape[1]), seq_lens=None)):
                hidden = inner(**kwargs).last_hidden_state[:, -1:]
            with active_plan(PackPlan(segments=_segments(adapters, 1), seq_lens=None)):
                return model.lm_head(hidden)  # type: ignore[operator]
        if cache is not None:
            kwargs[_cache_kwarg(model)] = cache
        with active_plan(PackPlan(segments=_segments(adapters, ids.shape[1]), seq_lens=None)):
            return model(**kwargs).logits


def _left_pad(prompts: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, L], valid [n, L] (False on padding), positions [n, L]."""
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, length - len(p):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), valid.to(device), positions.to(device)


def _prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """[n, 1, L, L] bool: causal, never onto padding; a padding query sees itself (no empty rows, no NaN)."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    return ((causal[None] & valid[:, None, :]) | eye[None])[:, None]


def forward_logits(base: BaseModel, adapter: LoRAAdapter | None, prompts: Sequence[list[int]]) -> list[torch.Tensor]:
    """Logits [len(p), vocab] (float32) of each prompt through the sampler's batched path."""
    ids, valid, positions = _left_pad(prompts, base.device)
    logits = _forward(base.model, ids, _prefill_mask(valid), positions, [adapter] * len(prompts))
    length = ids.shape[1]
    return [logits[i, length - len(p):].float().cpu() for i, p in enumerate(prompts)]


class _DecodeLoRA(RowLoRA):
    """`RowLoRA` for the decode steps: a group of layers fed the same input (q/k/v, gate/up)
    shares one batched matmul for its A side (side by side, each adapter's alpha/rank folded in
    once), and each member's B goes through a batched matmul of its own over its slice of the
    rank-sized activations, added into the base output as it is made where the rows are in
    adapter order. (A block-diagonal B costs as much as its zero blocks: the gate/up B of 8
    rank-32 adapters took 4x the time of the two B's apart, on the built-in model and on a
    Llama 8 x 512.)"""

    def __init__(self, adapters: list[LoRAAdapter | None], device: torch.device):
        super().__init__(adapters, device)
        self._parts: dict[tuple[str, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, int, int] | None]] | None] = {}

    def _split_group(self, names: tuple[str, ...]):
        """(A^T side by side times each adapter's scale [adapters, in, sum of ranks], per member
        (B^T [adapters, rank, out], first and last rank column) or None), None without LoRA."""
        if names not in self._parts:
            parts = [self._weights(name) for name in names]
            present = [p for p in parts if p is not None]
            if not present:
                self._parts[names] = None
            else:
                scale = present[0][2]
                members: list[tuple[torch.Tensor, int, int] | None] = []
                at = 0
                for p in parts:
                    if p is None:
                        members.append(None)
                        continue
                    a_t, b_t, s = p
                    scale = torch.maximum(scale, s)  # an adapter's scale is one for all its layers
                    members.append((b_t, at, at + a_t.shape[-1]))
                    at += a_t.shape[-1]
                a_cat = present[0][0] if len(present) == 1 else torch.cat([p[0] for p in present], dim=-1)
                self._parts[names] = (a_cat * scale, members)
        return self._parts[names]

    def apply_group(self, names: tuple[str, ...], x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        group = self._split_group(names)
        if group is None:
            return outs
        a_scaled, members = group
        assert self._slots is not None
        flat = x.reshape(-1, x.shape[-1]).to(a_scaled.dtype)
        if not self._in_place:
            flat = flat.new_zeros(self.count * self._width, flat.shape[-1]).index_copy_(0, self._slots, flat)
        hidden = torch.bmm(flat.view(self.count, self._width, -1), a_scaled)
        results = []
        for out, member in zip(outs, members):
            if member is None:
                results.append(out)
                continue
            b_t, start, end = member
            part = hidden if end - start == hidden.shape[-1] else hidden[:, :, start:end]
            if self._in_place and out.dtype == b_t.dtype and out.is_contiguous():
                results.append(out)
                out.view(self.count, self._width, -1).baddbmm_(part, b_t)  # out += part @ B^T, one op
                continue
            delta = torch.bmm(part, b_t).view(-1, b_t.shape[-1])
            if not self._in_place:
                delta = delta.index_select(0, self._slots)
            if out.dtype == b_t.dtype:
                results.append(out.add_(delta.view(out.shape)))
            else:  # added in the LoRA dtype and rounded once, as the packed path does
                results.append((out.to(b_t.dtype) + delta.view(out.shape)).to(out.dtype))
        return results


Linear = Callable[..., torch.Tensor]  # F.linear's signature: (x, weight, bias)


def _linear(layer: Any, x: torch.Tensor, lora: RowLoRA | None = None, linear: Linear = F.linear) -> torch.Tensor:
    """`layer(x)` without the module call: its base linear, plus each row's LoRA delta."""
    if isinstance(layer, MultiLoRALinear):
        out = linear(x, layer.base.weight, layer.base.bias)
        return out if lora is None else lora.apply_group((layer.name,), x, [out])[0]
    return linear(x, layer.weight, layer.bias)


def _grouped(lora: RowLoRA, layers: tuple[Any, ...], x: torch.Tensor, linear: Linear = F.linear) -> list[torch.Tensor]:
    """The outputs of `layers` (all fed `x`): each base layer, then their LoRA deltas together.
    (One matmul over the layers' weights side by side was no faster, built-in model or Llama 8 x 512.)"""
    if not all(isinstance(layer, MultiLoRALinear) for layer in layers):
        return [_linear(layer, x, lora, linear) for layer in layers]
    return lora.apply_group(tuple(layer.name for layer in layers), x,
                            [linear(x, layer.base.weight, layer.base.bias) for layer in layers])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for one new token per row: q [rows, heads, dim], keys and
    values [rows, kv heads, length, dim] (views of the cache), bias [rows, 1, 1, length] (0 or
    -inf); [rows, heads * dim] out. The query heads of one kv head share its keys (GQA) as one
    [group, dim] x [dim, length] product: SDPA's CPU kernel cost 2x this at one query row."""
    n, heads, dim = q.shape
    kv = keys.shape[1]
    scores = torch.matmul(q.reshape(n, kv, heads // kv, dim), keys.transpose(-1, -2))
    scores = torch.add(bias, scores, alpha=scale).softmax(dim=-1)
    return torch.matmul(scores, values).reshape(n, heads * dim)


def _llama_step(base: BaseModel, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], at: int, lora: RowLoRA) -> torch.Tensor:
    """One decode step of a Llama: next-token logits [rows, vocab] for `ids` [rows, 1] at
    `positions`, its keys and values written at cache index `at` of `kv` ([layers, rows, kv heads,
    length, head dim] each) and attending to [0, at] where `mask` [rows, 1, 1, at + 1] allows
    (bool, or a float bias of 0 and -inf).

    The same modules, weights and ops as transformers' LlamaForCausalLM.forward, called directly
    on [rows, hidden] activations: its per-call machinery (cache objects growing by
    concatenation, mask building, output records) costs more than a small model's whole step,
    and a preallocated cache is bounded up front. The large linears go through the base's packed
    weights (engine/kernels.py); in float32 the attention of the one new token is two batched
    matmuls (`_attend`)."""
    model, linear = base.model, base.linears.linear
    inner = model.model
    keys, values = kv
    n = ids.shape[0]
    hidden = F.embedding(ids.view(n), inner.embed_tokens.weight)
    cos, sin = rotary(inner, hidden, positions.view(n))
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = _grouped(lora, (attn.q_proj, attn.k_proj, attn.v_proj), rms_norm(layer.input_layernorm, hidden),
                           linear)
        dim = attn.head_dim
        heads, kv_heads = q.shape[-1] // dim, k.shape[-1] // dim
        both = rotate(torch.cat((q, k), dim=-1).view(n, heads + kv_heads, dim), cos, sin)
        keys[i, :, :, at] = both[:, heads:]
        values[i, :, :, at] = v.view(n, kv_heads, dim)
        if mask.dtype == torch.bool or both.dtype != torch.float32:
            out = F.scaled_dot_product_attention(both[:, :heads, None], keys[i, :, :, :at + 1],
                                                 values[i, :, :, :at + 1],
                                                 attn_mask=mask if mask.dtype == torch.bool else mask.to(both.dtype),
                                                 scale=attn.scaling, enable_gqa=heads != kv_heads)
            out = out.reshape(n, heads * dim)
        else:
            out = _attend(both[:, :heads], keys[i, :, :, :at + 1], values[i, :, :, :at + 1], mask, attn.scaling)
        hidden = hidden + _linear(attn.o_proj, out, lora, linear)
        mlp = layer.mlp
        gate, up = _grouped(lora, (mlp.gate_proj, mlp.up_proj), rms_norm(layer.post_attention_layernorm, hidden),
                            linear)
        hidden = hidden + _linear(mlp.down_proj, mlp.act_fn(gate) * up, lora, linear)
    return _linear(model.lm_head, rms_norm(inner.norm, hidden), lora, linear)


# -- choosing tokens ------------------------------------------------------------------------

def _row_seed(seed: int, index: int) -> int:
    state = np.random.SeedSequence([seed, index]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@dataclass
class _Row:
    job: int
    adapter: LoRAAdapter | None
    spec: SampleSpec
    uniforms: torch.Tensor  # float64 [max_tokens]
    tokens: list[int] = field(default_factory=list)  # kept only for rows with stop strings (their text)
    stop_reason: str | None = None
    # incremental decoding for stop strings: tokens[prefix_at:read_at] were decoded last step
    # (context for the next), `tail` the last characters a stop string could still end across
    prefix_at: int = 0
    read_at: int = 0
    tail: str = ""
    keep: int = 0  # characters of `tail`: a stop string that ends later starts at most this far back

    def __post_init__(self) -> None:
        self.keep = max(map(len, self.spec.stop_strings), default=1) - 1


def _topk_lists(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token, logprob) of each row of `logp` [rows, vocab], logprob descending."""
    values, ids = logp.topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


_BLOCK = 256  # tokens per block of the two-level inverse CDF

# torch's float32 exp on CPU takes ~100x longer where its result is subnormal or zero (inputs below
# about -87.3): most of a 32,000-token vocabulary once a distribution is peaked or its temperature
# low. Weights below e^-87 (1.6e-38) are taken as e^-87: such a token is drawn with probability
# under 1e-33, and a sum that is at least 1 does not change in float32.
_EXP_FLOOR = -87.0


def _exp_floored(z: torch.Tensor) -> torch.Tensor:
    """exp(z) for logits less their max (z <= 0), at least e^_EXP_FLOOR."""
    return z.clamp_min(_EXP_FLOOR).exp_()


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [rows, vocab] (unnormalised probabilities, float32), the first token
    id whose cumulative weight, in id order, passes `u` (float64, [rows]) of the total. Up to
    4 x `_BLOCK` ids, one float64 cumulative sum; a larger vocabulary's CDF
    is taken in two levels: the weights' sums per block of `_BLOCK` ids, cumulated in float64,
    then the cumulative sum (float64) within the one block that holds the draw, searched at the
    draw's fraction of that block. (A float64 softmax and cumsum over a 32,000-token vocabulary
    cost 5% of a Llama 8 x 512 step.) Each row's pick depends only on its own weights and uniform."""
    rows, vocab = weights.shape
    if vocab <= 4 * _BLOCK:  # a small vocabulary: one float64 cumulative sum is cheaper than two levels
        cdf = weights.double().cumsum(dim=-1)
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1).squeeze(1)
    pad = -vocab % _BLOCK
    blocks = (F.pad(weights, (0, pad)) if pad else weights).view(rows, -1, _BLOCK)
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [rows, blocks]
    target = (u * ends[:, -1])[:, None]
    block = torch.searchsorted(ends, target, right=True).clamp(max=ends.shape[1] - 1)  # [rows, 1]
    before = ends.gather(1, (block - 1).clamp(min=0)).masked_fill(block == 0, 0.0)
    fraction = (target - before) / (ends.gather(1, block) - before)  # in [0, 1): the draw within its block
    inside = blocks.gather(1, block[:, :, None].expand(-1, 1, _BLOCK)).squeeze(1).double().cumsum(dim=-1)
    at = torch.searchsorted(inside, fraction * inside[:, -1:], right=True).clamp(max=_BLOCK - 1)
    return (block * _BLOCK + at).clamp(max=vocab - 1).squeeze(1)


def _pick(shifted: torch.Tensor, weights: torch.Tensor, u: torch.Tensor, temps: torch.Tensor,
          cut: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One token per row by inverse CDF at uniform `u` (float64): over the vocabulary in id
    order when the row keeps the whole distribution (`_inverse_cdf` of `weights`, each row's
    exp(`shifted` / temperature), `shifted` its logits less their max), over the tokens by
    descending probability (stable, float64) once top-k / top-p cut it (`cut`: those rows'
    positions, and every row's top-k and top-p). Each row's pick depends only on its own logits
    and uniform."""
    vocab = shifted.shape[-1]
    out = _inverse_cdf(weights, u)
    if cut is not None:
        filtered, top_k, top_p = cut
        zf = shifted.index_select(0, filtered).double() / temps.index_select(0, filtered)[:, None]
        z_sorted, order = torch.sort(zf, dim=-1, descending=True, stable=True)
        ps = torch.softmax(z_sorted, dim=-1)
        keep = torch.arange(vocab, device=zf.device)[None] < top_k.index_select(0, filtered)[:, None]
        keep &= (ps.cumsum(-1) - ps) < top_p.index_select(0, filtered)[:, None]  # the most likely is always kept
        cdf_f = (ps * keep).cumsum(-1)
        pick = torch.searchsorted(cdf_f, (u.index_select(0, filtered) * cdf_f[:, -1])[:, None], right=True)
        out = out.index_copy(0, filtered, order.gather(1, pick.clamp(max=vocab - 1)).squeeze(1))
    return out


# Tokens held back while they end inside a character (a byte-level tokenizer's partial UTF-8)
# before they are decoded anyway: bounds the decode per token when a model emits stray bytes.
_MAX_PENDING_TOKENS = 16


def _new_text(row: _Row, tokenizer: Any) -> str:
    """The text the newest token adds, decoded incrementally (vLLM's prefix / read offsets): the
    tokens since the last emitted text are decoded after the previous step's (for context), so
    the per-token cost does not grow with the text or the stop strings."""
    prefix = tokenizer.decode(row.tokens[row.prefix_at:row.read_at]) if row.read_at > row.prefix_at else ""
    full = tokenizer.decode(row.tokens[row.prefix_at:])
    complete = len(full) > len(prefix) and not full.endswith("\ufffd")
    if not complete and len(row.tokens) - row.prefix_at <= _MAX_PENDING_TOKENS:
        return ""
    row.prefix_at, row.read_at = row.read_at, len(row.tokens)
    return full[len(prefix):]


def _stopped(row: _Row, token: int, tokenizer: Any) -> bool:
    """Whether the newest token is a stop token or completes a stop string. A stop string can
    only newly appear ending at one of the characters this token added, so only those ends are
    checked, against the stop strings ending in that character (bounded by the submit limits of
    validation.py)."""
    row.tokens.append(token)
    if token in row.spec.stop_ids:
        return True
    if not row.spec.stop_strings:
        return False
    new = _new_text(row, tokenizer)
    if not new:
        return False
    text = row.tail + new
    start = len(row.tail)
    by_last = row.spec.stop_by_last
    for i, char in enumerate(new):
        for stop in by_last.get(char, ()):
            if text.endswith(stop, 0, start + i + 1):
                return True
    row.tail = text[-row.keep:] if row.keep else ""
    return False


# -- one batch, decoded over as many cycles as it needs --------------------------------------

class _Decoding:
    """One chunk's samples: the prefill when made, then `advance()` a bounded number of decode
    steps per cycle, so a long sample shares the clock instead of holding it (the KV cache and
    each row's place are kept between cycles). A row's choices depend only on its own uniforms
    and step, so how the decode is cut into cycles does not change a sample.

    Each prompt is prefilled once and its KV cache expanded to its `num_samples` rows; then
    every row of every tenant advances in one batched forward per token, each through its own
    adapter (`RowLoRA`). A row's state lives in tensors ([rows, max_tokens] tokens, logprobs,
    uniforms; per-row temperature, top-k, top-p, stop ids, length limit), so a step's work in
    Python does not grow with the rows; only rows with stop strings decode their text."""

    def __init__(self, base: BaseModel, items: list[tuple[LoRAAdapter | None, SampleSpec]]):
        self.base, self.items = base, items
        model, device = base.model, base.device
        prompts = [job.prompt for _, job in items]
        ids, valid, positions = _left_pad(prompts, device)
        length = ids.shape[1]
        self.rows: list[_Row] = []
        for j, (adapter, job) in enumerate(items):
            for k in range(job.num_samples):
                gen = torch.Generator(device="cpu").manual_seed(_row_seed(job.seed, k))
                self.rows.append(_Row(j, adapter, job, torch.rand(job.max_tokens, generator=gen, dtype=torch.float64)))
        self.cache = _new_cache(model) if self.rows else None
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        prompt_side = any(job.prompt_logprobs or job.topk_prompt_logprobs or job.target_prompt_ids is not None
                          or job.prompt_alt_tokens_k for _, job in items)
        logits = _forward(model, ids, _prefill_mask(valid), positions, [a for a, _ in items], self.cache,
                          last_only=not prompt_side)
        self.prompt_side = [_prompt_side(logits[i, length - len(job.prompt):length - 1] if prompt_side
                                         else logits[i, :0], job) for i, (_, job) in enumerate(items)]
        self.left = [job.num_samples if not job.logprobs_only else 0 for _, job in items]  # rows still running
        self.reported: set[int] = set()
        self.active_rows: list[int] = []
        self.step_logits: torch.Tensor | None = None
        self.step = 0
        if self.rows:
            self._init_rows(logits, valid, positions, length)

    def _init_rows(self, logits: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        rows, device, vocab = self.rows, self.base.device, logits.shape[-1]
        longest = max(r.spec.max_tokens for r in rows)
        n = len(rows)
        index = torch.tensor([r.job for r in rows], device=device)
        self.step_logits = logits[index, -1]
        assert self.cache is not None
        self.cache.batch_select_indices(index)
        # the mask of every position a row will attend to: its prompt's, then all generated tokens
        self.valid = torch.cat([valid[index], valid.new_ones(n, longest)], dim=1)
        self.prompt_len = length
        self.pos0 = positions[index, -1] + 1
        uniforms = torch.zeros(n, longest, dtype=torch.float64)
        for i, r in enumerate(rows):
            uniforms[i, :r.spec.max_tokens] = r.uniforms
        self.uniforms = uniforms.to(device)
        specs = [r.spec for r in rows]
        self.greedy = torch.tensor([s.temperature == 0 for s in specs], device=device)
        self.temps = torch.tensor([s.temperature or 1.0 for s in specs], dtype=torch.float64, device=device)
        self.top_k = torch.tensor([s.top_k or vocab for s in specs], device=device)
        self.top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float64, device=device)
        self.filtered = torch.tensor([s.temperature != 0 and (0 < s.top_k < vocab or s.top_p < 1) for s in specs],
                                     device=device)
        self.max_tokens = torch.tensor([s.max_tokens for s in specs], device=device)
        width = max(len(s.stop_ids) for s in specs)
        self.stop_ids = None
        if width:
            table = torch.full((n, width), -1, dtype=torch.long)
            for i, s in enumerate(specs):
                table[i, :len(s.stop_ids)] = torch.tensor(sorted(s.stop_ids), dtype=torch.long)
            self.stop_ids = table.to(device)
        self.tokens = torch.zeros(n, longest, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(n, longest, dtype=torch.float32, device=device)
        self.ends = [0] * n
        self.topk_width = max(s.topk_sample_logprobs for s in specs)
        if self.topk_width:
            self.topk_ids = torch.zeros(n, longest, self.topk_width, dtype=torch.long, device=device)
            self.topk_values = torch.zeros(n, longest, self.topk_width, dtype=torch.float32, device=device)
        self.lora = _DecodeLoRA([r.adapter for r in rows], device)
        if _is_llama(self.base.model):  # its KV cache in two preallocated tensors, the prompt's copied in
            keys = [layer.keys for layer in self.cache.layers]
            values = [layer.values for layer in self.cache.layers]
            shape = (len(keys), n, keys[0].shape[1], length + longest, keys[0].shape[-1])
            kv = (keys[0].new_zeros(shape), values[0].new_zeros(shape))
            for i, (k, v) in enumerate(zip(keys, values)):
                kv[0][i, :, :, :length] = k
                kv[1][i, :, :, :length] = v
            self.kv = kv
            self.cache = None
            if kv[0].dtype == torch.float32:  # `_attend`'s additive mask: 0 where a row attends, else -inf
                self.valid = torch.zeros(self.valid.shape, device=device).masked_fill_(~self.valid, float("-inf"))
        self.active_rows = list(range(n))
        self._select(torch.arange(n, device=device))

    def _select(self, active: torch.Tensor) -> None:
        """The rows that go on (indices into `rows`), and what each step needs about them, taken
        once per change of rows rather than once a step."""
        self.active = active
        self.lora.select(active)
        self.text_rows = [a for a, i in enumerate(self.active_rows) if self.rows[i].spec.stop_strings]
        self.max_now = self.max_tokens.index_select(0, active)
        self.stop_now = None if self.stop_ids is None else self.stop_ids.index_select(0, active)
        # rows that end only at their max_tokens end at steps known here: no check, no sync, until one does
        self.length_only = self.stop_now is None and not self.text_rows
        self.ending_at = {self.rows[i].spec.max_tokens for i in self.active_rows}
        stochastic = (~self.greedy.index_select(0, active)).nonzero().squeeze(1)
        self.stochastic = stochastic if len(stochastic) else None
        if self.stochastic is not None:
            rows = active.index_select(0, stochastic)
            self.uniforms_now = self.uniforms.index_select(0, rows)
            self.temps_now = self.temps.index_select(0, rows)
            filtered = self.filtered.index_select(0, rows).nonzero().squeeze(1)
            # the rows top-k / top-p cut, with every row's top-k and top-p (`_pick`'s `cut`)
            self.cut = (filtered, self.top_k.index_select(0, rows), self.top_p.index_select(0, rows)) \
                if len(filtered) else None
            self.unit_temps = bool((self.temps_now == 1).all())

    @property
    def done(self) -> bool:
        return len(self.reported) == len(self.items)

    def advance(self, budget: StepBudget) -> dict[int, Any]:
        """Decode while the cycle's `budget` allows; returns the results of the jobs that
        finished, by index."""
        while self.active_rows and budget.take():
            self._step()
        finished = {}
        for j, left in enumerate(self.left):
            if left == 0 and j not in self.reported:
                finished[j] = self._result(j)
                self.reported.add(j)
        if self.done:
            self.release()
        return finished

    def release(self) -> None:
        """Let go of the KV cache and the per-row buffers (the large part) now."""
        self.cache = self.step_logits = self.kv = None
        self.active_rows = []
        if hasattr(self, "lora"):
            del self.lora, self.valid, self.uniforms
        self.__dict__.pop("uniforms_now", None)

    def _step(self) -> None:
        assert self.step_logits is not None
        step, active = self.step, self.active
        logits = self.step_logits.float()
        # the model's log-probabilities, of the chosen tokens only (no [rows, vocab] log-softmax):
        # log_softmax's own terms, whose exponentials are also the temperature-1 rows' weights
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        weights = _exp_floored(shifted)
        log_total = weights.sum(dim=-1).log()
        if self.stochastic is None:
            chosen = logits.argmax(dim=-1)
        else:
            u, temps = self.uniforms_now[:, step], self.temps_now
            everyone = len(self.stochastic) == len(active)  # (then no argmax over the vocabulary)
            mine = (lambda t: t) if everyone else (lambda t: t.index_select(0, self.stochastic))
            # each row's weights at its temperature, unnormalised (the largest is 1)
            weighted = mine(weights) if self.unit_temps else _exp_floored(mine(shifted) / temps.float()[:, None])
            picked = _pick(mine(shifted), weighted, u, temps, self.cut)
            chosen = picked if everyone else logits.argmax(dim=-1).index_copy(0, self.stochastic, picked)
        token_lp = shifted.gather(1, chosen[:, None]).squeeze(1) - log_total
        self.tokens[active, step] = chosen
        self.logprobs[active, step] = token_lp
        if self.topk_width:
            values, ids = shifted.topk(self.topk_width, dim=-1)
            self.topk_ids[active, step] = ids
            self.topk_values[active, step] = values - log_total[:, None]
        self.step = step + 1
        ended: torch.Tensor | None = None
        if self.length_only:
            if step + 1 in self.ending_at:  # else no row ends now, and nothing is checked
                ended = self.max_now <= step + 1
                stop = torch.zeros_like(ended)
        else:
            stop = torch.zeros_like(chosen, dtype=torch.bool)
            if self.stop_now is not None:
                stop = (self.stop_now == chosen[:, None]).any(dim=1)
            if self.text_rows:  # stop strings: the text each token adds, row by row (only these rows)
                where = torch.tensor(self.text_rows, device=chosen.device)
                text_stop = [_stopped(self.rows[self.active_rows[a]], tok, self.base.tokenizer)
                             for a, tok in zip(self.text_rows, chosen.index_select(0, where).tolist())]
                stop = stop.index_copy(0, where, torch.tensor(text_stop, device=chosen.device))
            ended = stop | (self.max_now <= step + 1)
            if not bool(ended.any()):  # one sync a step where a row may stop at any token
                ended = None
        if ended is not None:  # which rows finished
            for a, is_stop in zip(ended.nonzero().squeeze(1).tolist(), stop[ended].tolist()):
                i = self.active_rows[a]
                self.rows[i].stop_reason = "stop" if is_stop else "length"
                self.ends[i] = self.step
                self.left[self.rows[i].job] -= 1
            keep = (~ended).nonzero().squeeze(1)
            if len(keep) == 0:
                self.active_rows = []
                return
            if self.kv is not None:
                self.kv = (self.kv[0][:, keep], self.kv[1][:, keep])
            else:
                assert self.cache is not None
                self.cache.batch_select_indices(keep)
            self.valid, self.pos0, chosen = self.valid[keep], self.pos0[keep], chosen[keep]
            self.active_rows = [self.active_rows[a] for a in keep.tolist()]
            self._select(active[keep])
        mask = self.valid[:, None, None, :self.prompt_len + self.step]
        positions = (self.pos0 + step)[:, None]
        with torch.no_grad(), active_plan(PackPlan(segments=[], seq_lens=None, rows=self.lora)):
            if self.kv is not None:
                self.step_logits = _llama_step(self.base, chosen[:, None], positions, mask, self.kv,
                                               self.prompt_len + step, self.lora)
            else:
                kwargs: dict[str, Any] = dict(input_ids=chosen[:, None], attention_mask=mask,
                                              position_ids=positions, use_cache=True)
                kwargs[_cache_kwarg(self.base.model)] = self.cache
                self.step_logits = self.base.model(**kwargs).logits[:, -1]

    def _result(self, j: int) -> Any:
        job, side = self.items[j][1], self.prompt_side[j]
        if job.logprobs_only:
            return side.logprobs
        sequences = []
        for i, r in enumerate(self.rows):
            if r.job != j:
                continue
            end = self.ends[i]
            topk: list[list[tuple[int, float]] | None] | None = None
            if job.topk_sample_logprobs:
                k = job.topk_sample_logprobs
                topk = [list(zip(ids, values)) for ids, values in
                        zip(self.topk_ids[i, :end, :k].tolist(), self.topk_values[i, :end, :k].tolist())]
            sequences.append(SampledSequence(tokens=self.tokens[i, :end].tolist(),
                                             logprobs=self.logprobs[i, :end].tolist(),
                                             stop_reason="stop" if r.stop_reason == "stop" else "length",
                                             topk_logprobs=topk))
        return SampleResponse(sequences=sequences, prompt_logprobs=side.logprobs, topk_prompt_logprobs=side.topk,
                              target_prompt_logprobs=side.targets, prompt_alt_tokens=side.alt)


@dataclass
class _PromptSide:
    """What a request asked for about its prompt (each None if not asked for)."""

    logprobs: list[float | None] | None = None
    topk: list[list[tuple[int, float]] | None] | None = None
    targets: TensorData | None = None
    alt: PromptAltTokens | None = None


def _prompt_side(logits: torch.Tensor, job: SampleSpec) -> _PromptSide:
    """From the prefill's logits of positions 0..n-2 (row i predicts prompt[i + 1]): prompt
    logprobs and top-k of the last `prompt_logprobs_last_n` positions (all but the first by
    default; None elsewhere), the logprobs of `target_prompt_ids`, and alternative draws."""
    side = _PromptSide()
    n = len(job.prompt)
    want_rows = job.prompt_logprobs or job.topk_prompt_logprobs
    want_all = job.target_prompt_ids is not None or job.prompt_alt_tokens_k
    if not (want_rows or want_all) or n < 2:
        if job.prompt_logprobs:
            side.logprobs = [None] * n
        if job.topk_prompt_logprobs:
            side.topk = [None] * n
        return side
    # positions first..n-1 are scored; only their rows need a log-softmax over the vocabulary
    first = 1 if job.prompt_logprobs_last_n is None else n - job.prompt_logprobs_last_n
    start = 0 if want_all else first - 1
    lp = torch.log_softmax(logits[start:].float(), dim=-1)  # row r: position start + r + 1
    scored = lp[first - 1 - start:]
    unscored: list[None] = [None] * first
    if job.prompt_logprobs:
        target = torch.tensor(job.prompt[first:], dtype=torch.long, device=lp.device)
        side.logprobs = unscored + scored.gather(1, target[:, None]).squeeze(1).tolist()
    if job.topk_prompt_logprobs:
        side.topk = [*unscored, *_topk_lists(scored, job.topk_prompt_logprobs)]
    if job.target_prompt_ids is not None:
        ids = torch.tensor(job.target_prompt_ids, dtype=torch.long, device=lp.device).reshape(n - 1, -1)
        values = lp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
        side.targets = TensorData(values.cpu().numpy(), "float32")
    if job.prompt_alt_tokens_k:
        side.alt = _alt_tokens(logits.float(), lp, job)
    return side


def _alt_tokens(logits: torch.Tensor, lp: torch.Tensor, job: SampleSpec) -> PromptAltTokens:
    """k draws with replacement per prompt position at the request's temperature (greedy at 0),
    from a generator of their own: the request's seed gives the same draws every time."""
    k = job.prompt_alt_tokens_k
    if job.temperature == 0:
        ids = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        probs = torch.softmax(logits.double().cpu() / job.temperature, dim=-1)
        gen = torch.Generator(device="cpu").manual_seed(_row_seed(job.seed, _ALT_STREAM))
        ids = torch.multinomial(probs, k, replacement=True, generator=gen).to(lp.device)
    return PromptAltTokens(tokens=TensorData(ids.cpu().numpy(), "int64"),
                           logprobs=TensorData(lp.gather(1, ids).cpu().numpy(), "float32"))


_ALT_STREAM = 1 << 32  # a seed index no sample row uses (rows count from 0)


def _chunks(jobs: list[SampleSpec], budget: int) -> list[list[int]]:
    """Jobs in order, cut so that each prefill holds at most `budget` (padded) tokens."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, job in enumerate(jobs):
        n = len(job.prompt)
        if current and (len(current) + 1) * max(longest, n) > budget:
            chunks.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        chunks.append(current)
    return chunks


class StepBudget:
    """The decode steps of one cycle, shared by every decoding in it: `forced` steps whatever
    the time (so sampling always progresses), then more while the cycle is younger than
    `min_cycle_s` or than twice the time its other work took (sampling's fair share: as much
    as the rest of the cycle). So sampling fills a cycle without stretching it beyond
    max(min_cycle_s, 2 x its other work) + `forced` steps. `forced=None`: no bound (each
    sample decodes to its end in its cycle)."""

    def __init__(self, forced: int | None, boundary: float = 0.0, min_cycle_s: float = 0.0):
        self.forced, self.boundary, self.min_cycle_s = forced, boundary, min_cycle_s
        self.until: float | None = None

    def take(self) -> bool:
        if self.forced is None:
            return True
        now = time.perf_counter()
        if self.until is None:  # the first step of the cycle: the rest of its work is done
            self.until = self.boundary + max(self.min_cycle_s, 2 * (now - self.boundary))
        if self.forced > 0:
            self.forced -= 1
            return True
        return now < self.until


class SampleCarry:
    """The decodings of one cycle's sample requests that did not finish in it."""

    def __init__(self, decodings: list[tuple[list[int], _Decoding]], finish: Callable[[int, Any], Any]):
        self._decodings = decodings
        self._finish = finish

    @property
    def done(self) -> bool:
        return all(d.done for _, d in self._decodings)

    def advance(self, budget: StepBudget) -> dict[int, Any]:
        """One cycle's share: the outcomes of the requests that finished, by their index in the group."""
        out: dict[int, Any] = {}
        for chunk, decoding in self._decodings:
            if decoding.done:
                continue
            try:
                finished = decoding.advance(budget)
            except Exception as exc:
                finished = {j: _sampling_failed(exc) for j in range(len(chunk)) if j not in decoding.reported}
                decoding.reported.update(finished)
                decoding.release()
            for j, result in finished.items():
                out[chunk[j]] = self._finish(chunk[j], result)
        return out


def _sampling_failed(exc: Exception) -> RequestFailedError:
    err = RequestFailedError(f"sampling failed: {type(exc).__name__}: {exc}", category=RequestErrorCategory.Server)
    err.__cause__ = exc
    return err


def run_sample_batch(base: BaseModel, items: list[tuple[LoRAAdapter | None, SampleSpec]], token_budget: int,
                     budget: StepBudget | None = None,
                     finish: Callable[[int, Any], Any] = lambda i, outcome: outcome) -> list[Any]:
    """Every sample / compute_logprobs request of a cycle on `base`, each (adapter, spec): one
    outcome (a SampleResponse, a list of prompt logprobs, or an exception) per request, passed
    through `finish(index, outcome)`, or `Later` for those whose decode goes on in the next
    cycles, as the cycle's `budget` allows (None: everything decodes now)."""
    budget = budget or StepBudget(None)
    specs = [spec for _, spec in items]
    outcomes: list[Any] = [None] * len(items)
    unfinished: list[tuple[list[int], _Decoding]] = []
    for chunk in _chunks(specs, token_budget):
        try:
            decoding = _Decoding(base, [items[i] for i in chunk])
            results = decoding.advance(budget)
        except Exception as exc:
            results = {j: _sampling_failed(exc) for j in range(len(chunk))}
        else:
            if not decoding.done:
                unfinished.append((chunk, decoding))
        for j, result in results.items():
            outcomes[chunk[j]] = finish(chunk[j], result)
    if unfinished:
        later = Later(SampleCarry(unfinished, finish))  # one carry for all of them: the pool advances it
        outcomes = [later if o is None else o for o in outcomes]
    return outcomes
