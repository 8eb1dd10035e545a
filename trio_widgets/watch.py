"""Watch an unmodified official `tinker` SDK client from the user's side of the wire (issue 26).

`w = trio.watch(service_or_training_client)` returns a thin proxy the user holds instead of the
client: the same methods, called the same way (sync `.result()`, `await future`, the deprecated
`*_async` methods), whose requests each become a record. Nothing of the SDK is changed: no class
or instance attribute is patched, so `unwatch(w)` only stops recording and hands the client back.
(The SDK has no public per-request hook; its public `APIFuture.future()`, a
`concurrent.futures.Future`, is the one seam used: a done-callback on it says when the result
became available on this machine, independent of when the user asks for it.)

Records are :class:`WatchedRequest`, a `RequestRecord` of trio's telemetry filled from the
client's side: `queued_at` = submitted, `delivered_at` = result available (the SDK's future
resolved), `awaited_at` = when the loop first asked for it, `cycle` = None (a server's cycles
are not visible from here), `started_at` / `finished_at` = submitted / available (the span a
trace draws). They go into a bounded :class:`~trio_widgets.telemetry.Telemetry`
(`watcher.telemetry`): subscribers, views and exports read them as they read a pool's.

:func:`diagnose_watched` tells the loop's shape from submit / result order alone (the advisor's
rules and Cause names: naive, together, pipelined; a client-side stall), counts round trips per
update (the longest chain of "waited for a result, then submitted" per update) and the depth of
requests in flight, and says what it cannot know: where a server's cycles begin and end, so no
"cycles per update". A Watcher runs the GIL watchdog (trio_widgets/gil.py) in this process: when
the user's own Python holds the interpreter, the SDK's threads (sending requests, reading results)
wait for it, and its stalls name the function and cell line, as the pool's advisor does.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import importlib.metadata
import itertools
import math
import statistics
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .advisor import (
    CPU_CORES,
    GIL_COVERAGE,
    MIN_UPDATES,
    STRUCTURE_PERIOD,
    WASTED,
    Cause,
    core_demand,
    cpu_message,
    gil_held,
    gil_where,
    recent_stalls,
    segment_start,
    step_kinds,
    update_pairs,
)
from .gil import GilWatchdog
from .metrics import PERIOD_WINDOW, batch_weight, json_safe, record_loss
from .ops import OPS, UPDATE_OPS
from .telemetry import ClientInfo, CoreSample, GilStall, QueueDepthRecord, RequestRecord, Telemetry, UserFrame
from .trace import chrome_trace, write_metrics_jsonl

__all__ = ["SUPPORTED_SDKS", "UnsupportedSDKError", "WatchedDiagnosis", "WatchedRequest", "Watcher",
           "diagnose_watched", "in_flight_depth", "round_trip_depths", "unwatch", "watch", "watcher_of"]

#: SDK versions whose client surface this module was checked against (tinker: tests/test_watch.py;
#: pytrio: tests/test_watch_clients.py, its client classes and APIFuture); trio's own client
#: (in-process or over HTTP, any of its API styles: tinker's or pytrio's) at any version.
SUPPORTED_SDKS: dict[str, tuple[str, ...] | None] = {"tinker": ("0.38.0",), "pytrio": ("0.2.9",),
                                                     "trio_widgets": None}

#: What a client-side view cannot know, said wherever it diagnoses.
UNKNOWN = ("not visible from the client: the server's cycle boundaries (so no cycles per update, only round "
           "trips) and its queue")


class UnsupportedSDKError(TypeError):
    """`watch` was given something it does not know how to watch, or an SDK version it was not
    checked against (pass `check_version=False` to watch it anyway)."""


@dataclass(slots=True)
class WatchedRequest(RequestRecord):
    """A request seen from the client: `queued_at` submitted, `delivered_at` result available."""

    #: when the loop first asked for the result (None: not yet, or never)
    awaited_at: float | None = None
    #: how it asked: "result" (.result()), "await" (await the future), "async" (a *_async method)
    waited_by: str | None = None


# -- the recorder -------------------------------------------------------------------------------

_WATCHERS = itertools.count(1)


class Watcher:
    """Records what watched clients submit, into `telemetry` (bounded ring buffers), and runs the
    GIL watchdog (thread ``trio-gil-watch-N``; `gil=False`: none) until `close()` (or `unwatch`,
    or the watcher is dropped).

    It is also what `trio.Dashboard(watch=...)` shows, read as a pool is (a
    :class:`~trio_widgets.pools.PoolView` without cycles): each submit and result adds a
    `QueueDepthRecord` of the requests in flight per client (its `cycle`: a running count)."""

    #: what a PoolView has; a client's side has no cycles
    min_cycle_s = 0.0
    cycle_index = 0
    device_type = "client side"

    def __init__(self, capacity: int = 4096, telemetry: Telemetry | None = None, *, gil: bool = True,
                 name: str = "tinker client (watched)"):
        self.telemetry = telemetry if telemetry is not None else Telemetry(capacity)
        self.name = name
        self.active = True
        self._ids = itertools.count(1)
        self._samplers = itertools.count(1)
        self._marks = itertools.count(1)
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()
        self.watchdog: GilWatchdog | None = None
        if gil:
            self.watchdog = GilWatchdog(self.telemetry, f"watch-{next(_WATCHERS)}").start()
            weakref.finalize(self, self.watchdog.stop, 0)

    def close(self) -> None:
        """Stop recording (requests already submitted still get their result time) and the watchdog."""
        self.active = False
        if self.watchdog is not None:
            self.watchdog.stop()

    @property
    def closed(self) -> bool:
        return not self.active

    def in_flight(self) -> dict[str, int]:
        """Requests submitted and not yet answered, per client, now."""
        with self._lock:
            return {cid: n for cid, n in self._in_flight.items() if n}

    def _mark(self, client_id: str, change: int, now: float) -> None:
        with self._lock:
            self._in_flight[client_id] = max(0, self._in_flight.get(client_id, 0) + change)
            mark = QueueDepthRecord(next(self._marks), now, dict(self._in_flight))
        self.telemetry.add_boundary(mark)

    # writers
    def add_client(self, client_id: str, kind: str, label: str = "", parent: str | None = None,
                   base_model: str = "") -> None:
        if self.telemetry.client_info(client_id) is None:
            self.telemetry.add_client(ClientInfo(client_id, "sampling" if kind == "sampling" else "training",
                                                 base_model, label or client_id, parent=parent))

    def sampler_id(self) -> str:
        with self._lock:
            return f"sampler-{next(self._samplers)}"

    def submitted(self, client_id: str, op: str, tokens: int = 0, weight: float | None = None) -> WatchedRequest:
        now = time.perf_counter()
        with self._lock:
            rid = next(self._ids)
        record = WatchedRequest(rid, client_id, op, queued_at=now, tokens=tokens, status="running", started_at=now)
        if weight is not None:
            record.metrics["weight:sum"] = weight
        self.telemetry.add_request(record)
        self._mark(client_id, 1, now)
        return record

    def resolved(self, record: WatchedRequest, result: Any = None, error: BaseException | None = None,
                 cancelled: bool = False) -> None:
        """The SDK's future finished (any thread; the first call per record counts: the SDK's
        done-callback and the loop's own `result()` may both report it, at once)."""
        now = time.perf_counter()
        with self._lock:
            if record.delivered_at is not None:
                return
            if cancelled:
                record.status = "cancelled"
            elif error is not None:
                record.status, record.error = "error", f"{type(error).__name__}: {error}"[:500]
            else:
                record.status = "ok"
                record.metrics.update(_numbers(getattr(result, "metrics", None)))
            record.finished_at = record.delivered_at = now
        self.telemetry.request_delivered(record)
        self._mark(record.client_id, -1, now)

    def track(self, record: WatchedRequest, future: Any) -> None:
        """Mark `record` resolved when the SDK's concurrent future is (its public `.future()`)."""
        def done(f: Any) -> None:
            if f.cancelled():
                self.resolved(record, cancelled=True)
            elif f.exception() is not None:
                self.resolved(record, error=f.exception())
            else:
                self.resolved(record, f.result())

        future.add_done_callback(done)

    @staticmethod
    def asked(record: WatchedRequest, how: str) -> None:
        if record.awaited_at is None:
            record.awaited_at, record.waited_by = time.perf_counter(), how

    # readers
    def records(self) -> list[WatchedRequest]:
        return [r for r in list(self.telemetry.requests) if isinstance(r, WatchedRequest)]

    def diagnose(self, window: int = PERIOD_WINDOW) -> dict[str, WatchedDiagnosis]:
        return diagnose_watched(self.records(), self.telemetry.all_clients(), window=window,
                                stalls=recent_stalls(self.telemetry), cores=list(self.telemetry.cores))

    def chrome_trace(self, name: str | None = None) -> dict[str, Any]:
        """The Perfetto / Chrome trace: a lane per client with a bar per request (submitted →
        result available; args: when the loop asked, how) and an 'in flight <client>' counter."""
        trace = chrome_trace(self.telemetry, name=name or self.name, depth=("in flight", "in_flight"))
        events = trace["traceEvents"]
        records = {r.request_id: r for r in self.records()}
        spans = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("request_id") in records]
        if not spans:
            return trace
        for e in spans:
            r = records[e["args"]["request_id"]]
            e["args"].pop("queued_ms", None)
            e["args"]["waited_by"] = r.waited_by
            if r.awaited_at is not None:
                e["args"]["awaited_ms"] = round((r.awaited_at - r.queued_at) * 1e3, 3)
        trace["otherData"]["unknown"] = UNKNOWN
        return trace

    def write_chrome_trace(self, path: Any, **kwargs: Any) -> str:
        import json
        import os

        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(**kwargs), f)
        return path

    def metrics_rows(self) -> list[dict[str, Any]]:
        """One row per finished forward_backward, per client: step, loss, tokens, the round trip
        (submitted → result available) and how long the result waited for the loop to ask."""
        clients = self.telemetry.all_clients()
        steps: dict[str, int] = {}
        rows = []
        for r in sorted(self.records(), key=lambda r: r.request_id):
            if r.op not in UPDATE_OPS or r.status != "ok" or r.delivered_at is None:
                continue
            steps[r.client_id] = step = steps.get(r.client_id, 0) + 1
            info = clients.get(r.client_id)
            rows.append({"run": info.label if info else r.client_id, "client_id": r.client_id, "step": step,
                         "loss": record_loss(r.metrics), "loss:sum": r.metrics.get("loss:sum", math.nan),
                         "tokens": r.tokens, "cycle": None, "time/round_trip": r.delivered_at - r.queued_at,
                         "time/unclaimed": (max(0.0, r.awaited_at - r.delivered_at)
                                            if r.awaited_at is not None else None)})
        return [json_safe(row) for row in rows]

    def write_metrics_jsonl(self, path: Any) -> str:
        return write_metrics_jsonl(self.metrics_rows(), path)


