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
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InvalidInputError, RequestFailedError
from ..types import ModelInput, SampledSequence, SampleResponse, SamplingParams
from .clock import register_op
from .lora import LoRAAdapter
from .models import BaseModel
from .packing import PackPlan, Segment, active_plan

__all__ = ["SampleJob", "build_logprobs_job", "build_sample_job", "forward_logits"]


@dataclass
class SampleJob:
    """One validated request: a prompt and how to continue it (or only score it)."""

    prompt: list[int]
    num_samples: int  # 0 for compute_logprobs
    max_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    prompt_logprobs: bool = False
    logprobs_only: bool = False


# -- validation (submit time, caller's thread) -------------------------------------------

def _prompt_tokens(prompt: Any, base: BaseModel, field_name: str = "prompt") -> list[int]:
    if isinstance(prompt, ModelInput):
        tokens = prompt.to_ints()
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                   for t in prompt):
        tokens = [int(t) for t in prompt]
    else:
        raise InvalidInputError(f"expected a ModelInput (or a list of token ids), got {type(prompt).__name__}",
                                field=field_name)
    if not tokens:
        raise InvalidInputError("the prompt is empty: give at least one token", field=field_name)
    if len(tokens) > base.context_length:
        raise InvalidInputError(f"the prompt has {len(tokens)} tokens, more than the context of {base.name} "
                                f"({base.context_length})", field=field_name)
    for pos, tok in enumerate(tokens):
        if not (0 <= tok < base.vocab_size):
            raise InvalidInputError(f"token id {tok} at position {pos} is outside the vocabulary "
                                    f"[0, {base.vocab_size})", field=field_name)
    return tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _stops(stop: Any, base: BaseModel) -> tuple[frozenset[int], tuple[str, ...]]:
    where = "sampling_params.stop"
    if stop is None:
        return frozenset(), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidInputError(f"must be a string, a list of strings or a list of token ids, got "
                                f"{type(stop).__name__}", field=where)
    ids, strings = set(), []
    for item in stop:
        if isinstance(item, str):
            if not item:
                raise InvalidInputError("an empty stop string would stop at once", field=where)
            strings.append(item)
        elif _is_int(item):
            if not (0 <= item < base.vocab_size):
                raise InvalidInputError(f"stop token id {item} is outside the vocabulary [0, {base.vocab_size})",
                                        field=where)
            ids.add(int(item))
        else:
            raise InvalidInputError(f"stop entries must be strings or token ids, got {type(item).__name__}",
                                    field=where)
    if strings and base.tokenizer is None:
        raise InvalidInputError(f"{base.name} has no tokenizer, so stop strings cannot be matched; "
                                f"pass stop token ids instead", field=where)
    return frozenset(ids), tuple(strings)


def build_sample_job(base: BaseModel, prompt: Any, num_samples: Any, params: Any,
                     include_prompt_logprobs: bool) -> SampleJob:
    tokens = _prompt_tokens(prompt, base)
    if not _is_int(num_samples) or num_samples < 1:
        raise InvalidInputError(f"must be an integer >= 1, got {num_samples!r}", field="num_samples")
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"expected SamplingParams, got {type(params).__name__}", field="sampling_params")
    mt = params.max_tokens
    if not _is_int(mt) or mt < 1:
        raise InvalidInputError(f"must be an integer >= 1, got {mt!r}", field="sampling_params.max_tokens")
    if len(tokens) + mt > base.context_length:
        raise InvalidInputError(f"prompt ({len(tokens)} tokens) + max_tokens ({mt}) is more than the context of "
                                f"{base.name} ({base.context_length})", field="sampling_params.max_tokens")
    temp = params.temperature
    if not _is_number(temp) or not math.isfinite(temp) or temp < 0:
        raise InvalidInputError(f"must be a finite number >= 0 (0 is greedy), got {temp!r}",
                                field="sampling_params.temperature")
    top_k = params.top_k
    if not _is_int(top_k) or top_k < -1:
        raise InvalidInputError(f"must be -1 (off) or an integer >= 1, got {top_k!r}", field="sampling_params.top_k")
    top_p = params.top_p
    if not _is_number(top_p) or not (0 < top_p <= 1):
        raise InvalidInputError(f"must be in (0, 1], got {top_p!r}", field="sampling_params.top_p")
    seed = params.seed
    if seed is not None and not _is_int(seed):
        raise InvalidInputError(f"must be an integer or None, got {seed!r}", field="sampling_params.seed")
    stop_ids, stop_strings = _stops(params.stop, base)
    return SampleJob(prompt=tokens, num_samples=int(num_samples), max_tokens=int(mt), temperature=float(temp),
                     top_k=max(int(top_k), 0), top_p=float(top_p), stop_ids=stop_ids, stop_strings=stop_strings,
                     seed=int(seed) % 2**64 if seed is not None else secrets.randbits(63),
                     prompt_logprobs=bool(include_prompt_logprobs))


