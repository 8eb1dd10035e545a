"""trio's own client through every codec (conftest.py's transport: in-process, and over HTTP
to the same pool served on 127.0.0.1): the same loops, clock rules, resume, sampling and order.
Then what only the HTTP codec has: its sequencing of seq_ids, retries, threads and session, the
RestClient by URL, sampler handles, and which server a key may go to."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from conftest import random_batch
from served import (
    LossyProxy,
    adapter_file,
    check_three_loops,
    pairs_from_telemetry,
    same_tensors,
    served,
    spans_and_periods,
    three_loops,
    three_loops_async,
    wait_for,
)
from transports import KEY, checkpoint_dir, differs, pool_client_id, service

import trio_widgets as trio
from trio_widgets.http import wire

# `make test` runs it alone, with no test beside it: it counts the cycles each loop shape takes, and
# a round trip on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone
CYCLE_S = 0.4  # see test_serve_tinker.py
LOOPS_N = 3  # updates per loop shape in the clock-rule tests (see test_serve_tinker.py)
ADAM = trio.AdamParams(learning_rate=1e-2, weight_decay=0.01)
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]


def datum(i: int, length: int = 16) -> trio.Datum:
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + length + 1]
    return trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=CYCLE_S, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                        name="served-trio") as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with served(pool) as s:
        yield s


@pytest.fixture
def fast(pool):
    pool.min_cycle_s = 0.005
    yield
    pool.min_cycle_s = CYCLE_S


@pytest.fixture
def svc(pool, transport):
    with service(transport, pool) as s:
        yield s


@pytest.fixture
def http_svc(server):
    """trio's own HTTP client, for what only the HTTP codec has."""
    with trio.ServiceClient(base_url=server.url, api_key=KEY) as s:
        yield s


def test_it_is_the_http_backend(http_svc, server, pool):
    svc = http_svc
    from trio_widgets.http.client import HttpBackend

    assert isinstance(svc.backend, HttpBackend) and svc.pool is None
    assert trio.DEFAULT_MODEL in [m.model_name for m in svc.get_server_capabilities().supported_models]
    with pytest.raises(trio.InvalidInputError, match="base_url"):
        trio.ServiceClient(pool, base_url=server.url)


def test_sync_loops_have_the_clock_rules_of_local_ones(svc, pool):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    batch = [datum(0)]
    fbs: list[trio.APIFuture] = []
    opts: list[trio.APIFuture] = []

    def fb():
        fbs.append(tc.forward_backward(batch))
        return fbs[-1]

    def opt():
        opts.append(tc.optim_step(ADAM))
        return opts[-1]

    three_loops(fb, opt, lambda f: f.result(timeout=120), LOOPS_N)
    check_three_loops(pool, pool_client_id(svc, tc), since=0, n=LOOPS_N)
    # APIFuture.cycle is the pool's cycle (over HTTP: X-Trio-Cycle): the same spans and periods
    pairs = [(f.cycle, o.cycle) for f, o in zip(fbs, opts)]
    assert pairs == pairs_from_telemetry(pool, pool_client_id(svc, tc))
    assert spans_and_periods(pairs[2 * LOOPS_N:]) == ({1}, {1})


def test_async_loops_have_the_clock_rules_of_local_ones(svc, pool):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
    batch = [datum(1)]
    asyncio.run(three_loops_async(lambda: tc.forward_backward_async(batch, "cross_entropy"),
                                  lambda: tc.optim_step_async(ADAM), LOOPS_N))
    check_three_loops(pool, pool_client_id(svc, tc), since=0, n=LOOPS_N)


