"""The parts of the hosted SDKs' surface that live in types, futures and errors, checked for
behaviour against a real pool (the SDKs themselves are compared in test_sdk_parity.py)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import adapter_weights, make_datum, random_batch

import trio_widgets as trio
from trio_widgets.types import check_text_only, finish_sample_response, first_non_text_chunk

PROMPT = [3 + b for b in b"The cat "]  # byte tokenizer: token = byte + 3


@pytest.fixture
def tc(pool):
    return trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)


# -- TensorData and Datum ---------------------------------------------------------------

def test_tensor_data_infers_dtype_and_refuses_to_truncate():
    assert (trio.TensorData(data=[1, 2]).dtype, trio.TensorData(data=[0.5]).dtype) == ("int64", "float32")
    nested = trio.TensorData(data=[[1, 2, 3], [4, 5, 6]])
    assert nested.shape == [2, 3] and nested.data == [1, 2, 3, 4, 5, 6] and nested.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert trio.TensorData(data=[1, 2], dtype="float32").data == [1.0, 2.0]
    assert trio.TensorData(data=[2.0, 3.0], dtype="int64").data == [2, 3]  # whole numbers are exact
    with pytest.raises(ValueError, match=r"expected integers \(int64\), got 1.5 at flat position 1"):
        trio.TensorData(data=[2.0, 1.5], dtype="int64")
    with pytest.raises(ValueError, match=r"shape \[4\] does not fit 3 values"):
        trio.TensorData(data=[1, 2, 3], dtype="int64", shape=[4])
    bf16 = trio.TensorData.from_torch(torch.tensor([0.5, 1.5], dtype=torch.bfloat16))
    assert bf16.dtype == "float32" and torch.equal(bf16.to_torch(), torch.tensor([0.5, 1.5]))


def test_datum_types_list_inputs_by_key(pool, tc):
    """Integer weights are weights (float32), as in tinker; unknown keys keep their values' dtype;
    a ragged list is refused naming its key. Integer weights train exactly as float weights do."""
    tokens = PROMPT + [3 + b for b in b"sat."]
    as_ints = make_datum(tokens, [1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1])
    as_floats = make_datum(tokens, [float(w) for w in as_ints.loss_fn_inputs["weights"].data])
    assert as_ints.loss_fn_inputs["weights"].dtype == "float32"
    assert as_ints.loss_fn_inputs["target_tokens"].dtype == "int64"
    other = trio.Datum(trio.ModelInput.from_ints([5, 6]), {"mask": [1, 0], "advantages": np.array([1, 2])})
    assert other.loss_fn_inputs["mask"].dtype == "int64" and other.loss_fn_inputs["advantages"].dtype == "float32"
    with pytest.raises(trio.InvalidInputError, match=r"loss_fn_inputs\['weights'\]: .*ragged"):
        trio.Datum(trio.ModelInput.from_ints([5, 6]), {"weights": [[1.0], [1.0, 2.0]]})
    a = tc.forward([as_ints], "cross_entropy").result(timeout=60)
    b = tc.forward([as_floats], "cross_entropy").result(timeout=60)
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]


# -- ModelInput and non-text chunks -----------------------------------------------------------

def test_model_input_helpers_of_both_sdks():
    mi = trio.ModelInput.from_ints([1, 2])
    longer = mi.append_int(3).append(trio.EncodedTextChunk([4, 5]))
    assert mi.to_ints() == [1, 2] and longer.to_ints() == longer.tolist() == [1, 2, 3, 4, 5]  # tinker: new objects
    assert [c.to_ints() for c in longer.chunks] == [[1, 2], [3], [4, 5]] and len(longer) == longer.length == 5
    assert trio.ModelInput.empty().is_empty and trio.ModelInput.from_ints([]).is_empty and not mi.is_empty
    assert not longer.has_images and first_non_text_chunk(longer) is None


def test_image_chunks_are_accepted_detected_and_rejected_at_submit(tc):
    png = b"\x89PNG\r\n\x1a\nfake"
    chunk = trio.ImageChunk(data=base64.b64encode(png).decode(), format="png", expected_tokens=4)
    assert chunk.data == png and chunk.length == 4  # both SDKs take base64 text
    with pytest.raises(trio.InvalidInputError, match=r"ImageChunk.format: must be 'png' or 'jpeg', got 'gif'"):
        trio.ImageChunk(data=png, format="gif")
    with pytest.raises(ValueError, match="expected_tokens needs to be set"):
        _ = trio.ImageChunk(data=png, format="jpeg").length
    mi = trio.ModelInput.from_ints([5, 6]).append(chunk).append(trio.ImageAssetPointerChunk("png", "/img.png", 2))
    assert mi.has_images and mi.length == 8 and first_non_text_chunk(mi) == (1, chunk)
    with pytest.raises(trio.InvalidInputError) as info:
        check_text_only(mi, trio.DEFAULT_MODEL, field="data[3].model_input", datum_index=3)
    assert str(info.value) == (f"data[3].model_input.chunks[1]: is an ImageChunk, but {trio.DEFAULT_MODEL} is a "
                               f"text-only model: it reads token ids (EncodedTextChunk) only")
    assert info.value.datum_index == 3
    datum = trio.Datum(mi, {"target_tokens": list(range(4, 12))})
    queued_before = tc.pool.queue_depths()[tc.client_id]
    with pytest.raises(trio.InvalidInputError, match=r"chunks\[1\]: is an ImageChunk"):
        tc.forward_backward([datum])
    assert tc.pool.queue_depths()[tc.client_id] == queued_before  # nothing was queued


# -- sampling results -------------------------------------------------------------------

def test_sample_response_fields_of_both_sdks(pool):
    sampler = trio.ServiceClient(pool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    tok = sampler.get_tokenizer()
    params = trio.SamplingParams(max_tokens=6, seed=11)
    future = sampler.sample(trio.ModelInput.from_ints(PROMPT), 3, params, include_prompt_logprobs=True)
    finished = future.map(lambda r: finish_sample_response(r, len(PROMPT), tok.decode))
    response = finished.result(timeout=60)
    assert response is future.result() and finished.cycle == future.cycle is not None
    assert response.input_tokens == len(PROMPT)
    assert response.output_tokens == sum(len(s.tokens) for s in response.sequences) > 0
    assert len({s.sequence_id for s in response.sequences}) == 3
    for seq in response.sequences:
        assert isinstance(seq, trio.types.SampleSequence) and seq.text == tok.decode(seq.tokens)
        assert seq.tokens_np.dtype == np.int32 and seq.tokens_np.tolist() == seq.tokens
        assert seq.logprobs_np.dtype == np.float32 and np.allclose(seq.logprobs_np, seq.logprobs)
    lp = response.prompt_logprobs_np
    assert np.isnan(lp[0]) and np.allclose(lp[1:], response.prompt_logprobs[1:])
    assert response.prompt_cache_hit_tokens == 0


# -- futures -----------------------------------------------------------------------------

def test_cancelling_the_concurrent_future_withdraws_the_request(pool, tc):
    """tinker: cancelling `future()` cancels the operation. The optim_step withdrawn from the
    queue never runs: the weights stay as the forward_backward left them."""
    before = adapter_weights(tc)
    with pool.hold():
        fb = tc.forward_backward(random_batch(1, n=1, length=8))
        opt = tc.optim_step(trio.AdamParams(learning_rate=1e-1))
        assert opt.future().cancel() and opt.cancelled() and opt.done()
    fb.result(timeout=60)
    assert not fb.cancel() and not fb.future().cancel()  # already run: cannot be cancelled
    after = adapter_weights(tc)
    assert all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(concurrent.futures.CancelledError):
        opt.result()


def test_result_async_timeout_cancels_a_queued_request(pool, tc):
    with pool.hold():
        fb = tc.forward(random_batch(2, n=1, length=8))
        with pytest.raises(TimeoutError):
            asyncio.run(fb.result_async(timeout=0.05))
        assert fb.cancelled()


def test_map_completed_and_coroutine(pool, tc):
    fut = tc.forward(random_batch(3, n=1, length=8))
    loss = fut.map(lambda out: out.metrics["loss:sum"])
    assert loss.result(timeout=60) == fut.result().metrics["loss:sum"] and loss.cycle == fut.cycle
    broken = fut.map(lambda out: 1 / 0)
    assert isinstance(broken.exception(timeout=60), ZeroDivisionError)
    assert trio.APIFuture.completed(3).map(lambda x: x + 1).result() == 4

    async def in_tasks():
        futures = [tc.forward(random_batch(4, n=1, length=8)) for _ in range(2)]
        done, _ = await asyncio.to_thread(concurrent.futures.wait, [f.future() for f in futures], 60)
        tasks = [asyncio.create_task(f.coroutine()) for f in futures]
        return len(done), await asyncio.gather(*tasks), await trio.APIFuture.completed("x")

    n_done, outs, value = asyncio.run(in_tasks())
    assert n_done == 2 and outs[0].metrics == outs[1].metrics and value == "x"


def test_cancelling_a_mapped_future_cancels_its_source(pool, tc):
    with pool.hold():
        source = tc.forward(random_batch(5, n=1, length=8))
        mapped = source.map(lambda out: out.loss)
        assert mapped.cancel() and source.cancelled() and mapped.cancelled()
        kept = tc.forward(random_batch(5, n=1, length=8))
        kept_loss = kept.map(lambda out: out.loss)
    assert kept.result(timeout=60) and kept_loss.result() == kept.result().loss
    assert not kept_loss.cancel()


# -- errors ------------------------------------------------------------------------------

def test_errors_are_caught_under_the_sdks_names(pool, tc, tmp_path: Path):
    with pytest.raises(trio.BadRequestError) as bad:
        tc.forward_backward([])
    assert isinstance(bad.value, (trio.InvalidInputError, ValueError, trio.PyTrioError))
    assert (bad.value.status_code, bad.value.code, bad.value.message) == (
        400, "validation.failed", "data: the batch is empty: pass at least one Datum")
    with pytest.raises(trio.NotFoundError) as missing:
        trio.ServiceClient(pool).create_training_client_from_state(str(tmp_path / "nothing-here"))
    assert missing.value.status_code == 404 and isinstance(missing.value, FileNotFoundError)

    def failing_loss(data, logprobs):
        raise RuntimeError("on purpose")

    fut = tc.forward_backward_custom(random_batch(6, n=1, length=8), failing_loss)
    error = fut.exception(timeout=60)
    assert isinstance(error, trio.RequestFailedError) and isinstance(error, trio.TinkerError)
    assert isinstance(error, trio.PyTrioError) and isinstance(error, trio.errors.EventFailedError)
    assert error.request_id == str(fut.request_id) == error.event_cuid and error.task_cuid == tc.client_id
    # the tenant's own fault (its loss raised): tinker's category User
    assert error.category == trio.errors.RequestErrorCategory.User and "on purpose" in error.message

    closed = trio.LocalPool(min_cycle_s=0.0, name="closed")
    closed_tc = trio.ServiceClient(closed).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    closed.close()
    with pytest.raises(trio.TinkerError) as gone:
        closed_tc.forward(random_batch(7, n=1, length=8))
    assert isinstance(gone.value, (trio.PoolClosedError, trio.PyTrioError, RuntimeError))


# -- every public name of the SDKs' clients (issue 23) ------------------------------------------------

def _hosted_only(member: object) -> bool:
    func = getattr(member, "__func__", member)
    if isinstance(func, property):
        func = func.fget
    return (getattr(func, "__doc__", None) or "").startswith("Hosted only") or \
        "tinker's internal connection holder" in (getattr(func, "__doc__", None) or "")


@pytest.mark.parametrize("sdk", ["tinker", "pytrio"])
def test_every_public_name_of_the_sdks_clients_exists_and_works_or_says_why_not(sdk, pool):
    import importlib
    import inspect

    from trio_widgets.hosted import REASONS

    module = importlib.import_module(sdk)
    service = trio.ServiceClient(pool)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    ours = {"ServiceClient": service, "TrainingClient": tc,
            "SamplingClient": service.create_sampling_client(base_model=trio.DEFAULT_MODEL),
            "RestClient": trio.RestClient(pool)}
    refused, working = [], []
    for cls_name, instance in ours.items():
        theirs = getattr(module, cls_name)
        for name in sorted(n for n in dir(theirs) if not n.startswith("_")):
            assert hasattr(type(instance), name), f"{sdk}.{cls_name}.{name} has no counterpart in trio"
            member = inspect.getattr_static(type(instance), name)
            if not _hosted_only(member):
                working.append(f"{cls_name}.{name}")
                continue
            assert name.removesuffix("_async") in REASONS
            with pytest.raises(trio.NotSupportedError) as info:
                value = getattr(instance, name)
                result = value("tinker://x/weights/y") if callable(value) else value
                if inspect.iscoroutine(result):
                    asyncio.run(result)
            assert name in str(info.value) and len(str(info.value)) > len(name) + 40, str(info.value)
            assert isinstance(info.value, NotImplementedError) and isinstance(info.value, trio.TinkerError)
            refused.append(f"{cls_name}.{name}")
    service.close()
    # what works is tested where it is used (this file, test_sdk_parity.py, test_sdk_client.py, ...)
    assert len(working) > 40, len(working)
    assert refused or sdk == "pytrio", refused  # every pytrio name works since the downloads (test_export.py)


@pytest.mark.parametrize("sdk", ["tinker", "pytrio"])
def test_every_hosted_only_name_of_the_sdks_response_types_says_why(sdk):
    """Every response type the SDK's clients return (tests/sdk_compare.response_types): each of
    its members ours has as hosted-only raises NotSupportedError naming the hosted feature."""
    import importlib
    import inspect

    from sdk_compare import response_types

    from trio_widgets import types
    from trio_widgets.hosted import REASONS

    module = importlib.import_module(sdk)
    namespaces = [importlib.import_module(f"{sdk}.types"), module]
    clients = {n: getattr(module, n) for n in ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")}
    refused = []
    for name, (cls, _via) in sorted(response_types(clients, sdk, namespaces).items()):
        ours = getattr(types, name, None)
        if ours is None:
            continue
        for member in sorted(n for n in dir(cls) if not n.startswith("_")):
            static = inspect.getattr_static(ours, member, None)
            if static is None or not _hosted_only(static):
                continue
            assert member in REASONS
            with pytest.raises(trio.NotSupportedError) as info:
                getattr(object.__new__(ours), member)()  # (a hosted-only method reads nothing of its object)
            assert member in str(info.value) and len(str(info.value)) > len(member) + 40, str(info.value)
            refused.append(f"{name}.{member}")
    if sdk == "tinker":
        assert {"SaveWeightsResponse.get_console_url", "SaveWeightsForSamplerResponse.get_console_url",
                "SaveWeightsForSamplerResponse.get_playground_url"} <= set(refused), refused
