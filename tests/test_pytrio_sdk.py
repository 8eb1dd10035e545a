"""The gaps issue 32 named between our types and the SDKs' (point 4), and what happens when the
types of one are handed to the other (point 5), each checked with the real SDK objects (tinker
0.38, pytrio 0.2.9) and, where a request must run, a real pool (and, for tinker's own client,
the pool served on 127.0.0.1).

The surfaces themselves (every client method, field and return kind) are compared in
test_sdk_parity.py; here is how the named ones behave."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from conftest import adapter_weights, random_batch
from numerics import assert_fp32_close, model_terms, tiny_config
from served import served, tinker_env

import trio_widgets as trio
from trio_widgets.types import SDKTypeError, from_sdk

if sys.version_info < (3, 11):
    pytest.skip("tinker 0.38 and pytrio 0.2.9 need Python >= 3.11", allow_module_level=True)

_hook = sys.excepthook
tinker = pytest.importorskip("tinker")
pytrio = pytest.importorskip("pytrio")
sys.excepthook = _hook  # importing pytrio installs its own hook; leave the test process as it was

import pytrio.types as pt  # noqa: E402
import tinker.types as tt  # noqa: E402
from pytrio.client.training_batch import plan_training_batch  # noqa: E402
from pytrio.model.limits import TrainingLimits  # noqa: E402
from sdk_compare import return_kind, same_return_kind  # noqa: E402
from tinker.lib.public_interfaces.training_client import _estimate_datum_bytes_count_proto  # noqa: E402

TOKENS = [3 + b for b in b"The cat sat on the mat."]
SDKS = {"tinker": tt, "pytrio": pt}


@pytest.fixture
def ckpool(tmp_path):
    with trio.LocalPool(min_cycle_s=0.0, checkpoint_dir=str(tmp_path / "ckpt"), name="pytrio-sdk") as p:
        yield p


def _datum(module, tokens=TOKENS) -> object:
    """The same datum as `module`'s own type (trio, tinker.types or pytrio.types)."""
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * 4 + [0.5] * (len(tokens) - 5)}
    if module is trio:
        return trio.Datum(trio.ModelInput.from_ints(tokens[:-1]), inputs)
    return module.Datum(model_input=module.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={k: module.TensorData.from_numpy(trio.TensorData(v).to_numpy())
                                        for k, v in inputs.items()})


# -- point 4: the named gaps -------------------------------------------------------------------