def build_logprobs_job(base: BaseModel, prompt: Any) -> SampleJob:
    return SampleJob(prompt=_prompt_tokens(prompt, base), num_samples=0, prompt_logprobs=True, logprobs_only=True)


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


def _new_cache(model: torch.nn.Module):
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
    spec: SampleJob
    uniforms: torch.Tensor  # float64 [max_tokens]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


def _choose(logits: torch.Tensor, rows: list[_Row], step: int) -> tuple[list[int], list[float]]:
    """The next token of each row and its model log-probability."""
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
    return out.tolist(), chosen.tolist()


def _stopped(row: _Row, tokenizer: Any) -> bool:
    if row.tokens[-1] in row.spec.stop_ids:
        return True
    if row.spec.stop_strings:
        window = max(len(s.encode("utf-8")) for s in row.spec.stop_strings) + 8
        text = tokenizer.decode(row.tokens[-window:])
        return any(s in text for s in row.spec.stop_strings)
    return False


# -- one batch ---------------------------------------------------------------------------------

def _run_chunk(base: BaseModel, items: list[tuple[LoRAAdapter | None, SampleJob]]) -> list[Any]:
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

    prompt_lps: list[list[float | None] | None] = [None] * len(items)
    for j, (_, job) in enumerate(items):
        if job.prompt_logprobs:
            n = len(job.prompt)
            lp = torch.log_softmax(logits[j, length - n:length - 1].float(), dim=-1)
            target = torch.tensor(job.prompt[1:], dtype=torch.long, device=lp.device)
            prompt_lps[j] = [None] + lp.gather(1, target[:, None]).squeeze(1).tolist()

    if rows:
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
            for a, (i, tok, lp) in enumerate(zip(active, chosen, lps)):
                row = rows[i]
                row.tokens.append(tok)
                row.logprobs.append(lp)
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
        if job.logprobs_only:
            results.append(prompt_lps[j])
        else:
            sequences = [SampledSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason=r.stop_reason)
                         for r in by_job[j]]
            results.append(SampleResponse(sequences=sequences, prompt_logprobs=prompt_lps[j]))
    return results


def _chunks(jobs: list[SampleJob], budget: int) -> list[list[int]]:
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


def run_sample_batch(pool: Any, base: BaseModel, group: list[tuple[Any, Any]]) -> list[Any]:
    """The clock's "sample" handler: every sample / compute_logprobs request of a cycle on `base`."""
    jobs: list[SampleJob] = [request.payload for _, request in group]
    outcomes: list[Any] = [None] * len(group)
    for chunk in _chunks(jobs, pool.max_tokens_per_pass):
        items = [(group[i][0].adapter, jobs[i]) for i in chunk]
        try:
            results = _run_chunk(base, items)
        except Exception as exc:
            results = []
            for i in chunk:
                err = RequestFailedError(f"{group[i][1].op} failed: {type(exc).__name__}: {exc}",
                                         client_id=group[i][1].client_id)
                err.__cause__ = exc
                results.append(err)
        for i, result in zip(chunk, results):
            outcomes[i] = result
            record = group[i][1].record
            if isinstance(result, SampleResponse):
                generated = sum(len(s.tokens) for s in result.sequences)
                record.tokens = len(jobs[i].prompt) + generated
                record.metrics["sampled_tokens:sum"] = float(generated)
                record.metrics["num_samples"] = float(len(result.sequences))
    return outcomes


register_op("sample", "sample", run_sample_batch)
register_op("compute_logprobs", "sample", run_sample_batch)
