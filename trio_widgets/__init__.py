"""trio-widgets: see and steer clock-cycle LoRA training from a notebook.

`import trio_widgets as trio` gives the Tinker / PyTRIO client API over a local pool.
"""

from .client import ServiceClient, TrainingClient, default_pool
from .engine import DEFAULT_MODEL, LocalPool
from .errors import InvalidInputError, PoolClosedError, RequestFailedError, UnknownModelError
from .futures import APIFuture
from .types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "InvalidInputError",
    "LocalPool",
    "ModelInput",
    "OptimStepResponse",
    "PoolClosedError",
    "RequestFailedError",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
    "UnknownModelError",
    "default_pool",
]
