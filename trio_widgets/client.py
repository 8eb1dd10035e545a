"""ServiceClient, TrainingClient, SamplingClient: the Tinker / PyTRIO client API.

The client checks what it can without a model (types, shapes, ranges), builds plain-data
requests (trio_widgets.backend) and hands them to a backend: `LocalBackend` over an
in-process `LocalPool` by default. A refused request raises an `InvalidInputError` naming
the field, on the caller's thread, and nothing is queued.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .backend import (
    Backend,
    ComputeLogprobsRequest,
    CreateModelRequest,
    CreateSamplerRequest,
    ForwardRequest,
    FromStateRequest,
    InspectRequest,
    LoadRequest,
    ModelHandle,
    OptimStepRequest,
    Reservation,
    SamplerCreated,
    SampleRequest,
    SaveRequest,
)
from .engine.backend import LocalBackend
from .engine.clock import LocalPool
from .engine.models import DEFAULT_MODEL
from .errors import InvalidInputError, RequestFailedError
from .futures import APIFuture
from .types import (
    AdamParams,
    AdapterSnapshot,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from .validation import check_adam_params, check_batch, check_loss, is_number

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient", "default_pool", "ServerCapabilities",
           "SupportedModel", "TrainingInfo"]

_DEFAULT_POOL: LocalPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_pool() -> LocalPool:
    """The process-wide pool that `ServiceClient()` uses, created on first use."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL.closed:
            # shared by every cell: re-running a cell must not close it
            _DEFAULT_POOL = LocalPool(name="default", owned_by_cell=False)
        return _DEFAULT_POOL


@dataclass
class SupportedModel:
    model_name: str


@dataclass
class ServerCapabilities:
    supported_models: list[SupportedModel]


@dataclass
class ModelData:
    base_model: str
    lora_rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    seed: int


@dataclass
class TrainingInfo:
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _release(backend_ref: weakref.ref[Backend], client_id: str) -> None:
    backend = backend_ref()
    if backend is not None:
        backend.release(client_id)


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
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool(self) -> LocalPool | None:
        """The in-process pool this client's requests run on (None for other backends)."""
        return getattr(self._backend, "pool", None)

    def _submit(self, op: str, request: Any) -> APIFuture:
        return self._backend.submit(self.client_id, op, request)

    def inspect_adapter(self) -> APIFuture[AdapterSnapshot]:
        """A read-only copy of this client's LoRA weights (and, when training, its pending
        gradient and AdamW state), as of the requests submitted before this call."""
        return self._submit("inspect_adapter", InspectRequest())

    async def inspect_adapter_async(self) -> APIFuture[AdapterSnapshot]:
        return self.inspect_adapter()

    def get_tokenizer(self) -> Any:
        tokenizer = self._backend.tokenizer(self._handle.base_model)
        if tokenizer is None:
            raise RuntimeError(f"no tokenizer was saved with {self._handle.base_model!r}")
        return tokenizer


