"""trio.watch on trio's own client, in-process (issue 26): where the watcher's view must agree with
the pool's exactly. Each request the loop sent is one record on each side, and the loop's shape,
round trips per update (half the pool's cycles per update) and requests in flight are the same,
written in tinker's style (`.result()`) and in pytrio's (a client made and used at once)."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter

import pytest
from conftest import random_batch
from served import in_threads

import trio_widgets as trio
from trio_widgets.advisor import diagnose_telemetry
from trio_widgets.watch import in_flight_depth, unwatch, watch, watcher_of

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
