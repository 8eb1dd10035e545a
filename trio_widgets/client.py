"""ServiceClient and TrainingClient: the Tinker / PyTRIO client API over a LocalPool.

Every check on user input happens here, at submit time, on the caller's thread: a
rejected request raises an `InvalidInputError` and never reaches the pool.
"""

from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .engine.clock import LocalPool, Tenant
from .engine.compute import ForwardJob, PreparedDatum
from .engine.lora import LoRAAdapter
from .engine.losses import FLOAT_INPUTS, LOSSES, REQUIRED_INPUTS, resolved_config
from .engine.models import DEFAULT_MODEL, BaseModel
from .errors import InvalidInputError
from .futures import APIFuture
from .types import AdamParams, Datum, ForwardBackwardOutput, ModelInput, OptimStepResponse, TensorData

__all__ = ["ServiceClient", "TrainingClient", "default_pool", "ServerCapabilities", "SupportedModel", "TrainingInfo"]

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

    def __repr__(self) -> str:
        return f"<TrainingClient {self.client_id} {self._tenant.base.name} rank={self._tenant.rank}>"

    @property
    def pool(self) -> LocalPool:
        return self._pool

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

    # -- info ------------------------------------------------------------------------
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
