"""Data types of the client API, shaped like Tinker's / PyTRIO's so code moves by one import.

Plain dataclasses (no pydantic): they are built in the user's hot loop. Where the two SDKs
name or shape a type differently, ours answers to both (pytrio's `SampleSequence` is
`SampledSequence`, both `tokens` and tinker's `tokens_np`, ...); what is left over is
listed, with the reason, in tests/test_sdk_parity.py.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from ._numbers import is_int
from .errors import InvalidInputError, RequestErrorCategory
from .futures import APIFuture
from .hosted import hosted_only
from .protocol.paths import TINKER_SCHEME, parse_tinker_path

if TYPE_CHECKING:
    import torch

__all__ = [
    "APIFuture",
    "AdamOptimizerConfig",
    "AdamParams",
    "AdapterSnapshot",
    "Checkpoint",
    "CheckpointArchiveUrlResponse",
    "CheckpointDownloadResult",
    "CheckpointDownloadSource",
    "CheckpointType",
    "CheckpointsListResponse",
    "Cursor",
    "CustomLossInput",
    "Datum",
    "DmelChunk",
    "EncodedTextChunk",
    "ExternalWeightsUrlsResponse",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetSamplerResponse",
    "GetServerCapabilitiesResponse",
    "GetSessionResponse",
    "ImageAssetPointerChunk",
    "ImageChunk",
    "ListSessionsResponse",
    "LoadWeightsResponse",
    "LoraRunSpec",
    "LossFnOutput",
    "LossFnType",
    "LossHandle",
    "ModelData",
    "ModelID",
    "ModelInput",
    "ModelInputChunk",
    "ModelOperationCapabilities",
    "OptimParams",
    "OptimStepResponse",
    "ParsedCheckpointTinkerPath",
    "PerDatumLossFn",
    "PromptAltTokens",
    "RequestErrorCategory",
    "SDKTypeError",
    "SampledSequence",
    "SampleResponse",
    "SampleSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsExternalResponse",
    "SaveWeightsResponse",
    "StopReason",
    "SupportedModel",
    "TensorData",
    "TensorDtype",
    "TopkLogprobs",
    "TrainingRun",
    "TrainingRunsResponse",
    "WeightsInfoResponse",
    "check_text_only",
    "finish_sample_response",
    "first_non_text_chunk",
    "from_sdk",
    "sdk_of",
    "to_sdk",
]

# tinker also has "stable_reinforce" (its objective is not published: see engine/losses.py)
# and "custom" (server-side loss handles).
LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
TensorDtype = Literal["int64", "float32"]
"""The element types a `TensorData` holds."""
StopReason = Literal["stop", "length"]
"""Why a sampled sequence ended: a stop string or token, or `max_tokens`."""
ModelID = str
"""A base model's name, e.g. `trio.DEFAULT_MODEL` or a Hugging Face id."""

_NUMPY_DTYPES = {"int64": np.int64, "float32": np.float32}

# tinker's Datum types list inputs by key (types/datum.py `_KEY_TO_TYPE`): integer weights
# are still weights. Other keys take their dtype from the values, as pytrio does.
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}


# -- tensors ---------------------------------------------------------------------------

def _as_array(value: Any) -> np.ndarray:
    """Any numeric list (nested: rectangular), numpy array, torch tensor or TensorData."""
    if isinstance(value, TensorData):
        return value.to_numpy()
    torch = sys.modules.get("torch")  # a tensor means torch was imported: the core install has none
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16
            value = value.float()
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if value is None:
        return np.empty(0, dtype=np.float32)
    if isinstance(value, (str, bytes, dict)):
        raise TypeError(f"expected numbers (a list, numpy array, torch tensor or TensorData), "
                        f"got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except ValueError:  # numpy refuses ragged nesting
        raise ValueError("must be a rectangular numeric array; ragged nested lists are not supported") from None
    if array.dtype.kind not in "biuf":
        raise TypeError(f"expected numbers, got values of type {array.dtype}")
    return array


def _cast(array: np.ndarray, dtype: TensorDtype | None) -> tuple[np.ndarray, TensorDtype]:
    """`dtype` None infers it (floats: float32; integers, booleans: int64). Floats become
    int64 only when every value is an integer: truncating 1.5 to 1 would be a silent bug."""
    if array.dtype.kind not in "biuf":
        raise TypeError(f"unsupported dtype {array.dtype}")
    if dtype is None:
        dtype = "float32" if array.dtype.kind == "f" else "int64"
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"dtype must be 'int64' or 'float32', got {dtype!r}")
    if dtype == "int64" and array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if bad.size:
            raise ValueError(f"expected integers (int64), got {float(array.reshape(-1)[bad[0]])!r} at flat "
                             f"position {int(bad[0])}")
    return array.astype(_NUMPY_DTYPES[dtype], copy=False), dtype


