"""trio.watch on the unmodified official tinker SDK (0.38.0) against a served pool (issue 26).

The pool's own telemetry is the oracle: for each loop shape the watcher's diagnosis, made from
client-side submit / result times alone, must name the cause the advisor names from the pool's
cycles, with as many round trips per update (half the pool's cycles per update: a round trip
is two cycles on a clock pool) and the same depth of requests in flight.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
import warnings

import pytest
from served import in_threads, serving_process, wait_for

import trio_widgets as trio
from trio_widgets.advisor import diagnose_telemetry
from trio_widgets.watch import (
    SUPPORTED_SDKS,
    UnsupportedSDKError,
    WatchedRequest,
    Watcher,
    diagnose_watched,
    in_flight_depth,
    unwatch,
    watch,
    watcher_of,
)

if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import test_serve_tinker as serve_tests  # noqa: E402
import tinker  # noqa: E402
from tinker import types as tt  # noqa: E402

# `make test` runs it alone, with no test beside it: the watcher names a loop's cause from the CPU and waits it measures
pytestmark = pytest.mark.alone

# The served pool (0.4 s cycles: a client's HTTP round trip fits in one on a loaded 2-core machine),
# its server, the SDK's ServiceClient and short cycles on demand: test_serve_tinker's fixtures.
pool, server, sdk, fast = serve_tests.pool, serve_tests.server, serve_tests.sdk, serve_tests.fast
ADAM, datum = serve_tests.ADAM, serve_tests.datum


@pytest.fixture
def watching():
    """`watch`, with every watcher it made closed (its GIL watchdog stopped) after the test."""
    made = []

    def watch_(client, **kwargs):
        w = watch(client, **kwargs)
        made.append(w)
        return w

    yield watch_
    for w in made:
        watcher = watcher_of(w.result() if hasattr(type(w), "result") else w)
        watcher.close()
        assert watcher.watchdog is None or not watcher.watchdog.thread.is_alive()


# The loop shapes of tests/served.py, one client each, written as a user would.
def naive(tc, n=4):
    # (4 updates: 3 steps, each 2 round trips; the three shapes run beside `stalled`, the longest loop)
    for i in range(n):
        tc.forward_backward([datum(i)], "cross_entropy").result(timeout=120)
        tc.optim_step(ADAM).result(timeout=120)


def together(tc, n=6):
    for i in range(n):
        fb, opt = tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(ADAM)
        fb.result(timeout=120)
        opt.result(timeout=120)


def pipelined(tc, n=8, work_s=0.0):
    """One update ahead; `work_s`: the loop's own work after each result (sleeping)."""
    previous = None
    for i in range(n):
        current = (tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result(timeout=120)
            previous[1].result(timeout=120)
            if i < n - 1:  # (no request follows work after the last update's results: it could be late to none)
                time.sleep(work_s)
        previous = current
    previous[0].result(timeout=120)
    previous[1].result(timeout=120)


def stalled(tc):
    """Pipelined as written, but 5 cycles of work after each result (longer than a round trip, which
    takes at most 2 cycles, 3 on a loaded machine) make every next request late: results wait for the
    loop. 4 updates: the second goes out at once, the third and fourth each after the loop's work (the
    late requests both sides' medians read, a segment of their own)."""
    pipelined(tc, n=4, work_s=5 * serve_tests.CYCLE_S)


# the loop, the requests in flight at most (None: as the pool saw, whatever it was)
SHAPES = {"naive": (naive, 1), "together": (together, 2), "pipelined": (pipelined, 4), "stall": (stalled, None)}


def test_the_watchers_diagnosis_is_the_pools_for_each_loop_shape(sdk, server, pool, watching):
    """Ten runs of the three shapes and a stalled loop at once (a client each): the cause, round trips
    per update and in-flight depth from the client's side equal what the pool's telemetry says, every time."""
    watched = watching(sdk)
    for run in range(10):
        clients = {name: watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=run).result()
                   for name in SHAPES}
        in_threads({name: functools.partial(SHAPES[name][0], clients[name]) for name in SHAPES})
        # a lane each: the clients of one ServiceClient share a session, not a label
        infos = watcher_of(watched).telemetry.all_clients()
        assert len({infos[tc.model_id].label for tc in clients.values()}) == len(clients), infos
        mine = watcher_of(watched).diagnose()
        theirs = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)
        for name, tc in clients.items():
            pool_id = server.clients()[tc.model_id]
            d, p = mine[tc.model_id], theirs[pool_id]
            assert (d.cause, p.cause) == (name, name), (run, name, d.evidence, p.evidence)
            records = [r for r in watcher_of(watched).records() if r.client_id == tc.model_id]
            depth = in_flight_depth(pool.telemetry.requests_of(pool_id))
            assert in_flight_depth(records) == depth == (SHAPES[name][1] or depth), (run, name)
            if name != "stall":  # a stall costs time, not round trips: the pool counts it in cycles
                assert d.round_trips_per_update == p.cycles_per_update / 2, (run, name, d, p)
                assert d.in_flight == depth, d
            assert "server's cycle boundaries" in d.unknown and "server's cycle boundaries" in d.evidence
            assert d.cause == "pipelined" or d.wasted


