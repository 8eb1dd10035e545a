"""trio.watch on the clients besides tinker's (issue 26): trio's own and pytrio 0.2.9's, on an
in-process pool, whose own telemetry is the oracle: each request the loop sent is one record on
each side, and the loop's shape, round trips per update (half the pool's cycles per update) and
requests in flight are the same. (tests/test_watch_trio.py: trio's own client in tinker's
`.result()` style and pytrio's "use what create_* returned" style; here the asyncio style and
pytrio's own classes.)

pytrio's client cannot reach a trio pool, served or not: its ServiceClient first verifies its key
with pytrio's control plane (`GET /openapi/v1/api-key/verify`; then service sessions and training
runs there) and trains through actor endpoints in msgpack events (`v1/events`), none of which
`serve` answers (404 no_endpoint). What a watcher relies on is pytrio's client classes (which SDK
and version; clients made directly, not futures; `training_run_cuid` naming the run, `model_id` the
base model) and its APIFuture (`result`, `await`, `map`; no `.future()`, no done-callback). So the
pytrio clients here are pytrio's own classes made without their constructor (which would log in),
their transport replaced by the pool: each op hands back pytrio's public APIFuture wrapping the
pool's concurrent future, as pytrio's coordinator hands back one wrapping its actor's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import sys
from collections import Counter

import pytest
from conftest import random_batch
from served import in_threads
from test_watch_trio import naive, pipelined, together

import trio_widgets as trio
from trio_widgets.advisor import diagnose_telemetry
from trio_widgets.watch import SUPPORTED_SDKS, WatchedFuture, in_flight_depth, unwatch, watch, watcher_of

if sys.version_info < (3, 11):
    pytest.skip("pytrio 0.2.9 is installed for Python >= 3.11 only (the dev extra)", allow_module_level=True)

_hook = sys.excepthook
pytrio = pytest.importorskip("pytrio", reason="pytrio==0.2.9 is not installed: pip install -e '.[dev]'")
sys.excepthook = _hook  # importing pytrio installs its own hook; leave the test process as it was
import pytrio.types as pt  # noqa: E402

# `make test` runs it alone, with no test beside it: it counts the cycles each loop shape takes, and
# a round trip on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone
ADAM = trio.AdamParams(learning_rate=1e-3)
BATCH = random_batch(0, n=1, length=8)
PROMPT = trio.ModelInput.from_ints([3 + b for b in b"The cat "])
CYCLE_S = 0.1  # tests/test_loop.py's: a client in this process always reacts within one cycle


# -- pytrio's classes, the pool behind them ----------------------------------------------------

def _pytrio(cls: type, **attributes) -> object:
    """An instance of pytrio's `cls`, made without its constructor (which logs in to pytrio's
    control plane), with `attributes` (its public ones; the ops, bound to the pool)."""
    client = object.__new__(cls)
    vars(client).update(attributes)
    return client


def _answer(trio_future) -> pt.APIFuture:
    """pytrio's APIFuture of a request the pool runs (it wraps a concurrent future, as pytrio's own)."""
    return pt.APIFuture(trio_future.future())


def pytrio_sampling(sc: trio.SamplingClient):
    return _pytrio(pytrio.SamplingClient, sampling_run_cuid=sc.sampling_run_cuid, model_id=sc.model_id,
                   sample=lambda prompt, num_samples=1, sampling_params=None, *a, **k:
                   _answer(sc.sample(prompt, num_samples, sampling_params or trio.SamplingParams(max_tokens=4))))


def pytrio_training(tc: trio.TrainingClient):
    """pytrio's TrainingClient for `tc`'s run: `training_run_cuid` its id, `model_id` the base model
    (as pytrio names them), its training ops answering pytrio's futures."""
    return _pytrio(
        pytrio.TrainingClient, training_run_cuid=tc.model_id, model_id=trio.DEFAULT_MODEL,
        forward_backward=lambda data, loss_fn="cross_entropy", loss_fn_config=None:
            _answer(tc.forward_backward(data, loss_fn, loss_fn_config)),
        optim_step=lambda adam_params: _answer(tc.optim_step(adam_params)),
        # pytrio's: the save done and the sampler made before it returns (client/training.py:1092-1109)
        save_weights_and_get_sampling_client=lambda:
            pytrio_sampling(tc.save_weights_and_get_sampling_client().result()))


