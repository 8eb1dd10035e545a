"""Data types of the client API, shaped like Tinker's / PyTRIO's so code moves by one import.

Plain dataclasses (no pydantic): they are built in the user's hot loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import numpy as np
import torch

from ._numbers import is_int

__all__ = [
    "AdamParams",
    "AdapterSnapshot",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoadWeightsResponse",
    "LossFnType",
    "ModelInput",
    "OptimStepResponse",
    "SampledSequence",
    "SampleResponse",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "TensorData",
]

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]

_DTYPES = {"int64": np.int64, "float32": np.float32}


@dataclass
class TensorData:
    """A flat-or-shaped numeric array that crosses the client boundary as a list."""

    data: list
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        dtype: Literal["int64", "float32"]
        if array.dtype.kind in "iub":
            dtype = "int64"
        elif array.dtype.kind == "f":
            dtype = "float32"
        else:
            raise TypeError(f"TensorData: unsupported numpy dtype {array.dtype}")
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    @classmethod
    def from_any(cls, value: Any) -> TensorData:
        """Lists, numpy arrays, torch tensors and TensorData all become TensorData."""
        if isinstance(value, TensorData):
            return value
        if isinstance(value, torch.Tensor):
            return cls.from_torch(value)
        if isinstance(value, np.ndarray):
            return cls.from_numpy(value)
        if isinstance(value, (list, tuple)):
            flat = list(value)
            if all(is_int(v) for v in flat):
                return cls(data=[int(v) for v in flat], dtype="int64", shape=[len(flat)])
            return cls(data=[float(v) for v in flat], dtype="float32", shape=[len(flat)])
        raise TypeError(
            f"expected a list, numpy array, torch tensor or TensorData, got {type(value).__name__}"
        )

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=_DTYPES[self.dtype])
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def __len__(self) -> int:
        return len(self.data)


@dataclass
class EncodedTextChunk:
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ModelInput:
    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append_int(self, token: int) -> ModelInput:
        return ModelInput.from_ints(self.to_ints() + [int(token)])


@dataclass
class Datum:
    """One training sequence and everything its loss needs.

    `loss_fn_inputs` values may be plain lists, numpy arrays, torch tensors or
    TensorData; they are stored as TensorData.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.model_input, (list, tuple)):
            self.model_input = ModelInput.from_ints(self.model_input)
        self.loss_fn_inputs = {k: TensorData.from_any(v) for k, v in self.loss_fn_inputs.items()}


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class SamplingParams:
    """How `SamplingClient.sample` generates.

    `temperature` 0 is greedy; `top_k` -1 (or 0) and `top_p` 1.0 turn those filters off;
    `stop` is a string, a list of strings, or a list of token ids: generation ends right
    after the token that completes one (that token is kept in the output). The same
    `seed` with the same prompt and model gives the same samples.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: Union[str, Sequence[str], Sequence[int], None] = None
    seed: int | None = None


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs (`logprobs`, `elementwise_loss`) and `name:reduction` metrics."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]

    @property
    def loss(self) -> float:
        return self.metrics.get("loss:sum", math.nan)


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SampledSequence:
    """`logprobs[i]` is the model's log-probability of `tokens[i]` (at temperature 1, before
    top-k / top-p), so it equals `compute_logprobs` of the same tokens."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass
class SaveWeightsResponse:
    """`save_state`: `path` is the checkpoint directory (adapter weights + optimizer state)."""

    path: str


@dataclass
class SaveWeightsForSamplerResponse:
    """`save_weights_for_sampler`: `path` is a PEFT adapter directory (None if not written)."""

    path: str | None


@dataclass
class LoadWeightsResponse:
    path: str


LoRAPair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AdapterSnapshot:
    """A read-only copy of one training client's LoRA state, as of the requests submitted
    before `TrainingClient.inspect_adapter()` (it runs through the clock in order).

    `weights[name]` is (A [rank, in], B [out, rank]); `grad` is the gradient accumulated
    since the last optim_step (None if there is none); `exp_avg` / `exp_avg_sq` are the
    AdamW moments (empty before the first step). All tensors are float32 CPU copies.
    """

    client_id: str
    base_model: str
    rank: int
    alpha: float
    seed: int
    step: int
    weights: dict[str, LoRAPair]
    grad: dict[str, LoRAPair] | None
    exp_avg: dict[str, LoRAPair]
    exp_avg_sq: dict[str, LoRAPair]

    @property
    def scale(self) -> float:
        """The factor on the LoRA delta: alpha / rank (as in PEFT)."""
        return self.alpha / self.rank

    @property
    def shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        return {name: (tuple(a.shape), tuple(b.shape)) for name, (a, b) in self.weights.items()}

    def norms(self) -> dict[str, float]:
        """Frobenius norm of each module's delta-producing pair, `name.lora_A` / `name.lora_B`."""
        return {f"{name}.lora_{ab}": float(t.norm()) for name, pair in self.weights.items()
                for ab, t in zip("AB", pair)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights as flat `name.lora_A` / `name.lora_B` keys (PEFT's naming, without prefixes)."""
        return {f"{name}.lora_{ab}": t for name, pair in self.weights.items() for ab, t in zip("AB", pair)}

    def grad_dict(self) -> dict[str, torch.Tensor]:
        """The pending gradient with the same keys as `state_dict()` (empty if there is none)."""
        return {f"{name}.lora_{ab}": t for name, pair in (self.grad or {}).items() for ab, t in zip("AB", pair)}
