"""APIFuture: the handle every training op returns.

Backed by a `concurrent.futures.Future` that the backend resolves, so it can be waited on
from any thread and awaited on any event loop (`asyncio.wrap_future` hops threads safely).

It has the union of both hosted SDKs' surfaces: tinker's `result_async()`, `future()`,
`coroutine()` and pytrio's `done()`, `exception()`, `cancel()`, `map()`,
`APIFuture.completed()`. Cancelling, by any route (`cancel()`, `future().cancel()`, or a
cancelled `await`, which asyncio forwards to the Future), asks the pool: a request still
queued is withdrawn; one already taken into a cycle runs to the end, so it is not cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["APIFuture", "PoolFuture", "WaitInterrupted", "mark_delivery_thread", "on_wait_interrupted"]

log = logging.getLogger(__name__)
_thread = threading.local()


def mark_delivery_thread() -> None:
    """Called by a thread that resolves futures (a pool's clock): waiting on an unresolved
    future there would wait for itself."""
    _thread.delivers = True


class PoolFuture(concurrent.futures.Future):
    """A Future whose cancel() first asks whoever runs the operation (`ask()`: True if it
    withdrew the request).

    A plain Future would report "cancelled" while the pool still runs the request (and,
    for optim_step, still changes the weights), so the state must come from the pool.
    `ask` must not hold the pool: a future the user keeps may outlive it.
    """

    def __init__(self, ask: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._ask = ask

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        if self._ask is None or not self._ask():
            return False
        return super().cancel()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], Any]) -> None:
        """Callbacks run on the pool's clock thread: whatever one raises — SystemExit and
        KeyboardInterrupt included — is logged, never allowed to stop the clock."""
        def fenced(future: concurrent.futures.Future) -> None:
            try:
                fn(future)
            except BaseException:
                log.exception("a done-callback of %r raised; it was ignored", future)

        super().add_done_callback(fenced)

    def result(self, timeout: float | None = None) -> Any:
        if not self.done() and getattr(_thread, "delivers", False):
            raise RuntimeError("result() was called on the pool's clock thread (in a done-callback?) for a "
                               "request that is not done: the clock delivers results, so it would wait for "
                               "itself forever. Await the future from your own code instead.")
        return super().result(timeout)


_listeners: list[Callable[[WaitInterrupted], None]] = []
_listeners_lock = threading.Lock()


def on_wait_interrupted(listener: Callable[[WaitInterrupted], None]) -> Callable[[], None]:
    """Call `listener(exc)` (on the interrupted thread; keep it short) whenever a wait for a
    result in this process is interrupted, so that a Dashboard can say so. Returns the
    function that stops it."""
    with _listeners_lock:
        _listeners.append(listener)

    def remove() -> None:
        with _listeners_lock:
            if listener in _listeners:
                _listeners.remove(listener)
    return remove


def _interrupted(future: APIFuture) -> WaitInterrupted:
    exc = WaitInterrupted(future)
    with _listeners_lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(exc)
        except Exception:  # a view's trouble must not replace the user's interrupt
            log.exception("a wait-interrupted listener raised; it was ignored")
    return exc


class WaitInterrupted(KeyboardInterrupt, asyncio.CancelledError):
    """Waiting for a request's result stopped: Kernel → Interrupt or Ctrl+C during `.result()`, or
    the task awaiting it was cancelled (both classes, so `except KeyboardInterrupt` and asyncio's
    cancellation both work). The wait stopped, not the pool: a request not yet taken into a
    cycle was withdrawn with the wait; one already taken runs, and its future keeps its result."""

    def __init__(self, future: APIFuture) -> None:
        self.op = future.op
        self.request_id = future.request_id
        self.client_id: str | None = getattr(future._scheduled, "client_id", None)
        what = f"{future.op} (request #{future.request_id})" if future.request_id is not None else future.op
        if future.cancelled():
            state = "it had not run and was withdrawn"
        elif future.done():
            state = "its result had arrived and stays in its future"
        elif future.cycle is None:  # a `.result()` wait withdraws nothing
            state = "it is still queued and will run; its future gets the result"
        else:
            state = "it was already in a cycle and runs to its end; its future gets the result"
        self.state = state
        super().__init__(f"interrupted while waiting for {what}: {state}")

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through asyncio or threading: one line
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class _Scheduled(Protocol):
    """Where the cycle a request ran in is written (the pool's record of the request)."""

    cycle: int | None


class _NotScheduled:
    cycle: int | None = None


class APIFuture(Generic[T]):
    """The result of one request, available after the cycle boundary that follows its cycle.

    `cycle` is the index of the cycle the request ran in (None until it is taken).

    Example: `fb = tc.forward_backward(batch, "cross_entropy")`, then `await fb` in a notebook
    or `fb.result()` in a script; `fb.cycle` says which cycle ran it.
    """

    def __init__(self, future: concurrent.futures.Future, *, request_id: int | None, op: str,
                 scheduled: _Scheduled | None = None):
        self.request_id = request_id
        self.op = op
        self._future = future
        self._scheduled = scheduled if scheduled is not None else _NotScheduled()

    @property
    def cycle(self) -> int | None:
        """The clock cycle this request ran in (None until it has run, and for requests no cycle runs)."""
        return self._scheduled.cycle

    @staticmethod
    def completed(value: U) -> APIFuture[U]:
        """pytrio: a future that already holds `value`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(value)
        return APIFuture(future, request_id=None, op="completed")

    # -- waiting ---------------------------------------------------------------
    def result(self, timeout: float | None = None) -> T:
        """Wait for the result and return it (raises what the request failed with).

        Example: `fb = tc.forward_backward(batch, "cross_entropy"); out = fb.result()`."""
        try:
            return self._future.result(timeout)
        except KeyboardInterrupt:  # Kernel → Interrupt, Ctrl+C: one line, not a trip through threading
            raise _interrupted(self) from None

    async def result_async(self, timeout: float | None = None) -> T:
        """tinker: await the result; on timeout (TimeoutError) the request is cancelled if
        it is still queued, as tinker cancels it."""
        waiter = asyncio.wrap_future(self._future)
        try:
            if timeout is None:
                return await waiter
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.CancelledError as exc:  # the awaiting task was cancelled (a notebook's Interrupt)
            if isinstance(exc, WaitInterrupted):
                raise
            raise _interrupted(self) from None

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    async def coroutine(self) -> T:
        """tinker: this future as a coroutine, for APIs that want one (`asyncio.create_task`)."""
        return await self

    def future(self) -> concurrent.futures.Future:
        """tinker: the `concurrent.futures.Future` for `wait` / `as_completed` / libraries.
        Cancelling it cancels the request, on the same terms as `cancel()`."""
        return self._future

    # -- state -----------------------------------------------------------------
    def done(self) -> bool:
        """True once the result (or the failure) is in."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the request failed with, or None; waits as `result()` does."""
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        """Cancel a request that is still queued; one already in a cycle cannot be."""
        return self._future.cancel()

    def cancelled(self) -> bool:
        """True if the request was withdrawn before it ran."""
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[[APIFuture[T]], Any]) -> None:
        """`fn(self)` once the result is in; it runs on the thread that delivers it (keep it short)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def map(self, transform: Callable[[T], U]) -> APIFuture[U]:
        """pytrio: a future of `transform(result)`, for the same request (same id, op and cycle).
        An exception or cancellation of this future passes through, an exception from
        `transform` becomes the mapped future's, and cancelling the mapped future cancels this
        one (if it is still queued). `transform` runs on the thread that completes this future
        (the pool's clock thread): keep it cheap."""
        source_ref = weakref.ref(self._future)  # as pytrio: the mapped one does not keep the source alive
        target = PoolFuture(lambda: (s := source_ref()) is not None and s.cancel())

        def resolve(source: concurrent.futures.Future) -> None:
            if source.cancelled():
                concurrent.futures.Future.cancel(target)  # the base method: no round trip
                return
            try:
                error = source.exception()
                value = transform(source.result()) if error is None else None
            except BaseException as exc:  # a Future carries whatever the transform raised
                error = exc
            if target.done():
                return
            if error is not None:
                target.set_exception(error)
            else:
                target.set_result(value)

        self._future.add_done_callback(resolve)
        return APIFuture(target, request_id=self.request_id, op=self.op, scheduled=self._scheduled)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture #{self.request_id} {self.op} cycle={self.cycle} {state}>"