def _numbers(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, dict):
        return {}
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def _batch(args: tuple, kwargs: dict) -> tuple[int, float | None]:
    data = kwargs.get("data", args[0] if args else None)
    try:
        weight, tokens = batch_weight(list(data or ()))
        return tokens, weight
    except (AttributeError, TypeError, ValueError):
        return 0, None


# -- the proxies ----------------------------------------------------------------------------------

class WatchedFuture:
    """The SDK's APIFuture, as the user holds it: the same `result`, `result_async`, `future`,
    `coroutine` and `await` (pytrio's: `result`, `await`, `done`, `exception`, `cancel`, `map`),
    noting when the loop first asked for the result.

    A result the loop gets is recorded as available then, if the SDK's done-callback has not
    recorded it yet: a concurrent future wakes its waiters before it runs its callbacks, so a
    naive loop could otherwise submit its next request first and seem to have two in flight.

    `failures`: also record a failure or cancellation when the loop meets it (pytrio's futures,
    whose public surface signals only a success as it happens: see `_track`)."""

    __slots__ = ("_inner", "_record", "_watcher", "_failures")

    def __init__(self, inner: Any, record: WatchedRequest, watcher: Watcher, failures: bool = False):
        self._inner = inner
        self._record = record
        self._watcher = watcher
        self._failures = failures

    @property
    def record(self) -> WatchedRequest:
        return self._record

    def result(self, timeout: float | None = None) -> Any:
        Watcher.asked(self._record, "result")
        try:
            out = self._inner.result(timeout)
        except BaseException as exc:
            self._failed(exc)
            raise
        return self._arrived(out)

    async def result_async(self, timeout: float | None = None) -> Any:
        Watcher.asked(self._record, "await")
        try:
            out = await self._inner.result_async(timeout)
        except BaseException as exc:
            self._failed(exc)
            raise
        return self._arrived(out)

    async def _awaited(self) -> Any:
        """`await` on a future without `result_async` (pytrio's: awaitable itself)."""
        Watcher.asked(self._record, "await")
        try:
            out = await self._inner
        except BaseException as exc:
            self._failed(exc)
            raise
        return self._arrived(out)

    def _arrived(self, out: Any) -> Any:
        if self._record.delivered_at is None:
            self._watcher.resolved(self._record, out)
        return out

    def _failed(self, exc: BaseException) -> None:
        if not self._failures or self._record.delivered_at is not None or not self._inner.done():
            return  # (tracked by a done-callback, already recorded, or only a wait that timed out)
        from concurrent.futures import CancelledError

        if isinstance(exc, (asyncio.CancelledError, CancelledError)):
            self._watcher.resolved(self._record, cancelled=True)
        else:
            self._watcher.resolved(self._record, error=exc)

    def future(self) -> Any:
        return self._inner.future()

    async def coroutine(self) -> Any:
        return await self

    def __await__(self) -> Any:
        if _has(self._inner, "result_async"):
            return self.result_async().__await__()
        return self._awaited().__await__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"<watched {self._inner!r}>"


