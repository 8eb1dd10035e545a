"""The seam between the client API and where requests run (cf. httpx's transports).

The client builds plain-data requests — token ids, loss inputs, optimizer and sampling
settings: things that serialise — and hands them to a `Backend`. `LocalBackend`
(trio_widgets.engine.backend) runs them on an in-process `LocalPool`; an HTTP backend
sends the same requests to a served pool. Nothing here holds a tensor, an engine object
or a callable.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, Union

from .errors import NotSupportedError
from .futures import APIFuture
from .protocol import WireError
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
    "AttachSampler", "Backend", "Call", "Capabilities", "CheckpointDir", "ComputeLogprobsRequest", "CreateModelRequest",
    "CreateSamplerRequest", "DeleteCheckpoint", "DownloadCheckpoint", "ExportUrls", "ForwardRequest",
    "FromStateRequest", "GetExportUrls", "GetSampler", "GetSession", "GetTokenizer", "GetTrainingRun",
    "InspectRequest", "IsBaseModel", "IsCheckpoint", "ListCheckpoints", "ListSessions", "ListTrainingRuns",
    "LoadRequest", "ModelHandle", "Open", "OpenSession", "OptimStepRequest", "Request", "Reservation",
    "SampleRequest", "SamplerCreated", "SamplerHandle", "SaveRequest", "ServedEntry", "ServedModelView",
    "ServedSamplerView", "ServedSessionView", "ServedStateView", "ServedTables", "SetCheckpointTtl", "SupportedModels",
    "WeightsInfo", "answer", "opened",
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
    label: str | None = None  # the name the pool shows it by (user_metadata={"name": ...})


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


# -- the seam's questions: everything but running an op -----------------------------------------

T = TypeVar("T")
_A = TypeVar("_A", covariant=True)


class Call(Generic[_A]):
    """A question (or a catalog change) a transport puts to `Backend.call`; `T` is its answer.
    Each names the method of a backend that answers it (`_on_<verb>`, private: the one way in is
    `call`), which takes the call's fields as keywords."""

    verb: ClassVar[str]


@dataclass(frozen=True)
class SupportedModels(Call[list[str]]):
    verb: ClassVar[str] = "supported_models"


@dataclass(frozen=True)
class IsBaseModel(Call[bool]):
    """Whether `name` names a model the pool serves (a sampling client's argument order)."""

    name: Any
    verb: ClassVar[str] = "is_base_model"


@dataclass(frozen=True)
class IsCheckpoint(Call[bool]):
    """Whether `path` names a checkpoint the backend can load."""

    path: Any
    verb: ClassVar[str] = "is_checkpoint"


@dataclass(frozen=True)
class Capabilities(Call[GetServerCapabilitiesResponse]):
    verb: ClassVar[str] = "capabilities"


@dataclass(frozen=True)
class ListCheckpoints(Call[list[Checkpoint]]):
    """A run's checkpoints (`run_id`), or every checkpoint the caller may list (None), oldest first."""

    run_id: str | None = None
    verb: ClassVar[str] = "checkpoints"


@dataclass(frozen=True)
class DeleteCheckpoint(Call[None]):
    run_id: str
    checkpoint_id: str
    verb: ClassVar[str] = "delete_checkpoint"


@dataclass(frozen=True)
class SetCheckpointTtl(Call[None]):
    run_id: str
    checkpoint_id: str
    ttl_seconds: int | None
    verb: ClassVar[str] = "set_checkpoint_ttl"


@dataclass(frozen=True)
class WeightsInfo(Call[WeightsInfoResponse]):
    path: Any
    verb: ClassVar[str] = "weights_info"


@dataclass(frozen=True)
class GetExportUrls(Call["ExportUrls"]):
    """Download URLs of a checkpoint's PEFT files (trio_widgets/export.py)."""

    path: Any
    verb: ClassVar[str] = "export_urls"