def busy_loop_batches(n: int, cpu_s: float):
    """A loader whose Python holds the interpreter `cpu_s` seconds per batch (in the loop's thread)."""
    for i in range(n):
        start, x = time.perf_counter(), 0
        while time.perf_counter() - start < cpu_s:
            x += 1
        yield [datum(i)]


def test_a_gil_heavy_loader_is_named_gil_by_the_watcher_and_the_pool_every_time(sdk, server, pool, watching):
    """The pool is served from this process (a notebook serving its room, training there too): a
    loader's Python starves the pool's clock and the SDK's threads alike. Ten runs: the watcher says
    gil, naming the loader, from its own watchdog and the client-side records; the pool says the same
    from its cycles."""
    watched = watching(sdk)
    pool.min_cycle_s = 0.03  # as test_advisor's GIL runs: the loader's batch spans cycles
    try:
        # a loop without the loader first: the SDK's first calls on a new watcher's clients (its own
        # Python, called from this function) are not the loader's
        warm = watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=99).result()
        pipelined(warm, n=4)
        outcomes = []
        for run in range(10):
            tc = watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=run).result()
            previous = None
            for batch in busy_loop_batches(12, cpu_s=0.15):
                current = (tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM))
                if previous is not None:
                    previous[0].result(timeout=120)
                    previous[1].result(timeout=120)
                previous = current
            previous[1].result(timeout=120)
            mine = watcher_of(watched).diagnose()[tc.model_id]
            theirs = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[server.clients()[tc.model_id]]
            outcomes.append((mine.cause, mine.gil_frames[0].function if mine.gil_frames else None,
                             theirs.cause, theirs.gil_frames[0].function if theirs.gil_frames else None,
                             mine.evidence, mine.message))
    finally:
        pool.min_cycle_s = serve_tests.CYCLE_S
    # both say gil every time, and each names the loader in at least 9 of 10 (a stall is sampled where
    # its holder is at that moment: CI once saw the watcher name the test's loop, which calls the
    # loader, in one run; the pool named the loader there)
    assert [(o[0], o[2]) for o in outcomes] == [("gil", "gil")] * 10, outcomes
    for side in (1, 3):  # the names first: a failure shows each run's
        # (a text, which pytest shows whole: a tuple's repr is cut after a few names)
        assert sum(o[side] == "busy_loop_batches" for o in outcomes) >= 9, f"{[o[side] for o in outcomes]}: {outcomes}"
    assert all("your Python held the interpreter" in o[5] for o in outcomes)
    assert sum("busy_loop_batches" in o[5] for o in outcomes) >= 9


def test_sync_await_and_async_styles_and_samplers_are_recorded(sdk, fast, watching):
    watched = watching(sdk)
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
        prompt, params = tt.ModelInput.from_ints([5, 6, 7]), tt.SamplingParams(max_tokens=3, seed=1)
        both = await asyncio.gather(sampler.sample(prompt, 2, params), sampler.compute_logprobs(prompt))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            again = await sampler.sample_async(prompt, 2, params)
        return both[0], again

    samples, again = asyncio.run(loop())
    assert len(samples.sequences) == 2 and [s.tokens for s in again.sequences] == [s.tokens for s in samples.sequences]
    records = watcher.records()
    assert [(r.op, r.waited_by, r.status) for r in records] == [
        ("forward_backward", "result", "ok"), ("optim_step", "result", "ok"), ("forward_backward", "await", "ok"),
        ("optim_step", "await", "ok"), ("save_weights_for_sampler", "await", "ok"), ("sample", "await", "ok"),
        ("compute_logprobs", "await", "ok"),
        ("sample", "async", "ok")]
    sampler_info = watcher.telemetry.client_info(records[-1].client_id)
    assert sampler_info.kind == "sampling" and sampler_info.parent == tc.model_id
    assert all(r.delivered_at is not None and r.finished_at == r.delivered_at for r in records)

    # exports: a bar per request (submitted -> result) with when the loop asked; in-flight counters;
    # metrics rows with the loss per weighted token
    trace = watcher.chrome_trace()
    bars = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "gil"]
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
    assert not watcher_of(w).watchdog.thread.is_alive()  # its GIL watchdog stopped with it
    w.forward_backward([datum(3)], "cross_entropy").result(timeout=60)  # passes through, unrecorded
    assert len(watcher_of(w).records()) == 2
    after = {cls: dict(vars(cls)) for cls in classes}
    for cls in classes:
        assert after[cls].keys() == before[cls].keys(), cls
        assert all(after[cls][k] is before[cls][k] for k in before[cls]), cls
    assert vars(tc).keys() == instance.keys() and all(vars(tc)[k] is v for k, v in instance.items()
                                                     if k != "_request_id_counter" and k != "_turn_counter")