def test_save_state_resume_continues_bitwise(svc, pool, transport, fast):
    def update(tc, i):
        fb = tc.forward_backward([datum(i)])
        tc.optim_step(ADAM).result(timeout=120)
        return fb.result(timeout=120).loss

    straight = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=11)
    losses_straight = [update(straight, i) for i in range(8)]
    end_straight = straight.save_state("end").result(timeout=120).path
    first = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=11)
    losses = [update(first, i) for i in range(4)]
    half = first.save_state("half").result(timeout=120).path
    assert half == f"tinker://{first.model_id}/weights/half"
    resumed = svc.create_training_client_from_state_with_optimizer(half)
    assert resumed.get_info().model_data.lora_rank == 8
    losses += [update(resumed, i) for i in range(4, 8)]
    end_resumed = resumed.save_state("end").result(timeout=120).path
    assert losses == losses_straight
    assert same_tensors(adapter_file(checkpoint_dir(svc, pool, end_resumed)),
                        adapter_file(checkpoint_dir(svc, pool, end_straight)))
    weights_only = svc.create_training_client_from_state(half)
    weights_only.forward_backward([datum(4)])
    assert weights_only.optim_step(ADAM).result(timeout=120).metrics["step:max"] == 1
    if differs(transport, "filesystem-paths"):  # a file path is never a checkpoint name over HTTP
        with pytest.raises(trio.InvalidInputError, match="tinker://"):
            svc.create_training_client_from_state(str(checkpoint_dir(svc, pool, half)))


def test_sampling_matches_an_in_process_sampler(svc, pool, fast):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=3)
    for i in range(3):
        tc.forward_backward([datum(i)])
        tc.optim_step(ADAM).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client("snap")
    prompt = trio.ModelInput.from_ints([3 + b for b in b"It was the"])
    params = trio.SamplingParams(max_tokens=8, seed=7)
    remote = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result(timeout=120)
    assert sampler.model_path == f"tinker://{tc.model_id}/sampler_weights/snap"
    local = trio.ServiceClient(pool).create_sampling_client(
        model_path=str(checkpoint_dir(svc, pool, sampler.model_path)))
    mine = local.sample(prompt, 3, params, include_prompt_logprobs=True).result(timeout=120)
    assert [s.tokens for s in remote.sequences] == [s.tokens for s in mine.sequences]
    assert [s.logprobs for s in remote.sequences] == [s.logprobs for s in mine.sequences]
    assert remote.prompt_logprobs == mine.prompt_logprobs
    assert sampler.compute_logprobs(prompt).result(timeout=120) == local.compute_logprobs(prompt).result(timeout=120)
    local.close()
    by_path = svc.create_sampling_client(model_path=sampler.model_path)
    assert [s.tokens for s in by_path.sample(prompt, 3, params).result(timeout=120).sequences] == \
        [s.tokens for s in mine.sequences]


def test_a_custom_loss_keeps_its_place_before_a_later_optim_step(svc, pool, fast):
    """The second half of forward_backward_custom is reserved: the optim_step and forward
    submitted right after it run behind it, in order (over HTTP: held client-side, sent behind it)."""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=4)
    batch = random_batch(4, n=2, length=10)

    def loss_fn(data, logprobs):
        time.sleep(0.3)  # a slow loss: the later submits must wait for it, not overtake it
        total = sum((-lp).sum() for lp in logprobs)
        return total, {"custom:sum": float(total.detach())}

    custom = tc.forward_backward_custom(batch, loss_fn)
    opt = tc.optim_step(ADAM)
    after = tc.forward(batch)
    assert opt.result(timeout=120).metrics["step:max"] == 1
    out = custom.result(timeout=120)
    assert out.loss_fn_output_type == "custom" and out.metrics["custom:sum"] == out.metrics["loss:sum"]
    after.result(timeout=120)
    records = sorted(pool.telemetry.requests_of(pool_client_id(svc, tc)), key=lambda r: r.request_id)
    assert [r.op for r in records] == ["forward", "forward_backward_custom", "optim_step", "forward"]
    assert records[1].cycle <= records[2].cycle < records[3].cycle


