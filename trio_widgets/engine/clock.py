"""LocalPool: a clock thread that runs every tenant's requests in lock-step cycles.

The rules (DESIGN.md, "Clock-cycle semantics"):

* A cycle lasts max(min_cycle_s, its compute time); an empty cycle still ticks.
* A request is eligible for cycle K only if it was queued before K's boundary; the
  boundary takes a snapshot of the queues.
* Per tenant per cycle: at most one forward-type op, then at most one optim_step, in
  submission order (state ops ride along in order; sample requests batch freely).
* Results of cycle K are delivered just after the boundary of cycle K+1.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch

from ..errors import ClientClosedError, InvalidInputError, PoolClosedError, RequestFailedError
from ..futures import APIFuture
from ..telemetry import ClientInfo, CycleRecord, QueueDepthRecord, RequestRecord, Telemetry
from .compute import ForwardJob, run_forward_jobs
from .lora import LoRAAdapter
from .models import BUILTIN_MODELS, BaseModel, auto_torch_threads, load_base_model, resolve_device

log = logging.getLogger(__name__)

OpKind = Literal["forward", "optim", "state", "sample"]


@dataclass
class Request:
    request_id: int
    client_id: str
    op: str
    payload: Any
    future: APIFuture
    record: RequestRecord


@dataclass
class Tenant:
    client_id: str
    base: BaseModel
    adapter: LoRAAdapter | None  # None for sampling clients of the bare base
    rank: int
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# op name -> (kind, handler). Forward ops are run packed by the pool itself; "state"
# handlers run one request at a time, "sample" handlers get all of a cycle's sample
# requests of one base model at once and return one outcome (value or exception) each.
SingleHandler = Callable[["LocalPool", Tenant, Request], Any]
BatchHandler = Callable[["LocalPool", BaseModel, list[tuple[Tenant, Request]]], list[Any]]
_OPS: dict[str, tuple[OpKind, Callable | None]] = {
    "forward": ("forward", None),
    "forward_backward": ("forward", None),
    "forward_backward_custom": ("forward", None),
}


def register_op(name: str, kind: OpKind, handler: Callable) -> None:
    """Teach the clock a new op (used by the sampling and checkpoint modules)."""
    _OPS[name] = (kind, handler)


def _optim_step(pool: "LocalPool", tenant: Tenant, request: Request) -> Any:
    from ..types import OptimStepResponse

    try:
        metrics = tenant.adapter.adamw_step(request.payload)
    except FloatingPointError as exc:
        raise RequestFailedError(f"optim_step: {exc}; weights and optimizer state are unchanged",
                                 client_id=tenant.client_id) from exc
    request.record.metrics["step"] = metrics["step:max"]
    return OptimStepResponse(metrics=metrics)


register_op("optim_step", "optim", _optim_step)


def _take(queue: deque[Request], max_samples: int) -> list[Request]:
    """The requests of one client's queue that this cycle runs, in order."""
    taken: list[Request] = []
    took_forward = took_optim = False
    samples = 0
    for request in queue:
        kind = _OPS[request.op][0]
        if kind == "forward":
            if took_forward or took_optim:
                break
            took_forward = True
        elif kind == "optim":
            if took_optim:
                break
            took_optim = True
        elif kind == "sample":
            if samples >= max_samples:
                break
            samples += 1
        taken.append(request)
    return taken


# Pools alive in this process, so a re-run notebook cell can close the pool it built before.
_LIVE_POOLS: "weakref.WeakSet[LocalPool]" = weakref.WeakSet()


