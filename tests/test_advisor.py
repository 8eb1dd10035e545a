"""The advisor's diagnosis of each cause, from the pool's telemetry of loops written by hand.

The loops below are plain user code on the sync API, each in its own thread, all on one
pool at once: nothing is instrumented, the advisor reads RequestRecords only.
"""

from __future__ import annotations

import threading
import time

from conftest import random_batch

import trio_widgets as trio
from trio_widgets.advisor import diagnose_client, diagnose_telemetry
from trio_widgets.metrics import cycles_per_update as period
from trio_widgets.telemetry import RequestRecord

CYCLE_S = 0.1
ADAM = trio.AdamParams(learning_rate=1e-3)


def naive(tc, batch, n):
    for _ in range(n):
        tc.forward_backward(batch).result()
        tc.optim_step(ADAM).result()


def together(tc, batch, n):
    for _ in range(n):
        fb, opt = tc.forward_backward(batch), tc.optim_step(ADAM)
        fb.result()
        opt.result()


def pipelined(tc, batch, n, work_s: float = 0.0):
    previous = None
    for _ in range(n):
        current = (tc.forward_backward(batch), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result()
            previous[1].result()
            # Slow client-side work between results and the next request. (time.sleep, not a
            # busy loop: in-process, Python that holds the GIL also slows the clock thread's
            # torch calls, so the cycles themselves stretch and the stall shows in seconds.)
            time.sleep(work_s)
        previous = current
    previous[1].result()


def test_each_cause_is_diagnosed_with_its_fix():
    batch = random_batch(0, n=1, length=12)
    loops = {"naive": (naive, 6), "together": (together, 8), "pipelined": (pipelined, 12),
             "stalled": (lambda tc, b, n: pipelined(tc, b, n, work_s=0.45), 6)}
    with trio.LocalPool(min_cycle_s=CYCLE_S, name="advisor") as pool:
        sc = trio.ServiceClient(pool)
        clients = {name: sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i,
                                                        user_metadata={"name": name})
                   for i, name in enumerate(loops)}
        errors = []

        def run(name):
            try:
                fn, n = loops[name]
                fn(clients[name], batch, n)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(name,)) for name in loops]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        found = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)

    d = {name: found[tc.client_id] for name, tc in clients.items()}
    assert {name: x.cause for name, x in d.items()} == {
        "naive": "naive", "together": "together", "pipelined": "pipelined", "stalled": "stall"}, d
    assert d["naive"].message == ("optim_step was submitted after awaiting forward_backward: 4 cycles per update "
                                  "instead of 1 — submit optim_step right after forward_backward, before awaiting")
    assert d["together"].cycles_per_update == 2
    assert "2 cycles per update instead of 1" in d["together"].message
    assert "queue the next batch before awaiting the current one (pipeline)" in d["together"].message
    assert d["pipelined"].message == "1 cycle per update: pipelined, nothing wasted"
    assert d["pipelined"].stall_cycles < 1
    stall = d["stalled"]
    assert stall.message.startswith("client-side stall: results were ready but your next request came ")
    assert "move CPU-heavy work off the event loop" in stall.message
    # 0.45 s of client work is 4.5 nominal cycles; measured cycles stretch on a loaded machine
    assert stall.stall_cycles >= 1.5 and stall.cycles_per_update >= 2, stall
    assert {x.label for x in d.values()} == set(loops)


def _update(rid: int, cycle: int, t: float, cycle_s: float, delay: float = 0.001) -> list[RequestRecord]:
    """A pipelined update: fb + optim queued together at t, run in `cycle`, delivered a cycle later."""
    recs = []
    for i, op in enumerate(("forward_backward", "optim_step")):
        r = RequestRecord(rid + i, "c", op, queued_at=t + i * 1e-4, cycle=cycle, status="ok")
        r.started_at, r.finished_at = cycle * cycle_s, cycle * cycle_s + 0.01
        r.delivered_at = (cycle + 1) * cycle_s + delay
        recs.append(r)
    return recs


def test_one_long_pause_does_not_read_as_a_stall():
    cycle_s = 0.1
    records, rid, t = [], 1, 0.0
    # a healthy lookahead-1 loop: update k+1 queued right after update k-1 is delivered
    for k in range(20):
        cycle = k + (50 if k >= 10 else 0)  # a 50-cycle pause (the user pressed Pause) after 10 updates
        t = (cycle - 1) * cycle_s + 0.002 if k else 0.0
        records += _update(rid, cycle, t, cycle_s)
        rid += 2
    d = diagnose_client(records, cycle_s)
    assert d.cause == "pipelined" and d.cycles_per_update == 1, d
    assert diagnose_client(records[:4], cycle_s).cause == "warming-up"
    assert period([3, 4, 5, 9, 10, 11]) == 1.0 and period([7]) is None
