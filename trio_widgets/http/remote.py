"""A served pool, seen from another process: what `trio.Dashboard("http://host:8000")` reads.

`RemotePool` has the few attributes a Dashboard reads of a `LocalPool` (name, min_cycle_s,
device, cycle_index, closed, telemetry). Its `telemetry` is a `RemoteTelemetry`: the same
class as a pool's own `Telemetry` (the same bounded ring buffers, readers, `subscribe` /
`emit`), fed by one thread that reads the server's telemetry stream
(`GET /api/v1/trio/telemetry`, server-sent events, at most 10 batches a second, bounded on
both sides: a slow reader loses the oldest events, never the server's memory).

Times are the server's `perf_counter`, shifted onto this process's clock by the offset seen
in the first batch, so the views' time axes work unchanged. Watching needs an observer key
when the server has keys (`serve(..., observer_keys=[...])`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import httpx

from ..errors import APIConnectionError, AuthenticationError, PermissionDeniedError
from ..telemetry import ClientInfo, CycleRecord, GilStall, QueueDepthRecord, RequestRecord, Telemetry, UserFrame

__all__ = ["RemotePool", "RemoteTelemetry"]

log = logging.getLogger(__name__)

_RECONNECTS = 3  # tries after a dropped stream before the view says "closed"


class RemoteTelemetry(Telemetry):
    """A mirror of a served pool's Telemetry (see the module doc). `apply` is called by the
    reader thread only; everything else is the base class's, for any thread."""

    def __init__(self, capacity: int = 4096):
        super().__init__(capacity)
        self.offset: float | None = None  # local perf_counter minus the server's
        self._seen_ids: deque[int] = deque(maxlen=capacity * 4)
        self._seen: set[int] = set()
        self._last_cycle = self._last_boundary = -1

    def _time(self, value: float | None) -> float | None:
        return None if value is None or self.offset is None else value + self.offset

    def _request(self, raw: dict) -> RequestRecord:
        record = RequestRecord(**raw)
        for name in ("queued_at", "started_at", "finished_at", "delivered_at"):
            setattr(record, name, self._time(getattr(record, name)))
        return record

    def _cycle(self, raw: dict) -> CycleRecord:
        record = CycleRecord(**raw)
        record.started_at = self._time(record.started_at) or 0.0
        record.ended_at = self._time(record.ended_at) or 0.0
        return record

    def _stall(self, raw: dict) -> GilStall:
        frames = tuple(UserFrame(**f) for f in raw.pop("frames", ()))
        stall = GilStall(**raw, frames=frames)
        stall.started_at = self._time(stall.started_at) or 0.0
        stall.ended_at = self._time(stall.ended_at) or 0.0
        return stall

    def _boundary(self, raw: dict) -> QueueDepthRecord:
        record = QueueDepthRecord(**raw)
        record.time = self._time(record.time) or 0.0
        return record

    def _remember(self, request_id: int) -> bool:
        """False if this request was mirrored already (a backfill after a reconnect repeats it)."""
        if request_id in self._seen:
            return False
        if len(self._seen_ids) == self._seen_ids.maxlen:
            self._seen.discard(self._seen_ids[0])
        self._seen_ids.append(request_id)
        self._seen.add(request_id)
        return True

    def apply(self, batch: dict) -> None:
        """One batch of the stream: a backfill (first), then events in the server's order."""
        if self.offset is None:
            self.offset = time.perf_counter() - float(batch["now"])
        backfill = batch.get("backfill")
        if backfill:  # into the buffers without events: a TelemetryFeed takes them from there
            for raw in backfill.get("clients", []):
                self.add_client(ClientInfo(**raw))
            for raw in backfill.get("cycles", []):
                if raw["index"] > self._last_cycle:
                    self.cycles.append(self._cycle(raw))
                    self._last_cycle = raw["index"]
            for raw in backfill.get("boundaries", []):
                if raw["cycle"] > self._last_boundary:
                    self.queue_depths.append(self._boundary(raw))
                    self._last_boundary = raw["cycle"]
            for raw in backfill.get("requests", []):
                if self._remember(raw["request_id"]):
                    self.requests.append(self._request(raw))
            for raw in backfill.get("gil", []):
                stall = self._stall(raw)
                if not self.gil or stall.started_at > self.gil[-1].started_at:
                    self.gil.append(stall)
        for kind, raw in batch.get("events", []):
            if kind == "client":
                self.add_client(ClientInfo(**raw))
            elif kind == "retired":
                if raw["client_id"] not in self.clients:
                    self.add_client(ClientInfo(**raw))
                self.retire_client(raw["client_id"])
            elif kind == "boundary" and raw["cycle"] > self._last_boundary:
                self._last_boundary = raw["cycle"]
                self.add_boundary(self._boundary(raw))
            elif kind == "cycle" and raw["index"] > self._last_cycle:
                self._last_cycle = raw["index"]
                cycle = self._cycle(raw)
                self.cycles.append(cycle)  # (totals come from the server, below)
                self.emit("cycle", cycle)
            elif kind == "gil":  # the server's own GIL watchdog: its Python that held the clock
                self.add_gil_stall(self._stall(raw))
            elif kind == "delivered" and self._remember(raw["request_id"]):
                request = self._request(raw)
                self.requests.append(request)
                self.emit("delivered", request)
        for name in ("total_cycles", "total_updates", "total_tokens"):
            if name in batch:
                setattr(self, name, int(batch[name]))