def pytrio_service(service: trio.ServiceClient, lanes: dict[str, str]):
    """pytrio's ServiceClient: create_lora_training_client returns the client itself (no future);
    `lanes`: each run's cuid -> its lane in the pool, filled as they are made."""
    def create_lora_training_client(base_model, rank=32, seed=None, **kwargs):
        tc = service.create_lora_training_client(base_model, rank=rank, seed=seed).result()
        lanes[tc.model_id] = tc.client_id
        return pytrio_training(tc)

    return _pytrio(pytrio.ServiceClient, create_lora_training_client=create_lora_training_client)


def target_of(watched):
    """The object a watched client stands for (without stopping its watcher)."""
    return object.__getattribute__(watched, "_target")


# -- the loop shapes of tests/served.py, one client each --------------------------------------

# (naive, together, pipelined: test_watch_trio's, written as pytrio's quickstart writes them)


async def naive_async(tc, n=5):  # the asyncio style: await the *_async submit, then the future
    for _ in range(n):
        await (await tc.forward_backward_async(BATCH))
        await (await tc.optim_step_async(ADAM))


async def together_async(tc, n=6):
    for _ in range(n):
        fb = await tc.forward_backward_async(BATCH)
        opt = await tc.optim_step_async(ADAM)
        await fb
        await opt


async def pipelined_async(tc, n=8):
    previous = None
    for _ in range(n):
        current = (await tc.forward_backward_async(BATCH), await tc.optim_step_async(ADAM))
        if previous is not None:
            await previous[0]
            await previous[1]
        previous = current
    await previous[0]
    await previous[1]


# the loop (sync, asyncio), its round trips per update and requests in flight
SHAPES = {"naive": (naive, naive_async, 2, 1), "together": (together, together_async, 1, 2),
          "pipelined": (pipelined, pipelined_async, 0.5, 4)}


def _agree(pool: trio.LocalPool, watcher, clients: dict[str, tuple[str, str]]) -> None:
    """Each shape's client (its id in the watcher, its lane in the pool): the watcher's view is the pool's."""
    mine = watcher.diagnose()
    theirs = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)
    for name, (watched_id, lane) in clients.items():
        d, p = mine[watched_id], theirs[lane]
        records = [r for r in watcher.records() if r.client_id == watched_id]
        pooled = pool.telemetry.requests_of(lane)
        assert Counter(r.op for r in records) == Counter(r.op for r in pooled), name
        assert all(r.status == "ok" and r.delivered_at is not None for r in records), name
        _, _, trips, depth = SHAPES[name]
        assert (d.cause, p.cause) == (name, name), (name, d.evidence, p.evidence)
        assert d.round_trips_per_update == p.cycles_per_update / 2 == trips, (name, d, p)
        assert d.in_flight == in_flight_depth(records) == in_flight_depth(pooled) == depth, name


def test_trios_own_client_in_the_asyncio_style_agrees_with_the_pool_exactly():
    with trio.LocalPool(min_cycle_s=CYCLE_S, name="watch-asyncio") as pool:
        service = watch(trio.ServiceClient(pool))
        watcher = watcher_of(service)
        try:
            made = {name: service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i).result()
                    for i, name in enumerate(SHAPES)}
            in_threads({name: functools.partial(asyncio.run, SHAPES[name][1](tc)) for name, tc in made.items()},
                       timeout=120)
            assert {r.waited_by for r in watcher.records() if r.op in ("forward_backward", "optim_step")} == {"await"}
            _agree(pool, watcher, {name: (tc.model_id, tc.client_id) for name, tc in made.items()})
        finally:
            client = unwatch(service)
        assert isinstance(client, trio.ServiceClient) and not watcher.watchdog.thread.is_alive()


