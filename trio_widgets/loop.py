"""The training loop: naive, together or pipelined updates as an asyncio task.

>>> run = train(tc, batches, mode="pipelined", lookahead=1, learning_rate=3e-3, steps=200)
>>> run.pause(); run.resume(); run.stop()     # from any thread; applied at the next update
>>> await run                                  # or: run_sync(run) in a script / blocking cell

Modes (docs/architecture.md, "Clock cycles"; cycles per update = the period):

* ``naive``     await forward_backward, then submit optim_step and await it: 4 cycles
* ``together``  submit both, await both, then the next batch: 2 cycles
* ``pipelined`` keep up to ``lookahead`` updates queued ahead of the one awaited: 1 cycle

Per step the run records cookbook-style metrics (``step``, ``loss`` per weighted token,
``tokens``, ``cycle``, ``cycles`` since the previous update, ``time/get_batch``,
``time/submit``, ``time/wait``, ``time/total``, ``time/gil_wait``: how long the pool's clock
waited for the interpreter in the cycles that ran the update, ``learning_rate``, ``mode``) in
``run.metrics`` (bounded) and, with ``metrics_path``, as lines of ``metrics.jsonl``.

Interrupting never leaves updates unaccounted for: cancelling ``await run`` (Kernel →
Interrupt does) or Ctrl+C in ``run_sync(...)`` stops the run, lets what it already
submitted complete and records it, then raises :class:`RunInterrupted` (one line in a
notebook). A run whose task is cancelled outright withdraws the updates still queued and
completes and records those already taken into a cycle. So ``run.metrics`` and
``metrics.jsonl`` always list exactly the updates the weights received.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import IO, Any, Literal, TypeVar

from .client import TrainingClient
from .errors import PoolClosedError
from .futures import APIFuture
from .metrics import batch_weight, gil_wait, json_safe, loss_per_token
from .types import AdamParams, Datum
from .validation import is_int

__all__ = ["MODES", "RunEnding", "RunInterrupted", "TrainingRun", "live_runs", "run_endings", "run_sync",
           "train"]

log = logging.getLogger(__name__)

Mode = Literal["naive", "together", "pipelined"]
MODES: tuple[str, ...] = ("naive", "together", "pipelined")
State = Literal["created", "running", "paused", "stopped", "finished", "error"]
T = TypeVar("T")


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def _check_lookahead(lookahead: int) -> int:
    if not is_int(lookahead) or lookahead < 0:
        raise ValueError(f"lookahead must be an integer >= 0, got {lookahead!r}")
    return lookahead


_RUNS: weakref.WeakSet[TrainingRun] = weakref.WeakSet()
#: how runs ended, newest last (bounded): a run nobody keeps is gone as soon as its task ends,
#: so whoever reports endings (the dashboard) reads them here
_ENDINGS: deque[RunEnding] = deque(maxlen=256)
_ENDING_IDS = itertools.count(1)
_HOOKED_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True)
class RunEnding:
    seq: int
    name: str
    client_id: str | None
    state: str
    reason: str
    step: int
    steps: int | None


def live_runs() -> list[TrainingRun]:
    """Every TrainingRun still referenced somewhere."""
    return list(_RUNS)


def run_endings(after: int = 0) -> list[RunEnding]:
    """How runs ended (stopped, interrupted, finished, failed, pool closed), `seq` > `after`."""
    return [e for e in list(_ENDINGS) if e.seq > after]


def _pool_of(client: Any) -> Any:
    """The in-process pool a client of ours trains on (None for another SDK's client, or over HTTP)."""
    return client.pool if isinstance(client, TrainingClient) else None


def _say_pool_closed(pool_ref: weakref.ref) -> None:
    """A pool closes (its cell ran again, or close()): say, on the closing thread, i.e. in the
    output of the cell that closed it, which runs it stops."""
    pool = pool_ref()
    for run in list(_RUNS):
        if pool is not None and _pool_of(run.client) is pool and not run.done() and run.state != "created":
            run._pool_closed_said = True
            log.warning("training run %r stops at step %d: its pool %r was closed", run.name, run.step,
                        pool.name)


class RunInterrupted(Exception):
    """Waiting for a run was interrupted (Kernel → Interrupt, Ctrl+C in run_sync): the run was
    stopped after what it had submitted completed, and all of it is in `run.metrics`."""

    def __init__(self, run: TrainingRun):
        self.run = run
        total = f" of {run.steps}" if run.steps is not None else ""
        super().__init__(f"interrupted: run {run.name!r} stopped at step {run.step}{total}; every update it "
                         f"applied is in its metrics")

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: one line where the cell's output goes
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


def _client_label(client: Any) -> str | None:
    """The label the pool shows for this client (`user_metadata={"name": ...}`), if it has one:
    the engine's, on either transport (None for another SDK's client)."""
    return client._handle.label if isinstance(client, TrainingClient) else None


async def _result(future: APIFuture) -> Any:
    """A future's result, without cancelling the request if the awaiting task is cancelled
    (the cancellation clean-up decides what to withdraw, in an order that keeps updates whole).
    One hop from the delivering thread, like ``asyncio.wrap_future``, which would cancel it."""
    done = future.future()
    if not done.done():
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def settle() -> None:
            if not waiter.done():
                waiter.set_result(None)

        def wake(_f: concurrent.futures.Future) -> None:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop closed meanwhile
                pass

        done.add_done_callback(wake)
        await waiter
    return done.result()


@dataclass
class _Update:
    step: int
    fb: APIFuture
    opt: APIFuture | None
    weight: float
    tokens: int
    learning_rate: float
    mode: str
    t_get_batch: float
    t_submit: float


class TrainingRun:
    """One training loop over one client. Build it with :func:`train`.

    ``pause()``, ``resume()`` and ``stop()`` are safe from any thread; they take effect at
    the next update boundary (what is already submitted finishes first, so the weights
    always have whole updates). ``mode``, ``lookahead`` and ``learning_rate`` may be set
    at any time too and apply from the next update on.
    """

    def __init__(self, client: Any, batches: Iterable[list[Datum]] | AsyncIterable[list[Datum]], *,
                 mode: Mode = "pipelined", lookahead: int = 1, adam_params: AdamParams | None = None,
                 learning_rate: float | None = None, loss_fn: str = "cross_entropy",
                 loss_fn_config: dict | None = None, steps: int | None = None,
                 metrics_path: str | os.PathLike | None = None, name: str | None = None,
                 history: int = 10_000, on_step: Callable[[dict], None] | None = None):
        self.client = client
        self.name = name or _client_label(client) or getattr(client, "client_id", "run")
        self._batches = batches
        self._mode = _check_mode(mode)
        self._lookahead = _check_lookahead(lookahead)
        params = adam_params if adam_params is not None else AdamParams(learning_rate=1e-4)
        if learning_rate is not None:
            params = replace(params, learning_rate=float(learning_rate))
        self._adam = params
        self.loss_fn = loss_fn
        self.loss_fn_config = loss_fn_config
        if steps is not None and (not is_int(steps) or steps < 0):
            raise ValueError(f"steps must be an integer >= 0 or None, got {steps!r}")
        self.steps = steps
        self.metrics_path = os.fspath(metrics_path) if metrics_path is not None else None
        self.metrics: deque[dict] = deque(maxlen=history)
        self.on_step = on_step
        self.step = 0
        self.state: State = "created"
        self.error: BaseException | None = None
        #: why the run stopped ("stopped", "interrupted", "the pool was closed", ...), None while it runs
        self.stop_reason: str | None = None
        self.task: asyncio.Task | None = None
        self._lock = threading.Lock()
        self._pause_requested = False
        self._stop_requested = False
        self._stop_reason = "stopped"
        self._interrupted = False  # Ctrl+C landed in the run's own code: the next wait() says so
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._last_fb_cycle: int | None = None
        self._last_done: float | None = None
        self._file: IO[str] | None = None
        self._pool_closed_said = False
        _RUNS.add(self)

    @property
    def client_id(self) -> str | None:
        """The id of the client this run trains."""
        return getattr(self.client, "client_id", None)

    def __repr__(self) -> str:
        why = f" ({self.stop_reason})" if self.stop_reason and self.stop_reason != self.state else ""
        return f"<TrainingRun {self.name!r} {self.state}{why} step={self.step} mode={self._mode}>"

    # -- settings (any thread; read at each update) ----------------------------------
    @property
    def mode(self) -> str:
        """The loop shape: `naive`, `together` or `pipelined`."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        self._mode = _check_mode(value)

    @property
    def lookahead(self) -> int:
        """How many updates a pipelined run queues ahead of the one it awaits."""
        return self._lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        self._lookahead = _check_lookahead(value)

    @property
    def adam_params(self) -> AdamParams:
        """The AdamW settings of the next update."""
        return self._adam

    @adam_params.setter
    def adam_params(self, params: AdamParams) -> None:
        if not isinstance(params, AdamParams):
            raise TypeError(f"expected AdamParams, got {type(params).__name__}")
        self._adam = params

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update (settable: it applies from the next update on)."""
        return self._adam.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {value!r}")
        self._adam = replace(self._adam, learning_rate=value)

    # -- controls (any thread) ------------------------------------------------------------
    def pause(self) -> None:
        """Pause between updates (what was submitted completes)."""
        with self._lock:
            self._pause_requested = True
        self._poke()

    def resume(self) -> None:
        """Resume a paused run."""
        with self._lock:
            self._pause_requested = False
        self._poke()

    def stop(self, reason: str = "stopped") -> None:
        """Stop between updates: what was submitted completes and is recorded."""
        with self._lock:
            if not self._stop_requested:
                self._stop_requested = True
                self._stop_reason = reason
        self._poke()

    @property
    def paused(self) -> bool:
        """True while the run is paused."""
        return self.state == "paused"

    @property
    def pause_requested(self) -> bool:
        """pause() was called and resume() not since (the run pauses at its next update)."""
        return self._pause_requested

    def done(self) -> bool:
        """True once the run has ended (finished, stopped, interrupted or failed)."""
        return self.state in ("stopped", "finished", "error")

    def _poke(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is None or event is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- running ------------------------------------------------------------------------
    def start(self) -> TrainingRun:
        """Schedule the loop as a task on the running event loop (call it on that loop)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._main(), name=f"trio-train-{self.name}")
            pool = _pool_of(self.client)
            if pool is not None and hasattr(pool, "on_close") and pool not in _HOOKED_POOLS:
                _HOOKED_POOLS.add(pool)  # one hook per pool, holding the pool weakly
                pool.on_close(lambda ref=weakref.ref(pool): _say_pool_closed(ref))
        return self

    def _ended(self) -> None:
        _ENDINGS.append(RunEnding(next(_ENDING_IDS), str(self.name), self.client_id, self.state,
                                  self.stop_reason or self.state, self.step, self.steps))

    async def wait(self) -> TrainingRun:
        """Wait until the run ends; re-raises the error that ended it, if any.

        If this wait is cancelled (Kernel → Interrupt on ``await run``), the run is stopped:
        what it already submitted completes and is recorded, then :class:`RunInterrupted`
        says where it stopped. A second interrupt leaves it stopping in the background."""
        task = self.task if self.task is not None else self.start().task
        assert task is not None
        if not task.done():
            try:
                await _task_done(task)
            except asyncio.CancelledError:
                if task.done():
                    raise
                self.stop("interrupted")
                await _task_done(task)
                raise RunInterrupted(self) from None
        if self._interrupted:
            self._interrupted = False
            raise RunInterrupted(self) from None
        if self.error is not None:
            raise self.error
        return self

    def __await__(self):
        return self.wait().__await__()

    async def _next_batch(self, iterator: Any, is_async: bool) -> list[Datum] | None:
        try:
            return await iterator.__anext__() if is_async else next(iterator)
        except (StopIteration, StopAsyncIteration):
            return None

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        batches: Any = self._batches
        is_async = hasattr(batches, "__aiter__")
        iterator = batches.__aiter__() if is_async else iter(batches)
        if self.metrics_path is not None:
            self._file = open(self.metrics_path, "w", encoding="utf-8")
        # every update submitted and not yet recorded, oldest first (the clean-ups read it)
        inflight: deque[_Update] = deque()
        self.state = "running"
        self._last_done = time.perf_counter()
        try:
            while True:
                # ---- an update boundary: controls and settings apply here
                if self._stop_requested:
                    break
                if self._pause_requested:
                    await self._drain(inflight)
                    if not await self._paused():
                        break
                if self.steps is not None and self.step + len(inflight) >= self.steps:
                    break
                mode, lookahead, adam = self._mode, self._lookahead, self._adam
                if mode != "pipelined" or len(inflight) > lookahead:
                    await self._drain(inflight)
                t0 = time.perf_counter()
                batch = await self._next_batch(iterator, is_async)
                if batch is None:
                    break
                t1 = time.perf_counter()
                weight, tokens = batch_weight(batch)
                step = self.step + len(inflight) + 1
                if mode == "naive":
                    fb = await self.client.forward_backward_async(batch, self.loss_fn, self.loss_fn_config)
                    t2 = time.perf_counter()
                    update = _Update(step, fb, None, weight, tokens, adam.learning_rate, mode, t1 - t0, t2 - t1)
                    inflight.append(update)
                    result = await _result(fb)
                    t3 = time.perf_counter()
                    update.opt = await self.client.optim_step_async(adam)
                    t4 = time.perf_counter()
                    update.t_submit += t4 - t3
                    await _result(update.opt)
                    inflight.popleft()
                    self._record(update, result, wait=(t3 - t2) + (time.perf_counter() - t4))
                    continue
                fb = await self.client.forward_backward_async(batch, self.loss_fn, self.loss_fn_config)
                update = _Update(step, fb, None, weight, tokens, adam.learning_rate, mode, t1 - t0, 0.0)
                inflight.append(update)
                update.opt = await self.client.optim_step_async(adam)
                update.t_submit = time.perf_counter() - t1
                if mode == "together":
                    await self._drain(inflight)
                else:
                    while len(inflight) > lookahead:
                        await self._complete(inflight)
            await self._drain(inflight)
            self.state = "stopped" if self._stop_requested else "finished"
            self.stop_reason = self._stop_reason if self._stop_requested else "finished"
        except asyncio.CancelledError:
            await self._settle_cancelled(inflight)
            self.state = "stopped"
            self.stop_reason = self._stop_reason if self._stop_requested else "cancelled"
            raise
        except KeyboardInterrupt:
            # Ctrl+C landed in this task's own code (run_sync in a blocking cell runs it on the
            # cell's thread): the same clean-up as a cancel, and wait() says where it stopped
            await self._settle_cancelled(inflight)
            self.state = "stopped"
            self.stop_reason = "interrupted"
            self._interrupted = True
        except PoolClosedError as exc:
            self.state = "stopped"
            self.stop_reason = "the pool was closed"
            if not self._pool_closed_said:  # else the closing cell has said it already
                log.warning("training run %r stopped at step %d: %s", self.name, self.step, exc)
        except Exception as exc:
            self.error = exc
            # what was already submitted still completes: record it, so metrics match the weights
            while inflight:
                try:
                    await self._complete(inflight)
                except Exception:
                    break
            self.state = "error"
            self.stop_reason = f"{type(exc).__name__}: {exc}"
            log.warning("training run %s failed: %s", self.name, exc)
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._ended()

    async def _settle_cancelled(self, inflight: deque[_Update]) -> None:
        """The run's task was cancelled: withdraw the updates still queued and complete (and
        record) those the pool already took, so that the metrics list exactly what the
        weights received."""
        await self._finish_withdrawn(inflight, self._withdraw(inflight))

    @staticmethod
    def _withdraw(inflight: deque[_Update]) -> dict[int, tuple[bool, bool]]:
        """Withdraw what is still queued, newest first and optim_step before its
        forward_backward: a queue is FIFO, so nothing withdrawn lets a later request run
        early. Per update: (forward_backward withdrawn, optim_step withdrawn or never sent)."""
        withdrawn: dict[int, tuple[bool, bool]] = {}
        for update in reversed(inflight):
            opt_gone = update.opt is None or update.opt.cancelled() or update.opt.cancel()
            fb_gone = opt_gone and (update.fb.cancelled() or update.fb.cancel())
            withdrawn[id(update)] = (fb_gone, opt_gone)
        return withdrawn

    async def _finish_withdrawn(self, inflight: deque[_Update], withdrawn: dict[int, tuple[bool, bool]]) -> None:
        """Record the updates that ran. One whose forward_backward ran but whose optim_step was
        withdrawn (or never sent) gets a new optim_step: its gradient must not linger in the
        adapter, to be applied by some later step; it then counts as applied."""
        while inflight:
            update = inflight[0]
            fb_gone, opt_gone = withdrawn[id(update)]
            if fb_gone:
                inflight.popleft()  # never ran: nothing to record
                continue
            try:
                if opt_gone:
                    update.opt = await self.client.optim_step_async(self._adam_for(update))
                await self._complete(inflight)
            except Exception as exc:  # the pool closed meanwhile: nothing more will run
                log.warning("training run %s: an interrupted update did not complete: %s", self.name, exc)
                return

    def _adam_for(self, update: _Update) -> AdamParams:
        return replace(self._adam, learning_rate=update.learning_rate)

    async def _paused(self) -> bool:
        """Wait while paused; False if stopped meanwhile."""
        self.state = "paused"
        wakeup = self._wakeup
        assert wakeup is not None  # set when the run started
        while self._pause_requested and not self._stop_requested:
            wakeup.clear()
            if not self._pause_requested or self._stop_requested:
                break
            await wakeup.wait()
        if self._stop_requested:
            return False
        self.state = "running"
        self._last_done = time.perf_counter()
        self._last_fb_cycle = None  # the pause is not part of the next update's period
        return True

    async def _drain(self, inflight: deque[_Update]) -> None:
        while inflight:
            await self._complete(inflight)

    async def _complete(self, inflight: deque[_Update]) -> None:
        """Wait for the oldest update in flight and record it (it leaves `inflight` only then)."""
        update = inflight[0]
        t0 = time.perf_counter()
        result = await _result(update.fb)
        assert update.opt is not None
        await _result(update.opt)
        inflight.popleft()
        self._record(update, result, wait=time.perf_counter() - t0)

    def _record(self, update: _Update, result: Any, wait: float) -> None:
        now = time.perf_counter()
        loss_sum = float(result.metrics.get("loss:sum", math.nan))
        cycle = update.fb.cycle
        cycles = None if self._last_fb_cycle is None or cycle is None else cycle - self._last_fb_cycle
        pool = _pool_of(self.client)  # a LocalPool: its telemetry has the cycles' GIL waits
        self._last_fb_cycle = cycle
        optim_cycle = update.opt.cycle if update.opt is not None else None
        row = {
            "step": update.step,
            "loss": loss_per_token(loss_sum, update.weight),
            "loss:sum": loss_sum,
            "tokens": update.tokens,
            "weight": update.weight,
            "cycle": cycle,
            "cycles": cycles,
            "optim_cycle": optim_cycle,
            "learning_rate": update.learning_rate,
            "mode": update.mode,
            "time/get_batch": update.t_get_batch,
            "time/submit": update.t_submit,
            "time/wait": wait,
            "time/total": now - (self._last_done if self._last_done is not None else now),
            "time/gil_wait": gil_wait(pool.telemetry, (cycle, optim_cycle)) if pool is not None else None,
        }
        self._last_done = now
        self.step = update.step
        self.metrics.append(row)
        if self._file is not None:
            self._file.write(json.dumps(json_safe({"run": self.name, **row})) + "\n")
            self._file.flush()
        if self.on_step is not None:
            try:
                self.on_step(row)
            except Exception:
                log.exception("on_step callback failed")


async def _task_done(task: asyncio.Task) -> None:
    """Wait until `task` is done, from this loop or another one (the dashboard's runs live on
    the dashboard's own loop); cancelling the wait leaves the task alone."""
    loop = task.get_loop()
    if loop is asyncio.get_running_loop():
        await asyncio.shield(task)
        return
    done: concurrent.futures.Future = concurrent.futures.Future()

    def settle(_task: asyncio.Task) -> None:
        if not done.done():
            done.set_result(None)

    def watch() -> None:
        task.add_done_callback(settle)

    try:
        loop.call_soon_threadsafe(watch)
    except RuntimeError:  # that loop is closed: the task can no longer run
        return
    await asyncio.wrap_future(done)


def train(client: Any, batches: Iterable[list[Datum]] | AsyncIterable[list[Datum]], *,
          mode: Mode = "pipelined", lookahead: int = 1, adam_params: AdamParams | None = None,
          learning_rate: float | None = None, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None,
          steps: int | None = None, metrics_path: str | os.PathLike | None = None, name: str | None = None,
          history: int = 10_000, on_step: Callable[[dict], None] | None = None) -> TrainingRun:
    """Train `client` on `batches` (lists of Datum; ends when they do, or after `steps`).

    Inside a running event loop (a notebook cell) the loop starts at once as a background
    task and this returns immediately: the cell ends, buttons keep working. Outside one,
    the run starts when awaited, e.g. ``run_sync(train(...))`` in a script.
    """
    run = TrainingRun(client, batches, mode=mode, lookahead=lookahead, adam_params=adam_params,
                      learning_rate=learning_rate, loss_fn=loss_fn, loss_fn_config=loss_fn_config, steps=steps,
                      metrics_path=metrics_path, name=name, history=history, on_step=on_step)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run
    return run.start()


def run_sync(awaitable: Awaitable[T]) -> T:
    """Run `awaitable` to completion and return its result, from sync code.

    With no event loop running in this thread this is ``asyncio.run``. Inside a running
    loop (a notebook cell that must block) it applies ``nest_asyncio`` to that loop, here
    and only here, and runs the loop re-entrantly until done: other tasks on the loop
    (dashboards, other runs) keep going meanwhile.

    Ctrl+C (Kernel → Interrupt) cancels the awaitable; a TrainingRun then stops, records
    what it applied and raises :class:`RunInterrupted`.
    """
    async def _wrap() -> T:
        return await awaitable

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_wrap())  # its SIGINT handler cancels _wrap: the same clean-up
    import nest_asyncio

    nest_asyncio.apply(loop)
    task = loop.create_task(_wrap())
    try:
        return loop.run_until_complete(task)
    except KeyboardInterrupt:
        # SIGINT in a blocking cell lands here, not in the task: cancel it and let it clean up
        task.cancel()
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        raise
