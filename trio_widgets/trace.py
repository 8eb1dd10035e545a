"""Exports of what a pool did: a Chrome / Perfetto trace, and metrics.jsonl.

Engine side: reads `Telemetry` only, imports no widget code.

* :func:`chrome_trace` — the Trace Event Format (``{"traceEvents": [...]}``) that
  ui.perfetto.dev and chrome://tracing open: one process per pool, one track per client
  with a span per request (name = op; args: request id, cycle, queue wait, loss), a
  "clock" track with a span per cycle, counter tracks "queue <client>" with the
  requests queued at each boundary, and the GIL: a counter "clock GIL wait (ms)" per cycle
  (how long the clock waited for the interpreter) and a "GIL" track with a span per
  stretch in which other Python held it (name: the function; args: thread, cell/line, frames).
* :func:`metrics_rows` / :func:`write_metrics_jsonl` — one JSON object per update
  (cookbook-style keys: ``step``, ``loss``, ``tokens``, ``cycle``, ``cycles``, ``time/wait``,
  ``time/gil_wait``), for a
  loop the user wrote; the loop API (`trio_widgets.loop`) writes richer rows itself.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

from .metrics import gil_wait, json_safe, record_loss
from .ops import UPDATE_OPS
from .telemetry import Telemetry

__all__ = ["chrome_trace", "metrics_rows", "write_chrome_trace", "write_metrics_jsonl"]

GIL_TID = 1_000_000  # the GIL track's thread id: after the clock (0), apart from the clients (1, 2, ...)


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 1)


def chrome_trace(telemetry: Telemetry, *, name: str = "trio pool", pid: int = 1,
                 depth: tuple[str, str] = ("queue", "queued")) -> dict[str, Any]:
    """The pool's recent history (what its ring buffers still hold) as a trace dict. `depth`: the
    name and arg of the depth counters ("queue <client>": queued; a watcher's "in flight")."""
    cycles = list(telemetry.cycles)
    requests = [r for r in list(telemetry.requests) if r.started_at is not None and r.finished_at is not None]
    depths = list(telemetry.queue_depths)
    clients = telemetry.all_clients()
    stalls = list(telemetry.gil)
    starts = ([c.started_at for c in cycles] + [r.queued_at for r in requests] + [d.time for d in depths]
              + [s.started_at for s in stalls])
    t0 = min(starts) if starts else 0.0

    tids: dict[str, int] = {}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "clock"}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "thread_sort_index", "args": {"sort_index": 0}},
        {"ph": "M", "pid": pid, "tid": GIL_TID, "name": "thread_name",
         "args": {"name": "GIL (other Python held the interpreter)"}},
        {"ph": "M", "pid": pid, "tid": GIL_TID, "name": "thread_sort_index", "args": {"sort_index": 0}},
    ]

    def tid_of(client_id: str) -> int:
        if client_id not in tids:
            tids[client_id] = tid = len(tids) + 1
            info = clients.get(client_id)
            label = info.label if info is not None else client_id
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": f"{label} ({client_id})" if label != client_id else client_id}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
        return tids[client_id]

    for cid in clients:
        tid_of(cid)
    for c in cycles:
        events.append({"ph": "X", "pid": pid, "tid": 0, "name": f"cycle {c.index}", "cat": "cycle",
                       "ts": _us(c.started_at, t0), "dur": _us(c.ended_at, c.started_at),
                       "args": {"cycle": c.index, "busy_ms": round(c.busy_s * 1e3, 3), "requests": c.n_requests,
                                "tokens": c.tokens, "ops": dict(c.ops), "idle": c.n_requests == 0,
                                "cpu_ms": round(c.cpu_s * 1e3, 3), "gil_wait_ms": round(c.gil_wait_s * 1e3, 3)}})
        events.append({"ph": "C", "pid": pid, "tid": 0, "name": "clock GIL wait (ms)", "ts": _us(c.started_at, t0),
                       "args": {"ms": round(c.gil_wait_s * 1e3, 3)}})
    for s in stalls:
        top = s.frames[0] if s.frames else None
        events.append({"ph": "X", "pid": pid, "tid": GIL_TID, "cat": "gil",
                       "name": f"GIL held: {top.label}" if top else f"GIL held by {s.thread}",
                       "ts": _us(s.started_at, t0), "dur": max(_us(s.ended_at, s.started_at), 1.0),
                       "args": {"thread": s.thread, "where": top.where if top else None,
                                "frames": [f"{f.function} ({f.where}) {f.file}" for f in s.frames],
                                "lag_ms": round(s.lag_s * 1e3, 3), "heartbeats": s.heartbeats}})
    for r in requests:
        started, finished = r.started_at, r.finished_at
        if started is None or finished is None:
            continue
        args: dict[str, Any] = {"request_id": r.request_id, "client": r.client_id, "cycle": r.cycle,
                                "status": r.status, "tokens": r.tokens,
                                "queued_ms": round((started - r.queued_at) * 1e3, 3)}
        if r.delivered_at is not None:
            args["delivered_ms"] = round((r.delivered_at - finished) * 1e3, 3)
        for key, value in r.metrics.items():
            args[key] = value if isinstance(value, (int, float)) and math.isfinite(value) else str(value)
        if r.error:
            args["error"] = r.error
        events.append({"ph": "X", "pid": pid, "tid": tid_of(r.client_id), "name": r.op, "cat": r.op,
                       "ts": _us(started, t0), "dur": max(_us(finished, started), 1.0),
                       "args": args})
    counter, arg = depth
    for d in depths:
        for cid, n in d.depths.items():
            info = clients.get(cid)
            events.append({"ph": "C", "pid": pid, "tid": 0, "name": f"{counter} {info.label if info else cid}",
                           "ts": _us(d.time, t0), "args": {arg: n}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"total_cycles": telemetry.total_cycles, "total_updates": telemetry.total_updates,
                          "total_tokens": telemetry.total_tokens}}


def write_chrome_trace(telemetry: Telemetry, path: str | os.PathLike, **kwargs: Any) -> str:
    """Write :func:`chrome_trace` to `path` (open it in ui.perfetto.dev); returns the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(telemetry, **kwargs), f)
    return path


def metrics_rows(telemetry: Telemetry) -> list[dict[str, Any]]:
    """One row per delivered forward_backward, per client, from the telemetry alone."""
    clients = telemetry.all_clients()
    steps: dict[str, int] = {}
    last_cycle: dict[str, int] = {}
    rows = []
    for r in sorted(list(telemetry.requests), key=lambda r: r.request_id):
        if r.op not in UPDATE_OPS or r.status != "ok" or r.cycle is None:
            continue
        steps[r.client_id] = step = steps.get(r.client_id, 0) + 1
        loss_sum = r.metrics.get("loss:sum", math.nan)
        prev = last_cycle.get(r.client_id)
        last_cycle[r.client_id] = r.cycle
        info = clients.get(r.client_id)
        rows.append({"run": info.label if info else r.client_id, "client_id": r.client_id, "step": step,
                     "loss": record_loss(r.metrics), "loss:sum": loss_sum,
                     "tokens": r.tokens, "cycle": r.cycle, "cycles": None if prev is None else r.cycle - prev,
                     "time/wait": (r.delivered_at - r.queued_at) if r.delivered_at is not None else None,
                     "time/gil_wait": gil_wait(telemetry, (r.cycle,))})
    return rows


def write_metrics_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write dict rows as JSON lines (NaN as null); returns the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(json_safe(row)) + "\n")
    return path
