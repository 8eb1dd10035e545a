"""APIFuture: the handle every training op returns.

Backed by a `concurrent.futures.Future` that the backend resolves, so it can be waited on
from any thread and awaited on any event loop (`asyncio.wrap_future` hops threads safely).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["APIFuture"]


class _Scheduled(Protocol):
    """Where the cycle a request ran in is written (the pool's record of the request)."""

    cycle: int | None


class _NotScheduled:
    cycle: int | None = None


class APIFuture(Generic[T]):
    """The result of one request, available after the cycle boundary that follows its cycle.

    `cycle` is the index of the cycle the request ran in (None until it is taken).
    """

    def __init__(self, future: concurrent.futures.Future, *, request_id: int, op: str,
                 scheduled: _Scheduled | None = None, canceller: Callable[[], bool] | None = None):
        self.request_id = request_id
        self.op = op
        self._future = future
        self._scheduled = scheduled if scheduled is not None else _NotScheduled()
        # Must not hold the pool: a future the user keeps may outlive it (the pool passes a
        # closure over a weak reference).
        self._canceller = canceller

    @property
    def cycle(self) -> int | None:
        return self._scheduled.cycle

    # -- waiting ---------------------------------------------------------------
    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        waiter = asyncio.wrap_future(self._future)
        if timeout is None:
            return await waiter
        return await asyncio.wait_for(waiter, timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    # -- state -----------------------------------------------------------------
    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        """Cancel a request that is still queued; one already in a cycle cannot be."""
        if self._future.done() or self._canceller is None:
            return False
        if not self._canceller():
            return False
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[[APIFuture[T]], Any]) -> None:
        """`fn(self)` once the result is in; it runs on the thread that delivers it (keep it short)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)`, for the same request (same id, op and cycle)."""
        mapped: concurrent.futures.Future = concurrent.futures.Future()

        def chain(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                mapped.cancel()
                return
            error = done.exception()
            if error is not None:
                mapped.set_exception(error)
                return
            try:
                mapped.set_result(fn(done.result()))
            except Exception as exc:  # a failing conversion fails the mapped future, not the caller
                mapped.set_exception(exc)

        self._future.add_done_callback(chain)
        return APIFuture(mapped, request_id=self.request_id, op=self.op, scheduled=self._scheduled,
                         canceller=self._canceller)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture #{self.request_id} {self.op} cycle={self.cycle} {state}>"
