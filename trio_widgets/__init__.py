"""trio-widgets: see and steer clock-cycle LoRA training from a notebook.

`import trio_widgets as trio` gives the Tinker / PyTRIO client API over a local pool.
"""

from .client import SamplingClient, ServiceClient, TrainingClient, default_pool
from .engine import DEFAULT_MODEL, LocalPool
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ClientClosedError,
    DownloadFailedError,
    DownloadNotAllowedError,
    InvalidInputError,
    ModelDownloadError,
    PoolClosedError,
    RequestFailedError,
    UnknownModelError,
)
from . import data
from .futures import APIFuture
from .loop import TrainingRun, run_sync, train
from .types import (
    AdamParams,
    AdapterSnapshot,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "APIFuture",
    "AdamParams",
    "AdapterSnapshot",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ClientClosedError",
    "Datum",
    "DownloadFailedError",
    "DownloadNotAllowedError",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "InvalidInputError",
    "LoadWeightsResponse",
    "LocalPool",
    "ModelDownloadError",
    "ModelInput",
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
    "TensorData",
    "TrainingClient",
    "UnknownModelError",
    "default_pool",
    "Dashboard",
    "TrainingRun",
    "run_sync",
    "train",
]


def __getattr__(name: str):
    # The dashboard pulls in ipywidgets and bokeh: import it only when asked for.
    if name == "Dashboard":
        from .widgets.dashboard import Dashboard

        return Dashboard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
