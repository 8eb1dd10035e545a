"""What the pool did, kept in bounded ring buffers, and pushed to live subscribers.

The clock thread writes; any thread reads. Records are small dataclasses; a request
record is updated in place as the request moves from queued to delivered.
Times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .ops import OPS

__all__ = ["ClientInfo", "CoreSample", "CycleRecord", "GilStall", "QueueDepthRecord", "RequestRecord", "Telemetry",
           "TelemetryEvent", "UserFrame"]

log = logging.getLogger(__name__)

EventKind = Literal["client", "retired", "queued", "boundary", "cycle", "delivered", "gil"]


@dataclass(slots=True)
class ClientInfo:
    client_id: str
    kind: Literal["training", "sampling"]
    base_model: str
    label: str
    rank: int | None = None
    parent: str | None = None  # a sampler made from a training client: that client's id


@dataclass(slots=True)
class CycleRecord:
    index: int
    started_at: float
    ended_at: float
    busy_s: float
    n_requests: int
    tokens: int
    ops: dict[str, int] = field(default_factory=dict)
    # CPU seconds of the clock thread while it worked: what the cycle asked for.
    cpu_s: float = 0.0
    # Seconds the clock thread waited to run beyond what it asked for: off a CPU and out of
    # the OS run queue while it worked (for the GIL, or a disk write), plus how late its
    # end-of-cycle sleep woke. See trio_widgets/gil.py.
    gil_wait_s: float = 0.0


@dataclass(slots=True)
class QueueDepthRecord:
    """Requests waiting in each client's queue at a cycle boundary, before the cycle took any."""

    cycle: int
    time: float
    depths: dict[str, int]


@dataclass(slots=True)
class RequestRecord:
    request_id: int
    client_id: str
    op: str
    queued_at: float
    tokens: int = 0
    cycle: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    delivered_at: float | None = None
    status: Literal["queued", "running", "ok", "error", "cancelled"] = "queued"
    error: str | None = None
    # loss:sum and the number of loss-weighted tokens for forward ops; step for optim_step
    metrics: dict[str, float] = field(default_factory=dict)


#: a UserFrame's file for Python's garbage collector (a collection is no function's own work)
GC_FILE = "<garbage collector>"


@dataclass(frozen=True, slots=True)
class UserFrame:
    """Where Python was executing: file, function and line; for a notebook cell's code, the
    cell's execution count (the n of In[n]) as well."""

    file: str
    function: str
    line: int
    cell: int | None = None
    #: False for a library's frame, given only when no user code was on the stack
    user: bool = True

    @property
    def where(self) -> str:
        """'cell In[3] line 7' or 'loader.py line 12'."""
        if self.cell is not None:
            return f"cell In[{self.cell}] line {self.line}"
        if self.file == GC_FILE:
            return "Python's garbage collector"
        return f"{os.path.basename(self.file)} line {self.line}"

    @property
    def label(self) -> str:
        """'heavy_batches (cell In[3] line 7)'; code at a cell's or module's top level: its place."""
        return self.where if self.function == "<module>" else f"{self.function} ({self.where})"


@dataclass(slots=True)
class GilStall:
    """A stretch in which another thread's Python held the interpreter (GIL) while the pool's
    threads waited: the watchdog's heartbeats woke late throughout (trio_widgets/gil.py)."""

    started_at: float
    ended_at: float
    lag_s: float  # the watchdog's summed wake-up lag over the stretch
    heartbeats: int  # late heartbeats in it
    thread: str  # the thread that held the GIL (ran on a CPU meanwhile)
    frames: tuple[UserFrame, ...] = ()  # its innermost user frames, innermost first

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)


@dataclass(frozen=True, slots=True)
class CoreSample:
    """The GIL watchdog's look at the CPU cores, a few times a second (trio_widgets/gil.py): how
    many cores this process's threads wanted (ran on one, or waited in the OS run queue for one)
    and how long its own heartbeats waited for a core. The advisor's evidence for `cpu`."""

    at: float  # the end of the window
    window_s: float
    cpus: int  # the cores this process may run on
    #: CPU + run-queue seconds of all this process's threads (BLAS and OpenMP workers too) in the
    #: window; None where the platform gives no per-thread schedstat (the two cannot be told apart)
    demand_s: float | None
    #: of which waiting in the run queue; None as demand_s
    runqueue_s: float | None
    #: the heartbeats' summed wake-up lag in the window, their run-queue wait included
    lag_s: float = 0.0

    @property
    def cores(self) -> float | None:
        """Cores this process's threads wanted, on average over the window."""
        return None if self.demand_s is None else self.demand_s / max(self.window_s, 1e-9)


@dataclass(slots=True)
class TelemetryEvent:
    kind: EventKind
    record: object


