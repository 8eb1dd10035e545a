"""Faults stay with whoever caused them: user code that raises anything (SystemExit
included) or blocks never stops the pool's clock or touches a neighbour, and close() always
ends with no clock thread and no pending future, or says exactly what is still running."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from conftest import random_batch
from transports import adapter_of, service
from transports import queued as wait_queued

import trio_widgets as trio
from trio_widgets.validation import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS

ADAM = trio.AdamParams(learning_rate=1e-2)
BATCH = random_batch(31, n=2, length=12)
ESCAPES = [SystemExit(3), KeyboardInterrupt(), GeneratorExit()]


def ticks_on(pool: trio.LocalPool, cycles: int = 3) -> None:
    """The clock keeps taking boundaries and a fresh client still trains (bounded wait)."""
    before = pool.cycle_index
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=1)
    assert tc.forward_backward(BATCH).result(timeout=60).metrics["loss:sum"] > 0
    deadline = time.monotonic() + 30
    while pool.cycle_index < before + cycles and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.cycle_index >= before + cycles and not pool.closed and pool.failure is None
    tc.close()


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: type(e).__name__)
def test_a_done_callback_cannot_stop_the_clock(pool, svc, escape):
    """(Over HTTP the callbacks run on the client's delivery thread: it goes on too.)"""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    fut = tc.forward_backward(BATCH)
    ran = threading.Event()

    def raiser(_f):
        ran.set()
        raise escape

    fut.add_done_callback(raiser)
    fut.future().add_done_callback(raiser)  # the raw concurrent future too (tinker's future())
    fut.result(timeout=60)
    assert ran.wait(30)
    ticks_on(pool)
    assert tc.forward_backward(BATCH).result(timeout=60).metrics["loss:sum"] > 0  # its own client goes on


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: type(e).__name__)
def test_a_telemetry_subscriber_cannot_stop_the_clock(pool, escape):
    def subscriber(event):
        raise escape

    unsubscribe = pool.telemetry.subscribe(subscriber)
    try:
        ticks_on(pool)
    finally:
        unsubscribe()


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: type(e).__name__)
def test_a_custom_loss_that_raises_anything_fails_only_its_request(pool, svc, escape):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)

    def loss(data, logprobs):
        raise escape

    with pytest.raises(trio.RequestFailedError, match=f"your loss function raised {type(escape).__name__}") as info:
        tc.forward_backward_custom(BATCH, loss).result(timeout=60)
    assert info.value.client_id == tc.client_id
    # the client-side thread survived: the next custom loss runs
    ok = tc.forward_backward_custom(BATCH, lambda d, lps: (sum(-lp.sum() for lp in lps), {"n": 1}))
    assert ok.result(timeout=60).metrics["n"] == 1.0
    ticks_on(pool)


@pytest.mark.parametrize("make_loss,what", [
    (lambda lps: torch.stack([-lp.sum() for lp in lps]), "a loss of shape [2], not a scalar"),
    (lambda lps: -lps[0], "a loss of shape [12], not a scalar"),
    (lambda lps: float(-lps[0].sum().detach()), "its loss is a float"),
], ids=["per-datum vector", "per-token vector", "float"])
def test_a_custom_loss_that_is_not_a_scalar_fails_its_request_naming_the_shape(pool, svc, make_loss, what):
    """tinker's backward() refuses a loss that is not one element; it is never summed for the user."""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    with pytest.raises(trio.RequestFailedError, match="forward_backward_custom: your loss function") as info:
        tc.forward_backward_custom(BATCH, lambda d, lps: (make_loss(lps), {})).result(timeout=60)
    assert what in str(info.value) and "raised" not in str(info.value)
    ok = tc.forward_backward_custom(BATCH, lambda d, lps: (sum(-lp.sum() for lp in lps), {"n": 1}))
    assert ok.result(timeout=60).metrics["n"] == 1.0  # the client goes on


