"""trio.watch on trio's own client, in-process (issue 26): where the watcher's view must agree with
the pool's exactly. Each request the loop sent is one record on each side, and the loop's shape,
round trips per update (half the pool's cycles per update) and requests in flight are the same,
written in tinker's style (`.result()`) and in pytrio's (a client made and used at once)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections import Counter

import pytest
from conftest import random_batch
from served import in_threads

import trio_widgets as trio
from trio_widgets.advisor import diagnose_telemetry
from trio_widgets.watch import Watcher, _track, in_flight_depth, unwatch, watch, watcher_of

# `make test` runs it alone, with no test beside it: it counts the cycles each loop shape takes, and
# a round trip on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone
ADAM = trio.AdamParams(learning_rate=1e-3)
BATCH = random_batch(0, n=1, length=8)


def naive(tc, n=5):
    for _ in range(n):
        tc.forward_backward(BATCH).result()
        tc.optim_step(ADAM).result()


def together(tc, n=6):
    for _ in range(n):
        fb, opt = tc.forward_backward(BATCH), tc.optim_step(ADAM)
        fb.result()
        opt.result()


def pipelined(tc, n=8):
    previous = None
    for _ in range(n):
        current = (tc.forward_backward(BATCH), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result()
            previous[1].result()
        previous = current
    previous[0].result()
    previous[1].result()


# the loop, its round trips per update and requests in flight
SHAPES = {"naive": (naive, 2, 1), "together": (together, 1, 2), "pipelined": (pipelined, 0.5, 4)}


@pytest.mark.parametrize("style", ["tinker", "pytrio"])
def test_trios_own_client_watched_agrees_with_the_pool_exactly(style):
    with trio.LocalPool(min_cycle_s=0.1, name=f"watch-{style}") as pool:
        service = watch(trio.ServiceClient(pool))
        try:
            made = {name: service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i)
                    for i, name in enumerate(SHAPES)}
            # tinker's style waits for the client; pytrio's uses what create_* returned at once
            clients = {name: (f.result() if style == "tinker" else f) for name, f in made.items()}
            in_threads({name: functools.partial(SHAPES[name][0], clients[name]) for name in SHAPES}, timeout=120)
            watcher = watcher_of(service)
            mine = watcher.diagnose()
            theirs = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)
            for name, tc in clients.items():
                d, p = mine[tc.model_id], theirs[tc.client_id]
                records = [r for r in watcher.records() if r.client_id == tc.model_id]
                pooled = pool.telemetry.requests_of(tc.client_id)
                assert Counter(r.op for r in records) == Counter(r.op for r in pooled), name
                assert all(r.status == "ok" and r.delivered_at is not None for r in records), name
                _, trips, depth = SHAPES[name]
                assert (d.cause, p.cause) == (name, name), (name, d.evidence, p.evidence)
                assert d.round_trips_per_update == p.cycles_per_update / 2 == trips, (name, d, p)
                assert d.in_flight == in_flight_depth(records) == in_flight_depth(pooled) == depth, name
        finally:
            client = unwatch(service)
        assert isinstance(client, trio.ServiceClient) and not watcher.watchdog.thread.is_alive()


def test_a_watched_trio_client_resolves_to_the_watched_client():
    """trio's clients are also futures of themselves (tinker's `.result()`, pytrio's `await`),
    which give the plain client as tinker's do (issue 32: not a future, not awaitable): watched,
    the future resolves to one watched client, so what the loop goes on with is still watched."""
    with trio.LocalPool(min_cycle_s=0.02, name="watch-self") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        watched = watch(tc)
        try:
            client = watched.result()
            assert client is watched.result() and client is not tc

            async def awaited():
                return await watched, await watched.result_async()

            assert asyncio.run(awaited()) == (client, client)
            client.forward_backward(BATCH).result()
            assert [r.op for r in watcher_of(watched).records()] == ["forward_backward"]
        finally:
            assert unwatch(watched) is tc


def test_a_result_the_loop_has_counts_as_arrived_before_the_loops_next_submit():
    """A concurrent future wakes the thread in `.result()` before it runs its done-callbacks, the
    watcher's among them: a naive loop could submit its next request first and seem to have two in
    flight (seen in notebook 07). The loop's own `.result()` records the arrival. Here the watcher's
    callback waits behind an earlier one until the next request is in."""
    watcher = Watcher(gil=False)
    try:
        source: concurrent.futures.Future = concurrent.futures.Future()
        release = threading.Event()
        source.add_done_callback(lambda _f: release.wait(30))  # callbacks run in order: the watcher's is next
        first = watcher.submitted("run-1", "forward_backward")
        future = _track(watcher, first, trio.APIFuture(source, request_id=1, op="forward_backward"))
        output = trio.ForwardBackwardOutput("cross_entropy", [], {"loss:sum": 2.0})
        setter = threading.Thread(target=source.set_result, args=(output,))
        setter.start()
        try:
            assert future.result(timeout=30) is output
            second = watcher.submitted("run-1", "optim_step")
        finally:
            release.set()
            setter.join(30)
        assert first.delivered_at is not None and first.delivered_at <= second.queued_at
        assert first.status == "ok" and first.metrics["loss:sum"] == 2.0
        assert in_flight_depth([first, second]) == 1 and watcher.in_flight() == {"run-1": 1}
    finally:
        watcher.close()