# -- the hosted SDKs' own objects, and ours handed to them ------------------------------------

_SDK_PACKAGES = ("tinker", "pytrio")


def sdk_of(value: Any) -> str | None:
    """"tinker" or "pytrio" for an object of that SDK's own types, else None."""
    package = type(value).__module__.split(".", 1)[0]
    return package if package in _SDK_PACKAGES else None


class SDKTypeError(AttributeError, TypeError):
    """A trio_widgets object handed to a hosted SDK's code, which read an attribute only its own
    type has. A TypeError that says what to pass instead; also an AttributeError, so that
    `hasattr` and `getattr(..., default)` behave as before."""


class _SDKInterop:
    """What trio's input types (Datum, ModelInput and its chunks, TensorData, AdamParams,
    SamplingParams) share with the SDKs' own, whose shapes they have: `to_tinker()` /
    `to_pytrio()` give the SDK's object; SDK code that reads one of ours as its own gets an
    SDKTypeError saying so, not a bare AttributeError deep inside the SDK; and ours accept
    theirs (`from_sdk`)."""

    def to_tinker(self) -> Any:
        """The same value as the tinker SDK's own type (for the official tinker client)."""
        return to_sdk(self, "tinker")

    def to_pytrio(self) -> Any:
        """The same value as the pytrio SDK's own type (for the official pytrio client)."""
        return to_sdk(self, "pytrio")

    def __getattr__(self, name: str) -> Any:  # only reached for an attribute this object lacks
        raise self._missing(name)

    def _missing(self, name: str) -> AttributeError:
        """The error for reading `name`, which this object lacks (from a `__getattr__`, whose caller
        is two frames up)."""
        caller = str(sys._getframe(2).f_globals.get("__name__", ""))
        sdk = caller.split(".", 1)[0]
        cls = type(self).__name__
        if sdk in _SDK_PACKAGES:
            return SDKTypeError(
                f"{sdk}'s SDK read {name!r} of a trio_widgets.{cls}, which only its own {sdk}.types.{cls} has: hand "
                f"{sdk} its own types; trio's Datum, ModelInput, TensorData, AdamParams and SamplingParams convert "
                f"with .to_{sdk}() (a batch: [d.to_{sdk}() for d in data])")
        return AttributeError(f"{cls!r} object has no attribute {name!r}")


def from_sdk(value: Any) -> Any:
    """Ours for a tinker or pytrio Datum, ModelInput, chunk, TensorData, AdamParams or
    SamplingParams (field by field: the shapes agree), and for a list or tuple of them a list;
    anything else as it is (the checks then name what is wrong)."""
    if isinstance(value, (list, tuple)):
        return [from_sdk(v) for v in value] if any(sdk_of(v) for v in value) else value
    sdk = sdk_of(value)
    if sdk is None:
        return value
    name = type(value).__name__
    if name == "TensorData":
        if hasattr(value, "to_numpy"):  # tinker's densifies a sparse one
            return TensorData(np.asarray(value.to_numpy()), value.dtype)
        return TensorData(value.data, value.dtype, value.shape)
    if name == "ModelInput":
        return ModelInput(chunks=[from_sdk(c) for c in value.chunks])
    if name == "Datum":
        for spans in ("model_input_spans", "loss_fn_input_spans"):
            if getattr(value, spans, None) is not None:
                raise TypeError(f"{sdk}.types.Datum.{spans} is set: provenance spans only serve tinker's "
                                f"stable_reinforce, which the local pool does not have; pass the Datum without them")
        return Datum(from_sdk(value.model_input), {k: from_sdk(v) for k, v in value.loss_fn_inputs.items()})
    ours = _SAME_FIELDS.get(name)
    if ours is None:
        return value
    fields_of = ours.__dataclass_fields__  # type: ignore[attr-defined]
    return ours(**{f: from_sdk(getattr(value, f)) for f in fields_of if f != "type" and hasattr(value, f)})


def to_sdk(value: Any, sdk: str) -> Any:
    """The hosted SDK's own object (`sdk`: "tinker" or "pytrio") for one of ours."""
    import importlib

    try:
        module = importlib.import_module(f"{sdk}.types")
    except ImportError:
        raise ImportError(f"to_{sdk}() needs the {sdk} SDK installed (pip install {sdk})") from None
    if isinstance(value, TensorData):
        return module.TensorData.from_numpy(value.to_numpy())
    if isinstance(value, ModelInput):
        return module.ModelInput(chunks=[to_sdk(c, sdk) for c in value.chunks])
    if isinstance(value, Datum):
        return module.Datum(model_input=to_sdk(value.model_input, sdk),
                            loss_fn_inputs={k: to_sdk(v, sdk) for k, v in value.loss_fn_inputs.items()})
    if isinstance(value, (list, tuple)):
        return [to_sdk(v, sdk) for v in value]
    name = type(value).__name__
    theirs = getattr(module, name, None)
    if type(value) not in _SAME_FIELDS.values() or theirs is None:
        raise TypeError(f"{sdk} has no counterpart of a trio_widgets {name}")
    return theirs(**{f: getattr(value, f) for f in value.__dataclass_fields__ if f != "type"})


