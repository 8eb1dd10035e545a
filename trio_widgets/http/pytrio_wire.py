"""PyTRIO's wire protocol on a served pool, beside Tinker's (docs/pytrio.md: "PyTRIO's own SDK against a served pool").

pytrio 0.2.9 talks to a control plane (`/api/openapi/v1/...`, `/api/models`, `/api/sdk/bootstrap`:
JSON) and to the "actor" the control plane names for each run: here the served pool itself, at
`/api/pytrio/<session id>/` (`v1/events`: MessagePack event envelopes and their long-polled states,
`v1/sampling-runs/<id>/sample`, `v1/client/heartbeat`). This module decodes each request into the
plain requests of trio_widgets/backend.py and acts through the same `Service` as Tinker's routes:
its sessions, runs and samplers (a PyTRIO service session is a served session; a training run a
served model, numbered by the session; a sampling run a served sampler), its request entries and
long-polls, its per-key budgets and lanes, and the key's backend (the seam). It keeps no table of
its own: an event id is an alias the session keeps for a request id. Errors are the protocol's one
table (`WireError.pytrio_body`). The actor's token is the caller's own API key (sent back to the
one who presented it; the actor reads it as `Authorization: Bearer`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..backend import (
    Capabilities,
    CreateModelRequest,
    DeleteCheckpoint,
    FromStateRequest,
    GetTokenizer,
    GetTrainingRun,
    ListCheckpoints,
    ListTrainingRuns,
    OptimStepRequest,
    SampleRequest,
    SaveRequest,
    ServedEntry,
    ServedModelView,
    ServedSessionView,
    WeightsInfo,
)
from ..backend import ForwardRequest as _Forward
from ..errors import ClientClosedError, InvalidInputError, NotSupportedError, PoolClosedError
from ..protocol import WireError, names, wire_error
from ..types import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from ..validation import check_loss
from .auth import HttpError, api_key_of, is_loopback, not_found, wire_of
from .routes import json_body, page, read_body

if TYPE_CHECKING:
    from .service import Service

__all__ = ["ACTOR", "CONTROL", "pytrio_routes"]

log = logging.getLogger("trio_widgets.http.server")

CONTROL = "/api/openapi/v1"
ACTOR = "/api/pytrio"  # + /<session id>/v1/...
MSGPACK = "application/msgpack"
_ALIASES = 8192  # event ids remembered per session
PYTRIO_PAGE = 20  # a listing's default page size in PyTRIO's SDK
# an entry's kind (the pool's op) -> the event type that made it
_EVENT_OF = {"create_model": "trainer.init_run", "forward": "trainer.forward",
             "forward_backward": "trainer.forward_backward",
             "optim_step": "trainer.optimize_step", "save_state": "trainer.save_state",
             "save_weights_for_sampler": "trainer.save_weights"}
_FAR = datetime.datetime(2099, 1, 1, tzinfo=datetime.timezone.utc).isoformat()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else _now()


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:  # pragma: no cover - installed with the serve extra (and pytrio)
        raise NotSupportedError("PyTRIO's actor protocol needs the msgpack package on the server") from None
    return msgpack


def _refusal(error: WireError) -> JSONResponse:
    return JSONResponse(error.pytrio_body(), status_code=error.status)


def _field(value: Any, kind: type | tuple[type, ...], name: str, default: Any = ...) -> Any:
    if value is None and default is not ...:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidInputError(f"must be {getattr(kind, '__name__', kind)}, got {value!r:.60}", field=name)
    return value


def _text(value: Any, name: str, default: Any = ...) -> Any:
    """A string field that an answer may carry back: text UTF-8 can encode (JSON's `\\ud800` escape
    decodes to a lone surrogate, which no answer can be written with)."""
    value = _field(value, str, name, default)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeError:
            raise InvalidInputError(f"must be text UTF-8 can encode, got {value!r:.60}", field=name) from None
    return value


def _metadata(value: Any, name: str) -> dict[str, str] | None:
    """user_metadata: None, or a map whose keys and values are taken as text (what a label, a listing
    and the dashboard show), text that UTF-8 can encode."""
    if value is None:
        return None
    found = _field(value, dict, name)
    return {_text(str(k), f"{name} key"): _text(str(v), f"{name}.{k}") for k, v in found.items()}


@contextlib.contextmanager
def _decoding(name: str) -> Iterator[None]:
    """Around building a plain request from what the client sent: what the types refuse (a token that
    is text, a float where an integer goes, ragged nesting, an integer past int64) is the client's
    error, naming the field, never the server's."""
    try:
        yield
    except (ValueError, TypeError, OverflowError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(f"{exc}"[:300], field=name) from None


# -- decoding: PyTRIO's shapes into the plain requests ------------------------------------------

def _model_input(value: Any, name: str) -> ModelInput:
    chunks = _field(value, dict, name).get("chunks")
    tokens: list[int] = []
    for i, chunk in enumerate(_field(chunks, list, f"{name}.chunks")):
        chunk = _field(chunk, dict, f"{name}.chunks[{i}]")
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise NotSupportedError(f"{name}.chunks[{i}]: {chunk.get('type')!r:.20} chunks are not supported by a "
                                    f"local trio pool (its models read tokens)")
        tokens.extend(_field(chunk.get("tokens"), list, f"{name}.chunks[{i}].tokens"))
    with _decoding(f"{name}.chunks"):
        return ModelInput.from_ints(tokens)


def _datum(value: Any, i: int, auto_shift: bool) -> Datum:
    d = _field(value, dict, f"data[{i}]")
    tokens = _model_input(d.get("model_input"), f"data[{i}].model_input").to_ints()
    with _decoding(f"data[{i}].target_ids"):
        inputs: dict[str, Any] = {"target_tokens": TensorData(_field(d.get("target_ids"), list,
                                                                     f"data[{i}].target_ids"), "int64")}
    for key in ("weights", "logprobs", "advantages"):
        if d.get(key) is not None:
            with _decoding(f"data[{i}].{key}"):
                inputs[key] = TensorData(_field(d[key], list, f"data[{i}].{key}"), "float32")
    if auto_shift:  # every input aligned with the tokens: position j is predicted from those before it
        if len(tokens) < 2:
            raise InvalidInputError("auto_shift needs at least 2 tokens", field=f"data[{i}].model_input")
        for key, td in inputs.items():
            if len(td.data) != len(tokens):
                raise InvalidInputError(f"with auto_shift every input has the {len(tokens)} tokens' length, got "
                                        f"{len(td.data)}", field=f"data[{i}].{key}")
            inputs[key] = TensorData(td.data[1:], td.dtype)
        tokens = tokens[:-1]
    return Datum(ModelInput.from_ints(tokens), inputs)


def _tensor(values: list[float]) -> dict[str, Any]:
    """A WireTensorData: little-endian float32 bytes (a shape of at least one element)."""
    import numpy as np

    array = np.asarray(values if len(values) else [0.0], dtype="<f4")
    return {"dtype": "<f4", "shape": [len(array)], "encoding": "raw_le", "data": array.tobytes()}


def _forward_result(out: Any) -> dict[str, Any]:
    outputs = [{k: _tensor(list(v.data)) for k, v in o.items()} for o in out.loss_fn_outputs]
    m = out.metrics
    total = float(m.get("loss_sum", m.get("loss:sum", 0.0)))
    count = int(m.get("token_count", 0))
    return {"loss_fn_outputs": outputs,
            "metrics": {"loss_sum": total, "loss_mean": float(m.get("loss_mean", total / count if count else 0.0)),
                        "token_count": count}}


def _sampling_params(value: Any) -> SamplingParams:
    p = dict(_field(value, dict, "sampling_params"))
    stop = p.pop("stop", None) or p.pop("stop_token_ids", None)
    known = {k: p.pop(k) for k in ("max_tokens", "seed", "temperature", "top_k", "top_p") if p.get(k) is not None}
    if p:
        raise NotSupportedError(f"sampling_params {sorted(map(str, p))} are not supported by a local trio pool")
    with _decoding("sampling_params"):
        return SamplingParams(stop=stop, **known)


# -- the codec ----------------------------------------------------------------------------------

class PyTrio:
    """PyTRIO's endpoints over one `Service` (the same sessions, entries and seam as Tinker's)."""

    def __init__(self, service: Service):
        self.s = service

    # ids and shapes
    def workspace(self, owner: str) -> str:
        return f"ws-{owner[:12]}"

    def actor(self, request: Request, session: ServedSessionView, owner: str) -> dict[str, Any]:
        base = str(request.base_url).rstrip("/")
        return {"actor": {"actor_cuid": f"pool-{self.s.pool.name}", "endpoint": f"{base}{ACTOR}/{session.session_id}",
                          "connect_mode": "direct", "tls_enabled": False},
                "actor_jwt": {"token": api_key_of(request.headers) or "local", "expires_at": _FAR}}

    def capacity(self) -> dict[str, Any]:
        limits = self.s.pool.limits
        return {"max_batch_size": limits.max_request_data or None,
                "max_tokens_per_request": limits.max_request_tokens or None, "max_seq_len": None}

    def model_id(self, name: str, request: Request) -> str:
        """The model id a PyTRIO client loads its tokenizer by (AutoTokenizer.from_pretrained): as
        tinker's tokenizer_id, a hub model's name, or for a client on this machine the directory the
        server keeps the tokenizer of a built-in model in. A fleet's pool (an id tag) says the name: a
        pool's directory means nothing to its sibling pools, and pytrio compares model ids across them."""
        return name if self.s.id_tag else self.s.state.tokenizer_id(name, _local(request)) or name

    def base_of(self, value: Any, request: Request) -> str:
        """A served model's name from its name or its `model_id`."""
        found = [m for m in self.s.models if value == m or value == self.model_id(m, request)]
        return self.s.state.base_model(found[0] if found else value)

    def session_of(self, request: Request, owner: str, live: bool = True) -> ServedSessionView:
        return self.s.state.session(request.path_params["session_id"], owner, live=live)

    def session_json(self, session: ServedSessionView) -> dict[str, Any]:
        return {"service_session_cuid": session.session_id, "workspace_cuid": self.workspace(session.owner),
                "status": "ACTIVE" if session.state == "live" else "ENDED", "sdk_version": None,
                "created_at": _now(), "updated_at": _now(),
                "training_run_cuids": [c for c in session.clients if ":train:" in c],
                "sampling_run_cuids": [c for c in session.clients if ":sample:" in c]}

    def run_json(self, owner: str, run: Any) -> dict[str, Any]:
        """A run the key's backend described (read on the catalog's thread), with what the live model
        says of it (read here, on the loop's)."""
        run_id = run.training_run_id
        model = self.s.state.trained.get(run_id)
        h = model.handle if model is not None and model.session.owner == owner else None
        match = names.RUN_ID_RE.match(run_id)
        flags = {"train_mlp": h.train_mlp if h else True, "train_attn": h.train_attn if h else True,
                 "train_unembed": h.train_unembed if h else True}
        return {"training_run_cuid": run_id, "base_model": run.base_model, "workspace_cuid": self.workspace(owner),
                "service_session_cuid": match.group("session") if match else "", "status": "RUNNING" if h else "ENDED",
                "run_index": int(match.group("n")) if match else 0, "model_spec_cuid": run.base_model,
                "is_lora": True, "restore_optimizer": False, "lora_rank": run.lora_rank or 0,
                "seed": h.seed if h else None, **flags, "corrupted": bool(run.corrupted),
                "training_params": {"restore_optimizer": False, "lora_rank": run.lora_rank,
                                    "seed": h.seed if h else None, **flags},
                "created_at": _iso(run.last_request_time), "updated_at": _iso(run.last_request_time),
                "user_metadata": run.user_metadata}

    def checkpoint_json(self, owner: str, c: Any) -> dict[str, Any]:
        run = c.tinker_path[len("tinker://"):].split("/", 1)[0]
        kind, name = c.checkpoint_id.split("/", 1)
        cuid = f"{run}~{kind}~{name}"
        return {"cuid": cuid, "checkpoint_cuid": cuid, "training_run_cuid": run,
                "workspace_cuid": self.workspace(owner),
                "name": name, "checkpoint_type": "TRAINING" if kind == "weights" else "SAMPLER", "status": "READY",
                "checkpoint_uri": c.tinker_path, "model": "", "base_model": "", "model_spec_cuid": "",
                "task_id": run, "task_created_at": _iso(c.time), "task_status": "RUNNING",
                "path": c.tinker_path, "created_at": _iso(c.time), "size_bytes": c.size_bytes, "lora_rank": 0,
                "is_uploaded": True, "expired_at": _iso(c.expires_at) if c.expires_at else None}

    def checkpoint_path(self, cuid: str) -> tuple[str, str, str]:
        parts = cuid.split("~", 2)
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights", "external_weights"):
            raise not_found(f"checkpoint {cuid!r:.80}")
        return parts[0], parts[1], parts[2]

    # -- control plane ------------------------------------------------------------------------
    async def verify(self, owner: str, request: Request) -> dict:
        name = self.s.key_names.get(owner) or "trio"
        return {"api_key_tid": owner[:12], "api_key_name": None, "user_cuid": f"user-{owner[:12]}", "username": name,
                "display_name": name, "workspace_cuid": self.workspace(owner), "workspace_name": self.s.pool.name,
                "workspace_type": "personal", "expires_at": None}

    async def bootstrap(self, owner: str, request: Request) -> dict:
        version = request.query_params.get("sdk_version", "")
        return {"compatibility": {"status": "compatible", "sdk_version": version}, "notices": []}

    async def models(self, owner: str, request: Request) -> dict:
        served = [m for m in self.s.backend.call(Capabilities()).supported_models if m.model_name in self.s.models]
        items = [{"cuid": m.model_name, "alias": m.model_name, "model_id": m.model_name, "train_available": True,
                  "sample_available": True, "trainer": self.capacity(), "sampler": self.capacity(),
                  "context_length": getattr(m, "max_context_length", None), "created_at": _now(),
                  "updated_at": _now()} for m in served]
        return {"items": items, "total": len(items), "limit": len(items), "offset": 0}

    async def create_session(self, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, self.s, owner))
        made = self.s.create_session(owner, {"user_metadata": _metadata(body.get("user_metadata"), "user_metadata")})
        return self.session_json(self.s.state.session(made["session_id"], owner))

    async def get_session(self, owner: str, request: Request) -> dict:
        return self.session_json(self.session_of(request, owner, live=False))

    async def list_sessions(self, owner: str, request: Request) -> dict:
        mine = [s for s in self.s.state.sessions.values() if s.owner == owner]
        limit, offset = page(request, PYTRIO_PAGE)
        return {"service_sessions": [self.session_json(s) for s in mine[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total": len(mine)}}

    async def renew_session(self, owner: str, request: Request) -> dict:
        await read_body(request, self.s, owner)
        return self.session_json(self.session_of(request, owner))

    async def close_session(self, owner: str, request: Request) -> dict:
        await read_body(request, self.s, owner)
        session = self.session_of(request, owner, live=False)
        if session.state == "live":
            self.s.state.end_session(session, "finished", "the PyTRIO client closed its service session")
        return {}

    def _source(self, owner: str, uri: Any) -> Any:
        """The weights info of a checkpoint this key may read (404 otherwise)."""
        return self.s.of(owner).call(WeightsInfo(uri))

    async def create_run(self, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, self.s, owner))
        session = self.session_of(request, owner)
        source = body.get("source_checkpoint_uri") or ""
        base = self.base_of(body.get("base_model") or (self._source(owner, source).base_model if source else None),
                            request)
        # the run's number is its slot in the session; the adapter is made when its init_run event comes
        n = self.s.state.reserve_run(owner, session)  # counts against the key's results until init_run
        return {"training_run_cuid": names.run_id(session.session_id, n), "service_session_cuid": session.session_id,
                "workspace_cuid": self.workspace(owner), "status": "PENDING", "run_index": n,
                "model_spec_cuid": base, "model_alias": base, "model_id": self.model_id(base, request),
                "trainer": self.capacity(),
                **self.actor(request, session, owner), "created_at": _now()}

    async def update_run(self, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, self.s, owner))
        session = self.session_of(request, owner)
        source = body.get("source_checkpoint_uri")
        self._source(owner, _field(source, str, "source_checkpoint_uri"))  # 404 unless it is this key's
        return {"source_checkpoint_uri": source, "restore_optimizer": bool(body.get("restore_optimizer")),
                "trainer": self.capacity(), **self.actor(request, session, owner)}

    async def renew_run(self, owner: str, request: Request) -> dict:
        await read_body(request, self.s, owner)
        run_id = request.path_params["run_id"]
        match = names.RUN_ID_RE.match(run_id)
        session = self.s.state.session(match.group("session") if match else None, owner)
        return {"training_run_cuid": run_id, "service_session_cuid": session.session_id,
                "workspace_cuid": self.workspace(owner), **self.actor(request, session, owner)}

    async def by_checkpoint(self, owner: str, request: Request) -> dict:
        uri = request.query_params.get("checkpoint_uri")
        info = await self.s.catalog(owner, lambda: self._source(owner, uri))
        return {"base_model": self.model_id(info.base_model, request), "lora_rank": info.lora_rank, "seed": None,
                "train_mlp": info.train_mlp is not False, "train_attn": info.train_attn is not False,
                "train_unembed": info.train_unembed is not False}

    async def get_run(self, owner: str, request: Request) -> dict:
        run_id = request.path_params["run_id"]
        return self.run_json(owner, await self.s.catalog(owner, lambda: self.s.of(owner).call(GetTrainingRun(run_id))))

    async def list_runs(self, owner: str, request: Request) -> dict:
        limit, offset = page(request, PYTRIO_PAGE)
        runs = await self.s.catalog(owner, lambda: self.s.of(owner).call(ListTrainingRuns()))
        return {"training_runs": [self.run_json(owner, r) for r in runs[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total": len(runs)}}

    async def checkpoints(self, owner: str, request: Request) -> Response:
        limit, offset = page(request, PYTRIO_PAGE)
        run_id = request.path_params.get("run_id")

        def work() -> JSONResponse:  # listed, paged and encoded (up to 10,000 entries) off the event loop
            found = self.s.of(owner).call(ListCheckpoints(run_id))[::-1]  # newest first
            return JSONResponse({"checkpoints": [self.checkpoint_json(owner, c) for c in found[offset:offset + limit]],
                                 "cursor": {"offset": offset, "limit": limit, "total": len(found)}})

        return await self.s.catalog(owner, work)

    async def delete_checkpoint(self, owner: str, request: Request) -> dict:
        run, kind, name = self.checkpoint_path(request.path_params["cuid"])
        await self.s.catalog(owner, lambda: self.s.of(owner).call(DeleteCheckpoint(run, f"{kind}/{name}")))
        return {}

    async def download_url(self, owner: str, request: Request) -> dict:
        run, kind, name = self.checkpoint_path(request.path_params["cuid"])
        found = await self.s.catalog(owner, lambda: self.s.export_urls(owner, names.checkpoint_path(run, kind, name),  # type: ignore[arg-type]
                                                                         str(request.base_url)))
        return {"url": found["archive_url"], "expires_at": found["expires"], "source": "object_storage",
                "checkpoint_status": "READY", "tls_cert_pem": None, "tls_not_after": None}

    async def create_sampler(self, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, self.s, owner))
        session = self.session_of(request, owner)
        path = body.get("source_checkpoint_uri") or None
        base = self.base_of(body["base_model"], request) if body.get("base_model") else None
        # a number no other sampler of the session has or is being given (two creates may run at once;
        # tinker's SDK numbers its own, PyTRIO's does not)
        n = next(self.s.state.numbers)
        made = await self.s.create_sampling_session(owner, {"session_id": session.session_id, "model_path": path,
                                                            "base_model": None if path else base,
                                                            "sampling_session_seq_id": n})
        sampler = self.s.state.sampler(made["sampling_session_id"], owner)
        h = sampler.handle
        return {"sampling_run_cuid": sampler.sampler_id, "service_session_cuid": session.session_id,
                "workspace_cuid": self.workspace(owner), "status": "RUNNING",
                "run_index": int(sampler.sampler_id.rsplit(":", 1)[1]), "model_spec_cuid": h.base_model,
                "model_alias": base or h.base_model, "model_id": h.base_model, "sampler": self.capacity(),
                **self.actor(request, session, owner), "created_at": _now()}

    async def get_sampler(self, owner: str, request: Request) -> dict:
        sampler = self.s.state.sampler(request.path_params["sampler_id"], owner)
        h = sampler.handle
        return {"sampling_run_cuid": sampler.sampler_id, "service_session_cuid": sampler.session.session_id,
                "workspace_cuid": self.workspace(owner), "status": "RUNNING", "base_model": h.base_model,
                "model_id": h.base_model, "alias": h.base_model, "source_checkpoint_uri": sampler.model_path,
                "created_at": _now(), "updated_at": _now()}

    async def renew_sampler(self, owner: str, request: Request) -> dict:
        await read_body(request, self.s, owner)
        sampler = self.s.state.sampler(request.path_params["sampler_id"], owner)
        return {"sampling_run_cuid": sampler.sampler_id, "service_session_cuid": sampler.session.session_id,
                "workspace_cuid": self.workspace(owner), **self.actor(request, sampler.session, owner)}

    # -- the actor ----------------------------------------------------------------------------
    async def heartbeat(self, owner: str, request: Request) -> dict:
        await read_body(request, self.s, owner)
        self.session_of(request, owner)  # a sign of life (410 once expired)
        return {"heartbeat_ms": int(min(10.0, self.s.state.session_timeout_s / 4) * 1000)}

    async def submit(self, owner: str, request: Request) -> Response:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith(MSGPACK):
            raise HttpError(415, f"events are MessagePack ({MSGPACK}), got {ctype[:60]!r}")
        raw = await read_body(request, self.s, owner)
        try:
            envelope = _msgpack().unpackb(raw, raw=False)
        except Exception as exc:  # msgpack raises several classes for a malformed body
            raise HttpError(400, f"the body is not a MessagePack event: {exc}"[:300]) from None
        envelope = _field(envelope, dict, "body")
        event_id = _field(envelope.get("event_id"), str, "event_id")
        kind = _field(envelope.get("type"), str, "type")
        meta = _field(envelope.get("metadata"), dict, "metadata")
        session = self.session_of(request, owner)
        if event_id in session.aliases:  # a retry: the first one's state
            return self._event(event_id, kind, self.s.state.entries.get(session.aliases[event_id]))  # (same type)
        run_id = _field(meta.get("run_id"), str, "metadata.run_id")
        index = _field(meta.get("index"), int, "metadata.index")
        payload = _field(envelope.get("payload"), dict, "payload")
        model = None if kind == "trainer.init_run" else self.s.state.model(run_id, owner)
        if model is not None and model.session is not session:
            raise not_found(f"run {run_id!r:.80} in this session")
        try:
            entry = self._init_run(owner, session, run_id, payload, request) if model is None else \
                self.s.state.entries.get(self._op(owner, model, index - 1, kind, payload))  # init_run is seq 0
        except (InvalidInputError, NotSupportedError) as exc:  # refused: a failed event, as the actor's
            if model is not None and isinstance(exc, NotSupportedError):
                # its index is used up: the events after it do not wait for it
                self.s.state.refuse_seq(owner, model.model_id, index - 1)
            return self._event(event_id, kind, None, wire_of(exc))
        if entry is not None:
            session.aliases[event_id] = entry.request_id
            while len(session.aliases) > _ALIASES:
                session.aliases.popitem(last=False)
        return self._event(event_id, kind, entry)

    def _init_run(self, owner: str, session: ServedSessionView, run_id: str, p: dict, http: Request) -> ServedEntry:
        match = names.RUN_ID_RE.match(run_id)
        n = int(match.group("n")) if match and match.group("session") == session.session_id else -1
        placeholder = session.model_requests.get(n)
        if placeholder is None or placeholder.kind != "reserved":
            if placeholder is not None:  # made already (a retry with a new event id)
                return placeholder
            raise not_found(f"training run {run_id!r:.80} (create it through the control plane first)")
        lora = _field(p.get("lora_config"), dict, "lora_config")
        metadata = _metadata(p.get("user_metadata"), "user_metadata")
        uri = _text(p.get("checkpoint_uri") or None, "checkpoint_uri", None)
        self.s.state.forget(placeholder.request_id)
        label = self.s.state.model_label(session, n, metadata)
        request: CreateModelRequest | FromStateRequest
        if uri:
            request = FromStateRequest(uri, bool(p.get("load_optimizer")), label,
                                       base_model=self.base_of(p.get("base_model"), http), run_id=run_id,
                                       session_id=session.session_id)
        else:
            base = self.base_of(p.get("base_model"), http)
            request = CreateModelRequest(base, lora.get("rank", 32), lora.get("seed"),
                                         train_mlp=bool(lora.get("train_mlp", True)),
                                         train_attn=bool(lora.get("train_attn", True)),
                                         train_unembed=bool(lora.get("train_unembed", True)), label=label,
                                         run_id=run_id, session_id=session.session_id)
        return self.s.state.open_run(owner, session, n, request, label,
                                     lambda out: {"training_run_cuid": out["model_id"]})

    def _op(self, owner: str, model: ServedModelView, seq: int, kind: str, p: dict) -> str:
        s = self.s.state
        if kind in ("trainer.forward", "trainer.forward_backward"):
            with s.consumes(model, seq):
                loss = _field(p.get("loss"), dict, "loss")
                loss_fn, config = check_loss(loss.get("type"), loss.get("config") or None)
                shift = bool(p.get("auto_shift"))
                data = [_datum(d, i, shift) for i, d in enumerate(_field(p.get("data"), list, "data"))]
            op = "forward" if kind == "trainer.forward" else "forward_backward"
            request: Any = _Forward(data, loss_fn, config)
            encode: Callable[[Any], Any] = _forward_result
        elif kind == "trainer.optimize_step":
            with s.consumes(model, seq), _decoding("adam_params"):
                a = _field(p.get("adam_params"), dict, "adam_params")
                params = AdamParams(learning_rate=a.get("learning_rate", 1e-4), beta1=a.get("beta1", 0.9),
                                    beta2=a.get("beta2", 0.95), eps=a.get("eps", 1e-12),
                                    weight_decay=a.get("weight_decay", 0.0),
                                    grad_clip_norm=a.get("grad_clip_norm", 0.0))
            op, request = "optim_step", OptimStepRequest(params)
            encode = lambda r: {"metrics": {k: float(v) for k, v in r.metrics.items()}}  # noqa: E731
        elif kind in ("trainer.save_state", "trainer.save_weights"):
            with s.consumes(model, seq):
                name = names.validate_name(p.get("name"), "name")
                overwrite = _field(p.get("overwrite"), bool, "overwrite", False)
            state = kind == "trainer.save_state"
            path = names.checkpoint_path(model.model_id, "weights" if state else "sampler_weights", name)
            op = "save_state" if state else "save_weights_for_sampler"
            request = SaveRequest(name, overwrite=overwrite, ttl_seconds=p.get("ttl_seconds"),
                                  user_metadata=p.get("metadata"))
            base = model.handle.base_model
            encode = lambda r: {"checkpoint": {"uri": getattr(r, "path", None) or path,  # noqa: E731
                                               "model_id": base, "size_bytes": int(getattr(r, "size", 0) or 0)}}
        else:
            raise NotSupportedError(f"event type {kind!r:.40} is not supported by a local trio pool")
        return s.sequenced(model, owner, seq, op, request, lambda r: (encode(r), False))["request_id"]

    def _event(self, event_id: str, kind: str, entry: ServedEntry | None, error: WireError | None = None) -> Response:
        out: dict[str, Any] = {"version": 1, "event_id": event_id, "type": kind}
        usage = {"input_tokens": 0, "output_tokens": 0, "train_tokens": 0}
        if entry is None and error is None:
            error = WireError(404, "not_found", "user", f"event {event_id} is not known here (any more)")
        if entry is not None and entry.done.is_set():
            self.s.state.mark_retrieved(entry)
            error = entry.error
            if error is None:
                out.update(status="succeeded", result=entry.body or {}, usage=usage)
        if error is not None:
            out.update(status="failed", error={"code": error.code, "message": error.message}, usage=usage)
        elif "status" not in out:
            out["status"] = "accepted"
        headers = {"X-Trio-Cycle": str(entry.cycle)} if entry is not None and entry.cycle is not None else None
        return Response(_msgpack().packb(out, use_bin_type=True), media_type=MSGPACK, headers=headers)

    async def get_event(self, owner: str, request: Request) -> Response:
        session = self.session_of(request, owner)
        event_id = request.path_params["event_id"]
        rid = session.aliases.get(event_id)
        entry = self.s.state.entries.get(rid) if rid is not None else None
        if entry is None:
            raise not_found(f"event {event_id!r:.60}")
        wait = request.headers.get("prefer", "").partition("wait=")[2]
        if not entry.done.is_set():
            timeout = min(self.s.long_poll_s, float(wait) if wait.isdigit() else self.s.long_poll_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.done.wait(), timeout)
        return self._event(event_id, _EVENT_OF.get(entry.kind, entry.kind), entry)

    async def sample(self, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, self.s, owner))
        session = self.session_of(request, owner)
        sampler = self.s.state.sampler(request.path_params["sampler_id"], owner)
        if sampler.session is not session:
            raise not_found(f"sampling run {sampler.sampler_id!r:.80} in this session")
        prompt = _model_input(body.get("prompt"), "prompt")
        request_id = _text(body.get("request_id"), "request_id", "")  # said back in the answer
        topk = _field(body.get("topk_prompt_logprobs"), int, "topk_prompt_logprobs", 0)
        asked = SampleRequest(prompt, _field(body.get("num_samples"), int, "num_samples", 1),
                              _sampling_params(body.get("sampling_params")),
                              bool(body.get("return_prompt_logprobs")) or topk > 0, topk_prompt_logprobs=topk)
        text, logprobs = body.get("return_text", True) is not False, body.get("return_token_logprobs", True)
        base = sampler.handle.base_model

        def encode(r: Any) -> tuple[dict, bool]:
            decode = self.s.backend.call(GetTokenizer(base)).decode if text else None
            sequences = [{"tokens": list(q.tokens), "text": decode(list(q.tokens)) if decode else None,
                          "logprobs": list(q.logprobs) if logprobs is not False else [],
                          "stop_reason": str(q.stop_reason)} for q in r.sequences]
            topk_out = [None if row is None else [list(map(float, t)) for t in row]
                        for row in r.topk_prompt_logprobs] if r.topk_prompt_logprobs else None
            return {"request_id": request_id, "sampling_run": sampler.sampler_id,
                    "sequences": sequences, "prompt_logprobs": r.prompt_logprobs, "topk_prompt_logprobs": topk_out,
                    "usage": {"input_tokens": len(prompt.to_ints()),
                              "output_tokens": sum(len(q.tokens) for q in r.sequences)}}, False

        entry = self.s.state.sample(owner, sampler, asked, encode)
        await entry.done.wait()
        self.s.state.mark_retrieved(entry)
        if entry.error is not None:
            raise _Failed(entry.error)
        assert isinstance(entry.body, dict)
        return entry.body


class _Failed(Exception):
    def __init__(self, error: WireError):
        super().__init__(error.message)
        self.error = error


def _local(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


Handler = Callable[[str, Request], Any]


def pytrio_routes(service: Service) -> list[Route]:
    """PyTRIO's control plane and actor as starlette routes (auth, bodies and errors as Tinker's)."""
    codec = PyTrio(service)

    def endpoint(handler: Handler) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            owner = "-"
            try:
                owner = service.authenticate(request)
                result = await handler(owner, request)
            except _Failed as exc:
                return _refusal(exc.error)
            except (HttpError, InvalidInputError, NotSupportedError, PoolClosedError, ClientClosedError) as exc:
                error = wire_of(exc)
                log.info("refused %s %s: %d %s (owner %s): %s", request.method, request.url.path, error.status,
                         error.code, owner[:12], error.message[:300])
                response = _refusal(error)
                if isinstance(exc, HttpError) and exc.status in (401, 403, 408, 413, 415):
                    response.headers["Connection"] = "close"
                return response
            except Exception as exc:  # a bug: said in PyTRIO's shape, logged here
                log.exception("%s %s failed", request.method, request.url.path)
                return _refusal(wire_error(exc))
            return result if isinstance(result, Response) else JSONResponse(result)

        return run

    c, a = CONTROL, ACTOR + "/{session_id}/v1"
    table: list[tuple[str, str, Handler]] = [
        ("GET", f"{c}/api-key/verify", codec.verify), ("GET", "/api/sdk/bootstrap", codec.bootstrap),
        ("GET", "/api/models", codec.models),
        ("POST", f"{c}/service-sessions", codec.create_session), ("GET", f"{c}/service-sessions", codec.list_sessions),
        ("GET", f"{c}/service-sessions/{{session_id}}", codec.get_session),
        ("POST", f"{c}/service-sessions/{{session_id}}/renew", codec.renew_session),
        ("POST", f"{c}/service-sessions/{{session_id}}/close", codec.close_session),
        ("POST", f"{c}/service-sessions/{{session_id}}/training-runs", codec.create_run),
        ("PATCH", f"{c}/service-sessions/{{session_id}}/training-runs/{{run_id}}", codec.update_run),
        ("POST", f"{c}/service-sessions/{{session_id}}/sampling-runs", codec.create_sampler),
        ("GET", f"{c}/training-runs/by-checkpoint-uri", codec.by_checkpoint),
        ("GET", f"{c}/training-runs", codec.list_runs), ("GET", f"{c}/training-runs/{{run_id}}", codec.get_run),
        ("POST", f"{c}/training-runs/{{run_id}}/renew", codec.renew_run),
        ("GET", f"{c}/training-runs/{{run_id}}/checkpoints", codec.checkpoints),
        ("GET", f"{c}/sampling-runs/{{sampler_id}}", codec.get_sampler),
        ("POST", f"{c}/sampling-runs/{{sampler_id}}/renew", codec.renew_sampler),
        ("GET", f"{c}/checkpoints", codec.checkpoints),
        ("DELETE", f"{c}/checkpoints/{{cuid}}", codec.delete_checkpoint),
        ("GET", f"{c}/checkpoints/{{cuid}}/download-url", codec.download_url),
        ("POST", f"{a}/events", codec.submit), ("GET", f"{a}/events/{{event_id}}", codec.get_event),
        ("POST", f"{a}/sampling-runs/{{sampler_id}}/sample", codec.sample),
        ("POST", f"{a}/client/heartbeat", codec.heartbeat),
    ]
    async def unknown(owner: str, request: Request) -> dict:  # under PyTRIO's prefixes: said in its shape
        raise HttpError(404, f"no such endpoint: {request.method} {request.url.path[:200]}", code="no_endpoint")

    rest = [Route(path, endpoint(unknown), methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
            for prefix in (CONTROL, ACTOR) for path in (prefix, f"{prefix}/{{rest:path}}")]  # after the table:
    # a known path asked with another method comes here too
    return [Route(path, endpoint(handler), methods=[method]) for method, path, handler in table] + rest