def test_what_it_cannot_watch_is_refused_clearly(sdk, monkeypatch, watching):
    with pytest.raises(UnsupportedSDKError, match="official SDKs' clients"):
        watch(object())
    with pytest.raises(UnsupportedSDKError, match="official SDKs' clients"):
        watch(trio.AdamParams(learning_rate=1e-3))
    monkeypatch.setitem(SUPPORTED_SDKS, "tinker", ("0.0.1",))
    with pytest.raises(UnsupportedSDKError, match=r"checked against tinker 0\.0\.1, not the installed 0\.38\.0.*"
                                                  r"check_version=False"):
        watch(sdk)
    watched = watching(sdk, check_version=False)
    with pytest.raises(UnsupportedSDKError, match="already watched"):
        watch(watched)


def _loop(shape: str, n: int = 8, rt: float = 1.0) -> list[WatchedRequest]:
    """Client-side records of a loop of `shape` whose every request takes `rt` seconds to come back."""
    records: list[WatchedRequest] = []
    t = 0.0

    def req(op: str, at: float) -> WatchedRequest:
        r = WatchedRequest(len(records) + 1, "c", op, queued_at=at, status="ok", started_at=at)
        r.finished_at = r.delivered_at = at + rt
        records.append(r)
        return r

    for k in range(n):
        if shape == "naive":
            fb = req("forward_backward", t)
            t = req("optim_step", fb.delivered_at + 0.01).delivered_at + 0.01
        elif shape == "together":
            req("forward_backward", t)
            t = req("optim_step", t + 0.001).delivered_at + 0.01
        else:  # pipelined, one update ahead: update k+1 goes out when update k-1 is back
            at = 0.5 * k if k < 2 else records[2 * (k - 2) + 1].delivered_at + 0.01
            req("forward_backward", at)
            req("optim_step", at + 0.001)
    return records


@pytest.mark.parametrize("shape, trips, depth", [("naive", 2, 1), ("together", 1, 2), ("pipelined", 0.5, 4)])
def test_shapes_from_records_alone(shape, trips, depth):
    d = diagnose_watched(_loop(shape))["c"]
    assert (d.cause, d.round_trips_per_update, d.in_flight) == (shape, trips, depth), d
    assert diagnose_watched(_loop(shape, n=2))["c"].cause == "warming-up"
    # a mode change shows within 3 updates: 8 together updates, then pipelined ones
    late = [WatchedRequest(r.request_id + 100, "c", r.op, queued_at=r.queued_at + 100, status="ok",
                           started_at=r.queued_at + 100) for r in _loop("pipelined", n=4)]
    for r in late:
        r.finished_at = r.delivered_at = r.queued_at + 1.0
    assert diagnose_watched(_loop("together") + late)["c"].cause == "pipelined"


def test_a_future_of_a_client_is_watched_as_the_client_it_becomes(sdk, fast, watching):
    future = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=10)
    watched = watching(future)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # watching it reads nothing deprecated
        tc = watched.result(timeout=60)
    assert unwatch(tc) is future.result()
    watched = watching(future)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the SDK's deprecated "future as the client"
        watched.forward_backward([datum(4)], "cross_entropy").result(timeout=60)
    sampler = watched.result().save_weights_and_get_sampling_client()
    sampler.sample(tt.ModelInput.from_ints([5, 6]), 1, tt.SamplingParams(max_tokens=2, seed=0)).result(timeout=60)
    assert [r.op for r in watcher_of(watched.result()).records()] == ["forward_backward", "save_weights_for_sampler",
                                                                    "sample"]