@dataclass(init=False)
class TensorData(_SDKInterop):
    """A flat-or-shaped numeric array that crosses the client boundary as a list.

    `TensorData(data=[...])` infers `dtype` (tinker requires it, pytrio infers it from
    lists); a given `dtype` is applied, except that floats are refused as int64 unless
    they are whole numbers. `shape` defaults to the data's own shape; `data` is flat.
    """

    data: list
    dtype: TensorDtype
    shape: list[int]

    def __init__(self, data: Any = None, dtype: TensorDtype | None = None, shape: Sequence[int] | None = None):
        array, self.dtype = _cast(_as_array(data), dtype)
        if shape is not None:
            shape = [int(d) for d in shape]
            if any(d < 0 for d in shape) or math.prod(shape) != array.size:
                raise ValueError(f"shape {shape} does not fit {array.size} values")
        self.shape = list(array.shape) if shape is None else shape
        # `data` is made from this copy when first read: a served pool hands thousands of values per
        # forward from torch to the wire and never reads them as Python numbers, which would cost
        # ~32 bytes each, freed in an order that leaves the heap fragmented (issue 36, memory)
        self._array = array.reshape(-1).copy()

    def __getattr__(self, name: str) -> Any:  # only reached for an attribute this object lacks
        if name == "data":
            array = self.__dict__.get("_array")
            if array is not None:
                # (setdefault, then pop: a thread reading it meanwhile gets the same list, never an error)
                data = self.__dict__.setdefault("data", array.tolist())
                self.__dict__.pop("_array", None)
                return data
        raise self._missing(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data":  # the list given is the data from now on
            self.__dict__.pop("_array", None)
        super().__setattr__(name, value)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"TensorData: unsupported numpy dtype {array.dtype}")
        return cls(array)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls(tensor)

    @classmethod
    def from_any(cls, value: Any) -> TensorData:
        """Lists, numpy arrays, torch tensors and TensorData (ours, tinker's or pytrio's) all become TensorData."""
        if sdk_of(value) and type(value).__name__ == "TensorData":
            return from_sdk(value)
        return value if isinstance(value, TensorData) else cls(value)

    def to_numpy(self) -> np.ndarray:
        """The data as a numpy array of its shape and dtype (a copy: changing it changes no TensorData)."""
        array = self.__dict__.get("_array")
        if array is not None:
            return array.astype(_NUMPY_DTYPES[self.dtype]).reshape(self.shape)
        return np.asarray(self.data, dtype=_NUMPY_DTYPES[self.dtype]).reshape(self.shape)

    def to_torch(self) -> torch.Tensor:
        """The data as a torch tensor of its shape and dtype."""
        import torch  # needs the engine extra (or any torch)

        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        """Nested like `shape` (tinker); for the usual 1-D data, the flat list (pytrio)."""
        return self.to_numpy().tolist()

    def __len__(self) -> int:
        array = self.__dict__.get("_array")
        return int(array.size) if array is not None else len(self.data)


# -- model input -------------------------------------------------------------------------

@dataclass
class EncodedTextChunk(_SDKInterop):
    """A run of token ids in a `ModelInput`.

    Example: `ModelInput(chunks=[EncodedTextChunk(tokens=[72, 105])])`, or `ModelInput.from_ints([72, 105])`.
    """

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        """The number of tokens in this chunk."""
        return len(self.tokens)

    def to_ints(self) -> list[int]:
        """The chunk's token ids as a list of ints."""
        return list(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


def _image_bytes(data: Any, where: str) -> bytes:
    if isinstance(data, str):  # both SDKs take base64 text (their JSON form)
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInputError("a str must be standard base64", field=where) from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"expected bytes (or base64 text), got {type(data).__name__}", field=where)
    if not data:
        raise InvalidInputError("is empty", field=where)
    return bytes(data)


def _check_image_fields(kind: str, fmt: Any, expected_tokens: Any) -> None:
    if fmt not in ("png", "jpeg"):
        raise InvalidInputError(f"must be 'png' or 'jpeg', got {fmt!r}", field=f"{kind}.format")
    if expected_tokens is not None and (isinstance(expected_tokens, bool) or not isinstance(expected_tokens, int)
                                        or expected_tokens <= 0):
        raise InvalidInputError(f"must be None or an integer > 0, got {expected_tokens!r}",
                                field=f"{kind}.expected_tokens")