@dataclass(frozen=True)
class CheckpointDir(Call[Path]):
    """The directory on this machine a checkpoint path names, which exists (a served pool streams
    its files; a key's backend answers for its own runs' tinker:// paths only)."""

    path: Any
    verb: ClassVar[str] = "checkpoint_dir"


@dataclass(frozen=True)
class DownloadCheckpoint(Call[dict[str, int]]):
    """Write a checkpoint's PEFT files into the directory `destination`; answers name -> size."""

    path: Any
    destination: Path
    max_bytes: int
    verb: ClassVar[str] = "download_checkpoint"


@dataclass(frozen=True)
class GetTrainingRun(Call[TrainingRun]):
    run_id: str
    verb: ClassVar[str] = "training_run"


@dataclass(frozen=True)
class ListTrainingRuns(Call[list[TrainingRun]]):
    """The runs the caller may list, most recent first."""

    verb: ClassVar[str] = "training_runs"


@dataclass(frozen=True)
class GetSampler(Call[GetSamplerResponse]):
    sampler_id: str
    verb: ClassVar[str] = "sampler"


@dataclass(frozen=True)
class OpenSession(Call[None]):
    """List a session in the pool's one session table (a server opens one per remote ServiceClient;
    requests that name it list their runs and samplers under it)."""

    session_id: str
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    verb: ClassVar[str] = "open_session"


# -- the served state, as a wire codec sees it (the engine's: trio_widgets/engine/served.py) ----------

#: A codec's encoder of an op's result: (the body, whether it is protobuf bytes).
Encode = Callable[[Any], tuple[bytes | dict, bool]]


class ServedEntry(Protocol):
    """A request a client long-polls (the engine's `Entry`): settled once, by the engine."""

    request_id: str
    kind: str  # the pool's op, or what made it (create_model, load_weights, sample)
    done: asyncio.Event
    body: bytes | dict | None
    protobuf: bool
    error: WireError | None
    cycle: int | None


class ServedSessionView(Protocol):
    """A served session (a remote ServiceClient's): what codecs read of it, and `aliases`, the ids a
    client chose for its requests (-> request ids), which a codec keeps in it (bounded)."""

    session_id: str
    owner: str
    label: str
    state: str  # live, finished, expired
    last_seen: float
    clients: list[str]
    aliases: OrderedDict[str, str]

    @property
    def model_requests(self) -> Mapping[int, ServedEntry]:
        """model_seq_id -> the entry of its create / load."""
        ...


class ServedModelView(Protocol):
    """A served training client (its public id, `model_id`; the pool's handle)."""

    model_id: str
    handle: ModelHandle
    label: str

    @property
    def session(self) -> ServedSessionView: ...


class ServedSamplerView(Protocol):
    """A served sampler (its public id; the pool's handle; the weights it was made of)."""

    sampler_id: str
    handle: ModelHandle
    model_path: str | None

    @property
    def session(self) -> ServedSessionView: ...