class _Proxy:
    """What every watched object shares: the target, the watcher, delegation of the rest."""

    _ops: tuple[str, ...] = ()

    def __init__(self, target: Any, watcher: Watcher, client_id: str = ""):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_watcher", watcher)
        object.__setattr__(self, "_client_id", client_id)

    def __getattr__(self, name: str) -> Any:
        value = getattr(object.__getattribute__(self, "_target"), name)
        if name in ("result", "result_async") and callable(value):
            # trio's clients are also futures of themselves: resolved, they are this proxy
            return _resolving_to(self, value)
        return value

    def __await__(self) -> Any:  # (trio's clients are awaitable: the client itself)
        return _resolving_to(self, object.__getattribute__(self, "_target").result_async)().__await__()

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._target)) | set(type(self).__dict__))

    def __repr__(self) -> str:
        return f"<watched {self._target!r}>"

    def __enter__(self) -> Any:
        self._target.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._target.__exit__(*exc)


def _resolving_to(proxy: _Proxy, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (a result getter of the proxy's target), answering the proxy where it answers the target."""
    target = object.__getattribute__(proxy, "_target")
    if asyncio.iscoroutinefunction(method):
        async def aresolved(*args: Any, **kwargs: Any) -> Any:
            out = await method(*args, **kwargs)
            return proxy if out is target else out

        return aresolved

    def resolved(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        return proxy if out is target else out

    return resolved


def _submitter(op: str) -> Callable[..., Any]:
    """A method that submits `op` through the target and records it."""
    def method(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
        call = getattr(self._target, op)
        if not self._watcher.active:
            return call(*args, **kwargs)
        tokens, weight = _batch(args, kwargs) if OPS.get(op, None) and OPS[op].kind == "forward" else (0, None)
        record = self._watcher.submitted(self._client_id, op, tokens, weight)
        try:
            inner = call(*args, **kwargs)
        except BaseException as exc:
            self._watcher.resolved(record, error=exc)
            raise
        watched = _track(self._watcher, record, inner)
        if watched is None:  # (not a future: the call returned the result itself)
            Watcher.asked(record, "result")
            self._watcher.resolved(record, inner)
            return inner
        return watched

    method.__name__ = op
    return method


def _is_future(out: Any) -> bool:
    """Whether `out` is an SDK's future of a request: tinker's and trio's APIFuture (`.future()`,
    `result_async`) or pytrio's (`result`, `map`, awaitable; no `.future()`)."""
    return (_has(out, "future") and _has(out, "result_async")) or \
        (_has(out, "result") and _has(out, "map") and _has(out, "__await__"))


def _track(watcher: Watcher, record: WatchedRequest, inner: Any) -> WatchedFuture | None:
    """`inner`, the SDK's future of `record`'s request, as the user gets it, the time its result
    became available recorded; None if it is no future."""
    if _has(inner, "future"):  # tinker's and trio's: a concurrent.futures.Future
        watcher.track(record, inner.future())
        return WatchedFuture(inner, record, watcher)
    if not _is_future(inner):
        return None

    # pytrio's APIFuture has no `.future()` and no add_done_callback. Its public `map(transform)` runs
    # `transform` from its concurrent future's done-callback, on the thread that delivers the result,
    # whether or not the loop asks: the same moment tinker's `.future().add_done_callback` gives. A
    # failure or cancellation skips `transform`; the WatchedFuture records it when the loop meets it.
    def arrived(result: Any) -> None:  # (None: the mapped future, dropped, holds no second reference)
        watcher.resolved(record, result)

    inner.map(arrived)
    return WatchedFuture(inner, record, watcher, failures=True)


def _async_submitter(op: str) -> Callable[..., Awaitable[Any]]:
    """`op_async`: awaiting it submits (and, for a sampler, waits for the result too)."""
    async def method(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
        call = getattr(self._target, f"{op}_async")
        if not self._watcher.active:
            return await call(*args, **kwargs)
        tokens, weight = _batch(args, kwargs) if OPS.get(op, None) and OPS[op].kind == "forward" else (0, None)
        record = self._watcher.submitted(self._client_id, op, tokens, weight)
        try:
            out = await call(*args, **kwargs)
        except BaseException as exc:
            self._watcher.resolved(record, error=exc)
            raise
        watched = _track(self._watcher, record, out)  # an APIFuture: the training ops
        if watched is not None:
            return watched
        Watcher.asked(record, "async")  # a sampler's *_async returns the result itself
        self._watcher.resolved(record, out)
        return out

    method.__name__ = f"{op}_async"
    return method


def _maker(name: str, wrap: Callable[[Any, Any, Watcher], Any], is_async: bool = False,
           op: str | None = None) -> Callable[..., Any]:
    """A method returning a client (or a future of one), watched by the same watcher; `op`: the
    request it sends first (recorded until the client is ready)."""
    def record(self: _Proxy) -> WatchedRequest | None:
        return self._watcher.submitted(self._client_id, op) if op and self._watcher.active else None

    if is_async:
        async def amethod(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
            sent = record(self)
            try:
                out = await getattr(self._target, name)(*args, **kwargs)
            except BaseException as exc:
                if sent is not None:
                    self._watcher.resolved(sent, error=exc)
                raise
            if sent is not None:
                Watcher.asked(sent, "async")
                self._watcher.resolved(sent)
            return wrap(out, self, self._watcher)

        amethod.__name__ = name
        return amethod

    def method(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
        sent = record(self)
        try:
            out = getattr(self._target, name)(*args, **kwargs)
        except BaseException as exc:
            if sent is not None:
                self._watcher.resolved(sent, error=exc)
            raise
        watched = wrap(out, self, self._watcher)
        if sent is not None and _has(out, "future"):
            self._watcher.track(sent, out.future())
            if isinstance(watched, WatchedClientFuture):
                watched.record = sent
        elif sent is not None:  # the client itself (pytrio's): returned once the save was done
            Watcher.asked(sent, "result")
            self._watcher.resolved(sent)
        return watched

    method.__name__ = name
    return method


class WatchedClientFuture:
    """A future of a client (the SDK's Backcompat*ClientFuture; trio's clients, futures of
    themselves): resolves to the watched client."""

    __slots__ = ("_inner", "_wrap", "_watcher", "_client", "record")

    def __init__(self, inner: Any, wrap: Callable[[Any], Any], watcher: Watcher):
        self._inner = inner
        self._wrap = wrap
        self._watcher = watcher
        self._client: Any = None
        #: the request the client waits for (a save_weights_and_get_sampling_client's save), if any
        self.record: WatchedRequest | None = None

    def _watched(self, client: Any) -> Any:
        if self._client is None:
            self._client = self._wrap(client)
        return self._client

    def result(self, timeout: float | None = None) -> Any:
        if self.record is not None:
            Watcher.asked(self.record, "result")
        return self._watched(self._inner.result(timeout))

    async def result_async(self, timeout: float | None = None) -> Any:
        if self.record is not None:
            Watcher.asked(self.record, "await")
        return self._watched(await self._inner.result_async(timeout))

    def future(self) -> Any:
        return self._inner.future()

    def __await__(self) -> Any:
        return self.result_async().__await__()

    def __getattr__(self, name: str) -> Any:  # the SDK's deprecated "use the future as the client"
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        return f"<watched {self._inner!r}>"


def _has(obj: Any, name: str) -> bool:
    """Whether `obj`'s class defines `name`: asked of the class, as the SDK's futures of clients
    answer any other attribute by waiting for the client (deprecated, with a warning)."""
    return hasattr(type(obj), name)


def _training(client: Any, watcher: Watcher) -> WatchedTrainingClient:
    # the run's id: pytrio's training_run_cuid (its model_id names the base model; trio's is the
    # same as its model_id), else tinker's model_id
    run_id = getattr(client, "training_run_cuid", None) or getattr(client, "model_id", "")
    client_id = str(run_id or f"training-{id(client):x}")
    watcher.add_client(client_id, "training", label=_label(client_id))
    return WatchedTrainingClient(client, watcher, client_id)


def _label(model_id: str) -> str:
    """A lane's name: the session's start, and which of its clients after the first (the clients of one
    ServiceClient share a session: "sess-aa1a4f58", "sess-aa1a4f58:train:1"), as a served pool names them."""
    head, _, tail = model_id.partition(":")
    if not head:
        return model_id
    return head[:13] if tail in ("", "train:0") else f"{head[:13]}:{tail}"


def _sampling(client: Any, watcher: Watcher, parent: str | None = None) -> WatchedSamplingClient:
    client_id = watcher.sampler_id()
    watcher.add_client(client_id, "sampling", parent=parent)
    return WatchedSamplingClient(client, watcher, client_id)


def _wrap_training(out: Any, owner: _Proxy, watcher: Watcher) -> Any:
    if _has(out, "forward_backward") and not _has(out, "result"):
        return _training(out, watcher)
    return WatchedClientFuture(out, lambda c: _training(c, watcher), watcher)


def _wrap_sampling(out: Any, owner: _Proxy, watcher: Watcher) -> Any:
    parent = owner._client_id or None
    if _has(out, "sample") and not _has(out, "result"):
        return _sampling(out, watcher, parent)
    return WatchedClientFuture(out, lambda c: _sampling(c, watcher, parent), watcher)


class WatchedTrainingClient(_Proxy):
    """A tinker TrainingClient whose requests are recorded."""

    _ops = ("forward", "forward_backward", "forward_backward_custom", "optim_step", "save_state", "load_state",
            "load_state_with_optimizer", "save_weights_for_sampler", "save_weights_external")


class WatchedSamplingClient(_Proxy):
    """A tinker SamplingClient whose requests are recorded."""

    _ops = ("sample", "compute_logprobs")


class WatchedServiceClient(_Proxy):
    """A tinker ServiceClient whose clients are watched."""


for _cls in (WatchedTrainingClient, WatchedSamplingClient):
    for _op in _cls._ops:
        setattr(_cls, _op, _submitter(_op))
        setattr(_cls, f"{_op}_async", _async_submitter(_op))
for _name, _sent in (("create_sampling_client", None), ("save_weights_and_get_sampling_client",
                                                      "save_weights_for_sampler")):
    setattr(WatchedTrainingClient, _name, _maker(_name, _wrap_sampling, op=_sent))
    setattr(WatchedTrainingClient, f"{_name}_async", _maker(f"{_name}_async", _wrap_sampling, True, _sent))
for _name in ("create_lora_training_client", "create_training_client_from_state",
              "create_training_client_from_state_with_optimizer"):
    setattr(WatchedServiceClient, _name, _maker(_name, _wrap_training))
    setattr(WatchedServiceClient, f"{_name}_async", _maker(f"{_name}_async", _wrap_training, True))
for _name in ("create_sampling_client",):
    setattr(WatchedServiceClient, _name, _maker(_name, _wrap_sampling))
    setattr(WatchedServiceClient, f"{_name}_async", _maker(f"{_name}_async", _wrap_sampling, True))


def _check_sdk(client: Any, check_version: bool) -> None:
    package = type(client).__module__.split(".")[0]
    if package not in SUPPORTED_SDKS:
        raise UnsupportedSDKError(
            f"trio.watch watches the official SDKs' clients ({', '.join(SUPPORTED_SDKS)}); "
            f"got {type(client).__module__}.{type(client).__qualname__}")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - imported, so installed
        version = "unknown"
    checked = SUPPORTED_SDKS[package]
    if check_version and checked is not None and version not in checked:
        raise UnsupportedSDKError(
            f"trio.watch was checked against {package} {', '.join(checked)}, not the installed "
            f"{version}: its client methods may differ. Pass check_version=False to watch it anyway.")


def watch(client: Any, *, watcher: Watcher | None = None, check_version: bool = True) -> Any:
    """Watch a tinker ServiceClient, TrainingClient or SamplingClient (or a future of one): returns
    a proxy to use in its place, the same methods called the same way, every request recorded in
    `watcher_of(proxy).telemetry` (a new :class:`Watcher` unless one is given: clients watched with
    the same watcher share its telemetry). Nothing of the SDK is modified.

    Example: `service = trio.watch(tinker.ServiceClient())`, then `trio.Dashboard(watch=service)`
    and the loop, unchanged, through `service`; `trio.unwatch(service)` when done."""
    if isinstance(client, (_Proxy, WatchedClientFuture)):
        raise UnsupportedSDKError("this client is already watched")
    _check_sdk(client, check_version)
    # A future of a client: watch what it resolves to. (The SDK's futures of clients have the client's
    # methods too; trio's clients are futures that resolve to themselves: the same path.)
    sampling = _has(client, "sample")
    if _has(client, "result") and (sampling or _has(client, "forward_backward")):
        kind = "future"
    elif _has(client, "forward_backward") or sampling:
        kind = "client"
    elif _has(client, "create_lora_training_client"):
        kind = "service"
    else:  # (before a watcher, and its watchdog thread, is made)
        raise UnsupportedSDKError(f"trio.watch watches the official SDKs' clients and trio's own; "
                                  f"a {type(client).__module__}.{type(client).__qualname__} is none of them")
    w = watcher if watcher is not None else Watcher()
    if kind == "future":
        return WatchedClientFuture(client, lambda c: (_sampling(c, w) if sampling else _training(c, w)), w)
    if kind == "client":
        return _sampling(client, w) if sampling else _training(client, w)
    return WatchedServiceClient(client, w)


def watcher_of(watched: Any) -> Watcher:
    """The Watcher recording a watched client."""
    return object.__getattribute__(watched, "_watcher")


def unwatch(watched: Any) -> Any:
    """Stop recording through `watched` and every client watched with the same watcher (requests
    already submitted still get their result time); returns the client it watched. The SDK was
    never modified, so nothing needs restoring."""
    if isinstance(watched, WatchedClientFuture):
        watcher_of(watched).close()
        return object.__getattribute__(watched, "_inner")
    if not isinstance(watched, _Proxy):
        raise TypeError(f"not a watched client: {watched!r}")
    watcher_of(watched).close()
    return object.__getattribute__(watched, "_target")


# -- the diagnosis --------------------------------------------------------------------------------

@dataclass(frozen=True)
class WatchedDiagnosis:
    """The advisor's diagnosis, from the client's side: the same Cause names, in round trips
    (a result waited for, then the next request) instead of a server's cycles."""

    client_id: str
    label: str
    cause: Cause
    message: str
    #: the loop's round trips per update: 2 naive, 1 together, 0.5 pipelined with one update ahead
    round_trips_per_update: float | None = None
    #: the most requests this client had in flight (submitted, result not yet available)
    in_flight: int = 0
    #: median seconds from submit to result available, and from a result to the next request
    round_trip_s: float | None = None
    stall_s: float | None = None
    updates: int = 0
    #: gil: the share of the loop's time the user's Python held the interpreter, and where it ran
    gil_share: float | None = None
    gil_frames: tuple[UserFrame, ...] = ()
    evidence: str = ""
    unknown: str = UNKNOWN

    @property
    def wasted(self) -> bool:
        return self.cause in WASTED


def _done(r: RequestRecord) -> float:
    return r.delivered_at if r.delivered_at is not None else math.inf


def round_trip_depths(records: Sequence[RequestRecord]) -> dict[int, int]:
    """request_id -> the longest chain of round trips behind it: 1 + the most of any request of
    the same records whose result was available before it was submitted (the loop may have
    waited for it). One client's records."""
    ordered = sorted(records, key=lambda r: r.queued_at)
    finished = sorted((r for r in ordered if r.delivered_at is not None), key=_done)
    depth: dict[int, int] = {}
    best, k = 0, 0
    for r in ordered:
        while k < len(finished) and _done(finished[k]) <= r.queued_at:
            best = max(best, depth.get(finished[k].request_id, 0))
            k += 1
        depth[r.request_id] = best + 1
    return depth


def _depth_steps(records: Iterable[RequestRecord]) -> list[tuple[float, int]]:
    """(time, requests in flight) after each submit and each result, in time order."""
    events = sorted([(r.queued_at, 1) for r in records] + [(r.delivered_at, -1) for r in records
                                                           if r.delivered_at is not None],
                    key=lambda e: (e[0], e[1]))
    steps, depth = [], 0
    for t, change in events:
        depth += change
        steps.append((t, depth))
    return steps


def in_flight_depth(records: Iterable[RequestRecord], ops: Iterable[str] | None = None) -> int:
    """The most requests submitted and not yet delivered at once (of these records: one client's,
    from either side of the wire; `ops`: only those ops)."""
    chosen = [r for r in records if ops is None or r.op in set(ops)]
    return max((d for _, d in _depth_steps(chosen)), default=0)


def diagnose_watched(records: Iterable[RequestRecord], clients: dict[str, ClientInfo] | None = None, *,
                     window: int = PERIOD_WINDOW, stalls: Sequence[GilStall] = (),
                     cores: Sequence[CoreSample] = ()) -> dict[str, WatchedDiagnosis]:
    """One diagnosis per client that sent forward_backward, from client-side records alone
    (`stalls`: the GIL watchdog's, of this process, to tell the user's Python starving the SDK;
    `cores`: its CoreSamples, to tell a busy CPU)."""
    by_client: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_client.setdefault(r.client_id, []).append(r)
    # only the user's own Python: the SDK's and trio's threads run Python for the requests themselves
    mine_held = [s for s in stalls if s.frames and s.frames[0].user]
    out = {}
    for cid, mine in by_client.items():
        if any(r.op in UPDATE_OPS for r in mine):
            info = (clients or {}).get(cid)
            out[cid] = _diagnose_client(sorted(mine, key=lambda r: r.request_id), cid,
                                        info.label if info else cid, window, mine_held, cores)
    return out


def _diagnose_client(records: list[RequestRecord], cid: str, label: str, window: int,
                     stalls: Sequence[GilStall], cores: Sequence[CoreSample] = ()) -> WatchedDiagnosis:
    updates = update_pairs(records, need_cycle=False)[-(window + 1):]
    if len(updates) < MIN_UPDATES:
        return WatchedDiagnosis(cid, label, "warming-up", "measuring: waiting for a few updates",
                                updates=len(updates), evidence=f"{len(updates)} of {MIN_UPDATES} updates measured")
    kinds = step_kinds(updates)
    start = segment_start(kinds)
    # the GIL over the whole window, as the advisor judges it (a heavy loader makes a loop flip shapes)
    w0, w1 = updates[0][0].queued_at, _done(updates[-1][1] or updates[-1][0])
    held = gil_held(stalls, w0, w1)
    demand = core_demand(cores, w0, w1)
    updates, kinds = updates[start:], kinds[start:]
    structure = max(STRUCTURE_PERIOD, key=lambda k: (kinds.count(k), -STRUCTURE_PERIOD[k]))

    # round trips: the chain depth of each update's forward_backward, over two updates (a loop one
    # update ahead waits for a result every other update)
    t0, t1 = updates[0][0].queued_at, _done(updates[-1][1] or updates[-1][0])
    span = [r for r in records if t0 <= r.queued_at <= t1]
    depth = round_trip_depths([r for r in records if r.queued_at <= t1])
    chain = [depth[fb.request_id] for fb, _ in updates]
    step = 2 if len(chain) > 2 else 1
    trips = float(statistics.median((b - a) / step for a, b in zip(chain, chain[step:])))
    in_flight = in_flight_depth(span)
    round_trip = statistics.median(_done(fb) - fb.queued_at for fb, _ in updates)

    # client-side stall: from the first result after the loop's previous request to its next one
    deliveries = sorted(_done(r) for r in records if r.delivered_at is not None)
    submissions = sorted(r.queued_at for r in span)
    gaps: dict[int, float] = {}
    starts = [fb.queued_at for fb, _ in updates]
    for prev, sub in zip(submissions, submissions[1:]):
        k = bisect.bisect_right(deliveries, prev)
        if k < len(deliveries) and deliveries[k] <= sub:
            u = bisect.bisect_right(starts, sub) - 1
            gaps[u] = gaps.get(u, 0.0) + sub - deliveries[k]
    stall = float(statistics.median(gaps.get(u, 0.0) for u in range(1, len(updates))))

    n = len(updates)
    # As the advisor: a stall from one cycle, and for naive / together loops from the cycles their
    # shape wastes anyway; a cycle taken as half a round trip (the least one takes on a clock pool)
    threshold = max(0.5, (STRUCTURE_PERIOD[structure] - 1) / 2)
    trips_text = f"{trips:g} round trip{'' if trips == 1 else 's'} per update"
    counts = "/".join(str(kinds.count(k)) for k in STRUCTURE_PERIOD)
    gil_text = f"your Python held the interpreter {held[0]:.0%} of the time (gil from {GIL_COVERAGE:.0%}); " \
        if held is not None else ""
    evidence = (f"{n} updates; steps naive/together/pipelined: {counts}; {trips_text}; up to {in_flight} requests "
                f"in flight; round trip {round_trip * 1e3:.0f} ms "
                f"(submit → result), next request {stall * 1e3:.0f} ms after a result (stall from {threshold:g} "
                f"round trips); {gil_text}{UNKNOWN}")
    made = functools.partial(WatchedDiagnosis, round_trips_per_update=trips, in_flight=in_flight,
                             round_trip_s=round_trip, stall_s=stall, updates=n, evidence=evidence)
    if held is not None and held[0] >= GIL_COVERAGE:
        share, culprit = held
        return made(
            cid, label, "gil",
            f"your Python held the interpreter {share:.0%} of the loop's time ({gil_where(culprit)}); the SDK's "
            f"threads share this process and wait for it to send requests and read results — move that work out "
            f"of the loop, precompute it, or run it in a subprocess", gil_share=share, gil_frames=culprit.frames)
    if demand is not None and demand[0] is None and stall >= threshold * round_trip:
        return made(
            cid, label, "gil-or-cpu",
            f"results were ready but your next request came {stall * 1e3:.0f} ms later, and this platform gives no "
            f"per-thread run-queue times (/proc/self/task/*/schedstat): trio cannot tell whether your Python held "
            f"the interpreter lock (GIL) or the loop waited for a CPU core — check the machine's load (top)")
    if demand is not None and demand[0] is not None and demand[0] >= CPU_CORES * demand[1] and \
            stall >= threshold * round_trip:
        return made(cid, label, "cpu", cpu_message(demand[0], demand[1], "your loop"),
                    evidence=f"this process's threads wanted {demand[0]:.1f} of {demand[1]} cores (cpu from "
                             f"{CPU_CORES:.0%} of them); " + evidence)
    if stall >= threshold * round_trip:
        return made(
            cid, label, "stall",
            f"client-side stall: results were ready but your next request came {stall * 1e3:.0f} ms later (a round "
            f"trip takes {round_trip * 1e3:.0f} ms) — your loop was busy elsewhere meanwhile (computing, or waiting "
            f"for data): make that cheaper, or overlap it with training (queue the next request first, read ahead "
            f"in a thread)")
    if structure == "naive":
        return made(
            cid, label, "naive",
            f"optim_step was submitted after awaiting forward_backward: {trips_text} instead of one every other "
            f"update — submit optim_step right after forward_backward, before awaiting")
    if structure == "together":
        return made(
            cid, label, "together",
            f"the next batch was submitted only after the previous update finished: {trips_text} — queue the next "
            f"batch before awaiting the current one (pipeline)")
    return made(cid, label, "pipelined", f"{trips_text}: pipelined, the next update is queued while one is in "
                f"flight (whether the server runs one every cycle is not visible from here)")