def _image_length(kind: str, expected_tokens: int | None) -> int:
    if expected_tokens is None:
        raise ValueError(f"{kind} expected_tokens needs to be set in order to compute the length")
    return expected_tokens


@dataclass
class ImageChunk(_SDKInterop):
    """An image in a prompt. Accepted so that multimodal code builds its inputs; the local
    base models read text only, so a request containing one is rejected at submit
    (`check_text_only`) with an error naming the base model."""

    data: bytes
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = None
    type: Literal["image"] = "image"

    def __post_init__(self) -> None:
        self.data = _image_bytes(self.data, "ImageChunk.data")
        _check_image_fields("ImageChunk", self.format, self.expected_tokens)

    @property
    def length(self) -> int:
        """The number of tokens this image takes in the model input."""
        return _image_length("ImageChunk", self.expected_tokens)


@dataclass
class ImageAssetPointerChunk(_SDKInterop):
    """tinker: an image by path or URL. Accepted and rejected at submit, as ImageChunk."""

    format: Literal["png", "jpeg"]
    location: str
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    def __post_init__(self) -> None:
        _check_image_fields("ImageAssetPointerChunk", self.format, self.expected_tokens)

    @property
    def length(self) -> int:
        """The number of tokens this image takes in the model input."""
        return _image_length("ImageAssetPointerChunk", self.expected_tokens)


@dataclass
class DmelChunk(_SDKInterop):
    """tinker: serialized DMel (audio) model tokens. Accepted and rejected at submit."""

    dmel: bytes
    type: Literal["dmel"] = "dmel"

    def __post_init__(self) -> None:
        self.dmel = _image_bytes(self.dmel, "DmelChunk.dmel")

    @property
    def length(self) -> int:
        # Its length lives inside tinker's tensor container format, which nothing here reads.
        """The number of tokens this chunk takes in the model input."""
        raise ValueError("the length of a DmelChunk is unknown to the local pool (text-only models)")


ModelInputChunk = Union[EncodedTextChunk, ImageChunk, ImageAssetPointerChunk, DmelChunk]
"""One chunk of a `ModelInput`: text tokens, an image or audio."""


