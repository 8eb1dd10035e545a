"""The HTTP layer of a served pool: Tinker's routes, each decoded, authenticated and bounded
here, then handed to the service (trio_widgets/http/server.py); every refusal is a JSON 4xx from
the protocol's one error table (never a bare 400: the SDK retries those)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..backend import Capabilities
from ..errors import ClientClosedError, InvalidInputError, NotSupportedError, PoolClosedError
from ..protocol import WireError, wire_error
from . import wire
from .auth import HttpError, error_response, is_loopback, wire_of
from .stream import telemetry_stream

if TYPE_CHECKING:
    from .service import Service

__all__ = ["API", "build_app", "error_response", "json_body", "read_body"]

log = logging.getLogger("trio_widgets.http.server")

API = "/api/v1"
_CLOSE = (401, 403, 408, 413, 415)  # refusals after which the connection is closed


async def read_body(request: Request, service: Service, owner: str) -> bytes:
    """The body, bounded in size (max_body_bytes), in bytes held while it arrives (per key and in
    all: a stalled body holds its bytes) and in time: a body that stalls for body_timeout_s is a 408."""
    limit = service.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HttpError(400, "Content-Length is not a number")
        if int(length) > limit:
            raise HttpError(413, f"the body has {int(length)} bytes, more than this server's limit of {limit} "
                                  f"(max_body_bytes); send smaller batches")
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise HttpError(415, f"Content-Encoding {encoding!r} is not supported: this server does not advertise "
                              f"compressed request bodies")
    chunks, size = [], 0
    stream = request.stream()
    with service.budget.reading(owner) as take:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), service.body_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise HttpError(408, f"the body stalled: nothing arrived for {service.body_timeout_s:g} s "
                                     f"(body_timeout_s)", code="timeout") from None
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"the body is more than this server's limit of {limit} bytes (max_body_bytes)")
            take(len(chunk))
            chunks.append(chunk)
    return b"".join(chunks)


def _local(request: Request) -> bool:
    """Whether the client is on this machine (a directory path the server names means something there)."""
    return request.client is not None and is_loopback(request.client.host)


def _log_refusal(request: Request, owner: str, error: WireError) -> None:
    """One line per refused request, for the server's log: never the key (its owner digest, the
    client's session or model id where the body named one)."""
    who = getattr(request.state, "client", None) or "-"
    log.info("refused %s %s: %d %s (owner %s, client %s): %s", request.method, request.url.path, error.status,
             error.code, owner[:12], str(who)[:80], error.message[:300])


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


Handler = Callable[["Service", str, Request], Awaitable[Any]]


def _endpoint(service: Service, handler: Handler, *, observer: bool = False, open_: bool = False
              ) -> Callable[[Request], Awaitable[Response]]:
    """Auth, bounded body, and every refusal as a JSON 4xx (never a bare 400: the SDK retries those)."""
    async def endpoint(request: Request) -> Response:
        owner = "-"
        try:
            owner = "anonymous" if open_ else service.authenticate(request, observer)
            result = await handler(service, owner, request)
        except (HttpError, InvalidInputError, NotSupportedError, PoolClosedError, ClientClosedError) as exc:
            # one table (trio_widgets.protocol.errors): trio's client raises the in-process class
            error = wire_of(exc)
            _log_refusal(request, owner, error)
            return error_response(error, close=isinstance(exc, HttpError) and exc.status in _CLOSE)
        except Exception as exc:  # a bug: said in JSON (the SDK shows the body), logged here
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(wire_error(exc))
        if isinstance(result, Response):
            return result
        return JSONResponse(result)

    return endpoint


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
        s.session(body.get("session_id"), owner)  # 410 once expired: the SDK stops heartbeating then
        return {"type": "session_heartbeat"}

    async def finish(s: Service, owner: str, request: Request) -> dict:
        await read_body(request, s, owner)
        session = s.session(request.path_params["session_id"], owner, live=False)
        if session.state == "live":
            s.end_session(session, "finished", "the client finished its session")
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
        return s.get_sampler(owner, request.path_params["sampler_id"], local=_local(request))

    async def get_info(s: Service, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, s, owner))
        request.state.client = body.get("model_id")
        return s.get_info(owner, body, local=_local(request))

    # the catalog's handlers read and write checkpoints on disk: off the event loop (Service.off_loop)
    async def tokenizer(s: Service, owner: str, request: Request) -> dict:
        model = request.query_params.get("base_model")
        return await s.off_loop(lambda: s.tokenizer_files(owner, model))

    async def checkpoints(s: Service, owner: str, request: Request) -> dict:
        model_id = request.path_params["model_id"]
        return await s.off_loop(lambda: s.list_checkpoints(owner, model_id))

    def page(request: Request) -> tuple[int, int]:
        values = []
        for name, default in (("limit", 100), ("offset", 0)):
            text = request.query_params.get(name, str(default))
            if not text.isdigit() or int(text) > 10_000:
                raise InvalidInputError(f"must be an integer from 0 to 10000, got {text!r:.20}", field=name)
            values.append(int(text))
        return values[0], values[1]

    async def training_runs(s: Service, owner: str, request: Request) -> dict:
        limit, offset = page(request)
        return await s.off_loop(lambda: s.training_runs(owner, limit, offset))

    async def training_run(s: Service, owner: str, request: Request) -> dict:
        model_id = request.path_params["model_id"]
        return await s.off_loop(lambda: s.training_run(owner, model_id))

    async def user_checkpoints(s: Service, owner: str, request: Request) -> dict:
        limit, offset = page(request)
        return await s.off_loop(lambda: s.user_checkpoints(owner, limit, offset))

    async def delete_checkpoint(s: Service, owner: str, request: Request) -> dict:
        p = request.path_params
        return await s.off_loop(lambda: s.delete_checkpoint(owner, p["model_id"], p["checkpoint_id"]))

    async def set_ttl(s: Service, owner: str, request: Request) -> dict:
        body = json_body(await read_body(request, s, owner))
        p = request.path_params
        return await s.off_loop(lambda: s.set_checkpoint_ttl(owner, p["model_id"], p["checkpoint_id"], body))

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
        return {**s.info(), **s.totals()}

    async def telemetry(s: Service, owner: str, request: Request) -> Response:
        return await telemetry_stream(s, request, owner)

    def unsupported(what: str) -> Handler:
        async def handler(s: Service, owner: str, request: Request) -> Any:
            body = json_body(await read_body(request, s, owner))
            s.refuse_seq(owner, body.get("model_id"), body.get("seq_id"))  # the SDK used a seq_id for it
            raise NotSupportedError(f"{what} is not supported by a local trio pool")

        return handler

    async def unknown(request: Request) -> Response:
        return error_response(WireError(404, "no_endpoint", "user",
                                         f"no such endpoint: {request.method} {request.url.path}"))

    def post(path: str, handler: Handler, **kw: Any) -> Route:
        return Route(API + path, _endpoint(service, handler, **kw), methods=["POST"])

    def get(path: str, handler: Handler, **kw: Any) -> Route:
        return Route(API + path, _endpoint(service, handler, **kw), methods=["GET"])

    def route(method: str, path: str, handler: Handler) -> Route:
        return Route(API + path, _endpoint(service, handler), methods=[method])

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
        post("/weights_info", _json_handler(lambda s, o, b: s.off_loop(lambda: s.weights_info(o, b)))),
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