class RemotePool:
    """What a Dashboard reads of a pool, for a pool served at `url` (see the module doc).
    `close()` stops the reader thread; so does the server stopping."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 30.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"expected the served pool's http:// URL, got {url!r:.80}")
        self.base_url = url.rstrip("/")
        self._headers = {"X-API-Key": api_key} if api_key else {}
        info = self._info(timeout_s)
        self.name = f"{info['name']} @ {self.base_url.split('://', 1)[1]}"
        self.min_cycle_s = float(info["min_cycle_s"])
        self.device = SimpleNamespace(type=str(info["device"]))
        self.device_type = str(info["device"])  # trio_widgets.pools.PoolView
        self.models = list(info.get("models", []))
        self.cycle_index = int(info["cycle_index"])
        self.telemetry = RemoteTelemetry()
        self.error: str | None = None
        self._ended = False
        self._stop = threading.Event()
        self._first = threading.Event()
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, name="trio-remote-telemetry", daemon=True)
        self._thread.start()
        if not self._first.wait(timeout_s):
            self.close()
            raise APIConnectionError(f"no telemetry from {self.base_url} within {timeout_s:g} s")
        if self.error is not None and self._ended:
            self.close()
            raise APIConnectionError(f"cannot watch {self.base_url}: {self.error}")

    def __repr__(self) -> str:
        return f"<RemotePool {self.name!r} {'closed' if self.closed else f'cycle {self.cycle_index}'}>"

    def _info(self, timeout_s: float) -> dict:
        try:
            response = httpx.get(f"{self.base_url}/api/v1/trio/info", headers=self._headers, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise APIConnectionError(f"cannot reach the trio server at {self.base_url}: {exc}") from None
        if response.status_code in (401, 403):
            detail = response.json().get("detail", response.text)
            raise (AuthenticationError if response.status_code == 401 else PermissionDeniedError)(detail)
        if response.status_code != 200:
            raise APIConnectionError(f"{self.base_url} is not a trio server (GET /api/v1/trio/info answered "
                                     f"{response.status_code})")
        return response.json()

    # -- the reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        try:
            self._stream()
        finally:
            self._ended = True
            self._first.set()

    def _stream(self) -> None:
        tries = 0
        with httpx.Client(headers=self._headers, timeout=httpx.Timeout(15.0, connect=5.0)) as client:
            while not self._stop.is_set() and tries <= _RECONNECTS:
                try:
                    with client.stream("GET", f"{self.base_url}/api/v1/trio/telemetry") as response:
                        self._response = response
                        if response.status_code != 200:
                            response.read()
                            self.error = f"the telemetry stream answered {response.status_code}: {response.text}"
                            return
                        for line in response.iter_lines():
                            if self._stop.is_set():
                                return
                            if not line.startswith("data: "):
                                continue
                            batch = json.loads(line[6:])
                            self.telemetry.apply(batch)
                            self.cycle_index = int(batch.get("cycle_index", self.cycle_index))
                            tries = 0
                            self._first.set()
                            if batch.get("closed"):
                                self.error = "the server stopped"
                                return
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    if self._stop.is_set():
                        return
                    self.error = f"{type(exc).__name__}: {exc}"
                    log.info("telemetry stream from %s broke (%s); reconnecting", self.base_url, self.error)
                tries += 1
                self._stop.wait(1.0)

    @property
    def closed(self) -> bool:
        """Closed here, or the server stopped (the stream ended and did not come back)."""
        return self._stop.is_set() or self._ended or not self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.close()  # wakes a reader blocked on the socket
            except Exception:  # noqa: BLE001 - closing from another thread may race the reader
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
