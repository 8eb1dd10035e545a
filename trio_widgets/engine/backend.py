"""LocalBackend: the client API's requests, run by an in-process LocalPool.

Everything that needs the model happens here or in the op handlers: loading the base,
building adapters and tenants, reading checkpoints, checking inputs against the model.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import Any

from .._worker import BackgroundWorker
from ..backend import CreateModelRequest, CreateSamplerRequest, FromStateRequest, ModelHandle
from ..errors import InvalidInputError
from ..futures import APIFuture
from ..validation import is_int
from . import checkpoints as ckpt
from .clock import LocalPool, Tenant
from .handlers import handle_of
from .lora import LoRAAdapter

__all__ = ["LocalBackend"]


class LocalBackend:
    """Runs a ServiceClient's requests on `pool` (see trio_widgets.backend.Backend)."""

    def __init__(self, pool: LocalPool):
        self.pool = pool
        self.name = pool.name
        self._worker = BackgroundWorker(f"trio-client-{pool.name}")
        # the hook holds the worker, not this backend: no cycle keeps a dropped pool alive
        pool.on_close(self._worker.stop)

    def __repr__(self) -> str:
        return f"<LocalBackend {self.pool!r}>"


    # -- clients ------------------------------------------------------------------------
    def supported_models(self) -> list[str]:
        return self.pool.supported_models()

    def create_model(self, request: CreateModelRequest) -> ModelHandle:
        pool = self.pool
        rank = request.rank
        if not is_int(rank):
            raise InvalidInputError(f"must be an integer, got {rank!r}", field="rank")
        if rank < 1 or rank > pool.max_rank:
            raise InvalidInputError(f"must be between 1 and the pool's max_rank {pool.max_rank}, got {rank}",
                                    field="rank")
        if not (request.train_mlp or request.train_attn or request.train_unembed):
            raise InvalidInputError("nothing to train: train_mlp, train_attn and train_unembed are all False",
                                    field="train_mlp")
        if request.seed is not None and not is_int(request.seed):
            raise InvalidInputError(f"must be an integer or None, got {request.seed!r}", field="seed")
        base = pool.get_base_model(request.base_model)
        targets = base.targets_for(train_attn=request.train_attn, train_mlp=request.train_mlp,
                                   train_unembed=request.train_unembed)
        if not targets:
            raise InvalidInputError(f"{request.base_model} has no linear layers of the kinds asked for",
                                    field="train_mlp")
        seed = int(request.seed) if request.seed is not None else secrets.randbits(31)
        adapter = LoRAAdapter(targets, int(rank), seed, base.device)
        tenant = Tenant(pool.new_client_id("lora"), base, adapter, int(rank), seed, train_attn=request.train_attn,
                        train_mlp=request.train_mlp, train_unembed=request.train_unembed)
        pool.add_tenant(tenant, request.label)
        return handle_of(tenant)

    def create_model_from_state(self, request: FromStateRequest) -> ModelHandle:
        pool = self.pool
        loaded = ckpt.read_checkpoint(request.path, pool, require_optimizer=request.with_optimizer)
        shown = os.fspath(request.path) if isinstance(request.path, (str, os.PathLike)) else loaded.path
        if loaded.base_model is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts", field="path")
        base = pool.get_base_model(loaded.base_model)
        targets = ckpt.targets_of(loaded, base, shown)
        if loaded.rank > pool.max_rank:
            raise ckpt.CheckpointError(f"checkpoint {shown!r} has rank {loaded.rank}, more than the pool's "
                                       f"max_rank {pool.max_rank}", path=shown)
        kinds = {base.lora_targets[name][0] for name in targets}
        meta = loaded.meta

        def flag(key: str, kind: str) -> bool:  # saved by us; else what the weights adapt
            return bool(meta.get(key, kind in kinds))

        adapter = LoRAAdapter(targets, loaded.rank, loaded.seed, base.device, alpha=loaded.alpha)
        adapter.load_state_dict(loaded.state_dict(), with_optimizer=request.with_optimizer)
        tenant = Tenant(pool.new_client_id("lora"), base, adapter, loaded.rank, loaded.seed,
                        train_attn=flag("train_attn", "attn"), train_mlp=flag("train_mlp", "mlp"),
                        train_unembed=flag("train_unembed", "unembed"))
        tenant.extra["resumed_from"] = loaded.path
        pool.add_tenant(tenant, request.label)
        return handle_of(tenant, model_path=loaded.path)

    def create_sampler(self, request: CreateSamplerRequest) -> ModelHandle:
        pool = self.pool
        if request.model_path is None:
            if request.base_model is None:
                raise InvalidInputError("give model_path (saved weights) or base_model", field="model_path")
            base = pool.get_base_model(request.base_model)
            tenant = Tenant(pool.new_client_id("sampler"), base, None, 0, 0, kind="sampling")
            pool.add_tenant(tenant, request.label)
            return handle_of(tenant)
        loaded = ckpt.read_checkpoint(request.model_path, pool)
        path = request.model_path
        shown = os.fspath(path) if isinstance(path, (str, os.PathLike)) else loaded.path
        name = request.base_model or loaded.base_model
        if name is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts: pass base_model",
                                    field="base_model")
        if request.base_model is not None and loaded.kind != "peft" and loaded.base_model != request.base_model:
            raise ckpt.CheckpointError(f"checkpoint {shown!r} is for base model {loaded.base_model!r}, not "
                                       f"{request.base_model!r}", path=shown, field="base_model")
        base = pool.get_base_model(name)
        ckpt.targets_of(loaded, base, shown)
        adapter = LoRAAdapter.from_weights(loaded.weights, loaded.rank, loaded.alpha, loaded.seed, base.device)
        tenant = Tenant(pool.new_client_id("sampler"), base, adapter, adapter.rank, adapter.seed, kind="sampling")
        pool.add_tenant(tenant, request.label)
        return handle_of(tenant, model_path=loaded.path)

    def release(self, client_id: str) -> None:
        if not self.pool.closed:
            self.pool.retire_tenant(client_id)

    def tokenizer(self, base_model: str) -> Any:
        return self.pool.get_base_model(base_model).tokenizer

    # -- requests --------------------------------------------------------------------------
    def submit(self, client_id: str, op: str, request: Any) -> APIFuture:
        return self.pool.submit(client_id, op, request)

    def reserve(self, client_id: str, op: str) -> Any:
        return self.pool.reserve(client_id, op)

    def run_in_background(self, work: Callable[[], None]) -> None:
        self._worker.submit(work)

    def close(self) -> None:
        """Stop the client-side thread (the pool is not closed: other clients may share it)."""
        self._worker.close()