@dataclass
class ModelInput(_SDKInterop):
    """The tokens a model reads: a list of chunks (text tokens here; images are the hosted services').

    Example: `trio.ModelInput.from_ints(tokenizer.encode("1+1="))`.
    """

    chunks: list[ModelInputChunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        if any(sdk_of(c) for c in self.chunks):  # tinker's or pytrio's chunks: ours, field by field
            self.chunks = [from_sdk(c) for c in self.chunks]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        """Token ids must be integers: 1.5 or "7" is a bug upstream, not a token to guess."""
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
            raise InvalidInputError(f"expected a sequence of token ids, got {type(tokens).__name__}",
                                    field="model_input")
        ids = list(tokens)
        for pos, t in enumerate(ids):
            if not is_int(t):
                raise InvalidInputError(f"token {pos} is {t!r} ({type(t).__name__}), not an integer token id",
                                        field="model_input")
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in ids])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """The input's token ids as a list of ints (text chunks only)."""
        found = first_non_text_chunk(self)
        if found is not None:
            index, chunk = found
            raise InvalidInputError(f"is {_a(type(chunk).__name__)}, which has no token ids",
                                    field=f"model_input.chunks[{index}]")
        return [t for chunk in self.chunks if isinstance(chunk, EncodedTextChunk) for t in chunk.tokens]

    def tolist(self) -> list[int]:
        """The input's token ids as a list (pytrio's name for `to_ints`)."""
        return self.to_ints()

    @property
    def length(self) -> int:
        """The number of tokens of the whole input."""
        return sum(chunk.length for chunk in self.chunks)

    def __len__(self) -> int:
        return self.length

    @property
    def has_images(self) -> bool:
        """True if any chunk is an image."""
        return any(isinstance(c, (ImageChunk, ImageAssetPointerChunk)) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """True if the input has no tokens."""
        return not any(not isinstance(c, EncodedTextChunk) or c.tokens for c in self.chunks)

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        """A new ModelInput with `chunk` added (this one is unchanged, as in tinker)."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new input with one more token at the end."""
        return self.append(EncodedTextChunk(tokens=[int(token)]))


def _a(name: str) -> str:
    return f"{'an' if name[0] in 'AEIOU' else 'a'} {name}"


def first_non_text_chunk(model_input: ModelInput) -> tuple[int, Any] | None:
    """(index, chunk) of the first chunk that is not token ids, or None if there is none."""
    for index, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            return index, chunk
    return None


def check_text_only(model_input: ModelInput, base_model: str, field: str = "model_input",
                    datum_index: int | None = None) -> None:
    """Raise an InvalidInputError naming the base model and the chunk if `model_input`
    holds an image (or any other non-text) chunk: the local base models read text only."""
    found = first_non_text_chunk(model_input)
    if found is None:
        return
    index, chunk = found
    raise InvalidInputError(
        f"is {_a(type(chunk).__name__)}, but {base_model} is a text-only model: it reads token ids "
        f"(EncodedTextChunk) only", field=f"{field}.chunks[{index}]", datum_index=datum_index)


# -- training ----------------------------------------------------------------------------

@dataclass
class Datum(_SDKInterop):
    """One training sequence and everything its loss needs.

    `loss_fn_inputs` values may be plain lists, numpy arrays, torch tensors or
    TensorData; they are stored as TensorData in the dtype of their values, except that
    integers under a float key (`LOSS_INPUT_DTYPES`: `weights`, `advantages`, ...) become
    float32, as in tinker. Floats under `target_tokens` are kept, and rejected at submit.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.model_input, (list, tuple)):
            self.model_input = ModelInput.from_ints(self.model_input)
        elif sdk_of(self.model_input):  # tinker's or pytrio's ModelInput
            self.model_input = from_sdk(self.model_input)
        if not isinstance(self.loss_fn_inputs, dict):
            raise InvalidInputError(f"must be a dict of arrays, got {type(self.loss_fn_inputs).__name__}",
                                    field="loss_fn_inputs")
        converted = {}
        for key, value in self.loss_fn_inputs.items():
            try:
                if key == "target_tokens" and not isinstance(value, TensorData) and not sdk_of(value) \
                        and _as_array(value).dtype.kind == "b":
                    raise TypeError("target tokens must be token ids, got booleans")
                td = TensorData.from_any(value)
                if LOSS_INPUT_DTYPES.get(key) == "float32" and td.dtype != "float32":
                    td = TensorData(td, "float32")
            except (TypeError, ValueError, OverflowError, NotImplementedError, RuntimeError) as exc:
                # (meta tensors raise NotImplementedError, odd tensors RuntimeError: all mean "not data")
                raise InvalidInputError(f"{exc}", field=f"loss_fn_inputs[{key!r}]") from None
            # Floats under an int64 key (target_tokens) stay floats: the submit check rejects
            # them by datum index, where tinker would truncate 1.5 to 1 without a word.
            converted[key] = td
        self.loss_fn_inputs = converted


@dataclass
class AdamParams(_SDKInterop):
    """AdamW settings of one `optim_step` (tinker's defaults; also pytrio's `OptimParams`).

    Example: `tc.optim_step(trio.AdamParams(learning_rate=3e-3))`.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# tinker's union of per-step optimizer parameters: AdamW is the only optimizer here.
OptimParams = AdamParams


@dataclass(frozen=True)
class AdamOptimizerConfig:
    """tinker: the optimizer a training client is created with; AdamW (the only one here)."""

    type: Literal["adamw"] = "adamw"


@dataclass
class SamplingParams(_SDKInterop):
    """How `SamplingClient.sample` generates (fields in the SDKs' order).

    `temperature` 0 is greedy; `top_k` -1 (or 0) and `top_p` 1.0 turn those filters off;
    `stop` is a string, a list of strings, or a list of token ids: generation ends right
    after the token that completes one (that token is kept in the output). The same
    `seed` with the same prompt and model gives the same samples. `max_tokens` defaults
    to 16 where both SDKs say None (tinker: the server decides; pytrio: an error).
    """

    max_tokens: int = 16
    seed: int | None = None
    stop: Union[str, Sequence[str], Sequence[int], None] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


# the input types whose fields are the SDKs' (by name), converted field by field both ways
_SAME_FIELDS: dict[str, type] = {cls.__name__: cls for cls in (
    EncodedTextChunk, ImageChunk, ImageAssetPointerChunk, DmelChunk, AdamParams, SamplingParams)}


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs (`logprobs`, `elementwise_loss`) and `name:reduction` metrics.
    `debug` is pytrio's field; nothing is put in it here."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=dict)
    debug: dict[str, object] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """The loss of the request (its `loss:sum` metric)."""
        return self.metrics.get("loss:sum", math.nan)


LossFnOutput = dict[str, TensorData]  # pytrio: one datum's entry of `loss_fn_outputs`


@dataclass
class OptimStepResponse:
    """The result of `optim_step`: its metrics (e.g. `step:max`, the optimizer's step count)."""

    metrics: dict[str, float] = field(default_factory=dict)


# -- sampling ------------------------------------------------------------------------------

_TOPK_EMPTY = (0, -99999.0)  # tinker's sentinel for an empty top-k cell


@dataclass(frozen=True)
class TopkLogprobs:
    """tinker: top-k (token id, logprob) per position as two `(length, k)` matrices
    (int32 / float32); empty cells hold (0, -99999.0)."""

    token_ids: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[tuple[int, float]] | None]) -> TopkLogprobs:
        k = max((len(r) for r in rows if r), default=0)
        ids = np.full((len(rows), k), _TOPK_EMPTY[0], dtype=np.int32)
        lps = np.full((len(rows), k), _TOPK_EMPTY[1], dtype=np.float32)
        for i, row in enumerate(rows):
            for j, (tok, lp) in enumerate(row or ()):
                ids[i, j], lps[i, j] = tok, lp
        return cls(ids, lps)