def test_seq_ids_sent_out_of_order_run_in_order(http_svc, server, pool, fast):
    svc = http_svc
    """Raw protobuf POSTs for a model: seq 2 before seq 1. The server holds 2 until 1 arrives."""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=5)
    client = server.clients()[tc.client_id]
    short, long_ = [datum(0, 5)], [datum(1, 11)]
    headers = {"X-API-Key": KEY, "Content-Type": wire.PROTOBUF}
    url = f"{server.url}/api/v1/forward_backward"
    held_before = server.stats()["held"]
    second = httpx.post(url, content=wire.encode_forward_request(tc.client_id, 2, long_, "cross_entropy", {}, False),
                        headers=headers).json()
    first = httpx.post(url, content=wire.encode_forward_request(tc.client_id, 1, short, "cross_entropy", {}, False),
                       headers=headers).json()
    for rid in (second["request_id"], first["request_id"]):
        body = {"request_id": rid}
        while (r := httpx.post(f"{server.url}/api/v1/retrieve_future", json=body, headers={"X-API-Key": KEY},
                               timeout=60)).headers["content-type"] != wire.PROTOBUF:
            assert r.json().get("type") == "try_again", r.text
    records = sorted(pool.telemetry.requests_of(client), key=lambda r: r.cycle)
    assert [r.tokens for r in records] == [5, 11]  # seq 1 ran first
    assert server.stats()["held"] == held_before + 1
    # and a repeat of seq 2 is answered with its first request, running nothing
    again = httpx.post(url, content=wire.encode_forward_request(tc.client_id, 2, long_, "cross_entropy", {}, False),
                       headers=headers).json()
    assert again["request_id"] == second["request_id"]
    assert len(pool.telemetry.requests_of(client)) == 2


def test_a_retried_submit_runs_once(server, pool, fast):
    with LossyProxy(server.port, "/api/v1/optim_step") as proxy:
        service = trio.ServiceClient(base_url=proxy.url, api_key=KEY)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=6)
        steps = []
        for i in range(3):
            tc.forward_backward([datum(i)])
            steps.append(tc.optim_step(ADAM).result(timeout=120).metrics["step:max"])
        service.close()
        assert proxy.dropped == 1
    assert steps == [1, 2, 3]
    assert len(pairs_from_telemetry(pool, server.clients()[tc.client_id])) == 3


def test_bad_input_is_refused_at_submit_naming_the_field(svc, transport, fast):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=7)
    bad = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 999]})]
    with pytest.raises(trio.InvalidInputError) as info:
        tc.forward_backward(bad)
    assert info.value.field == "data[0].loss_fn_inputs['target_tokens']" and "vocabulary" in str(info.value)
    with pytest.raises(trio.InvalidInputError, match="rank"):
        svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=100_000)
    # a directory names a base model only in-process
    unknown = "unknown model .*this server serves" if differs(transport, "filesystem-paths") \
        else "could not load '/etc'"
    with pytest.raises(trio.InvalidInputError, match=unknown):
        svc.create_lora_training_client("/etc", rank=4)
    if differs(transport, "inspect-adapter"):
        with pytest.raises(trio.InvalidInputError, match="inspect_adapter"):
            tc.inspect_adapter()
    with pytest.raises(trio.InvalidInputError, match="path"):
        tc.save_state("../escape")
    # nothing was queued by any of it: the next update is step 1
    tc.forward_backward([datum(0)])
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1


def test_closing_a_client_frees_its_lane(svc, pool, fast):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=8)
    client = pool_client_id(svc, tc)
    tc.forward_backward([datum(0)]).result(timeout=60)
    assert client in pool.telemetry.live_clients()
    tc.close()
    wait_for(lambda: client not in pool.telemetry.live_clients(), "the served client to be retired")
    with pytest.raises(trio.ClientClosedError):
        tc.forward_backward([datum(0)])


def threads_of(backend) -> list[threading.Thread]:
    """An HttpBackend's connection threads that are still running."""
    link = backend._link
    return [t for t in (link.thread, link.heartbeat) if t is not None and t.is_alive()]


def session_state(server, session_id: str) -> str:
    return next(s["state"] for s in server.sessions() if s["session_id"] == session_id)


