"""trio-widgets: see and steer clock-cycle LoRA training from a notebook.

`import trio_widgets as trio` gives the Tinker / PyTRIO client API over a local pool.
"""

from . import data, types
from .client import SamplingClient, ServiceClient, TrainingClient, default_pool

# Cheap (stdlib only at import). It shadows the submodule: use `from trio_widgets.doctor import ...`.
from .doctor import doctor
from .engine import DEFAULT_MODEL, LocalPool
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
    CheckpointNotFoundError,
    ClientClosedError,
    ConflictError,
    ExperimentalWarning,
    InternalServerError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    PoolClosedError,
    PyTrioError,
    RateLimitError,
    RequestFailedError,
    TinkerError,
    UnknownModelError,
    UnprocessableEntityError,
)
from .futures import APIFuture
from .loop import TrainingRun, run_sync, train
from .types import (
    AdamOptimizerConfig,
    AdamParams,
    AdapterSnapshot,
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageAssetPointerChunk,
    ImageChunk,
    LoadWeightsResponse,
    ModelID,
    ModelInput,
    ModelInputChunk,
    OptimParams,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    StopReason,
    TensorData,
    TensorDtype,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "APIFuture",
    "AdamOptimizerConfig",
    "AdamParams",
    "AdapterSnapshot",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ClientClosedError",
    "Datum",
    "DmelChunk",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ImageAssetPointerChunk",
    "ImageChunk",
    "InvalidInputError",
    "LoadWeightsResponse",
    "LocalPool",
    "ModelID",
    "ModelInput",
    "ModelInputChunk",
    "OptimParams",
    "OptimStepResponse",
    "PoolClosedError",
    "RequestFailedError",
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
    "data",
    "default_pool",
    "doctor",
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
    "serve",
    "TrainingRun",
    "run_sync",
    "train",
]


def __getattr__(name: str):
    # The dashboard pulls in ipywidgets and bokeh, the server starlette and uvicorn: import them
    # only when asked for.
    if name == "Dashboard":
        from .widgets.dashboard import Dashboard

        return Dashboard
    if name == "serve":
        from .http.server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
