"""ServiceClient and TrainingClient: the Tinker / PyTRIO client API over a LocalPool.

Every check on user input happens here, at submit time, on the caller's thread: a
rejected request raises an `InvalidInputError` and never reaches the pool.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .engine import checkpoints as _ckpt
from .engine import sampling as _sampling
from .engine.clock import LocalPool, Tenant
from .engine.compute import ForwardJob, PreparedDatum
from .engine.lora import LoRAAdapter
from .engine.losses import FLOAT_INPUTS, LOSSES, REQUIRED_INPUTS, resolved_config
from .engine.models import DEFAULT_MODEL, BaseModel
from .errors import InvalidInputError
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
    TensorData,
)

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient", "default_pool", "ServerCapabilities",
           "SupportedModel", "TrainingInfo"]

_DEFAULT_POOL: LocalPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_pool() -> LocalPool:
    """The process-wide pool that `ServiceClient()` uses, created on first use."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL.closed:
            _DEFAULT_POOL = LocalPool(name="default")
            _DEFAULT_POOL._cell_id = None  # shared by every cell: never auto-closed on a re-run
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


# -- input validation --------------------------------------------------------------

def _as_tensor_data(value: Any, where: str, index: int) -> TensorData:
    try:
        return TensorData.from_any(value)
    except TypeError as exc:
        raise InvalidInputError(str(exc), field=where, datum_index=index) from None


def _check_tokens(tokens: Sequence[int], vocab: int, where: str, index: int) -> None:
    for pos, tok in enumerate(tokens):
        if not (0 <= tok < vocab):
            raise InvalidInputError(
                f"token id {tok} at position {pos} is outside the vocabulary [0, {vocab})",
                field=where, datum_index=index)


def prepare_data(data: Sequence[Datum], base: BaseModel, loss_fn: str) -> list[PreparedDatum]:
    """Validate a batch against the model and the loss, and turn it into tensors."""
    if isinstance(data, Datum):
        raise InvalidInputError("expected a list of Datum, got a single Datum (wrap it in a list)", field="data")
    if not isinstance(data, (list, tuple)) or len(data) == 0:
        raise InvalidInputError("the batch is empty: pass at least one Datum", field="data")
    needed = REQUIRED_INPUTS.get(loss_fn, ("target_tokens",))
    prepared = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        if not isinstance(datum, Datum):
            raise InvalidInputError(f"expected a Datum, got {type(datum).__name__}", field=where, datum_index=i)
        if not isinstance(datum.model_input, ModelInput):
            raise InvalidInputError("model_input must be a ModelInput", field=f"{where}.model_input", datum_index=i)
        tokens = datum.model_input.to_ints()
        length = len(tokens)
        if length == 0:
            raise InvalidInputError("model_input is empty", field=f"{where}.model_input", datum_index=i)
        if length > base.context_length:
            raise InvalidInputError(
                f"model_input has {length} tokens, more than the context of {base.name} ({base.context_length})",
                field=f"{where}.model_input", datum_index=i)
        _check_tokens(tokens, base.vocab_size, f"{where}.model_input", i)
        for key in needed:
            if key not in datum.loss_fn_inputs:
                have = ", ".join(sorted(datum.loss_fn_inputs)) or "nothing"
                raise InvalidInputError(
                    f"loss {loss_fn!r} needs loss_fn_inputs[{key!r}] (got {have})",
                    field=f"{where}.loss_fn_inputs", datum_index=i)
        inputs: dict[str, torch.Tensor] = {}
        target = None
        for key, raw in datum.loss_fn_inputs.items():
            field_name = f"{where}.loss_fn_inputs[{key!r}]"
            td = _as_tensor_data(raw, field_name, i)
            if len(td.data) != length:
                raise InvalidInputError(
                    f"has length {len(td.data)} but model_input has length {length}", field=field_name, datum_index=i)
            if key == "target_tokens":
                if td.dtype != "int64":
                    raise InvalidInputError("target tokens must be integers, got floats", field=field_name, datum_index=i)
                _check_tokens(td.data, base.vocab_size, field_name, i)
                target = torch.tensor(td.data, dtype=torch.long)
            elif key in FLOAT_INPUTS:
                values = np.asarray(td.data, dtype=np.float64)
                bad = np.flatnonzero(~np.isfinite(values))
                if bad.size:
                    raise InvalidInputError(
                        f"value {values[bad[0]]} at position {int(bad[0])} is not finite (NaN or infinite)",
                        field=field_name, datum_index=i)
                inputs[key] = torch.tensor(td.data, dtype=torch.float32)
        prepared.append(PreparedDatum(torch.tensor(tokens, dtype=torch.long), target, inputs))
    return prepared


