"""ServiceClient, TrainingClient, SamplingClient: the Tinker / PyTRIO client API.

The client checks what it can without a model (types, shapes, ranges), builds plain-data
requests (trio_widgets.backend) and hands them to a backend: `LocalBackend` over an
in-process `LocalPool` by default. A refused request raises an `InvalidInputError` naming
the field, on the caller's thread, and nothing is queued.

Both SDKs' call styles run unchanged. Where they disagree:

* Client creation returns an object that is the client *and* a future of it
  (`BackcompatTrainingClientFuture` / `BackcompatSamplingClientFuture`): tinker 0.38 code
  calls `.result()` on it or awaits it, pytrio code uses it directly.
* `*_async` methods are not deprecated here (tinker 0.38 emits a FutureWarning for them,
  pytrio 0.2.9 does not): `await tc.forward_backward_async(...)` gives a future, as in both.
* Positional `create_sampling_client` calls in pytrio's order (base_model, model_path) are
  recognised by value; see `ServiceClient.create_sampling_client`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import getpass
import inspect
import json
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from .backend import (
    AttachSampler,
    Backend,
    Capabilities,
    ComputeLogprobsRequest,
    CreateModelRequest,
    CreateSamplerRequest,
    ForwardRequest,
    FromStateRequest,
    GetTokenizer,
    InspectRequest,
    IsBaseModel,
    IsCheckpoint,
    LoadRequest,
    ModelHandle,
    OptimStepRequest,
    Reservation,
    SamplerCreated,
    SampleRequest,
    SamplerHandle,
    SaveRequest,
    SupportedModels,
)
from .connect import DEFAULT_MODEL, Pool, connect
from .connect import default_pool as default_pool
from .errors import ClientClosedError, InvalidInputError, NotSupportedError, RequestErrorCategory, RequestFailedError
from .futures import APIFuture
from .hosted import hosted_only
from .protocol.losses import IGNORE_TARGET
from .protocol.names import same_origin
from .types import (
    AdamOptimizerConfig,
    AdamParams,
    AdapterSnapshot,
    CustomLossInput,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    LoraRunSpec,
    LossHandle,
    ModelData,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    check_text_only,
    finish_sample_response,
    from_sdk,
)
from .validation import (
    check_adam_params,
    check_age_recipients,
    check_batch,
    check_loss,
    check_sample,
    check_ttl,
    check_user_metadata,
    custom_loss_problem,
    is_int,
    is_number,
)

if TYPE_CHECKING:
    import torch

    from .pools import PoolView
    from .rest import RestClient

__all__ = ["BackcompatSamplingClientFuture", "BackcompatTrainingClientFuture", "SamplingClient", "ServiceClient",
           "TrainingClient", "configure", "configure_observability", "default_pool", "shutdown_observability"]

def _release(backend_ref: weakref.ref[Backend], client_id: str) -> None:
    """A dropped client's finalizer. The garbage collector runs it on whatever thread it
    interrupted, maybe inside a lock that a release takes (httpcore's connection pool, under a
    request of this very link: that thread then waited for itself forever), so the backend
    only queues it (`dropped`)."""
    backend = backend_ref()
    if backend is not None:
        backend.release(client_id, dropped=True)


class _WrongTypeError(InvalidInputError, TypeError):
    """A value of the wrong type: tinker raises TypeError there, our checks InvalidInputError."""


class _Client:
    """What training and sampling clients share: a model in a backend, released on close."""

    def __init__(self, backend: Backend, handle: ModelHandle):
        self._backend = backend
        self._handle = handle
        self.client_id = handle.client_id
        # Dropping the object releases the client's state in the pool once its queued
        # requests have run; close() does it now.
        self._finalizer = weakref.finalize(self, _release, weakref.ref(backend), handle.client_id)

    def close(self) -> None:
        """Release this client's state in the pool (adapter, optimizer, queue, dashboard lane).
        Requests already submitted still run; new ones raise ClientClosedError."""
        if self._finalizer.detach() is not None:  # (the finalizer is for dropped clients)
            self._backend.release(self.client_id)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool(self) -> PoolView | None:
        """The in-process pool this client's requests run on (None for other backends)."""
        return self._backend.pool

    def _submit(self, op: str, request: Any) -> APIFuture:
        return self._backend.submit(self.client_id, op, request)

    def inspect_adapter(self) -> APIFuture[AdapterSnapshot]:
        """A read-only copy of this client's LoRA weights (and, when training, its pending
        gradient and AdamW state), as of the requests submitted before this call."""
        return self._submit("inspect_adapter", InspectRequest())

    async def inspect_adapter_async(self) -> APIFuture[AdapterSnapshot]:
        return self.inspect_adapter()

    def get_telemetry(self) -> None:
        """tinker: its SDK's own event reporter, None when off. Off here: the pool's telemetry
        is `pool.telemetry`."""
        return None

    def get_tokenizer(self) -> Any:
        tokenizer = self._backend.call(GetTokenizer(self._handle.base_model))
        if tokenizer is None:
            raise RuntimeError(f"no tokenizer was saved with {self._handle.base_model!r}")
        return tokenizer



_STABILITY = ("record_stability_info only serves tinker's stable_reinforce loss, which the local pool does not "
              "have (engine/losses.py says why); leave it False")
_LOSS_TYPE_INPUT = ("The 'loss_type_input' parameter of forward_backward_custom() is deprecated: the loss always "
                    "receives logprobs. This parameter will be removed in a future release; remove it from your call.")


def _sampler_options(retry_config: Any, record_stability_info: Any) -> None:
    """tinker's sampler options: retries have no local meaning (accepted, ignored); stability
    records are refused, since nothing here could use them."""
    if record_stability_info:
        raise InvalidInputError(_STABILITY, field="record_stability_info")


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(optimizer, AdamOptimizerConfig):
        raise InvalidInputError(f"the local pool implements AdamW only: pass None or AdamOptimizerConfig(), got "
                                f"{type(optimizer).__name__}", field="optimizer")


def _check_text(data: Any, base_model: str) -> None:
    """Image (or other non-text) chunks are refused at submit, naming the datum and base model."""
    if isinstance(data, (list, tuple)):
        for i, datum in enumerate(data):
            if isinstance(datum, Datum) and isinstance(datum.model_input, ModelInput):
                check_text_only(datum.model_input, base_model, field=f"data[{i}].model_input", datum_index=i)


def _auto_shift(data: Any) -> list[Datum]:
    """pytrio's auto_shift: every loss input is aligned with `model_input` (the same length,
    e.g. `target_tokens` = the input tokens); position i is predicted from positions < i, so
    the model reads tokens[:-1] and every input loses its first entry (label 0)."""
    if not isinstance(data, (list, tuple)):
        return data  # check_batch names the problem
    shifted = []
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum) or not isinstance(datum.model_input, ModelInput):
            shifted.append(datum)
            continue
        tokens = datum.model_input.to_ints()
        if len(tokens) < 2:
            raise InvalidInputError(f"auto_shift needs at least 2 tokens (the first has nothing to predict it), "
                                    f"got {len(tokens)}", field=f"data[{i}].model_input", datum_index=i)
        inputs = {}
        for key, td in datum.loss_fn_inputs.items():
            if not td.shape or td.shape[0] != len(tokens):
                raise InvalidInputError(
                    f"with auto_shift=True every loss input is aligned with model_input ({len(tokens)} tokens), "
                    f"got shape {td.shape}", field=f"data[{i}].loss_fn_inputs[{key!r}]", datum_index=i)
            inputs[key] = TensorData(td.to_numpy()[1:], td.dtype)
        shifted.append(Datum(ModelInput.from_ints(tokens[:-1]), inputs))
    return shifted


