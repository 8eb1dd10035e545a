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
import time
from collections.abc import Callable, Sequence
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


# -- one batch, decoded over as many cycles as it needs --------------------------------------

class _Decoding:
    """One chunk's samples: the prefill when made, then `advance()` a bounded number of decode
    steps per cycle, so a long sample shares the clock instead of holding it (the KV cache and
    each row's place are kept between cycles). A row's choices depend only on its own uniforms
    and step, so how the decode is cut into cycles does not change a sample."""

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
        logits = _forward(model, ids, _prefill_mask(valid), positions, [a for a, _ in items], self.cache)
        self.prompt_side = [_prompt_side(logits[i, length - len(job.prompt):length - 1], job)
                            for i, (_, job) in enumerate(items)]
        self.left = [job.num_samples if not job.logprobs_only else 0 for _, job in items]  # rows still running
        self.reported: set[int] = set()
        self.active: list[int] = []
        self.step_logits: torch.Tensor | None = None
        if self.rows and self.cache is not None:
            index = torch.tensor([r.job for r in self.rows], device=device)
            self.step_logits = logits[index, -1]
            self.cache.batch_select_indices(index)
            self.valid = valid[index]
            self.next_pos = positions[index, -1] + 1
            self.active = list(range(len(self.rows)))
        self.step = 0

    @property
    def done(self) -> bool:
        return len(self.reported) == len(self.items)

    def advance(self, budget: StepBudget) -> dict[int, Any]:
        """Decode while the cycle's `budget` allows; returns the results of the jobs that
        finished, by index."""
        while self.active and budget.take():
            self._step()
        finished = {}
        for j, left in enumerate(self.left):
            if left == 0 and j not in self.reported:
                finished[j] = self._result(j)
                self.reported.add(j)
        if self.done:
            self.cache = self.step_logits = None  # the KV cache is the large part: let it go now
        return finished

    def _step(self) -> None:
        assert self.step_logits is not None and self.cache is not None
        rows, device = self.rows, self.base.device
        chosen, lps = _choose(self.step_logits, [rows[i] for i in self.active], self.step)
        keep = []
        for a, (i, tok, token_lp) in enumerate(zip(self.active, chosen, lps)):
            row = rows[i]
            row.tokens.append(tok)
            row.logprobs.append(token_lp)
            if _stopped(row, self.base.tokenizer):
                row.stop_reason = "stop"
            elif len(row.tokens) >= row.spec.max_tokens:
                row.stop_reason = "length"
            else:
                keep.append(a)
            if row.stop_reason is not None:
                self.left[row.job] -= 1
        if not keep:
            self.active = []
            return
        last = torch.tensor(chosen, dtype=torch.long, device=device)
        if len(keep) < len(self.active):
            sel = torch.tensor(keep, device=device)
            self.cache.batch_select_indices(sel)
            self.valid, self.next_pos, last = self.valid[sel], self.next_pos[sel], last[sel]
            self.active = [self.active[a] for a in keep]
        self.valid = torch.cat([self.valid, self.valid.new_ones(len(self.active), 1)], dim=1)
        self.step_logits = _forward(self.base.model, last[:, None], self.valid[:, None, None, :],
                                    self.next_pos[:, None], [rows[i].adapter for i in self.active],
                                    self.cache)[:, -1]
        self.next_pos = self.next_pos + 1
        self.step += 1

    def _result(self, j: int) -> Any:
        job, side = self.items[j][1], self.prompt_side[j]
        if job.logprobs_only:
            return side.logprobs
        sequences = [SampledSequence(tokens=r.tokens, logprobs=r.logprobs,
                                     stop_reason="stop" if r.stop_reason == "stop" else "length",
                                     topk_logprobs=list(r.topk) if job.topk_sample_logprobs else None)
                     for r in self.rows if r.job == j]
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
                decoding.cache = decoding.step_logits = None
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