def test_sample_response_type_is_pytrios(ckpool):
    sampler = trio.ServiceClient(ckpool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    response = sampler.sample(trio.ModelInput.from_ints(TOKENS[:5]), 2, trio.SamplingParams(max_tokens=3, seed=1))
    assert response.result(timeout=60).type == pt.SampleResponse.model_fields["type"].default == "sample"


def test_console_and_playground_urls_are_hosted_only_and_say_so(ckpool):
    tc = trio.ServiceClient(ckpool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    state = tc.save_state("s").result(timeout=60)
    weights = tc.save_weights_for_sampler("w").result(timeout=60)
    calls = {"get_console_url": (state, weights), "get_playground_url": (weights,)}
    for name, responses in calls.items():
        for response in responses:
            assert callable(getattr(getattr(tt, type(response).__name__), name))  # tinker's have it
            with pytest.raises(trio.NotSupportedError) as info:
                getattr(response, name)()
            assert isinstance(info.value, NotImplementedError) and isinstance(info.value, trio.TinkerError)
            assert ("web console" if name == "get_console_url" else "playground") in str(info.value)
            assert "a local pool has none" in str(info.value)


def test_download_checkpoint_resolves_a_listed_id_never_the_current_directory(ckpool, tmp_path, monkeypatch):
    """pytrio's RestClient.download_checkpoint(checkpoint_id, dest): the id as list_checkpoints
    lists it. A directory of the same relative name in the current directory is never read."""
    service = trio.ServiceClient(ckpool)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    tc.forward_backward(random_batch(1, n=1, length=8)).result(timeout=60)
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=60)
    tc.save_weights_for_sampler("dl").result(timeout=60)
    rest = service.create_rest_client()
    (listed,) = rest.list_checkpoints(tc.training_run_cuid).result().checkpoints
    assert listed.checkpoint_id == "sampler_weights/dl"
    decoy = tmp_path / "cwd" / "sampler_weights" / "dl"
    decoy.mkdir(parents=True)
    (decoy / "adapter_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "cwd")

    done = rest.download_checkpoint(listed.checkpoint_id, tmp_path / "out").result()
    assert done.checkpoint_id == "sampler_weights/dl" and done.bytes_written > 0
    (real,) = Path(ckpool.checkpoint_dir).rglob("sampler_weights/dl")  # the checkpoint's directory
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (real / name).read_bytes()
    assert rest.get_checkpoint_archive_url(listed.checkpoint_id).result().url == real.as_uri()
    assert rest.get_checkpoint_download_url(listed.checkpoint_id).result().url == real.as_uri()
    assert asyncio.run(rest.download_checkpoint_async(listed.tinker_path, tmp_path / "again")).bytes_written == \
        done.bytes_written

    with pytest.raises(trio.CheckpointNotFoundError) as missing:
        rest.download_checkpoint("sampler_weights/nothing", tmp_path / "x").result()
    assert str(missing.value).startswith("checkpoint_id: no checkpoint of yours has the id 'sampler_weights/nothing'")
    assert "tinker:// path" in str(missing.value) and not (tmp_path / "x").exists()
    other = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=1)
    other.save_weights_for_sampler("dl").result(timeout=60)
    with pytest.raises(trio.InvalidInputError) as ambiguous:
        rest.download_checkpoint("sampler_weights/dl", tmp_path / "y").result()
    assert "2 of your runs have a checkpoint 'sampler_weights/dl'" in str(ambiguous.value)
    assert listed.tinker_path in str(ambiguous.value) and str(ambiguous.value).startswith("checkpoint_id: ")
    with pytest.raises(trio.InvalidInputError, match=r"^checkpoint_id: must be a checkpoint_id"):
        rest.download_checkpoint("", tmp_path / "z").result()
    service.close()


def test_save_weights_and_get_sampling_client_the_pytrio_way_and_the_tinker_way(ckpool):
    """pytrio's returns the SamplingClient itself (sync) and after one await (async); tinker's a
    future whose `.result()` is the SamplingClient. Ours is both: used directly it samples,
    `.result()` and `await` give a plain SamplingClient (no future, not awaitable)."""
    assert return_kind(pytrio.TrainingClient, "save_weights_and_get_sampling_client") == "value"
    assert return_kind(tinker.TrainingClient, "save_weights_and_get_sampling_client") == "client-future"
    ours = return_kind(trio.TrainingClient, "save_weights_and_get_sampling_client")
    assert ours == "client-future" and same_return_kind("value", ours) and same_return_kind("client-future", ours)

    tc = trio.ServiceClient(ckpool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    prompt = trio.ModelInput.from_ints(TOKENS[:6])
    params = trio.SamplingParams(max_tokens=4, seed=3)
    direct = tc.save_weights_and_get_sampling_client()  # pytrio: no arguments, the client itself
    first = direct.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens
    plain = direct.result()  # tinker
    assert isinstance(plain, trio.SamplingClient) and not isinstance(plain, trio.APIFuture)
    assert not hasattr(plain, "__await__") and not hasattr(plain, "result") and plain is direct.result()
    assert plain.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens == first

    async def pytrio_async():
        sampler = await tc.save_weights_and_get_sampling_client_async()
        return sampler, await sampler.sample_async(prompt, 1, params)

    sampler, response = asyncio.run(pytrio_async())
    assert isinstance(sampler, trio.SamplingClient) and not hasattr(sampler, "__await__")
    assert response.sequences[0].tokens == first  # the same weights, the same seed


def test_a_plain_client_keeps_its_future_and_releases_with_it(ckpool):
    """`.result()` gives a client that holds the future: the pool keeps the client while
    either is referenced, and lets it go once both are dropped."""
    import gc

    service = trio.ServiceClient(ckpool)
    sampler = service.create_sampling_client(base_model=trio.DEFAULT_MODEL)  # to run cycles later
    before = ckpool.tenant_count
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0).result()  # the future is dropped
    gc.collect()
    assert ckpool.tenant_count == before + 1
    tc.forward(random_batch(2, n=1, length=8)).result(timeout=60)  # still usable
    del tc
    gc.collect()
    sampler.sample(TOKENS[:3], 1, trio.SamplingParams(max_tokens=1)).result(timeout=60)  # a cycle or two run
    assert ckpool.tenant_count == before  # both dropped: the training client is gone
    service.close()


# -- point 5: theirs handed to ours ---------------------------------------------------------------

@pytest.mark.parametrize("sdk", ["tinker", "pytrio"])
def test_the_sdks_types_work_in_our_client(ckpool, sdk):
    """Their Datum, ModelInput, TensorData, AdamParams and SamplingParams, handed to our client,
    are converted field by field: the same losses, weights and samples as ours give."""
    module = SDKS[sdk]
    service = trio.ServiceClient(ckpool)
    a = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    b = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    ours_out = a.forward_backward([_datum(trio)]).result(timeout=60)
    theirs_out = b.forward_backward([_datum(module)], "cross_entropy").result(timeout=60)
    assert theirs_out.metrics == ours_out.metrics
    a.optim_step(trio.AdamParams(learning_rate=1e-2, weight_decay=0.1)).result(timeout=60)
    b.optim_step(module.AdamParams(learning_rate=1e-2, weight_decay=0.1)).result(timeout=60)
    wa, wb = adapter_weights(a), adapter_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # ours built from their parts
    mixed = trio.Datum(module.ModelInput.from_ints(TOKENS[:-1]),
                       {"target_tokens": module.TensorData.from_numpy(trio.TensorData(TOKENS[1:]).to_numpy())})
    assert isinstance(mixed.model_input, trio.ModelInput) and mixed.loss_fn_inputs["target_tokens"].data == TOKENS[1:]
    sampler = a.save_weights_and_get_sampling_client()
    ours_sample = sampler.sample(trio.ModelInput.from_ints(TOKENS[:6]), 2, trio.SamplingParams(max_tokens=4, seed=5))
    theirs_sample = sampler.sample(module.ModelInput.from_ints(TOKENS[:6]), 2,
                                   module.SamplingParams(max_tokens=4, seed=5))
    assert [s.tokens for s in ours_sample.result(timeout=60).sequences] == \
        [s.tokens for s in theirs_sample.result(timeout=60).sequences]
    service.close()


def test_what_has_no_counterpart_is_refused_saying_what_to_pass(ckpool):
    n = len(TOKENS) - 1
    with_spans = _datum(tt).with_provenance(model_input=[tt.PromptProvenanceSpan(sequence_id="p", length=n)],
                                            loss_fn_inputs=[tt.PromptProvenanceSpan(sequence_id="p", length=n)])
    with pytest.raises(TypeError, match=r"tinker\.types\.Datum\.model_input_spans is set: provenance spans only "
                                        r"serve tinker's stable_reinforce.*pass the Datum without them"):
        from_sdk(with_spans)
    tc = trio.ServiceClient(ckpool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    with pytest.raises(TypeError, match=r"Expected AdamParams \(the local pool implements AdamW only\), got "
                                        r"DimuonParams"):
        tc.optim_step(tt.DimuonParams(learning_rate=1e-3))  # a TypeError, as tinker's own


# -- point 5: ours handed to theirs ---------------------------------------------------------------

@pytest.mark.parametrize("sdk", ["tinker", "pytrio"])
def test_our_types_convert_to_the_sdks_and_back(sdk):
    convert = {"tinker": lambda v: v.to_tinker(), "pytrio": lambda v: v.to_pytrio()}[sdk]
    module = SDKS[sdk]
    values = [_datum(trio), trio.ModelInput.from_ints([5, 6, 7]), trio.TensorData([[1.5, 2.0], [3.0, 4.0]]),
              trio.AdamParams(learning_rate=3e-3, beta2=0.99, grad_clip_norm=1.0),
              trio.SamplingParams(max_tokens=7, seed=2, stop=["\n"], temperature=0.5, top_k=5, top_p=0.9),
              trio.EncodedTextChunk([1, 2])]
    for value in values:
        theirs = convert(value)
        assert type(theirs) is getattr(module, type(value).__name__), (sdk, type(theirs))
        assert from_sdk(theirs) == value
    assert _datum(trio).to_tinker().loss_fn_inputs["weights"].tolist() == _datum(tt).loss_fn_inputs["weights"].tolist()


def test_the_sdks_reading_ours_get_a_type_error_that_says_what_to_pass():
    """tinker's TrainingClient sizes each datum before sending (the deep AttributeError of the
    issue); pytrio's plans the batch. Both are the real SDK functions their clients call."""
    with pytest.raises(TypeError) as info:
        _estimate_datum_bytes_count_proto(_datum(trio))
    assert isinstance(info.value, SDKTypeError) and isinstance(info.value, AttributeError)
    assert "tinker's SDK read '_numpy' of a trio_widgets.TensorData" in str(info.value)
    assert ".to_tinker()" in str(info.value) and "[d.to_tinker() for d in data]" in str(info.value)
    assert _estimate_datum_bytes_count_proto(_datum(trio).to_tinker()) == _estimate_datum_bytes_count_proto(_datum(tt))

    limits = TrainingLimits(None, None, None)
    with pytest.raises(TypeError, match=r"pytrio's SDK read 'expected_tokens' of a trio_widgets\.EncodedTextChunk.*"
                                        r"\.to_pytrio\(\)"):
        plan_training_batch([_datum(trio)], loss_fn="cross_entropy", auto_shift=False, limits=limits,
                            tokenizer_vocab_size=259)
    ours = plan_training_batch([_datum(trio).to_pytrio()], loss_fn="cross_entropy", auto_shift=False, limits=limits,
                               tokenizer_vocab_size=259)
    theirs = plan_training_batch([_datum(pt)], loss_fn="cross_entropy", auto_shift=False, limits=limits,
                                 tokenizer_vocab_size=259)
    assert ours.totals == theirs.totals
    # our own code and plain Python see a plain AttributeError, as before
    assert not hasattr(_datum(trio), "_numpy") and getattr(trio.ModelInput(), "expected_tokens", 7) == 7
    with pytest.raises(AttributeError) as plain:
        trio.TensorData([1])._numpy  # noqa: B018
    assert type(plain.value) is AttributeError


def test_the_official_tinker_client_takes_our_types_converted(monkeypatch):
    """End to end through tinker's own client against the served pool: our Datum handed as it
    is fails at once with the TypeError saying to convert; converted, the step runs and gives
    the loss our own client gives."""
    tinker_env(monkeypatch)
    with trio.LocalPool(min_cycle_s=0.0, name="mixed-tinker") as pool, served(pool) as server:
        sdk = tinker.ServiceClient(base_url=server.url, api_key="tml-mixing")
        try:
            tc = sdk.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=2, seed=0).result()
            with pytest.raises(TypeError, match=r"\.to_tinker\(\)"):
                tc.forward_backward([_datum(trio)], "cross_entropy")
            out = tc.forward([_datum(trio).to_tinker()], "cross_entropy").result(timeout=60)
            ours = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
            expected = ours.forward([_datum(trio)]).result(timeout=60).metrics["loss:sum"]
            # the same op from the same state (B = 0: the base's loss), through another codec: fp32 rounding
            assert_fp32_close(out.metrics["loss:sum"], expected, model_terms(tiny_config(), len(TOKENS)) + len(TOKENS),
                              "loss:sum", magnitude=abs(expected))
            # tinker checks the optimizer's type itself: a TypeError naming what it takes
            with pytest.raises(TypeError, match="Expected AdamParams"):
                tc.optim_step(trio.AdamParams(learning_rate=1e-3))
            tc.forward_backward([_datum(trio).to_tinker()], "cross_entropy").result(timeout=60)
            assert tc.optim_step(trio.AdamParams(learning_rate=1e-3).to_tinker()).result(timeout=60) is not None
        finally:
            sdk.close("success").result(timeout=60)


def test_every_async_creator_gives_the_plain_client_after_one_await(ckpool):
    """As both SDKs' `*_async` creators: one await gives the client itself (the return kind
    test_sdk_parity.py reads off the annotations, here at run time)."""
    service = trio.ServiceClient(ckpool)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    path = tc.save_state("a").result(timeout=60).path
    sampler_path = tc.save_weights_for_sampler("b").result(timeout=60).path

    async def made():
        return {
            "ServiceClient.create_lora_training_client_async":
                await service.create_lora_training_client_async(trio.DEFAULT_MODEL, rank=2),
            "ServiceClient.create_training_client_from_state_async":
                await service.create_training_client_from_state_async(path),
            "ServiceClient.create_training_client_from_state_with_optimizer_async":
                await service.create_training_client_from_state_with_optimizer_async(path),
            "ServiceClient.create_sampling_client_async":
                await service.create_sampling_client_async(base_model=trio.DEFAULT_MODEL),
            "TrainingClient.create_sampling_client_async": await tc.create_sampling_client_async(sampler_path),
            "TrainingClient.save_weights_and_get_sampling_client_async":
                await tc.save_weights_and_get_sampling_client_async(),
        }

    for name, client in asyncio.run(made()).items():
        kind = trio.SamplingClient if "sampling" in name else trio.TrainingClient
        assert isinstance(client, kind) and not isinstance(client, trio.APIFuture), name
        assert not hasattr(client, "__await__") and not hasattr(client, "result"), name
        for sdk in (tinker, pytrio):
            cls_name, method = name.split(".")
            assert return_kind(getattr(sdk, cls_name), method) == "awaitable of value", (sdk, name)
    service.close()
