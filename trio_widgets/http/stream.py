"""The served pool's telemetry for remote views (`GET /api/v1/trio/telemetry`, server-sent
events): a bounded backfill, then at most STREAM_HZ batches a second of what the clock
recorded. The clock thread only appends to a bounded deque; a slow reader loses the oldest."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .auth import HttpError

if TYPE_CHECKING:
    from .service import Service

__all__ = ["MAX_STREAMS", "MAX_STREAMS_PER_KEY", "STREAM_HZ", "TELEMETRY_KINDS", "info", "sse", "telemetry_stream",
           "totals"]

TELEMETRY_KINDS = ("client", "retired", "boundary", "cycle", "delivered", "gil")
STREAM_HZ = 10.0  # telemetry batches per second at most (the dashboard's own refresh)
SNAPSHOT_BYTES = 96_000  # a connecting viewer's backfill, at most (JSON): it is encoded while the clock runs
# the snapshot's share of each record kind, newest first (a view shows recent windows)
_SHARES = {"cycles": 0.25, "boundaries": 0.2, "requests": 0.4, "gil": 0.1}


def _newest(records: list[Any], budget: int) -> list[dict]:
    """The newest records (as dicts, oldest first) whose JSON fits in `budget` bytes."""
    out: list[dict] = []
    for record in reversed(records):
        raw = dataclasses.asdict(record)
        budget -= len(json.dumps(raw, separators=(",", ":"), allow_nan=True)) + 1
        if budget < 0:
            break
        out.append(raw)
    out.reverse()
    return out


def info(service: Service) -> dict:
    """What a served pool is (`GET /api/v1/trio/info`, and a stream's first event)."""
    pool = service.pool
    return {"name": pool.name, "min_cycle_s": pool.min_cycle_s, "device": pool.device_type,
            "cycle_index": pool.cycle_index, "models": service.models, "now": time.perf_counter(),
            "stats": dict(service.state.stats), **totals(service)}


def totals(service: Service) -> dict:
    t = service.pool.telemetry
    return {"total_cycles": t.total_cycles, "total_updates": t.total_updates, "total_tokens": t.total_tokens}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=True)}\n\n"


MAX_STREAMS = 32  # telemetry streams open at once, in all
MAX_STREAMS_PER_KEY = 8  # ... and of one key (or, without keys, of one client address)


async def telemetry_stream(service: Service, request: Request, owner: str) -> StreamingResponse:
    # without keys every viewer is "anonymous": its address stands in for the key
    who = owner if owner != "anonymous" else f"address {request.client.host if request.client else '?'}"
    mine = service.streams_of.get(who, 0)
    if mine >= MAX_STREAMS_PER_KEY:
        raise HttpError(429, f"{mine} telemetry streams of this {'key' if who == owner else who} are open, the "
                             f"server's limit per key ({MAX_STREAMS_PER_KEY}); close some dashboards")
    if service.streams >= MAX_STREAMS:
        raise HttpError(429, f"{MAX_STREAMS} telemetry streams are open, the server's limit")
    events: deque = deque(maxlen=16384)  # bounded: a slow reader loses the oldest (views are windows)
    telemetry = service.pool.telemetry

    def keep(event: Any) -> None:  # on the clock thread: an append, nothing else
        if event.kind in TELEMETRY_KINDS:
            events.append((event.kind, event.record))

    unsubscribe = telemetry.subscribe(keep)
    service.streams += 1
    service.streams_of[who] = mine + 1
    asked = request.query_params.get("backfill", "2048")
    n = min(int(asked), 4096) if asked.isdigit() else 2048
    clients = [dataclasses.asdict(c) for c in list(telemetry.live_clients().values())[-256:]]
    budget = SNAPSHOT_BYTES - len(json.dumps(clients))
    backfill = {"clients": clients,
                "cycles": _newest(list(telemetry.cycles)[-n:], int(budget * _SHARES["cycles"])),
                "boundaries": _newest(list(telemetry.queue_depths)[-n:], int(budget * _SHARES["boundaries"])),
                "requests": _newest([r for r in list(telemetry.requests) if r.delivered_at is not None][-n:],
                                    int(budget * _SHARES["requests"])),
                "gil": _newest(list(telemetry.gil)[-n:], int(budget * _SHARES["gil"]))}

    async def batches() -> Any:
        try:
            yield sse({**info(service), "backfill": backfill})
            quiet_since = time.monotonic()
            while not service.state.stopping and not service.pool.closed:
                await asyncio.sleep(1.0 / STREAM_HZ)
                out = []
                for _ in range(len(events)):
                    kind, record = events.popleft()
                    out.append([kind, dataclasses.asdict(record)])
                if out or time.monotonic() - quiet_since > 1.0:  # at least one a second: a heartbeat
                    quiet_since = time.monotonic()
                    yield sse({"now": time.perf_counter(), "cycle_index": service.pool.cycle_index,
                                **totals(service), "events": out})
            yield sse({"now": time.perf_counter(), "closed": True, "events": []})
        finally:
            unsubscribe()
            service.streams -= 1
            left = service.streams_of.pop(who, 1) - 1
            if left > 0:
                service.streams_of[who] = left

    return StreamingResponse(batches(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