def _new_sequence_id() -> str:
    return f"seq-{uuid.uuid4().hex}"


@dataclass
class SampledSequence:
    """One sampled continuation (pytrio calls the class `SampleSequence`).

    `logprobs[i]` is the model's log-probability of `tokens[i]` (at temperature 1, before
    top-k / top-p), so it equals `compute_logprobs` of the same tokens. `sequence_id` is
    unique per sequence (tinker). `text` (pytrio) is the decoded continuation where the
    base model has a tokenizer, else None: the sampler knows the tokenizer, so it fills
    `text` through `finish_sample_response`. `topk_logprobs` is filled only when top-k
    sample logprobs were asked for.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    sequence_id: str = field(default_factory=_new_sequence_id)
    text: str | None = None
    topk_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def tokens_np(self) -> np.ndarray:
        """The sampled tokens as a numpy array."""
        return np.asarray(self.tokens, dtype=np.int32)  # tinker's dtype

    @property
    def logprobs_np(self) -> np.ndarray:
        """The sampled tokens' logprobs as a numpy array (None if not asked for)."""
        return np.asarray(self.logprobs, dtype=np.float32)

    @property
    def topk_logprobs_np(self) -> TopkLogprobs | None:
        """Each sampled position's top-k logprobs as numpy arrays (None if not asked for)."""
        return None if self.topk_logprobs is None else TopkLogprobs.from_lists(self.topk_logprobs)


SampleSequence = SampledSequence


@dataclass(frozen=True)
class PromptAltTokens:
    """tinker: `k` independent draws (with replacement, at the request's temperature) from the
    model's distribution at every prompt position after the first: `tokens` (int64) and
    their model logprobs (float32, temperature 1), both `[len(prompt) - 1, k]`; row `i`
    holds alternatives to `prompt[i + 1]`."""

    tokens: TensorData
    logprobs: TensorData