@pytest.mark.parametrize("metrics,what", [({"m": "abc"}, "'m' = 'abc'"), ({"m": [1, 2]}, "'m' = [1, 2]"),
                                          ({"m": torch.ones(3)}, "'m' = tensor"), ("oops", "of type str")])
def test_custom_metrics_that_are_not_numbers_fail_only_that_tenant(pool, svc, metrics, what):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    neighbour = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=5)
    with pool.hold():
        bad = tc.forward_backward_custom(BATCH, lambda d, lps: (sum(-lp.sum() for lp in lps), metrics))
        fine = neighbour.forward_backward(BATCH)
        saved = neighbour.save_state("after-neighbour")
    with pytest.raises(trio.RequestFailedError, match="not a number|return a dict of numbers") as info:
        bad.result(timeout=60)
    assert what in str(info.value) and info.value.client_id == tc.client_id
    assert fine.result(timeout=60).metrics["loss:sum"] > 0
    path = saved.result(timeout=60).path  # a state op in the same cycle is reported as it happened
    assert pool.checkpoint_path(path).is_dir()


def test_result_inside_a_done_callback_raises_instead_of_freezing_the_clock(pool, svc):
    """(Over HTTP the thread that delivers results would wait for itself just the same.)"""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    seen: list[BaseException] = []
    with pool.hold():
        first = tc.forward_backward(BATCH)
        later = tc.optim_step(ADAM)  # same cycle, delivered after `first`
        wait_queued(pool, 2)

        def wait_for_later(_f):
            try:
                later.result()
            except BaseException as exc:
                seen.append(exc)

        first.add_done_callback(wait_for_later)
    first.result(timeout=60)
    later.result(timeout=60)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and "wait for itself" in str(seen[0])
    ticks_on(pool)


def test_nested_holds_on_one_thread(pool):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    other = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=1)
    with pool.hold():
        a = tc.forward_backward(BATCH)
        with pool.hold():
            b = other.forward_backward(BATCH)
    assert a.result(timeout=60) and b.result(timeout=60) and a.cycle == b.cycle


def test_close_inside_hold_stops_at_once_and_fails_what_was_queued(transport):
    pool = trio.LocalPool(min_cycle_s=0.0, name="hold-close")
    with service(transport, pool) as svc:
        _close_inside_hold(pool, svc)


def _close_inside_hold(pool: trio.LocalPool, svc: trio.ServiceClient) -> None:
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    clock = pool._clock.thread
    with pool.hold():
        queued = tc.forward_backward(BATCH)
        wait_queued(pool, 1)
        pool.close(timeout=30)  # would block on the held boundary before; now the clock sees it is closing
        assert not clock.is_alive()
    with pytest.raises(trio.PoolClosedError, match="never ran"):
        queued.result(timeout=5)


def test_close_says_what_a_blocked_clock_is_doing_then_it_finishes():
    pool = trio.LocalPool(min_cycle_s=0.0, name="blocked")
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    release = threading.Event()
    entered = threading.Event()
    fut = tc.forward_backward(BATCH)

    def block(_f):
        entered.set()
        release.wait(60)  # a user's callback that blocks the thread delivering results

    fut.add_done_callback(block)
    assert entered.wait(60)
    queued = tc.optim_step(ADAM)
    with pytest.raises(TimeoutError, match="delivering the results of cycle .* done-callbacks"):
        pool.close(timeout=0.5)
    assert pool.closed
    with pytest.raises(trio.PoolClosedError):
        queued.result(timeout=5)  # what never ran fails at once
    release.set()
    pool._clock.thread.join(30)
    assert not pool._clock.thread.is_alive() and fut.result(timeout=5)


