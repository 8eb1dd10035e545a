"""The work of one cycle: every tenant's forward(_backward) packed into shared passes.

A tenant's loss is a sum over its own tokens, so the gradient that reaches its adapter
from the packed pass equals its solo gradient. A tenant whose work fails (its custom
loss raises, its loss or gradient is not finite) is dropped and the pass is run again
without it: the others' results are then exactly those of a cycle it was never in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import RequestFailedError
from ..types import Datum, ForwardBackwardOutput, TensorData
from .lora import LoRAAdapter, all_finite
from .losses import LOSSES
from .models import BaseModel
from .packing import PackPlan, Segment, active_plan


@dataclass
class PreparedDatum:
    input_ids: torch.Tensor  # int64 [L]
    target_tokens: torch.Tensor  # int64 [L]
    inputs: dict[str, torch.Tensor]  # float32 [L] each: weights, logprobs, advantages

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ForwardJob:
    adapter: LoRAAdapter | None  # None: the bare base model
    data: list[PreparedDatum]
    loss_fn: str  # a built-in name, or "custom"
    config: dict[str, float]
    backward: bool
    custom_fn: Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict]] | None = None
    raw_data: list[Datum] | None = None
    client_id: str = ""
    # filled in while running
    error: BaseException | None = None
    surrogate: list[torch.Tensor] | None = field(default=None, repr=False)
    custom_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(d.length for d in self.data)


def _micro_batches(jobs: list[ForwardJob], token_budget: int) -> list[list[tuple[int, int]]]:
    """(job, datum) pairs in order, cut so that each micro-batch holds at most `token_budget`
    tokens (a longer datum gets a micro-batch of its own)."""
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    used = 0
    for j, job in enumerate(jobs):
        for d, datum in enumerate(job.data):
            if current and used + datum.length > token_budget:
                batches.append(current)
                current, used = [], 0
            current.append((j, d))
            used += datum.length
    if current:
        batches.append(current)
    return batches


def _target_logprobs(base: BaseModel, jobs: list[ForwardJob],
                     batch: list[tuple[int, int]]) -> tuple[list[torch.Tensor], PackPlan]:
    """One packed forward; returns the log-probability of each datum's targets, and the plan
    (whose `flush_grads` hands the adapters their gradients after a backward)."""
    data = [jobs[j].data[d] for j, d in batch]
    lengths = [x.length for x in data]
    ids = torch.cat([x.input_ids for x in data]).to(base.device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(base.device)
    segments: list[Segment] = []
    start = 0
    for (j, _), n in zip(batch, lengths):
        if segments and segments[-1].adapter is jobs[j].adapter and segments[-1].end == start:
            segments[-1].end += n
        else:
            segments.append(Segment(start, start + n, jobs[j].adapter))
        start += n
    plan = PackPlan(segments=segments, seq_lens=lengths)
    with active_plan(plan):
        logits = base.model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    targets = torch.cat([x.target_tokens for x in data]).to(base.device)
    logp = -F.cross_entropy(logits.float(), targets, reduction="none")  # one op for the whole row
    return list(logp.split(lengths)), plan


def _datum_loss(job: ForwardJob, d: int, logp: torch.Tensor, device: torch.device) -> torch.Tensor:
    if job.loss_fn == "custom":
        assert job.surrogate is not None
        # d(custom loss)/d(logprob) as fixed weights: same gradient as the custom loss
        return job.surrogate[d].to(device) * logp
    inputs = {k: v.to(device) for k, v in job.data[d].inputs.items()}
    return LOSSES[job.loss_fn](logp, inputs, job.config)


def _run_custom_loss(base: BaseModel, job: ForwardJob, token_budget: int) -> None:
    """First pass for forward_backward_custom: the user's loss on detached logprobs."""
    with torch.no_grad():
        logps: list[torch.Tensor] = []
        for batch in _micro_batches([job], token_budget):
            logps.extend(_target_logprobs(base, [job], batch)[0])
    leaves = [lp.detach().cpu().float().requires_grad_(True) for lp in logps]
    try:
        loss, metrics = job.custom_fn(job.raw_data, leaves)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"the loss function must return (scalar tensor, dict), got {type(loss).__name__}")
        loss.backward()
    except Exception as exc:
        raise RequestFailedError(
            f"forward_backward_custom: your loss function raised {type(exc).__name__}: {exc}",
            client_id=job.client_id) from exc
    grads = [lp.grad if lp.grad is not None else torch.zeros_like(lp) for lp in leaves]
    value = float(loss.detach())
    if not math.isfinite(value) or not all(torch.isfinite(g).all() for g in grads):
        raise RequestFailedError("forward_backward_custom: the loss or its gradient is not finite",
                                 client_id=job.client_id)
    job.surrogate = [g.detach() for g in grads]
    job.custom_metrics = {"loss:sum": value, **{k: float(v) for k, v in (metrics or {}).items()}}


