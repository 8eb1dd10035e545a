"""Pools and clients come and go all day in a notebook: what they leave behind is bounded.

RSS is read after a warm-up (allocator arenas, torch's thread pools and kernel caches are
sized by then) and may grow by less than 50 MB afterwards. What a leak costs, for scale:
one rank-32 adapter of the built-in model with its gradient, AdamW moments and spare
buffers is ~7 MB, one pool with its own base model ~10 MB; 200 leaked clients or 20
leaked pools would cost well over 50 MB.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import psutil
import pytest
from conftest import random_batch
from transports import queued

import trio_widgets as trio

GROWTH_LIMIT_MB = 50.0
# A dashboard run also makes and drops widgets, a bokeh document's columns and an asyncio task
# per run, and their heap churn moves RSS by up to +-50 MB over 25 rounds (four runs here:
# -51, +35, +34 and +5 MB). A leaked run costs at least its client, ~7 MB (above), so 200 runs
# leaking would cost ~1.4 GB; 100 MB still catches any per-run leak of 0.5 MB or more.
DASHBOARD_GROWTH_LIMIT_MB = 100.0
ADAM = trio.AdamParams(learning_rate=1e-3)


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def clock_threads(prefix: str) -> list[threading.Thread]:
    """A pool's threads: its clock and its GIL watchdog."""
    return [t for t in threading.enumerate()
            if t.name.startswith((f"trio-clock-{prefix}", f"trio-gil-{prefix}")) and t.is_alive()]


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def use_and_drop_a_pool(i: int) -> trio.APIFuture:
    pool = trio.LocalPool(min_cycle_s=0.0, name=f"dropped-{i}")
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=i)
    kept = tc.forward_backward(random_batch(i, n=2, length=12))
    kept.result(timeout=60)
    tc.optim_step(ADAM).result(timeout=60)
    return kept  # a future the user still holds must not keep the pool alive


def test_dropped_pools_stop_their_clocks_and_memory_stays_flat():
    kept = [use_and_drop_a_pool(i) for i in range(5)]  # warm-up
    wait_for(lambda: not clock_threads("dropped-"), "the warm-up pools' clocks to stop")
    before = rss_mb()
    kept += [use_and_drop_a_pool(i) for i in range(5, 30)]
    wait_for(lambda: not clock_threads("dropped-"), "every dropped pool's clock to stop")
    growth = rss_mb() - before
    assert growth < GROWTH_LIMIT_MB, f"RSS grew by {growth:.1f} MB over 25 pools"


def test_a_dropped_pool_fails_what_it_never_ran():
    pool = trio.LocalPool(min_cycle_s=3600.0, name="dropped-queued")  # its next boundary is an hour away
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    time.sleep(0.05)  # the first (empty) boundary has been taken: the request waits for the next
    fut = tc.forward_backward(random_batch(1, n=1, length=5))
    del tc, pool
    gc.collect()
    with pytest.raises(trio.PoolClosedError, match="dropped"):
        fut.result(timeout=30)
    wait_for(lambda: not clock_threads("dropped-queued"), "the clock to stop")


def test_dropped_and_closed_training_clients_are_released(pool):
    service = trio.ServiceClient(pool)
    batch = random_batch(3, n=2, length=16)

    def one_client(i: int) -> None:
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=32, seed=i)
        tc.forward_backward(batch)
        tc.optim_step(ADAM).result(timeout=60)
        if i % 2:
            tc.close()  # explicitly; the others are just dropped

    for i in range(20):  # warm-up
        one_client(i)
    before = rss_mb()
    for i in range(20, 220):
        one_client(i)
        assert pool.tenant_count <= 2  # this one, and at most the previous until the next boundary
    wait_for(lambda: pool.tenant_count == 0, "the last clients to be released")
    growth = rss_mb() - before
    assert growth < GROWTH_LIMIT_MB, f"RSS grew by {growth:.1f} MB over 200 clients"
    assert len(pool.telemetry.clients) == 0 and len(pool.telemetry.retired) <= pool.telemetry.capacity
    assert len(pool.queue_depths()) == 0  # no queue left behind for the boundary to visit


def test_a_closed_client_refuses_new_requests_and_finishes_queued_ones(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    with pool.hold():
        fb = tc.forward_backward(random_batch(1, n=1, length=8))
        opt = tc.optim_step(ADAM)
        queued(pool, 2)
        tc.close()
        with pytest.raises(trio.ClientClosedError, match=tc.client_id):
            tc.forward_backward(random_batch(1, n=1, length=8))
    assert fb.result(timeout=60).metrics["loss:sum"] > 0 and opt.result(timeout=60).metrics["step:max"] == 1
    wait_for(lambda: pool.tenant_count == 0, "the closed client to be released")
    assert tc.closed and "closed" in repr(tc)
    with svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0) as other:
        other.forward_backward(random_batch(1, n=1, length=8)).result(timeout=60)
    assert other.closed


def test_dashboard_start_stop_releases_the_runs_clients():
    """25 rounds of Start / Stop with 8 runs each: 200 training clients through the dashboard."""
    async def main() -> tuple[float, float, int]:
        with trio.LocalPool(min_cycle_s=0.0, name="start-stop") as pool:
            dash = trio.Dashboard(pool, runs=8, rank=32, batch_size=2)

            async def round_trip() -> None:
                before = list(dash.runs)
                dash.start()  # applied on the dashboard's thread: wait for this Start's runs
                await until(lambda: dash.state != "starting" and len(dash.runs) == 8 and dash.runs != before
                            and all(r.step >= 1 for r in dash.runs), "runs to train")
                dash.stop()
                await until(lambda: all(r.done() for r in dash.runs), "runs to stop")

            for _ in range(3):  # warm-up
                await round_trip()
            before = rss_mb()
            for _ in range(25):
                await round_trip()
                assert pool.tenant_count <= 16  # this round's runs, and the last round's until a boundary
            await until(lambda: pool.tenant_count <= 8, "the previous round's clients to be released")
            after = rss_mb()
            tenants = pool.tenant_count
            dash.close()
            return before, after, tenants

    before, after, tenants = asyncio.run(main())
    assert tenants <= 8
    assert after - before < DASHBOARD_GROWTH_LIMIT_MB, f"RSS grew by {after - before:.1f} MB over 200 dashboard runs"


async def until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