def test_a_dashboard_watches_the_sdk_loop_from_its_side(sdk, fast, watching, tmp_path):
    """trio.Dashboard(watch=...): a lane per client with a bar per request, requests in flight, the
    watcher's diagnosis with what it cannot know, its exports; no Start runs; unwatch ends it."""
    watched = watching(sdk)
    dash = trio.Dashboard(watch=watched, export_dir=tmp_path)
    try:
        assert dash.state == "watching" and "seen from this process" in dash._header.value
        tc = watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=11).result()
        pipelined(tc, n=8)
        wait_for(lambda: tc.model_id in dash.diagnoses and dash.diagnoses[tc.model_id].cause == "pipelined",
                 "the dashboard's diagnosis", timeout=30)
        # (the line is rewritten at most every second while its state stays the same)
        wait_for(lambda: "in flight <b>0</b> · updates <b>8</b>" in dash.status_text, "the status line", timeout=10)
        assert "0.5</b> round trips/update" in dash.status_text, dash.status_text
        assert "server&#x27;s cycle boundaries" in dash._advisor_w.value
        figs = dash._figs
        assert tc.model_id in figs.clients and figs.timeline.title.text.startswith("Requests seen from the client")
        wait_for(lambda: len(figs.bars.data["op"]) == 16, "a bar per request", timeout=10)
        assert max(max(figs.queue.data[k], default=0) for k in figs.queue.data if k != "t") == 4  # in flight
        assert figs.loss_points(tc.model_id) == 8  # a loss per update, from the returned metrics
        dash.start()
        wait_for(lambda: any("your loop trains" in n for n in dash.notices), "Start's notice", timeout=10)
        trace = json.loads(open(dash.export_trace()).read())
        assert any(e.get("ph") == "C" and e["name"].startswith("in flight ") for e in trace["traceEvents"])
        assert [r["step"] for r in map(json.loads, open(dash.export_metrics()).read().splitlines())] == list(
            range(1, 9))
        unwatch(watched)
        wait_for(lambda: any("watching stopped" in n for n in dash.notices), "its notice once unwatched", timeout=10)
        assert dash.pool_state == "closed" and "closed" in dash.status_text
    finally:
        dash.close()
    with pytest.raises(ValueError, match="not both"):
        trio.Dashboard("http://127.0.0.1:9", watch=watched)
    with pytest.raises(TypeError, match=r"watch= takes what trio.watch\(client\) returned"):
        trio.Dashboard(watch=sdk)


OBSERVER = "tml-watch-observer"


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    """A real `python -m trio_widgets serve` (the pool in another process, as a room's or a hosted
    service's is), with the served pool's cycle of these tests; yields its URL."""
    with serving_process(tmp_path_factory.mktemp("watch-serve"), keys=serve_tests.KEY, min_cycle_s=serve_tests.CYCLE_S,
                       observers=OBSERVER) as (url, _):
        yield url


def test_against_a_serve_process_the_watchers_diagnosis_is_the_pools(serve_process, monkeypatch):
    """The pool in its own process: the oracle is its telemetry as a remote dashboard mirrors it
    (trio.Dashboard(url)). Ten runs of the three shapes and a stalled loop, a session each (its
    lane is labelled by the session): cause, round trips per update and requests in flight agree."""
    from served import tinker_env

    from trio_widgets.http.remote import RemotePool

    tinker_env(monkeypatch)
    remote = RemotePool(serve_process, api_key=OBSERVER)  # (a participant's key may not watch the pool)
    services = {name: tinker.ServiceClient(base_url=serve_process, api_key=serve_tests.KEY) for name in SHAPES}
    watcher = Watcher()
    try:
        for run in range(10):
            clients = {name: watch(services[name], watcher=watcher).create_lora_training_client(
                base_model=trio.DEFAULT_MODEL, rank=4, seed=run).result() for name in SHAPES}
            in_threads({name: functools.partial(SHAPES[name][0], clients[name]) for name in SHAPES})
            mine = watcher.diagnose()

            def mirrored(clients=clients) -> bool:  # every request of the run, as the pool delivered it
                lanes = _lanes(remote, clients)
                return len(lanes) == len(clients) and all(
                    sum(r.delivered_at is not None for r in remote.telemetry.requests_of(lanes[name]))
                    == sum(r.client_id == tc.model_id for r in watcher.records()) for name, tc in clients.items())

            wait_for(mirrored, "the mirror to hold the run", 30)
            theirs = diagnose_telemetry(remote.telemetry, remote.min_cycle_s)
            lanes = _lanes(remote, clients)
            for name, tc in clients.items():
                d, p = mine[tc.model_id], theirs[lanes[name]]
                assert (d.cause, p.cause) == (name, name), (run, name, d.evidence, p.evidence)
                records = [r for r in watcher.records() if r.client_id == tc.model_id]
                depth = in_flight_depth(remote.telemetry.requests_of(lanes[name]))
                assert in_flight_depth(records) == depth == (SHAPES[name][1] or depth), (run, name)
                if name != "stall":
                    assert d.round_trips_per_update == p.cycles_per_update / 2, (run, name, d, p)
    finally:
        watcher.close()
        remote.close()
        for sc in services.values():
            sc.close("success").result(timeout=60)


def _lanes(remote, clients) -> dict[str, str]:
    """Each shape's client -> its lane in the served pool: the newest training lane of its session."""
    infos = remote.telemetry.all_clients()
    out = {}
    for name, tc in clients.items():
        session = tc.model_id.split(":")[0][:13]
        mine = [cid for cid, info in infos.items() if info.kind == "training" and info.label.startswith(session)]
        if mine:
            out[name] = mine[-1]
    return out