@dataclass
class _PassResult:
    loss_sum: float
    logprobs: list[torch.Tensor]
    elementwise: list[torch.Tensor]
    grads: torch.Tensor | None  # the adapter's flat gradient from this pass


def _run_pass(base: BaseModel, jobs: list[ForwardJob], token_budget: int, backward: bool) -> list[_PassResult]:
    results = [_PassResult(0.0, [None] * len(j.data), [None] * len(j.data), None) for j in jobs]
    if backward:
        for job in jobs:
            job.adapter.begin_pass()
    try:
        for batch in _micro_batches(jobs, token_budget):
            with torch.set_grad_enabled(backward):
                logps, plan = _target_logprobs(base, jobs, batch)
                total = None
                for (j, d), logp in zip(batch, logps):
                    elementwise = _datum_loss(jobs[j], d, logp, base.device)
                    datum_loss = elementwise.sum()
                    results[j].loss_sum += float(datum_loss.detach())
                    results[j].logprobs[d] = logp.detach().float().cpu()
                    results[j].elementwise[d] = elementwise.detach().float().cpu()
                    total = datum_loss if total is None else total + datum_loss
                if backward and total is not None and total.requires_grad:
                    total.backward()
                    plan.flush_grads()
    finally:  # the adapters let go of the pass's buffers even when the pass breaks
        if backward:
            for job, result in zip(jobs, results):
                result.grads = job.adapter.end_pass()
    return results


def _finite(result: _PassResult) -> bool:
    if not math.isfinite(result.loss_sum):
        return False
    return result.grads is None or all_finite(result.grads)


def _output(job: ForwardJob, result: _PassResult) -> ForwardBackwardOutput:
    outputs = [{"logprobs": TensorData.from_torch(lp), "elementwise_loss": TensorData.from_torch(el)}
               for lp, el in zip(result.logprobs, result.elementwise)]
    metrics = dict(job.custom_metrics) if job.loss_fn == "custom" else {"loss:sum": result.loss_sum}
    return ForwardBackwardOutput(loss_fn_output_type=job.loss_fn, loss_fn_outputs=outputs, metrics=metrics)


def run_forward_jobs(base: BaseModel, jobs: list[ForwardJob], token_budget: int) -> list[Any]:
    """Run a cycle's forward jobs on one base; returns per job a ForwardBackwardOutput or an exception.

    Gradients are added to each adapter's accumulator only when every tenant left in
    the pass has finished cleanly.
    """
    outcomes: list[Any] = [None] * len(jobs)
    for i, job in enumerate(jobs):
        if job.loss_fn == "custom":
            try:
                _run_custom_loss(base, job, token_budget)
            except RequestFailedError as exc:
                outcomes[i] = exc
    for backward in (False, True):
        alive = [i for i, job in enumerate(jobs) if job.backward == backward and outcomes[i] is None]
        while alive:
            try:
                results = _run_pass(base, [jobs[i] for i in alive], token_budget, backward)
            except Exception as exc:  # the shared pass itself broke (e.g. out of memory): all fail
                for i in alive:
                    outcomes[i] = RequestFailedError(f"the cycle's packed pass failed: {type(exc).__name__}: {exc}",
                                                     client_id=jobs[i].client_id)
                    outcomes[i].__cause__ = exc
                break
            bad = [i for i, r in zip(alive, results) if not _finite(r)]
            if not bad:
                for i, result in zip(alive, results):
                    if backward:
                        jobs[i].adapter.accumulate(result.grads)
                    outcomes[i] = _output(jobs[i], result)
                break
            for i in bad:
                outcomes[i] = RequestFailedError(
                    f"{'forward_backward' if backward else 'forward'}: the loss or the gradient is not finite "
                    f"(NaN or infinite); this request changed nothing", client_id=jobs[i].client_id)
            alive = [i for i in alive if i not in bad]
    return outcomes
