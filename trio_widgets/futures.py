"""APIFuture: the handle every training op returns.

Backed by a `concurrent.futures.Future`, so it can be waited on from any thread and
awaited on any event loop (`asyncio.wrap_future` hops threads safely).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import weakref
from typing import Any, Callable, Generator, Generic, TypeVar

T = TypeVar("T")

__all__ = ["APIFuture"]


class APIFuture(Generic[T]):
    def __init__(self, request_id: int, op: str, canceller: Callable[["APIFuture"], bool] | None = None):
        self.request_id = request_id
        self.op = op
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        # Weak: a future the user keeps must not keep its pool (and the pool's clock
        # thread) alive after the pool itself was dropped.
        self._canceller: Callable[[], Callable[["APIFuture"], bool] | None] | None = None
        if canceller is not None:
            self._canceller = (weakref.WeakMethod(canceller) if hasattr(canceller, "__self__")
                               else (lambda: canceller))
        # Set by the pool when the request is taken into a cycle.
        self.cycle: int | None = None

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
        canceller = self._canceller() if self._canceller is not None else None
        if self._future.done() or canceller is None:
            return False
        if not canceller(self):
            return False
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[["APIFuture[T]"], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture #{self.request_id} {self.op} cycle={self.cycle} {state}>"

    # -- pool side ---------------------------------------------------------------
    def _set_result(self, value: T) -> None:
        if not self._future.done():
            self._future.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)