def test_closing_the_service_finishes_its_session_and_stops_its_threads(server, pool, fast):
    """tinker's `ServiceClient.close()` finishes the session and releases the client's resources:
    over HTTP nothing of it keeps running, whether or not it is dropped (or collected) later."""
    before = set(threading.enumerate())
    with trio.ServiceClient(base_url=server.url, api_key=KEY) as service:
        backend = service.backend
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9)
        tc.forward_backward([datum(0)])
        assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1
        assert len(threads_of(backend)) == 2 and session_state(server, backend.session_id) == "live"
    assert service.closed and backend.closed and tc.closed
    assert threads_of(backend) == []
    assert session_state(server, backend.session_id) == "finished"
    with pytest.raises(trio.ClientClosedError):
        tc.forward_backward([datum(0)])
    # and a RestClient made by URL has a session of its own, ended the same way
    with trio.RestClient(base_url=server.url, api_key=KEY) as rest:
        assert threads_of(rest._backend) == []  # the session opens when the server is first asked
        assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert len(threads_of(rest._backend)) == 2
    assert threads_of(rest._backend) == [] and session_state(server, rest._backend.session_id) == "finished"
    rest.close()  # a second close does nothing
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("trio-http")]



def test_the_rest_client_and_new_request_fields_over_http(http_svc, server, fast):
    """main's Backend methods (RestClient) over HTTP: this session's runs, checkpoints and
    samplers; what a served pool cannot do is refused with tinker's BadRequestError, naming it."""
    svc = http_svc
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=5, user_metadata={"name": "rest"})
    assert tc.model_id == tc.client_id  # tinker's model_id names the run's checkpoints
    tc.forward_backward([datum(0)])
    tc.optim_step(ADAM).result(timeout=60)
    path = tc.save_state("first").result(timeout=60).path
    assert path == f"tinker://{tc.model_id}/weights/first"
    with pytest.raises(trio.CheckpointExistsError) as exists:  # tinker's ConflictError, as in-process
        tc.save_state("first").result(timeout=60)
    assert isinstance(exists.value, trio.ConflictError)
    assert tc.save_state("first", overwrite=True).result(timeout=60).path == path
    sampler = tc.save_weights_and_get_sampling_client("snap")
    rest = svc.create_rest_client()
    assert trio.DEFAULT_MODEL in [m.model_name for m in rest.get_server_capabilities().result().supported_models]
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} >= {path} and {c.checkpoint_type for c in listed} >= {"training"}
    assert path in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4 and run.last_checkpoint is not None
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    info = rest.get_sampler(sampler.sampler_id if hasattr(sampler, "sampler_id") else sampler.client_id).result()
    assert info.base_model == trio.DEFAULT_MODEL
    assert rest.list_sessions().result().sessions == [svc.backend.session_id]
    session = rest.get_session(svc.backend.session_id).result()
    assert tc.model_id in session.training_run_ids
    # the REST catalog over HTTP, answered by the pool's own (tinker's routes)
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.lora_rank, info.is_lora) == (trio.DEFAULT_MODEL, 4, True)
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    assert next(c for c in rest.list_checkpoints(tc.model_id).result().checkpoints
                if c.tinker_path == path).expires_at is not None
    assert rest.get_training_run(tc.model_id).result().last_checkpoint.tinker_path == path
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    with pytest.raises(trio.CheckpointNotFoundError):
        rest.get_weights_info_by_tinker_path(path).result()
    with pytest.raises(trio.NotFoundError):
        rest.get_session("sess-0000000000000000").result()
    with pytest.raises(trio.NotFoundError):
        rest.get_training_run("sess-0000000000000000:train:0").result()
    # TTL and metadata travel and the engine keeps them, as in-process (tests/test_transports.py)
    later = tc.save_state("later", ttl_seconds=7200, user_metadata={"k": "v"}).result(timeout=60).path
    kept = {c.tinker_path: c for c in trio.RestClient(server.pool).list_checkpoints(tc.model_id).result().checkpoints}
    assert kept[later].expires_at is not None and kept[later].user_metadata == {"k": "v"}
    prompt = trio.ModelInput.from_ints(TEXT[:8])
    # top-k travels in tinker's protobuf fields (tests/test_sampling.py compares it with a reference)
    topk = sampler.sample(prompt, 1, trio.SamplingParams(max_tokens=2), topk_sample_logprobs=3).result(timeout=60)
    assert [len(top) for top in topk.sequences[0].topk_logprobs] == [3, 3]
    with pytest.raises(trio.InvalidInputError) as bad:  # and is checked by the engine, as in-process
        sampler.sample(prompt, 1, trio.SamplingParams(max_tokens=2), topk_sample_logprobs=-1)
    assert bad.value.field == "topk_sample_logprobs"
    # and a RestClient of its own, by URL
    own = trio.RestClient(base_url=server.url, api_key=KEY)
    assert tc.model_id in [r.training_run_id for r in own.list_training_runs().result().training_runs]  # its key's
    other = trio.RestClient(base_url=server.url, api_key=KEY + "-other")
    assert tc.model_id not in [r.training_run_id for r in other.list_training_runs().result().training_runs]
    with pytest.raises(trio.NotFoundError):
        other.get_training_run(tc.model_id).result()  # another key's run: absent, as an unknown one
    other.close()
    with pytest.raises(trio.NotFoundError):
        own.list_checkpoints("sess-0000000000000000:train:0").result()
    own.close()
    assert threads_of(own._backend) == []