class TrainingClient(_Client):
    """One LoRA run in the pool. Every op returns an APIFuture at once; `*_async` twins
    return it from an awaitable (two await boundaries: submit, then result)."""

    def __init__(self, backend: Backend, handle: ModelHandle, service: ServiceClient):
        super().__init__(backend, handle)
        self._service = service

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<TrainingClient {self.client_id} {self._handle.base_model} rank={self._handle.rank}{state}>"

    # -- forward ops ---------------------------------------------------------------
    def _forward(self, op: str, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None) -> APIFuture:
        loss_fn, config = check_loss(loss_fn, loss_fn_config)
        check_batch(data, loss_fn)
        return self._submit(op, ForwardRequest(list(data), loss_fn, config))

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._forward("forward", data, loss_fn, loss_fn_config)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._forward("forward_backward", data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[Datum],
        loss_fn: Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]],
    ) -> APIFuture[ForwardBackwardOutput]:
        """`loss_fn(data, logprobs)` gets one logprob tensor per datum and returns (loss, metrics).

        As on the hosted services, two requests: a forward gives the logprobs, your loss runs
        here (on a background thread of this client, never on the pool's clock), and its
        gradient d(loss)/d(logprob) goes back as the weights of a forward_backward. Requests
        you submit after this one wait behind it, so an optim_step applies its gradient."""
        if not callable(loss_fn):
            raise InvalidInputError(f"loss_fn must be callable, got {type(loss_fn).__name__}", field="loss_fn")
        check_batch(data, "cross_entropy")
        data = list(data)
        forward = self._submit("forward", ForwardRequest(data, "cross_entropy", {}))
        slot = self._backend.reserve(self.client_id, "forward_backward_custom")
        reported: dict[str, float] = {}
        self._backend.run_in_background(
            lambda: _finish_custom_loss(forward, slot, data, loss_fn, self.client_id, reported))
        return slot.future.map(lambda out: replace(out, loss_fn_output_type="custom", metrics=dict(reported)))

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self._submit("optim_step", OptimStepRequest(check_adam_params(adam_params)))

    async def forward_async(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                            loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                                     loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_backward_custom_async(self, data: Sequence[Datum], loss_fn: Callable
                                            ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward_custom(data, loss_fn)

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self.optim_step(adam_params)

    # -- checkpoints and sampling ------------------------------------------------------
    # State ops run in the client's cycle in submission order, after an optim_step
    # submitted before them. A path is checked and read at submit time.
    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[SaveWeightsResponse]:
        """Adapter weights + AdamW state under `name`; the result's `path` resumes training.
        (`ttl_seconds` is accepted for hosted-service code and ignored: local files stay.)"""
        return self._submit("save_state", SaveRequest(name))

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load the weights only; the AdamW moments and step count start afresh."""
        return self._submit("load_state", LoadRequest(path))

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load the weights and the AdamW state (moments and step): training continues exactly."""
        return self._submit("load_state_with_optimizer", LoadRequest(path))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Write the current weights as a PEFT adapter directory (the result's `path`), for
        `create_sampling_client(model_path=...)` or `peft.PeftModel.from_pretrained(base, path)`."""
        return self._submit("save_weights_for_sampler", SaveRequest(name))

    def _sampler_from(self, created: SamplerCreated) -> SamplingClient:
        return SamplingClient(self._backend, created.sampler)

    def _submit_snapshot(self, name: str | None) -> APIFuture[SamplerCreated]:
        return self._submit("save_weights_for_sampler", SaveRequest(name, make_sampler=True))

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A sampling client over a copy of the weights as of the ops submitted before this call
        (later training does not change what it samples). With `name`, also written to disk."""
        return self._sampler_from(self._submit_snapshot(name).result())

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self._service.create_sampling_client(model_path=model_path)

    async def save_state_async(self, name: str, ttl_seconds: int | None = None) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(name, ttl_seconds)

    async def load_state_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self.load_state_with_optimizer(path)

    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None
                                             ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(name, ttl_seconds)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        return self._sampler_from(await self._submit_snapshot(name))

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        return self.create_sampling_client(model_path)

    # -- info ------------------------------------------------------------------------
    def get_info(self) -> TrainingInfo:
        h = self._handle
        return TrainingInfo(model_id=self.client_id, model_data=ModelData(
            base_model=h.base_model, lora_rank=h.rank, train_attn=h.train_attn, train_mlp=h.train_mlp,
            train_unembed=h.train_unembed, seed=h.seed))

    async def get_info_async(self) -> TrainingInfo:
        return self.get_info()


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
        slot.fail(RequestFailedError(f"forward_backward_custom: {message}", client_id=client_id, cycle=forward.cycle))

    leaves = [o["logprobs"].to_torch().float().requires_grad_(True) for o in out.loss_fn_outputs]
    try:
        loss, metrics = loss_fn(data, leaves)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"the loss function must return (scalar tensor, dict), got {type(loss).__name__}")
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
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not is_number(value):
            return (f"your loss function returned metric {key!r} = {value!r:.60}, which is not a number "
                    f"(return plain numbers or one-element tensors)")
        out[str(key)] = float(value)
    return out


class SamplingClient(_Client):
    """Samples from a frozen snapshot of a LoRA adapter (or from the bare base model).

    Sample requests go through the clock like training requests: every sample of a
    cycle, from every client of the same base model, runs in one batch.
    `sample` / `compute_logprobs` return an APIFuture; as on the hosted services,
    `sample_async` / `compute_logprobs_async` return the result itself after one await.
    When this object is garbage-collected, the pool forgets its adapter.
    """

    def __repr__(self) -> str:
        what = f"rank={self._handle.rank}" if self._handle.rank else "base only"
        return f"<SamplingClient {self.client_id} {self._handle.base_model} {what}>"

    @property
    def model_path(self) -> str | None:
        return self._handle.model_path

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt`; each sequence has `tokens`, `logprobs` and
        `stop_reason` ("stop" or "length"). `prompt_logprobs` (first None) if asked for."""
        if topk_prompt_logprobs:
            raise InvalidInputError("top-k prompt logprobs are not supported by the local pool; pass 0",
                                    field="topk_prompt_logprobs")
        return self._submit("sample", SampleRequest(prompt, num_samples, sampling_params, include_prompt_logprobs))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """The log-probability of each prompt token given the ones before it (the first is None)."""
        return self._submit("compute_logprobs", ComputeLogprobsRequest(prompt))

    async def sample_async(self, prompt: ModelInput, num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0) -> SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str:
        return self._handle.base_model


class ServiceClient:
    """Entry point, as on the hosted services: `ServiceClient()` uses the process-wide pool;
    `ServiceClient(pool)` a pool of yours; `ServiceClient(backend=...)` any backend."""

    def __init__(self, pool: LocalPool | None = None, *, backend: Backend | None = None, base_url: str | None = None,
                 api_key: str | None = None, **_ignored: Any):
        # Extra keywords are accepted so hosted-service code runs unchanged.
        if backend is None and base_url is not None:  # a served pool (trio_widgets/http)
            if pool is not None:
                raise InvalidInputError("give a pool (in-process) or a base_url (a served pool), not both",
                                        field="base_url")
            from .http.client import HttpBackend

            backend = HttpBackend(base_url, api_key)
        if backend is None:
            backend = LocalBackend(pool if pool is not None else default_pool())
        self.backend = backend

    @property
    def pool(self) -> LocalPool | None:
        """The in-process pool behind this client (None for other backends)."""
        return getattr(self.backend, "pool", None)

    def get_server_capabilities(self) -> ServerCapabilities:
        return ServerCapabilities([SupportedModel(name) for name in self.backend.supported_models()])

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return self.get_server_capabilities()

    def create_lora_training_client(self, base_model: str = DEFAULT_MODEL, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None) -> TrainingClient:
        """A new LoRA run. `user_metadata={"name": ...}` labels it in the dashboard."""
        handle = self.backend.create_model(CreateModelRequest(
            base_model, rank, seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed,
            label=_label(user_metadata)))
        return TrainingClient(self.backend, handle, self)

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               user_metadata: dict[str, str] | None = None) -> SamplingClient:
        """Sample from saved weights (`model_path`: a directory from save_weights_for_sampler or
        save_state, or any PEFT LoRA adapter directory) or from a bare `base_model`."""
        handle = self.backend.create_sampler(CreateSamplerRequest(model_path, base_model, _label(user_metadata)))
        return SamplingClient(self.backend, handle)

    def create_training_client_from_state(self, path: str, user_metadata: dict[str, str] | None = None
                                          ) -> TrainingClient:
        """A new training client with the weights of a checkpoint (save_state, save_weights_for_sampler,
        or any PEFT LoRA adapter directory): same base model, rank, alpha and LoRA targets; the
        AdamW state starts afresh, as on the hosted services. To continue a run exactly, use
        `create_training_client_from_state_with_optimizer`."""
        handle = self.backend.create_model_from_state(FromStateRequest(path, False, _label(user_metadata)))
        return TrainingClient(self.backend, handle, self)

    def create_training_client_from_state_with_optimizer(self, path: str,
                                                         user_metadata: dict[str, str] | None = None
                                                         ) -> TrainingClient:
        """A new training client that resumes a save_state checkpoint exactly: its weights and its
        AdamW state (moments and step count)."""
        handle = self.backend.create_model_from_state(FromStateRequest(path, True, _label(user_metadata)))
        return TrainingClient(self.backend, handle, self)

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           user_metadata: dict[str, str] | None = None) -> SamplingClient:
        return self.create_sampling_client(model_path, base_model, user_metadata)

    async def create_training_client_from_state_async(self, path: str, user_metadata: dict[str, str] | None = None
                                                      ) -> TrainingClient:
        return self.create_training_client_from_state(path, user_metadata)

    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, user_metadata: dict[str, str] | None = None) -> TrainingClient:
        return self.create_training_client_from_state_with_optimizer(path, user_metadata)


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
