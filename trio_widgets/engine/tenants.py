"""What the clock and the op handlers share: a tenant (one client's model in the pool), a
queued request, what an op's `prepare` hands the clock, and the op handler registry's entry.
Its own module so that the clock, the handlers and the checkpoints import it, not each other."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..futures import APIFuture
from ..telemetry import RequestRecord
from .lora import LoRAAdapter
from .models import BaseModel

__all__ = ["AddTenant", "Carry", "Later", "OpHandlers", "PoolLike", "Prepared", "Request", "Tenant"]


@dataclass
class Tenant:
    client_id: str
    base: BaseModel
    adapter: LoRAAdapter | None  # None for sampling clients of the bare base
    rank: int
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    kind: Literal["training", "sampling"] = "training"
    #: a training run's public id (tinker's model_id; its tinker:// paths), made on first use
    run_id: str | None = None
    #: where its checkpoints go under the checkpoint root (default: run_id); a server keeps
    #: each API key's runs apart so
    run_dir: str | None = None
    parent: str | None = None  # a snapshot sampler: the training client it was taken from
    resumed_from: str | None = None  # a client made from a checkpoint: its directory
    #: the API key (digest) of a served pool's client: its clients share one slice of new decode
    #: rows a cycle while other keys have work (clock.py); None in-process (each client its own)
    owner: str | None = None


@dataclass
class Prepared:
    """What an op's `prepare` hands the clock: its payload, and what telemetry counts."""

    payload: Any
    tokens: int = 0
    weight: float = 0.0  # loss-weighted tokens (forward ops)


@dataclass
class Request:
    request_id: int
    client_id: str
    op: str
    payload: Any
    result: concurrent.futures.Future
    future: APIFuture
    record: RequestRecord
    ready: bool = True  # a reservation is not, until it is filled


@dataclass(frozen=True)
class OpHandlers:
    """An op's pair: `prepare(pool, tenant, op, request) -> Prepared` on the submitting thread;
    `run(pool, tenant, request)` on the clock thread, or, for `batched` ops,
    `run(pool, base, [(tenant, request), ...]) -> [outcome, ...]` once per base model."""

    prepare: Callable[..., Prepared]
    run: Callable[..., Any]


@dataclass(frozen=True)
class AddTenant:
    """What a handler returns when its op makes a client (a snapshot's sampler): the clock adds
    the tenant, and the request's result is `result`. Handlers never change the pool themselves."""

    tenant: Tenant
    label: str
    result: Any


class Carry(Protocol):
    """Work of some of a cycle's requests that goes on in the next cycles (a long sample): the
    pool calls `advance(budget)` once a cycle, and delivers the outcomes it returns (by index
    in the group the handler was given) until `done`."""

    @property
    def done(self) -> bool: ...

    def advance(self, budget: Any) -> dict[int, Any]: ...


@dataclass(frozen=True, eq=False)
class Later:
    """A batched handler's outcome for a request whose work goes on in `carry`."""

    carry: Carry


class PoolLike(Protocol):
    """What the handlers, the checkpoints and LocalBackend use of the pool that runs them: the clock
    (engine/clock.py, LocalPool) builds on those modules, so they name it by this shape, never by
    its class (no import back, not even for annotations)."""

    name: str
    checkpoint_dir: str | None
    max_rank: int
    max_tokens_per_pass: int
    max_checkpoint_bytes: int | None
    limits: Any  # validation.RequestLimits
    decode_budget: Any  # sampling.StepBudget: this cycle's decode steps (clock thread)

    @property
    def closed(self) -> bool: ...

    def on_close(self, hook: Callable[[], None]) -> None: ...

    def get_base_model(self, name: str) -> BaseModel: ...

    def supported_models(self) -> list[str]: ...

    def new_client_id(self, prefix: str) -> str: ...

    def add_tenant(self, tenant: Tenant, label: str | None) -> None: ...

    def tenant(self, client_id: str) -> Tenant: ...

    def retire_tenant(self, client_id: str, *, dropped: bool = False) -> None: ...

    def submit(self, client_id: str, op: str, request: Any) -> APIFuture: ...

    def reserve(self, client_id: str, op: str) -> Any: ...
