"""Sampling and prompt log-probabilities, run by the clock like any other request.

Every `sample` and `compute_logprobs` request of a cycle on one base model is served
by one batch (cut only to respect the pool's token budget): the distinct prompts are
left-padded into one [jobs, length] prefill, the KV cache is then expanded to one row
per sample, and a single decode loop advances all rows together, each row with its own
tenant's LoRA delta (a `PackPlan` segment per run of rows with the same adapter).
Rows that stop are dropped from the batch, so finished samples cost nothing.

Determinism: row j of a request with seed s draws its uniforms from its own generator
seeded by (s, j), and a token is picked by inverse CDF over the filtered distribution,
so the same seed gives the same samples whatever else shares the cycle.

`logprobs` are the model's own log-probabilities (temperature 1, no top-k / top-p),
the quantity importance-sampling losses need and what `compute_logprobs` returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import RequestErrorCategory, RequestFailedError
from ..types import PromptAltTokens, SampledSequence, SampleResponse, TensorData
from ..validation import SampleSpec
from .lora import LoRAAdapter
from .models import BaseModel
from .packing import PackPlan, Segment, active_plan

__all__ = ["forward_logits", "run_sample_batch"]


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
             adapters: Sequence[LoRAAdapter | None], cache=None) -> torch.Tensor:
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                                  use_cache=cache is not None)
    if cache is not None:
        kwargs[_cache_kwarg(model)] = cache
    with torch.no_grad(), active_plan(PackPlan(segments=_segments(adapters, ids.shape[1]), seq_lens=None)):
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
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]] | None] = field(default_factory=list)
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


def _choose(logits: torch.Tensor, rows: list[_Row], step: int) -> tuple[list[int], list[float]]:
    """The next token of each row and its model log-probability (and, for rows that asked for
    top-k sample logprobs, the top k of the same distribution)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy = torch.tensor([r.spec.temperature == 0 for r in rows], device=logits.device)
    if greedy.any():
        out[greedy] = logits[greedy].argmax(dim=-1)
    stochastic = ~greedy
    if stochastic.any():
        picked = [r for r in rows if r.spec.temperature != 0]
        dev = logits.device
        temps = torch.tensor([r.spec.temperature for r in picked], dtype=torch.float64, device=dev)
        top_k = torch.tensor([r.spec.top_k or vocab for r in picked], device=dev)
        top_p = torch.tensor([r.spec.top_p for r in picked], dtype=torch.float64, device=dev)
        u = torch.stack([r.uniforms[step] for r in picked]).to(dev)
        z = logits[stochastic].double() / temps[:, None]
        z_sorted, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(z_sorted, dim=-1)
        keep = torch.arange(vocab, device=dev)[None] < top_k[:, None]
        keep &= (probs.cumsum(-1) - probs) < top_p[:, None]  # the most likely token is always kept
        cdf = (probs * keep).cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
        out[stochastic] = order.gather(1, pick).squeeze(1)
    chosen = logp.gather(1, out[:, None]).squeeze(1)
    k = max(r.spec.topk_sample_logprobs for r in rows)
    if k:
        for row, top in zip(rows, _topk_lists(logp, k)):
            if row.spec.topk_sample_logprobs:
                row.topk.append(top[:row.spec.topk_sample_logprobs])
    return out.tolist(), chosen.tolist()


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


def _stopped(row: _Row, tokenizer: Any) -> bool:
    """Whether the newest token is a stop token or completes a stop string. A stop string can
    only newly appear ending at one of the characters this token added, so only those ends are
    checked, against the stop strings ending in that character (bounded by the submit limits of
    validation.py)."""
    if row.tokens[-1] in row.spec.stop_ids:
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


# -- one batch ---------------------------------------------------------------------------------

