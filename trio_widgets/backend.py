"""The seam between the client API and where requests run (cf. httpx's transports).

The client builds plain-data requests — token ids, loss inputs, optimizer and sampling
settings: things that serialise — and hands them to a `Backend`. `LocalBackend`
(trio_widgets.engine.backend) runs them on an in-process `LocalPool`; an HTTP backend
sends the same requests to a served pool. Nothing here holds a tensor, an engine object
or a callable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Union

from .futures import APIFuture
from .types import (
    AdamParams,
    Checkpoint,
    Datum,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ModelInput,
    SamplingParams,
    TensorData,
    TrainingRun,
    WeightsInfoResponse,
)

__all__ = [
    "Backend", "Catalog", "ComputeLogprobsRequest", "CreateModelRequest", "CreateSamplerRequest", "ExportUrls",
    "ForwardRequest",
    "FromStateRequest", "InspectRequest", "LoadRequest", "ModelHandle", "OptimStepRequest", "Request", "Reservation",
    "SampleRequest", "SamplerCreated", "SaveRequest",
]


# -- creating clients --------------------------------------------------------------------

@dataclass(frozen=True)
class CreateModelRequest:
    base_model: str
    rank: int
    seed: int | None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    label: str | None = None
    user_metadata: dict[str, str] | None = None
    # Set by a server, which names runs itself (None: the backend makes them). run_id: the run's
    # public id (tinker's model_id); run_dir: its checkpoints' directory under the checkpoint root;
    # session_id: the session the run is listed under (None: the backend's own).
    run_id: str | None = None
    run_dir: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class FromStateRequest:
    path: str
    with_optimizer: bool
    label: str | None = None
    base_model: str | None = None  # if given, the checkpoint's base model must be this one
    user_metadata: dict[str, str] | None = None
    run_id: str | None = None  # as CreateModelRequest's
    run_dir: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class CreateSamplerRequest:
    model_path: str | None = None  # saved weights; None: the bare base model
    base_model: str | None = None
    label: str | None = None
    session_id: str | None = None  # as CreateModelRequest's
    sampler_id: str | None = None  # set by a server: the public id the session's catalog lists it by


@dataclass(frozen=True)
class ModelHandle:
    """What a client knows about its model in the backend."""

    client_id: str
    base_model: str
    rank: int  # 0: a sampler of the bare base model
    alpha: float
    seed: int
    train_attn: bool = False
    train_mlp: bool = False
    train_unembed: bool = False
    model_path: str | None = None
    run_id: str | None = None  # a training run's id: its checkpoints' directory (tinker's model_id)
    arch: str | None = None  # the base model's architecture (its config's model_type)
    context_length: int | None = None
    state_bytes: int = 0  # what the pool holds for it: adapter, and gradient and Adam moments when training


# -- requests of a client (the op name travels beside them) ------------------------------

@dataclass(frozen=True)
class ForwardRequest:
    """forward, forward_backward, and the second half of forward_backward_custom."""

    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None


@dataclass(frozen=True)
class OptimStepRequest:
    adam_params: AdamParams


@dataclass(frozen=True)
class SaveRequest:
    """save_state / save_weights_for_sampler; `make_sampler` also creates a sampling client over
    a copy of the weights (save_weights_and_get_sampling_client); `name` None: memory only.
    `overwrite` False refuses a name already saved; `ttl_seconds` sets when the checkpoint
    expires; `user_metadata` is stored with it. `external`: save_weights_external, the weights
    as a PEFT directory under `external_weights/` (for download; tinker's hosted export)."""

    name: str | None
    make_sampler: bool = False
    label: str | None = None
    overwrite: bool = False  # as both SDKs: a name saved before is refused unless asked
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    sampler_id: str | None = None  # with make_sampler, set by a server: the sampler's public id
    external: bool = False
    age_recipients: tuple[str, ...] | None = None  # external only: the files leave the server encrypted to them


@dataclass(frozen=True)
class LoadRequest:
    path: str


@dataclass(frozen=True)
class InspectRequest:
    pass


@dataclass(frozen=True)
class SampleRequest:
    """The tinker options: top-k (token, logprob) at each prompt position and at each sampled
    token; prompt logprobs of the last n positions only; the logprobs of given token ids
    (`target_prompt_logprobs`, [len(prompt) - 1, K], -1: none); `prompt_alt_tokens_k` draws
    at each prompt position."""

    prompt: ModelInput
    num_samples: int = 1
    sampling_params: SamplingParams | None = None
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0


@dataclass(frozen=True)
class ComputeLogprobsRequest:
    prompt: ModelInput
    prompt_logprobs_last_n: int | None = None


@dataclass(frozen=True)
class SamplerCreated:
    """The result of a save with `make_sampler`."""

    sampler: ModelHandle
    path: str | None


class Reservation(Protocol):
    """A place in a client's queue, taken now and filled later: requests submitted after it wait
    behind it, so a custom loss's forward_backward keeps its order with a later optim_step."""

    future: APIFuture

    def fill(self, request: ForwardRequest) -> None: ...

    def fail(self, error: BaseException) -> None: ...


#: Every request a client submits (the op travels beside it: one type serves several ops).
Request = Union[ForwardRequest, OptimStepRequest, SaveRequest, LoadRequest, InspectRequest, SampleRequest,
                ComputeLogprobsRequest]


@dataclass(frozen=True)
class ExportUrls:
    """Where a checkpoint's PEFT files can be fetched until `expires`: the whole directory as one
    tar (`archive_url`) and each file (`file_urls`, name -> URL). A served pool signs them
    (no key in them); an in-process pool gives file:// URLs of the checkpoint itself."""

    archive_url: str
    file_urls: dict[str, str]
    expires: datetime


class Catalog(Protocol):
    """What the RestClient asks (trio_widgets/rest.py); answers are the plain types of
    trio_widgets.types. Ids: a training run's `run_id`, a sampler's client id."""

    def capabilities(self) -> GetServerCapabilitiesResponse: ...

    def checkpoints(self, run_id: str | None = None) -> list[Checkpoint]: ...

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None: ...

    def set_checkpoint_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None: ...

    def weights_info(self, path: Any) -> WeightsInfoResponse: ...

    def export_urls(self, path: Any) -> ExportUrls:
        """Download URLs of a checkpoint's PEFT files (trio_widgets/export.py)."""
        ...

    def download_checkpoint(self, path: Any, destination: Path, max_bytes: int) -> dict[str, int]:
        """Write a checkpoint's PEFT files into the directory `destination`; name -> size."""
        ...

    def training_run(self, run_id: str) -> TrainingRun: ...

    def training_runs(self) -> list[TrainingRun]: ...

    def sampler(self, sampler_id: str) -> GetSamplerResponse: ...

    def session(self, session_id: str) -> GetSessionResponse: ...

    def sessions(self) -> list[str]: ...

    def close(self) -> None: ...


class Backend(Catalog, Protocol):
    """Where a ServiceClient's requests run (and, as a Catalog, what its RestClient lists).
    Every method raises InvalidInputError (naming the field) for a request it refuses, before
    anything is queued."""

    name: str

    @property
    def session_id(self) -> str | None:
        """The session this backend's clients are listed under (None: none yet)."""
        ...

    @property
    def pool(self) -> Any:
        """The in-process pool behind this backend, or None (a served pool)."""
        ...

    def supported_models(self) -> list[str]: ...

    def is_base_model(self, name: Any) -> bool:
        """Whether `name` names a model this backend serves (a sampling client's argument order)."""
        ...

    def is_checkpoint(self, path: Any) -> bool:
        """Whether `path` names a checkpoint this backend can load."""
        ...

    def create_model(self, request: CreateModelRequest) -> ModelHandle: ...

    def create_model_from_state(self, request: FromStateRequest) -> ModelHandle: ...

    def create_sampler(self, request: CreateSamplerRequest) -> ModelHandle: ...

    def sampler_handle(self, client_id: str) -> str:
        """A string another process passes to `attach_sampler` to sample from the same sampler
        (tinker's get_sampler_handle); no credentials in it. NotSupportedError where samplers
        cannot leave the process (an in-process pool)."""
        ...

    def attach_sampler(self, sampler_id: str) -> ModelHandle:
        """This backend's client of a sampler another backend made (same key): it samples, and
        releasing it leaves the sampler to its maker."""
        ...

    def submit(self, client_id: str, op: str, request: Request) -> APIFuture: ...

    def reserve(self, client_id: str, op: str) -> Reservation: ...

    def release(self, client_id: str) -> None: ...

    def tokenizer(self, base_model: str) -> Any: ...

    def run_in_background(self, work: Callable[[], None]) -> None:
        """Run client-side work (a custom loss) off the caller's thread and off the clock."""
        ...

    def close(self) -> None: ...