def test_pytrios_clients_and_futures_watched_agree_with_the_pool_exactly():
    assert SUPPORTED_SDKS["pytrio"] == (pytrio._version.__version__,)
    with trio.LocalPool(min_cycle_s=CYCLE_S, name="watch-pytrio") as pool:
        lanes: dict[str, str] = {}
        sdk = pytrio_service(trio.ServiceClient(pool), lanes)
        service = watch(sdk)
        watcher = watcher_of(service)
        try:
            # pytrio's style: the client itself, at once; each run named by its training_run_cuid
            made = {name: service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i)
                    for i, name in enumerate(SHAPES)}
            assert all(isinstance(target_of(tc), pytrio.TrainingClient) for tc in made.values())
            in_threads({name: functools.partial(SHAPES[name][0], tc) for name, tc in made.items()}, timeout=120)
            assert len({tc.training_run_cuid for tc in made.values()}) == 3  # (one model_id: the base model)
            _agree(pool, watcher, {name: (tc.training_run_cuid, lanes[tc.training_run_cuid])
                                   for name, tc in made.items()})
            # pytrio's save_weights_and_get_sampling_client: the sampler itself, the save recorded as done
            sampler = made["naive"].save_weights_and_get_sampling_client()
            assert isinstance(target_of(sampler), pytrio.SamplingClient)
            sampled = sampler.sample(PROMPT, 1)
            assert isinstance(sampled, WatchedFuture) and sampled.result().sequences
            records = [r for r in watcher.records() if r.op in ("save_weights_for_sampler", "sample")]
            assert [r.op for r in records] == ["save_weights_for_sampler", "sample"]
            assert all(r.status == "ok" and r.delivered_at is not None for r in records), records
        finally:
            client = unwatch(service)
        assert client is sdk and not watcher.watchdog.thread.is_alive()


def test_a_pytrio_future_is_timed_as_it_resolves_and_its_failure_when_the_loop_meets_it():
    """pytrio's APIFuture has no done-callback: the arrival of a result is learnt through its public
    `map` (the moment it resolves, asked for or not); a failure or cancellation when the loop meets it."""
    sources = [concurrent.futures.Future() for _ in range(4)]
    answers = iter(pt.APIFuture(f) for f in sources)
    tc = _pytrio(pytrio.TrainingClient, training_run_cuid="run-1", model_id=trio.DEFAULT_MODEL,
                 forward_backward=lambda data, loss_fn="cross_entropy": next(answers))
    watched = watch(tc)
    watcher = watcher_of(watched)
    try:
        ok, failed, cancelled, awaited = (watched.forward_backward(BATCH) for _ in range(4))
        assert all(isinstance(f, WatchedFuture) for f in (ok, failed, cancelled, awaited))
        assert watcher.in_flight() == {"run-1": 4}
        sources[0].set_result(pt.ForwardBackwardOutput(loss_fn_outputs=[], metrics={"loss_sum": 2.0}))
        assert ok.record.status == "ok" and ok.record.delivered_at is not None and ok.record.awaited_at is None
        assert ok.record.metrics["loss_sum"] == 2.0 and ok.result() is sources[0].result()
        sources[1].set_exception(ValueError("bad batch"))
        assert failed.record.delivered_at is None  # (pytrio says nothing of a failure until asked)
        with pytest.raises(TimeoutError):
            cancelled.result(timeout=0)  # a wait that timed out is no answer
        assert cancelled.record.delivered_at is None and cancelled.record.awaited_at is not None
        with pytest.raises(ValueError, match="bad batch"):
            failed.result()
        assert failed.record.status == "error" and "bad batch" in failed.record.error
        assert cancelled.cancel() and cancelled.done()  # pytrio's own cancel, through the proxy
        with pytest.raises(concurrent.futures.CancelledError):
            cancelled.result()
        assert cancelled.record.status == "cancelled"

        async def wait():  # pytrio's futures have no result_async: `await` awaits the future itself
            return await awaited

        sources[3].set_result(pt.ForwardBackwardOutput(loss_fn_outputs=[], metrics={}))
        assert asyncio.run(wait()) is sources[3].result() and awaited.record.waited_by == "await"
        assert watcher.in_flight() == {}
    finally:
        assert unwatch(watched) is tc


def test_unwatch_hands_back_the_identical_object():
    with trio.LocalPool(min_cycle_s=0.0, name="watch-unwatch") as pool:
        service = trio.ServiceClient(pool)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        sampler = service.create_sampling_client(base_model=trio.DEFAULT_MODEL)
        for client in (service, tc, sampler):
            watched = watch(client)
            assert watched is not client and unwatch(watched) is client
            assert watcher_of(watched).closed and not watcher_of(watched).watchdog.thread.is_alive()
        pt_client = pytrio_training(tc)
        watched = watch(pt_client)
        assert watched.training_run_cuid == tc.model_id and unwatch(watched) is pt_client