@dataclass
class SampleResponse:
    """`prompt_logprobs` (and `topk_prompt_logprobs`) are None unless asked for; entry 0 is
    None (the first token has no context), and so is every entry before the last
    `prompt_logprobs_last_n`. `input_tokens` (pytrio) is the prompt's length, filled by the
    sampler through `finish_sample_response`; `output_tokens` counts the generated tokens.
    There is no prefix cache to bill, so `prompt_cache_hit_tokens` is 0.
    `target_prompt_logprobs` / `prompt_alt_tokens` answer tinker's request options of the
    same names (None unless asked for)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    type: Literal["sample"] = "sample"  # pytrio's response-type tag (tinker's has none)

    @property
    def output_tokens(self) -> int:
        """The number of tokens sampled, all sequences together (pytrio's field)."""
        return sum(len(s.tokens) for s in self.sequences)

    @property
    def prompt_logprobs_np(self) -> np.ndarray | None:
        """tinker: float32, NaN where there is no logprob."""
        if self.prompt_logprobs is None:
            return None
        return np.asarray([math.nan if v is None else v for v in self.prompt_logprobs], dtype=np.float32)

    @property
    def topk_prompt_logprobs_np(self) -> TopkLogprobs | None:
        """The prompt's top-k logprobs as numpy arrays (tinker's view)."""
        return None if self.topk_prompt_logprobs is None else TopkLogprobs.from_lists(self.topk_prompt_logprobs)


def finish_sample_response(response: SampleResponse, prompt_tokens: int,
                           decode: Callable[[list[int]], str] | None = None) -> SampleResponse:
    """What the sampler adds to a response: pytrio's `input_tokens` and, with a decoder
    (the base model's tokenizer), each sequence's `text`. Returns `response`, so it can be
    a future's `.map()`."""
    response.input_tokens = prompt_tokens
    if decode is not None:
        for seq in response.sequences:
            seq.text = decode(seq.tokens)
    return response


# -- checkpoints and info ---------------------------------------------------------------

@dataclass
class SaveWeightsResponse:
    """`save_state`: `path` is the checkpoint directory (adapter weights + optimizer state);
    pytrio's `model` (the base model) and `size` (bytes written)."""

    path: str
    model: str = ""
    size: int = 0

    # tinker's link to the checkpoint's page on its web console: hosted only (trio_widgets/hosted.py)
    get_console_url = hosted_only("get_console_url")


@dataclass
class SaveWeightsForSamplerResponse:
    """`save_weights_for_sampler`: `path` is a PEFT adapter directory (None if not written);
    pytrio's `model` (the base model) and `size` (bytes written, 0 if nothing was)."""

    path: str | None
    model: str = ""
    size: int = 0

    # tinker's links to the checkpoint's console page and playground: hosted only
    get_console_url = hosted_only("get_console_url")
    get_playground_url = hosted_only("get_playground_url")


@dataclass
class SaveWeightsExternalResponse:
    """`save_weights_external`: `path` names the export, a PEFT adapter directory under
    `external_weights/` (a tinker:// path over HTTP), for `RestClient.get_external_weights_urls`."""

    path: str


@dataclass
class ExternalWeightsUrlsResponse:
    """tinker: one download URL per file of the checkpoint (name relative to its root), valid
    until `expires`. A served pool's are signed (no API key in them); in-process, file:// URLs."""

    urls: dict[str, str]
    expires: datetime


@dataclass
class CheckpointArchiveUrlResponse:
    """pytrio: the URL of the checkpoint's PEFT directory as one tar archive, valid until `expires`."""

    url: str
    expires: datetime


@dataclass
class CheckpointDownloadSource:
    """pytrio: where a checkpoint downloads from. Here always the pool itself, ready."""

    checkpoint_id: str
    url: str
    expires: datetime
    source: Literal["object_storage", "actor"] = "actor"
    checkpoint_status: Literal["LOCAL", "SYNCING", "READY"] = "READY"
    tls_cert_pem: str | None = None
    tls_not_after: datetime | None = None


@dataclass
class CheckpointDownloadResult:
    """pytrio: a finished download. `path` is the PEFT directory written (adapter_config.json +
    adapter_model.safetensors), `file_size_bytes` its files' bytes; nothing is resumed."""

    checkpoint_id: str
    path: str
    bytes_written: int
    file_size_bytes: int
    status_code: int = 200
    resumed: bool = False


@dataclass
class LoadWeightsResponse:
    """`path`: the checkpoint directory read; `model_id`: the training run it was loaded into."""

    path: str
    model_id: str | None = None


@dataclass
class ModelOperationCapabilities:
    """pytrio: whether an operation is available on a model, and its limits (None: no limit)."""

    available: bool
    max_batch_size: int | None = None
    max_tokens_per_request: int | None = None
    max_seq_len: int | None = None


@dataclass
class SupportedModel:
    """A model of `get_server_capabilities()`: tinker's fields (`trainable`, `sampleable`)
    and pytrio's (`training`, `sampling`) next to the shared ones."""

    model_name: str
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None
    training: ModelOperationCapabilities | None = None
    sampling: ModelOperationCapabilities | None = None


@dataclass
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]


@dataclass
class ModelData:
    """tinker's `arch` / `model_name` / `tokenizer_id`, and how the LoRA run was created."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None
    base_model: str | None = None
    lora_rank: int | None = None
    train_attn: bool | None = None
    train_mlp: bool | None = None
    train_unembed: bool | None = None
    seed: int | None = None


@dataclass
class GetInfoResponse:
    """tinker's `TrainingClient.get_info()`: `model_id`, `model_data.model_name`, `lora_rank`..."""

    model_data: ModelData
    model_id: ModelID
    optimizer_config: AdamOptimizerConfig = field(default_factory=AdamOptimizerConfig)
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


@dataclass(frozen=True)
class LoraRunSpec:
    """pytrio's `TrainingClient.lora`: how the run's adapter was made."""

    model_id: str
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


# -- checkpoints, runs and sessions (RestClient) ------------------------------------------

CheckpointType = Literal["training", "sampler", "external"]  # external: save_weights_external's exports
"""What a checkpoint holds: training state, sampler weights, or an export."""
_PATH_SEGMENTS: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler",
                                             "external_weights": "external"}


@dataclass
class Checkpoint:
    """A saved checkpoint. `checkpoint_id` is tinker's `"weights/<name>"` or
    `"sampler_weights/<name>"`; `tinker_path` and `path` (pytrio's name for it) are both
    `tinker://<run>/<weights|sampler_weights>/<name>`, what its save returned, which every loader
    takes on every transport (`LocalPool.checkpoint_path` gives the directory in-process). Nothing
    is public: `public` is always False."""

    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