def test_a_clock_that_dies_says_so_and_fails_what_it_cannot_run(monkeypatch):
    """Only an engine bug can kill the clock (user code is fenced off); if one does, the pool
    does not pretend to be open: queued requests fail and submits say why."""
    from trio_widgets.engine import handlers

    def broken(pool, tenant, request):
        raise SystemExit("a bug in the engine")

    monkeypatch.setitem(handlers.HANDLERS, "inspect", handlers.OpHandlers(handlers.prepare_inspect, broken))
    with trio.LocalPool(min_cycle_s=0.0, name="dies") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        with pool.hold():
            doomed = tc.inspect_adapter()
            queued = tc.forward_backward(BATCH)
        for taken_with_it in (doomed, queued):  # both were in the cycle that broke
            with pytest.raises(trio.PoolClosedError, match="died while running this request"):
                taken_with_it.result(timeout=60)
        pool._clock.thread.join(30)
        assert pool.closed and isinstance(pool.failure, SystemExit)
        with pytest.raises(trio.PoolClosedError, match="clock thread died"):
            tc.forward_backward(BATCH)


def test_limits_are_enforced_at_submit_and_configurable(transport):
    with trio.LocalPool(min_cycle_s=0.0, name="limits", max_request_data=4, max_request_tokens=100,
                        max_num_samples=8, max_sampled_tokens=64) as pool, service(transport, pool) as svc:
        tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        sc = tc.save_weights_and_get_sampling_client()
        prompt = trio.ModelInput.from_ints([5, 6, 7])
        cases = [
            (lambda: tc.forward_backward(random_batch(1, n=5, length=4)), "has 5 data", "max_request_data", "data"),
            (lambda: tc.forward_backward(random_batch(1, n=4, length=30)), "has 120 tokens", "max_request_tokens",
             "data"),
            (lambda: sc.sample(prompt, 9, trio.SamplingParams(max_tokens=1)), "9 is more than", "max_num_samples",
             "num_samples"),
            (lambda: sc.sample(prompt, 8, trio.SamplingParams(max_tokens=9)), "num_samples × max_tokens = 72",
             "max_sampled_tokens", "sampling_params.max_tokens"),
        ]
        for call, text, setting, field in cases:
            with pytest.raises(trio.InvalidInputError) as info:
                call()
            assert text in str(info.value) and setting in str(info.value) and info.value.field == field
        assert not any(pool.queue_depths().values())  # nothing queued by a refusal
        assert tc.forward_backward(random_batch(1, n=4, length=24)).result(timeout=60)  # within the limits


@pytest.mark.parametrize("kwargs,text", [
    (dict(min_cycle_s=float("inf")), "min_cycle_s must be a number of seconds from 0 to 3600"),
    (dict(min_cycle_s="0.1"), "got '0.1'"),
    (dict(min_cycle_s=-1), "got -1"),
    (dict(max_samples_per_cycle=0), "max_samples_per_cycle must be an integer >= 1"),
    (dict(max_request_tokens=1.5), "max_request_tokens must be an integer >= 1"),
    (dict(torch_threads=0), "torch_threads must be"),
    (dict(torch_threads="all"), "torch_threads must be"),
    (dict(name=7), "name must be a string"),
])
def test_bad_pool_settings_are_refused_before_anything_starts(kwargs, text):
    before = {t for t in threading.enumerate() if t.name.startswith("trio-clock-")}
    with pytest.raises(ValueError, match=text):
        trio.LocalPool(**kwargs)
    assert {t for t in threading.enumerate() if t.name.startswith("trio-clock-")} == before


