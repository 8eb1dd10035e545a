"""trio-widgets: see and steer clock-cycle LoRA training from a notebook.

`import trio_widgets as trio` gives the Tinker / PyTRIO client API over a local pool.
The client, the HTTP backend and the dashboard need no torch; `LocalPool` (the engine, the
`[engine]` extra) is imported when first asked for.
"""

from . import data, types
from .client import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
    SamplingClient,
    ServiceClient,
    TrainingClient,
    configure,
    configure_observability,
    default_pool,
    shutdown_observability,
)
from .connect import DEFAULT_MODEL

# Cheap (stdlib only at import). It shadows the submodule: use `from trio_widgets.doctor import ...`.
from .doctor import doctor
from .errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BillingError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ClientClosedError,
    ConflictError,
    DownloadFailedError,
    DownloadNotAllowedError,
    ExperimentalWarning,
    InternalServerError,
    InvalidInputError,
    ModelDownloadError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
    PoolClosedError,
    PyTrioError,
    RateLimitError,
    RequestFailedError,
    TinkerError,
    UnknownModelError,
    UnprocessableEntityError,
)
from .futures import APIFuture, WaitInterrupted
from .loop import RunInterrupted, TrainingRun, run_sync, train
from .rest import RestClient
from .types import (
    AdamOptimizerConfig,
    AdamParams,
    AdapterSnapshot,
    Checkpoint,
    CheckpointType,
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageAssetPointerChunk,
    ImageChunk,
    LoadWeightsResponse,
    LossHandle,
    ModelID,
    ModelInput,
    ModelInputChunk,
    OptimParams,
    OptimStepResponse,
    ParsedCheckpointTinkerPath,
    PerDatumLossFn,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    StopReason,
    TensorData,
    TensorDtype,
)

# It shadows the submodule: use `from trio_widgets.watch import ...`.
from .watch import unwatch, watch

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "APIFuture",
    "AdamOptimizerConfig",
    "AdamParams",
    "AdapterSnapshot",
    "BackcompatSamplingClientFuture",
    "BackcompatTrainingClientFuture",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointType",
    "ClientClosedError",
    "Datum",
    "DmelChunk",
    "DownloadFailedError",
    "DownloadNotAllowedError",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ImageAssetPointerChunk",
    "ImageChunk",
    "InvalidInputError",
    "NotSupportedError",
    "LoadWeightsResponse",
    "LocalPool",
    "LossHandle",
    "ModelID",
    "ModelDownloadError",
    "ModelInput",
    "ModelInputChunk",
    "OptimParams",
    "OptimStepResponse",
    "ParsedCheckpointTinkerPath",
    "PerDatumLossFn",
    "PoolClosedError",
    "RequestFailedError",
    "RestClient",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServiceClient",
    "StopReason",
    "TensorData",
    "TensorDtype",
    "TrainingClient",
    "UnknownModelError",
    "configure",
    "configure_observability",
    "data",
    "default_pool",
    "doctor",
    "shutdown_observability",
    "types",
    # the hosted SDKs' exception names (see errors.py for which of ours each one catches)
    "APIConnectionError",
    "APIError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "BillingError",
    "ConflictError",
    "ExperimentalWarning",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "PyTrioError",
    "RateLimitError",
    "TinkerError",
    "UnprocessableEntityError",
    "Dashboard",
    "RunInterrupted",
    "WaitInterrupted",
    "serve",
    "TrainingRun",
    "run_sync",
    "train",
    "unwatch",
    "watch",
]


def __getattr__(name: str):
    # The dashboard pulls in ipywidgets and bokeh, the server starlette and uvicorn: import them
    # only when asked for.
    if name == "LocalPool":  # the engine: torch, transformers (the [engine] extra)
        from .engine import LocalPool

        return LocalPool
    if name == "Dashboard":
        from .widgets.dashboard import Dashboard

        return Dashboard
    if name == "serve":
        from .http.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