@dataclass
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass
class TrainingRun:
    """A training run the pool knows: live in this process, or found on disk by its
    checkpoints. `last_request_time` is the last submit seen in this process, else the
    newest checkpoint's time. `model_owner` is the local user."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


@dataclass
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass
class WeightsInfoResponse:
    """tinker: what a checkpoint holds (`RestClient.get_weights_info_by_tinker_path`)."""

    base_model: str
    is_lora: bool
    optimizer_config: AdamOptimizerConfig = field(default_factory=AdamOptimizerConfig)
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


@dataclass
class GetSamplerResponse:
    sampler_id: str
    base_model: str
    model_path: str | None = None


@dataclass
class GetSessionResponse:
    """A session is one ServiceClient: the runs and samplers it created in this process."""

    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


@dataclass
class ListSessionsResponse:
    sessions: list[str]


@dataclass
class ParsedCheckpointTinkerPath:
    """tinker: the parts of a checkpoint path. `from_tinker_path` reads tinker's
    `tinker://<run>/<weights|sampler_weights>/<name>` and, since local checkpoint paths are
    directories laid out the same way, `<checkpoint_dir>/<run>/<weights|sampler_weights>/<name>`."""

    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str

    @classmethod
    def from_tinker_path(cls, tinker_path: Any) -> ParsedCheckpointTinkerPath:
        text = tinker_path.path if isinstance(tinker_path, (SaveWeightsResponse, SaveWeightsForSamplerResponse)) \
            else tinker_path
        if not isinstance(text, str) or not text:
            raise ValueError(f"Invalid tinker path: {text!r}")
        if text.startswith(TINKER_SCHEME):
            try:
                parsed = parse_tinker_path(text)
            except InvalidInputError as exc:  # tinker raises a plain ValueError here (ours is one too)
                raise ValueError(f"Invalid tinker path: {text}") from exc
            return cls(tinker_path=text, training_run_id=parsed.run_id, checkpoint_type=parsed.checkpoint_type,
                       checkpoint_id=parsed.checkpoint_id)
        if "://" in text:
            raise ValueError(f"Invalid tinker path: {text}")
        else:
            parts = [p for p in PurePath(text).parts if p not in ("/", "\\")][-3:]
        if len(parts) != 3 or parts[1] not in _PATH_SEGMENTS or not parts[0] or not parts[2]:
            raise ValueError(f"Invalid tinker path: {text} (expected tinker://<run>/<weights|sampler_weights>/<name>, "
                             f"or a checkpoint directory <checkpoint_dir>/<run>/<weights|sampler_weights>/<name>)")
        return cls(tinker_path=text, training_run_id=parts[0], checkpoint_type=_PATH_SEGMENTS[parts[1]],
                   checkpoint_id=f"{parts[1]}/{parts[2]}")


# -- custom losses (tinker's create_custom_loss) ------------------------------------------

@dataclass(frozen=True)
class CustomLossInput:
    """One input of a custom loss: `logprobs` or a `loss_fn_inputs` key, with its rank
    (0: a scalar, 1: `[T]`, 2: `[T, K]`)."""

    name: str
    rank: int


def _loss_handle_key(fn: Callable, inputs: tuple[CustomLossInput, ...]) -> str:
    import hashlib

    code = getattr(fn, "__code__", None)
    digest = hashlib.sha256(code.co_code if code is not None else repr(fn).encode())
    digest.update(repr(inputs).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class LossHandle:
    """tinker: a per-datum loss made by `ServiceClient.create_custom_loss`, for
    `forward_backward_custom`. Here `graph` is your function itself: the local pool runs it
    on the client, untraced (tinker traces it with torch.fx and may run it on its server)."""

    name: str
    inputs: tuple[CustomLossInput, ...]
    session_id: str
    graph: Callable[..., Any] = field(repr=False, compare=False)
    loss_id: str | None = None

    @property
    def key(self) -> str:
        """The name the loss is registered under."""
        return _loss_handle_key(self.graph, self.inputs)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The names of the inputs the loss function takes."""
        return tuple(i.name for i in self.inputs[1:])


# tinker's type of the functions create_custom_loss takes: (logprobs, *inputs) -> (loss, metrics)
PerDatumLossFn = Callable[..., tuple["torch.Tensor", Mapping[str, Any]]]
"""A custom loss: `(data, logprobs) -> (loss, metrics)`, for `forward_backward_custom`."""


LoRAPair = tuple["torch.Tensor", "torch.Tensor"]


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
        """Each LoRA weight's name and shape."""
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
