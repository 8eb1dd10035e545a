"""The HTTP layer of a served pool: Tinker's routes, each decoded here (bodies bounded by the guard,
keys checked by auth) and handed to the service (trio_widgets/http/service.py); every refusal is a
JSON 4xx from the protocol's one error table (never a bare 400: the SDK retries those)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..backend import (
    Capabilities,
    DeleteCheckpoint,
    GetTrainingRun,
    ListCheckpoints,
    ListTrainingRuns,
    SetCheckpointTtl,
    WeightsInfo,
)
from ..errors import InvalidInputError, NotSupportedError
from ..protocol import WireError
from . import wire
from .auth import HttpError, answering, error_response, is_local
from .guard import read_body
from .stream import info as info_of
from .stream import telemetry_stream

if TYPE_CHECKING:
    from .service import Service

__all__ = ["API", "build_app", "error_response", "json_body", "page", "read_body"]


API = "/api/v1"


def _plain(value: Any) -> Any:
    """A catalog's dataclass as JSON, datetimes as ISO 8601 (what the SDK's models parse), at any depth."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.isoformat() if hasattr(value, "isoformat") else value


def _paged(key: str, items: list, limit: int, offset: int) -> dict:
    return {key: [_plain(i) for i in items[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(items)}}


def json_body(body: bytes) -> dict:
    if not body:
        return {}
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HttpError(400, f"the body must be a JSON object, got {type(value).__name__}")
    return value


TINKER_PAGE = 100  # a listing's default page size in Tinker's SDK (PyTRIO's: pytrio_wire.PYTRIO_PAGE)


def page(request: Request, limit: int) -> tuple[int, int]:
    """A listing's (limit, offset) from its query (`limit` when not given; each 0 to 10,000: each codec
    passes its SDK's default, Tinker's 100, PyTRIO's 20)."""
    values = []
    for name, default in (("limit", limit), ("offset", 0)):
        text = request.query_params.get(name, str(default))
        if not text.isdigit() or int(text) > 10_000:
            raise InvalidInputError(f"must be an integer from 0 to 10000, got {text!r:.20}", field=name)
        values.append(int(text))
    return values[0], values[1]


Handler = Callable[["Service", str, Request], Awaitable[Any]]


def _json_handler(method: Callable[[Service, str, dict], Any]) -> Handler:
    async def handler(service: Service, owner: str, request: Request) -> Any:
        body = json_body(await read_body(request, service, owner))
        request.state.client = next((body[k] for k in ("model_id", "sampling_session_id", "session_id", "request_id")
                                     if isinstance(body.get(k), str)), None)  # for the log
        result = method(service, owner, body)
        return await result if asyncio.iscoroutine(result) else result

    return handler


def build_app(service: Service, more: list[Route] | None = None) -> Starlette:
    """Tinker's routes, then `more` (PyTRIO's: trio_widgets/http/pytrio_wire.py), then 404 for the rest."""
    async def config(s: Service, owner: str, request: Request) -> dict:
        await read_body(request, s, owner)
        # plain httpx (no Rust transport), uncompressed bodies, chunks no larger than a pool request
        return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": False, "pjwt_auth_enabled": False,
                "fwdbwd_max_chunk_len": s.fwdbwd_max_chunk_len,
                "fwdbwd_max_chunk_bytes_count": max(1, s.max_body_bytes // 2),
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    async def dynamic_config(s: Service, owner: str, request: Request) -> dict:
        await read_body(request, s, owner)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def heartbeat(s: Service, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, s, owner))
        s.state.session(body.get("session_id"), owner)  # 410 once expired: the SDK stops heartbeating then
        return {"type": "session_heartbeat"}

    async def finish(s: Service, owner: str, request: Request) -> dict:
        await read_body(request, s, owner)
        s.state.finish(request.path_params["session_id"], owner, "the client finished its session")
        return {}

    async def telemetry_sink(s: Service, owner: str, request: Request) -> dict:
        await read_body(request, s, owner)  # the SDK's own telemetry: accepted, not kept
        return {"status": "accepted"}

    async def forward_backward(s: Service, owner: str, request: Request) -> dict:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith(wire.PROTOBUF):
            raise HttpError(415, f"forward_backward takes a protobuf body ({wire.PROTOBUF}), got {ctype!r}")
        return s.forward_backward(owner, await read_body(request, s, owner))

    async def retrieve(s: Service, owner: str, request: Request) -> Response:
        return await s.retrieve(owner, json_body(await read_body(request, s, owner)))

    async def capabilities(s: Service, owner: str, request: Request) -> dict:
        # the engine's answer, as in-process (the SDK's model ignores pytrio's extra fields)
        models = s.backend.call(Capabilities()).supported_models
        served = [dataclasses.asdict(m) for m in models if m.model_name in s.models]
        return {"supported_models": served}

    async def healthz(s: Service, owner: str, request: Request) -> dict:
        return {"status": "ok"}

    async def get_sampler(s: Service, owner: str, request: Request) -> dict:
        return s.get_sampler(owner, request.path_params["sampler_id"], local=is_local(request))

    async def get_info(s: Service, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, s, owner))
        request.state.client = body.get("model_id")
        return s.get_info(owner, body, local=is_local(request))

    # tokenizer files and the catalog: disk work and JSON (1,000 checkpoints ~10 ms), off the event loop, paced per key
    async def tokenizer(s: Service, owner: str, request: Request) -> Response:
        model = request.query_params.get("base_model")
        return await s.catalog(owner, lambda: JSONResponse(s.state.tokenizer_files(owner, model)))

    async def catalog(s: Service, owner: str, call: Any, encode: Callable[[Any], dict] = lambda _r: {}) -> Response:
        return await s.catalog(owner, lambda: JSONResponse(encode(s.of(owner).call(call))))

    async def checkpoints(s: Service, owner: str, request: Request) -> Response:
        return await catalog(s, owner, ListCheckpoints(request.path_params["model_id"]),
                             lambda found: {"checkpoints": [_plain(c) for c in found[:1000]]})  # bounded

    async def training_runs(s: Service, owner: str, request: Request) -> Response:
        limit, offset = page(request, TINKER_PAGE)
        return await catalog(s, owner, ListTrainingRuns(), lambda runs: _paged("training_runs", runs, limit, offset))

    async def training_run(s: Service, owner: str, request: Request) -> Response:
        return await catalog(s, owner, GetTrainingRun(request.path_params["model_id"]), _plain)

    async def user_checkpoints(s: Service, owner: str, request: Request) -> Response:
        limit, offset = page(request, TINKER_PAGE)  # newest first, as in-process
        return await catalog(s, owner, ListCheckpoints(None), lambda found: _paged("checkpoints", found[::-1], limit,
                                                                                  offset))

    async def delete_checkpoint(s: Service, owner: str, request: Request) -> Response:
        p = request.path_params
        return await catalog(s, owner, DeleteCheckpoint(p["model_id"], p["checkpoint_id"]))

    async def set_ttl(s: Service, owner: str, request: Request) -> Response:
        body = json_body(await read_body(request, s, owner))
        p = request.path_params
        return await catalog(s, owner, SetCheckpointTtl(p["model_id"], p["checkpoint_id"], body.get("ttl_seconds")))

    async def weights_info(s: Service, owner: str, request: Request) -> Response:
        body = json_body(await read_body(request, s, owner))
        return await catalog(s, owner, WeightsInfo(body.get("tinker_path")), _plain)

    async def export_urls(s: Service, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, s, owner))
        return s.export_urls(owner, body.get("tinker_path"), str(request.base_url))

    async def external_weights_urls(s: Service, owner: str, request: Request) -> dict:
        # tinker's RestClient.get_external_weights_urls: one signed URL per file
        p = request.path_params
        found = s.export_urls(owner, f"tinker://{p['model_id']}/{p['checkpoint_id']}", str(request.base_url))
        return {"urls": found["urls"], "expires": found["expires"]}

    async def export_download(s: Service, owner: str, request: Request) -> Response:
        return await s.exports.download(request)  # no key: the URL's signature is the credential

    async def info(s: Service, owner: str, request: Request) -> dict:
        return info_of(s)

    async def telemetry(s: Service, owner: str, request: Request) -> Response:
        return await telemetry_stream(s, request, owner)

    def unsupported(what: str) -> Handler:
        async def handler(s: Service, owner: str, request: Request) -> Any:
            body = json_body(await read_body(request, s, owner))
            s.state.refuse_seq(owner, body.get("model_id"), body.get("seq_id"))  # the SDK used a seq_id for it
            raise NotSupportedError(f"{what} is not supported by a local trio pool")

        return handler

    async def unknown(request: Request) -> Response:
        return error_response(WireError(404, "no_endpoint", "user",
                                         f"no such endpoint: {request.method} {request.url.path}"))

    def post(path: str, handler: Handler, **kw: Any) -> Route:
        return Route(API + path, answering(service, handler, **kw), methods=["POST"])

    def get(path: str, handler: Handler, **kw: Any) -> Route:
        return Route(API + path, answering(service, handler, **kw), methods=["GET"])

    def route(method: str, path: str, handler: Handler) -> Route:
        return Route(API + path, answering(service, handler), methods=[method])

    routes = [
        post("/client/config", config), post("/client/dynamic_config", dynamic_config),
        post("/create_session", _json_handler(lambda s, o, b: s.create_session(o, b))),
        post("/session_heartbeat", heartbeat), post("/sessions/{session_id}/finish", finish),
        post("/telemetry", telemetry_sink),
        post("/create_model", _json_handler(lambda s, o, b: s.create_model(o, b))),
        post("/get_info", get_info),
        post("/forward_backward", forward_backward),
        post("/optim_step", _json_handler(lambda s, o, b: s.optim_step(o, b))),
        post("/save_weights", _json_handler(lambda s, o, b: s.save_weights(o, b))),
        post("/save_weights_for_sampler", _json_handler(lambda s, o, b: s.save_weights_for_sampler(o, b))),
        post("/load_weights", _json_handler(lambda s, o, b: s.load_weights(o, b))),
        post("/create_sampling_session", _json_handler(lambda s, o, b: s.create_sampling_session(o, b))),
        get("/samplers/{sampler_id}", get_sampler),
        post("/asample", _json_handler(lambda s, o, b: s.asample(o, b))),
        post("/retrieve_future", retrieve),
        post("/cancel_future", _json_handler(lambda s, o, b: s.cancel(o, b))),
        get("/get_server_capabilities", capabilities),
        get("/healthz", healthz, open_=True),
        get("/training_runs/{model_id}/checkpoints", checkpoints),
        get("/training_runs", training_runs), get("/training_runs/{model_id}", training_run),
        get("/checkpoints", user_checkpoints),
        post("/weights_info", weights_info),
        route("DELETE", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint),
        route("PUT", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl", set_ttl),
        post("/save_weights_external", _json_handler(lambda s, o, b: s.save_weights_external(o, b))),
        get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
            external_weights_urls),
        post("/trio/export_urls", export_urls),
        get("/trio/export/{model_id}/{segment}/{name}/{member}", export_download, open_=True),
        post("/create_custom_loss", unsupported("a server-side custom loss (create_custom_loss)")),
        post("/auth/token", unsupported("JWT authentication")),
        post("/trio/release", _json_handler(lambda s, o, b: s.release(o, b))),
        get("/trio/info", info, observer=True),
        get("/trio/tokenizer", tokenizer),
        get("/trio/telemetry", telemetry, observer=True),
    ]
    app = Starlette(routes=[*routes, *(more or ())])
    app.add_route("/{path:path}", unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    return app