def _custom_loss_caller(loss_fn: Any, loss_fn_config: Any) -> Callable[[list[Datum], list[torch.Tensor]], Any]:
    """pytrio calls `loss_fn(data, logprobs, loss_fn_config)` when a config is given and the
    function takes it; otherwise (and in tinker) `loss_fn(data, logprobs)`."""
    if isinstance(loss_fn, LossHandle):
        return lambda data, logprobs: _run_loss_handle(loss_fn, data, logprobs)
    if not callable(loss_fn):
        raise InvalidInputError(f"loss_fn must be callable (or a LossHandle), got {type(loss_fn).__name__}",
                                field="loss_fn")
    if loss_fn_config is not None:
        if not isinstance(loss_fn_config, Mapping):
            raise InvalidInputError(f"must be a dict, got {type(loss_fn_config).__name__}", field="loss_fn_config")
        try:
            inspect.signature(loss_fn).bind([], [], loss_fn_config)
        except TypeError:
            pass
        except ValueError:  # no signature (some builtins): call it the 2-argument way
            pass
        else:
            config = loss_fn_config
            return lambda data, logprobs: loss_fn(data, logprobs, config)
    return lambda data, logprobs: loss_fn(data, logprobs)


def _check_handle_inputs(handle: LossHandle, data: list[Datum]) -> None:
    """tinker's check: every datum has each input the loss reads, at its declared rank
    (`logprobs` has the rank of `target_tokens`)."""
    logprobs, *inputs = handle.inputs
    for i, datum in enumerate(data):
        for loss_input, key in [(logprobs, "target_tokens"), *((x, x.name) for x in inputs)]:
            where = f"data[{i}].loss_fn_inputs[{key!r}]"
            if key not in datum.loss_fn_inputs:
                raise InvalidInputError(f"loss {handle.name!r} reads it, and it is missing", field=where,
                                        datum_index=i)
            rank = len(datum.loss_fn_inputs[key].shape)
            if rank != loss_input.rank:
                raise InvalidInputError(f"has rank {rank}, but loss {handle.name!r} declared {loss_input.name} with "
                                        f"rank {loss_input.rank}", field=where, datum_index=i)


def _run_loss_handle(handle: LossHandle, data: list[Datum], logprobs_list: list[torch.Tensor]) -> Any:
    """tinker's run_loss_handle: the per-datum losses summed; `:sum` metrics summed, `:mean`
    metrics averaged over the data."""
    import torch  # custom losses need torch (the client's core install does not)

    total: Any = None
    sums: dict[str, float] = {}
    for datum, logprobs in zip(data, logprobs_list):
        loss, metrics = handle.graph(logprobs, *[datum.loss_fn_inputs[n].to_torch() for n in handle.input_names])
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"loss {handle.name!r} must return a scalar loss, got "
                             f"{getattr(loss, 'shape', type(loss).__name__)}")
        total = loss if total is None else total + loss
        for key, value in (metrics or {}).items():
            sums[key] = sums.get(key, 0.0) + float(value.detach() if isinstance(value, torch.Tensor) else value)
    return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


