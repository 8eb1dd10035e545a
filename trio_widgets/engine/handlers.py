"""What each op does in the pool: `prepare_<handler>` and `run_<handler>` per row of the op
table (trio_widgets/ops.py).

* ``prepare_X(pool, tenant, op, request) -> Prepared`` runs on the submitting thread: it
  checks the plain-data request against the client's model (trio_widgets.validation) and
  turns it into the payload `run_X` needs. Raising InvalidInputError there means nothing
  was queued.
* ``run_X`` runs on the clock thread. For ops of kind "forward" and "sample" it gets every
  request of the cycle on one base model at once, ``run_X(pool, base, [(tenant, request)])``,
  and returns one outcome (a value or an exception) per request; for "optim" and "state"
  ops, ``run_X(pool, tenant, request)`` returns the value or raises.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backend import (
    ComputeLogprobsRequest,
    ForwardRequest,
    InspectRequest,
    LoadRequest,
    ModelHandle,
    OptimStepRequest,
    SamplerCreated,
    SampleRequest,
    SaveRequest,
)
from ..errors import CheckpointExistsError, InvalidInputError, RequestFailedError
from ..protocol import names, shown_path
from ..types import (
    AdapterSnapshot,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from ..validation import (
    check_adam_params,
    check_logprob_options,
    check_logprobs_prompt,
    check_loss,
    check_sample,
    check_save_extras,
)
from . import checkpoints as ckpt
from .compute import make_forward_job, run_forward_jobs
from .lora import LoRAAdapter
from .sampling import run_sample_batch
from .tenants import AddTenant, OpHandlers, PoolLike, Prepared, Request, Tenant

if TYPE_CHECKING:
    from .models import BaseModel


def _expect(request: Any, kind: type, op: str) -> None:
    if not isinstance(request, kind):
        raise InvalidInputError(f"{op} takes a {kind.__name__}, got {type(request).__name__}", field="request")


def _trained(tenant: Tenant, op: str) -> LoRAAdapter:
    if tenant.kind != "training" or tenant.adapter is None:
        raise InvalidInputError(f"{op}: client {tenant.client_id} is a sampling client; it has no weights to train",
                                field="client")
    return tenant.adapter


def _adapter(tenant: Tenant) -> LoRAAdapter:
    if tenant.adapter is None:
        raise InvalidInputError(f"client {tenant.client_id} samples the bare base model: it has no adapter",
                                field="client")
    return tenant.adapter


# -- forward, forward_backward, forward_backward_custom ------------------------------------

def prepare_forward(pool: PoolLike, tenant: Tenant, op: str, request: ForwardRequest) -> Prepared:
    _expect(request, ForwardRequest, op)
    if op != "forward":
        _trained(tenant, op)
    loss_fn, config = check_loss(request.loss_fn, request.loss_fn_config)
    job, weight = make_forward_job(tenant.base, request.data, loss_fn, config, backward=op != "forward",
                                   request_limits=pool.limits)
    # a custom loss's weights are its gradient, not a count of tokens: no loss per token then
    return Prepared(job, tokens=job.tokens, weight=0.0 if op == "forward_backward_custom" else weight)


def run_forward(pool: PoolLike, base: BaseModel, group: list[tuple[Tenant, Request]]) -> list[Any]:
    items = [(tenant.adapter, request.payload, tenant.client_id) for tenant, request in group]
    outcomes = run_forward_jobs(base, items, pool.max_tokens_per_pass)
    for (_, request), outcome in zip(group, outcomes):
        if not isinstance(outcome, BaseException):
            request.record.metrics["loss:sum"] = outcome.metrics.get("loss:sum", float("nan"))
    return outcomes


# -- optim_step ------------------------------------------------------------------------------

def prepare_optim_step(pool: PoolLike, tenant: Tenant, op: str, request: OptimStepRequest) -> Prepared:
    _expect(request, OptimStepRequest, op)
    _trained(tenant, op)
    return Prepared(check_adam_params(request.adam_params))


def run_optim_step(pool: PoolLike, tenant: Tenant, request: Request) -> OptimStepResponse:
    try:
        metrics = _trained(tenant, request.op).adamw_step(request.payload)
    except FloatingPointError as exc:
        raise RequestFailedError(f"optim_step: {exc}; weights and optimizer state are unchanged",
                                 client_id=tenant.client_id) from exc
    request.record.metrics["step"] = metrics["step:max"]
    return OptimStepResponse(metrics=metrics)


# -- save_state, save_weights_for_sampler ----------------------------------------------------

def prepare_save(pool: PoolLike, tenant: Tenant, op: str, request: SaveRequest) -> Prepared:
    _expect(request, SaveRequest, op)
    _trained(tenant, op)
    if request.name is not None or not request.make_sampler:  # only an in-memory sampler may go unnamed
        ckpt.validate_name(request.name)
    check_save_extras(request.ttl_seconds, request.user_metadata)
    if request.external and (op != "save_weights_for_sampler" or request.make_sampler or request.name is None):
        raise InvalidInputError("an external save is a named weights-only save (save_weights_external)", field="op")
    if request.name is not None:
        _refuse_existing(pool, tenant, request, op)  # early; run_save checks again (saves queued together)
    return Prepared(request)


def _save_target(pool: PoolLike, tenant: Tenant, op: str, save: SaveRequest) -> Any:
    segment = "external_weights" if save.external else "weights" if op == "save_state" else "sampler_weights"
    return ckpt.run_dir(pool, tenant) / segment / ckpt.validate_name(save.name)


def _refuse_existing(pool: PoolLike, tenant: Tenant, save: SaveRequest, op: str = "save_state") -> None:
    if save.overwrite or save.name is None:
        return
    target = _save_target(pool, tenant, op, save)
    if os.path.lexists(target):
        # named by its tinker:// path: a served pool's directories are the server's business
        shown = names.checkpoint_path(ckpt.run_id_of(tenant), target.parent.name, save.name)
        raise CheckpointExistsError(f"a checkpoint named {save.name!r} exists already ({shown}); pass "
                                    f"overwrite=True to replace it", path=shown)


def run_save(pool: PoolLike, tenant: Tenant, request: Request) -> Any:
    save: SaveRequest = request.payload
    adapter = _trained(tenant, request.op)
    expires_at = time.time() + save.ttl_seconds if save.ttl_seconds is not None else None
    if request.op == "save_state":
        name = ckpt.validate_name(save.name)
        _refuse_existing(pool, tenant, save)
        path = _save_target(pool, tenant, request.op, save)
        size = ckpt.write_checkpoint(path, tenant, "state", name, user_metadata=save.user_metadata,
                                     expires_at=expires_at)
        request.record.metrics["step"] = float(adapter.adam.step)
        # every transport names it by its tinker:// path (LocalPool.checkpoint_path: the directory)
        return SaveWeightsResponse(path=names.checkpoint_path(ckpt.run_id_of(tenant), "weights", name),
                                   model=tenant.base.name, size=size)
    snapshot = adapter.snapshot()
    written = None
    size = 0
    if save.name is not None:
        _refuse_existing(pool, tenant, save, request.op)
        target = _save_target(pool, tenant, request.op, save)
        size = ckpt.write_checkpoint(target, tenant, "sampler", save.name, adapter=snapshot,
                                     user_metadata=save.user_metadata, expires_at=expires_at,
                                     age_recipients=save.age_recipients)
        written = names.checkpoint_path(ckpt.run_id_of(tenant), target.parent.name, save.name)
    if not save.make_sampler:
        return SaveWeightsForSamplerResponse(path=written, model=tenant.base.name, size=size)
    sampler = Tenant(pool.new_client_id("sampler"), tenant.base, snapshot, snapshot.rank, snapshot.seed,
                     kind="sampling", parent=tenant.client_id, owner=tenant.owner)
    return AddTenant(sampler, save.label or f"{tenant.client_id} sampler",
                     SamplerCreated(sampler=handle_of(sampler, model_path=written), path=written))


def handle_of(tenant: Tenant, model_path: str | None = None, label: str | None = None) -> ModelHandle:
    adapter = tenant.adapter
    base = tenant.base
    return ModelHandle(client_id=tenant.client_id, base_model=base.name, rank=tenant.rank,
                       alpha=adapter.alpha if adapter is not None else 0.0, seed=tenant.seed,
                       train_attn=tenant.train_attn, train_mlp=tenant.train_mlp, train_unembed=tenant.train_unembed,
                       model_path=model_path,
                       run_id=ckpt.run_id_of(tenant) if tenant.kind == "training" else None,
                       arch=getattr(getattr(base.model, "config", None), "model_type", None),
                       context_length=base.context_length, state_bytes=_state_bytes(tenant), label=label)


def _state_bytes(tenant: Tenant) -> int:
    adapter = tenant.adapter
    if adapter is None:
        return 0
    # a training client holds its weights, a gradient and two Adam moments of the same size
    return adapter.flat.numel() * adapter.flat.element_size() * (4 if tenant.kind == "training" else 1)


# -- load_state, load_state_with_optimizer ---------------------------------------------------

@dataclass
class LoadJob:
    loaded: ckpt.LoadedCheckpoint
    with_optimizer: bool
    shown: str  # the path as the caller named it (a tinker:// path, or an in-process directory)


def prepare_load(pool: PoolLike, tenant: Tenant, op: str, request: LoadRequest) -> Prepared:
    _expect(request, LoadRequest, op)
    _trained(tenant, op)
    with_optimizer = op == "load_state_with_optimizer"
    loaded = ckpt.read_checkpoint(request.path, pool, require_optimizer=with_optimizer, owner=tenant.owner)
    shown = shown_path(request.path, loaded.path)
    ckpt.check_compatible(loaded, tenant, shown)
    return Prepared(LoadJob(loaded, with_optimizer, shown))


def run_load(pool: PoolLike, tenant: Tenant, request: Request) -> LoadWeightsResponse:
    job: LoadJob = request.payload
    adapter = _trained(tenant, request.op)
    adapter.load_state_dict(job.loaded.state_dict(), with_optimizer=job.with_optimizer)
    request.record.metrics["step"] = float(adapter.adam.step)
    return LoadWeightsResponse(path=job.shown, model_id=ckpt.run_id_of(tenant))


# -- inspect_adapter ---------------------------------------------------------------------------

def prepare_inspect(pool: PoolLike, tenant: Tenant, op: str, request: InspectRequest) -> Prepared:
    _expect(request, InspectRequest, op)
    _adapter(tenant)
    return Prepared(None)


def run_inspect(pool: PoolLike, tenant: Tenant, request: Request) -> AdapterSnapshot:
    return _adapter(tenant).snapshot_state(tenant.client_id, tenant.base.name)


# -- sample, compute_logprobs ---------------------------------------------------------------------

def prepare_sample(pool: PoolLike, tenant: Tenant, op: str, request: SampleRequest) -> Prepared:
    _expect(request, SampleRequest, op)
    limits = tenant.base.limits
    spec = check_sample(request.prompt, request.num_samples, request.sampling_params,
                        request.include_prompt_logprobs, limits, pool.limits)
    spec = check_logprob_options(spec, include_prompt_logprobs=request.include_prompt_logprobs,
                                 topk_prompt_logprobs=request.topk_prompt_logprobs,
                                 topk_sample_logprobs=request.topk_sample_logprobs,
                                 prompt_logprobs_last_n=request.prompt_logprobs_last_n,
                                 target_prompt_logprobs=request.target_prompt_logprobs,
                                 prompt_alt_tokens_k=request.prompt_alt_tokens_k, limits=limits)
    return Prepared(spec, tokens=len(spec.prompt))


def prepare_logprobs(pool: PoolLike, tenant: Tenant, op: str, request: ComputeLogprobsRequest) -> Prepared:
    _expect(request, ComputeLogprobsRequest, op)
    spec = check_logprobs_prompt(request.prompt, tenant.base.limits)
    spec = check_logprob_options(spec, include_prompt_logprobs=True,
                                 prompt_logprobs_last_n=request.prompt_logprobs_last_n, limits=tenant.base.limits)
    return Prepared(spec, tokens=len(spec.prompt))


def run_sample(pool: PoolLike, base: BaseModel, group: list[tuple[Tenant, Request]]) -> list[Any]:
    """The cycle's sample requests on `base`, decoded together; those still decoding when the
    cycle's share is used up (pool.decode_budget: min_decode_steps, then until the cycle's minimum
    length) come back as `Later`, and the pool carries them on (engine/sampling.py)."""
    def finish(i: int, outcome: Any) -> Any:
        tenant, request = group[i]
        if isinstance(outcome, RequestFailedError) and outcome.client_id is None:
            outcome.client_id = tenant.client_id
        if hasattr(outcome, "sequences"):
            generated = sum(len(s.tokens) for s in outcome.sequences)
            request.record.tokens = len(request.payload.prompt) + generated
            request.record.metrics["sampled_tokens:sum"] = float(generated)
            request.record.metrics["num_samples"] = float(len(outcome.sequences))
        return outcome

    return run_sample_batch(base, [(tenant.adapter, request.payload) for tenant, request in group],
                            pool.max_tokens_per_pass, pool.decode_budget, finish)


run_logprobs = run_sample


#: The registry: each op of the table (trio_widgets/ops.py) names its handler here.
HANDLERS: dict[str, OpHandlers] = {
    "forward": OpHandlers(prepare_forward, run_forward),
    "optim_step": OpHandlers(prepare_optim_step, run_optim_step),
    "save": OpHandlers(prepare_save, run_save),
    "load": OpHandlers(prepare_load, run_load),
    "inspect": OpHandlers(prepare_inspect, run_inspect),
    "sample": OpHandlers(prepare_sample, run_sample),
    "logprobs": OpHandlers(prepare_logprobs, run_sample),
}
