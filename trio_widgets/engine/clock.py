"""LocalPool: a clock thread that runs every tenant's requests in lock-step cycles.

The rules (docs/architecture.md, "Clock cycles"):

* A cycle lasts max(min_cycle_s, its compute time); an empty cycle still ticks (with nothing
  queued, for at least _IDLE_TICK_S or until the next submit: an idle pool does not spin).
* A request is eligible for cycle K only if it was queued before K's boundary; the
  boundary takes a snapshot of the queues.
* Per tenant per cycle: at most one forward-kind op, then at most one optim_step, in
  submission order (state ops ride along in order; sample requests batch freely).
* Results of cycle K are delivered just after the boundary of cycle K+1.

Requests arrive as plain data (trio_widgets.backend); each op's `prepare` (in
engine/handlers.py, named by the op table trio_widgets/ops.py) checks it against the model
and turns it into what its `run` needs, on the submitting thread, before it is queued.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import pools
from .._numbers import is_int, is_number
from ..errors import ClientClosedError, InvalidInputError, PoolClosedError, RequestFailedError
from ..futures import APIFuture, PoolFuture, mark_delivery_thread
from ..gil import GilWatchdog, RunMeter
from ..ops import OPS, OpKind, OpSpec
from ..telemetry import ClientInfo, CycleRecord, QueueDepthRecord, RequestRecord, Telemetry
from ..validation import RequestLimits
from .checkpoints import checkpoint_root, recover_checkpoints, resolve_path
from .handlers import HANDLERS
from .models import BUILTIN_MODELS, BaseModel, auto_torch_threads, load_base_model, resolve_device
from .sampling import StepBudget
from .tenants import AddTenant, Carry, Later, Prepared, Request, Tenant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Op:
    spec: OpSpec
    prepare: Callable[..., Prepared]
    run: Callable[..., Any]


def _resolve_ops() -> dict[str, _Op]:
    """Every op of the table with its handlers from the registry (engine/handlers.py HANDLERS)."""
    resolved = {}
    for name, spec in OPS.items():
        pair = HANDLERS.get(spec.handler)
        if pair is None:
            raise RuntimeError(f"op {name!r}: engine/handlers.py HANDLERS has no entry {spec.handler!r}")
        resolved[name] = _Op(spec, pair.prepare, pair.run)
    return resolved


@dataclass
class _Allowance:
    """What a party (an API key's clients, or one client) may still start this cycle: sample
    requests, and while several clients have work, decode rows and prompt tokens (None: unbounded).
    Its first request goes whatever its size."""

    samples: int
    rows: int | None = None
    prompt_tokens: int | None = None
    fresh: bool = True


def _take(queue: deque[Request], kinds: dict[str, OpKind], allowance: _Allowance) -> list[Request]:
    """The requests of one client's queue that this cycle runs, in order. Its new samples start
    within `allowance` (shared by its party's clients): a party's sampling is cut into bounded
    slices per cycle, and its neighbours' work waits for one slice, not for all it asked at once."""
    taken: list[Request] = []
    took_forward = took_optim = False
    for request in queue:
        if not request.ready:  # a reserved place: what follows keeps its order behind it
            break
        kind = kinds[request.op]
        if kind == "forward":
            if took_forward or took_optim:
                break
            took_forward = True
        elif kind == "optim":
            if took_optim:
                break
            took_optim = True
        elif kind == "sample":
            if allowance.samples <= 0:
                break
            more_rows, more_tokens = _sample_size(request)
            rows_left, tokens_left = allowance.rows, allowance.prompt_tokens
            if not allowance.fresh and ((rows_left is not None and more_rows > rows_left) or
                                        (tokens_left is not None and more_tokens > tokens_left)):
                break
            allowance.fresh = False
            allowance.samples -= 1
            if allowance.rows is not None:
                allowance.rows -= more_rows
            if allowance.prompt_tokens is not None:
                allowance.prompt_tokens -= more_tokens
        taken.append(request)
    return taken


_BUSY_CYCLES = 4  # a client that had work this many cycles ago still shares the cycle


def _sample_size(request: Request) -> tuple[int, int]:
    """(decode rows, prompt tokens) of a sample or logprobs request (its SampleSpec)."""
    spec = request.payload
    return max(1, int(getattr(spec, "num_samples", 1) or 1)), len(getattr(spec, "prompt", ()) or ())


def _slices(samples: list[Request], max_rows: int) -> list[list[Request]]:
    """A cycle's sample requests in order, cut into groups of at most `max_rows` decode rows (one
    request whatever its size): each group decodes as one batch, carried on alone, so a decode step
    (and the steps every cycle owes it) costs at most a slice's rows."""
    groups: list[list[Request]] = []
    rows = 0
    for request in samples:
        more = _sample_size(request)[0]
        if not groups or rows + more > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(request)
        rows += more
    return groups


_TRIM_DELAY_S = 1.0  # what still held a dropped client's tensors (a delivery, a future) lets go first
_TRIM_BUSY_S = 30.0  # a pool never idle trims anyway, this long after its clients dropped


def _return_memory() -> None:
    """Give the heap that dropped clients freed back to the OS (glibc's malloc_trim: freed
    blocks stay in malloc's arenas otherwise, and a served pool's RSS stayed +108 MB after its
    clients closed: issue 36 point 8). Called on the clock's own thread, between cycles (a
    thread of its own outlived the notebook that closed the pool); nothing where there is no glibc."""
    with contextlib.suppress(Exception):  # (OSError, AttributeError: not glibc)
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


_ATEXIT_LOCK = threading.Lock()
_atexit_registered = False


def _close_live_pools() -> None:
    for pool in pools.live_pools():
        if isinstance(pool, LocalPool):
            pool.close(timeout=5.0)


@dataclass(eq=False)
class _Carried:
    """A carry (a decode that goes on) with its handler's group, and which of them wait for it."""

    carry: Carry
    requests: list[Request]
    waiting: set[int] = field(default_factory=set)
    step_s: float = 0.0  # how long its last decode step took (what the next is expected to)

    def unfinished(self) -> list[Request]:
        return [self.requests[i] for i in sorted(self.waiting)]


class _Share:
    """A cycle's decode budget while more than one client has work (issue 36 point 3): instead of
    `min_decode_steps` owed whatever the time (a step of a large batch outlasted a neighbour's
    whole update), decoding spends a credit: each cycle adds its share (half of what StepBudget
    gives: the rest of min_cycle_s, or as long as the cycle's other work took), every step,
    prefill included, is paid from it,
    and a step runs only while the credit covers what its batch's last step took. A step longer
    than one share runs every few cycles (deficit round robin): the decodes always progress, at
    their share, and a neighbour's cycle holds at most one slice's step beyond its share."""

    CAP_S = 2.0  # credit kept at most (seconds)
    # of StepBudget's time (the cycle's rest of min_cycle_s, or as long as its other work): half, so
    # the server's thread finds the GIL free part of each cycle (a served neighbour at the full
    # share: 2.5-2.9x its quiet update; at half: 1.07-1.28x, benchmarks/serve_abuse.py)
    SHARE = 0.5

    def __init__(self, pool: LocalPool, boundary: float):
        self.pool, self.boundary = pool, boundary
        self.opened = False

    def open(self, now: float) -> None:
        if not self.opened:
            self.opened = True
            other = now - self.boundary
            share = self.SHARE * max(self.pool.min_cycle_s - other, other)
            self.pool._decode_credit = min(self.CAP_S, self.pool._decode_credit + share)

    def view(self, entry: _Carried | None) -> _ShareView:
        return _ShareView(self, entry)


class _ShareView:
    """One decode batch's take() on a cycle's `_Share` (what `advance(budget)` asks before each step)."""

    def __init__(self, share: _Share, entry: _Carried | None):
        self.share, self.entry = share, entry
        self.mark = time.perf_counter()
        self.stepping = False

    def _spend(self, now: float) -> None:
        spent, self.mark = now - self.mark, now
        self.share.pool._decode_credit -= spent
        if self.stepping and self.entry is not None:
            self.entry.step_s = spent

    def take(self) -> bool:
        now = time.perf_counter()
        self._spend(now)
        self.share.open(now)
        credit = self.share.pool._decode_credit
        expected = self.entry.step_s if self.entry is not None else 0.0
        self.stepping = credit > 0 and (credit >= expected or credit >= _Share.CAP_S)
        return self.stepping

    def finish(self) -> None:
        self._spend(time.perf_counter())
        self.stepping = False


class _OneStep:
    """One step of a cycle's budget, a StepBudget or a _Share's view (a decode's turn while
    several keys decode)."""

    def __init__(self, budget: StepBudget | _ShareView):
        self.budget, self.took = budget, False

    def take(self) -> bool:
        if self.took:
            return False
        self.took = self.budget.take()
        return self.took

    def finish(self) -> None:
        if isinstance(self.budget, _ShareView):  # (it charges the step's time to the credit)
            self.budget.finish()


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
        self.pending: list[tuple[Request, Any]] = []  # ran in pending_cycle, delivered at the next boundary
        self.pending_cycle = -1
        self.running: list[Request] = []  # taken into the cycle that runs now
        self.carried: list[_Carried] = []  # samples still decoding (engine/sampling.py)
        self.activity = "starting"  # what the thread does now, for close() to say if it hangs
        self.failure: BaseException | None = None  # set if the thread died
        self.watchdog: GilWatchdog | None = None  # stopped with the clock
        # the queues changed since the last boundary took them (an idle clock then does not wait)
        self.poked = False
        self.trim_at: float | None = None  # clients were dropped: give their heap back after this time
        self.dropped: queue.SimpleQueue[str] = queue.SimpleQueue()  # garbage-collected clients, to retire

    def poke(self) -> None:
        """The queues changed: wake the clock. Call with `cond` held."""
        self.poked = True
        self.cond.notify_all()

    def fail_carried(self, why: str) -> None:
        """Fail every sample still decoding with PoolClosedError (the clock has stopped)."""
        leftovers = [r for c in self.carried for r in c.unfinished()]
        self.carried = []
        _deliver(self.telemetry, [(r, PoolClosedError(f"{r.op} (request #{r.request_id}) did not finish: the pool "
                                                       f"{self.name!r} {why}")) for r in leftovers],
                 self.pending_cycle + 1)

    def fail_queued(self, why: str) -> None:
        """Fail every request still queued with PoolClosedError (the clock has stopped)."""
        with self.cond:
            leftovers = [r for q in self.queues.values() for r in q]
            for q in self.queues.values():
                q.clear()
        for request in leftovers:
            request.record.status = "error"
            request.record.error = "pool closed"
            _settle(request, PoolClosedError(
                f"{request.op} (request #{request.request_id}) never ran: the pool {self.name!r} {why}"))


class _Slot:
    """A reservation (see trio_widgets.backend.Reservation) in a LocalPool's queue."""

    def __init__(self, pool: LocalPool, request: Request):
        self._pool = weakref.ref(pool)
        self._request = request
        self.future = request.future

    def fill(self, request: Any) -> None:
        pool = self._pool()
        if pool is None or self._request.result.done():
            return  # the pool closed (and failed this place) meanwhile
        try:
            pool._fill(self._request, request)
        except BaseException as exc:  # refused (InvalidInputError): the place fails, the queue moves on
            self.fail(exc)

    def fail(self, error: BaseException) -> None:
        pool = self._pool()
        if pool is not None:
            pool._drop_reserved(self._request, error)


class LocalPool:
    """An in-process LoRA training pool that advances in clock cycles.

    >>> with LocalPool(min_cycle_s=0.05) as pool:
    ...     tc = ServiceClient(pool).create_lora_training_client(DEFAULT_MODEL, rank=8)

    What it does to the process, all named here: it starts one daemon thread (the clock,
    "trio-clock-<name>") and, with `gil_watchdog=True` (default), a second one
    ("trio-gil-<name>": a heartbeat every 20 ms that measures how long other Python held the
    interpreter, and where; trio_widgets/gil.py), both stopped by `close()`, by leaving
    a `with` block, when the pool is garbage-collected, or at interpreter exit; on CPU,
    `torch_threads` sets torch's process-wide thread count ("auto": $TRIO_TORCH_THREADS, else
    half the usable CPUs; None leaves it alone); and with
    `owned_by_cell=True` (default), a pool built by a notebook cell closes the pool the same
    cell built before, so re-running the cell leaves no clock behind.
    """

    def __init__(self, min_cycle_s: float = 0.05, device: str | torch.device = "auto", *,
                 max_tokens_per_pass: int = 4096, max_rank: int = 128, max_samples_per_cycle: int = 64,
                 max_request_tokens: int = 16_384, max_request_data: int = 1024, max_num_samples: int = 128,
                 max_sampled_tokens: int = 32_768, telemetry_capacity: int = 4096,
                 checkpoint_dir: str | os.PathLike | None = None, name: str | None = None,
                 torch_threads: int | Literal["auto"] | None = "auto", owned_by_cell: bool = True,
                 allow_download: bool | None = None, gil_watchdog: bool = True, max_tenants: int = 1024,
                 min_decode_steps: int | None = 2):
        if not is_number(min_cycle_s) or not (0 <= min_cycle_s <= _MAX_CYCLE_S):
            raise ValueError(f"min_cycle_s must be a number of seconds from 0 to {_MAX_CYCLE_S:.0f}, "
                             f"got {min_cycle_s!r}")
        counts = {"max_tokens_per_pass": max_tokens_per_pass, "max_rank": max_rank,
                  "max_samples_per_cycle": max_samples_per_cycle, "max_request_tokens": max_request_tokens,
                  "max_request_data": max_request_data, "max_num_samples": max_num_samples,
                  "max_sampled_tokens": max_sampled_tokens, "telemetry_capacity": telemetry_capacity,
                  "max_tenants": max_tenants}
        for key, value in counts.items():
            if not is_int(value) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if torch_threads not in (None, "auto") and (not is_int(torch_threads) or int(torch_threads) < 1):
            raise ValueError(f'torch_threads must be "auto", None or an integer >= 1, got {torch_threads!r}')
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name must be a string, got {type(name).__name__}")
        if allow_download not in (None, True, False):
            raise ValueError(f"allow_download must be True, False or None, got {allow_download!r}")
        if gil_watchdog not in (True, False):
            raise ValueError(f"gil_watchdog must be True or False, got {gil_watchdog!r}")
        self.min_cycle_s = float(min_cycle_s)
        self.device = resolve_device(device)
        if self.device.type == "cpu" and torch_threads is not None:
            torch.set_num_threads(auto_torch_threads() if torch_threads == "auto" else int(torch_threads))
        self.max_tokens_per_pass = int(max_tokens_per_pass)
        self.max_rank = int(max_rank)
        self.max_samples_per_cycle = int(max_samples_per_cycle)
        self.max_tenants = int(max_tenants)  # clients whose state the pool holds at once (memory)
        if min_decode_steps is not None and (not is_int(min_decode_steps) or min_decode_steps < 1):
            raise ValueError(f"min_decode_steps must be None or an integer >= 1, got {min_decode_steps!r}")
        # decode steps of sampling per cycle, whatever the time; then only while the cycle is
        # shorter than min_cycle_s or twice its other work (engine/sampling.py StepBudget): a long
        # sample goes on over several cycles instead of holding its cycle (and every tenant in
        # it). None: every sample decodes to its end in its cycle.
        self.min_decode_steps = None if min_decode_steps is None else int(min_decode_steps)
        # this cycle's (clock thread); a _Share's view while several clients have work (duck-typed:
        # what a decode asks of it is take())
        self.decode_budget: Any = StepBudget(self.min_decode_steps)
        self._contended = False
        # whether several parties (API keys) have work this cycle (clock thread; _take_queues)
        self._several = False
        self._turns: dict[str, int] = {}  # a party's clients' turns to start samples first (_take_queues)
        self._last_busy: dict[str, int] = {}  # client -> the last cycle it had work in (clock thread)
        self._last_queued = -_BUSY_CYCLES - 1  # the last cycle some client had a request queued
        # a decode batch holds at most this many rows (a request's most), and a client starts at most
        # this many new rows a cycle, and max_tokens_per_pass of prompts: the forced decode steps of a
        # cycle cost a slice, not every row a participant asked for at once (issue 36 point 3)
        self.decode_slice_rows = max(1, int(max_num_samples))
        self._decode_credit = 0.0  # seconds of decode owed (clock thread; see _Share)
        self.limits = RequestLimits(int(max_request_tokens), int(max_request_data), int(max_num_samples),
                                    int(max_sampled_tokens))
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        # finish what a writer killed mid-save left (a name only set aside, stray temporaries);
        # best effort: a directory it may not change never stops a pool from starting
        try:
            recover_checkpoints(checkpoint_root(self))
        except OSError as exc:
            log.warning("could not recover the checkpoint directory: %s", exc)
        #: the most bytes read from a checkpoint's tensor files (None: derived from max_rank)
        self.max_checkpoint_bytes: int | None = None
        # Hugging Face Hub ids not on this machine: fetched only when allowed (None: $TRIO_ALLOW_DOWNLOAD)
        self.allow_download = allow_download
        self.name = name or f"pool-{next(_POOL_IDS)}"
        self.serial = pools.next_serial()  # creation order: a Dashboard() without a pool follows the newest
        self.telemetry = Telemetry(telemetry_capacity)
        self.cycle_index = 0  # the index the next boundary will take

        self._ops = _resolve_ops()
        self._kinds: dict[str, OpKind] = {name: op.spec.kind for name, op in self._ops.items()}
        self._clock = _Clock(self.name, self.telemetry)
        # held by hold() (reentrant: nested holds on one thread) and by the clock at a boundary
        self._boundary_gate = threading.RLock()
        self._queues = self._clock.queues
        self._tenants: dict[str, Tenant] = {}
        self._retired: set[str] = set()  # clients whose objects are gone: dropped once their queue is empty
        self._models: dict[str, BaseModel] = {}
        self._models_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._client_ids = itertools.count(1)
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self._cycle_tenants: dict[str, Tenant] = {}  # the running cycle's (clock thread only)

        if owned_by_cell:
            pools.claim_cell(self)
        pools.register(self)
        _register_atexit()

        self._clock.thread = threading.Thread(target=_run_clock, args=(weakref.ref(self), self._clock),
                                              name=f"trio-clock-{self.name}", daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown_dropped, self._clock)
        self._clock.thread.start()
        if gil_watchdog:
            self._clock.watchdog = GilWatchdog(self.telemetry, self.name).start()

    def checkpoint_path(self, path: Any) -> Path:
        """The directory on this machine that a save's `tinker://<run>/<segment>/<name>` path (or
        its result) names, e.g. for `peft.PeftModel.from_pretrained(base, pool.checkpoint_path(p))`.
        Every transport returns tinker:// paths; in-process, a directory also loads as it is."""
        return resolve_path(path, self)

    def connect(self, *, user_metadata: dict[str, str] | None = None, display_name: str | None = None,
                session: bool = True, owner: str | None = None) -> Any:
        """A backend over this pool (trio_widgets.connect.Pool): a ServiceClient's session, or,
        with `session=False`, a RestClient's reader or a server's; `owner`: an API key's (digest)."""
        from .backend import LocalBackend  # (the backend module builds on this one)

        return LocalBackend(self, user_metadata=user_metadata, display_name=display_name, session=session,
                            owner=owner)

    @property
    def device_type(self) -> str:
        """Where the pool computes: "cpu", "cuda", ... (trio_widgets.pools.PoolView)."""
        return self.device.type

    # -- lifecycle -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Closed, or its clock stopped (see `LocalPool.failure`): it takes no more requests."""
        return self._closed or self._clock.failure is not None

    @property
    def failure(self) -> BaseException | None:
        """What stopped the clock thread, if it died (an engine bug; user code cannot stop it)."""
        return self._clock.failure

    def close(self, timeout: float = 30.0) -> None:
        """Stop the clock, join its thread, and fail every request still queued.

        What already ran is delivered. If the thread does not stop within `timeout` seconds
        (a cycle still computing, or a done-callback of yours that blocks), raises
        TimeoutError saying what it is doing; the pool is closed either way.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop_clock(self._clock, timeout)
        self._clock.fail_queued("was closed")
        pools.unregister(self)
        hooks, self._on_close = self._on_close, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("a close hook of pool %s failed", self.name)
        thread = self._clock.thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            raise TimeoutError(f"pool {self.name!r}: its clock thread is still {self._clock.activity} after "
                               f"{timeout:g} s; it stops when that returns (results of the cycle that ran "
                               f"are still delivered)")

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call `hook()` when the pool closes (backends stop their client-side threads so)."""
        if self._closed:
            hook()
        else:
            self._on_close.append(hook)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Take no cycle boundary while inside: what is submitted here lands in one cycle.

        For tests and teaching; a held pool's clock waits, it does not skip cycles.
        """
        with self._boundary_gate:
            yield

    @property
    def gil_watchdog(self) -> GilWatchdog | None:
        """The heartbeat thread that measures GIL starvation (None if built without one)."""
        return self._clock.watchdog

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"cycle {self.cycle_index}"
        return f"<LocalPool {self.name!r} {self.device.type} {state}, {len(self._tenants)} clients>"

    # -- models and tenants ------------------------------------------------------
    def get_base_model(self, name: str) -> BaseModel:
        """The loaded base model called `name`, loading it on first use (see Models)."""
        with self._models_lock:
            if name not in self._models:
                self._models[name] = load_base_model(name, self.device, self.allow_download)
            return self._models[name]

    def supported_models(self) -> list[str]:
        """The base models this pool can train: the built-in ones and those it has loaded."""
        return list(dict.fromkeys([*BUILTIN_MODELS, *self._models]))

    def new_client_id(self, prefix: str) -> str:
        """A new client id, unique in this pool: `prefix-N`."""
        return f"{prefix}-{next(self._client_ids)}"

    def add_tenant(self, tenant: Tenant, label: str | None) -> None:
        """Register a client's state (its adapter and optimizer) under `label`; raises if the pool is full."""
        self._check_open()
        with self._clock.cond:
            if len(self._tenants) >= self.max_tenants:
                raise InvalidInputError(f"the pool {self.name!r} holds {len(self._tenants)} clients, its limit "
                                        f"(max_tenants): close some clients first")
            self._tenants[tenant.client_id] = tenant
            self._queues[tenant.client_id] = deque()
        self.telemetry.add_client(ClientInfo(tenant.client_id, tenant.kind, tenant.base.name,
                                             label or tenant.client_id, tenant.rank or None,
                                             parent=tenant.parent))

    def tenant(self, client_id: str) -> Tenant:
        """The live tenant of `client_id`; ClientClosedError once it was closed."""
        with self._clock.cond:
            tenant = self._tenants.get(client_id)
            if tenant is None or client_id in self._retired:
                raise ClientClosedError(f"client {client_id} is closed: create a new client")
            return tenant

    def retire_tenant(self, client_id: str, *, dropped: bool = False) -> None:
        """Forget a client once nothing of it is queued: its adapter, optimizer state, queue
        and telemetry lane are released. It accepts no new requests from now on. `dropped` (a
        dropped client's finalizer, which may run inside the clock's own loop over the
        tenants): queued without a lock, taken at the next boundary (an idle clock ticks)."""
        if dropped:
            self._clock.dropped.put(client_id)  # SimpleQueue.put: safe in a finalizer
            return
        with self._clock.cond:
            if client_id in self._tenants:
                self._retired.add(client_id)
            self._clock.poke()  # an idle clock takes the next boundary, which drops it

    @property
    def tenant_count(self) -> int:
        """Clients whose state the pool holds (retired ones leave at the next boundary)."""
        with self._clock.cond:
            return len(self._tenants)

    # -- requests ------------------------------------------------------------------
    def submit(self, client_id: str, op: str, request: Any) -> APIFuture:
        """Check `request` (plain data, see trio_widgets.backend) against the client's model and
        queue it; InvalidInputError (nothing queued) if it is refused."""
        self._check_open()
        resolved = self._op(op)
        prepared = resolved.prepare(self, self.tenant(client_id), op, request)
        return self._enqueue(client_id, op, prepared, ready=True).future

    def reserve(self, client_id: str, op: str) -> _Slot:
        """A place in the client's queue for a request given later (`fill`); later requests of
        the client wait behind it. For the two steps of a custom loss."""
        self._check_open()
        self._op(op)
        self.tenant(client_id)
        return _Slot(self, self._enqueue(client_id, op, Prepared(None), ready=False))

    def _op(self, op: str) -> _Op:
        resolved = self._ops.get(op) if isinstance(op, str) else None
        if resolved is None:
            raise InvalidInputError(f"unknown op {op!r}", field="op")
        return resolved

    def _enqueue(self, client_id: str, op: str, prepared: Prepared, ready: bool) -> Request:
        request_id = next(self._request_ids)
        record = RequestRecord(request_id, client_id, op, queued_at=time.perf_counter(), tokens=prepared.tokens)
        if prepared.weight:
            record.metrics["weight:sum"] = prepared.weight
        pool_ref = weakref.ref(self)
        this: list[Request] = []  # the request, for the cancel path (weak to the pool, see PoolFuture)
        result = PoolFuture(lambda: bool(this) and _cancel(pool_ref, this[0]))
        future: APIFuture = APIFuture(result, request_id=request_id, op=op, scheduled=record)
        request = Request(request_id, client_id, op, prepared.payload, result, future, record, ready)
        this.append(request)
        with self._clock.cond:
            self._check_open()
            queue = self._queues.get(client_id)
            if queue is None or client_id in self._retired:
                raise ClientClosedError(f"client {client_id} is closed: create a new client to submit {op}")
            queue.append(request)
            self._clock.poke()
        self.telemetry.add_request(record)
        return request

    def _fill(self, request: Request, plain: Any) -> None:
        with self._clock.cond:  # (a closed client's reserved place still runs, like its queue)
            tenant = self._tenants[request.client_id]
        prepared = self._ops[request.op].prepare(self, tenant, request.op, plain)
        with self._clock.cond:
            request.payload = prepared.payload
            request.record.tokens = prepared.tokens
            if prepared.weight:
                request.record.metrics["weight:sum"] = prepared.weight
            request.ready = True
            self._clock.poke()

    def _drop_reserved(self, request: Request, error: BaseException) -> None:
        with self._clock.cond:
            queue = self._queues.get(request.client_id)
            if queue is None or request not in queue:
                return  # already taken or failed (the pool closed)
            queue.remove(request)
            self._clock.poke()
        request.record.status = "error"
        request.record.error = str(error)
        request.record.delivered_at = time.perf_counter()
        if isinstance(error, RequestFailedError) and error.cycle is not None:
            request.record.cycle = error.cycle  # it failed in the exchange that began in that cycle
        _settle(request, error)
        self.telemetry.request_delivered(request.record)

    def queue_depths(self) -> dict[str, int]:
        """How many requests each client has queued, by client id."""
        with self._clock.cond:
            return {cid: len(q) for cid, q in self._queues.items()}

    def _check_open(self) -> None:
        failure = self._clock.failure
        if failure is not None:
            raise PoolClosedError(f"the pool {self.name!r} stopped: its clock thread died "
                                  f"({type(failure).__name__}: {failure}); create a new pool")
        if self._closed:
            raise PoolClosedError(f"the pool {self.name!r} is closed")

    # -- one cycle (clock thread) -------------------------------------------------------
    def _take_boundary(self, now: float) -> tuple[int, dict[str, list[Request]]]:
        decoding = Counter(c.requests[i].client_id for c in self._clock.carried for i in c.waiting)
        with self._clock.cond:
            self._clock.poked = False  # what changed until now, this boundary sees
            index = self.cycle_index
            self.cycle_index += 1
            depths = {cid: len(q) for cid, q in self._queues.items()}
            # more than one client with work: decoding gets its share of each cycle (_Share), new
            # samples start in bounded slices, and a client whose decodes overspent starts none
            # samples still decoding count against the client's samples per cycle. A client counts as
            # busy for a few cycles after its last work (a pipelined trainer awaiting a result has an
            # empty queue at some boundaries)
            queued = {cid for cid, q in self._queues.items() if q and q[0].ready}
            for cid in queued | set(decoding):
                self._last_busy[cid] = index
            if queued:
                self._last_queued = index
            for cid in [c for c, last in self._last_busy.items() if index - last > _BUSY_CYCLES]:
                del self._last_busy[cid]
            # decodes alone (nothing queued for a few cycles) share with nobody: a credit of the empty
            # cycles' own time ran 8 tenants' sample 3x slower, the clock spinning through empty cycles
            self._contended = len(self._last_busy) > 1 and self.min_decode_steps is not None \
                and index - self._last_queued <= _BUSY_CYCLES
            if self._contended:
                self.decode_budget = _Share(self, now)
            else:
                self.decode_budget = StepBudget(self.min_decode_steps, now, self.min_cycle_s)
                self._decode_credit = 0.0
            taken = self._take_queues(decoding)
            while not self._clock.dropped.empty():
                gone = self._clock.dropped.get()
                if gone in self._tenants:
                    self._retired.add(gone)
            dropped = [c for c in self._retired if not self._queues[c] and c not in taken and c not in decoding]
            for cid in dropped:
                del self._tenants[cid], self._queues[cid]
                self._retired.discard(cid)
            tenants = {cid: self._tenants[cid] for cid in taken}
        for cid in dropped:
            self.telemetry.retire_client(cid)
        if dropped and self._clock.trim_at is None:  # (later drops do not put off a pending trim)
            self._clock.trim_at = now + _TRIM_DELAY_S
        for requests in taken.values():
            for request in requests:
                request.record.cycle = index
                request.record.status = "running"
        self._cycle_tenants = tenants
        self.telemetry.add_boundary(QueueDepthRecord(index, now, depths))
        return index, taken

    def _take_queues(self, decoding: Counter[str]) -> dict[str, list[Request]]:
        """Each client's requests for this cycle (under the clock's lock), in the queues' order.
        New samples start within a party's allowance (`_Allowance`: bounded slices while several
        clients have work). While several parties have work, a party is an API key: its clients
        share one allowance and take the first place in turn (a key with N sampling clients
        started N slices a cycle: issue 36). In-process clients, and a key's clients while it is
        alone, are each a party of their own."""
        owners = {cid: t.owner for cid, t in self._tenants.items() if t.owner is not None}
        self._several = bool(owners) and len({owners.get(cid, cid) for cid in self._last_busy}) > 1
        if self._several:
            members: dict[str, list[str]] = {}
            for cid in self._queues:
                members.setdefault(owners.get(cid, cid), []).append(cid)
            decoding_of: Counter[str] = Counter()
            for cid, n in decoding.items():
                decoding_of[owners.get(cid, cid)] += n
        else:  # (in-process clients, or one key: each client a party of its own)
            members, decoding_of = {cid: [cid] for cid in self._queues}, decoding
        takes: dict[str, list[Request]] = {}
        turns: dict[str, int] = {}
        for who, cids in members.items():
            allowance = _Allowance(self.max_samples_per_cycle - decoding_of.get(who, 0))
            if self._contended:
                allowance.rows, allowance.prompt_tokens = self.decode_slice_rows, self.max_tokens_per_pass
                if self._decode_credit < 0 and decoding_of.get(who, 0):
                    allowance.samples = 0  # its decodes spent more than their share: they go on, nothing new starts
            turn = self._turns.get(who, 0)
            for cid in cids[turn % len(cids):] + cids[:turn % len(cids)]:
                queue = self._queues[cid]
                requests = _take(queue, self._kinds, allowance)
                for _ in requests:
                    queue.popleft()
                if requests:
                    takes[cid] = requests
            turns[who] = turn + (not allowance.fresh)  # the next client goes first once one started a sample
        self._turns = turns
        return {cid: takes[cid] for cid in self._queues if cid in takes}

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
                kind = self._kinds[request.op]
                if kind == "forward":
                    forwards.append(request)
                    seen_forward = True
                elif kind == "sample":
                    samples.append(request)
                else:
                    (after if seen_forward else before).append(request)
        for request in before:
            outcomes.append((request, self._run_single(request)))
        outcomes.extend(self._run_batched(forwards))
        for request in after:
            outcomes.append((request, self._run_single(request)))
        outcomes.extend(self._advance_carried())  # the oldest samples first: they finish first
        if not isinstance(self.decode_budget, _Share):
            outcomes.extend(self._run_batched(samples))
            return outcomes
        share = self.decode_budget
        for group in _slices(samples, self.decode_slice_rows):
            view = self.decode_budget = share.view(None)  # (the sample handler reads pool.decode_budget)
            try:
                outcomes.extend(self._run_batched(group))
            finally:
                view.finish()
                self.decode_budget = share
        return outcomes

    def _advance_carried(self) -> list[tuple[Request, Any]]:
        """This cycle's share of the samples still decoding from earlier cycles: the oldest first;
        while several keys have work, their decodes take turns a step at a time, each key's oldest
        first, so one key's many rows cannot spend the share before another's decode steps."""
        outcomes: list[tuple[Request, Any]] = []
        share = self.decode_budget
        by_key: dict[str | None, list[_Carried]] = {}
        for entry in self._clock.carried:  # (a carry is its first request's; in-process clients: one group)
            tenant = self._tenants.get(entry.requests[min(entry.waiting)].client_id)
            by_key.setdefault(tenant.owner if self._several and tenant is not None else None, []).append(entry)
        if len(by_key) < 2:
            for entry in list(self._clock.carried):
                self._advance(entry, share.view(entry) if isinstance(share, _Share) else share, outcomes)
            return outcomes
        turns = [e for rank in itertools.zip_longest(*by_key.values()) for e in rank if e is not None]
        stepped = True
        while stepped and turns:
            stepped = False
            for entry in turns:
                view = _OneStep(share.view(entry) if isinstance(share, _Share) else share)
                self._advance(entry, view, outcomes)
                stepped = stepped or view.took
            turns = [e for e in turns if e.waiting]
        return outcomes

    def _advance(self, entry: _Carried, budget: Any, outcomes: list[tuple[Request, Any]]) -> None:
        """Advance one carried decode as `budget` allows; what finished goes to `outcomes`."""
        try:
            finished = entry.carry.advance(budget)
        except Exception as exc:  # a bug: what is left of it fails, the clock goes on
            finished = {i: _as_failure(entry.requests[i], exc) for i in entry.waiting}
        finally:
            if isinstance(budget, (_ShareView, _OneStep)):
                budget.finish()
        now = time.perf_counter()
        for i, value in finished.items():
            if i in entry.waiting:
                entry.waiting.discard(i)
                entry.requests[i].record.finished_at = now
                outcomes.append((entry.requests[i], value))
        if not entry.waiting:
            self._clock.carried.remove(entry)

    def _run_single(self, request: Request) -> Any:
        tenant = self._cycle_tenants[request.client_id]
        request.record.started_at = time.perf_counter()
        try:
            value = self._ops[request.op].run(self, tenant, request)
            if isinstance(value, AddTenant):  # the op made a client: the pool adds it, here
                self.add_tenant(value.tenant, value.label)
                value = value.result
        except Exception as exc:
            value = _as_failure(request, exc)
        request.record.finished_at = time.perf_counter()
        return value

    def _run_batched(self, requests: list[Request]) -> list[tuple[Request, Any]]:
        """Forward (or sample) requests of a cycle: one call per base model and handler, which
        packs them into shared passes and returns one outcome per request."""
        groups: dict[tuple[str, Callable], list[tuple[Tenant, Request]]] = {}
        for request in requests:
            tenant = self._cycle_tenants[request.client_id]
            groups.setdefault((tenant.base.name, self._ops[request.op].run), []).append((tenant, request))
        outcomes = []
        for (base_name, run), group in groups.items():
            started = time.perf_counter()
            for _, request in group:
                request.record.started_at = started
            try:
                results = run(self, self._models[base_name], group)
            except Exception as exc:  # the shared pass itself broke (e.g. out of memory): all of it fails
                results = [_as_failure(request, exc) for _, request in group]
            finished = time.perf_counter()
            carried: dict[int, _Carried] = {}
            for i, ((_, request), result) in enumerate(zip(group, results)):
                if isinstance(result, Later):  # still decoding: carried on, delivered when done
                    entry = carried.setdefault(id(result.carry), _Carried(result.carry, [r for _, r in group]))
                    entry.waiting.add(i)
                    continue
                request.record.finished_at = finished
                outcomes.append((request, result))
            self._clock.carried.extend(carried.values())
        return outcomes

    def _deliver(self, outcomes: list[tuple[Request, Any]], cycle: int) -> None:
        _deliver(self.telemetry, outcomes, cycle)


def _as_failure(request: Request, exc: Exception) -> BaseException:
    if isinstance(exc, (RequestFailedError, InvalidInputError)):
        return exc
    failure = RequestFailedError(f"{request.op} failed: {type(exc).__name__}: {exc}", client_id=request.client_id)
    failure.__cause__ = exc
    return failure


def _cancel(pool_ref: weakref.ref[LocalPool], request: Request) -> bool:
    pool = pool_ref()
    if pool is None:
        return False
    with pool._clock.cond:
        queue = pool._queues.get(request.client_id)
        if queue is None or request not in queue:
            return False
        queue.remove(request)
        pool._clock.poke()
    request.record.status = "cancelled"
    request.payload = None
    pool.telemetry.request_delivered(request.record)
    return True


def _settle(request: Request, value: Any) -> None:
    """Resolve a request's future and let go of its payload (a batch, an adapter): the
    user's future may live long, and telemetry records outlive both."""
    request.payload = None
    if isinstance(value, RequestFailedError) and not value.request_id:
        value.request_id = str(request.request_id)  # tinker's RequestFailedError names its request
    if request.result.done():  # cancelled meanwhile
        return
    try:
        if isinstance(value, BaseException):
            request.result.set_exception(value)
        else:
            request.result.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


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
        else:
            record.status = "ok"
        _settle(request, value)
        telemetry.request_delivered(record)


_POOL_IDS = itertools.count(1)
#: how long an empty cycle with nothing queued lasts at least: a submit (or close) ends the wait
#: at once, so work never waits for it; without it a pool at min_cycle_s=0 ticked ~190 empty
#: cycles a second, taking the GIL from client threads and feeding every view a row each time
_IDLE_TICK_S = 0.05
_MAX_CYCLE_S = 3600.0  # a cycle longer than an hour is a typo (and time_t overflows at inf)
_GATE_POLL_S = 0.05  # how often a clock waiting on hold() looks whether the pool is closing


def _register_atexit() -> None:
    """Pools close at interpreter exit (registered with the first pool, not at import)."""
    global _atexit_registered
    with _ATEXIT_LOCK:
        if not _atexit_registered:
            atexit.register(_close_live_pools)
            _atexit_registered = True


def _shutdown_dropped(clock: _Clock) -> None:
    """The pool was garbage-collected: stop its clock; fail what it can no longer run."""
    _stop_clock(clock, 5.0)
    clock.fail_queued("was dropped (garbage-collected) before it ran")


def _stop_clock(clock: _Clock, timeout: float = 30.0) -> None:
    with clock.cond:
        clock.closing = True
        clock.cond.notify_all()
    if clock.watchdog is not None:
        clock.watchdog.stop(timeout=0)  # signalled now, joined below: both threads end meanwhile
    thread = clock.thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout)
    if clock.watchdog is not None:
        clock.watchdog.stop(timeout)


def _run_clock(pool_ref: weakref.ref[LocalPool], clock: _Clock) -> None:
    mark_delivery_thread()  # APIFuture.result() called here (in a done-callback) raises, not deadlocks
    try:
        _clock_loop(pool_ref, clock)
    except BaseException as exc:  # only an engine bug gets here: user code is fenced off below
        clock.failure = exc
        log.critical("the clock of pool %s stopped: %s: %s", clock.name, type(exc).__name__, exc, exc_info=True)
        _deliver(clock.telemetry, clock.pending, clock.pending_cycle)
        why = PoolClosedError(f"the clock of pool {clock.name!r} died while running this request "
                              f"({type(exc).__name__}: {exc}); the client's state may be part-updated")
        _deliver(clock.telemetry, [(r, why) for r in clock.running], clock.pending_cycle + 1)
        clock.fail_carried(f"stopped: its clock thread died ({type(exc).__name__}: {exc})")
        clock.fail_queued(f"stopped: its clock thread died ({type(exc).__name__}: {exc})")
        if clock.watchdog is not None:  # nothing left to watch
            clock.watchdog.stop(timeout=0)


def _clock_loop(pool_ref: weakref.ref[LocalPool], clock: _Clock) -> None:
    last: CycleRecord | None = None
    meter = RunMeter()  # how long this thread waits for the GIL (trio_widgets/gil.py)
    while True:
        pool = pool_ref()
        if pool is None:  # dropped: what already ran is reported, not lost
            _deliver(clock.telemetry, clock.pending, clock.pending_cycle)
            clock.fail_carried("was dropped (garbage-collected) while it was sampling")
            return
        boundary = time.perf_counter()
        if clock.closing:
            pool._deliver(clock.pending, clock.pending_cycle)  # what already ran is reported, not lost
            clock.fail_carried("was closed while it was sampling")
            if last is not None:
                last.ended_at = boundary
                pool.telemetry.add_cycle(last)
            return
        # hold() may keep the gate; look now and then whether the pool is closing meanwhile
        if not pool._boundary_gate.acquire(timeout=_GATE_POLL_S):
            continue
        try:
            boundary = time.perf_counter()
            working = meter.mark()
            index, taken = pool._take_boundary(boundary)
        finally:
            pool._boundary_gate.release()
        if last is not None:
            last.ended_at = boundary
            pool.telemetry.add_cycle(last)
        clock.activity = f"delivering the results of cycle {clock.pending_cycle} (running your done-callbacks)"
        pool._deliver(clock.pending, clock.pending_cycle)
        requests = [r for rs in taken.values() for r in rs]
        decoding = [r for c in clock.carried for r in c.unfinished()]  # samples going on from earlier cycles
        ops = dict(Counter(r.op for r in requests + decoding))
        clock.activity = f"running cycle {index} ({', '.join(f'{n} {op}' for op, n in ops.items()) or 'idle'})"
        clock.running = requests  # (carried samples fail through fail_carried)
        try:
            clock.pending = pool._execute(index, taken)
        except Exception as exc:  # a bug in the engine: fail this cycle's requests, keep ticking
            log.exception("cycle %d failed", index)
            clock.pending = [(r, RequestFailedError(f"internal error in cycle {index}: {exc}",
                                                    client_id=r.client_id)) for r in requests]
        clock.running = []
        clock.activity = "waiting for the next boundary"
        pool._cycle_tenants = {}
        clock.pending_cycle = index
        waited, cpu = meter.waited(working)
        busy = time.perf_counter() - boundary
        last = CycleRecord(index=index, started_at=boundary, ended_at=boundary, busy_s=busy,
                           n_requests=len(requests), tokens=sum(r.record.tokens for r in requests), ops=ops,
                           cpu_s=cpu, gil_wait_s=waited)
        min_cycle_s = pool.min_cycle_s
        idle = not requests and not decoding
        # trimming takes malloc's locks for a while: on an idle cycle, unless the pool stays busy for long
        if clock.trim_at is not None and time.perf_counter() >= clock.trim_at + (0.0 if idle else _TRIM_BUSY_S):
            clock.trim_at = None
            _return_memory()
        # Hold nothing that leads back to the pool while sleeping, so that a dropped pool
        # is collected (its finalizer then stops this thread).
        del pool, taken, requests, decoding
        with clock.cond:
            deadline = boundary + min_cycle_s
            if idle and min_cycle_s < _IDLE_TICK_S and not clock.closing and not clock.poked:
                # An idle clock with no minimum would spin and starve the client threads of
                # the GIL; it waits for the next submit (which notifies) or an idle tick.
                clock.cond.wait(_IDLE_TICK_S)
            asleep = None
            while not clock.closing:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                asleep = meter.mark()
                clock.cond.wait(remaining)
            if asleep is not None:  # woke later than asked: the GIL (or a busy machine) kept it
                last.gil_wait_s += meter.overslept(asleep, deadline)