class TrainingClient(_Client):
    """One LoRA run in the pool. Every op returns an APIFuture at once, so both hosted styles
    work: tinker 0.38's `fb = tc.forward_backward(...); opt = tc.optim_step(...); await fb;
    await opt` (or `.result()` on each), and the `*_async` twins, which return that future
    from an awaitable (two await boundaries: submit, then result).

    Example:
        ```python
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=16)
        fb = tc.forward_backward(batch, "cross_entropy")       # queued for the next cycle
        opt = tc.optim_step(trio.AdamParams(learning_rate=3e-3))
        print(fb.result().metrics["loss:sum"], opt.result().metrics)
        ```"""

    def __init__(self, backend: Backend, handle: ModelHandle, service: ServiceClient):
        super().__init__(backend, handle)
        self._service = service

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<TrainingClient {self.client_id} {self._handle.base_model} rank={self._handle.rank}{state}>"

    # hosted-only names (trio_widgets/hosted.py): they exist, and say why not here
    get_console_url = hosted_only("get_console_url")

    # -- who this run is ----------------------------------------------------------------
    @property
    def model_id(self) -> str:
        """tinker: the training run's id. It names the run's checkpoint directory
        (`tinker://<model_id>/weights/<name>`); `client_id` names its lane in the pool."""
        run_id = self._handle.run_id
        return run_id if run_id is not None else self.client_id

    @property
    def training_run_cuid(self) -> str:
        """pytrio: the training run's id (the same as `model_id`)."""
        return self.model_id

    @property
    def model_alias(self) -> str:
        """pytrio: the base model's name as given."""
        return self._handle.base_model

    @property
    def lora(self) -> LoraRunSpec:
        """pytrio: how this run's adapter was made."""
        h = self._handle
        return LoraRunSpec(model_id=h.base_model, rank=h.rank, seed=h.seed, train_mlp=h.train_mlp,
                           train_attn=h.train_attn, train_unembed=h.train_unembed)

    # -- forward ops ---------------------------------------------------------------
    def _forward(self, op: str, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None,
                 auto_shift: bool) -> APIFuture:
        data = from_sdk(data)  # tinker's or pytrio's Datum: ours, field by field
        _check_text(data, self._handle.base_model)
        if not isinstance(auto_shift, bool):
            raise InvalidInputError(f"must be True or False, got {auto_shift!r}", field="auto_shift")
        if auto_shift:
            data = _auto_shift(data)
        loss_fn, config = check_loss(loss_fn, loss_fn_config)
        check_batch(data, loss_fn)
        return self._submit(op, ForwardRequest(list(data), loss_fn, config))

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None,
                auto_shift: bool = False) -> APIFuture[ForwardBackwardOutput]:
        """Log-probabilities and loss, no gradient. `loss_fn` ignores case (pytrio);
        `auto_shift=True` (pytrio): loss inputs aligned with the input, see `_auto_shift`."""
        return self._forward("forward", data, loss_fn, loss_fn_config, auto_shift)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict | None = None, auto_shift: bool = False
                         ) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of the loss (a sum over tokens) for the next optim_step.
        `metrics` has tinker's `loss:sum` and pytrio's `loss_sum`, `loss_mean`, `token_count`."""
        return self._forward("forward_backward", data, loss_fn, loss_fn_config, auto_shift)

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: Any, loss_fn_config: dict | None = None, *,
                                loss_type_input: Literal["logprobs"] | None = None
                                ) -> APIFuture[ForwardBackwardOutput]:
        """`loss_fn(data, logprobs)` gets one logprob tensor per datum and returns (loss, metrics);
        with `loss_fn_config` (pytrio) a loss that takes a third argument gets it; a
        `LossHandle` from `ServiceClient.create_custom_loss` (tinker) works too.

        As on the hosted services, two requests: a forward gives the logprobs, your loss runs
        here (on a background thread of this client, never on the pool's clock), and its
        gradient d(loss)/d(logprob) goes back as the weights of a forward_backward. Requests
        you submit after this one wait behind it, so an optim_step applies its gradient.
        `metrics["loss:sum"]` (and `loss_sum`) is your loss; `surrogate_loss:sum` the
        weighted cross-entropy that carried its gradient."""
        if loss_type_input is not None:
            warnings.warn(_LOSS_TYPE_INPUT, DeprecationWarning, stacklevel=2)
        call = _custom_loss_caller(loss_fn, loss_fn_config)
        data = from_sdk(data)
        _check_text(data, self._handle.base_model)
        if not isinstance(data, (list, tuple)) or not all(isinstance(d, Datum) for d in data):
            check_batch(data, "cross_entropy")  # names what is wrong
        data = list(data)
        if isinstance(loss_fn, LossHandle):
            _check_handle_inputs(loss_fn, data)
        forward_data = []
        for i, d in enumerate(data):  # only the targets go to the forward, as in tinker
            if "target_tokens" not in d.loss_fn_inputs:
                raise InvalidInputError("a custom loss needs loss_fn_inputs['target_tokens']",
                                        field=f"data[{i}].loss_fn_inputs", datum_index=i)
            forward_data.append(Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]}))
        check_batch(forward_data, "cross_entropy")
        forward = self._submit("forward", ForwardRequest(forward_data, "cross_entropy", {}))
        slot = self._backend.reserve(self.client_id, "forward_backward_custom")
        reported: dict[str, float] = {}
        self._backend.run_in_background(
            lambda: _finish_custom_loss(forward, slot, data, call, self.client_id, reported))
        tokens = sum(t != IGNORE_TARGET for d in forward_data for t in d.loss_fn_inputs["target_tokens"].data)
        return slot.future.map(lambda out: replace(out, loss_fn_output_type="custom",
                                                   metrics=_custom_metrics(reported, out, tokens)))

    def optim_step(self, optim_params: AdamParams | None = None, *,
                   adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """One AdamW step with the accumulated gradient. tinker's `optim_step(params)`,
        `optim_step(optim_params=...)` and `optim_step(adam_params=...)` (pytrio's too)."""
        if optim_params is not None and adam_params is not None:
            raise InvalidInputError("Specify optim_params or legacy adam_params, not both", field="optim_params")
        params = from_sdk(optim_params if optim_params is not None else adam_params)
        if not isinstance(params, AdamParams):
            got = "nothing" if params is None else type(params).__name__
            raise _WrongTypeError(f"Expected AdamParams (the local pool implements AdamW only), got {got}",
                                  field="adam_params")
        return self._submit("optim_step", OptimStepRequest(check_adam_params(params)))

    async def forward_async(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                            loss_fn_config: dict | None = None, auto_shift: bool = False
                            ) -> APIFuture[ForwardBackwardOutput]:
        """The async twin of `forward`: submits the same request and returns its `APIFuture`."""
        return self.forward(data, loss_fn, loss_fn_config, auto_shift)

    async def forward_backward_async(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                                     loss_fn_config: dict | None = None, auto_shift: bool = False
                                     ) -> APIFuture[ForwardBackwardOutput]:
        """The async twin of `forward_backward`: submits the same request and returns its `APIFuture`."""
        return self.forward_backward(data, loss_fn, loss_fn_config, auto_shift)

    async def forward_backward_custom_async(self, data: Sequence[Datum], loss_fn: Any,
                                            loss_fn_config: dict | None = None, *,
                                            loss_type_input: Literal["logprobs"] | None = None
                                            ) -> APIFuture[ForwardBackwardOutput]:
        """The async twin of `forward_backward_custom`: submits the same request and returns its `APIFuture`."""
        return self.forward_backward_custom(data, loss_fn, loss_fn_config, loss_type_input=loss_type_input)

    async def optim_step_async(self, optim_params: AdamParams | None = None, *,
                               adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """The async twin of `optim_step`: submits the same request and returns its `APIFuture`."""
        return self.optim_step(optim_params, adam_params=adam_params)

    # -- checkpoints and sampling ------------------------------------------------------
    # State ops run in the client's cycle in submission order, after an optim_step
    # submitted before them. A path is checked and read at submit time; paths are the
    # checkpoint directories, and tinker's tinker://<run>/<weights|sampler_weights>/<name>
    # names the same directory under the pool's checkpoint_dir.
    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[SaveWeightsResponse]:
        """Adapter weights + AdamW state under `name`; the result's `path` resumes training.
        A name saved before is refused (CheckpointExistsError, tinker's ConflictError) unless
        `overwrite=True`, which replaces it atomically. `ttl_seconds` (1 hour to 10 years)
        deletes it after that time; `user_metadata` is stored with it (RestClient lists it)."""
        if not isinstance(overwrite, bool):
            raise InvalidInputError(f"must be True or False, got {overwrite!r}", field="overwrite")
        return self._submit("save_state", SaveRequest(name, overwrite=overwrite, ttl_seconds=check_ttl(ttl_seconds),
                                                      user_metadata=check_user_metadata(user_metadata)))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[LoadWeightsResponse]:
        """Load the weights only; the AdamW moments and step count start afresh.
        (`weights_access_token` is for hosted weights of another account: local files need none.)"""
        return self._submit("load_state", LoadRequest(path))

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> APIFuture[LoadWeightsResponse]:
        """Load the weights and the AdamW state (moments and step): training continues exactly."""
        return self._submit("load_state_with_optimizer", LoadRequest(path))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Write the current weights as a PEFT adapter directory (the result's `path`), for
        `create_sampling_client(model_path=...)` or `peft.PeftModel.from_pretrained(base, path)`."""
        return self._submit("save_weights_for_sampler", SaveRequest(
            name, ttl_seconds=check_ttl(ttl_seconds), user_metadata=check_user_metadata(user_metadata)))

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None
                              ) -> APIFuture[SaveWeightsExternalResponse]:
        """tinker: the current weights as an export for download, a PEFT adapter directory under
        `external_weights/` (the result's `path`); `RestClient.get_external_weights_urls(path)`
        gives its files' URLs, and tinker_cookbook's `weights.download` fetches them. Over HTTP,
        `age_encryption_recipients` has each file leave the server age-encrypted to them."""
        recipients = check_age_recipients(age_encryption_recipients)
        if recipients is not None and self._backend.pool is not None:
            raise NotSupportedError("save_weights_external(age_encryption_recipients=...) encrypts files that leave "
                                    "a served pool; an in-process pool's checkpoints are on this machine already")
        request = SaveRequest(name, ttl_seconds=check_ttl(ttl_seconds), external=True, age_recipients=recipients)
        return self._submit("save_weights_for_sampler", request).map(lambda r: SaveWeightsExternalResponse(r.path))

    async def save_weights_external_async(self, name: str, ttl_seconds: int | None = None,
                                          age_encryption_recipients: list[str] | None = None
                                          ) -> APIFuture[SaveWeightsExternalResponse]:
        """The async twin of `save_weights_external`: submits the same request and returns its `APIFuture`."""
        return self.save_weights_external(name, ttl_seconds, age_encryption_recipients)

    def _submit_snapshot(self, name: str | None) -> APIFuture[SamplerCreated]:
        return self._submit("save_weights_for_sampler", SaveRequest(name, make_sampler=True))

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: Literal["snapshot"] = "snapshot"
                                             ) -> BackcompatSamplingClientFuture:
        """A sampling client over a copy of the weights as of the ops submitted before this call
        (later training does not change what it samples). Returned at once, as a future of
        the client that is also the client: using it waits for the snapshot's cycle (so
        inside `pool.hold()`, where no cycle runs, call `.result()` on it before the hold).
        With `name`, the snapshot is also written to disk (tinker ignores `name`)."""
        _sampler_options(retry_config, record_stability_info)
        if kind != "snapshot":
            raise InvalidInputError(f"only 'snapshot' (a frozen copy of the weights) is available locally, got "
                                    f"{kind!r}; tinker's 'inflight' shares weights across its servers", field="kind")
        service = self._service
        future = BackcompatSamplingClientFuture._pending(self._backend, self._submit_snapshot(name))
        service._track(future)
        return future

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> BackcompatSamplingClientFuture:
        """A sampler for a saved checkpoint of this run (`model_path`), on the same pool."""
        return self._service.create_sampling_client(model_path=model_path, retry_config=retry_config,
                                                    record_stability_info=record_stability_info)

    async def save_state_async(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None) -> APIFuture[SaveWeightsResponse]:
        """The async twin of `save_state`: submits the same request and returns its `APIFuture`."""
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    async def load_state_async(self, path: str, weights_access_token: str | None = None
                               ) -> APIFuture[LoadWeightsResponse]:
        """The async twin of `load_state`: submits the same request and returns its `APIFuture`."""
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path: str, weights_access_token: str | None = None
                                              ) -> APIFuture[LoadWeightsResponse]:
        """The async twin of `load_state_with_optimizer`: submits the same request and returns its `APIFuture`."""
        return self.load_state_with_optimizer(path)

    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """The async twin of `save_weights_for_sampler`: submits the same request and returns its `APIFuture`."""
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None, retry_config: Any = None,
                                                         record_stability_info: bool = False,
                                                         kind: Literal["snapshot"] = "snapshot") -> SamplingClient:
        """The async twin of `save_weights_and_get_sampling_client`: the same client, awaited."""
        return await self.save_weights_and_get_sampling_client(name, retry_config, record_stability_info, kind)

    async def create_sampling_client_async(self, model_path: str, retry_config: Any = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        """The async twin of `create_sampling_client`: the same client, awaited."""
        return self.create_sampling_client(model_path, retry_config, record_stability_info).result()

    # -- info ------------------------------------------------------------------------
    def get_info(self) -> GetInfoResponse:
        """tinker: `model_id`, `model_data.model_name`, `lora_rank`, ... answered locally."""
        h = self._handle
        data = ModelData(arch=h.arch, model_name=h.base_model, tokenizer_id=h.base_model, base_model=h.base_model,
                         lora_rank=h.rank, train_attn=h.train_attn, train_mlp=h.train_mlp,
                         train_unembed=h.train_unembed, seed=h.seed)
        return GetInfoResponse(model_data=data, model_id=self.model_id, optimizer_config=AdamOptimizerConfig(),
                               is_lora=True, lora_rank=h.rank, model_name=h.base_model)

    async def get_info_async(self) -> GetInfoResponse:
        """The async twin of `get_info`: the same answer, awaited."""
        return self.get_info()


def _custom_metrics(reported: dict[str, float], out: ForwardBackwardOutput, tokens: int) -> dict[str, float]:
    """tinker's: `loss:sum` is the custom loss, `surrogate_loss:sum` what carried its gradient;
    pytrio's keys describe the same custom loss over every target token."""
    metrics = dict(reported)
    metrics["surrogate_loss:sum"] = out.metrics.get("loss:sum", math.nan)
    loss = metrics.get("loss:sum", math.nan)
    metrics.update(loss_sum=loss, token_count=tokens, loss_mean=loss / tokens if tokens else 0.0)
    return metrics


def _finish_custom_loss(forward: APIFuture, slot: Reservation, data: list[Datum], loss_fn: Callable,
                        client_id: str, reported: dict[str, float]) -> None:
    """The middle of a custom loss (background thread): logprobs in, the user's loss, its
    gradient out as cross-entropy weights (Σ -w·logp with w = -dC/dlogp has C's gradient)."""
    try:
        out = forward.result()
    except BaseException as exc:
        slot.fail(exc if isinstance(exc, Exception) else RequestFailedError(str(exc), client_id=client_id))
        return

    def failed(message: str) -> None:
        slot.fail(RequestFailedError(f"forward_backward_custom: {message}", client_id=client_id, cycle=forward.cycle,
                                     category=RequestErrorCategory.User))

    import torch  # custom losses need torch (the client's core install does not)

    leaves = [o["logprobs"].to_torch().float().requires_grad_(True) for o in out.loss_fn_outputs]
    try:
        loss, metrics = loss_fn(data, leaves)
        if (problem := custom_loss_problem(loss)) is not None:
            failed(problem)
            return
        loss.backward()
    except BaseException as exc:  # user code may raise anything, SystemExit included: it fails this request only
        failed(f"your loss function raised {type(exc).__name__}: {exc}")
        return
    user_metrics = _numeric_metrics(metrics)
    if isinstance(user_metrics, str):
        failed(user_metrics)
        return
    grads = [lp.grad if lp.grad is not None else torch.zeros_like(lp) for lp in leaves]
    value = float(loss.detach())
    if not math.isfinite(value) or not all(bool(torch.isfinite(g).all()) for g in grads):
        failed("the loss or its gradient is not finite")
        return
    reported.update(user_metrics)
    reported["loss:sum"] = value
    surrogate = [Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": (-g).tolist()})
                 for d, g in zip(data, grads)]
    slot.fill(ForwardRequest(surrogate, "cross_entropy", {}))


def _numeric_metrics(metrics: Any) -> dict[str, float] | str:
    """A custom loss's metrics as numbers, or what is wrong with them."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        return f"your loss function returned metrics of type {type(metrics).__name__}; return a dict of numbers"
    torch = sys.modules.get("torch")  # a tensor means torch was imported
    out = {}
    for key, value in metrics.items():
        if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not is_number(value):
            return (f"your loss function returned metric {key!r} = {value!r:.60}, which is not a number "
                    f"(return plain numbers or one-element tensors)")
        out[str(key)] = float(value)
    return out


def _handle_fields(handle: Any) -> dict[str, str]:
    """The fields of a sampler handle (get_sampler_handle), checked."""
    try:
        fields = json.loads(base64.urlsafe_b64decode(handle.encode("ascii")))
    except (AttributeError, ValueError, UnicodeError):
        fields = None
    if not isinstance(fields, dict) or fields.get("trio_sampler") != 1 or \
            not all(isinstance(fields.get(k), str) for k in ("base_url", "sampler_id")):
        raise InvalidInputError(f"is not a sampler handle from trio's get_sampler_handle: {str(handle)[:60]!r}",
                                field="handle")
    return fields


class SamplingClient(_Client):
    """Samples from a frozen snapshot of a LoRA adapter (or from the bare base model).

    Sample requests go through the clock like training requests: every sample of a
    cycle, from every client of the same base model, runs in one batch.
    `sample` / `compute_logprobs` return an APIFuture; as on the hosted services,
    `sample_async` / `compute_logprobs_async` return the result itself after one await.
    When this object is garbage-collected, the pool forgets its adapter.

    Example:
        ```python
        sampler = tc.save_weights_and_get_sampling_client("step-200")
        prompt = trio.ModelInput.from_ints(tc.get_tokenizer().encode("12+7="))
        out = sampler.sample(prompt, num_samples=4, sampling_params=trio.SamplingParams(max_tokens=8)).result()
        ```
    """

    def __repr__(self) -> str:
        what = f"rank={self._handle.rank}" if self._handle.rank else "base only"
        return f"<SamplingClient {self.client_id} {self._handle.base_model} {what}>"

    # hosted-only names (trio_widgets/hosted.py): they exist, and say why not here
    create = staticmethod(hosted_only("create"))

    _owner: ServiceClient | None = None  # the connection a client from a handle made for itself

    def get_sampler_handle(self) -> str:
        """tinker: a string that `SamplingClient.from_sampler_handle` turns into a client of this
        same sampler, in any process (a served pool's sampler; no credentials in it). An
        in-process pool's samplers cannot leave the process: NotSupportedError says so."""
        return self._backend.call(SamplerHandle(self.client_id))

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None, base_url: str | None = None
                            ) -> SamplingClient:
        """tinker: a client of the sampler behind `handle` (from `get_sampler_handle`, in any
        process), on its own connection, authenticated with `api_key` (default: $TRIO_API_KEY;
        it must be the key the sampler was made with). Closing it ends that connection; the
        sampler stays its maker's. A key goes only to the server you configured (`base_url`,
        default $TRIO_BASE_URL): a handle naming another server is refused before any request."""
        fields = _handle_fields(handle)
        key = api_key if api_key is not None else os.environ.get("TRIO_API_KEY")
        trusted = base_url if base_url is not None else os.environ.get("TRIO_BASE_URL")
        if key and (trusted is None or not same_origin(trusted, fields["base_url"])):
            # the handle is data from elsewhere: it may say where the sampler is, never where the key goes
            raise InvalidInputError(
                f"the handle names the server {fields['base_url'][:80]!r}, and your API key goes only to the server "
                f"you configured ({'none: pass base_url=... or set TRIO_BASE_URL' if trusted is None else trusted}); "
                f"nothing was sent", field="handle")
        service = ServiceClient(base_url=fields["base_url"], api_key=key)
        try:
            client = SamplingClient(service.backend, service.backend.open(AttachSampler(fields["sampler_id"])))
        except BaseException:
            service.close()
            raise
        client._owner = service
        return client

    def close(self) -> None:
        """Release this sampler once what it already submitted has run; later submits raise `ClientClosedError`."""
        super().close()
        if self._owner is not None:
            self._owner.close()

    def on_queue_state_change(self, queue_state: Any, queue_state_reason: str | None = None) -> None:
        """tinker calls this when the hosted queue pauses (rate limit, capacity); a local pool's
        queue never pauses, so there is nothing to report."""

    @property
    def model_path(self) -> str | None:
        """The checkpoint path this sampler samples from (None for the base model)."""
        return self._handle.model_path

    @property
    def model_id(self) -> str:
        """pytrio: the base model's id."""
        return self._handle.base_model

    @property
    def sampling_run_cuid(self) -> str:
        """pytrio: this sampler's id (tinker's sampler_id, for RestClient.get_sampler)."""
        return self.client_id

    def _prompt(self, prompt: Any) -> Any:
        """A list of token ids is a ModelInput (as the engine reads it), here for every backend;
        so is tinker's or pytrio's ModelInput."""
        prompt = from_sdk(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            prompt = ModelInput.from_ints([int(t) for t in prompt])
        if isinstance(prompt, ModelInput):
            check_text_only(prompt, self._handle.base_model, field="prompt")
        return prompt

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: TensorData | None = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None, *, return_text: bool = True
               ) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt` (tinker's positional order). Each sequence has
        `tokens`, `logprobs` (the model's, temperature 1), `stop_reason` ("stop" or "length"),
        `sequence_id`, and `text` (pytrio; the decoded tokens, with `return_text`, where the base
        model has a tokenizer). On request: `prompt_logprobs` (first None; only the last
        `prompt_logprobs_last_n`), `topk_prompt_logprobs` / `topk_sample_logprobs` (the k most
        likely (token, logprob) per position), `target_prompt_logprobs` and `prompt_alt_tokens`.
        `return_text` is keyword-only: pytrio's sixth positional parameter is tinker's
        `topk_sample_logprobs`."""
        if isinstance(topk_sample_logprobs, bool):
            raise InvalidInputError("got a bool: in pytrio's order the sixth argument is return_text, here (tinker's "
                                    "order) it is topk_sample_logprobs; pass return_text=... by keyword",
                                    field="topk_sample_logprobs")
        if not isinstance(return_text, bool):
            raise InvalidInputError(f"must be True or False, got {return_text!r}", field="return_text")
        prompt = self._prompt(prompt)
        sampling_params = from_sdk(sampling_params)
        # the checks that need no model, here for every backend (the engine runs the rest)
        check_sample(prompt, num_samples, sampling_params, include_prompt_logprobs)
        future = self._submit("sample", SampleRequest(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs, prompt_logprobs_last_n=prompt_logprobs_last_n,
            target_prompt_logprobs=target_prompt_logprobs, prompt_alt_tokens_k=prompt_alt_tokens_k))
        length = prompt.length if isinstance(prompt, ModelInput) else len(prompt)
        decode = None
        if return_text:
            tokenizer = self._backend.call(GetTokenizer(self._handle.base_model))
            decode = tokenizer.decode if tokenizer is not None else None
        return future.map(lambda response: finish_sample_response(response, length, decode))

    def compute_logprobs(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
                         ) -> APIFuture[list[float | None]]:
        """The log-probability of each prompt token given the ones before it (the first is None;
        with `prompt_logprobs_last_n`, every entry before the last n is None too)."""
        prompt = self._prompt(prompt)
        return self._submit("compute_logprobs", ComputeLogprobsRequest(prompt, prompt_logprobs_last_n))

    async def sample_async(self, prompt: ModelInput, num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
                           target_prompt_logprobs: TensorData | None = None, prompt_alt_tokens_k: int = 0,
                           prompt_logprobs_last_n: int | None = None, *, return_text: bool = True
                           ) -> SampleResponse:
        """The async twin of `sample`: submits the same request and returns its `APIFuture`."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, topk_sample_logprobs, target_prompt_logprobs,
                                 prompt_alt_tokens_k, prompt_logprobs_last_n, return_text=return_text)

    async def compute_logprobs_async(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
                                     ) -> list[float | None]:
        """The async twin of `compute_logprobs`: submits the same request and returns its `APIFuture`."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_base_model(self) -> str:
        """The base model this sampler's adapter belongs to."""
        return self._handle.base_model

    async def get_base_model_async(self) -> str:
        """The async twin of `get_base_model`: the same answer, awaited."""
        return self.get_base_model()

# -- clients that are futures of themselves (tinker 0.38's creation methods) ---------------

class _ClientFuture(APIFuture):
    """A client that is also an `APIFuture` of itself, as tinker 0.38's creation methods
    return: `.result()`, `await`, `.future()`, `.map()`... give the client, and the object can
    be used as the client directly (pytrio's style, and tinker's older one). What they give is
    the client as both SDKs' `.result()` and pytrio's methods return it: a plain TrainingClient
    / SamplingClient, neither a future nor awaitable (`_client`).

    Most clients exist at once, so this future is done. A sampling client made by
    `save_weights_and_get_sampling_client` waits for its snapshot's cycle: until then the
    future is pending, and using it as the client waits for it. The future never holds the
    client itself (that would keep a dropped client alive until the garbage collector runs):
    what it gives out is made on demand.
    """

    request_id = None
    op = "create_client"
    _creation: APIFuture | None = None  # the pending snapshot; None: the client exists

    def _await_creation(self, timeout: float | None = None) -> None:
        if self._creation is not None:
            self._creation.result(timeout)
            self._adopt(self._creation.result())

    def _adopt(self, created: Any) -> None:  # pragma: no cover - only pending futures have a creation
        raise NotImplementedError

    @property
    def cycle(self) -> int | None:
        return self._creation.cycle if self._creation is not None else None

    _plain_class: type  # the plain client class `_client` makes

    def _client(self) -> Any:
        """The client this future gives: an object of the plain client class sharing this
        one's state (its `__dict__`), the same one while it lives. It holds this future, so
        the pool lets the client go once both are dropped (or either is closed)."""
        ref = self.__dict__.get("_plain_ref")
        client: Any = ref() if ref is not None else None
        if client is None:
            client = object.__new__(self._plain_class)
            client.__dict__ = self.__dict__
            client._client_future = self
            self.__dict__["_plain_ref"] = weakref.ref(client)
        return client

    def result(self, timeout: float | None = None) -> Any:
        self._await_creation(timeout)
        return self._client()

    async def result_async(self, timeout: float | None = None) -> Any:
        if self._creation is not None:
            self._adopt(await self._creation.result_async(timeout))
        return self._client()

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result_async().__await__()

    def future(self) -> concurrent.futures.Future:
        """A `concurrent.futures.Future` of the client (made on each call)."""
        return self.map(lambda client: client).future()

    def done(self) -> bool:
        return self._creation is None or self._creation.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._creation.exception(timeout) if self._creation is not None else None

    def cancel(self) -> bool:
        """A pending snapshot still queued is withdrawn (the client then never exists)."""
        return self._creation.cancel() if self._creation is not None else False

    def cancelled(self) -> bool:
        return self._creation is not None and self._creation.cancelled()

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        if self._creation is None:
            fn(self)
        else:
            self._creation.add_done_callback(lambda _f: fn(self))

    def map(self, transform: Callable[[Any], Any]) -> APIFuture:
        if self._creation is None:
            try:
                return APIFuture.completed(transform(self._client()))
            except Exception as exc:
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(exc)
                return APIFuture(failed, request_id=None, op=self.op)
        return self._creation.map(lambda created: transform(self._adopted(created)))

    def _adopted(self, created: Any) -> Any:
        self._adopt(created)
        return self._client()


class _PlainTrainingClient(TrainingClient):
    """What a BackcompatTrainingClientFuture gives: the TrainingClient itself, not a future."""

    __slots__ = ("_client_future",)


class _PlainSamplingClient(SamplingClient):
    """What a BackcompatSamplingClientFuture gives: the SamplingClient itself, not a future."""

    __slots__ = ("_client_future",)




class BackcompatTrainingClientFuture(TrainingClient, _ClientFuture):
    """What tinker 0.38's `create_lora_training_client` (and `create_training_client_from_state*`)
    return: the TrainingClient, and a done future of it (`.result()` / `await` give it)."""

    _plain_class = _PlainTrainingClient

    def __repr__(self) -> str:
        return TrainingClient.__repr__(self)


class BackcompatSamplingClientFuture(SamplingClient, _ClientFuture):
    """What tinker 0.38's `create_sampling_client` and `save_weights_and_get_sampling_client`
    return: the SamplingClient, and a future of it. A snapshot's future is pending until its
    cycle ran; using it as the client (`.sample(...)`, pytrio's style) waits until then."""

    _lock: threading.Lock
    _plain_class = _PlainSamplingClient

    @classmethod
    def _pending(cls, backend: Backend, creation: APIFuture[SamplerCreated]) -> BackcompatSamplingClientFuture:
        self = cls.__new__(cls)
        self._backend = backend
        self._creation = creation
        self._lock = threading.Lock()
        me = weakref.ref(self)
        backend_ref = weakref.ref(backend)

        def created(f: APIFuture) -> None:  # on the clock thread: adopt, or release if already dropped
            if f.cancelled() or f.exception() is not None:
                return
            client = me()
            if client is None:
                _release(backend_ref, f.result().sampler.client_id)
            else:
                client._adopt(f.result())

        creation.add_done_callback(created)
        return self

    def _adopt(self, created: Any) -> None:
        with self._lock:
            if "_handle" in self.__dict__:
                return
            handle = created.sampler
            self._finalizer = weakref.finalize(self, _release, weakref.ref(self._backend), handle.client_id)
            self.client_id = handle.client_id
            self._handle = handle

    def __getattr__(self, name: str) -> Any:
        # only reached while the snapshot is pending (these are set once it is made)
        if name in ("_handle", "client_id", "_finalizer") and self.__dict__.get("_creation") is not None:
            self._await_creation()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if "_handle" not in self.__dict__:
            state = "cancelled" if self.cancelled() else "failed" if self.done() else "pending"
            return f"<BackcompatSamplingClientFuture: {state}>"
        return SamplingClient.__repr__(self)


# -- the entry point -----------------------------------------------------------------------

_CLOSE_STATUSES = ("success", "errored", "interrupted")


class ServiceClient:
    """Entry point, as on the hosted services: `ServiceClient()` uses the process-wide pool;
    `ServiceClient(pool)` (or `pool=`) a pool of yours; `ServiceClient(backend=...)` any backend.

    The first positional argument is read by its type: a LocalPool is the pool, a str is
    pytrio's api_key, a dict tinker's user_metadata (a second one is tinker's project_id).
    `base_url=` (with `api_key=`) sends the requests to a served pool (`trio.serve`) over HTTP;
    without it, account options (api_key, project_id, ...) are accepted and ignored.
    `with ServiceClient(pool) as sc:` closes the clients it made on exit (not the pool).
    """

    def __init__(self, *args: Any, user_metadata: dict[str, str] | None = None, project_id: str | None = None,
                 display_name: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 default_headers_overrides: Mapping[str, str] | None = None, pool: Pool | None = None,
                 backend: Backend | None = None, **kwargs: Any):
        if len(args) > 2:
            raise TypeError(f"ServiceClient takes at most 2 positional arguments, got {len(args)}")
        if args:
            first = args[0]
            if isinstance(first, Pool):
                if pool is not None:
                    raise TypeError("ServiceClient got a pool both by position and as pool=")
                pool = first
            elif isinstance(first, str):
                api_key = first  # pytrio's api_key (ignored)
            elif first is None or isinstance(first, dict):
                user_metadata = first if first is not None else user_metadata
            else:
                raise InvalidInputError(f"expected a LocalPool, an api_key (str) or user_metadata (dict), got "
                                        f"{type(first).__name__}", field="ServiceClient()")
            if len(args) == 2:
                project_id = args[1]  # tinker's project: one more account option, ignored
        del project_id, default_headers_overrides  # accepted for hosted-service code
        if kwargs:
            warnings.warn(f"ServiceClient ignores unsupported arguments: {', '.join(sorted(kwargs))}.",
                          FutureWarning, stacklevel=2)
        user_metadata = check_user_metadata(user_metadata)
        self._own_backend: Backend | None = None  # made here from base_url: its session ends with close()
        if backend is None:
            backend, owned = connect(pool, base_url=base_url, api_key=api_key, user_metadata=user_metadata,
                                     display_name=display_name)
            if owned:
                self._own_backend = backend
        elif pool is not None:
            raise TypeError("ServiceClient takes a pool or a backend, not both")
        self.backend = backend
        self.user_metadata = user_metadata
        self._clients: weakref.WeakSet[_Client] = weakref.WeakSet()
        self._closed = False
        # pytrio's identity of the session, for code that prints it: the local user
        self._cuid = f"session-{id(self):x}"  # until (or unless) the backend names the session
        self.username: str = _local_user()
        self.display_name: str = display_name or self.username
        self.user_id: str = self.username
        self.user_cuid: str = self.username
        self.user_info: dict[str, object] = {"username": self.username, "source": "local"}
        self.workspace_cuid: str = "local"
        self.workspace_name: str = "local"

    @property
    def pool(self) -> PoolView | None:
        """The in-process pool behind this client (None for other backends)."""
        return self.backend.pool

    @property
    def service_session_cuid(self) -> str:
        """pytrio's identity of the session: the backend's session id (over HTTP, asking opens it)."""
        return self.backend.session_id or self._cuid

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<ServiceClient {self.service_session_cuid} {self.backend!r}{state}>"

    # hosted-only names (trio_widgets/hosted.py): they exist, and say why not here
    get_console_url = hosted_only("get_console_url")
    copy_weights = hosted_only("copy_weights")

    @property
    def holder(self) -> Any:
        """tinker's internal connection holder (deprecated there): none here."""
        hosted_only("holder")(self)

    # -- lifecycle -------------------------------------------------------------------
    def close(self, status: Literal["success", "errored", "interrupted"] = "success",
              detail: str | None = None) -> APIFuture[None]:
        """tinker: end the session. Every client it made is closed (what they submitted still
        runs); the pool stays open. Over HTTP (`base_url=`) the session is finished on the server
        and this client's connection threads stop, so a result not yet delivered fails with
        ClientClosedError. A second call does nothing. Returns a done future."""
        if status not in _CLOSE_STATUSES:
            raise InvalidInputError(f"must be one of {', '.join(_CLOSE_STATUSES)}, got {status!r}", field="status")
        if not self._closed:
            self._closed = True
            for client in list(self._clients):
                client.close()
            if self._own_backend is not None:
                self._own_backend.close()
        return APIFuture.completed(None)

    @property
    def closed(self) -> bool:
        """True once `close()` has run."""
        return self._closed

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        status: Literal["success", "errored", "interrupted"] = "success"
        if exc_type is not None:
            status = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "errored"
        self.close(status).result()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("this ServiceClient was closed: create a new one")

    def _track(self, client: _Client) -> None:
        self._clients.add(client)

    # -- what the service offers ---------------------------------------------------------
    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """Each model with its context length and limits (tinker's and pytrio's fields). tinker
        0.38 prefers `RestClient().get_server_capabilities()`, which works here too."""
        return self.backend.call(Capabilities())

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        """The async twin of `get_server_capabilities`: the same answer, awaited."""
        return self.get_server_capabilities()

    def get_telemetry(self) -> None:
        """tinker: its SDK's own event reporter, None when off. Off here (see `pool.telemetry`)."""
        return None

    def get_supported_models(self) -> list[str]:
        """pytrio: the names of the models this pool can train and sample."""
        return self.backend.call(SupportedModels())

    def create_rest_client(self) -> RestClient:
        """A RestClient over this session's pool (tinker 0.38 also lets you build `RestClient()`)."""
        from .rest import RestClient

        return RestClient(self)

    def create_custom_loss(self, fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> APIFuture[LossHandle]:
        """tinker: a per-datum loss `fn(logprobs, <one parameter per loss_fn_inputs key>) ->
        (scalar loss, {"custom/<name>:sum" or ":mean": value})`, for `forward_backward_custom`.
        `input_ranks` gives each parameter's rank (0 scalar, 1 [T], 2 [T, K]). The function
        runs here, as is (tinker traces it with torch.fx first)."""
        inputs = _custom_loss_inputs(fn, input_ranks)
        return APIFuture.completed(LossHandle(name=_fn_name(fn), inputs=inputs,
                                              session_id=self.service_session_cuid, graph=fn))

    # -- clients ---------------------------------------------------------------------
    def _training_client(self, handle: ModelHandle) -> BackcompatTrainingClientFuture:
        client = BackcompatTrainingClientFuture(self.backend, handle, self)
        self._track(client)
        return client

    def create_lora_training_client(self, base_model: str = DEFAULT_MODEL, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None, optimizer: Any = None
                                    ) -> BackcompatTrainingClientFuture:
        """A new LoRA run: the client, which is also a done future of it (tinker 0.38's
        `.result()` / `await` work). `user_metadata={"name": ...}` labels it in the dashboard.
        `optimizer`: None or AdamOptimizerConfig() (AdamW is the only optimizer here)."""
        self._check_open()
        _check_optimizer(optimizer)
        handle = self.backend.open(CreateModelRequest(
            base_model, rank, seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed,
            label=_label(user_metadata), user_metadata=check_user_metadata(user_metadata)))
        return self._training_client(handle)

    async def create_lora_training_client_async(self, base_model: str = DEFAULT_MODEL, rank: int = 32,
                                                seed: int | None = None, train_mlp: bool = True,
                                                train_attn: bool = True, train_unembed: bool = True,
                                                user_metadata: dict[str, str] | None = None,
                                                optimizer: Any = None) -> TrainingClient:
        """The async twin of `create_lora_training_client`: the same client, awaited."""
        return self.create_lora_training_client(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                                                user_metadata, optimizer).result()

    def _resolve_sampler_paths(self, model_path: Any, base_model: Any) -> tuple[Any, Any]:
        """(model_path, base_model) from a call in tinker's order or pytrio's
        `create_sampling_client(base_model, model_path)`: a value that names a base model and
        no checkpoint is a base model; one that names both is ambiguous."""
        backend = self.backend

        def is_model(value: Any) -> bool:
            return backend.call(IsBaseModel(value))

        def is_checkpoint(value: Any) -> bool:
            return backend.call(IsCheckpoint(value))

        def kind(value: Any) -> str | None:
            if value is None:
                return None
            model, checkpoint = is_model(value), is_checkpoint(value)
            if model and checkpoint:
                raise InvalidInputError(f"{value!r} is both a base model and a checkpoint directory; pass "
                                        f"model_path=... and base_model=... by keyword", field="model_path")
            return "model" if model else "checkpoint" if checkpoint else "unknown"

        path_kind, base_kind = kind(model_path), kind(base_model)
        if path_kind == "model" and base_kind in (None, "checkpoint"):
            return base_model, model_path  # pytrio's order: (base_model, model_path)
        return model_path, base_model

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False, *,
                               user_metadata: dict[str, str] | None = None) -> BackcompatSamplingClientFuture:
        """Sample from saved weights (`model_path`: a directory from save_weights_for_sampler or
        save_state, its tinker:// path, or any PEFT LoRA adapter directory) or from a bare
        `base_model`. Both SDKs' positional orders work: tinker's (model_path, base_model) and
        pytrio's (base_model, model_path), told apart by what the values name. `retry_config`
        is accepted and ignored (no retries locally)."""
        self._check_open()
        _sampler_options(retry_config, record_stability_info)
        model_path, base_model = self._resolve_sampler_paths(model_path, base_model)
        handle = self.backend.open(CreateSamplerRequest(model_path, base_model, _label(user_metadata)))
        client = BackcompatSamplingClientFuture(self.backend, handle)
        self._track(client)
        return client

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None, optimizer: Any = None
                                          ) -> BackcompatTrainingClientFuture:
        """A new training client with the weights of a checkpoint (save_state, save_weights_for_sampler,
        or any PEFT LoRA adapter directory): same base model, rank, alpha and LoRA targets; the
        AdamW state starts afresh, as on the hosted services. To continue a run exactly, use
        `create_training_client_from_state_with_optimizer`. `base_model`, if given, must be the
        checkpoint's."""
        self._check_open()
        _check_optimizer(optimizer)
        handle = self.backend.open(FromStateRequest(
            path, False, _label(user_metadata), base_model=base_model,
            user_metadata=check_user_metadata(user_metadata)))
        return self._training_client(handle)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None
                                                         ) -> BackcompatTrainingClientFuture:
        """A new training client that resumes a save_state checkpoint exactly: its weights and its
        AdamW state (moments and step count)."""
        self._check_open()
        handle = self.backend.open(FromStateRequest(
            path, True, _label(user_metadata), base_model=base_model,
            user_metadata=check_user_metadata(user_metadata)))
        return self._training_client(handle)

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           retry_config: Any = None, record_stability_info: bool = False, *,
                                           user_metadata: dict[str, str] | None = None) -> SamplingClient:
        """The async twin of `create_sampling_client`: the same client, awaited."""
        return self.create_sampling_client(model_path, base_model, retry_config, record_stability_info,
                                           user_metadata=user_metadata).result()

    async def create_training_client_from_state_async(self, path: str, base_model: str | None = None,
                                                      user_metadata: dict[str, str] | None = None,
                                                      weights_access_token: str | None = None,
                                                      optimizer: Any = None) -> TrainingClient:
        """The async twin of `create_training_client_from_state`: the same client, awaited."""
        return self.create_training_client_from_state(path, base_model, user_metadata, weights_access_token,
                                                      optimizer).result()

    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
            weights_access_token: str | None = None) -> TrainingClient:
        """The async twin of `create_training_client_from_state_with_optimizer`: the same client, awaited."""
        return self.create_training_client_from_state_with_optimizer(path, base_model, user_metadata,
                                                                     weights_access_token).result()


def _local_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (e.g. a container without one)
        return "local"


def _label(user_metadata: dict[str, str] | None) -> str | None:
    if user_metadata is None:
        return None
    if not isinstance(user_metadata, dict):
        raise InvalidInputError(f"must be a dict of strings, got {type(user_metadata).__name__}",
                                field="user_metadata")
    name = user_metadata.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidInputError(f"'name' must be a string, got {type(name).__name__}", field="user_metadata")
    return name


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _custom_loss_inputs(fn: Any, input_ranks: Any) -> tuple[CustomLossInput, ...]:
    """tinker's rules for a custom loss's parameters: `logprobs` first, then one plain
    positional parameter per loss_fn_inputs key it reads, each with a rank in `input_ranks`."""
    if not callable(fn):
        raise InvalidInputError(f"must be a function, got {type(fn).__name__}", field="fn")
    name = _fn_name(fn)
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name != "logprobs":
        raise InvalidInputError(f"{name} must take logprobs as its first parameter, followed by the loss_fn_inputs "
                                f"it reads, e.g. def loss(logprobs, advantages)", field="fn")
    for param in params:
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) or param.default is not param.empty:
            raise InvalidInputError(f"{name} parameter {param.name!r} must be a plain positional parameter without a "
                                    f"default (each names a required loss_fn_inputs key)", field="fn")
    names = [p.name for p in params]
    if not isinstance(input_ranks, Mapping) or set(input_ranks) != set(names):
        got = sorted(input_ranks) if isinstance(input_ranks, Mapping) else type(input_ranks).__name__
        raise InvalidInputError(f"must give a rank for each parameter of {name} ({', '.join(names)}), got {got}",
                                field="input_ranks")
    for key in names:
        if input_ranks[key] not in (0, 1, 2) or isinstance(input_ranks[key], bool):
            raise InvalidInputError(f"{key}: a rank is 0 (scalar), 1 ([T]) or 2 ([T, K]), got {input_ranks[key]!r}",
                                    field="input_ranks")
    if input_ranks["logprobs"] == 0:
        raise InvalidInputError("logprobs has rank 1 ([T]) or 2 ([T, K])", field="input_ranks")
    return tuple(CustomLossInput(name=key, rank=int(input_ranks[key])) for key in names)


# -- pytrio's module-level configuration -------------------------------------------------------

_PYTRIO_OPTIONS = frozenset({
    "api_key", "base_url", "request_timeout_seconds", "retry_max_attempts", "retry_initial_delay_seconds",
    "retry_multiplier", "retry_max_delay_seconds", "retry_jitter_ratio", "training_retry_timeout_seconds",
    "control_retry_timeout_seconds", "sampling_retry_timeout_seconds", "actor_capacity_poll_interval_seconds",
    "actor_capacity_poll_jitter_ratio", "actor_capacity_wait_timeout_seconds", "sampling_timeout_seconds",
    "sampling_first_chunk_timeout_seconds", "sampling_chunk_idle_timeout_seconds",
    "actor_event_submit_timeout_seconds", "actor_event_polling_timeout_seconds", "training_event_max_in_flight",
    "training_event_queue_capacity", "sampling_request_max_in_flight", "sampling_request_queue_capacity",
    "actor_heartbeat_enabled", "actor_heartbeat_interval_seconds", "actor_heartbeat_max_in_flight", "log_level",
    "home", "env"})


def configure(**options: Any) -> None:
    """pytrio: connection, retry and logging options of the hosted SDK. A local pool has no
    connection to configure, so every known option is accepted and ignored; an unknown one
    warns, as pytrio does."""
    for name in sorted(set(options) - _PYTRIO_OPTIONS):
        warnings.warn(f"Unknown configuration option {name!r} was ignored.", UserWarning, stacklevel=2)


def configure_observability(*, enabled: bool = True) -> None:
    """pytrio: OpenTelemetry export of the hosted SDK's spans. Nothing to export here (the
    pool's own telemetry is `pool.telemetry`): a no-op."""


def shutdown_observability() -> None:
    """pytrio: flush the OpenTelemetry exporter; a no-op here."""

