"""The work of one cycle: every tenant's forward(_backward) packed into shared passes.

A tenant's loss is a sum over its own tokens, so the gradient that reaches its adapter
from the packed pass equals its solo gradient. A tenant whose work fails (its loss or
gradient is not finite) is dropped and the pass is run again without it: the others'
results are then exactly those of a cycle it was never in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RequestErrorCategory, RequestFailedError
from ..protocol.losses import forward_metrics, tokens_read
from ..types import ForwardBackwardOutput, TensorData
from ..validation import RequestLimits, check_batch
from .llama import is_llama, packed_logits
from .lora import LoRAAdapter, finite_flags
from .losses import IGNORE_TARGET, datum_loss
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
    """One forward-kind request, checked and turned into tensors (the payload its op's
    `prepare` queues): the data, the loss and whether to backpropagate."""

    data: list[PreparedDatum]
    loss_fn: str  # a built-in loss name
    config: dict[str, float]
    backward: bool
    token_count: int = 0  # pytrio's: the tokens the loss reads (counted at submit, off the clock)

    @property
    def tokens(self) -> int:
        return sum(d.length for d in self.data)


def make_forward_job(base: BaseModel, data: Any, loss_fn: str, config: dict[str, float], backward: bool,
                     request_limits: RequestLimits | None = None) -> tuple[ForwardJob, float]:
    """Check a batch against the loss and `base`, and turn it into a job; also its loss weight."""
    checked = check_batch(data, loss_fn, base.limits, request_limits)
    tensors = [PreparedDatum(torch.tensor(d.tokens, dtype=torch.long), torch.tensor(d.target_tokens, dtype=torch.long),
                             {k: torch.tensor(v, dtype=torch.float32) for k, v in d.floats.items()}) for d in checked]
    job = ForwardJob(data=tensors, loss_fn=loss_fn, config=config, backward=backward,
                     token_count=sum(tokens_read(loss_fn, d.length, d.floats.get("weights"), d.target_tokens)
                                     for d in checked))
    return job, sum(d.weight for d in checked)


@dataclass
class _Work:
    """A job of this cycle with the adapter it runs through (None: the bare base)."""

    adapter: LoRAAdapter | None
    job: ForwardJob
    client_id: str

    @property
    def trained(self) -> LoRAAdapter:
        """The adapter a backward pass writes to (only training clients send one)."""
        if self.adapter is None:
            raise RuntimeError(f"client {self.client_id} has no adapter to train")
        return self.adapter


def _micro_batches(jobs: list[_Work], token_budget: int) -> list[list[tuple[int, int]]]:
    """(job, datum) pairs in order, cut so that each micro-batch holds at most `token_budget`
    tokens (a longer datum gets a micro-batch of its own)."""
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    used = 0
    for j, work in enumerate(jobs):
        for d, datum in enumerate(work.job.data):
            if current and used + datum.length > token_budget:
                batches.append(current)
                current, used = [], 0
            current.append((j, d))
            used += datum.length
    if current:
        batches.append(current)
    return batches


def _target_logprobs(base: BaseModel, jobs: list[_Work],
                     batch: list[tuple[int, int]]) -> tuple[list[torch.Tensor], PackPlan]:
    """One packed forward; returns the log-probability of each datum's targets, and the plan
    (whose `flush_grads` hands the adapters their gradients after a backward)."""
    data = [jobs[j].job.data[d] for j, d in batch]
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
        if is_llama(base.model):
            logits = packed_logits(base, ids, positions, plan)
        else:
            logits = base.model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    targets = torch.cat([x.target_tokens for x in data]).to(base.device)
    # one op for the whole row; a target of -100 (IGNORE_TARGET) gets logp 0 and no gradient
    logp = -F.cross_entropy(logits.float(), targets, reduction="none", ignore_index=IGNORE_TARGET)
    return list(logp.split(lengths)), plan


def _datum_loss(job: ForwardJob, d: int, logp: torch.Tensor, device: torch.device) -> torch.Tensor:
    inputs = {k: v.to(device) for k, v in job.data[d].inputs.items()}
    return datum_loss(job.loss_fn, logp, inputs, job.config, job.data[d].target_tokens)


@dataclass
class _PassResult:
    loss_sum: float
    logprobs: list[Any]  # a tensor per datum once the pass ran
    elementwise: list[Any]
    grads: torch.Tensor | None  # the adapter's flat gradient from this pass


def _run_pass(base: BaseModel, jobs: list[_Work], token_budget: int, backward: bool) -> list[_PassResult]:
    results = [_PassResult(0.0, [None] * len(w.job.data), [None] * len(w.job.data), None) for w in jobs]
    # What the outputs need stays on the device until the pass is over, then crosses in one
    # transfer: a float() or .cpu() per datum would wait for a GPU once per datum.
    order: list[tuple[int, int]] = []
    losses: list[torch.Tensor] = []
    logps_out: list[torch.Tensor] = []
    elementwise_out: list[torch.Tensor] = []
    if backward:
        for work in jobs:
            work.trained.begin_pass()
    try:
        for batch in _micro_batches(jobs, token_budget):
            with torch.set_grad_enabled(backward):
                logps, plan = _target_logprobs(base, jobs, batch)
                total = None
                for (j, d), logp in zip(batch, logps):
                    elementwise = _datum_loss(jobs[j].job, d, logp, base.device)
                    datum_loss = elementwise.sum()
                    order.append((j, d))
                    losses.append(datum_loss.detach())
                    logps_out.append(logp.detach())
                    elementwise_out.append(elementwise.detach())
                    total = datum_loss if total is None else total + datum_loss
                if backward and total is not None and total.requires_grad:
                    total.backward()
                    plan.flush_grads()
    finally:  # the adapters let go of the pass's buffers even when the pass breaks
        if backward:
            for work, result in zip(jobs, results):
                result.grads = work.trained.end_pass()
    if order:
        lengths = [lp.shape[0] for lp in logps_out]
        for (j, _d), loss in zip(order, torch.stack(losses).float().tolist()):
            results[j].loss_sum += loss  # in datum order, in float64, as the loss was always summed
        for (j, d), lp, el in zip(order, torch.cat(logps_out).float().cpu().split(lengths),
                                  torch.cat(elementwise_out).float().cpu().split(lengths)):
            results[j].logprobs[d], results[j].elementwise[d] = lp, el
    return results


def _finite(results: list[_PassResult]) -> list[bool]:
    """Whether each pass result is usable: a finite loss and gradient (one sync for all)."""
    grads = finite_flags([r.grads for r in results])
    return [math.isfinite(r.loss_sum) and ok for r, ok in zip(results, grads)]


def _output(job: ForwardJob, result: _PassResult) -> ForwardBackwardOutput:
    outputs = [{"logprobs": TensorData.from_torch(lp), "elementwise_loss": TensorData.from_torch(el)}
               for lp, el in zip(result.logprobs, result.elementwise)]
    metrics = forward_metrics(result.loss_sum, job.token_count)
    return ForwardBackwardOutput(loss_fn_output_type=job.loss_fn, loss_fn_outputs=outputs, metrics=metrics)


def run_forward_jobs(base: BaseModel, items: list[tuple[LoRAAdapter | None, ForwardJob, str]],
                     token_budget: int) -> list[Any]:
    """Run a cycle's forward jobs on one base, each (adapter, job, client id); returns per job a
    ForwardBackwardOutput or an exception.

    Gradients are added to each adapter's accumulator only when every tenant left in
    the pass has finished cleanly.
    """
    jobs = [_Work(adapter, job, client_id) for adapter, job, client_id in items]
    outcomes: list[Any] = [None] * len(jobs)
    for backward in (False, True):
        alive = [i for i, work in enumerate(jobs) if work.job.backward == backward]
        while alive:
            try:
                results = _run_pass(base, [jobs[i] for i in alive], token_budget, backward)
            except Exception as exc:  # the shared pass itself broke (e.g. out of memory): all fail
                for i in alive:
                    outcomes[i] = RequestFailedError(f"the cycle's packed pass failed: {type(exc).__name__}: {exc}",
                                                     client_id=jobs[i].client_id, category=RequestErrorCategory.Server)
                    outcomes[i].__cause__ = exc
                break
            bad = [i for i, ok in zip(alive, _finite(results)) if not ok]
            if not bad:
                for i, result in zip(alive, results):
                    if backward and result.grads is not None:
                        jobs[i].trained.accumulate(result.grads)
                    outcomes[i] = _output(jobs[i].job, result)
                break
            for i in bad:
                outcomes[i] = RequestFailedError(
                    f"{'forward_backward' if backward else 'forward'}: the loss or the gradient is not finite "
                    f"(NaN or infinite); this request changed nothing", client_id=jobs[i].client_id,
                    category=RequestErrorCategory.User)
            alive = [i for i in alive if i not in bad]
    return outcomes