class ServedStateView(Protocol):
    """What `call(ServedTables(...))` answers: a server's served state, every behaviour a remote
    client observes but the wire, which each codec asks and none copies. A row a codec got here
    (a session, model, sampler or entry) goes back only to this same state. On the server's event loop."""

    loop: asyncio.AbstractEventLoop  # set by the server when it starts: futures settle on it
    stopping: bool
    session_timeout_s: float
    lanes: OrderedDict[str, str]  # public id -> the pool's client id (telemetry lanes)

    @property
    def stats(self) -> Mapping[str, int]: ...
    @property
    def sessions(self) -> Mapping[str, ServedSessionView]: ...
    @property
    def trained(self) -> Mapping[str, ServedModelView]: ...
    @property
    def entries(self) -> Mapping[str, ServedEntry]: ...
    @property
    def numbers(self) -> Iterator[int]:
        """Numbers given out once (request ids, PyTRIO's sampler numbers)."""
        ...

    def of(self, owner: str) -> Backend: ...
    # sessions
    def session(self, session_id: Any, owner: str, *, live: bool = True) -> ServedSessionView: ...
    def create_session(self, owner: str, user_metadata: Any = None, display_name: Any = None) -> str: ...
    def end_session(self, session: ServedSessionView, state: str, why: str) -> None: ...
    def finish(self, session_id: Any, owner: str, why: str) -> ServedSessionView: ...
    # futures
    def new_entry(self, owner: str, session: ServedSessionView | None, kind: str) -> ServedEntry: ...
    def entry(self, request_id: Any, owner: str) -> ServedEntry: ...
    def forget(self, request_id: str) -> None: ...
    def mark_retrieved(self, entry: ServedEntry) -> None: ...
    async def wait(self, entry: ServedEntry, timeout_s: float) -> bool: ...
    def cancel(self, request_id: Any, owner: str) -> bool: ...
    async def off_loop(self, work: Callable[[], T]) -> T: ...
    # models and samplers
    def model(self, model_id: Any, owner: str) -> ServedModelView: ...
    def sampler(self, sampler_id: Any, owner: str) -> ServedSamplerView: ...
    def base_model(self, name: Any) -> str: ...
    def check_model_slot(self, session: ServedSessionView, n: Any, field_name: str) -> int: ...
    def model_label(self, session: ServedSessionView, n: int, meta: Any) -> str: ...
    def run_slot(self, session: ServedSessionView, n: Any, meta: Any) -> tuple[int, str, str, ServedEntry | None]: ...
    def reserve_run(self, owner: str, session: ServedSessionView) -> int: ...
    def open_run(self, owner: str, session: ServedSessionView, n: int, request: CreateModelRequest | FromStateRequest,
                 label: str, then: Callable[[dict], dict] = ..., kind: str = ...) -> ServedEntry: ...
    def sampler_slot(self, session: ServedSessionView, n: Any) -> int: ...
    def register_sampler(self, session: ServedSessionView, sampler_id: str, handle: ModelHandle,
                         model_path: str | None, n: int) -> None: ...
    async def open_sampler(self, owner: str, session: ServedSessionView, n: Any, model_path: Any,
                           base: Any) -> str: ...
    def sample(self, owner: str, sampler: ServedSamplerView, request: SampleRequest, encode: Encode) -> ServedEntry: ...
    def sample_once(self, owner: str, sampler: ServedSamplerView, caller: str | None, seq: Any,
                    decode: Callable[[], SampleRequest], encode: Encode) -> tuple[str, list[str]]: ...
    def release(self, owner: str, public: Any) -> None: ...
    # a model's requests, in seq_id order
    def consumes(self, model: ServedModelView, seq: Any) -> AbstractContextManager[None]: ...
    def sequenced(self, model: ServedModelView, owner: str, seq: Any, op: str, request: Request,
                  encode: Encode) -> dict: ...
    def refuse_seq(self, owner: str, model_id: Any, seq: Any) -> None: ...
    # tokenizers
    def tokenizer_id(self, name: str, local: bool) -> str | None: ...
    def tokenizer_files(self, owner: str, name: Any) -> dict: ...
    # upkeep (the server's)
    async def reap(self) -> None: ...
    def shut_down(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ServedTables(Call[ServedStateView]):
    """A server's served state, which every wire codec asks and none copies: its sessions (heartbeats,
    TTL), the futures its clients long-poll (retries deduplicated), each model's requests in seq_id
    order, per-key budgets, run and sampler slots (trio_widgets/engine/served.py). Only the engine
    answers it; a server asks once, when it starts. The fields are the server's limits."""

    models: tuple[str, ...]
    key_names: dict[str, str]
    session_timeout_s: float
    reorder_wait_s: float
    max_sessions_per_key: int
    max_clients_per_session: int
    max_futures_per_key: int
    max_clients_per_key: int
    max_state_bytes_per_key: int
    id_tag: str = ""
    verb: ClassVar[str] = "served_tables"


@dataclass(frozen=True)
class GetSession(Call[GetSessionResponse]):
    session_id: str
    verb: ClassVar[str] = "session"


@dataclass(frozen=True)
class ListSessions(Call[list[str]]):
    """Session ids, newest first."""

    verb: ClassVar[str] = "sessions"


@dataclass(frozen=True)
class SamplerHandle(Call[str]):
    """A string another process passes to `AttachSampler` to sample from the same sampler (tinker's
    get_sampler_handle); no credentials in it. NotSupportedError where samplers cannot leave the
    process (an in-process pool)."""

    client_id: str
    verb: ClassVar[str] = "sampler_handle"


@dataclass(frozen=True)
class GetTokenizer(Call[Any]):
    """The base model's tokenizer (a transformers tokenizer)."""

    base_model: str
    verb: ClassVar[str] = "tokenizer"


@dataclass(frozen=True)
class AttachSampler:
    """Open this backend's client of a sampler another backend made (same key): it samples, and
    releasing it leaves the sampler to its maker."""

    sampler_id: str


#: What `Backend.open` makes a client of: a new run, a run from saved state, a sampler, another's sampler.
Open = Union[CreateModelRequest, FromStateRequest, CreateSamplerRequest, AttachSampler]

_OPENS: dict[type, str] = {CreateModelRequest: "_on_create_model", FromStateRequest: "_on_create_model_from_state",
                           CreateSamplerRequest: "_on_create_sampler", AttachSampler: "_on_attach_sampler"}


def answer(backend: object, request: Call[T]) -> T:
    """`backend.call(request)`: the backend's `_on_<verb>` with the request's fields."""
    if not isinstance(request, Call):
        raise TypeError(f"call() takes one of trio_widgets.backend's Call types, got {type(request).__name__}")
    method = getattr(backend, f"_on_{request.verb}", None)
    if method is None:
        raise NotSupportedError(f"{type(backend).__name__} does not answer {type(request).__name__}")
    return method(**{f.name: getattr(request, f.name) for f in fields(request)})  # type: ignore[arg-type]


def opened(backend: object, request: Open) -> ModelHandle:
    """`backend.open(request)`: the backend's maker of that kind of client."""
    name = _OPENS.get(type(request))
    if name is None:
        raise TypeError(f"open() takes a CreateModelRequest, FromStateRequest, CreateSamplerRequest or "
                        f"AttachSampler, got {type(request).__name__}")
    return getattr(backend, name)(request)


class Backend(Protocol):
    """The one seam every transport calls (httpx's transport, in the shape of this API): the
    in-process client, the served pool's wire codecs. Ten members: make clients (`open`), run
    ops (`submit`, `reserve`), let go (`release`), ask anything else (`call`, with a `Call`),
    run client-side work (`run_in_background`), and what a backend is (`name`, `session_id`,
    `pool`), `close`. Every method raises InvalidInputError (naming the field) for a request it
    refuses, before anything is queued."""

    name: str

    @property
    def session_id(self) -> str | None:
        """The session this backend's clients are listed under (None: none yet)."""
        ...

    @property
    def pool(self) -> Any:
        """The in-process pool behind this backend, or None (a served pool)."""
        ...

    def open(self, request: Open) -> ModelHandle: ...

    def submit(self, client_id: str, op: str, request: Request) -> APIFuture: ...

    def reserve(self, client_id: str, op: str) -> Reservation: ...

    def release(self, client_id: str, *, dropped: bool = False) -> None:
        """Let go of a client's state once its queued requests have run. `dropped`: called by a
        garbage-collected client's finalizer, on whatever thread the collector interrupted,
        maybe inside a lock the release takes: only queue it, take no lock, do no I/O."""
        ...

    def call(self, request: Call[T]) -> T: ...

    def run_in_background(self, work: Callable[[], None]) -> None:
        """Run client-side work (a custom loss) off the caller's thread and off the clock."""
        ...

    def close(self) -> None: ...