def _current_cell_id() -> str | None:
    """The id of the notebook cell being executed (JupyterLab and nbclient send it)."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None:
            return None
        parent = kernel.get_parent() if hasattr(kernel, "get_parent") else kernel._parent_header
        return (parent or {}).get("metadata", {}).get("cellId")
    except Exception:
        return None


class _Clock:
    """The clock's state, shared by the pool and its thread. Kept apart from LocalPool so
    that the thread does not keep an unreachable pool alive: when the pool is dropped, a
    finalizer stops the thread, and what was still queued fails instead of hanging."""

    def __init__(self, name: str, telemetry: Telemetry) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.closing = False
        self.thread: threading.Thread | None = None
        self.queues: dict[str, deque[Request]] = {}
        self.telemetry = telemetry

    def fail_queued(self, why: str) -> None:
        """Fail every request still queued with PoolClosedError (the clock has stopped)."""
        with self.cond:
            leftovers = [r for q in self.queues.values() for r in q]
            for q in self.queues.values():
                q.clear()
        for request in leftovers:
            request.record.status = "error"
            request.record.error = "pool closed"
            request.future._set_exception(PoolClosedError(
                f"{request.op} (request #{request.request_id}) never ran: the pool {self.name!r} {why}"))
            _release(request)


class LocalPool:
    """An in-process LoRA training pool that advances in clock cycles.

    >>> with LocalPool(min_cycle_s=0.05) as pool:
    ...     tc = ServiceClient(pool).create_lora_training_client(DEFAULT_MODEL, rank=8)
    """

    def __init__(self, min_cycle_s: float = 0.05, device: str | torch.device = "auto", *,
                 max_tokens_per_pass: int = 4096, max_rank: int = 128, max_samples_per_cycle: int = 64,
                 telemetry_capacity: int = 4096, checkpoint_dir: str | None = None, name: str | None = None,
                 torch_threads: int | Literal["auto"] | None = "auto", allow_download: bool | None = None):
        if not (min_cycle_s >= 0):
            raise ValueError(f"min_cycle_s must be >= 0, got {min_cycle_s!r}")
        if max_tokens_per_pass < 1:
            raise ValueError(f"max_tokens_per_pass must be >= 1, got {max_tokens_per_pass!r}")
        self.min_cycle_s = float(min_cycle_s)
        self.device = resolve_device(device)
        if self.device.type == "cpu" and torch_threads is not None:
            torch.set_num_threads(auto_torch_threads() if torch_threads == "auto" else int(torch_threads))
        self.max_tokens_per_pass = int(max_tokens_per_pass)
        self.max_rank = int(max_rank)
        self.max_samples_per_cycle = int(max_samples_per_cycle)
        self.checkpoint_dir = checkpoint_dir
        # Hugging Face Hub ids not on this machine: fetched only when allowed (None: $TRIO_ALLOW_DOWNLOAD)
        self.allow_download = allow_download
        self.name = name or f"pool-{next(_POOL_IDS)}"
        self.telemetry = Telemetry(telemetry_capacity)
        self.cycle_index = 0  # the index the next boundary will take

        self._clock = _Clock(self.name, self.telemetry)
        self._boundary_gate = threading.Lock()  # held by hold(): no boundary is taken meanwhile
        self._queues = self._clock.queues
        self._tenants: dict[str, Tenant] = {}
        self._retired: set[str] = set()  # clients whose objects are gone: dropped once their queue is empty
        self._models: dict[str, BaseModel] = {}
        self._models_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._client_ids = itertools.count(1)
        self._closed = False

        self._cell_id = _current_cell_id()
        if self._cell_id is not None:
            for other in list(_LIVE_POOLS):
                if other._cell_id == self._cell_id and not other._closed:
                    other.close()  # this cell built it before: don't leave its clock running
        _LIVE_POOLS.add(self)

        self._clock.thread = threading.Thread(target=_run_clock, args=(weakref.ref(self), self._clock),
                                              name=f"trio-clock-{self.name}", daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown_dropped, self._clock)
        self._clock.thread.start()

    # -- lifecycle -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 30.0) -> None:
        """Stop the clock, join its thread, and fail every request still queued."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop_clock(self._clock, timeout)
        self._clock.fail_queued("was closed")
        _LIVE_POOLS.discard(self)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Take no cycle boundary while inside: what is submitted here lands in one cycle.

        For tests and teaching; a held pool's clock waits, it does not skip cycles.
        """
        with self._boundary_gate:
            yield

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"cycle {self.cycle_index}"
        return f"<LocalPool {self.name!r} {self.device.type} {state}, {len(self._tenants)} clients>"

    # -- models and tenants ------------------------------------------------------
    def get_base_model(self, name: str) -> BaseModel:
        with self._models_lock:
            if name not in self._models:
                self._models[name] = load_base_model(name, self.device, self.allow_download)
            return self._models[name]

    def supported_models(self) -> list[str]:
        return list(dict.fromkeys([*BUILTIN_MODELS, *self._models]))

    def new_client_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._client_ids)}"

    def add_tenant(self, tenant: Tenant, kind: Literal["training", "sampling"], label: str | None) -> None:
        self._check_open()
        with self._clock.cond:
            self._tenants[tenant.client_id] = tenant
            self._queues[tenant.client_id] = deque()
        self.telemetry.add_client(ClientInfo(tenant.client_id, kind, tenant.base.name,
                                             label or tenant.client_id, tenant.rank or None))

    def retire_tenant(self, client_id: str) -> None:
        """Forget a client once nothing of it is queued: its adapter, optimizer state, queue
        and telemetry lane are released. It accepts no new requests from now on."""
        with self._clock.cond:
            if client_id in self._tenants:
                self._retired.add(client_id)
            self._clock.cond.notify_all()  # an idle clock takes the next boundary, which drops it

    @property
    def tenant_count(self) -> int:
        """Clients whose state the pool holds (retired ones leave at the next boundary)."""
        with self._clock.cond:
            return len(self._tenants)

    # -- requests ------------------------------------------------------------------
    def submit(self, client_id: str, op: str, payload: Any, tokens: int = 0) -> APIFuture:
        self._check_open()
        if op not in _OPS:
            raise InvalidInputError(f"unknown op {op!r}", field="op")
        request_id = next(self._request_ids)
        future: APIFuture = APIFuture(request_id, op, canceller=self._cancel)
        record = RequestRecord(request_id, client_id, op, queued_at=time.perf_counter(), tokens=tokens)
        request = Request(request_id, client_id, op, payload, future, record)
        future._request = request
        with self._clock.cond:
            self._check_open()
            queue = self._queues.get(client_id)
            if queue is None or client_id in self._retired:
                raise ClientClosedError(f"client {client_id} is closed: create a new client to submit {op}")
            queue.append(request)
            self._clock.cond.notify_all()
        self.telemetry.add_request(record)
        return future

    def _cancel(self, future: APIFuture) -> bool:
        request = getattr(future, "_request", None)
        with self._clock.cond:
            queue = self._queues.get(request.client_id) if request else None
            if queue is None or request not in queue:
                return False
            queue.remove(request)
        request.record.status = "cancelled"
        _release(request)
        self.telemetry.request_delivered(request.record)
        return True

    def queue_depths(self) -> dict[str, int]:
        with self._clock.cond:
            return {cid: len(q) for cid, q in self._queues.items()}

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"the pool {self.name!r} is closed")

    # -- one cycle (clock thread) -------------------------------------------------------
    def _take_boundary(self, now: float) -> tuple[int, dict[str, list[Request]]]:
        with self._clock.cond:
            index = self.cycle_index
            self.cycle_index += 1
            depths = {cid: len(q) for cid, q in self._queues.items()}
            taken: dict[str, list[Request]] = {}
            for cid, queue in self._queues.items():
                requests = _take(queue, self.max_samples_per_cycle)
                for _ in requests:
                    queue.popleft()
                if requests:
                    taken[cid] = requests
            dropped = [c for c in self._retired if not self._queues[c] and c not in taken]
            for cid in dropped:
                del self._tenants[cid], self._queues[cid]
                self._retired.discard(cid)
        for cid in dropped:
            self.telemetry.retire_client(cid)
        for requests in taken.values():
            for request in requests:
                request.future.cycle = index
                request.record.cycle = index
                request.record.status = "running"
        self.telemetry.add_boundary(QueueDepthRecord(index, now, depths))
        return index, taken

    def _execute(self, index: int, taken: dict[str, list[Request]]) -> list[tuple[Request, Any]]:
        """Run one cycle's work; returns (request, value or exception) in a stable order."""
        outcomes: list[tuple[Request, Any]] = []
        before: list[Request] = []
        forwards: list[Request] = []
        after: list[Request] = []
        samples: list[Request] = []
        for requests in taken.values():
            seen_forward = False
            for request in requests:
                kind = _OPS[request.op][0]
                if kind == "forward":
                    forwards.append(request)
                    seen_forward = True
                elif kind == "sample":
                    samples.append(request)
                else:
                    (after if seen_forward else before).append(request)
        for request in before:
            outcomes.append((request, self._run_single(request)))
        outcomes.extend(self._run_forwards(forwards))
        for request in after:
            outcomes.append((request, self._run_single(request)))
        outcomes.extend(self._run_samples(samples))
        return outcomes

    def _run_single(self, request: Request) -> Any:
        tenant = self._tenants[request.client_id]
        request.record.started_at = time.perf_counter()
        try:
            value = _OPS[request.op][1](self, tenant, request)
        except Exception as exc:
            value = exc if isinstance(exc, (RequestFailedError, InvalidInputError)) else RequestFailedError(
                f"{request.op} failed: {type(exc).__name__}: {exc}", client_id=request.client_id)
            if value is not exc:
                value.__cause__ = exc
        request.record.finished_at = time.perf_counter()
        return value

    def _run_forwards(self, requests: list[Request]) -> list[tuple[Request, Any]]:
        by_base: dict[str, list[Request]] = {}
        for request in requests:
            by_base.setdefault(self._tenants[request.client_id].base.name, []).append(request)
        outcomes = []
        for base_name, group in by_base.items():
            base = self._models[base_name]
            jobs: list[ForwardJob] = []
            for request in group:
                job: ForwardJob = request.payload
                job.adapter = self._tenants[request.client_id].adapter
                job.client_id = request.client_id
                jobs.append(job)
            started = time.perf_counter()
            for request in group:
                request.record.started_at = started
            results = run_forward_jobs(base, jobs, self.max_tokens_per_pass)
            finished = time.perf_counter()
            for request, job, result in zip(group, jobs, results):
                request.record.finished_at = finished
                if not isinstance(result, BaseException):
                    request.record.metrics["loss:sum"] = result.metrics.get("loss:sum", float("nan"))
                    request.record.metrics["weight:sum"] = sum(
                        float(d.inputs["weights"].sum()) if "weights" in d.inputs else d.length for d in job.data)
                job.raw_data = job.surrogate = None  # don't keep the batch alive in telemetry
                outcomes.append((request, result))
        return outcomes

    def _run_samples(self, requests: list[Request]) -> list[tuple[Request, Any]]:
        by_handler: dict[tuple[str, Callable], list[tuple[Tenant, Request]]] = {}
        for request in requests:
            tenant = self._tenants[request.client_id]
            by_handler.setdefault((tenant.base.name, _OPS[request.op][1]), []).append((tenant, request))
        outcomes = []
        for (base_name, handler), group in by_handler.items():
            started = time.perf_counter()
            for _, request in group:
                request.record.started_at = started
            try:
                results = handler(self, self._models[base_name], group)
            except Exception as exc:
                results = [RequestFailedError(f"{request.op} failed: {type(exc).__name__}: {exc}",
                                              client_id=request.client_id) for _, request in group]
            finished = time.perf_counter()
            for (_, request), result in zip(group, results):
                request.record.finished_at = finished
                outcomes.append((request, result))
        return outcomes

    def _deliver(self, outcomes: list[tuple[Request, Any]], cycle: int) -> None:
        _deliver(self.telemetry, outcomes, cycle)


