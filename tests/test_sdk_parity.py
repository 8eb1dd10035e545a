"""Parity with the installed hosted SDKs, tinker 0.38.0 and pytrio 0.2.9 (issue 16).

The SDKs are the reference: their public names, method signatures (parameter names, order,
defaults, async) and response fields are compared with ours programmatically
(tests/sdk_compare.py says exactly how). Every difference is either fixed or listed below
with its reason:

* ALLOWED_DIFFERENCES: kept on purpose (docs/differences.md, "Differences from the hosted services"
  mirrors them);
* PENDING_CLIENT_CHANGES: work still to do on the client side (empty since issue 16's
  client half: a new difference is listed there with what is to be done, or fixed).

A listed difference that no longer exists fails the test too, so the lists stay true.
Behaviour is compared side by side on the SDKs' own objects where they run offline.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if sys.version_info < (3, 11):
    pytest.skip("tinker 0.38 and pytrio 0.2.9 need Python >= 3.11 (the dev extra installs them only there)",
                allow_module_level=True)

_hook = sys.excepthook
tinker = pytest.importorskip("tinker", reason="tinker==0.38.0 is not installed: pip install -e '.[dev]'")
pytrio = pytest.importorskip("pytrio", reason="pytrio==0.2.9 is not installed: pip install -e '.[dev]'")
sys.excepthook = _hook  # importing pytrio installs its own hook; leave the test process as it was

import pytrio.errors.base  # noqa: E402, F811 (a submodule of the skipped-or-imported package)
import pytrio.errors.event  # noqa: E402
import pytrio.types as pt  # noqa: E402
import tinker._exceptions  # noqa: E402, F811
import tinker.types as tt  # noqa: E402
from sdk_compare import (  # noqa: E402
    compare_class,
    compare_exceptions,
    compare_names,
    public_members,
    response_types,
)
from tinker.types.topk_logprobs import TopkLogprobs as TinkerTopk  # noqa: E402
from tinker.types.topk_logprobs import topk_to_lists  # noqa: E402

import trio_widgets as trio  # noqa: E402
from trio_widgets import errors, types  # noqa: E402
from trio_widgets.hosted import REASONS  # noqa: E402

SDK_VERSIONS = {"tinker": "0.38.0", "pytrio": "0.2.9"}


def _ours(module, name: str):
    return getattr(module, name, None)


# (key, SDK class, our class, compare the constructor too)
TINKER_TYPES = ["Datum", "ModelInput", "EncodedTextChunk", "ImageChunk", "ImageAssetPointerChunk", "DmelChunk",
                "TensorData", "AdamParams", "SamplingParams", "ForwardBackwardOutput", "OptimStepResponse",
                "SampleResponse", "SampledSequence", "SaveWeightsResponse", "SaveWeightsForSamplerResponse",
                "LoadWeightsResponse", "GetInfoResponse", "ModelData", "GetServerCapabilitiesResponse",
                "SupportedModel"]
INPUT_TYPES = {"Datum", "ModelInput", "EncodedTextChunk", "ImageChunk", "ImageAssetPointerChunk", "DmelChunk",
               "TensorData", "AdamParams", "SamplingParams"}
PYTRIO_TYPES = ["Datum", "ModelInput", "EncodedTextChunk", "ImageChunk", "TensorData", "AdamParams",
                "SamplingParams", "ForwardBackwardOutput", "OptimStepResponse", "SampleResponse", "SampleSequence",
                "SaveWeightsResponse", "SaveWeightsForSamplerResponse", "GetServerCapabilitiesResponse",
                "SupportedModel", "ModelOperationCapabilities"]
CLIENTS = ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient"]


def differences() -> dict[str, str]:
    diffs: dict[str, str] = {}
    # names
    diffs |= compare_names("tinker:top", [n for n in tinker.__all__ if not n.startswith("__")],
                           lambda n: hasattr(trio, n))
    diffs |= compare_names("pytrio:top", [n for n in dir(pytrio) if not n.startswith("_")
                                          and not isinstance(getattr(pytrio, n), type(sys))],
                           lambda n: hasattr(trio, n))
    diffs |= compare_names("pytrio:types", [n for n in dir(pt) if not n.startswith("_")
                                            and not isinstance(getattr(pt, n), type(sys))],
                           lambda n: hasattr(types, n))
    diffs |= compare_names("tinker:types", TINKER_TYPES + ["LossFnType", "StopReason", "TensorDtype", "ModelID",
                                                           "ModelInputChunk", "RequestErrorCategory"],
                           lambda n: hasattr(types, n))
    # types
    for name in TINKER_TYPES:
        diffs |= compare_class(f"tinker:types.{name}", getattr(tt, name), _ours(types, name),
                               constructor=name in INPUT_TYPES)
    diffs |= compare_class("tinker:types.TopkLogprobs", TinkerTopk, types.TopkLogprobs, constructor=True)
    for name in PYTRIO_TYPES:
        diffs |= compare_class(f"pytrio:types.{name}", getattr(pt, name), _ours(types, name),
                               constructor=name in INPUT_TYPES)
    # futures
    diffs |= compare_class("tinker:APIFuture", tinker.APIFuture, trio.APIFuture)
    diffs |= compare_class("pytrio:types.APIFuture", pt.APIFuture, trio.APIFuture, constructor=True)
    # errors
    tinker_errors = {n: getattr(tinker, n) for n in tinker.__all__
                     if isinstance(getattr(tinker, n), type) and issubclass(getattr(tinker, n), BaseException)}
    diffs |= compare_exceptions("tinker:errors", tinker_errors, lambda n: getattr(trio, n, None))
    pytrio_errors = {"PyTrioError": pytrio.PyTrioError, "ValidationError": pytrio.errors.base.ValidationError,
                     "EventError": pytrio.errors.event.EventError,
                     "EventFailedError": pytrio.errors.event.EventFailedError}
    diffs |= compare_exceptions("pytrio:errors", pytrio_errors, lambda n: getattr(errors, n, None))
    diffs |= compare_class("pytrio:errors.PyTrioError", pytrio.PyTrioError, errors.PyTrioError,
                           skip=["__init__"])
    # clients: every public method's signature, async-ness and return kind (value, future, awaitable)
    for name in CLIENTS:  # users construct ServiceClient and RestClient themselves
        constructed = name in ("ServiceClient", "RestClient")
        diffs |= compare_class(f"tinker:{name}", getattr(tinker, name), _ours(trio, name), constructor=constructed)
        diffs |= compare_class(f"pytrio:{name}", getattr(pytrio, name), _ours(trio, name), constructor=constructed)
    # tinker's futures of clients: their future half (result, result_async, future, coroutine, await);
    # the client half forwards every client method as (*args, **kwargs), compared above
    for name in ("BackcompatTrainingClientFuture", "BackcompatSamplingClientFuture"):
        client_half = set(public_members(getattr(tinker, name.removeprefix("Backcompat").removesuffix("Future"))))
        diffs |= compare_class(f"tinker:{name}", getattr(tinker, name), _ours(trio, name), skip=client_half)
    # every response type a client method returns, and the types their fields hold: ours has each
    # (fields, properties, methods), or only hosted-only methods return it (they raise NotSupportedError)
    for sdk, module, namespaces in (("tinker", tinker, [tt, tinker]), ("pytrio", pytrio, [pt, pytrio])):
        clients = {name: getattr(module, name) for name in CLIENTS}
        for name, (cls, reached_by) in response_types(clients, sdk, namespaces).items():
            ours = _ours(types, name)
            if ours is not None:
                diffs |= compare_class(f"{sdk}:types.{name}", cls, ours)
            elif not all(via.split(".")[-1].removesuffix("_async") in REASONS for via in reached_by):
                diffs[f"{sdk}:types.{name}"] = f"missing (returned by {', '.join(sorted(reached_by))})"
    return diffs


def test_response_types_are_found_by_walking_the_clients():
    """The walk reaches what the SDK-docs scripts read: the responses of training, sampling and
    the RestClient, and the types inside them."""
    found = {sdk: set(response_types({n: getattr(m, n) for n in CLIENTS}, sdk, ns)) for sdk, m, ns in
             (("tinker", tinker, [tt, tinker]), ("pytrio", pytrio, [pt, pytrio]))}
    assert {"ForwardBackwardOutput", "SaveWeightsResponse", "SampleResponse", "Checkpoint", "TrainingRun",
            "Cursor", "WeightsInfoResponse", "AuditLogResponse"} <= found["tinker"]
    assert {"SampleResponse", "SampleSequence", "CheckpointDownloadResult", "CheckpointArchiveUrlResponse",
            "TensorData", "ModelOperationCapabilities"} <= found["pytrio"]


_WIRE_TYPE = "a wire-format discriminator; the SDKs disagree on its value and user code does not read it"
_SPARSE = "sparse CSR TensorData: the local pool's losses take 1-D dense inputs only, so nothing is sparse here"
_PROVENANCE = "provenance spans only serve stable_reinforce, which the local pool refuses (engine/losses.py)"
_MAX_TOKENS = ("max_tokens defaults to 16, not None: tinker's None lets the server choose, pytrio's is an "
               "error at sample time; a local pool needs a bound of its own")

_SAMPLER_ORDER = ("tinker's order (model_path, base_model, ...): a positional call in pytrio's order "
                  "(base_model, model_path) is recognised by value (a base-model name that is no checkpoint is "
                  "the base model); a value that is both is refused, asking for keywords")
_PYTRIO_SAMPLE = ("tinker's positional order wins: the sixth parameter is topk_sample_logprobs and return_text is "
                  "keyword-only (a bool given there is refused, naming return_text); sampling_params defaults "
                  "to None, meaning SamplingParams() (pytrio's default object has max_tokens=None, which it "
                  "refuses at sample time)")
_OPTIM_PARAMS = ("tinker's (optim_params=None, *, adam_params=None): pytrio's positional call and its keyword "
                 "adam_params= both work")
_NO_PROJECTS = "hosted projects group an account's runs; a local pool has no account and no projects"
_HOLDER = "tinker's internal connection holder; a local client holds its backend instead"
_NO_EXTERNAL = ("an export to tinker's external store; save_weights_for_sampler already writes a PEFT "
                "directory Hugging Face tools load")
_NO_PUBLISH = "nothing local is public: Checkpoint.public is always False"
_NO_ACCOUNT = "identity, audit log, billing and storage usage of a hosted account have no local meaning"

ALLOWED_DIFFERENCES: dict[str, str] = {
    "pytrio:types.APIFuture()": "futures are made by the pool for each request (and by APIFuture.completed), "
                                "not by wrapping a concurrent.futures.Future",
    "pytrio:types.SaveWeightsForSamplerResponse.type": _WIRE_TYPE,
    "pytrio:types.SaveWeightsResponse.type": _WIRE_TYPE,
    "tinker:types.GetInfoResponse.type": _WIRE_TYPE,
    "tinker:types.LoadWeightsResponse.type": _WIRE_TYPE,
    "tinker:types.SaveWeightsForSamplerResponse.type": _WIRE_TYPE,
    "tinker:types.SaveWeightsResponse.type": _WIRE_TYPE,
    "tinker:types.SaveWeightsExternalResponse.type": _WIRE_TYPE,
    "pytrio:types.SamplingParams()": _MAX_TOKENS,
    "tinker:types.SamplingParams()": _MAX_TOKENS,
    "tinker:types.Datum()": _PROVENANCE,
    "tinker:types.Datum.loss_fn_input_spans": _PROVENANCE,
    "tinker:types.Datum.model_input_spans": _PROVENANCE,
    "tinker:types.Datum.with_provenance": _PROVENANCE,
    "tinker:top.PromptProvenanceSpan": _PROVENANCE,
    "tinker:top.SampledProvenanceSpan": _PROVENANCE,
    "tinker:types.TensorData()": _SPARSE,
    "tinker:types.TensorData.from_torch_sparse": _SPARSE,
    "tinker:types.TensorData.sparse_col_indices": _SPARSE,
    "tinker:types.TensorData.sparse_crow_indices": _SPARSE,
    "tinker:types.TensorData.to_numpy": "pad_value only densifies sparse data; " + _SPARSE,
    "tinker:types.TensorData.to_torch": "pad_value only densifies sparse data; " + _SPARSE,
    "tinker:types.TensorData.tolist": "pad_value only densifies sparse data; " + _SPARSE,
    "tinker:top.AdminClient": "audit logs, billing and storage usage of a hosted account have no local meaning",
    "tinker:top.DimuonOptimizerConfig": "the local pool implements AdamW only",
    "tinker:top.DimuonParams": "the local pool implements AdamW only",
    "tinker:top.LoraConfig": "a wire request type; create_lora_training_client takes the same values as arguments",
    "tinker:top.OptimStepRequest": "a wire request type; optim_step takes its values as arguments",
    "tinker:top.SampleRequest": "a wire request type; sample takes its values as arguments",
    "tinker:top.RequestOptions": "HTTP request options; there is no HTTP here",
    "tinker:top.Timeout": "an HTTP timeout type; there is no HTTP here",
    "tinker:top.auth": "credential helpers for the hosted service; a local pool needs no credentials",
    # -- the client, where the two SDKs disagree or a local pool has nothing to offer (issue 16) --
    "pytrio:ServiceClient.create_sampling_client": _SAMPLER_ORDER,
    "pytrio:ServiceClient.create_sampling_client_async": _SAMPLER_ORDER,
    "pytrio:SamplingClient.sample": _PYTRIO_SAMPLE,
    "pytrio:SamplingClient.sample_async": _PYTRIO_SAMPLE,
    "pytrio:TrainingClient.optim_step": _OPTIM_PARAMS,
    "pytrio:TrainingClient.optim_step_async": _OPTIM_PARAMS,
    "pytrio:RestClient()": "pytrio builds its RestClient from its runtime (users call "
                           "ServiceClient.create_rest_client(), which works here); ours takes a pool",
    "tinker:TrainingClient.holder": _HOLDER,
    "tinker:SamplingClient.holder": _HOLDER,
    "tinker:RestClient.holder": _HOLDER,
    "tinker:SamplingClient.create": _HOLDER,
    "tinker:SamplingClient.feature_gates": "tinker's server feature flags; a local pool has every feature it has",
    "tinker:SamplingClient.retry_handler": "there is no network, so nothing to retry (retry_config is accepted "
                                           "and ignored)",
}

# Issue 16's client half is done: every difference of the client is fixed or allowed above.
# A new one lands here with what is to be done, until it is.
PENDING_CLIENT_CHANGES: dict[str, str] = {}


def _report(title: str, entries: dict[str, str]) -> str:
    return title + "".join(f"\n  {k}: {v}" for k, v in sorted(entries.items()))


def test_sdk_versions_are_the_reference():
    assert tinker.__version__ == SDK_VERSIONS["tinker"]
    assert pytrio._version.__version__ == SDK_VERSIONS["pytrio"]


def test_every_difference_is_fixed_or_listed_with_its_reason():
    actual = differences()
    unexplained = {k: v for k, v in actual.items() if k not in ALLOWED_DIFFERENCES and k not in PENDING_CLIENT_CHANGES}
    assert not unexplained, _report("differences from the SDKs that are neither fixed nor listed:", unexplained)


def test_listed_differences_still_exist():
    actual = differences()
    assert not set(ALLOWED_DIFFERENCES) & set(PENDING_CLIENT_CHANGES)
    stale_allowed = {k: v for k, v in ALLOWED_DIFFERENCES.items() if k not in actual}
    assert not stale_allowed, _report("fixed, remove from ALLOWED_DIFFERENCES:", stale_allowed)
    stale_pending = {k: v for k, v in PENDING_CLIENT_CHANGES.items() if k not in actual}
    assert not stale_pending, _report("done, remove from PENDING_CLIENT_CHANGES:", stale_pending)


def _member(key: str) -> str:
    """The name a difference is about: `tinker:types.SampleResponse.type` -> `type`."""
    return key.split(":", 1)[1].split(".")[-1].removesuffix("()").removesuffix("_async")


def test_the_docs_list_every_allowed_difference():
    # the site's "Tinker and PyTRIO users" page (docs/differences.md) holds what the README once did
    page = (Path(__file__).resolve().parents[1] / "docs" / "differences.md").read_text(encoding="utf-8")
    quoted = " ".join(re.findall(r"`([^`]+)`", page))
    missing = sorted({_member(k) for k in ALLOWED_DIFFERENCES if not re.search(rf"\b{_member(k)}\b", quoted)})
    assert not missing, f"docs/differences.md does not name: {missing}"


# -- behaviour, side by side with the SDKs' own objects ------------------------------------

def test_datum_types_lists_by_key_as_tinker_does():
    from tinker.types.datum import _KEY_TO_TYPE

    assert types.LOSS_INPUT_DTYPES == _KEY_TO_TYPE  # the same key list, so the same coercion
    mi = [5, 6, 7]
    for key, dtype in _KEY_TO_TYPE.items():
        for values in ([1, 0, 2], [0.5, 1.0, 2.0]):
            if dtype == "int64" and isinstance(values[0], float):
                continue
            theirs = tt.Datum(model_input=tt.ModelInput.from_ints(mi), loss_fn_inputs={key: values})
            ours = trio.Datum(trio.ModelInput.from_ints(mi), {key: values})
            assert (ours.loss_fn_inputs[key].dtype, ours.loss_fn_inputs[key].tolist()) == \
                (theirs.loss_fn_inputs[key].dtype, theirs.loss_fn_inputs[key].tolist()), key
    # where they differ, on purpose: tinker truncates fractional targets, we keep them (rejected at submit)
    theirs = tt.Datum(model_input=tt.ModelInput.from_ints(mi), loss_fn_inputs={"target_tokens": [1.5, 2.0, 3.0]})
    ours = trio.Datum(trio.ModelInput.from_ints(mi), {"target_tokens": [1.5, 2.0, 3.0]})
    assert theirs.loss_fn_inputs["target_tokens"].tolist() == [1, 2, 3]
    assert ours.loss_fn_inputs["target_tokens"].dtype == "float32"
    # keys tinker does not know: pytrio's rule (the values' own dtype); tinker raises KeyError
    theirs = pt.Datum(model_input=pt.ModelInput.from_ints(mi), loss_fn_inputs={"mask": [1, 0, 1]})
    ours = trio.Datum(trio.ModelInput.from_ints(mi), {"mask": [1, 0, 1]})
    assert ours.loss_fn_inputs["mask"].dtype == theirs.loss_fn_inputs["mask"].dtype == "int64"


@pytest.mark.parametrize("array", [np.arange(6, dtype=np.float64).reshape(2, 3), np.array([3, 1, 2], dtype=np.int32),
                                   np.array([-1.5, 2.25], dtype=np.float32)], ids=["f64-2d", "i32", "f32"])
def test_tensor_data_conversions_match_both_sdks(array):
    ours, tink, pyt = (trio.TensorData.from_numpy(array), tt.TensorData.from_numpy(array),
                       pt.TensorData.from_numpy(array))
    assert ours.dtype == tink.dtype == pyt.dtype and ours.shape == tink.shape == pyt.shape
    assert ours.tolist() == tink.tolist() and ours.data == tink.data == pyt.data
    assert torch.equal(ours.to_torch(), tink.to_torch())
    t = torch.from_numpy(array)
    assert trio.TensorData.from_torch(t).tolist() == tt.TensorData.from_torch(t).tolist()
    # pytrio's dtype-less list form (through Datum / model_validate) infers as ours does
    assert trio.TensorData(array.tolist()).dtype == pt.TensorData.model_validate(array.tolist()).dtype


def test_model_input_matches_both_sdks():
    ours = trio.ModelInput.from_ints([1, 2]).append_int(3)
    tink = tt.ModelInput.from_ints([1, 2]).append_int(3)
    assert ours.to_ints() == tink.to_ints() and ours.length == tink.length
    assert [c.length for c in ours.chunks] == [c.length for c in tink.chunks]
    assert tt.ModelInput.empty().length == trio.ModelInput.empty().length == 0
    pyt = pt.ModelInput.from_ints([1, 2, 3])
    assert (pyt.tolist(), len(pyt), pyt.is_empty, pyt.has_images) == \
        (ours.tolist(), len(ours), ours.is_empty, ours.has_images)
    png = b"\x89PNG fake"
    for make in (lambda: tt.ImageChunk(data=png, format="png"), lambda: pt.ImageChunk(data=png, format="png"),
                 lambda: trio.ImageChunk(data=png, format="png")):
        chunk = make()
        assert chunk.type == "image" and chunk.data == png
    with pytest.raises(ValueError):
        pt.ModelInput(chunks=[pt.EncodedTextChunk(tokens=[1]), pt.ImageChunk(data=png, format="png")]).to_ints()
    with pytest.raises(ValueError):
        trio.ModelInput(chunks=[trio.EncodedTextChunk([1]), trio.ImageChunk(png, "png")]).to_ints()


def test_sampled_sequence_and_response_views_match_tinker():
    tokens, logprobs = [5, 9, 2], [-0.5, -1.25, -3.0]
    tink = tt.SampledSequence(stop_reason="stop", sequence_id="s1", tokens_np=np.array(tokens, dtype=np.int32),
                              logprobs_np=np.array(logprobs, dtype=np.float32))
    ours = trio.SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason="stop")
    assert ours.tokens == tink.tokens and ours.logprobs == tink.logprobs
    assert ours.tokens_np.dtype == tink.tokens_np.dtype and np.array_equal(ours.tokens_np, tink.tokens_np)
    assert ours.logprobs_np.dtype == tink.logprobs_np.dtype
    prompt = [None, -1.5, -0.25]
    tink_resp = tt.SampleResponse(sequences=[tink], prompt_logprobs_np=np.array([np.nan, -1.5, -0.25], np.float32))
    ours_resp = trio.SampleResponse(sequences=[ours], prompt_logprobs=prompt)
    assert tink_resp.prompt_logprobs == prompt and np.array_equal(ours_resp.prompt_logprobs_np,
                                                                   tink_resp.prompt_logprobs_np, equal_nan=True)
    topk = [[(5, -0.125), (7, -2.0)], None, [(1, -0.5)]]  # exact in float32
    matrices = types.TopkLogprobs.from_lists(topk)
    assert topk_to_lists(TinkerTopk(matrices.token_ids, matrices.logprobs)) == topk  # tinker reads our matrices
    assert trio.SampledSequence([1], [-1.0], "length", topk_logprobs=topk).topk_logprobs_np.token_ids.dtype == np.int32


def test_futures_behave_like_pytrios():
    def scenario(completed, pending):
        """The same calls on either SDK's future; `pending()` gives (future, resolve, fail)."""
        out = [completed(3).result(), completed(3).map(lambda x: x * 2).result()]
        fut, resolve, _ = pending()
        mapped = fut.map(lambda x: x + 1)
        out.append((fut.done(), mapped.done()))
        resolve(10)
        out += [fut.result(timeout=5), mapped.result(timeout=5), fut.exception(), fut.done(), fut.cancel()]
        fut, _, fail = pending()
        mapped = fut.map(lambda x: x + 1)
        fail(KeyError("k"))
        out += [type(mapped.exception(timeout=5)).__name__, type(fut.exception(timeout=5)).__name__]
        fut, resolve, _ = pending()
        broken = fut.map(lambda x: x / 0)
        resolve(1)
        out.append(type(broken.exception(timeout=5)).__name__)
        return out

    def pytrio_pending():
        cf = concurrent.futures.Future()
        return pt.APIFuture(cf), cf.set_result, cf.set_exception

    def ours_pending():
        cf = concurrent.futures.Future()
        return trio.APIFuture(cf, request_id=1, op="op"), cf.set_result, cf.set_exception

    assert scenario(pt.APIFuture.completed, pytrio_pending) == scenario(trio.APIFuture.completed, ours_pending)


def test_error_attributes_of_both_sdks():
    probe = pytrio.PyTrioError("m")
    pytrio_attrs = [a for a in vars(probe) if not a.startswith("_")]
    tinker_status_attrs = ["message", "request", "body", "response", "status_code"]
    ours = [trio.InvalidInputError("bad", field="f"), trio.RequestFailedError("failed", client_id="c"),
            trio.PoolClosedError("closed"), trio.ClientClosedError("closed"),
            trio.CheckpointNotFoundError("gone", path="/p")]
    for error in ours:
        assert all(hasattr(error, a) for a in pytrio_attrs), (type(error), pytrio_attrs)
        assert error.diagnostic_fields()["message"] == error.message == str(error)
    for error in (ours[0], ours[4]):
        assert all(hasattr(error, a) for a in tinker_status_attrs)
    assert {c.value for c in tt.RequestErrorCategory} == {c.value for c in errors.RequestErrorCategory}
    failed = ours[1]
    assert (failed.message, failed.request_id, str(failed.category)) == ("failed", "", "unknown")