class Telemetry:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.cycles: deque[CycleRecord] = deque(maxlen=capacity)
        self.requests: deque[RequestRecord] = deque(maxlen=capacity * 4)
        self.queue_depths: deque[QueueDepthRecord] = deque(maxlen=capacity)
        self.gil: deque[GilStall] = deque(maxlen=capacity)
        #: the stretch the GIL watchdog is in now (None between stretches): it joins `gil` when it
        #: ends, at most max_stretch_s later; the advisor reads it meanwhile
        self.gil_ongoing: GilStall | None = None
        #: the watchdog's looks at the cores (not streamed: the advisor of this process reads them)
        self.cores: deque[CoreSample] = deque(maxlen=capacity)
        self.clients: dict[str, ClientInfo] = {}  # live clients
        # Retired clients, newest last, so records still in the buffers keep their labels;
        # bounded like everything here (clients may come and go all day).
        self.retired: OrderedDict[str, ClientInfo] = OrderedDict()
        self.total_cycles = 0
        self.total_updates = 0
        self.total_tokens = 0
        self._subscribers: list[Callable[[TelemetryEvent], None]] = []
        self._lock = threading.Lock()
        self._clients_lock = threading.Lock()  # clients come and go on several threads

    def subscribe(self, callback: Callable[[TelemetryEvent], None]) -> Callable[[], None]:
        """Call `callback(event)` for every new record; returns a function that unsubscribes.

        Callbacks run on the pool's clock thread (or the submitting thread for
        'queued', the GIL watchdog's for 'gil'): keep them short and thread-safe, e.g.
        append to a deque.
        """
        with self._lock:
            self._subscribers = [*self._subscribers, callback]

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = [s for s in self._subscribers if s is not callback]

        return unsubscribe

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def emit(self, kind: EventKind, record: object) -> None:
        event = TelemetryEvent(kind, record)
        for callback in self._subscribers:  # a snapshot: subscribe() replaces the list
            try:
                callback(event)
            except BaseException:  # a broken viewer (SystemExit included) must never stop the clock
                log.exception("telemetry subscriber failed")

    # -- writers (pool side) ---------------------------------------------------
    def add_client(self, info: ClientInfo) -> None:
        with self._clients_lock:
            self.clients[info.client_id] = info
        self.emit("client", info)

    def retire_client(self, client_id: str) -> None:
        """The pool dropped this client: its lane is free (event "retired")."""
        with self._clients_lock:
            info = self.clients.pop(client_id, None)
            if info is None:
                return
            self.retired[client_id] = info
            while len(self.retired) > self.capacity:
                self.retired.popitem(last=False)
        self.emit("retired", info)

    def add_request(self, record: RequestRecord) -> None:
        self.requests.append(record)
        self.emit("queued", record)

    def add_boundary(self, record: QueueDepthRecord) -> None:
        self.queue_depths.append(record)
        self.emit("boundary", record)

    def add_cycle(self, record: CycleRecord) -> None:
        self.cycles.append(record)
        self.total_cycles += 1
        self.total_tokens += record.tokens
        self.emit("cycle", record)

    def add_gil_stall(self, record: GilStall) -> None:
        self.gil.append(record)
        self.emit("gil", record)

    def add_core_sample(self, record: CoreSample) -> None:
        self.cores.append(record)

    def request_delivered(self, record: RequestRecord) -> None:
        spec = OPS.get(record.op)
        if spec is not None and spec.is_step and record.status == "ok":
            self.total_updates += 1
        self.emit("delivered", record)

    # -- readers -----------------------------------------------------------------
    def client_info(self, client_id: str) -> ClientInfo | None:
        """A live or recently retired client's info (None once forgotten)."""
        with self._clients_lock:
            return self.clients.get(client_id) or self.retired.get(client_id)

    def live_clients(self) -> dict[str, ClientInfo]:
        """The pool's current clients, by id (a copy)."""
        with self._clients_lock:
            return dict(self.clients)

    def all_clients(self) -> dict[str, ClientInfo]:
        """Recently retired and live clients, by id (a copy)."""
        with self._clients_lock:
            return {**self.retired, **self.clients}

    def cycle(self, index: int) -> CycleRecord | None:
        """The record of cycle `index` while the buffer still holds it (cycles are kept in
        order, one per index, so a recent one is found from the end at once)."""
        cycles = self.cycles
        try:
            offset = cycles[-1].index - index
            record = cycles[-1 - offset] if 0 <= offset < len(cycles) else None
        except IndexError:  # empty, or trimmed meanwhile
            return None
        return record if record is not None and record.index == index else None

    def requests_of(self, client_id: str) -> list[RequestRecord]:
        return [r for r in list(self.requests) if r.client_id == client_id]
