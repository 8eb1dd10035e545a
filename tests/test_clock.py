"""Clock-cycle semantics, pinned exactly through APIFuture.cycle (never by wall-clock time)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import random_batch
from transports import differs, queued, service

import trio_widgets as trio

# `make test` runs it alone, with no test beside it: it counts the cycles each loop shape takes, and
# a round trip on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone

# Long enough that a client always reacts within one cycle, on any machine (over HTTP a round
# trip and the server's share of the GIL too, as in test_serve_client.py).
CYCLE_S = 0.1
HTTP_CYCLE_S = 0.4
ADAM = trio.AdamParams(learning_rate=1e-3)


@pytest.fixture
def clocked(transport):
    """A pool on cycles a client always reacts within, and its ServiceClient through each codec."""
    with trio.LocalPool(min_cycle_s=CYCLE_S if transport == "in-process" else HTTP_CYCLE_S, name="clocked") as p, \
            service(transport, p) as svc:
        yield svc


def spans_and_periods(pairs: list[tuple[trio.APIFuture, trio.APIFuture]]) -> tuple[set[int], set[int]]:
    spans = {opt.cycle - fb.cycle + 1 for fb, opt in pairs}
    starts = [fb.cycle for fb, _ in pairs]
    periods = {b - a for a, b in zip(starts[1:], starts[2:])}  # skip the first: not steady state yet
    return spans, periods


def test_sync_naive_together_pipelined(clocked):
    tc = clocked.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    batch = random_batch(0, n=1, length=16)

    naive = []
    for _ in range(5):
        fb = tc.forward_backward(batch, "cross_entropy")
        fb.result()
        opt = tc.optim_step(ADAM)
        opt.result()
        naive.append((fb, opt))
    assert spans_and_periods(naive) == ({3}, {4})

    together = []
    for _ in range(5):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(ADAM)
        fb.result()
        opt.result()
        together.append((fb, opt))
    assert spans_and_periods(together) == ({1}, {2})

    pipelined, previous = [], None
    for _ in range(6):
        current = (tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result()
            previous[1].result()
        pipelined.append(current)
        previous = current
    previous[1].result()
    assert spans_and_periods(pipelined) == ({1}, {1})


def test_async_two_await_boundaries(clocked):
    tc = clocked.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    batch = random_batch(1, n=1, length=16)

    async def run() -> dict[str, list]:
        out: dict[str, list] = {"naive": [], "together": [], "pipelined": []}
        for _ in range(5):
            fb = await tc.forward_backward_async(batch, "cross_entropy")
            assert isinstance(fb, trio.APIFuture) and fb.cycle is None  # submitted, not yet run
            await fb
            opt = await tc.optim_step_async(ADAM)
            await opt.result_async()
            out["naive"].append((fb, opt))
        for _ in range(5):
            fb = await tc.forward_backward_async(batch, "cross_entropy")
            opt = await tc.optim_step_async(adam_params=ADAM)
            await fb
            await opt
            out["together"].append((fb, opt))
        previous = None
        for _ in range(6):
            current = (await tc.forward_backward_async(batch, "cross_entropy"), await tc.optim_step_async(ADAM))
            if previous is not None:
                await previous[0]
                await previous[1]
            out["pipelined"].append(current)
            previous = current
        await previous[1]
        return out

    out = asyncio.run(run())
    assert spans_and_periods(out["naive"]) == ({3}, {4})
    assert spans_and_periods(out["together"]) == ({1}, {2})
    assert spans_and_periods(out["pipelined"]) == ({1}, {1})


def test_one_update_per_tenant_per_cycle_and_order_kept(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    batch = random_batch(2, n=1, length=8)
    with pool.hold():  # everything below is queued before one boundary
        futures = [tc.forward_backward(batch), tc.optim_step(ADAM), tc.forward_backward(batch),
                   tc.forward_backward(batch), tc.optim_step(ADAM), tc.optim_step(ADAM)]
        queued(pool, len(futures))
    for f in futures:
        f.result(timeout=60)
    c = [f.cycle for f in futures]
    # fb+opt, then fb alone (the next op is another fb), then fb+opt, then the last opt
    assert c[1] == c[0] and c[2] == c[0] + 1 and c[3] == c[2] + 1 and c[4] == c[3] and c[5] == c[4] + 1


def test_optim_step_keyword_and_positional(svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    tc.forward_backward(random_batch(3, n=1, length=8)).result()
    assert tc.optim_step(adam_params=ADAM).result().metrics["step:max"] == 1
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 2


def test_empty_cycles_tick_and_telemetry_is_bounded():
    with trio.LocalPool(min_cycle_s=0.0, telemetry_capacity=16, name="tick") as p:
        while p.telemetry.total_cycles < 48:  # three times what the buffers hold
            threading.Event().wait(0.01)
        assert len(p.telemetry.cycles) == 16
        assert len(p.telemetry.queue_depths) == 16
        assert all(c.n_requests == 0 for c in p.telemetry.cycles)
        indices = [c.index for c in p.telemetry.cycles]
        assert indices == list(range(indices[0], indices[0] + 16))


def test_an_idle_pool_does_not_spin_and_work_does_not_wait_for_its_tick():
    """min_cycle_s=0 and nothing queued: an empty cycle waits for a submit or the idle tick
    (it ticked ~190 times a second before); a submit ends the wait, so a naive loop still
    spans its exact cycles."""
    from trio_widgets.engine.clock import _IDLE_TICK_S

    with trio.LocalPool(min_cycle_s=0.0, name="idle") as p:
        threading.Event().wait(0.2)
        c0, t0 = p.telemetry.total_cycles, time.perf_counter()
        threading.Event().wait(1.0)
        rate = (p.telemetry.total_cycles - c0) / (time.perf_counter() - t0)
        assert rate <= 1.5 / _IDLE_TICK_S, rate  # (a slow machine only ticks fewer)
        tc = trio.ServiceClient(p).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        for _ in range(3):  # each submit lands while the clock waits out an idle cycle
            fb = tc.forward_backward(random_batch(3, n=1, length=8))
            fb.result(timeout=60)
            opt = tc.optim_step(ADAM)
            opt.result(timeout=60)
            assert opt.cycle == fb.cycle + 2


def test_telemetry_records_requests_and_queue_depth(pool):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    events = []
    unsubscribe = pool.telemetry.subscribe(events.append)
    with pool.hold():
        fb = tc.forward_backward(random_batch(4, n=2, length=8))
        opt = tc.optim_step(ADAM)
        nxt = tc.forward_backward(random_batch(4, n=2, length=8))
    nxt.result(timeout=60)
    opt.result()
    unsubscribe()
    records = {r.request_id: r for r in pool.telemetry.requests_of(tc.client_id)}
    r_fb = records[fb.request_id]
    assert (r_fb.op, r_fb.cycle, r_fb.tokens, r_fb.status) == ("forward_backward", fb.cycle, 16, "ok")
    assert r_fb.queued_at <= r_fb.started_at <= r_fb.finished_at <= r_fb.delivered_at
    assert records[opt.request_id].cycle == fb.cycle and records[nxt.request_id].cycle == fb.cycle + 1
    depth = next(d for d in pool.telemetry.queue_depths if d.cycle == fb.cycle)
    assert depth.depths[tc.client_id] == 3
    cycle = next(c for c in pool.telemetry.cycles if c.index == fb.cycle)
    assert cycle.n_requests == 2 and cycle.tokens == 16 and cycle.ended_at >= cycle.started_at + cycle.busy_s
    kinds = {e.kind for e in events}
    assert {"queued", "boundary", "cycle", "delivered"} <= kinds


def test_close_joins_thread_and_fails_pending(transport):
    p = trio.LocalPool(min_cycle_s=0.0, name="closing")
    with service(transport, p) as svc:
        _close_joins_thread_and_fails_pending(p, svc, transport)


def _close_joins_thread_and_fails_pending(p: trio.LocalPool, svc: trio.ServiceClient, transport: str) -> None:
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    thread = p._clock.thread
    with p.hold():
        futures = [tc.forward_backward(random_batch(5, n=1, length=8)) for _ in range(3)]
        queued(p, 3)
    futures[0].result(timeout=60)
    p.close()
    assert not thread.is_alive()
    errors = [f.exception(timeout=5) for f in futures[1:]]
    assert any(isinstance(e, trio.PoolClosedError) and "closed" in str(e) for e in errors)
    # (over HTTP the server stopped with its pool: a new request cannot reach it, tests/transports.py)
    with pytest.raises(trio.APIConnectionError if differs(transport, "closed-pool") else trio.PoolClosedError):
        tc.forward_backward(random_batch(5, n=1, length=8))


def test_cancel_queued_request(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    with pool.hold():
        first = tc.forward_backward(random_batch(6, n=1, length=8))
        second = tc.forward_backward(random_batch(6, n=1, length=8))
        queued(pool, 2)
        assert second.cancel()
    first.result(timeout=60)
    assert second.cancelled() and not first.cancel()


def test_rerunning_a_cell_closes_the_pool_it_built(monkeypatch):
    import trio_widgets._notebook as notebook

    monkeypatch.setattr(notebook, "current_cell_id", lambda: "cell-abc")
    first = trio.LocalPool(min_cycle_s=0.0, name="cell-1")
    second = trio.LocalPool(min_cycle_s=0.0, name="cell-2")  # the same cell, run again
    try:
        assert first.closed and not first._clock.thread.is_alive()
        assert not second.closed
    finally:
        second.close()


def test_unreferenced_pool_stops_its_clock():
    import gc

    p = trio.LocalPool(min_cycle_s=0.0, name="orphan")
    thread = p._clock.thread
    del p
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
