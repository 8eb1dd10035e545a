"""One background thread for client-side work (a custom loss between its two requests).

The hosted SDKs run this work on their own background thread too. It must not run on the
pool's clock thread (user code may block or raise anything) nor on the caller's thread (a
submit returns at once). Started on first use, stopped by `close()`: nothing outlives it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundWorker:
    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is _STOP:
                return
            try:
                work()
            except BaseException:  # the work reports its own failures; this thread must go on
                log.exception("background work failed in %s", self.name)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop after the queued work; False if the thread is still busy after `timeout`."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return True
        self._queue.put(_STOP)
        if thread is not threading.current_thread():
            thread.join(timeout)
        if thread.is_alive():
            log.warning("%s is still running user code after %.0f s; it is a daemon thread and will not "
                        "block exit", self.name, timeout)
            return False
        return True

    def stop(self) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
