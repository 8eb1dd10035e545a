"""Tinker's wire format, both directions: the protobuf messages and the JSON shapes.

The protobuf messages are ours, declared here field by field with the field numbers and types
the tinker SDK (0.38) puts on the wire, and turned into Python classes at import time from a
descriptor (no protoc step, no generated file). Only what this package reads or writes is
declared; anything else a peer sends is an unknown field, which protobuf skips.

Everything here is pure data conversion between the wire and trio's own types, used by the
server (trio_widgets/http/server.py) and by `HttpBackend` (trio_widgets/http/client.py).
Every decode of untrusted bytes checks lengths, dtypes and shapes and raises
`InvalidInputError` naming the field; nothing is unpickled or evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from ..errors import InvalidInputError
from ..types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
    TensorDtype,
)

__all__ = [
    "PROTO", "adam_from_json", "adam_to_json", "decode_forward_request", "decode_forward_output",
    "forward_request_model_id",
    "decode_sample_response", "encode_forward_output", "encode_forward_request", "encode_sample_response",
    "model_input_from_json", "model_input_to_json", "sampling_params_from_json", "sampling_params_to_json",
    "tensor_from_json", "tensor_to_json", "tinker_metric_keys",
]

PROTOBUF = "application/x-protobuf"

# -- the schema ------------------------------------------------------------------------------

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
            "uint32": _F.TYPE_UINT32, "bool": _F.TYPE_BOOL, "double": _F.TYPE_DOUBLE}
_PACKAGE = "trio_wire"  # not tinker's package name: both may live in one process (tests import the SDK)
_ENUMS = {
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
}
# message -> fields (name, number, type, "repeated" | "map:<value type>" | "oneof:<name>" | "")
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "ForwardBackwardRequest": [("model_id", 1, "string", ""), ("seq_id", 2, "int32", ""),
                               ("data", 3, "Datum", "repeated"), ("loss_fn", 4, "string", ""),
                               ("loss_fn_config", 5, "string", "map:double"), ("forward_only", 6, "bool", ""),
                               ("loss_fn_config_v2", 7, "string", "map:LossConfigValue")],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "Datum": [("model_input", 1, "Chunk", "repeated"), ("loss_fn_inputs", 2, "string", "map:Tensor")],
    "Chunk": [("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"), ("image", 2, "ImageChunk", "oneof:chunk"),
              ("dmel", 3, "DmelChunk", "oneof:chunk")],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],  # int32 little-endian
    "ImageChunk": [("data", 1, "bytes", ""), ("format", 2, "string", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
    "Tensor": [("dense", 1, "bytes", "oneof:encoding"), ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
               ("dtype", 3, "DType", ""), ("shape", 4, "int64", "repeated")],
    "SparseCsr": [("values", 1, "bytes", ""), ("crow_indices", 2, "bytes", ""), ("col_indices", 3, "bytes", "")],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, "string", ""),
                              ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
                              ("metrics", 3, "string", "map:double")],
    "ArrayRecord": [("type_tag", 1, "string", ""), ("fields", 2, "string", "map:BatchedTensor"),
                    ("num_datums", 3, "int64", "")],
    # data: every datum's values, concatenated; offsets: int64 *byte* offsets, one per datum + 1
    "BatchedTensor": [("data", 1, "bytes", ""), ("offsets", 2, "bytes", ""), ("dtype", 3, "DType", ""),
                      ("trailing_shape", 4, "int64", "repeated")],
    "SampleResponse": [("sequences", 1, "SampledSequence", "repeated"), ("prompt_logprobs", 2, "bytes", ""),
                       ("topk_prompt_logprobs", 3, "TopkLogprobs", ""), ("prompt_cache_hit_tokens", 4, "int32", ""),
                       ("target_prompt_logprobs", 5, "Tensor", ""), ("prompt_alt_tokens", 6, "PromptAltTokens", "")],
    "SampledSequence": [("stop_reason", 1, "StopReason", ""), ("tokens", 2, "bytes", ""),
                        ("logprobs", 3, "bytes", ""), ("topk_sampled_logprobs", 4, "TopkLogprobs", "")],
    # [length, k] matrices, row-major: int32 token ids and float32 logprobs; a position without
    # top-k is a row of (0, -99999.0) (tinker's MASK_LOGPROB), as is the tail of a shorter row
    "TopkLogprobs": [("token_ids", 1, "bytes", ""), ("logprobs", 2, "bytes", ""), ("k", 3, "uint32", ""),
                     ("length", 4, "uint32", "")],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
}
_MASK_LOGPROB = -99999.0


def _type_of(field: descriptor_pb2.FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    elif type_name in _ENUMS:
        field.type = _F.TYPE_ENUM
        field.type_name = f".{_PACKAGE}.{type_name}"
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{type_name}"


def _schema() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="trio_widgets/http/tinker_wire.proto", package=_PACKAGE,
                                              syntax="proto3")
    for name, values in _ENUMS.items():
        enum = file.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        oneofs: list[str] = []
        for fname, number, type_name, how in fields:
            field = message.field.add(name=fname, number=number)
            if how.startswith("map:"):
                # a map is a repeated nested entry message (key = 1, value = 2) marked map_entry
                entry = message.nested_type.add(name="".join(p.title() for p in fname.split("_")) + "Entry")
                entry.options.map_entry = True
                key = entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL)
                _type_of(key, type_name)
                value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
                _type_of(value, how[4:])
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{name}.{entry.name}"
                continue
            field.label = _F.LABEL_REPEATED if how == "repeated" else _F.LABEL_OPTIONAL
            _type_of(field, type_name)
            if how.startswith("oneof:"):
                group = how[6:]
                if group not in oneofs:
                    oneofs.append(group)
                    message.oneof_decl.add(name=group)
                field.oneof_index = oneofs.index(group)
    return file


class _Proto:
    """The message classes, by name: PROTO.ForwardBackwardRequest() etc."""

    def __init__(self) -> None:
        pool = descriptor_pool.DescriptorPool()
        pool.Add(_schema())
        # GetMessageClass is protobuf >= 4.22's name; older releases build classes with a factory
        make = getattr(message_factory, "GetMessageClass", None) or message_factory.MessageFactory(pool).GetPrototype
        for name in _MESSAGES:
            setattr(self, name, make(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}")))
        self.DTYPE_FLOAT32, self.DTYPE_INT64, self.DTYPE_INT32 = 1, 2, 3

    def __getattr__(self, name: str) -> Any:  # for type checkers: the classes are set above
        raise AttributeError(name)


PROTO = _Proto()

_NP: dict[int, np.dtype] = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
_DTYPE_NAME: dict[int, TensorDtype] = {1: "float32", 2: "int64", 3: "int64"}  # int32 widens, as the SDK does
_PROTO_DTYPE: dict[str, int] = {"float32": 1, "int64": 2}
_STOP_CODE = {"stop": 0, "length": 1}


def _parse(cls: type[Message], body: bytes, what: str) -> Any:
    message = cls()
    try:
        message.ParseFromString(body)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidInputError(f"is not a valid protobuf {what}: {exc}", field="body") from None
    return message


# -- tensors ---------------------------------------------------------------------------------

def _array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidInputError(f"has {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte values",
                                field=where)
    return np.frombuffer(raw, dtype=dtype)


def _tensor_from_proto(msg: Any, where: str, max_values: int) -> TensorData:
    """A wire Tensor (dense or CSR) as TensorData; CSR is expanded, bounded by `max_values`."""
    dtype = _NP.get(msg.dtype)
    if dtype is None or msg.dtype == 3:
        raise InvalidInputError(f"has dtype {msg.dtype}; tensors are float32 (1) or int64 (2)", field=where)
    shape = [int(d) for d in msg.shape]
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"has a negative dimension in shape {shape}", field=where)
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise InvalidInputError(f"a sparse CSR tensor must be 2-D, got shape {shape}", field=where)
        rows, cols = shape
        if rows * cols > max_values:
            raise InvalidInputError(f"a {rows}x{cols} tensor is more than the {max_values} values one request may "
                                    f"hold", field=where)
        values = _array(msg.sparse_csr.values, dtype, f"{where}.sparse_csr.values")
        crow = _array(msg.sparse_csr.crow_indices, np.dtype("<i8"), f"{where}.sparse_csr.crow_indices")
        col = _array(msg.sparse_csr.col_indices, np.dtype("<i8"), f"{where}.sparse_csr.col_indices")
        if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(values)
                or len(col) != len(values) or (len(col) and (col.min() < 0 or col.max() >= cols))):
            raise InvalidInputError("is not a well-formed CSR matrix (row pointers, column indices and values "
                                    "disagree)", field=where)
        dense = np.zeros((rows, cols), dtype=dtype)
        dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
        return TensorData(dense, _DTYPE_NAME[msg.dtype])
    values = _array(msg.dense, dtype, f"{where}.dense")
    if len(values) > max_values:
        raise InvalidInputError(f"has {len(values)} values, more than the {max_values} one request may hold",
                                field=where)
    if shape and math.prod(shape) != len(values):
        raise InvalidInputError(f"shape {shape} does not fit {len(values)} values", field=where)
    return TensorData(values.reshape(shape) if shape else values, _DTYPE_NAME[msg.dtype])


def _tensor_to_proto(td: TensorData, msg: Any) -> None:
    array = td.to_numpy()
    msg.dtype = _PROTO_DTYPE[td.dtype]
    msg.shape.extend(int(d) for d in array.shape)
    msg.dense = np.ascontiguousarray(array, dtype=_NP[msg.dtype]).tobytes()


# -- forward / forward_backward requests -------------------------------------------------------

def forward_request_model_id(body: bytes) -> str:
    """The model_id of a ForwardBackwardRequest (a fleet's ingress routes by it); "" if it has none."""
    return str(_parse(PROTO.ForwardBackwardRequest, body, "ForwardBackwardRequest").model_id)


def decode_forward_request(body: bytes, max_values: int) -> tuple[str, int, list[Datum], str, dict[str, Any], bool]:
    """(model_id, seq_id, data, loss_fn, loss_fn_config, forward_only) of a ForwardBackwardRequest.
    `max_values` bounds every tensor and token list (the pool's max_request_tokens)."""
    msg = _parse(PROTO.ForwardBackwardRequest, body, "ForwardBackwardRequest")
    data = []
    for i, datum in enumerate(msg.data):
        chunks: list[EncodedTextChunk] = []
        for j, chunk in enumerate(datum.model_input):
            where = f"data[{i}].model_input.chunks[{j}]"
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise InvalidInputError(f"is {'an image' if kind == 'image' else kind or 'empty'} chunk; this "
                                        f"server's models read token ids (encoded_text) only", field=where,
                                        datum_index=i)
            tokens = _array(chunk.encoded_text.tokens, np.dtype("<i4"), where)
            if len(tokens) > max_values:
                raise InvalidInputError(f"has {len(tokens)} tokens, more than one request may hold ({max_values})",
                                        field=where, datum_index=i)
            chunks.append(EncodedTextChunk(tokens=tokens.tolist()))
        inputs = {key: _tensor_from_proto(value, f"data[{i}].loss_fn_inputs[{key!r}]", max_values)
                  for key, value in datum.loss_fn_inputs.items()}
        try:
            data.append(Datum(ModelInput(chunks=list(chunks)), inputs))
        except InvalidInputError as exc:
            raise InvalidInputError(str(exc), field=f"data[{i}]", datum_index=i) from None
    config: dict[str, Any] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # v2 is preferred; text values live only there
        kind = value.WhichOneof("value")
        config[key] = value.number if kind == "number" else value.text
    return msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only)


