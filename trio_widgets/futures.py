"""APIFuture: the handle every training op returns.

Backed by a `concurrent.futures.Future`, so it can be waited on from any thread and
awaited on any event loop (`asyncio.wrap_future` hops threads safely).

It has the union of both hosted SDKs' surfaces: tinker's `result_async()`, `future()`,
`coroutine()` and pytrio's `done()`, `exception()`, `cancel()`, `map()`,
`APIFuture.completed()`. Cancelling, by any route (`cancel()`, `future().cancel()`, or a
cancelled `await`, which asyncio forwards to the Future), asks the pool: a request still
queued is withdrawn; one already taken into a cycle runs to the end, so it is not cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import weakref
from typing import Any, Callable, Generator, Generic, TypeVar

from .errors import RequestFailedError

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["APIFuture"]

Canceller = Callable[["APIFuture"], bool]


class _PoolFuture(concurrent.futures.Future):
    """A Future whose cancel() first asks whoever runs the operation.

    A plain Future would report "cancelled" while the pool still runs the request (and,
    for optim_step, still changes the weights), so the state must come from the pool.
    """

    def __init__(self, ask: Callable[[], bool] | None) -> None:
        super().__init__()
        self._ask = ask

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        if self._ask is None or not self._ask():
            return False
        return super().cancel()


class APIFuture(Generic[T]):
    def __init__(self, request_id: int | None = None, op: str = "", canceller: Canceller | None = None):
        self.request_id = request_id
        self.op = op
        # Weak: a future the user keeps must not keep its pool (and the pool's clock
        # thread) alive after the pool itself was dropped.
        self._canceller: Callable[[], Canceller | None] | None = None
        if canceller is not None:
            self._canceller = (weakref.WeakMethod(canceller) if hasattr(canceller, "__self__")
                               else (lambda: canceller))
        owner = weakref.ref(self)  # weak: no cycle between the handle and its Future
        self._future: concurrent.futures.Future = _PoolFuture(
            lambda: (f := owner()) is not None and f._ask_to_cancel())
        self._source: APIFuture | None = None  # set on the futures map() returns
        self._cycle: int | None = None

    @property
    def cycle(self) -> int | None:
        """The cycle the request ran in (set by the pool when it takes the request)."""
        return self._source.cycle if self._source is not None else self._cycle

    @cycle.setter
    def cycle(self, value: int | None) -> None:
        self._cycle = value

    @staticmethod
    def completed(value: U) -> "APIFuture[U]":
        """pytrio: a future that already holds `value`."""
        future: APIFuture[U] = APIFuture(None, "completed")
        future._set_result(value)
        return future

    # -- waiting ---------------------------------------------------------------
    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        """tinker: await the result; on timeout (TimeoutError) the request is cancelled if
        it is still queued, as tinker cancels it."""
        waiter = asyncio.wrap_future(self._future)
        if timeout is None:
            return await waiter
        return await asyncio.wait_for(waiter, timeout)

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
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        """Cancel a request that is still queued; one already in a cycle cannot be."""
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[["APIFuture[T]"], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def map(self, transform: Callable[[T], U]) -> "APIFuture[U]":
        """pytrio: a future of `transform(result)`. An exception or cancellation of this
        future passes through, an exception from `transform` becomes the mapped future's,
        and cancelling the mapped future cancels this one (if it is still queued).
        `transform` runs on the thread that completes this future (the pool's clock
        thread): keep it cheap."""
        mapped: APIFuture[U] = APIFuture(self.request_id, self.op)
        mapped._source = self
        source_ref = weakref.ref(self._future)  # as pytrio: the mapped one does not keep the source alive
        mapped._future = _PoolFuture(lambda: (s := source_ref()) is not None and s.cancel())
        target = mapped._future

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
        return mapped

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture #{self.request_id} {self.op} cycle={self.cycle} {state}>"

    # -- pool side ---------------------------------------------------------------
    def _ask_to_cancel(self) -> bool:
        canceller = self._canceller() if self._canceller is not None else None
        return canceller is not None and canceller(self)

    def _set_result(self, value: T) -> None:
        if not self._future.done():
            self._future.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        if isinstance(exc, RequestFailedError) and not exc.request_id and self.request_id is not None:
            exc.request_id = str(self.request_id)  # tinker's RequestFailedError names its request
        if not self._future.done():
            self._future.set_exception(exc)
