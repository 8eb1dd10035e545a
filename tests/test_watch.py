"""trio.watch on the unmodified official tinker SDK (0.38.0) against a served pool (issue 26).

The pool's own telemetry is the oracle: for each loop shape the watcher's diagnosis, made from
client-side submit / result times alone, must name the cause the advisor names from the pool's
cycles, with as many round trips per update (half the pool's cycles per update: a round trip
is two cycles on a clock pool) and the same depth of requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import warnings

import pytest
from served import wait_for

import trio_widgets as trio
from trio_widgets import watch as watch_module
from trio_widgets.advisor import diagnose_telemetry
from trio_widgets.watch import UnsupportedSDKError, WatchedRequest, in_flight_depth, unwatch, watch, watcher_of

if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import test_serve_tinker as serve_tests  # noqa: E402
import tinker  # noqa: E402
from tinker import types as tt  # noqa: E402

# The served pool (0.4 s cycles: a client's HTTP round trip fits in one on a loaded 2-core machine),
# its server, the SDK's ServiceClient and short cycles on demand: test_serve_tinker's fixtures.
pool, server, sdk, fast = serve_tests.pool, serve_tests.server, serve_tests.sdk, serve_tests.fast
ADAM, datum = serve_tests.ADAM, serve_tests.datum


# The loop shapes of tests/served.py, one client each, written as a user would.
def naive(tc, n=5):
    for i in range(n):
        tc.forward_backward([datum(i)], "cross_entropy").result(timeout=120)
        tc.optim_step(ADAM).result(timeout=120)


def together(tc, n=6):
    for i in range(n):
        fb, opt = tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(ADAM)
        fb.result(timeout=120)
        opt.result(timeout=120)


def pipelined(tc, n=8):
    previous = None
    for i in range(n):
        current = (tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result(timeout=120)
            previous[1].result(timeout=120)
        previous = current
    previous[0].result(timeout=120)
    previous[1].result(timeout=120)


SHAPES = {"naive": (naive, 1), "together": (together, 2), "pipelined": (pipelined, 4)}  # shape, in flight


def test_the_watchers_diagnosis_is_the_pools_for_each_loop_shape(sdk, server, pool):
    """Three runs of the three shapes at once (a client each): the cause, round trips per update and
    in-flight depth from the client's side equal what the pool's telemetry says, every time."""
    watched = watch(sdk)
    for run in range(3):
        clients = {name: watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=run).result()
                   for name in SHAPES}
        errors: list[BaseException] = []

        def go(name, clients=clients, errors=errors):
            try:
                SHAPES[name][0](clients[name])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(name,)) for name in SHAPES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        mine = watcher_of(watched).diagnose()
        theirs = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)
        for name, tc in clients.items():
            pool_id = server.clients()[tc.model_id]
            d, p = mine[tc.model_id], theirs[pool_id]
            assert (d.cause, p.cause) == (name, name), (run, name, d, p)
            assert d.round_trips_per_update == p.cycles_per_update / 2, (run, name, d, p)
            records = [r for r in watcher_of(watched).records() if r.client_id == tc.model_id]
            depth = SHAPES[name][1]
            assert in_flight_depth(records) == in_flight_depth(pool.telemetry.requests_of(pool_id)) == depth
            assert d.in_flight == depth, d
            assert "server's cycle boundaries" in d.unknown and "server's cycle boundaries" in d.evidence
            assert d.cause == "pipelined" or d.wasted


def test_sync_await_and_async_styles_and_samplers_are_recorded(sdk, fast):
    watched = watch(sdk)
    watcher = watcher_of(watched)
    tc = watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=7).result()
    # sync: the result is available (the SDK's future resolved) before the loop asks for it
    fb = tc.forward_backward([datum(0)], "cross_entropy")
    wait_for(lambda: fb.future().done(), "the forward_backward result")
    time.sleep(0.3)
    out = fb.result(timeout=60)
    record = fb.record
    assert isinstance(record, WatchedRequest) and record.op == "forward_backward" and record.status == "ok"
    assert record.client_id == tc.model_id and record.cycle is None and record.tokens == 16
    assert record.queued_at < record.delivered_at <= record.awaited_at - 0.25
    assert record.waited_by == "result"
    assert record.metrics["loss:sum"] == out.metrics["loss:sum"] and record.metrics["weight:sum"] == 16
    tc.optim_step(ADAM).result(timeout=60)

    async def loop():
        fut = tc.forward_backward([datum(1)], "cross_entropy")
        await fut
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the SDK deprecates its *_async methods
            opt = await tc.optim_step_async(ADAM)
        await opt.result_async(timeout=60)
        sampler = await tc.save_weights_and_get_sampling_client()
        return await sampler.sample(tt.ModelInput.from_ints([5, 6, 7]), 2, tt.SamplingParams(max_tokens=3, seed=1))

    samples = asyncio.run(loop())
    assert len(samples.sequences) == 2
    records = watcher.records()
    assert [(r.op, r.waited_by, r.status) for r in records] == [
        ("forward_backward", "result", "ok"), ("optim_step", "result", "ok"), ("forward_backward", "await", "ok"),
        ("optim_step", "await", "ok"), ("sample", "await", "ok")]
    sampler_info = watcher.telemetry.client_info(records[-1].client_id)
    assert sampler_info.kind == "sampling" and sampler_info.parent == tc.model_id
    assert all(r.delivered_at is not None and r.finished_at == r.delivered_at for r in records)

    # exports: a bar per request (submitted -> result) with when the loop asked; in-flight counters;
    # metrics rows with the loss per weighted token
    trace = watcher.chrome_trace()
    bars = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert [e["name"] for e in bars] == [r.op for r in records]
    assert all("awaited_ms" in e["args"] and e["args"]["cycle"] is None for e in bars)
    assert any(e.get("ph") == "C" and e["name"].startswith("in flight ") for e in trace["traceEvents"])
    rows = watcher.metrics_rows()
    assert [row["step"] for row in rows] == [1, 2]
    assert math.isclose(rows[0]["loss"], out.metrics["loss:sum"] / 16) and rows[0]["time/round_trip"] > 0
    assert rows[0]["time/unclaimed"] >= 0.25


def _attributes(objects):
    return {id(o): dict(vars(o)) for o in objects}


def test_watching_changes_nothing_of_the_sdk_and_unwatch_hands_the_client_back(sdk, fast):
    from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
    from tinker.lib.public_interfaces.backcompat_training_client_future import BackcompatTrainingClientFuture

    classes = [tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.APIFuture,
               AwaitableConcurrentFuture, BackcompatTrainingClientFuture]
    before = {cls: dict(vars(cls)) for cls in classes}
    tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=9).result()
    instance = dict(vars(tc))
    w = watch(tc)
    w.forward_backward([datum(2)], "cross_entropy").result(timeout=60)
    w.optim_step(ADAM).result(timeout=60)
    assert w.model_id == tc.model_id and len(watcher_of(w).records()) == 2
    assert unwatch(w) is tc
    w.forward_backward([datum(3)], "cross_entropy").result(timeout=60)  # passes through, unrecorded
    assert len(watcher_of(w).records()) == 2
    after = {cls: dict(vars(cls)) for cls in classes}
    for cls in classes:
        assert after[cls].keys() == before[cls].keys(), cls
        assert all(after[cls][k] is before[cls][k] for k in before[cls]), cls
    assert vars(tc).keys() == instance.keys() and all(vars(tc)[k] is v for k, v in instance.items()
                                                     if k != "_request_id_counter" and k != "_turn_counter")


def test_what_it_cannot_watch_is_refused_clearly(sdk, monkeypatch):
    with pytest.raises(UnsupportedSDKError, match="official SDKs' clients"):
        watch(object())
    with pytest.raises(UnsupportedSDKError, match="official SDKs' clients"):
        watch(trio.AdamParams(learning_rate=1e-3))
    monkeypatch.setitem(watch_module.SUPPORTED_SDKS, "tinker", ("0.0.1",))
    with pytest.raises(UnsupportedSDKError, match=r"checked against tinker 0\.0\.1, not the installed 0\.38\.0.*"
                                                  r"check_version=False"):
        watch(sdk)
    assert watch(sdk, check_version=False) is not None
    with pytest.raises(UnsupportedSDKError, match="already watched"):
        watch(watch(sdk, check_version=False))