def encode_forward_request(model_id: str, seq_id: int, data: Sequence[Datum], loss_fn: str,
                           loss_fn_config: dict[str, Any] | None, forward_only: bool) -> bytes:
    msg = PROTO.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only)
    for key, value in (loss_fn_config or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
    for datum in data:
        out = msg.data.add()
        out.model_input.add().encoded_text.tokens = np.asarray(datum.model_input.to_ints(), dtype="<i4").tobytes()
        for key, value in datum.loss_fn_inputs.items():
            _tensor_to_proto(TensorData.from_any(value), out.loss_fn_inputs[key])
    return msg.SerializeToString()


# -- forward / forward_backward results ----------------------------------------------------------

_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")


def tinker_metric_keys(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics the tinker SDK accepts: `name:reduction` keys with one colon and a reduction it
    knows (it fails on any other key); others are left out."""
    return {k: float(v) for k, v in metrics.items()
            if k.count(":") == 1 and k.split(":")[1] in _REDUCTIONS and k.split(":")[0]}


def encode_forward_output(out: ForwardBackwardOutput) -> bytes:
    msg = PROTO.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in tinker_metric_keys(out.metrics).items():
        msg.metrics[key] = value
    if out.loss_fn_outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(out.loss_fn_outputs))
        names = list(out.loss_fn_outputs[0])
        for name in names:
            arrays = [TensorData.from_any(d[name]).to_numpy() for d in out.loss_fn_outputs]
            kind = "float32" if arrays[0].dtype.kind == "f" else "int64"
            np_dtype = _NP[_PROTO_DTYPE[kind]]
            blobs = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
            field = record.fields[name]
            field.dtype = _PROTO_DTYPE[kind]
            field.data = b"".join(blobs)
            field.offsets = np.cumsum([0, *map(len, blobs)], dtype="<i8").tobytes()
            field.trailing_shape.extend(int(d) for d in arrays[0].shape[1:])
    return msg.SerializeToString()


def decode_forward_output(body: bytes) -> ForwardBackwardOutput:
    msg = _parse(PROTO.ForwardBackwardOutput, body, "ForwardBackwardOutput")
    outputs: list[dict[str, TensorData]] = []
    for record in msg.loss_fn_outputs:
        per_datum: list[dict[str, TensorData]] = [{} for _ in range(int(record.num_datums))]
        for name, field in record.fields.items():
            dtype = _NP.get(field.dtype)
            if dtype is None:
                raise InvalidInputError(f"output {name!r} has dtype {field.dtype}", field="body")
            data = np.frombuffer(field.data, dtype=dtype)
            offsets = np.frombuffer(field.offsets, dtype="<i8") // dtype.itemsize
            trailing = [int(d) for d in field.trailing_shape]
            for i in range(min(len(per_datum), len(offsets) - 1)):
                values = data[offsets[i]:offsets[i + 1]]
                per_datum[i][name] = TensorData(values.reshape([-1, *trailing]) if trailing else values,
                                                _DTYPE_NAME[field.dtype])
        outputs.extend(per_datum)
    return ForwardBackwardOutput(loss_fn_output_type=msg.loss_fn_output_type, loss_fn_outputs=outputs,
                                 metrics={k: float(v) for k, v in msg.metrics.items()})


# -- samples -------------------------------------------------------------------------------------

def _topk_to_proto(rows: Sequence[Sequence[tuple[int, float]] | None], msg: Any) -> None:
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), "<i4")
    lps = np.full((len(rows), k), _MASK_LOGPROB, "<f4")
    for i, row in enumerate(rows):
        if row:
            ids[i, :len(row)] = [t for t, _ in row]
            lps[i, :len(row)] = [v for _, v in row]
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def _topk_from_proto(msg: Any) -> list[list[tuple[int, float]] | None]:
    n, k = int(msg.length), int(msg.k)
    if n * k * 4 != len(msg.token_ids) or n * k * 4 != len(msg.logprobs):
        raise InvalidInputError(f"a top-k matrix of {n}x{k} does not fit its bytes", field="body")
    if k == 0:
        return [None] * n
    ids = np.frombuffer(msg.token_ids, "<i4").reshape(n, k).tolist()
    lps = np.frombuffer(msg.logprobs, "<f4").reshape(n, k).tolist()
    rows: list[list[tuple[int, float]] | None] = []
    for tid, lp in zip(ids, lps):
        row = [(t, v) for t, v in zip(tid, lp) if not (t == 0 and v == _MASK_LOGPROB)]
        rows.append(row or None)
    return rows


def encode_sample_response(response: SampleResponse) -> bytes:
    msg = PROTO.SampleResponse(prompt_cache_hit_tokens=int(response.prompt_cache_hit_tokens))
    for seq in response.sequences:
        out = msg.sequences.add(stop_reason=_STOP_CODE[seq.stop_reason], tokens=np.asarray(seq.tokens, "<i4").tobytes(),
                                logprobs=np.asarray(seq.logprobs, "<f4").tobytes())
        if seq.topk_logprobs is not None:
            _topk_to_proto(seq.topk_logprobs, out.topk_sampled_logprobs)
    if response.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if v is None else v for v in response.prompt_logprobs],
                                         "<f4").tobytes()
    if response.topk_prompt_logprobs is not None:
        _topk_to_proto(response.topk_prompt_logprobs, msg.topk_prompt_logprobs)
    if response.target_prompt_logprobs is not None:
        _tensor_to_proto(response.target_prompt_logprobs, msg.target_prompt_logprobs)
    if response.prompt_alt_tokens is not None:
        _tensor_to_proto(response.prompt_alt_tokens.tokens, msg.prompt_alt_tokens.tokens)
        _tensor_to_proto(response.prompt_alt_tokens.logprobs, msg.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def decode_sample_response(body: bytes, sequence_ids: Sequence[str]) -> SampleResponse:
    msg = _parse(PROTO.SampleResponse, body, "SampleResponse")
    sequences = []
    for i, seq in enumerate(msg.sequences):
        sequence = SampledSequence(tokens=np.frombuffer(seq.tokens, "<i4").tolist(),
                                   logprobs=np.frombuffer(seq.logprobs, "<f4").tolist(),
                                   stop_reason="length" if seq.stop_reason == 1 else "stop",
                                   topk_logprobs=_topk_from_proto(seq.topk_sampled_logprobs)
                                   if seq.HasField("topk_sampled_logprobs") else None)
        if i < len(sequence_ids):
            sequence.sequence_id = sequence_ids[i]
        sequences.append(sequence)
    prompt = None
    if msg.prompt_logprobs:
        prompt = [None if math.isnan(v) else float(v) for v in np.frombuffer(msg.prompt_logprobs, "<f4")]
    unbounded = 1 << 62  # a response the server encoded: its size is the server's bound
    alt = None
    if msg.HasField("prompt_alt_tokens"):
        alt = PromptAltTokens(tokens=_tensor_from_proto(msg.prompt_alt_tokens.tokens, "prompt_alt_tokens", unbounded),
                              logprobs=_tensor_from_proto(msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens",
                                                          unbounded))
    return SampleResponse(sequences=sequences, prompt_logprobs=prompt,
                          topk_prompt_logprobs=_topk_from_proto(msg.topk_prompt_logprobs)
                          if msg.HasField("topk_prompt_logprobs") else None,
                          target_prompt_logprobs=_tensor_from_proto(msg.target_prompt_logprobs,
                                                                    "target_prompt_logprobs", unbounded)
                          if msg.HasField("target_prompt_logprobs") else None,
                          prompt_alt_tokens=alt, prompt_cache_hit_tokens=int(msg.prompt_cache_hit_tokens))


def tensor_to_json(td: TensorData) -> dict[str, Any]:
    """A tensor as the SDK sends it in JSON: flat data, dtype, shape."""
    array = td.to_numpy()
    return {"data": array.reshape(-1).tolist(), "dtype": td.dtype, "shape": list(array.shape)}


def tensor_from_json(value: Any, field: str, max_values: int, pad: int | float = 0) -> TensorData:
    """The SDK's JSON tensor (dense, or CSR whose unlisted cells are `pad`), bounded by `max_values`."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), list):
        raise InvalidInputError('must be a tensor {"data": [...], "dtype": ..., "shape": [...]}', field=field)
    dtype = value.get("dtype")
    if dtype not in ("int64", "float32"):
        raise InvalidInputError(f"dtype must be int64 or float32, got {dtype!r:.20}", field=field)
    shape = value.get("shape")
    if shape is not None and (not isinstance(shape, list) or
                              not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise InvalidInputError("shape must be a list of sizes", field=field)
    data = value["data"]
    if len(data) > max_values or (shape and math.prod(shape) > max_values):
        raise InvalidInputError(f"has more than the {max_values} values one request may hold", field=field)
    kind = int if dtype == "int64" else (int, float)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in data):
        raise InvalidInputError(f"data must be numbers of dtype {dtype}", field=field)
    np_dtype = np.int64 if dtype == "int64" else np.float32
    crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    if crow is not None or col is not None:
        if not (isinstance(crow, list) and isinstance(col, list) and shape and len(shape) == 2):
            raise InvalidInputError("a sparse CSR tensor needs sparse_crow_indices, sparse_col_indices and a 2-D "
                                    "shape", field=field)
        rows, cols = shape
        c, k = np.asarray(crow, np.int64), np.asarray(col, np.int64)
        if (len(c) != rows + 1 or (len(c) and c[0] != 0) or np.any(np.diff(c) < 0) or (len(c) and c[-1] != len(data))
                or len(k) != len(data) or (len(k) and (k.min() < 0 or k.max() >= cols))):
            raise InvalidInputError("is not a well-formed CSR matrix (row pointers, column indices and values "
                                    "disagree)", field=field)
        dense = np.full((rows, cols), pad, dtype=np_dtype)
        dense[np.repeat(np.arange(rows), np.diff(c)), k] = np.asarray(data, np_dtype)
        return TensorData(dense, dtype)
    array = np.asarray(data, np_dtype)
    if shape is not None:
        if math.prod(shape) != len(array):
            raise InvalidInputError(f"shape {shape} does not fit {len(array)} values", field=field)
        array = array.reshape(shape)
    return TensorData(array, dtype)


# -- JSON shapes -----------------------------------------------------------------------------------

def model_input_to_json(model_input: ModelInput) -> dict[str, Any]:
    return {"chunks": [{"tokens": model_input.to_ints(), "type": "encoded_text"}]}


def model_input_from_json(value: Any, field: str = "prompt") -> ModelInput:
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise InvalidInputError('must be {"chunks": [...]}', field=field)
    chunks = []
    for j, chunk in enumerate(value["chunks"]):
        where = f"{field}.chunks[{j}]"
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise InvalidInputError(f"is a {kind!r} chunk; this server's models read token ids (encoded_text) only",
                                    field=where)
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidInputError("tokens must be a list of integer token ids", field=where)
        chunks.append(EncodedTextChunk(tokens=list(tokens)))
    return ModelInput(chunks=list(chunks))


_ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def adam_to_json(params: AdamParams) -> dict[str, float]:
    return {name: float(getattr(params, name)) for name in _ADAM_FIELDS}


def adam_from_json(value: Any) -> AdamParams:
    if not isinstance(value, dict):
        raise InvalidInputError("must be an object of AdamW settings", field="adam_params")
    unknown = sorted(set(value) - set(_ADAM_FIELDS) - {"type"})
    if unknown:
        raise InvalidInputError(f"unknown settings {unknown}; AdamW takes {', '.join(_ADAM_FIELDS)}",
                                field="adam_params")
    kwargs = {}
    for name in _ADAM_FIELDS:
        if name in value:
            number = value[name]
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise InvalidInputError(f"must be a number, got {number!r:.40}", field=f"adam_params.{name}")
            kwargs[name] = float(number)
    return AdamParams(**kwargs)


def sampling_params_to_json(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                           "top_k": params.top_k, "top_p": params.top_p}
    if params.seed is not None:
        out["seed"] = params.seed
    if params.stop is not None:
        out["stop"] = params.stop if isinstance(params.stop, str) else list(params.stop)
    return out


def sampling_params_from_json(value: Any) -> SamplingParams:
    if not isinstance(value, dict):
        raise InvalidInputError("must be an object", field="sampling_params")
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidInputError(f"unknown settings {unknown}", field="sampling_params")
    kwargs = {k: v for k, v in value.items() if v is not None}
    if "stop" in kwargs and isinstance(kwargs["stop"], list) and not kwargs["stop"]:
        # tinker: [] means "no stop at all, not even EOS"; the local sampler always stops at EOS
        raise InvalidInputError("an empty stop list (never stop, not even at EOS) is not supported here; "
                                "leave stop unset", field="sampling_params.stop")
    return SamplingParams(**kwargs)
