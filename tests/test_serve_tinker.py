"""The unmodified official tinker SDK (0.38.0) against a served pool on 127.0.0.1: loops, clock
rules read from the pool's own telemetry, resume, sampling, seq_id order and retries, and the
SDK's own errors for what a local pool does not offer."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch
from served import (
    LossyProxy,
    adapter_file,
    check_three_loops,
    pairs_from_telemetry,
    same_tensors,
    sdk_client,
    served,
    three_loops,
    three_loops_async,
    tinker_env,
)

import trio_widgets as trio
from trio_widgets.http import wire

if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import tinker  # noqa: E402
from tinker import types as tt  # noqa: E402

KEY = "tml-serve-tests"
# `make test` runs it alone, with no test beside it: it counts the cycles each loop shape takes, and
# a round trip on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone

# Long enough that a client's HTTP round trip (result, then its next submit) fits in one
# cycle on a loaded 2-core machine: the clock rules are what is tested, not the speed.
CYCLE_S = 0.4
# Updates per loop shape in the clock-rule tests: each shape's steady period shows from its third
# update (as tests/test_fleet.py's loops); the loops take 3*4 + 3*2 + 4 cycles of 0.4 s.
LOOPS_N = 3
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]


def datum(i: int, length: int = 16) -> tt.Datum:
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + length + 1]
    return tt.Datum(model_input=tt.ModelInput.from_ints(chunk[:-1]), loss_fn_inputs={"target_tokens": chunk[1:]})


ADAM = tt.AdamParams(learning_rate=1e-2, weight_decay=0.01)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=CYCLE_S, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                        name="served-sdk") as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with served(pool) as s:
        yield s


@pytest.fixture
def fast(pool):
    """Short cycles for tests that pin results, not clock rules."""
    pool.min_cycle_s = 0.005
    yield
    pool.min_cycle_s = CYCLE_S


@pytest.fixture
def sdk(server, monkeypatch):
    yield from sdk_client(server, KEY, monkeypatch)


def test_sync_loops_have_the_clock_rules_of_local_ones(sdk, server, pool):
    tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=0).result()
    data = [datum(0)]
    three_loops(lambda: tc.forward_backward(data, "cross_entropy"), lambda: tc.optim_step(ADAM),
                lambda f: f.result(timeout=120), LOOPS_N)
    check_three_loops(pool, server.clients()[tc.model_id], since=0, n=LOOPS_N)
    # the lane is labelled by the session
    label = pool.telemetry.client_info(server.clients()[tc.model_id]).label
    assert label.startswith(tc.model_id.split(":")[0][:13]), label


def test_async_loops_have_the_clock_rules_of_local_ones(sdk, server, pool):
    async def run() -> str:
        tc = await sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=1)
        data = [datum(1)]

        async def fb():
            return tc.forward_backward(data, "cross_entropy")

        async def opt():
            return tc.optim_step(ADAM)

        await three_loops_async(fb, opt, LOOPS_N)
        return tc.model_id

    model_id = asyncio.run(run())
    check_three_loops(pool, server.clients()[model_id], since=0, n=LOOPS_N)


def test_save_state_resume_continues_bitwise(sdk, server, fast):
    def update(tc, i):
        fb = tc.forward_backward([datum(i)], "cross_entropy")
        tc.optim_step(ADAM).result(timeout=120)
        return fb.result(timeout=120).metrics["loss:sum"]

    straight = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=11).result()
    losses_straight = [update(straight, i) for i in range(8)]
    end_straight = straight.save_state("end").result(timeout=120).path

    first = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=11).result()
    losses = [update(first, i) for i in range(4)]
    half = first.save_state("half").result(timeout=120)
    assert half.path == f"tinker://{first.model_id}/weights/half"
    resumed = sdk.create_training_client_from_state_with_optimizer(half.path).result()
    assert resumed.model_id != first.model_id
    losses += [update(resumed, i) for i in range(4, 8)]
    end_resumed = resumed.save_state("end").result(timeout=120).path
    assert losses == losses_straight  # exact float equality, through protobuf and back
    assert same_tensors(adapter_file(server.checkpoint_path(end_resumed, KEY)),
                        adapter_file(server.checkpoint_path(end_straight, KEY)))

    # weights only: the same weights, AdamW starting afresh (step 1 again)
    weights_only = sdk.create_training_client_from_state(half.path).result()
    at_load = weights_only.save_state("at-load").result(timeout=120).path
    assert same_tensors(adapter_file(server.checkpoint_path(at_load, KEY)),
                        adapter_file(server.checkpoint_path(half.path, KEY)))
    weights_only.forward_backward([datum(4)], "cross_entropy")
    assert weights_only.optim_step(ADAM).result(timeout=120).metrics["step:max"] == 1
    # the checkpoints of this run, listed by the SDK's RestClient
    listed = tinker.RestClient(base_url=server.url, api_key=KEY).list_checkpoints(first.model_id).result()
    assert [c.tinker_path for c in listed.checkpoints] == [half.path]


def test_sampling_matches_an_in_process_sampler_of_the_same_weights(sdk, server, pool, fast):
    tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=3).result()
    for i in range(3):
        tc.forward_backward([datum(i)], "cross_entropy")
        tc.optim_step(ADAM).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [3 + b for b in b"It was the"]
    params = tt.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    remote = sampler.sample(tt.ModelInput.from_ints(prompt), 3, params).result(timeout=120)
    remote_lp = sampler.compute_logprobs(tt.ModelInput.from_ints(prompt)).result(timeout=120)
    saved = tc.save_weights_for_sampler("for-local").result(timeout=120).path

    local = trio.ServiceClient(pool).create_sampling_client(model_path=str(server.checkpoint_path(saved, KEY)))
    mine = local.sample(trio.ModelInput.from_ints(prompt), 3, trio.SamplingParams(max_tokens=8, temperature=1.0,
                                                                                  seed=7)).result(timeout=120)
    mine_lp = local.compute_logprobs(trio.ModelInput.from_ints(prompt)).result(timeout=120)
    local.close()
    # the same weights and seed in a cycle of their own: the same tokens, the same float32 logprobs
    assert [list(s.tokens) for s in remote.sequences] == [s.tokens for s in mine.sequences]
    assert [list(s.logprobs) for s in remote.sequences] == [s.logprobs for s in mine.sequences]
    assert remote_lp[0] is None and remote_lp[1:] == mine_lp[1:]
    assert len({s.sequence_id for s in remote.sequences}) == 3
    # tinker's options in its own protobuf fields: top-k prompt and sampled logprobs, target ids,
    # alternative tokens; equal to in-process, bit for bit (float32 both ways)
    n = len(prompt)
    targets = [[prompt[i + 1], -1, 3 + i] for i in range(n - 1)]
    options = dict(include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2,
                   prompt_alt_tokens_k=2)
    theirs_opt = sampler.sample(tt.ModelInput.from_ints(prompt), 2, params, **options,
                                target_prompt_logprobs=tt.TensorData(data=sum(targets, []), dtype="int64",
                                                                     shape=[n - 1, 3])).result(timeout=120)
    local = trio.ServiceClient(pool).create_sampling_client(model_path=str(server.checkpoint_path(saved, KEY)))
    ours_opt = local.sample(trio.ModelInput.from_ints(prompt), 2,
                            trio.SamplingParams(max_tokens=8, temperature=1.0, seed=7), **options,
                            target_prompt_logprobs=trio.TensorData(targets)).result(timeout=120)
    local.close()
    assert theirs_opt.topk_prompt_logprobs == ours_opt.topk_prompt_logprobs
    assert ours_opt.topk_prompt_logprobs[0] is None and len(ours_opt.topk_prompt_logprobs[1]) == 3
    for theirs, ours in zip(theirs_opt.sequences, ours_opt.sequences):
        assert list(theirs.tokens) == ours.tokens and theirs.topk_logprobs == ours.topk_logprobs
        assert len(ours.topk_logprobs) == len(ours.tokens) and len(ours.topk_logprobs[0]) == 2
    for field in ("target_prompt_logprobs",):
        assert getattr(theirs_opt, field).to_numpy().tolist() == getattr(ours_opt, field).to_numpy().tolist()
    for part in ("tokens", "logprobs"):
        assert getattr(theirs_opt.prompt_alt_tokens, part).to_numpy().tolist() == \
            getattr(ours_opt.prompt_alt_tokens, part).to_numpy().tolist()
    # a sampler by path, through the SDK's create_sampling_client
    by_path = sdk.create_sampling_client(model_path=saved).result()
    again = by_path.sample(tt.ModelInput.from_ints(prompt), 3, params).result(timeout=120)
    assert [list(s.tokens) for s in again.sequences] == [s.tokens for s in mine.sequences]


def test_chunks_sent_out_of_order_run_in_seq_id_order(pool, monkeypatch, fast):
    """With one datum per chunk the SDK sends a forward_backward's chunks concurrently, the first
    one last; the server holds the early ones until it has the first, so they run in order."""
    tinker_env(monkeypatch)
    with served(pool, fwdbwd_max_chunk_len=1) as server:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=5).result()
        lengths = [5, 9, 13, 7]
        data = [datum(i, n) for i, n in enumerate(lengths)]
        out = tc.forward_backward(data, "cross_entropy").result(timeout=120)
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == lengths
        records = sorted((r for r in pool.telemetry.requests_of(server.clients()[tc.model_id])
                          if r.op == "forward_backward"), key=lambda r: r.cycle)
        assert [r.tokens for r in records] == lengths  # seq_id order, one chunk per cycle
        assert [r.cycle for r in records] == list(range(records[0].cycle, records[0].cycle + 4))
        assert server.stats()["held"] >= 1  # some did arrive before the first
        # the whole batch's loss is the sum of the chunks' (what one call would have given)
        assert out.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in records), rel=1e-6)
        sc.close("success").result(timeout=60)


def test_a_retried_submit_runs_once(server, pool, monkeypatch, fast):
    """The answer to the first optim_step is lost on the way back; the SDK sends it again (same
    seq_id); the server answers with the first request and runs the step once."""
    tinker_env(monkeypatch)
    with LossyProxy(server.port, "/api/v1/optim_step") as proxy:
        sc = tinker.ServiceClient(base_url=proxy.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=6).result()
        steps = []
        for i in range(3):
            tc.forward_backward([datum(i)], "cross_entropy")
            steps.append(tc.optim_step(ADAM).result(timeout=120).metrics["step:max"])
        sc.close("success").result(timeout=60)
        assert proxy.dropped == 1
    assert steps == [1, 2, 3]
    assert server.stats()["duplicates"] >= 1
    pairs = pairs_from_telemetry(pool, server.clients()[tc.model_id])
    assert len(pairs) == 3  # three forward_backward, three optim_step: nothing ran twice


def test_unsupported_features_answer_with_the_sdks_errors(sdk, server, fast):
    tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=2).result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce"):
        tc.forward_backward([datum(0)], "stable_reinforce").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="image"):
        image = tt.ImageChunk(data=b"\x89PNG....", format="png", expected_tokens=4)
        tc.forward_backward([tt.Datum(model_input=tt.ModelInput(chunks=[image]),
                                      loss_fn_inputs={"target_tokens": [1, 2, 3, 4]})], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not a valid age recipient"):  # exports: test_export.py
        tc.save_weights_external("hf-copy", age_encryption_recipients=["age1notakey"]).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="snapshot"):
        tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):  # the engine's check, as in-process
        sampler.sample(tt.ModelInput.from_ints([5, 6]), 1, tt.SamplingParams(max_tokens=2),
                       topk_prompt_logprobs=-1).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="max_request_tokens"):
        tc.forward_backward([datum(0, 40)] * 500, "cross_entropy").result(timeout=60)
    # the REST catalog answers the SDK's own RestClient (its key's runs)
    run = tinker.RestClient(base_url=server.url, api_key=KEY).get_training_run(tc.model_id).result(timeout=60)
    assert run.training_run_id == tc.model_id and run.base_model == trio.DEFAULT_MODEL
    tc.save_state("once").result(timeout=60)
    started = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="overwrite"):  # not a 409: the SDK retries every 409
        tc.save_state("once").result(timeout=60)
    assert time.monotonic() - started < 10
    # the client is not poisoned by any of it
    tc.forward_backward([datum(1)], "cross_entropy")
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1


def test_custom_loss_is_the_two_step_exchange(sdk, server, pool, fast):
    tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=8).result()
    data = [datum(0), datum(1, 9)]

    def loss_fn(batch, logprobs):
        total = sum((-lp).sum() for lp in logprobs)
        return total, {"custom:sum": float(total.detach())}

    out = tc.forward_backward_custom(data, loss_fn).result(timeout=120)
    plain = tc.forward(data, "cross_entropy").result(timeout=120)
    # the custom loss is the plain cross-entropy here, from the same weights (no step between)
    assert out.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-6)
    ops = [r.op for r in pool.telemetry.requests_of(server.clients()[tc.model_id])]
    assert ops == ["forward", "forward_backward", "forward"]
    assert torch.isfinite(torch.tensor(out.metrics["loss:sum"]))
    assert wire.tinker_metric_keys(out.metrics) == out.metrics