def _run_chunk(base: BaseModel, items: list[tuple[LoRAAdapter | None, SampleSpec]]) -> list[Any]:
    model, device = base.model, base.device
    prompts = [job.prompt for _, job in items]
    adapters = [adapter for adapter, _ in items]
    ids, valid, positions = _left_pad(prompts, device)
    length = ids.shape[1]
    rows: list[_Row] = []
    for j, (adapter, job) in enumerate(items):
        for k in range(job.num_samples):
            gen = torch.Generator(device="cpu").manual_seed(_row_seed(job.seed, k))
            rows.append(_Row(j, adapter, job, torch.rand(job.max_tokens, generator=gen, dtype=torch.float64)))
    cache = _new_cache(model) if rows else None
    logits = _forward(model, ids, _prefill_mask(valid), positions, adapters, cache)

    prompt_side = [_prompt_side(logits[i, length - len(job.prompt):length - 1], job)
                   for i, (_, job) in enumerate(items)]

    if rows and cache is not None:
        index = torch.tensor([r.job for r in rows], device=device)
        step_logits = logits[index, -1]
        del logits
        cache.batch_select_indices(index)
        valid = valid[index]
        next_pos = positions[index, -1] + 1
        active = list(range(len(rows)))
        step = 0
        while True:
            chosen, lps = _choose(step_logits, [rows[i] for i in active], step)
            keep = []
            for a, (i, tok, token_lp) in enumerate(zip(active, chosen, lps)):
                row = rows[i]
                row.tokens.append(tok)
                row.logprobs.append(token_lp)
                if _stopped(row, base.tokenizer):
                    row.stop_reason = "stop"
                elif len(row.tokens) >= row.spec.max_tokens:
                    row.stop_reason = "length"
                else:
                    keep.append(a)
            if not keep:
                break
            last = torch.tensor(chosen, dtype=torch.long, device=device)
            if len(keep) < len(active):
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                valid, next_pos, last = valid[sel], next_pos[sel], last[sel]
                active = [active[a] for a in keep]
            valid = torch.cat([valid, valid.new_ones(len(active), 1)], dim=1)
            step_logits = _forward(model, last[:, None], valid[:, None, None, :], next_pos[:, None],
                                   [rows[i].adapter for i in active], cache)[:, -1]
            next_pos = next_pos + 1
            step += 1
    else:
        del logits

    results: list[Any] = []
    by_job: list[list[_Row]] = [[] for _ in items]
    for row in rows:
        by_job[row.job].append(row)
    for j, (_, job) in enumerate(items):
        side = prompt_side[j]
        if job.logprobs_only:
            results.append(side.logprobs)
        else:
            sequences = [SampledSequence(tokens=r.tokens, logprobs=r.logprobs,
                                         stop_reason="stop" if r.stop_reason == "stop" else "length",
                                         topk_logprobs=list(r.topk) if job.topk_sample_logprobs else None)
                         for r in by_job[j]]
            results.append(SampleResponse(sequences=sequences, prompt_logprobs=side.logprobs,
                                          topk_prompt_logprobs=side.topk, target_prompt_logprobs=side.targets,
                                          prompt_alt_tokens=side.alt))
    return results


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


def run_sample_batch(base: BaseModel, items: list[tuple[LoRAAdapter | None, SampleSpec]], token_budget: int
                     ) -> list[Any]:
    """Every sample / compute_logprobs request of a cycle on `base`, each (adapter, spec): one
    outcome (a SampleResponse, a list of prompt logprobs, or an exception) per request."""
    specs = [spec for _, spec in items]
    outcomes: list[Any] = [None] * len(items)
    for chunk in _chunks(specs, token_budget):
        try:
            results = _run_chunk(base, [items[i] for i in chunk])
        except Exception as exc:
            results = []
            for _ in chunk:
                err = RequestFailedError(f"sampling failed: {type(exc).__name__}: {exc}",
                                         category=RequestErrorCategory.Server)
                err.__cause__ = exc
                results.append(err)
        for i, result in zip(chunk, results):
            outcomes[i] = result
    return outcomes
