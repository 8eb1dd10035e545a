"""TelemetryFeed: the only dashboard code that runs on the pool's clock thread.

A telemetry subscriber that appends each event to a bounded deque (``deque.append`` and
``popleft`` are atomic, so the clock thread and the consumer never lock each other).
The dashboard's periodic task drains the deques on the kernel's event loop. If the
consumer falls behind, the oldest events are dropped: the views are rolling windows.

On creation the feed also takes what the pool's ring buffers already hold (a loop that
ran before the dashboard was opened shows up too); the first drains drop live events
that this copy already had.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..telemetry import ClientInfo, CycleRecord, GilStall, QueueDepthRecord, RequestRecord, Telemetry, TelemetryEvent

__all__ = ["TelemetryFeed"]

_DEDUPE_DRAINS = 3


class TelemetryFeed:
    def __init__(self, telemetry: Telemetry, *, maxlen: int = 4096, backfill: bool = True):
        self.telemetry = telemetry
        self.clients: deque[ClientInfo] = deque(maxlen=1024)
        self.retired: deque[ClientInfo] = deque(maxlen=1024)
        self.cycles: deque[CycleRecord] = deque(maxlen=maxlen)
        self.boundaries: deque[QueueDepthRecord] = deque(maxlen=maxlen)
        self.delivered: deque[RequestRecord] = deque(maxlen=maxlen)
        self.gil: deque[GilStall] = deque(maxlen=maxlen)
        self.events = 0  # events seen (a plain counter: a racy increment can only undercount)
        self._unsubscribe: Callable[[], None] | None = telemetry.subscribe(self)
        self._backfill: tuple[list, list, list, list] | None = None
        self._seen_ids: set[int] = set()
        self._max_cycle = self._max_boundary = -1
        self._dedupe = 0
        # GIL stalls the pool's buffer already holds come first (drain_gil drops live repeats).
        self._gil_backfill = list(telemetry.gil)[-maxlen:] if backfill else []
        if backfill:
            self._take_backfill()

    # -- clock thread ------------------------------------------------------------------
    def __call__(self, event: TelemetryEvent) -> None:
        record = event.record
        if isinstance(record, RequestRecord):
            if event.kind == "delivered":
                self.delivered.append(record)
        elif isinstance(record, CycleRecord):
            self.cycles.append(record)
        elif isinstance(record, QueueDepthRecord):
            self.boundaries.append(record)
        elif isinstance(record, ClientInfo):
            (self.clients if event.kind == "client" else self.retired).append(record)
        elif isinstance(record, GilStall):
            self.gil.append(record)
        self.events += 1

    # -- consumer (one thread) ---------------------------------------------------------
    def _take_backfill(self) -> None:
        t = self.telemetry
        n = self.delivered.maxlen or 4096
        clients = list(t.live_clients().values())
        cycles = list(t.cycles)[-n:]
        boundaries = list(t.queue_depths)[-n:]
        requests = [r for r in list(t.requests) if r.delivered_at is not None]
        requests.sort(key=lambda r: (r.delivered_at or 0.0, r.request_id))
        requests = requests[-n:]
        self._backfill = (clients, cycles, boundaries, requests)
        self._seen_ids = {r.request_id for r in requests}
        self._max_cycle = cycles[-1].index if cycles else -1
        self._max_boundary = boundaries[-1].cycle if boundaries else -1
        self._dedupe = _DEDUPE_DRAINS

    @staticmethod
    def _pop_all(queue: deque) -> list:
        out = []
        pop = queue.popleft
        for _ in range(len(queue)):
            try:
                out.append(pop())
            except IndexError:  # pragma: no cover - only this thread pops
                break
        return out

    def drain(self) -> tuple[list[ClientInfo], list[CycleRecord], list[QueueDepthRecord], list[RequestRecord]]:
        """Everything new since the last drain: (clients, cycles, boundaries, delivered requests)."""
        clients = self._pop_all(self.clients)
        cycles = self._pop_all(self.cycles)
        boundaries = self._pop_all(self.boundaries)
        delivered = self._pop_all(self.delivered)
        if self._dedupe > 0:
            self._dedupe -= 1
            cycles = [c for c in cycles if c.index > self._max_cycle]
            boundaries = [b for b in boundaries if b.cycle > self._max_boundary]
            delivered = [r for r in delivered if r.request_id not in self._seen_ids]
            if self._dedupe == 0:
                self._seen_ids = set()
        if self._backfill is not None:
            old_clients, old_cycles, old_boundaries, old_requests = self._backfill
            self._backfill = None
            known = {c.client_id for c in old_clients}
            clients = [*old_clients, *(c for c in clients if c.client_id not in known)]
            cycles = [*old_cycles, *cycles]
            boundaries = [*old_boundaries, *boundaries]
            delivered = [*old_requests, *delivered]
        return clients, cycles, boundaries, delivered

    def drain_gil(self) -> list[GilStall]:
        """Stretches in which other Python held the GIL, new since the last call (oldest first)."""
        stalls = self._pop_all(self.gil)
        if self._gil_backfill:
            old, self._gil_backfill = self._gil_backfill, []
            stalls = [*old, *(s for s in stalls if s.started_at > old[-1].started_at)]
        return stalls

    def drain_retired(self) -> list[ClientInfo]:
        """Clients the pool let go of since the last call."""
        return self._pop_all(self.retired)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @property
    def subscribed(self) -> bool:
        return self._unsubscribe is not None
