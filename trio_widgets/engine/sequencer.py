"""Per model: requests run in `seq_id` order even when they arrive out of order; a repeated
seq_id is the first request's; a seq_id that never comes is skipped after a while.

Pure: no clock, no I/O, no event loop. `arrive` says what to do with a request and which held
requests may run now; the caller launches them, and starts (or stops) the one timer after
which `skip_gap` gives up on a missing predecessor (`waiting` says whether one is needed).
A server keeps one per model (engine/served.py), on its event loop's thread (tests/test_sequencer.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from ..errors import InvalidInputError

__all__ = ["Arrival", "Sequencer"]

T = TypeVar("T")
SEEN = 4096  # seq_ids remembered per model, for deduplication
HELD = 1024  # requests of a model that may wait for a missing predecessor


@dataclass
class Arrival(Generic[T]):
    """What became of an arriving request. `kind`: "run" (launch `item` now, then `ready`),
    "held" (it waits for a predecessor), "duplicate" (a retry: `item` is the first request's,
    nothing to run). `ready`: held requests whose turn came, in order, to launch after it."""

    kind: Literal["run", "held", "duplicate"]
    item: Any  # T; for a duplicate, what the first one's `remember` kept
    ready: list[T] = field(default_factory=list)


class Sequencer(Generic[T]):
    """`remember(item)` is what a repeat is answered with (the server keeps a request's id, not
    the request and its result: the table of seen seq_ids costs ids, not bodies)."""

    def __init__(self, start: int = 0, *, seen: int = SEEN, held: int = HELD,
                 remember: Callable[[T], Any] = lambda item: item):
        self.last = start  # highest seq_id run (0: the create)
        self.seen: OrderedDict[int, Any] = OrderedDict()
        self._remember = remember
        self.held: dict[int, T | None] = {}  # None: a refused request's seq_id, only to be stepped over
        self._seen_limit, self._held_limit = seen, held

    @property
    def waiting(self) -> bool:
        """Whether something waits for a predecessor (the caller's timer should run)."""
        return bool(self.held)

    def arrive(self, seq: Any, item: T) -> Arrival[T]:
        if seq is None:  # unnumbered (not from the SDKs): runs at once, no deduplication
            return Arrival("run", item)
        if isinstance(seq, bool) or not isinstance(seq, int) or not (0 <= seq < 2**31):
            raise InvalidInputError(f"must be an integer from 0 to 2^31-1, got {seq!r:.40}", field="seq_id")
        if seq in self.seen:
            return Arrival("duplicate", self.seen[seq])  # a retry: the first submission's request, run once
        if seq <= self.last and len(self.seen) >= self._seen_limit and seq < next(iter(self.seen)):
            raise InvalidInputError(f"seq_id {seq} is older than the last {self._seen_limit} requests of this "
                                    f"model; it was used already", field="seq_id")
        if seq > self.last + 1 and len(self.held) >= self._held_limit:
            raise InvalidInputError(f"{len(self.held)} requests of this model already wait for seq_id "
                                    f"{self.last + 1}; send that one first", field="seq_id")
        self.seen[seq] = self._remember(item)
        while len(self.seen) > self._seen_limit:
            self.seen.popitem(last=False)
        if seq > self.last + 1:  # its predecessor has not arrived (yet): hold it, for a while
            self.held[seq] = item
            return Arrival("held", item)
        self.last = max(self.last, seq)  # next in line, or late (its gap was skipped already)
        return Arrival("run", item, self._release())

    def unsee(self, seq: Any) -> None:
        """A request that `arrive` let run was refused when launched: its seq_id gave out no
        request, so a retry must not be answered with it."""
        if isinstance(seq, int):
            self.seen.pop(seq, None)

    def refuse(self, seq: Any) -> list[T]:
        """A request refused (4xx) before it could be queued still used its seq_id: its successors
        must not wait for it. Returns the held requests whose turn came."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= self.last or seq in self.seen:
            return []
        if seq == self.last + 1:
            self.last = seq
            return self._release()
        if len(self.held) < self._held_limit:
            self.held.setdefault(seq, None)
        return []

    def skip_gap(self) -> tuple[int, int, list[T]]:
        """A seq_id never came (its client consumed it without sending it): go on without it.
        Returns the skipped range (first, last) and the held requests whose turn came."""
        if not self.held:
            return self.last + 1, self.last, []
        first, missing = self.last + 1, min(self.held) - 1
        self.last = missing
        return first, missing, self._release()

    def drop_held(self) -> list[T]:
        """Everything held, given up (the session ended): the caller fails them."""
        dropped = [item for item in self.held.values() if item is not None]
        self.held.clear()
        return dropped

    def _release(self) -> list[T]:
        ready = []
        while self.last + 1 in self.held:
            self.last += 1
            item = self.held.pop(self.last)
            if item is not None:
                ready.append(item)
        return ready
