"""HttpBackend: trio's client API against a served pool, in Tinker's wire protocol, with httpx.

`trio.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")` builds one; the
TrainingClient / SamplingClient code is the same as in-process (trio_widgets/backend.py is
the seam). What happens on the wire:

* Submits are synchronous POSTs from the caller's thread (a refusal raises at submit, as
  in-process); each returns a request id, whose result one poller thread long-polls
  (`retrieve_future`) and delivers into the `APIFuture`. Its cycle comes back in the
  `X-Trio-Cycle` header, so `APIFuture.cycle` works over HTTP too.
* Order: every request of a model carries the next `seq_id`, and the POSTs of a model are
  sent one at a time, in order. A reservation (the second half of `forward_backward_custom`)
  holds its place on this side: the model's later submits wait in a client-side queue behind
  it and are sent, in order, once it is filled (or failed). The server therefore never sees a
  gap from this client, and never has to wait for one.
* Retries: a POST that fails in transport, or with 408 / 429 / 5xx, is sent again with the
  same `seq_id` for up to `retry_s` seconds; the server answers a repeated `(model, seq_id)`
  with the first request's id, so an update never runs twice.
* A session heartbeat every `heartbeat_s` seconds keeps the server from expiring the session.
  `close()` finishes the session, fails what is still pending and stops both threads; so does
  garbage collection of the backend, and interpreter exit.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime
import itertools
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from .._worker import BackgroundWorker
from ..backend import (
    AttachSampler,
    Call,
    ComputeLogprobsRequest,
    CreateModelRequest,
    CreateSamplerRequest,
    ExportUrls,
    ForwardRequest,
    FromStateRequest,
    LoadRequest,
    ModelHandle,
    Open,
    OptimStepRequest,
    SamplerCreated,
    SampleRequest,
    SaveRequest,
    T,
    answer,
    opened,
)
from ..errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    CheckpointNotFoundError,
    ClientClosedError,
    InternalServerError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    PoolClosedError,
    RequestErrorCategory,
    RequestFailedError,
)
from ..export import extract_tar
from ..futures import APIFuture, PoolFuture, mark_delivery_thread
from ..protocol import error_from_wire, parse_tinker_path
from ..protocol.losses import forward_metrics, tokens_read
from ..protocol.paths import parse_checkpoint_id
from ..types import (
    AdamOptimizerConfig,
    Checkpoint,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    LoadWeightsResponse,
    ModelOperationCapabilities,
    OptimStepResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    TensorData,
    TrainingRun,
    WeightsInfoResponse,
    check_text_only,
)
from . import new_event_loop, wire

__all__ = ["HttpBackend"]

log = logging.getLogger(__name__)

_RETRYABLE = {408, 429, 500, 502, 503, 504}
_DOWNLOAD_S = 3600.0  # a checkpoint download's time, in all (each read has the link's timeout)
_DRAIN_S = 30.0  # close() waits at most this long for the results of what was sent
_TOKENIZER_LOCK = threading.Lock()


class _Cycle:
    """Where the cycle a request ran in is written (from the X-Trio-Cycle header), and whose
    request it is (an interrupted wait names the client, as in-process)."""

    def __init__(self, client_id: str | None = None) -> None:
        self.cycle: int | None = None
        self.client_id = client_id


def _json_body(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")


def _details(body: dict, path: str | None = None) -> tuple[str | None, str | None, Any]:
    """The field, checkpoint path and datum index an error body names (`path` when it names none)."""
    field_name = body.get("field") if isinstance(body.get("field"), str) else None
    return field_name, body["path"] if isinstance(body.get("path"), str) else path, body.get("datum_index")


def _error(response: httpx.Response, *, path: str | None = None) -> Exception:
    """The exception a non-200 answer means (the server's JSON `detail` is its message)."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    message = str(body.get("detail") or response.text or response.reason_phrase)
    status = response.status_code
    field_name, path, datum_index = _details(body, path)
    if field_name and message.startswith(f"{field_name}: "):
        message = message[len(field_name) + 2:]
    known = error_from_wire(body.get("code"), message, field=field_name, path=path, datum_index=datum_index)
    if known is not None:  # the class the pool raised, as in-process (trio_widgets.protocol.errors)
        return known
    if status in (400, 413, 415, 422):
        return InvalidInputError(message, field=field_name)
    if status == 401:
        return AuthenticationError(message)
    if status == 403:
        return PermissionDeniedError(message)
    if status == 404:
        return CheckpointNotFoundError(message, path=path) if path is not None else NotFoundError(message)
    if status == 410:
        return PoolClosedError(message)
    if status >= 500:
        return InternalServerError(message)
    error = APIStatusError(message)
    error.status_code = status
    return error


@dataclass
class _Outgoing:
    """A request of a model, in its client-side queue until it is sent."""

    op: str
    request: Any
    ready: bool
    future: PoolFuture
    scheduled: _Cycle = field(default_factory=_Cycle)
    request_id: str | None = None


class _Lane:
    """One model's requests: the next seq_id and what waits behind a reservation."""

    def __init__(self, handle: ModelHandle):
        self.handle = handle
        self.lock = threading.RLock()  # held while a POST of this model is on the wire: one at a time, in order
        self.next_seq = 1  # the create is seq 0
        self.outbox: deque[_Outgoing] = deque()


class _Link:
    """The connection state the threads share; the backend holds it (the threads never hold the
    backend, so dropping the backend stops them)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, retry_s: float, long_poll_s: float,
                 transport: httpx.BaseTransport | None = None, label: str | None = None, heartbeat_s: float = 10.0):
        self.base_url = base_url
        self.retry_s = retry_s
        self.long_poll_s = long_poll_s
        headers = {"User-Agent": "trio-widgets"}
        if api_key:
            headers["X-API-Key"] = api_key
        self.headers = headers
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.transport = transport
        self.http = httpx.Client(base_url=f"{base_url}/api/v1", headers=headers, timeout=self.timeout,
                                 transport=transport)
        self.session_id: str | None = None
        self.label, self.heartbeat_s = label, heartbeat_s
        self.opening = threading.Lock()
        self.stop = threading.Event()
        self.closed = False
        self.loop = new_event_loop()  # (an object: no socket until the poller starts)
        self.pending: dict[str, tuple[_Outgoing, Callable[[Any, bool], Any], str | None]] = {}
        self.thread = threading.Thread(target=self._run_poller, name="trio-http-poller", daemon=True)
        self.heartbeat: threading.Thread | None = None
        self.aclient: httpx.AsyncClient | None = None

    def open(self) -> None:
        """The session, made on first use (a backend's constructor does no I/O): the server's
        config, create_session, then the poller and the heartbeat threads."""
        with self.opening:
            if self.session_id is not None or self.closed:
                return
            if self.thread.ident is None:  # (a failed first open leaves it running for the next)
                self.thread.start()
            self._call("POST", "/client/config", json={"sdk_version": "trio-widgets"})
            body: dict[str, Any] = {"tags": [], "user_metadata": {"name": self.label} if self.label else {},
                                    "sdk_version": "trio-widgets", "type": "create_session"}
            self.session_id = str(self._call("POST", "/create_session", json=body)["session_id"])
            self.start_heartbeat(self.heartbeat_s)

    # -- plain calls (any thread but the poller's) -------------------------------------------
    def call(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
             headers: dict[str, str] | None = None, retry: bool = True, checkpoint: str | None = None) -> Any:
        """One request, retried in transport failures and 408/429/5xx for up to `retry_s` seconds
        (every retried call here is idempotent on the server); its JSON body, or an exception."""
        self.open()
        return self._call(method, path, json=json, content=content, headers=headers, retry=retry,
                          checkpoint=checkpoint)

    def _call(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
              headers: dict[str, str] | None = None, retry: bool = True, checkpoint: str | None = None) -> Any:
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        if json is not None:  # ASCII escapes: text that is not UTF-8 (a lone surrogate in a name) reaches the
            # server, whose check names the field it is in, as in-process (httpx's own encoding raised here)
            content = _json_body(json)
            headers = {**(headers or {}), "Content-Type": "application/json"}
        while True:
            if self.closed:
                raise ClientClosedError(f"the connection to {self.base_url} was closed")
            try:
                response = self.http.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                if not retry or time.monotonic() + delay > deadline:
                    raise APIConnectionError(f"cannot reach the trio server at {self.base_url} ({method} {path}): "
                                             f"{type(exc).__name__}: {exc}") from None
            else:
                if response.status_code == 200:
                    return response.json()
                if not retry or response.status_code not in _RETRYABLE or time.monotonic() + delay > deadline:
                    raise _error(response, path=checkpoint)
            time.sleep(delay)
            delay = min(2.0, delay * 2)

    def release_later(self, client_id: str) -> None:
        """POST /trio/release from the poller's loop: no lock taken and no I/O on this thread
        (a garbage-collected client's finalizer); nothing to do once the link is closed."""
        if self.closed:  # (its session is closed with what it held)
            return
        try:
            asyncio.run_coroutine_threadsafe(self._release(client_id), self.loop)
        except RuntimeError:  # the loop is closed: so is the session, and what it held
            pass

    async def _release(self, client_id: str) -> None:
        if self.closed or self.aclient is None:
            return
        try:
            await self.aclient.post("/trio/release", content=_json_body({"id": client_id}),
                                    headers={"Content-Type": "application/json"})
        except httpx.HTTPError:
            pass  # the server or the session is gone: nothing is held for it there

    # -- the poller -------------------------------------------------------------------------
    def _run_poller(self) -> None:
        mark_delivery_thread()  # a done-callback that waits on another result here would wait forever
        asyncio.set_event_loop(self.loop)
        transport = self.transport if isinstance(self.transport, httpx.AsyncBaseTransport) else None
        self.aclient = httpx.AsyncClient(base_url=f"{self.base_url}/api/v1", headers=self.headers,
                                         timeout=httpx.Timeout(self.long_poll_s + 20.0, connect=5.0),
                                         limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                                         transport=transport)
        try:
            self.loop.run_forever()
        finally:
            # polls still waiting end here, cancelled (close() settles their futures), rather than
            # being destroyed pending with the loop ("Task was destroyed but it is pending!")
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.aclient.aclose())
            self.loop.close()

    def watch(self, request_id: str, item: _Outgoing, decode: Callable[[Any, bool], Any],
              owner: str | None) -> None:
        """Long-poll `request_id` until its result is in, then settle `item.future`."""
        self.pending[request_id] = (item, decode, owner)
        try:
            asyncio.run_coroutine_threadsafe(self._poll(request_id), self.loop)
        except RuntimeError:  # the loop stopped: closed meanwhile
            self.pending.pop(request_id, None)
            _settle(item.future, exc=ClientClosedError(f"the connection to {self.base_url} was closed"))

    async def _poll(self, request_id: str) -> None:
        item, decode, owner = self.pending[request_id]
        accept = {"Accept": f"{wire.PROTOBUF}, application/json"}
        failing_since: float | None = None
        delay = 0.05
        try:
            while not self.closed:
                assert self.aclient is not None
                try:
                    response = await self.aclient.post("/retrieve_future", headers=accept,
                                                       json={"request_id": request_id, "allow_metadata_only": False})
                except httpx.TransportError as exc:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.retry_s:
                        raise APIConnectionError(f"lost the trio server at {self.base_url} while waiting for "
                                                 f"request {request_id}: {type(exc).__name__}: {exc}") from None
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    continue
                if response.status_code in _RETRYABLE:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.retry_s:
                        raise _error(response)
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    continue
                failing_since, delay = None, 0.05
                if response.status_code != 200:
                    raise _error(response)
                cycle = response.headers.get("x-trio-cycle")
                if cycle is not None and cycle.lstrip("-").isdigit():
                    item.scheduled.cycle = int(cycle)
                if response.headers.get("content-type", "").startswith(wire.PROTOBUF):
                    _settle(item.future, value=decode(response.content, True))
                    return
                body = response.json()
                if isinstance(body, dict) and body.get("type") == "try_again":
                    continue
                if isinstance(body, dict) and body.get("code") == "cancelled":
                    # withdrawn on cancel() before it ran: cancelled, as in-process (even when this
                    # answer arrives before the cancel call returns)
                    concurrent.futures.Future.cancel(item.future)
                    return
                if isinstance(body, dict) and "error" in body:
                    raise _future_error(body, request_id, owner, item.scheduled.cycle, self.base_url)
                _settle(item.future, value=decode(body, False))
                return
            raise ClientClosedError(f"the connection to {self.base_url} was closed before request {request_id} "
                                    f"finished")
        except BaseException as exc:  # noqa: BLE001 - whatever happened belongs to this future
            _settle(item.future, exc=exc if isinstance(exc, Exception) else
                    ClientClosedError(f"polling request {request_id} was stopped"))
        finally:
            self.pending.pop(request_id, None)

    # -- heartbeat --------------------------------------------------------------------------
    def start_heartbeat(self, every_s: float) -> None:
        def beat() -> None:
            while not self.stop.wait(every_s):
                try:
                    self.http.post("/session_heartbeat", json={"session_id": self.session_id,
                                                               "type": "session_heartbeat"}, timeout=10.0)
                except httpx.TransportError as exc:
                    log.debug("heartbeat to %s failed: %s", self.base_url, exc)

        self.heartbeat = threading.Thread(target=beat, name="trio-http-heartbeat", daemon=True)
        self.heartbeat.start()

    # -- closing ----------------------------------------------------------------------------
    def close_later(self, worker: BackgroundWorker) -> None:
        """close() from the poller's loop: no lock taken and no I/O on this thread (a dropped
        backend's finalizer). A link never opened has no session, thread or connection to end."""
        if self.closed:
            return
        if self.thread.ident is None:
            self.closed = True
            self.stop.set()
            worker.close()
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_on_loop(worker), self.loop)
        except RuntimeError:  # the loop is closed: so is the link
            pass

    async def _close_on_loop(self, worker: BackgroundWorker) -> None:
        if self.closed:
            return
        if self.session_id is not None and self.aclient is not None:
            try:
                await self.aclient.post(f"/sessions/{self.session_id}/finish", timeout=5.0,
                                        content=_json_body({"reason": {"type": "success"}, "detail": None}),
                                        headers={"Content-Type": "application/json"})
            except httpx.HTTPError:
                pass  # the server is gone: nothing to finish
        worker.close()
        self.close(finish=False)  # on this thread: it stops the loop after this task, and joins the heartbeat

    def delivering(self) -> bool:
        """Whether this is the thread that settles this link's futures."""
        return self.thread is threading.current_thread()

    def close(self, finish: bool = True) -> None:
        if self.closed:
            return
        if finish and self.session_id is not None:
            try:
                self.http.post(f"/sessions/{self.session_id}/finish", json={"reason": {"type": "success"},
                                                                            "detail": None}, timeout=5.0)
            except httpx.TransportError:
                pass  # the server is gone: nothing to finish
        self.closed = True
        self.stop.set()
        for item, _decode, _owner in list(self.pending.values()):
            _settle(item.future, exc=ClientClosedError(f"the connection to {self.base_url} was closed before "
                                                       f"this result arrived"))
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self.thread is not threading.current_thread():
                self.thread.join(10.0)
        if self.heartbeat is not None and self.heartbeat is not threading.current_thread():
            self.heartbeat.join(10.0)
        self.http.close()


def _close(link: _Link, worker: BackgroundWorker) -> None:
    """close(): nothing of the backend keeps running."""
    worker.close()
    link.close()


def _dropped(link: _Link, worker: BackgroundWorker) -> None:
    """The finalizer of a dropped backend. The collector runs it on whatever thread it
    interrupted, maybe inside a lock that close() takes (httpx's connection-pool lock, held by a
    heartbeat's request of this link): here it only hands the close to the poller's loop."""
    link.close_later(worker)


def _settle(future: concurrent.futures.Future, value: Any = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def _future_error(body: dict, request_id: str, owner: str | None, cycle: int | None, base_url: str) -> Exception:
    message, code = str(body.get("error")), body.get("code")
    if code == "server_shutdown":
        message = f"the trio server at {base_url} shut down: {message}"
    field_name, path, datum_index = _details(body)
    known = error_from_wire(code, message, field=field_name, path=path, category=body.get("category"),
                            request_id=request_id, client_id=owner, cycle=cycle, datum_index=datum_index)
    if known is not None:  # the class the pool raised, as in-process (trio_widgets.protocol.errors)
        return known
    try:
        category = RequestErrorCategory(body.get("category", "unknown"))
    except ValueError:
        category = RequestErrorCategory.Unknown
    return RequestFailedError(message, client_id=owner, cycle=cycle, request_id=request_id, category=category)


def _request_number(request_id: str) -> int | None:
    tail = request_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


class HttpBackend:
    """Runs a ServiceClient's requests on a served pool (see trio_widgets.backend.Backend).

    `base_url` is the server's address (`http://host:port`); `api_key` goes in the `X-API-Key`
    header. `retry_s` bounds how long a request is retried when the server cannot be reached.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, label: str | None = None,
                 timeout_s: float = 60.0, retry_s: float = 10.0, heartbeat_s: float = 10.0,
                 long_poll_s: float = 20.0, transport: httpx.BaseTransport | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise InvalidInputError(f"must be an http:// or https:// URL, got {base_url!r:.80}", field="base_url")
        if api_key is not None and not isinstance(api_key, str):
            raise InvalidInputError(f"must be a string, got {type(api_key).__name__}", field="api_key")
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        # no I/O here: the session is made by the first call that needs the server (_Link.open).
        # `transport`: httpx's seam (a MockTransport in tests; one that also handles async
        # requests serves the long-polls too)
        self._link = _Link(self.base_url, api_key, timeout_s, retry_s, long_poll_s, transport, label, heartbeat_s)
        self._worker = BackgroundWorker("trio-client-http")  # custom losses: started on first use
        self._finalizer = weakref.finalize(self, _dropped, self._link, self._worker)
        self._model_seq = itertools.count()
        self._sampler_seq = itertools.count()
        self._lanes: dict[str, _Lane] = {}
        self._samplers: dict[str, tuple[ModelHandle, itertools.count]] = {}
        self._attached: set[str] = set()  # samplers another backend made (from_sampler_handle)
        self._tokenizer_ids: dict[str, str | None] = {}
        self._tokenizers: dict[str, Any] = {}
        # what this session made, for the RestClient's questions: run id -> (handle, last submit)
        self._runs: dict[str, tuple[ModelHandle, datetime.datetime]] = {}
        self._sampler_ids: list[str] = []

    def __repr__(self) -> str:
        return f"<HttpBackend {self.base_url} session={self._link.session_id}>"

    @property
    def session_id(self) -> str | None:
        """The server's id of this session (asking for it opens the session)."""
        if not self._link.closed:
            self._link.open()
        return self._link.session_id

    @property
    def closed(self) -> bool:
        return self._link.closed

    # -- clients --------------------------------------------------------------------------
    #: no in-process pool behind this backend (trio_widgets.backend.Backend.pool)
    pool = None

    # -- the seam (trio_widgets.backend.Backend) ------------------------------------------------
    def open(self, request: Open) -> ModelHandle:
        return opened(self, request)

    def call(self, request: Call[T]) -> T:
        return answer(self, request)

    def _on_supported_models(self) -> list[str]:
        body = self._link.call("GET", "/get_server_capabilities")
        return [m["model_name"] for m in body.get("supported_models", []) if isinstance(m, dict)]

    def _on_is_base_model(self, name: Any) -> bool:
        return isinstance(name, str) and not name.startswith("tinker://") and name in self._on_supported_models()

    def _on_is_checkpoint(self, path: Any) -> bool:
        """Over HTTP a checkpoint is named by its tinker:// path."""
        return isinstance(getattr(path, "path", path), str) and str(getattr(path, "path", path)).startswith("tinker://")

    def _wait(self, submitted: dict, what: str, decode: Callable[[Any, bool], Any] = lambda body, _p: body) -> Any:
        item = _Outgoing(what, None, True, PoolFuture())
        self._link.watch(str(submitted["request_id"]), item, decode, None)
        return item.future.result()

    def _training_handle(self, model_id: str) -> ModelHandle:
        info = self._link.call("POST", "/get_info", json={"model_id": model_id, "type": "get_info"})
        extra = info.get("trio") or {}
        base = info["model_data"]["model_name"]
        self._tokenizer_ids.setdefault(base, info["model_data"].get("tokenizer_id"))
        handle = ModelHandle(client_id=model_id, base_model=base, rank=int(info.get("lora_rank") or 0),
                             alpha=float(extra.get("alpha", 0.0)), seed=int(extra.get("seed", 0)),
                             train_attn=bool(extra.get("train_attn", True)),
                             train_mlp=bool(extra.get("train_mlp", True)),
                             train_unembed=bool(extra.get("train_unembed", True)),
                             label=extra.get("label") if isinstance(extra.get("label"), str) else None,
                             run_id=model_id,  # tinker's model_id names its checkpoints: tinker://<model_id>/...
                             arch=info["model_data"].get("arch"))
        self._lanes[model_id] = _Lane(handle)
        self._runs[model_id] = (handle, _utcnow())
        return handle

    def _on_create_model(self, request: CreateModelRequest) -> ModelHandle:
        lora: dict[str, Any] = {"rank": request.rank, "train_mlp": request.train_mlp,
                                "train_attn": request.train_attn, "train_unembed": request.train_unembed}
        if request.seed is not None:
            lora["seed"] = request.seed
        body = {"session_id": self.session_id, "model_seq_id": next(self._model_seq), "base_model": request.base_model,
                "lora_config": lora, "optimizer_config": {"type": "adamw"}, "type": "create_model",
                "user_metadata": _metadata(request.user_metadata, request.label)}
        created = self._wait(self._link.call("POST", "/create_model", json=body), "create_model")
        return self._training_handle(created["model_id"])

    def _on_create_model_from_state(self, request: FromStateRequest) -> ModelHandle:
        path = _tinker_path(request.path)
        body = {"session_id": self.session_id, "model_seq_id": next(self._model_seq), "path": path,
                "optimizer": request.with_optimizer, "type": "load_weights",
                "user_metadata": _metadata(request.user_metadata, request.label)}
        if request.base_model is not None:
            body["base_model"] = request.base_model
        submitted = self._link.call("POST", "/load_weights", json=body, checkpoint=path)
        self._wait(submitted, "load_weights")
        handle = self._training_handle(submitted["model_id"])
        return ModelHandle(**{**handle.__dict__, "model_path": path})

    def _on_create_sampler(self, request: CreateSamplerRequest) -> ModelHandle:
        body: dict[str, Any] = {"session_id": self.session_id, "sampling_session_seq_id": next(self._sampler_seq),
                                "type": "create_sampling_session"}
        if request.model_path is not None:
            body["model_path"] = _tinker_path(request.model_path, "model_path")
        if request.base_model is not None:
            body["base_model"] = request.base_model
        sampler_id = self._link.call("POST", "/create_sampling_session", json=body,
                                     checkpoint=body.get("model_path"))["sampling_session_id"]
        return self._sampler_handle(sampler_id)

    def _sampler_handle(self, sampler_id: str, known: ModelHandle | None = None) -> ModelHandle:
        if known is None:
            info = self._link.call("GET", f"/samplers/{sampler_id}")
            extra = info.get("trio") or {}
            self._tokenizer_ids.setdefault(info["base_model"], extra.get("tokenizer_id"))
            known = ModelHandle(client_id=sampler_id, base_model=info["base_model"], rank=int(extra.get("rank", 0)),
                                alpha=float(extra.get("alpha", 0.0)), seed=int(extra.get("seed", 0)),
                                model_path=info.get("model_path"))
        self._samplers[sampler_id] = (known, itertools.count())
        if sampler_id not in self._sampler_ids:
            self._sampler_ids.append(sampler_id)
            del self._sampler_ids[:-4096]  # bounded, like everything a long session keeps
        return known

    def _on_sampler_handle(self, client_id: str) -> str:
        if client_id not in self._samplers:
            raise ClientClosedError(f"sampler {client_id} is closed")
        fields = {"trio_sampler": 1, "base_url": self.base_url, "sampler_id": client_id}  # no key: the caller's own
        return base64.urlsafe_b64encode(json.dumps(fields, separators=(",", ":")).encode()).decode("ascii")

    def _on_attach_sampler(self, request: AttachSampler) -> ModelHandle:
        sampler_id = request.sampler_id
        handle = self._sampler_handle(sampler_id)  # 404 unless this key may use it
        self._attached.add(sampler_id)
        return handle

    def release(self, client_id: str, *, dropped: bool = False) -> None:
        self._lanes.pop(client_id, None)
        self._samplers.pop(client_id, None)
        if client_id in self._attached:  # another's sampler: its maker releases it
            self._attached.discard(client_id)
            return
        if dropped:  # a finalizer: maybe inside httpcore's pool lock on this thread (a request here would hang)
            self._link.release_later(client_id)
        elif not self._link.closed:
            try:
                self._link.call("POST", "/trio/release", json={"id": client_id}, retry=False)
            except (APIConnectionError, APIStatusError, PoolClosedError, ClientClosedError):
                pass  # the server or the session is gone: nothing is held for it there

    def _on_tokenizer(self, base_model: str) -> Any:
        with _TOKENIZER_LOCK:  # once per model, even when a sampler's threads ask together
            return self._tokenizer(base_model)

    def _tokenizer(self, base_model: str) -> Any:
        if base_model not in self._tokenizers:
            from ..protocol import DEFAULT_MODEL
            from ..tokenizers import byte_tokenizer, load_tokenizer

            where = self._tokenizer_ids.get(base_model)
            if base_model == DEFAULT_MODEL:  # the built-in model's byte tokenizer
                self._tokenizers[base_model] = byte_tokenizer()
            elif where is not None:
                import os

                if os.path.isdir(where):
                    self._tokenizers[base_model] = load_tokenizer(where)
                else:
                    from transformers import AutoTokenizer

                    self._tokenizers[base_model] = AutoTokenizer.from_pretrained(where)
            else:
                return None
        return self._tokenizers[base_model]

    # -- requests ------------------------------------------------------------------------
    def submit(self, client_id: str, op: str, request: Any) -> APIFuture:
        if client_id in self._samplers:
            return self._sample(client_id, op, request)
        lane = self._lanes.get(client_id)
        if lane is None:
            raise ClientClosedError(f"client {client_id} is closed: create a new client to submit {op}")
        if client_id in self._runs:
            self._runs[client_id] = (self._runs[client_id][0], _utcnow())
        item = _Outgoing(op, request, True, PoolFuture(), _Cycle(client_id))
        item.future._ask = lambda: self._cancel(lane, item)
        with lane.lock:
            if lane.outbox:  # behind a reservation: sent in order once it is filled
                lane.outbox.append(item)
            else:
                self._send(lane, item)
        return self._api_future(item)

    def reserve(self, client_id: str, op: str) -> _HttpSlot:
        lane = self._lanes.get(client_id)
        if lane is None:
            raise ClientClosedError(f"client {client_id} is closed: create a new client to submit {op}")
        item = _Outgoing(op, None, False, PoolFuture(), _Cycle(client_id))
        item.future._ask = lambda: self._cancel(lane, item)
        with lane.lock:
            lane.outbox.append(item)
        return _HttpSlot(self, lane, item)

    def _api_future(self, item: _Outgoing) -> APIFuture:
        number = _request_number(item.request_id) if item.request_id else None
        return APIFuture(item.future, request_id=number, op=item.op, scheduled=item.scheduled)

    def _flush(self, lane: _Lane) -> None:
        """Send what a filled (or failed) reservation held back, in order (lane.lock held)."""
        while lane.outbox and lane.outbox[0].ready:
            item = lane.outbox.popleft()
            try:
                self._send(lane, item)
            except Exception as exc:  # noqa: BLE001 - refused later than submit: the future says so
                _settle(item.future, exc=exc)

    def _cancel(self, lane: _Lane, item: _Outgoing) -> bool:
        with lane.lock:
            if item in lane.outbox:
                lane.outbox.remove(item)
                self._flush(lane)
                return True
        if item.request_id is None:
            return False
        try:
            return bool(self._link.call("POST", "/cancel_future", json={"request_id": item.request_id},
                                        retry=False).get("cancelled"))
        except (APIConnectionError, APIStatusError, PoolClosedError, ClientClosedError):
            return False

    def _send(self, lane: _Lane, item: _Outgoing) -> None:
        """POST one request of `lane` with the next seq_id (lane.lock held) and start polling it."""
        model_id, op, request = lane.handle.client_id, item.op, item.request
        seq = lane.next_seq
        decode: Callable[[Any, bool], Any]
        checkpoint = None
        if isinstance(request, ForwardRequest) and op in ("forward", "forward_backward", "forward_backward_custom"):
            for i, datum in enumerate(request.data):
                check_text_only(datum.model_input, lane.handle.base_model, f"data[{i}].model_input", i)
            config: dict[str, Any] = dict(request.loss_fn_config or {})
            if op == "forward_backward_custom":
                config["trio_op"] = op  # the server shows it as the second half of a custom loss
            body = wire.encode_forward_request(model_id, seq, request.data, request.loss_fn, config,
                                               forward_only=op == "forward")
            lane.next_seq += 1
            submitted = self._link.call("POST", "/forward_backward", content=body,
                                        headers={"Content-Type": wire.PROTOBUF})
            count = _tokens_read(request)
            decode = lambda payload, protobuf: _with_pytrio_metrics(_decode_forward(payload, protobuf), count)
        else:
            path, json_body, decode = self._json_request(lane, op, request, seq)
            checkpoint = json_body.get("path") if op.startswith("load_state") else None
            lane.next_seq += 1
            submitted = self._link.call("POST", path, json=json_body, checkpoint=checkpoint)
        item.request_id = str(submitted["request_id"])
        self._link.watch(item.request_id, item, decode, model_id)

    def _json_request(self, lane: _Lane, op: str, request: Any, seq: int
                      ) -> tuple[str, dict[str, Any], Callable[[Any, bool], Any]]:
        model_id = lane.handle.client_id
        if op == "optim_step" and isinstance(request, OptimStepRequest):
            return ("/optim_step", {"model_id": model_id, "seq_id": seq, "type": "optim_step",
                                    "adam_params": wire.adam_to_json(request.adam_params)},
                    lambda body, _p: OptimStepResponse(metrics=dict(body.get("metrics") or {})))
        if op == "save_state" and isinstance(request, SaveRequest):
            return ("/save_weights", {"model_id": model_id, "path": request.name, "seq_id": seq,
                                      "overwrite": request.overwrite, "ttl_seconds": request.ttl_seconds,
                                      "user_metadata": request.user_metadata, "type": "save_weights"},
                    lambda body, _p: SaveWeightsResponse(path=body["path"], model=str(body.get("model") or ""),
                                                         size=int(body.get("size") or 0)))
        if op == "save_weights_for_sampler" and isinstance(request, SaveRequest) and request.external:
            external: dict[str, Any] = {"model_id": model_id, "path": request.name, "seq_id": seq,
                                        "ttl_seconds": request.ttl_seconds, "type": "save_weights_external"}
            if request.age_recipients is not None:
                external["age_encryption_recipients"] = list(request.age_recipients)
            return ("/save_weights_external", external,
                    lambda body, _p: SaveWeightsForSamplerResponse(path=body["path"]))
        if op == "save_weights_for_sampler" and isinstance(request, SaveRequest):
            out: dict[str, Any] = {"model_id": model_id, "seq_id": seq, "kind": "snapshot",
                                   "ttl_seconds": request.ttl_seconds, "user_metadata": request.user_metadata,
                                   "type": "save_weights_for_sampler"}
            if request.name is not None:
                out["path"] = request.name
            if not request.make_sampler:
                return "/save_weights_for_sampler", out, \
                    lambda body, _p: SaveWeightsForSamplerResponse(path=body.get("path"),
                                                                   model=str(body.get("model") or ""),
                                                                   size=int(body.get("size") or 0))
            out["sampling_session_seq_id"] = next(self._sampler_seq)
            h = lane.handle

            def made(body: Any, _p: bool) -> SamplerCreated:
                sampler = ModelHandle(client_id=body["sampling_session_id"], base_model=h.base_model, rank=h.rank,
                                      alpha=h.alpha, seed=h.seed, model_path=body.get("path"))
                self._sampler_handle(sampler.client_id, sampler)
                return SamplerCreated(sampler=sampler, path=body.get("path"))

            return "/save_weights_for_sampler", out, made
        if op in ("load_state", "load_state_with_optimizer") and isinstance(request, LoadRequest):
            path = _tinker_path(request.path)
            return ("/load_weights", {"model_id": model_id, "seq_id": seq, "path": path,
                                      "optimizer": op == "load_state_with_optimizer", "type": "load_weights"},
                    lambda body, _p: LoadWeightsResponse(path=body.get("path") or path, model_id=body.get("model_id")))
        if op == "inspect_adapter":
            raise InvalidInputError("inspect_adapter reads the adapter in the server's memory and is not offered "
                                    "over HTTP; save_state and read the checkpoint instead", field="op")
        raise InvalidInputError(f"op {op!r} with a {type(request).__name__} is not one this backend sends",
                                field="op")

    def _sample(self, sampler_id: str, op: str, request: Any) -> APIFuture:
        handle, seqs = self._samplers[sampler_id]
        if op == "compute_logprobs" and isinstance(request, ComputeLogprobsRequest):
            prompt, num, params, logprobs = request.prompt, 1, SamplingParams(max_tokens=1), True
            last_n = request.prompt_logprobs_last_n
        elif op == "sample" and isinstance(request, SampleRequest):
            prompt, num, logprobs = request.prompt, request.num_samples, request.include_prompt_logprobs
            params = request.sampling_params or SamplingParams()
            last_n = request.prompt_logprobs_last_n
        else:
            raise InvalidInputError(f"op {op!r} is not a sampling op", field="op")
        if not hasattr(prompt, "to_ints"):
            raise InvalidInputError(f"expected a ModelInput, got {type(prompt).__name__}", field="prompt")
        check_text_only(prompt, handle.base_model, "prompt")
        # session_id: the server deduplicates seq_ids per session (two processes may share a sampler)
        body = {"sampling_session_id": sampler_id, "session_id": self.session_id, "seq_id": next(seqs),
                "num_samples": num, "prompt": wire.model_input_to_json(prompt),
                "sampling_params": wire.sampling_params_to_json(params), "prompt_logprobs": logprobs, "type": "sample"}
        if last_n is not None:  # a trio field (the engine checks it, as in-process)
            body["prompt_logprobs_last_n"] = last_n
        if isinstance(request, SampleRequest):  # tinker's options, in its fields (the engine checks them)
            for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
                if getattr(request, key):
                    body[key] = getattr(request, key)
            if request.target_prompt_logprobs is not None:
                target = request.target_prompt_logprobs
                body["target_prompt_logprobs"] = wire.tensor_to_json(target) if isinstance(target, TensorData) \
                    else target
        submitted = self._link.call("POST", "/asample", json=body)
        ids = list(submitted.get("sample_sequence_ids") or [])
        item = _Outgoing(op, request, True, PoolFuture(), _Cycle(sampler_id))
        item.request_id = str(submitted["request_id"])
        item.future._ask = lambda: self._cancel_sent(item)

        def decode(payload: Any, protobuf: bool) -> Any:
            response = wire.decode_sample_response(payload, ids)
            return response.prompt_logprobs if op == "compute_logprobs" else response

        self._link.watch(item.request_id, item, decode, sampler_id)
        return self._api_future(item)

    def _cancel_sent(self, item: _Outgoing) -> bool:
        try:
            return bool(self._link.call("POST", "/cancel_future", json={"request_id": item.request_id},
                                        retry=False).get("cancelled"))
        except (APIConnectionError, APIStatusError, PoolClosedError, ClientClosedError):
            return False

    def run_in_background(self, work: Callable[[], None]) -> None:
        self._worker.submit(work)

    # -- what the RestClient asks (trio_widgets/rest.py): this session's runs and samplers -------
    def _on_capabilities(self) -> GetServerCapabilitiesResponse:
        body = self._link.call("GET", "/get_server_capabilities")
        def ops(value: Any) -> ModelOperationCapabilities | None:
            if not isinstance(value, dict):
                return None
            return ModelOperationCapabilities(bool(value.get("available")), value.get("max_batch_size"),
                                              value.get("max_tokens_per_request"), value.get("max_seq_len"))

        return GetServerCapabilitiesResponse([
            SupportedModel(str(m["model_name"]), max_context_length=m.get("max_context_length"),
                           trainable=m.get("trainable"), sampleable=m.get("sampleable"),
                           training=ops(m.get("training")), sampling=ops(m.get("sampling")))
            for m in body.get("supported_models", []) if isinstance(m, dict) and "model_name" in m])

    def _on_checkpoints(self, run_id: str | None = None) -> list[Checkpoint]:
        """The checkpoints of one of this API key's runs (the server keeps each key's apart), or of
        all of them, answered by the served pool's catalog (metadata, size, expiry)."""
        if run_id is None:
            body = self._link.call("GET", "/checkpoints?limit=10000")
            return sorted((_checkpoint(c) for c in body.get("checkpoints", [])), key=lambda c: (c.time, c.tinker_path))
        return self._run_checkpoints(run_id)

    def _run_checkpoints(self, run_id: str) -> list[Checkpoint]:
        _check_run_id(run_id)
        body = self._link.call("GET", f"/training_runs/{run_id}/checkpoints")
        return [_checkpoint(c) for c in body.get("checkpoints", [])]

    def _on_delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        _check_run_id(run_id)
        self._link.call("DELETE", f"/training_runs/{run_id}/checkpoints/{_checkpoint_id(checkpoint_id)}",
                        retry=False)

    def _on_set_checkpoint_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        _check_run_id(run_id)
        self._link.call("PUT", f"/training_runs/{run_id}/checkpoints/{_checkpoint_id(checkpoint_id)}/ttl",
                        json={"ttl_seconds": ttl_seconds})

    def _on_weights_info(self, path: Any) -> WeightsInfoResponse:
        body = self._link.call("POST", "/weights_info", json={"tinker_path": _tinker_path(path)})
        optimizer = body.get("optimizer_config")
        return WeightsInfoResponse(base_model=str(body["base_model"]), is_lora=bool(body.get("is_lora", True)),
                                   optimizer_config=AdamOptimizerConfig(**optimizer) if isinstance(optimizer, dict)
                                   else AdamOptimizerConfig(),
                                   lora_rank=body.get("lora_rank"), train_unembed=body.get("train_unembed"),
                                   train_mlp=body.get("train_mlp"), train_attn=body.get("train_attn"))

    def _on_export_urls(self, path: Any) -> ExportUrls:
        """The server's signed URLs of one of this key's checkpoints (no key in them)."""
        body = self._link.call("POST", "/trio/export_urls", json={"tinker_path": _tinker_path(path, "tinker_path")},
                               checkpoint=str(path))
        expires = _when(body.get("expires"))
        assert expires is not None
        return ExportUrls(str(body["archive_url"]), {str(k): str(v) for k, v in dict(body["urls"]).items()}, expires)

    def _on_download_checkpoint(self, path: Any, destination: Path, max_bytes: int) -> dict[str, int]:
        """The archive at the signed URL, streamed into `destination` (bounded: extract_tar)."""
        url = self._on_export_urls(path).archive_url
        deadline = time.monotonic() + _DOWNLOAD_S
        # the signed URL is the credential: the key is not sent with it
        with httpx.Client(timeout=self._link.timeout, transport=self._link.transport) as http, \
                http.stream("GET", url) as response:
            if response.status_code != 200:
                response.read()
                raise _error(response, path=str(path))

            def chunks() -> Iterator[bytes]:
                for chunk in response.iter_raw(1 << 20):
                    if time.monotonic() > deadline:
                        raise APIConnectionError(f"the download of {path!r:.200} took more than {_DOWNLOAD_S:g} s")
                    yield chunk

            return extract_tar(chunks(), destination, max_bytes=max_bytes)

    def _on_training_runs(self) -> list[TrainingRun]:
        """This API key's runs (every session of it), most recent first."""
        body = self._link.call("GET", "/training_runs?limit=10000")
        return [_training_run(r) for r in body.get("training_runs", [])]

    def _on_training_run(self, run_id: str) -> TrainingRun:
        _check_run_id(run_id)
        return _training_run(self._link.call("GET", f"/training_runs/{run_id}"))

    def _on_sampler(self, sampler_id: str) -> GetSamplerResponse:
        if not isinstance(sampler_id, str) or not sampler_id or "/" in sampler_id:
            raise InvalidInputError(f"must be a sampler id, got {sampler_id!r:.80}", field="sampler_id")
        info = self._link.call("GET", f"/samplers/{sampler_id}")
        return GetSamplerResponse(sampler_id=sampler_id, base_model=info["base_model"],
                                  model_path=info.get("model_path"))

    def _on_sessions(self) -> list[str]:
        return [self.session_id] if self.session_id else []

    def _on_session(self, session_id: str) -> GetSessionResponse:
        if session_id != self.session_id:
            raise NotFoundError(f"no session {session_id!r:.80} here: over HTTP a client sees only its own "
                                f"session ({self.session_id})")
        return GetSessionResponse(training_run_ids=list(self._runs), sampler_ids=list(self._sampler_ids))

    def close(self) -> None:
        """Wait (at most _DRAIN_S) for the results of what was sent, as in-process, where work a
        closed client queued still runs and its futures get their results; then finish the session
        on the server, fail what is still pending, stop the poller and the heartbeat threads (and a
        custom loss's thread). The served pool goes on for its other clients."""
        link = self._link
        if not link.closed and not link.delivering():  # (on the poller, a wait would wait for itself)
            concurrent.futures.wait([item.future for item, _d, _o in list(link.pending.values())], timeout=_DRAIN_S)
        if self._finalizer.detach() is not None:  # (closed once; a dropped backend's close is _dropped's)
            _close(link, self._worker)

    def __enter__(self) -> HttpBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HttpSlot:
    """A reserved place in a model's client-side queue (see trio_widgets.backend.Reservation)."""

    def __init__(self, backend: HttpBackend, lane: _Lane, item: _Outgoing):
        self._backend = backend
        self._lane = lane
        self._item = item
        self.future = backend._api_future(item)

    def fill(self, request: ForwardRequest) -> None:
        with self._lane.lock:
            if self._item not in self._lane.outbox:
                return  # cancelled meanwhile
            self._item.request = request
            self._item.ready = True
            self._backend._flush(self._lane)

    def fail(self, error: BaseException) -> None:
        with self._lane.lock:
            if isinstance(error, RequestFailedError) and error.cycle is not None:
                self._item.scheduled.cycle = error.cycle  # the cycle its forward ran in, as in-process
            if self._item in self._lane.outbox:
                self._lane.outbox.remove(self._item)
            _settle(self._item.future, exc=error)
            self._backend._flush(self._lane)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _metadata(user_metadata: dict[str, str] | None, label: str | None) -> dict[str, str]:
    """A model's user_metadata on the wire; its `name` labels its lane (the label wins)."""
    out = dict(user_metadata or {})
    if label:
        out["name"] = label
    return out


def _not_offered(what: str) -> InvalidInputError:
    return InvalidInputError(f"{what} is not offered over HTTP by a served trio pool (the server keeps each API "
                             f"key's checkpoints; an in-process RestClient on the server's machine can)", field="op")


def _tokens_read(request: ForwardRequest) -> int:
    """pytrio's token_count of a forward, from the data sent (the wire carries only `loss:sum`)."""
    total = 0
    for datum in request.data:
        inputs = datum.loss_fn_inputs
        targets = [int(t) for t in TensorData.from_any(inputs["target_tokens"]).data] \
            if "target_tokens" in inputs else []
        weights = inputs.get("weights")
        total += tokens_read(request.loss_fn, len(targets),
                             [float(w) for w in TensorData.from_any(weights).data] if weights is not None else None,
                             targets)  # a -100 target is never read, as in-process
    return total


def _with_pytrio_metrics(out: Any, token_count: int) -> Any:
    loss_sum = out.metrics.get("loss:sum")
    if loss_sum is not None:
        out.metrics = {**forward_metrics(float(loss_sum), token_count), **out.metrics}
    return out


def _check_run_id(run_id: Any) -> None:
    if not isinstance(run_id, str) or not run_id or "/" in run_id or "?" in run_id:
        raise InvalidInputError(f"must be a training run id, got {run_id!r:.80}", field="training_run_id")


def _checkpoint_id(checkpoint_id: Any) -> str:
    segment, name = parse_checkpoint_id(checkpoint_id)
    return f"{segment}/{quote(name, safe='')}"  # a name is one path segment of the URL


def _when(text: Any) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None


def _checkpoint(c: dict) -> Checkpoint:
    """A checkpoint of the served catalog (named by its tinker:// path: the server's directories
    are not the client's)."""
    when = _when(c["time"])
    assert when is not None
    return Checkpoint(checkpoint_id=c["checkpoint_id"], checkpoint_type=c["checkpoint_type"], time=when,
                      tinker_path=c["tinker_path"], path=c["tinker_path"], size_bytes=c.get("size_bytes"),
                      public=bool(c.get("public", False)), user_metadata=c.get("user_metadata"),
                      expires_at=_when(c.get("expires_at")))


def _training_run(r: dict) -> TrainingRun:
    when = _when(r["last_request_time"])
    assert when is not None
    return TrainingRun(training_run_id=r["training_run_id"], base_model=r["base_model"], model_owner=r["model_owner"],
                       is_lora=bool(r.get("is_lora", True)), last_request_time=when,
                       corrupted=bool(r.get("corrupted", False)), lora_rank=r.get("lora_rank"),
                       last_checkpoint=_checkpoint(r["last_checkpoint"]) if r.get("last_checkpoint") else None,
                       last_sampler_checkpoint=(_checkpoint(r["last_sampler_checkpoint"])
                                                if r.get("last_sampler_checkpoint") else None),
                       user_metadata=r.get("user_metadata"))


def _decode_forward(payload: Any, protobuf: bool) -> Any:
    if not protobuf:
        raise InvalidInputError("the server answered a forward_backward with JSON, not protobuf", field="body")
    return wire.decode_forward_output(payload)


def _tinker_path(path: Any, field_name: str = "path") -> str:
    path = getattr(path, "path", path)  # a SaveWeightsResponse and friends
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise InvalidInputError(f"over HTTP a checkpoint is named by the tinker:// path that save_state / "
                                f"save_weights_for_sampler returned, got {path!r:.200}", field=field_name)
    parse_tinker_path(path, field_name)
    return path