def check_adam_params(params: Any) -> AdamParams:
    if not isinstance(params, AdamParams):
        raise InvalidInputError(f"expected AdamParams, got {type(params).__name__}", field="adam_params")
    lr = params.learning_rate
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise InvalidInputError(f"must be a finite number > 0, got {lr!r}", field="adam_params.learning_rate")
    for name in ("beta1", "beta2"):
        value = getattr(params, name)
        if not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise InvalidInputError(f"must be in [0, 1), got {value!r}", field=f"adam_params.{name}")
    for name in ("eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise InvalidInputError(f"must be a finite number >= 0, got {value!r}", field=f"adam_params.{name}")
    return AdamParams(**vars(params))  # a copy: later edits by the caller don't reach the queued step


# -- clients ---------------------------------------------------------------------------

class TrainingClient:
    """One LoRA run in the pool. Every op returns an APIFuture at once; `*_async` twins
    return it from an awaitable (two await boundaries: submit, then result)."""

    def __init__(self, pool: LocalPool, tenant: Tenant, service: "ServiceClient"):
        self._pool = pool
        self._tenant = tenant
        self._service = service
        self.client_id = tenant.client_id
        # Dropping the object releases the run's adapter, optimizer state, queue and lane
        # once its queued requests have run; close() does it now.
        self._finalizer = weakref.finalize(self, _retire, weakref.ref(pool), tenant.client_id)

    def __repr__(self) -> str:
        state = " closed" if not self._finalizer.alive else ""
        return f"<TrainingClient {self.client_id} {self._tenant.base.name} rank={self._tenant.rank}{state}>"

    @property
    def pool(self) -> LocalPool:
        return self._pool

    def close(self) -> None:
        """Release this run's state in the pool (adapter, optimizer, queue, dashboard lane).
        Requests already submitted still run; new ones raise ClientClosedError."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forward ops ---------------------------------------------------------------
    def _forward_job(self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None,
                     backward: bool) -> tuple[ForwardJob, int]:
        if not isinstance(loss_fn, str) or loss_fn not in LOSSES:
            raise InvalidInputError(f"unknown loss_fn {loss_fn!r}; choose one of {', '.join(LOSSES)}",
                                    field="loss_fn")
        try:
            config = resolved_config(loss_fn, loss_fn_config)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(str(exc).strip('"'), field="loss_fn_config") from None
        prepared = prepare_data(data, self._tenant.base, loss_fn)
        job = ForwardJob(adapter=None, data=prepared, loss_fn=loss_fn, config=config, backward=backward)
        return job, job.tokens

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        job, tokens = self._forward_job(data, loss_fn, loss_fn_config, backward=False)
        return self._pool.submit(self.client_id, "forward", job, tokens)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        job, tokens = self._forward_job(data, loss_fn, loss_fn_config, backward=True)
        return self._pool.submit(self.client_id, "forward_backward", job, tokens)

    def forward_backward_custom(
        self, data: Sequence[Datum],
        loss_fn: Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]],
    ) -> APIFuture[ForwardBackwardOutput]:
        """`loss_fn(data, logprobs)` gets one logprob tensor per datum and returns (loss, metrics)."""
        if not callable(loss_fn):
            raise InvalidInputError(f"loss_fn must be callable, got {type(loss_fn).__name__}", field="loss_fn")
        prepared = prepare_data(data, self._tenant.base, "custom")
        job = ForwardJob(adapter=None, data=prepared, loss_fn="custom", config={}, backward=True,
                         custom_fn=loss_fn, raw_data=list(data))
        return self._pool.submit(self.client_id, "forward_backward_custom", job, job.tokens)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        params = check_adam_params(adam_params)
        return self._pool.submit(self.client_id, "optim_step", params)

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
    # submitted before them. A path is validated and read at submit time.
    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[SaveWeightsResponse]:
        """Adapter weights + AdamW state under `name`; the result's `path` resumes training.
        (`ttl_seconds` is accepted for hosted-service code and ignored: local files stay.)"""
        job = _ckpt.SaveJob(_ckpt.validate_name(name))
        return self._pool.submit(self.client_id, "save_state", job)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load the weights only; the AdamW moments and step count start afresh."""
        return self._submit_load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load the weights and the AdamW state (moments and step): training continues exactly."""
        return self._submit_load(path, with_optimizer=True)

    def _submit_load(self, path: str, with_optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        loaded = _ckpt.read_checkpoint(path, self._pool, require_optimizer=with_optimizer)
        shown = os.fspath(path) if isinstance(path, (str, os.PathLike)) else loaded.path
        _ckpt.check_compatible(loaded, self._tenant, shown)
        op = "load_state_with_optimizer" if with_optimizer else "load_state"
        return self._pool.submit(self.client_id, op, _ckpt.LoadJob(loaded, with_optimizer, shown))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Write the current weights as a PEFT adapter directory (the result's `path`), for
        `create_sampling_client(model_path=...)` or `peft.PeftModel.from_pretrained(base, path)`."""
        job = _ckpt.SaveJob(_ckpt.validate_name(name))
        return self._pool.submit(self.client_id, "save_weights_for_sampler", job)

    def _submit_snapshot(self, name: str | None) -> APIFuture:
        job = _ckpt.SaveJob(_ckpt.validate_name(name) if name is not None else None, snapshot=True)
        return self._pool.submit(self.client_id, "save_weights_for_sampler", job)

    def _sampling_client_from(self, snap: "_ckpt.SamplerSnapshot") -> "SamplingClient":
        return self._service._new_sampling_client(self._tenant.base, snap.adapter, snap.path,
                                                  f"{self.client_id} sampler")

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> "SamplingClient":
        """A sampling client over a copy of the weights as of the ops submitted before this call
        (later training does not change what it samples). With `name`, also written to disk."""
        return self._sampling_client_from(self._submit_snapshot(name).result())

    def create_sampling_client(self, model_path: str) -> "SamplingClient":
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

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> "SamplingClient":
        return self._sampling_client_from(await self._submit_snapshot(name))

    async def create_sampling_client_async(self, model_path: str) -> "SamplingClient":
        return self.create_sampling_client(model_path)

    # -- info ------------------------------------------------------------------------
    def inspect_adapter(self) -> APIFuture[AdapterSnapshot]:
        """A read-only copy of this run's LoRA weights, pending gradient and AdamW state, as
        of the requests submitted before this call (it runs in the client's next cycle)."""
        return self._pool.submit(self.client_id, "inspect_adapter", None)

    async def inspect_adapter_async(self) -> APIFuture[AdapterSnapshot]:
        return self.inspect_adapter()

    def get_info(self) -> TrainingInfo:
        t = self._tenant
        return TrainingInfo(model_id=self.client_id, model_data=ModelData(
            base_model=t.base.name, lora_rank=t.rank, train_attn=t.train_attn, train_mlp=t.train_mlp,
            train_unembed=t.train_unembed, seed=t.seed))

    async def get_info_async(self) -> TrainingInfo:
        return self.get_info()

    def get_tokenizer(self):
        if self._tenant.base.tokenizer is None:
            raise RuntimeError(f"no tokenizer was saved with {self._tenant.base.name!r}")
        return self._tenant.base.tokenizer


def _retire(pool_ref: "weakref.ref[LocalPool]", client_id: str) -> None:
    pool = pool_ref()
    if pool is not None and not pool.closed:
        pool.retire_tenant(client_id)


class SamplingClient:
    """Samples from a frozen snapshot of a LoRA adapter (or from the bare base model).

    Sample requests go through the clock like training requests: every sample of a
    cycle, from every client of the same base model, runs in one batch.
    `sample` / `compute_logprobs` return an APIFuture; as on the hosted services,
    `sample_async` / `compute_logprobs_async` return the result itself after one await.
    When this object is garbage-collected, the pool forgets its adapter.
    """

    def __init__(self, pool: LocalPool, tenant: Tenant, model_path: str | None = None):
        self._pool = pool
        self._tenant = tenant
        self.client_id = tenant.client_id
        self.model_path = model_path
        self._finalizer = weakref.finalize(self, _retire, weakref.ref(pool), tenant.client_id)

    def close(self) -> None:
        """Release this sampler's adapter copy in the pool; queued requests still run."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        what = f"rank={self._tenant.rank}" if self._tenant.adapter is not None else "base only"
        return f"<SamplingClient {self.client_id} {self._tenant.base.name} {what}>"

    @property
    def pool(self) -> LocalPool:
        return self._pool

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt`; each sequence has `tokens`, `logprobs` and
        `stop_reason` ("stop" or "length"). `prompt_logprobs` (first None) if asked for."""
        if topk_prompt_logprobs:
            raise InvalidInputError("top-k prompt logprobs are not supported by the local pool; pass 0",
                                    field="topk_prompt_logprobs")
        job = _sampling.build_sample_job(self._tenant.base, prompt, num_samples, sampling_params,
                                         include_prompt_logprobs)
        return self._pool.submit(self.client_id, "sample", job, tokens=len(job.prompt))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """The log-probability of each prompt token given the ones before it (the first is None)."""
        job = _sampling.build_logprobs_job(self._tenant.base, prompt)
        return self._pool.submit(self.client_id, "compute_logprobs", job, tokens=len(job.prompt))

    async def sample_async(self, prompt: ModelInput, num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0) -> SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str:
        return self._tenant.base.name

    def get_tokenizer(self):
        if self._tenant.base.tokenizer is None:
            raise RuntimeError(f"no tokenizer was saved with {self._tenant.base.name!r}")
        return self._tenant.base.tokenizer


class ServiceClient:
    """Entry point, as on the hosted services: `ServiceClient()` uses the process-wide pool."""

    def __init__(self, pool: LocalPool | None = None, **_ignored: Any):
        # Extra keywords (api_key, base_url, ...) are accepted so hosted-service code runs unchanged.
        self.pool = pool if pool is not None else default_pool()

    def get_server_capabilities(self) -> ServerCapabilities:
        return ServerCapabilities([SupportedModel(name) for name in self.pool.supported_models()])

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return self.get_server_capabilities()

    def create_lora_training_client(self, base_model: str = DEFAULT_MODEL, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None) -> TrainingClient:
        """A new LoRA run. `user_metadata={"name": ...}` labels it in the dashboard."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise InvalidInputError(f"must be an integer, got {rank!r}", field="rank")
        if rank < 1 or rank > self.pool.max_rank:
            raise InvalidInputError(f"must be between 1 and the pool's max_rank {self.pool.max_rank}, got {rank}",
                                    field="rank")
        if not (train_mlp or train_attn or train_unembed):
            raise InvalidInputError("nothing to train: train_mlp, train_attn and train_unembed are all False",
                                    field="train_mlp")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise InvalidInputError(f"must be an integer or None, got {seed!r}", field="seed")
        base = self.pool.get_base_model(base_model)
        targets = base.targets_for(train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        if not targets:
            raise InvalidInputError(f"{base_model} has no linear layers of the kinds asked for", field="train_mlp")
        seed = int(seed) if seed is not None else secrets.randbits(31)
        adapter = LoRAAdapter(targets, int(rank), seed, base.device)
        tenant = Tenant(self.pool.new_client_id("lora"), base, adapter, int(rank), seed,
                        train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        self.pool.add_tenant(tenant, "training", (user_metadata or {}).get("name"))
        return TrainingClient(self.pool, tenant, self)

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    # -- sampling and checkpoints ------------------------------------------------------------
    def _new_sampling_client(self, base: BaseModel, adapter: LoRAAdapter | None, model_path: str | None,
                             label: str | None) -> SamplingClient:
        rank = adapter.rank if adapter is not None else 0
        tenant = Tenant(self.pool.new_client_id("sampler"), base, adapter, rank, adapter.seed if adapter else 0)
        self.pool.add_tenant(tenant, "sampling", label)
        return SamplingClient(self.pool, tenant, model_path)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               user_metadata: dict[str, str] | None = None) -> SamplingClient:
        """Sample from saved weights (`model_path`: a directory from save_weights_for_sampler or
        save_state, or any PEFT LoRA adapter directory) or from a bare `base_model`."""
        label = (user_metadata or {}).get("name")
        if model_path is None:
            if base_model is None:
                raise InvalidInputError("give model_path (saved weights) or base_model", field="model_path")
            return self._new_sampling_client(self.pool.get_base_model(base_model), None, None, label)
        loaded = _ckpt.read_checkpoint(model_path, self.pool)
        shown = os.fspath(model_path) if isinstance(model_path, (str, os.PathLike)) else loaded.path
        name = base_model or loaded.base_model
        if name is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts: pass base_model",
                                    field="base_model")
        if base_model is not None and loaded.kind != "peft" and loaded.base_model != base_model:
            raise _ckpt.CheckpointError(f"checkpoint {shown!r} is for base model {loaded.base_model!r}, not "
                                        f"{base_model!r}", path=shown, field="base_model")
        base = self.pool.get_base_model(name)
        _ckpt.targets_of(loaded, base, shown)
        adapter = LoRAAdapter.from_weights(loaded.weights, loaded.rank, loaded.alpha, loaded.seed, base.device)
        return self._new_sampling_client(base, adapter, loaded.path, label)

    def create_training_client_from_state(self, path: str, user_metadata: dict[str, str] | None = None
                                          ) -> TrainingClient:
        """A new training client with the weights of a checkpoint (save_state, save_weights_for_sampler,
        or any PEFT LoRA adapter directory): same base model, rank, alpha and LoRA targets; the
        AdamW state starts afresh, as on the hosted services. To continue a run exactly, use
        `create_training_client_from_state_with_optimizer`."""
        return self._client_from_state(path, user_metadata, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str,
                                                         user_metadata: dict[str, str] | None = None
                                                         ) -> TrainingClient:
        """A new training client that resumes a save_state checkpoint exactly: its weights and its
        AdamW state (moments and step count)."""
        return self._client_from_state(path, user_metadata, with_optimizer=True)

    def _client_from_state(self, path: str, user_metadata: dict[str, str] | None,
                           with_optimizer: bool) -> TrainingClient:
        loaded = _ckpt.read_checkpoint(path, self.pool, require_optimizer=with_optimizer)
        shown = os.fspath(path) if isinstance(path, (str, os.PathLike)) else loaded.path
        if loaded.base_model is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts", field="path")
        base = self.pool.get_base_model(loaded.base_model)
        targets = _ckpt.targets_of(loaded, base, shown)
        if loaded.rank > self.pool.max_rank:
            raise _ckpt.CheckpointError(f"checkpoint {shown!r} has rank {loaded.rank}, more than the pool's "
                                        f"max_rank {self.pool.max_rank}", path=shown)
        kinds = {base.lora_targets[name][0] for name in targets}
        meta = loaded.meta
        flags = {key: bool(meta.get(key, kind in kinds))
                 for key, kind in (("train_attn", "attn"), ("train_mlp", "mlp"), ("train_unembed", "unembed"))}
        adapter = LoRAAdapter(targets, loaded.rank, loaded.seed, base.device, alpha=loaded.alpha)
        adapter.load_state_dict(loaded.state_dict(), with_optimizer=with_optimizer)
        tenant = Tenant(self.pool.new_client_id("lora"), base, adapter, loaded.rank, loaded.seed, **flags)
        tenant.extra["resumed_from"] = loaded.path
        self.pool.add_tenant(tenant, "training", (user_metadata or {}).get("name"))
        return TrainingClient(self.pool, tenant, self)

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           user_metadata: dict[str, str] | None = None) -> SamplingClient:
        return self.create_sampling_client(model_path, base_model, user_metadata)

    async def create_training_client_from_state_async(self, path: str, user_metadata: dict[str, str] | None = None
                                                      ) -> TrainingClient:
        return self.create_training_client_from_state(path, user_metadata)

    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, user_metadata: dict[str, str] | None = None) -> TrainingClient:
        return self.create_training_client_from_state_with_optimizer(path, user_metadata)