def test_odd_sampling_settings_fail_alone_or_not_at_all(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    sc = tc.save_weights_and_get_sampling_client()
    prompt = trio.ModelInput.from_ints([5, 6, 7])
    params = trio.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    alone = sc.sample(prompt, 2, params).result(timeout=60)
    with pytest.raises(trio.InvalidInputError, match="not valid text") as info:
        sc.sample(prompt, 1, trio.SamplingParams(max_tokens=2, stop="\udcff"))
    assert info.value.field == "sampling_params.stop"
    with pool.hold():  # a top_k beyond the vocabulary keeps every token; the neighbour is unaffected
        huge = sc.sample(prompt, 1, trio.SamplingParams(max_tokens=4, top_k=2 ** 63, seed=9))
        neighbour = sc.sample(prompt, 2, params)
    assert len(huge.result(timeout=60).sequences[0].tokens) == 4
    assert [s.tokens for s in neighbour.result(timeout=60).sequences] == [s.tokens for s in alone.sequences]


def test_load_and_save_results_are_reported_as_they_happened(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    tc.forward_backward(BATCH)
    tc.optim_step(ADAM).result(timeout=60)
    path = tc.save_state("truth").result(timeout=60).path
    other = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=9)
    with pool.hold():
        loaded = other.load_state(path)
        bad = other.forward_backward_custom(BATCH, lambda d, lps: (sum(-lp.sum() for lp in lps), {"m": "x"}))
    assert loaded.result(timeout=60).path == path  # ran and reported so, whatever its neighbours did
    with pytest.raises(trio.RequestFailedError):
        bad.result(timeout=60)
    assert all(torch.equal(v, adapter_of(svc, pool, tc)[k]) for k, v in adapter_of(svc, pool, other).items())


def test_numpy_scalars_are_numbers(pool, svc):
    import numpy as np

    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    tc.forward_backward(BATCH)
    step = tc.optim_step(trio.AdamParams(learning_rate=np.float32(1e-3), beta2=np.float64(0.99))).result(timeout=60)
    assert step.metrics["learning_rate:mean"] == pytest.approx(1e-3, rel=1e-6)  # float32(1e-3) as a float


def _stop_flood(count: int, length: int) -> list[str]:
    """`count` stop strings of `length` characters that never match: a snowman run (3 bytes each,
    which the byte model does not emit in a row), each ending in a different common character."""
    ends = " etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ0123456789.,;:!?"
    return ["\u2603" * (length - 1) + ends[i % len(ends)] for i in range(count)]


def test_a_flood_of_stop_strings_at_the_limit_does_not_slow_a_neighbour(pool):
    """Issue 22: the issue's flood (1 MB of stop strings, which took a neighbour's update from
    0.1 s to 8.4 s) is refused at submit, naming the field; a sample request with the most stop
    strings the limits allow, sharing cycles with a neighbour's update, stretches that update at
    most 2× over the same sample request without stop strings (measured side by side,
    interleaved, in this run)."""
    neighbour = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=5)
    sc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=6
                                                              ).save_weights_and_get_sampling_client().result()
    prompt = trio.ModelInput.from_ints([3 + b for b in b"The cat "])
    floods = {"longest": _stop_flood(MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS, MAX_STOP_STRING_CHARS),
              "most": _stop_flood(MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS // MAX_STOP_STRINGS)}

    depth = pool.queue_depths()
    with pytest.raises(trio.InvalidInputError, match="limit") as info:
        sc.sample(prompt, 1, trio.SamplingParams(max_tokens=8, stop=[f"{i:09d}\n" for i in range(100_000)]))
    assert info.value.field == "sampling_params.stop" and pool.queue_depths() == depth

    def update_beside(stop: list[str] | None, seed: int) -> float:
        """Wall time of the neighbour's forward_backward + optim_step, submitted in the cycle of
        the sample request."""
        with pool.hold():
            sampled = sc.sample(prompt, 16, trio.SamplingParams(max_tokens=48, temperature=1.0, seed=seed, stop=stop))
            start = time.perf_counter()
            fb = neighbour.forward_backward(BATCH)
            step = neighbour.optim_step(ADAM)
        fb.result(timeout=120)
        step.result(timeout=120)
        took = time.perf_counter() - start
        assert all(s.stop_reason == "length" for s in sampled.result(timeout=120).sequences)  # the same work
        return took

    times: dict[str, list[float]] = {"quiet": [], **{name: [] for name in floods}}
    update_beside(None, 0)  # warm-up
    for seed in range(5):  # interleaved, so a busy machine slows all of them alike
        times["quiet"].append(update_beside(None, seed))
        for name, stop in floods.items():
            assert sum(map(len, stop)) <= MAX_STOP_TOTAL_CHARS
            times[name].append(update_beside(stop, seed))
    quiet = statistics.median(times["quiet"])
    for name in floods:
        assert statistics.median(times[name]) < 2 * quiet, (name, times)
    ticks_on(pool)