def _release(request: Request) -> None:
    """A finished request lets go of its payload (a batch, an adapter): the user's future
    may live long, and telemetry records outlive both."""
    request.payload = None
    request.future._request = None


def _deliver(telemetry: Telemetry, outcomes: list[tuple[Request, Any]], cycle: int) -> None:
    now = time.perf_counter()
    for request, value in outcomes:
        record = request.record
        record.delivered_at = now
        if isinstance(value, BaseException):
            if isinstance(value, RequestFailedError) and value.cycle is None:
                value.cycle = cycle
            record.status = "error"
            record.error = str(value)
            request.future._set_exception(value)
        else:
            record.status = "ok"
            request.future._set_result(value)
        _release(request)
        telemetry.request_delivered(record)


_POOL_IDS = itertools.count(1)
_IDLE_TICK_S = 0.001


def _shutdown_dropped(clock: _Clock) -> None:
    """The pool was garbage-collected: stop its clock; fail what it can no longer run."""
    _stop_clock(clock, 5.0)
    clock.fail_queued("was dropped (garbage-collected) before it ran")


def _stop_clock(clock: _Clock, timeout: float = 30.0) -> None:
    with clock.cond:
        clock.closing = True
        clock.cond.notify_all()
    thread = clock.thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout)


def _run_clock(pool_ref: "weakref.ref[LocalPool]", clock: _Clock) -> None:
    pending: list[tuple[Request, Any]] = []
    pending_cycle = -1
    last: CycleRecord | None = None
    while True:
        pool = pool_ref()
        if pool is None:  # dropped: what already ran is reported, not lost
            _deliver(clock.telemetry, pending, pending_cycle)
            return
        boundary = time.perf_counter()
        if clock.closing:
            pool._deliver(pending, pending_cycle)  # what already ran is reported, not lost
            if last is not None:
                last.ended_at = boundary
                pool.telemetry.add_cycle(last)
            return
        with pool._boundary_gate:
            boundary = time.perf_counter()
            index, taken = pool._take_boundary(boundary)
        if last is not None:
            last.ended_at = boundary
            pool.telemetry.add_cycle(last)
        pool._deliver(pending, pending_cycle)
        requests = [r for rs in taken.values() for r in rs]
        try:
            pending = pool._execute(index, taken)
        except Exception as exc:  # a bug in the engine: fail this cycle's requests, keep ticking
            log.exception("cycle %d failed", index)
            pending = [(r, RequestFailedError(f"internal error in cycle {index}: {exc}", client_id=r.client_id))
                       for r in requests]
        pending_cycle = index
        busy = time.perf_counter() - boundary
        ops = dict(Counter(r.op for r in requests))
        last = CycleRecord(index=index, started_at=boundary, ended_at=boundary, busy_s=busy,
                           n_requests=len(requests), tokens=sum(r.record.tokens for r in requests), ops=ops)
        min_cycle_s = pool.min_cycle_s
        idle = not requests
        # Hold nothing that leads back to the pool while sleeping, so that a dropped pool
        # is collected (its finalizer then stops this thread).
        del pool, taken, requests
        with clock.cond:
            deadline = boundary + min_cycle_s
            if idle and min_cycle_s < _IDLE_TICK_S:
                # An idle clock with no minimum would spin and starve the client threads of
                # the GIL; it waits a moment, or until the next submit wakes it.
                clock.cond.wait(_IDLE_TICK_S)
            while not clock.closing:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                clock.cond.wait(remaining)


atexit.register(lambda: [pool.close(timeout=5.0) for pool in list(_LIVE_POOLS)])
