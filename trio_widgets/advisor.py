"""Why is a loop slow? Pure functions over telemetry records, one diagnosis per client.

Nothing here instruments the user's loop: everything is read from the pool's
`RequestRecord`s (queued / delivered times, the cycle each request ran in).

* cycles per update (the *period*, trio_widgets.metrics): the median number of cycles between a
  client's successive forward_backward requests, over its recent updates;
* naive: an optim_step was queued after its forward_backward had been delivered;
* together: the next forward_backward was queued only after the previous update's
  results had been delivered;
* client-side stall: results were delivered, but the client's next request came more
  than one cycle later (CPU-heavy Python on the event loop, a slow data loader, ...);
  reported when the loop is otherwise pipelined or the stall costs more cycles than
  the loop's structure does;
* otherwise pipelined: one cycle per update, nothing wasted.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .metrics import PERIOD_WINDOW, cycle_duration, cycles_per_update, format_cycles
from .ops import OPS, UPDATE_OPS
from .telemetry import ClientInfo, CycleRecord, RequestRecord, Telemetry

__all__ = ["Diagnosis", "cycle_seconds", "diagnose", "diagnose_client", "diagnose_telemetry", "recent_records"]

Cause = Literal["pipelined", "naive", "together", "stall", "warming-up", "slow"]

#: Cycles an update takes for each loop structure, without stalls.
STRUCTURE_PERIOD = {"naive": 4, "together": 2, "pipelined": 1}
MIN_UPDATES = 3


@dataclass(frozen=True)
class Diagnosis:
    client_id: str
    label: str
    cause: Cause
    message: str
    cycles_per_update: float | None = None
    stall_cycles: float | None = None
    updates: int = 0  # how many recent updates the diagnosis is based on

    @property
    def wasted(self) -> bool:
        return self.cause in ("naive", "together", "stall", "slow")


def _plural(value: float, word: str) -> str:
    text = format_cycles(value)
    return f"{text} {word}" if text == "1" else f"{text} {word}s"


def _is_step(op: str) -> bool:
    spec = OPS.get(op)
    return spec is not None and spec.is_step


def cycle_seconds(cycles: Iterable[CycleRecord], default: float | None = None) -> float | None:
    """Median measured duration of the recent (finished) cycles, else `default`."""
    return cycle_duration((c.ended_at - c.started_at for c in cycles), default=default)


def _delivered(record: RequestRecord) -> bool:
    return record.delivered_at is not None and record.status in ("ok", "error") and record.cycle is not None


def _delivered_at(record: RequestRecord) -> float:
    """When a record `_updates` kept was delivered (always set for those)."""
    return record.delivered_at if record.delivered_at is not None else float("inf")


def _updates(records: Sequence[RequestRecord]) -> list[tuple[RequestRecord, RequestRecord | None]]:
    """(forward_backward, its optim_step or None) in submission order, delivered ones only."""
    updates: list[list] = []
    for record in records:
        if record.op in UPDATE_OPS:
            updates.append([record, None])
        elif _is_step(record.op) and updates and updates[-1][1] is None:
            updates[-1][1] = record
    return [(fb, opt) for fb, opt in updates
            if _delivered(fb) and fb.status == "ok" and (opt is None or _delivered(opt))]


def diagnose_client(records: Sequence[RequestRecord], cycle_s: float | None, *, client_id: str = "",
                    label: str = "", window: int = PERIOD_WINDOW) -> Diagnosis:
    """The diagnosis of one client from its own records (any order; all of one client)."""
    records = sorted(records, key=lambda r: r.request_id)
    client_id = client_id or (records[0].client_id if records else "")
    label = label or client_id
    updates = _updates(records)[-(window + 1):]
    if len(updates) < MIN_UPDATES:
        return Diagnosis(client_id, label, "warming-up", "measuring: waiting for a few updates",
                         updates=len(updates))
    p = cycles_per_update([fb.cycle for fb, _ in updates], window)
    assert p is not None

    # Loop structure of each step from one update to the next.
    kinds: list[str] = []
    for (fb, opt), (nxt, _) in zip(updates, updates[1:]):
        fb_done = _delivered_at(fb)
        if opt is not None and opt.queued_at > fb_done:
            kinds.append("naive")
        else:
            last = max(fb_done, _delivered_at(opt) if opt is not None else fb_done)
            kinds.append("together" if nxt.queued_at >= last else "pipelined")
    structure = max(STRUCTURE_PERIOD, key=lambda k: (kinds.count(k), -STRUCTURE_PERIOD[k]))

    # Client-side stall: for each submission that followed a delivery, how long after that
    # delivery it came (the earliest delivery since the client's previous submission).
    stall_cycles = 0.0
    if cycle_s:
        deliveries = sorted(r.delivered_at for r in records if r.delivered_at is not None)
        submissions = sorted(r.queued_at for r in records)
        first = updates[1][0].queued_at
        per_update: dict[int, float] = {}
        starts = [fb.queued_at for fb, _ in updates]
        for prev, sub in zip(submissions, submissions[1:]):
            if sub < first:
                continue
            k = bisect.bisect_right(deliveries, prev)
            if k < len(deliveries) and deliveries[k] <= sub:
                gap = sub - deliveries[k]
                u = bisect.bisect_right(starts, sub) - 1
                per_update[u] = per_update.get(u, 0.0) + gap
        gaps = [per_update.get(u, 0.0) / cycle_s for u in range(1, len(updates))]
        stall_cycles = float(statistics.median(gaps)) if gaps else 0.0

    excess = STRUCTURE_PERIOD[structure] - 1
    period_text = _plural(p, "cycle")
    if stall_cycles >= 1.0 and (structure == "pipelined" or stall_cycles >= excess):
        later = _plural(max(1.0, round(stall_cycles)), "cycle")
        message = (f"client-side stall: results were ready but your next request came {later} later "
                   f"({period_text} per update) — move CPU-heavy work off the event loop or overlap it "
                   f"with the next request")
        return Diagnosis(client_id, label, "stall", message, p, stall_cycles, len(updates))
    if structure == "naive":
        message = (f"optim_step was submitted after awaiting forward_backward: {period_text} per update instead "
                   f"of 1 — submit optim_step right after forward_backward, before awaiting")
        return Diagnosis(client_id, label, "naive", message, p, stall_cycles, len(updates))
    if structure == "together":
        message = (f"the next batch was submitted only after the previous update finished: {period_text} per "
                   f"update instead of 1 — queue the next batch before awaiting the current one (pipeline)")
        return Diagnosis(client_id, label, "together", message, p, stall_cycles, len(updates))
    if p > 1.25:
        message = (f"{period_text} per update although the loop is pipelined — requests are not reaching the "
                   f"pool every cycle (failed or cancelled requests, or a loop that waits elsewhere)")
        return Diagnosis(client_id, label, "slow", message, p, stall_cycles, len(updates))
    return Diagnosis(client_id, label, "pipelined", f"{period_text} per update: pipelined, nothing wasted",
                     p, stall_cycles, len(updates))


def diagnose(records: Iterable[RequestRecord], cycle_s: float | None,
             clients: dict[str, ClientInfo] | None = None, *, window: int = PERIOD_WINDOW) -> dict[str, Diagnosis]:
    """One diagnosis per client that sent forward_backward requests (label from `clients`)."""
    by_client: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_client.setdefault(record.client_id, []).append(record)
    out = {}
    for cid, mine in by_client.items():
        if not any(r.op in UPDATE_OPS for r in mine):
            continue
        info = (clients or {}).get(cid)
        out[cid] = diagnose_client(mine, cycle_s, client_id=cid, label=info.label if info else cid, window=window)
    return out


def recent_records(telemetry: Telemetry, per_client: int = 96) -> list[RequestRecord]:
    """The last `per_client` records of each client, newest-first scan of the ring buffer."""
    counts: dict[str, int] = {}
    out = []
    for record in reversed(list(telemetry.requests)):
        n = counts.get(record.client_id, 0)
        if n < per_client:
            counts[record.client_id] = n + 1
            out.append(record)
    out.reverse()
    return out


def diagnose_telemetry(telemetry: Telemetry, min_cycle_s: float | None = None, *, window: int = PERIOD_WINDOW
                       ) -> dict[str, Diagnosis]:
    """`diagnose` over a pool's telemetry: recent records, measured cycle duration."""
    cycle_s = cycle_seconds(list(telemetry.cycles), default=min_cycle_s)
    if min_cycle_s:
        cycle_s = max(cycle_s or 0.0, min_cycle_s)
    return diagnose(recent_records(telemetry, per_client=6 * (window + 2)), cycle_s, telemetry.all_clients(),
                    window=window)