def test_the_backend_does_no_io_until_used_and_takes_an_httpx_transport():
    """httpx's seam: a MockTransport answers here, so what the client sends is seen exactly; the
    constructor sends nothing, and the first call opens the session (config, create_session)."""
    from trio_widgets.http.client import HttpBackend

    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api/v1")
        sent.append(path)
        if path == "/create_session":
            return httpx.Response(200, json={"session_id": "sess-0123456789abcdef"})
        if path == "/get_server_capabilities":
            return httpx.Response(200, json={"supported_models": [{"model_name": "m", "max_context_length": 64,
                                                                    "trainable": True, "sampleable": True}]})
        return httpx.Response(200, json={})

    backend = HttpBackend("http://trio.invalid:1", KEY, transport=httpx.MockTransport(answer), heartbeat_s=60)
    service = trio.ServiceClient(backend=backend)
    assert sent == [] and not backend._link.thread.is_alive() and "session=None" in repr(backend)
    assert [m.model_name for m in service.get_server_capabilities().supported_models] == ["m"]
    assert sent == ["/client/config", "/create_session", "/get_server_capabilities"]
    assert service.service_session_cuid == backend.session_id == "sess-0123456789abcdef"
    backend.close()
    assert sent[-1] == "/sessions/sess-0123456789abcdef/finish"
    assert not backend._link.thread.is_alive() and not backend._link.heartbeat.is_alive()
    unused = HttpBackend("http://trio.invalid:1", KEY, transport=httpx.MockTransport(answer))
    unused.close()  # never opened: nothing to finish, no thread to stop
    assert sent[-1] == "/sessions/sess-0123456789abcdef/finish" and unused._link.thread.ident is None


def test_a_sampler_handle_passes_the_sampler_to_another_process(http_svc, server, pool, fast):
    """tinker's get_sampler_handle / from_sampler_handle: a real second process samples from the
    same sampler; both number their requests from 0, and each gets its own answers (the server
    deduplicates seq_ids per session); closing the other process's client leaves the sampler."""
    svc = http_svc
    import json as jsonlib
    import os
    import subprocess
    import sys

    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
    tc.forward_backward([datum(0)])
    tc.optim_step(ADAM).result(timeout=60)
    sampler = tc.save_weights_and_get_sampling_client("shared")
    handle = sampler.get_sampler_handle()
    assert KEY not in handle and isinstance(handle, str)
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    mine = sampler.sample(trio.ModelInput.from_ints(TEXT[:9]), 1, params, include_prompt_logprobs=True).result(60)
    code = ("import json, sys, trio_widgets as trio\n"
            "s = trio.SamplingClient.from_sampler_handle(sys.argv[1])\n"
            "p = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=3)\n"
            "other = s.sample(trio.ModelInput.from_ints(list(range(5, 9))), 1, p, include_prompt_logprobs=True)\n"
            "same = s.sample(trio.ModelInput.from_ints(json.loads(sys.argv[2])), 1, p).result(60)\n"
            "print(json.dumps({'other': len(other.result(60).prompt_logprobs), "
            "'same': same.sequences[0].tokens}))\n"
            "s.close()\n")
    env = {**os.environ, "TRIO_API_KEY": KEY, "TRIO_BASE_URL": server.url}
    run = subprocess.run([sys.executable, "-c", code, handle, jsonlib.dumps(TEXT[:9])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = jsonlib.loads(run.stdout.strip().splitlines()[-1])
    assert seen["other"] == 4  # its own first request (seq_id 0 there too), not this process's
    assert seen["same"] == mine.sequences[0].tokens  # the same sampler, the same seed: the same tokens
    again = sampler.sample(trio.ModelInput.from_ints(TEXT[:9]), 1, params).result(60)  # still this process's
    assert again.sequences[0].tokens == mine.sequences[0].tokens
    # another key may not use it; a malformed handle says so; an in-process pool's sampler cannot leave
    with pytest.raises(trio.NotFoundError):
        trio.SamplingClient.from_sampler_handle(handle, api_key="tml-someone-else", base_url=server.url)
    with pytest.raises(trio.InvalidInputError) as info:
        trio.SamplingClient.from_sampler_handle("not-a-handle", api_key=KEY)
    assert info.value.field == "handle"
    local = trio.ServiceClient(pool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    with pytest.raises(trio.NotSupportedError, match="in-process pool"):
        local.get_sampler_handle()
    local.close()


def test_a_key_goes_only_to_the_server_it_was_configured_for(http_svc, server, monkeypatch):
    """A sampler handle is data from elsewhere: one naming another server (here a second local
    server that records what reaches it) is refused before any request, so the key never leaves;
    with the configured server it works; the same server spelled another way is the same."""
    svc = http_svc
    import base64
    import http.server
    import json as jsonlib
    import threading

    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(f"{self.path} {self.headers.get('X-API-Key')}")
            self.send_response(404)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    recorder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=recorder.serve_forever, name="test-recorder", daemon=True)
    thread.start()
    try:
        elsewhere = f"http://127.0.0.1:{recorder.server_address[1]}"
        tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        sampler = tc.save_weights_and_get_sampling_client("handle-host")  # (kept: a dropped sampler is released)
        real = sampler.get_sampler_handle()
        fields = jsonlib.loads(base64.urlsafe_b64decode(real))
        crafted = base64.urlsafe_b64encode(jsonlib.dumps({**fields, "base_url": elsewhere}).encode()).decode()
        monkeypatch.setenv("TRIO_BASE_URL", server.url)
        for handle, kwargs in [(crafted, {"api_key": KEY}), (crafted, {"api_key": KEY, "base_url": server.url}),
                               (real, {"api_key": KEY, "base_url": elsewhere})]:
            with pytest.raises(trio.InvalidInputError, match="goes only to the server you configured") as info:
                trio.SamplingClient.from_sampler_handle(handle, **kwargs)
            assert info.value.field == "handle" and KEY not in str(info.value)
        monkeypatch.delenv("TRIO_BASE_URL")
        with pytest.raises(trio.InvalidInputError, match="pass base_url"):
            trio.SamplingClient.from_sampler_handle(real, api_key=KEY)  # nothing configured: nowhere to send it
        assert seen == []  # not one request reached the other server
        spelled = server.url.replace("127.0.0.1", "127.0.0.1.") + "/"  # the same origin, written another way
        same = trio.SamplingClient.from_sampler_handle(real, api_key=KEY, base_url=spelled)
        assert same.sample([5, 6], 1, trio.SamplingParams(max_tokens=2, seed=0)).result(60).sequences
        same.close()
    finally:
        recorder.shutdown()
        recorder.server_close()
        thread.join(10)
