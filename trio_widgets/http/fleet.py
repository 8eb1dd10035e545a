"""Many served pools behind one URL: the fleet's ingress.

Each pool of a fleet is a plain served pool (trio_widgets/http/server.py) whose ids carry its
tag, ``p<index>r<epoch>``: sessions ``sess-p1r3fa9c1-…`` (hence their models
``…:train:N``, samplers ``…:sample:N`` and checkpoint paths ``tinker://sess-p1r…/…``) and
requests ``req-p1r3fa9c1-N``. The epoch is new each time a pool's process starts. So the
ingress routes every request by the id it names, with no table to lose:

* ``create_session`` is placed on the live pool with the most headroom (fewest live sessions,
  then clients, then tokens per cycle), one placement at a time; everything of that session
  then goes to that pool (the id in the path, or in the body: session_id, model_id,
  sampling_session_id, request_id, then a tinker:// path; forward_backward's protobuf body
  names its model).
* A request naming a pool that died, or whose process restarted since (another epoch), is
  answered at once, naming the pool: a future fails (category ``server``, code
  ``pool_failed``), anything else is a 410. Checkpoints live in one shared directory, so a
  new session (on a live pool) resumes from them.
* Capabilities are the union of the pools' models (a session's models must be its pool's: the
  refusal names the pools that serve one); the REST listing of runs (``training_runs``)
  merges every pool's (off the event loop), a key's ``checkpoints`` (one shared directory) are
  listed by one pool in turn; ``/api/v1/trio/info`` sums them; ``/api/v1/trio/fleet``
  lists the pools; ``/trio/pools/<k>/…`` is pool k itself (a dashboard of one pool:
  ``trio.Dashboard(url + "/trio/pools/1")``). URLs a pool signs (exports) are rewritten to
  that prefix.

The pools authenticate every request (the ingress forwards the caller's key and keeps none).
Ray Serve runs the pools (trio_widgets/http/ray_fleet.py); `Members` is all the ingress needs
of them.

**The front door** (`FrontDoor`) serves the ingress as `serve` serves a pool, with the same
guards (trio_widgets/http/guard.py): Host / Origin / Content-Type checks, header and idle
timeouts, connections bounded per address, per key and in all, new connections per address
paced, and request bodies bounded per connection (max_body_bytes), per key and in all while
they are read (`Budget`), and in time (body_timeout_s).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import ClientClosedError, PoolClosedError
from . import wire
from .auth import HttpError, owner_of, wire_of
from .guard import Budget, Connections, Policy, guarded_protocol, policy_app
from .routes import API, error_response

__all__ = ["FrontDoor", "Ingress", "Members", "PoolState", "pool_tag"]

log = logging.getLogger(__name__)

TAG = r"p(?P<index>\d{1,4})r(?P<epoch>[0-9a-f]{6})"
_ID = re.compile(rf"(?:sess|req)-{TAG}-")
_EXPLICIT = re.compile(r"^/trio/pools/(?P<index>\d{1,4})(?P<rest>/.*)$")
#: Body fields that name what a request is about, most specific first: a from-state load names
#: its (new) session and the checkpoint it reads from another pool; the session decides.
# PyTRIO's control plane and actor (trio_widgets/http/pytrio_wire.py): routed by the ids in their paths
_PYTRIO = ("/api/openapi/", "/api/pytrio/", "/api/models", "/api/sdk/")
_PYTRIO_SESSIONS = "/api/openapi/v1/service-sessions"
# the listings merged from every pool: their key, an item's id, the sort, the cursor's total
_LISTINGS = {
    "/training_runs": ("training_runs", "training_run_id", ("last_request_time", "training_run_id"), "total_count"),
    "/api/openapi/v1/training-runs": ("training_runs", "training_run_cuid", ("updated_at", "training_run_cuid"),
                                      "total"),
    _PYTRIO_SESSIONS: ("service_sessions", "service_session_cuid", ("created_at", "service_session_cuid"), "total"),
}
# a key's checkpoints: every pool lists the same ones, from the one shared directory, so one pool
# (in turn) answers, not each (2 x the work, merged here, for a listing of thousands)
_ON_SHARED_DISK = frozenset({"/checkpoints", "/api/openapi/v1/checkpoints"})
_ROUTING_FIELDS = ("session_id", "model_id", "sampling_session_id", "request_id", "tinker_path", "path",
                   "model_path")
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-connection", "accept-encoding"}
STATE_TTL_S = 2.0  # a pool's state is asked again after this long (placement reads fresh load)


def pool_tag(index: int, epoch: str) -> str:
    """The id tag of pool `index` in the process started as `epoch` (6 hex digits)."""
    return f"p{index}r{epoch}"


@dataclass(frozen=True)
class PoolState:
    """What a pool says of itself (its replica answers; see ray_fleet.PoolReplica.describe)."""

    index: int
    epoch: str
    url: str  # where its server listens (inside the cluster)
    models: tuple[str, ...]
    pid: int
    node: str
    device: str
    sessions: int  # live sessions
    clients: int  # live training and sampling clients
    tokens_per_cycle: float  # recent mean
    total_updates: int
    frozen_objects: int = 0  # its startup heap, out of the cyclic collector's passes (server.freeze_heap)

    @property
    def name(self) -> str:
        return f"pool-{self.index}"


class Members:
    """The ingress's view of its pools: `state(k)` is pool k's PoolState, or None when it
    cannot answer now (dead, restarting). Subclasses ask them (Ray handles, in-process)."""

    size: int = 0

    async def ask(self, index: int) -> PoolState | None:
        raise NotImplementedError


class Ingress:
    """The ASGI-level logic of the fleet's one URL: `await ingress(request)` answers a starlette
    Request (Ray Serve calls it; so can a Starlette route)."""

    def __init__(self, members: Members, *, max_body_bytes: int = 16 << 20, body_timeout_s: float = 30.0,
                 read_timeout_s: float = 120.0, budget: Budget | None = None):
        self.members = members
        self.max_body_bytes = int(max_body_bytes)
        self.body_timeout_s = float(body_timeout_s)
        # bytes of bodies being read, per key and in all (the front door's; unbounded without one)
        self.budget = budget or Budget(per_key=1 << 62, total=1 << 62)
        # a long-poll is held up to the pools' long_poll_s (<= 40 s): the read timeout outlasts it
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=5.0),
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._states: dict[int, tuple[float, PoolState | None]] = {}
        self._asking: dict[int, asyncio.Future[PoolState | None]] = {}  # a pool's state being asked
        self._placing = asyncio.Lock()
        self.placements = [0] * members.size  # sessions placed on each pool since start (for tests, logs)
        self._turn = 0  # which live pool answers the next listing any pool answers alike

    async def aclose(self) -> None:
        for task in self._asking.values():
            task.cancel()
        await asyncio.gather(*self._asking.values(), return_exceptions=True)
        self._asking.clear()
        await self._http.aclose()

    # -- the pools' states ------------------------------------------------------------------
    async def state(self, index: int, *, fresh: bool = False) -> PoolState | None:
        """Pool `index`'s state: a live pool's last answer at once, asked again behind the request once
        it is STATE_TTL_S old (a Ray round trip, 100-200 ms on a busy machine: every request that found
        the state stale waited for it, and a neighbour's heartbeat every 2 s took 120-220 ms, issue 36);
        awaited when `fresh`, never asked, or last found dead. One ask per pool at a time."""
        if not 0 <= index < self.members.size:
            return None
        cached = self._states.get(index)
        if cached is not None and not fresh:
            at, found = cached
            if time.monotonic() - at < STATE_TTL_S:
                return found
            if found is not None:
                self._asking_of(index)
                return found
        return await asyncio.shield(self._asking_of(index))  # (a caller that goes away leaves the ask)

    def _asking_of(self, index: int) -> asyncio.Future[PoolState | None]:
        task = self._asking.get(index)
        if task is None or task.done():
            task = self._asking[index] = asyncio.ensure_future(self._ask(index))
        return task

    async def _ask(self, index: int) -> PoolState | None:
        try:
            found = await asyncio.wait_for(self.members.ask(index), 10.0)
        except Exception:  # (asyncio.TimeoutError included) dead, restarting, unreachable
            found = None
        self._states[index] = (time.monotonic(), found)
        return found

    async def states(self, *, fresh: bool = False) -> list[PoolState]:
        found = await asyncio.gather(*(self.state(k, fresh=fresh) for k in range(self.members.size)))
        return [s for s in found if s is not None]

    # -- answering -------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path = request.scope.get("path", request.url.path)
        try:
            explicit = _EXPLICIT.match(path)
            if explicit is not None:
                return await self._explicit(request, int(explicit["index"]), explicit["rest"])
            if not path.startswith((API + "/", *_PYTRIO)):
                return _refusal(404, f"no such endpoint: {request.method} {path}")
            op = path[len(API):] if path.startswith(API + "/") else path  # PyTRIO's: the whole path
            if op == "/trio/fleet" and request.method == "GET":
                return await self._fleet(request)
            body = await self._body(request)
            if op == "/create_session" or (op == _PYTRIO_SESSIONS and request.method == "POST"):
                return await self._place(request, body)
            if op == "/get_server_capabilities":
                return await self._capabilities(request)
            if op in _ON_SHARED_DISK and request.method == "GET":
                return await self._one_of(request, op, body)
            if op in _LISTINGS and request.method == "GET":
                return await self._merged(request, op)
            if op == "/trio/info":
                return await self._info(request)
            tag = _tag_of(op, body, request.headers.get("content-type", ""))
            if tag is None:
                return await self._anywhere(request, op, body)
            index, epoch = tag
            if index >= self.members.size:  # an id no pool of this fleet made
                return _refusal(404, f"{_subject(op)} names pool-{index}, and this fleet has pools 0 to "
                                     f"{self.members.size - 1}: not found")
            state = await self.state(index)
            if state is not None and state.epoch != epoch:
                state = await self.state(index, fresh=True)  # restarted since it was last asked?
            if state is None or state.epoch != epoch:
                return _lost(op, index, restarted=state is not None)
            return await self._forward(request, state, body, op=op, epoch=epoch)
        except _Refused as refused:
            return refused.response

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise _Refused(_refusal(413, f"the body has {length} bytes, more than this server's limit of "
                                         f"{self.max_body_bytes} (max_body_bytes); send smaller batches"))
        chunks, size = [], 0
        stream = request.stream()
        key = request.headers.get("x-api-key")
        with self.budget.reading(owner_of(key) if key else "anonymous") as take:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), self.body_timeout_s)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise _Refused(_refusal(408, f"the body stalled: nothing arrived for {self.body_timeout_s:g} s "
                                                 f"(body_timeout_s)", code="timeout", close=True)) from None
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise _Refused(_refusal(413, f"the body is more than this server's limit of "
                                                 f"{self.max_body_bytes} bytes (max_body_bytes)", close=True))
                try:
                    take(len(chunk))
                except HttpError as exc:  # over the key's share (429) or the door's (503), naming it
                    raise _Refused(_refusal(exc.status, str(exc), code=exc.code or "busy", close=True)) from None
                chunks.append(chunk)
        return b"".join(chunks)

    async def _send(self, request: Request, state: PoolState, path: str, body: bytes,
                    query: str | None = None, stream: bool = False) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = state.url + path + (f"?{query}" if query else "")
        built = self._http.build_request(request.method, url, headers=headers, content=body)
        return await self._http.send(built, stream=stream)

    async def _forward(self, request: Request, state: PoolState, body: bytes, *, op: str,
                       epoch: str | None = None) -> Response:
        """`request` answered by pool `state` (the same path under its URL); a pool that fails under
        it is said lost (and asked again next time)."""
        raw = request.scope.get("raw_path") or request.url.path.encode()
        try:
            answer = await self._send(request, state, raw.decode("latin-1"), body, request.url.query)
        except httpx.TransportError:
            self._states.pop(state.index, None)
            if epoch is None:
                return _refusal(503, f"{state.name} of this fleet did not answer (its replica may be restarting); "
                                     f"try again", code="pool_closed")
            return _lost(op, state.index, restarted=False)
        return _relay(answer, state, str(request.base_url))

    async def _explicit(self, request: Request, index: int, rest: str) -> Response:
        if index >= self.members.size:
            return _refusal(404, f"this fleet has pools 0 to {self.members.size - 1}, not pool-{index}")
        state = await self.state(index)
        if state is None:
            return _refusal(503, f"pool-{index} of this fleet is not answering now (dead or restarting)",
                            code="pool_closed")
        if rest == API + "/trio/telemetry":  # a stream, relayed as it comes
            try:
                answer = await self._send(request, state, rest, b"", request.url.query, stream=True)
            except httpx.TransportError:
                return _refusal(503, f"{state.name} of this fleet did not answer", code="pool_closed")
            if answer.status_code != 200:
                await answer.aread()
                return _relay(answer, state, str(request.base_url))

            async def relay() -> Any:
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                except httpx.TransportError:
                    return
                finally:
                    await answer.aclose()

            return StreamingResponse(relay(), media_type=answer.headers.get("content-type"))
        body = await self._body(request)
        try:
            answer = await self._send(request, state, rest, body, request.url.query)
        except httpx.TransportError:
            self._states.pop(index, None)
            return _refusal(503, f"{state.name} of this fleet did not answer", code="pool_closed")
        return _relay(answer, state, str(request.base_url))

    async def _place(self, request: Request, body: bytes) -> Response:
        # One placement at a time: the next one sees this session in its pool's count.
        async with self._placing:
            live = await self.states(fresh=True)
            if not live:
                return _no_pool()
            best = min(live, key=lambda s: (s.sessions, s.clients, s.tokens_per_cycle, s.index))
            answer = await self._forward(request, best, body, op="/create_session")
            if answer.status_code == 200:
                self.placements[best.index] += 1
                self._states[best.index] = (float("-inf"), best)  # stale: asked again behind the next request
            return answer

    async def _capabilities(self, request: Request) -> Response:
        answers = await self._each(request, API + "/get_server_capabilities")
        models: dict[str, Any] = {}
        for _, answer in answers:
            if answer.status_code != 200:
                return _relay(answer, None, "")
            for model in answer.json().get("supported_models", []):
                models.setdefault(model.get("model_name"), model)
        return JSONResponse({"supported_models": list(models.values())})

    async def _one_of(self, request: Request, op: str, body: bytes, states: list[PoolState] | None = None
                      ) -> Response:
        """A request any of `states` (default: the live pools) answers alike: the next one's, in turn."""
        live = await self.states() if states is None else states
        if not live:
            return _no_pool()
        self._turn += 1
        return await self._forward(request, live[self._turn % len(live)], body, op=op)

    async def _merged(self, request: Request, op: str) -> Response:
        """A REST listing of every pool's (a run lives on one pool; one another pool lists too is
        taken from its own), newest first, then paged here."""
        try:
            limit = int(request.query_params.get("limit", "100"))
            offset = int(request.query_params.get("offset", "0"))
        except ValueError:
            limit = offset = -1
        if not (0 <= limit <= 10_000 and 0 <= offset <= 10_000):
            return _refusal(400, "limit and offset must be integers from 0 to 10000", code="invalid_input")
        answers = await self._each(request, op if op.startswith("/api/") else API + op,
                                   query=f"limit={min(10_000, offset + limit)}&offset=0")
        for state, answer in answers:
            if answer.status_code != 200:
                return _relay(answer, state, str(request.base_url))
        # parse, merge, sort and encode in a worker thread: 2 x 1,000 items take ~10 ms, which on the
        # loop would hold up every other caller's request (a neighbour's heartbeat) meanwhile
        body = await asyncio.to_thread(_merge, op, [(s.index, a.content) for s, a in answers], offset, limit)
        return Response(body, media_type="application/json")

    async def _info(self, request: Request) -> Response:
        answers = await self._each(request, API + "/trio/info")
        infos = []
        for state, answer in answers:
            if answer.status_code != 200:
                return _relay(answer, state, "")
            infos.append(answer.json())
        first = infos[0]
        total = {k: sum(int(i.get(k, 0)) for i in infos) for k in ("total_cycles", "total_updates", "total_tokens")}
        return JSONResponse({**first, **total, "name": f"fleet of {self.members.size} pools",
                             "pools": [i.get("name") for i in infos]})

    async def _fleet(self, request: Request) -> Response:
        """The pools (each: index, name, epoch, node, pid, device, models, load, totals) and the fleet's
        totals; asked with a key the pools accept (an observer key too)."""
        answers = await self._each(request, API + "/trio/info")
        pools = []
        for state, answer in answers:
            if answer.status_code != 200:
                return _relay(answer, state, "")
            info = answer.json()
            pools.append({**asdict(state), "name": state.name, "alive": True, "path": f"/trio/pools/{state.index}",
                          "min_cycle_s": info.get("min_cycle_s"), "cycle_index": info.get("cycle_index"),
                          "total_cycles": info.get("total_cycles"), "total_tokens": info.get("total_tokens"),
                          "total_updates": info.get("total_updates")})
        up = {p["index"] for p in pools}
        pools += [{"index": k, "name": f"pool-{k}", "alive": False, "path": f"/trio/pools/{k}"}
                  for k in range(self.members.size) if k not in up]
        pools.sort(key=lambda p: p["index"])
        totals = {k: sum(int(p.get(k) or 0) for p in pools)
                  for k in ("sessions", "clients", "total_updates", "total_tokens")}
        return JSONResponse({"pools": pools, "totals": {**totals, "pools": len(pools), "alive": len(up)},
                             "placements": list(self.placements),
                             "door": {"frozen_objects": gc.get_freeze_count()}})  # (server.freeze_heap)

    async def _each(self, request: Request, path: str, query: str | None = None
                    ) -> list[tuple[PoolState, httpx.Response]]:
        """`request` (bodiless) asked of every live pool; a pool that fails meanwhile is left out."""
        live = await self.states()
        if not live:
            raise _Refused(_no_pool())
        query = request.url.query if query is None else query

        async def one(state: PoolState) -> tuple[PoolState, httpx.Response] | None:
            try:
                answer = await self._send(request, state, path, b"", query)
                await answer.aread()
                return state, answer
            except httpx.TransportError:
                self._states.pop(state.index, None)
                return None

        found = [a for a in await asyncio.gather(*(one(s) for s in live)) if a is not None]
        if not found:
            raise _Refused(_refusal(503, "no pool of this fleet answered: try again in a moment", code="pool_closed"))
        return found

    async def _anywhere(self, request: Request, op: str, body: bytes) -> Response:
        """A request of no pool's in particular (config, health, the SDK's telemetry, a tokenizer):
        the live pools that serve the model it names, if it names one, in turn."""
        live = await self.states()
        model = request.query_params.get("base_model")
        return await self._one_of(request, op, body, [s for s in live if model is None or model in s.models] or live)


class _Refused(Exception):
    def __init__(self, response: Response):
        self.response = response


def _refusal(status: int, message: str, *, code: str = "not_found", close: bool = False) -> JSONResponse:
    return JSONResponse({"detail": message, "code": code}, status_code=status,
                        headers={"Connection": "close"} if close else None)


def _no_pool() -> JSONResponse:
    return _refusal(503, "no pool of this fleet is answering now: try again in a moment", code="pool_closed")


def _subject(op: str) -> str:
    """What a request to `op` is about, in words (for a refusal)."""
    return "the request" if op in ("/retrieve_future", "/cancel_future") else f"{op.lstrip('/')}'s id"


def _lost(op: str, index: int, *, restarted: bool) -> Response:
    what = "restarted (its replica died)" if restarted else "is not answering (its replica died)"
    message = (f"pool-{index} of this fleet {what}: the sessions, models and requests it held are lost; "
               f"checkpoints saved before are kept: create a new ServiceClient (it goes to a live pool) and "
               f"resume from your last checkpoint")
    if op == "/retrieve_future":
        return JSONResponse(wire_of(PoolClosedError(message), "pool_failed").future_body())
    if op == "/session_heartbeat":  # 410: the SDK stops heartbeating a session it is told is gone
        return error_response(wire_of(ClientClosedError(message), "session_expired"))
    return error_response(wire_of(PoolClosedError(message), "pool_failed"))


def _relay(answer: httpx.Response, state: PoolState | None, base_url: str) -> Response:
    """A pool's answer as the fleet's: its status, type and body (URLs it signed under its own
    address rewritten to the fleet's prefix for that pool)."""
    content = answer.content
    media = answer.headers.get("content-type", "")
    if state is not None and base_url and media.startswith("application/json"):
        inner = state.url.rstrip("/").encode()
        if inner in content:
            content = content.replace(inner, f"{base_url.rstrip('/')}/trio/pools/{state.index}".encode())
    headers = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-trio-")}
    return Response(content, status_code=answer.status_code, media_type=media or None, headers=headers)


def _merge(op: str, listings: list[tuple[int, bytes]], offset: int, limit: int) -> bytes:
    """Every pool's listing of `op` (pool index, its JSON answer) as one page: each item once (the
    run's own pool's copy where several list it), newest first."""
    key, ident_of, sort, total = _LISTINGS[op]
    merged: dict[str, dict] = {}
    for index, content in listings:
        for item in json.loads(content).get(key, []):
            ident = item.get(ident_of)
            mine = isinstance(ident, str) and _owner_index(ident) == index
            if ident not in merged or mine:  # the run's own pool knows it best (it is live there)
                merged[ident] = item
    items = sorted(merged.values(), key=lambda r: tuple(str(r.get(k)) for k in sort), reverse=True)
    return json.dumps({key: items[offset:offset + limit], "cursor": {"offset": offset, "limit": limit,
                                                                     total: len(items)}},
                      ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _owner_index(ident: str) -> int | None:
    found = _ID.search(ident)
    return int(found["index"]) if found else None


def _tag_of(op: str, body: bytes, content_type: str) -> tuple[int, str] | None:
    """(pool index, epoch) of the request's subject: the id in its path, else in its body."""
    found = _ID.search(unquote(op))
    if found is None and body:
        if content_type.startswith(wire.PROTOBUF):
            try:
                found = _ID.search(wire.forward_request_model_id(body))
            except Exception:  # not a forward request: the pool refuses it, any pool
                found = None
        else:
            try:
                value = json.loads(body)
            except (ValueError, RecursionError):
                value = None
            if isinstance(value, dict):
                for name in _ROUTING_FIELDS:
                    field = value.get(name)
                    if isinstance(field, str) and (found := _ID.search(field)) is not None:
                        break
    return (int(found["index"]), found["epoch"]) if found is not None else None


def describe(index: int, epoch: str, server: Any, node: str) -> PoolState:
    """The PoolState of a running `Server` (what a pool replica answers)."""
    import os

    pool = server.pool
    sessions = [s for s in server.sessions() if s["state"] == "live"]
    cycles: Sequence[Any] = list(pool.telemetry.cycles)[-16:]
    tokens = sum(c.tokens for c in cycles) / len(cycles) if cycles else 0.0
    return PoolState(index=index, epoch=epoch, url=server.url, models=tuple(server._service.models), pid=os.getpid(),
                     node=node, device=pool.device.type, sessions=len(sessions),
                     clients=sum(len(s["clients"]) for s in sessions), tokens_per_cycle=float(tokens),
                     total_updates=int(pool.telemetry.total_updates), frozen_objects=gc.get_freeze_count())


class FrontDoor:
    """The fleet's one URL on `host`:`port`, served from a thread of its own (uvicorn), with
    every guard `serve` has (trio_widgets/http/guard.py; the settings are `trio.serve`'s of the
    same names): what a pool's own server holds, the fleet's door holds too."""

    def __init__(self, members: Members, *, host: str = "127.0.0.1", port: int = 8000,
                 api_keys: Iterable[str] | None = None, observer_keys: Iterable[str] | None = None,
                 allowed_hosts: Iterable[str] | None = None, allowed_origins: Iterable[str] | None = None,
                 max_body_bytes: int = 16 << 20, body_timeout_s: float = 30.0, header_timeout_s: float = 10.0,
                 max_waiting_connections: int = 256, max_connections_per_address: int = 512,
                 max_connections_per_key: int = 512, max_connections: int = 4096,
                 max_new_connections_per_address_s: float = 256.0, max_inflight_bytes_per_key: int = 64 << 20,
                 max_inflight_bytes: int = 256 << 20):
        from .server import check_bind, owner_identifier

        keys = [*(api_keys or ()), *(observer_keys or ())]
        check_bind(host, keys)
        for name, value, low, high in (("header_timeout_s", header_timeout_s, 0.1, 3600.0),
                                       ("body_timeout_s", body_timeout_s, 0.1, 3600.0),
                                       ("max_body_bytes", max_body_bytes, 1, 1 << 40),
                                       ("max_waiting_connections", max_waiting_connections, 1, 1 << 20),
                                       ("max_connections_per_address", max_connections_per_address, 1, 1 << 20),
                                       ("max_connections_per_key", max_connections_per_key, 1, 1 << 20),
                                       ("max_connections", max_connections, 1, 1 << 20),
                                       ("max_new_connections_per_address_s", max_new_connections_per_address_s,
                                        1.0, 1e6),
                                       ("max_inflight_bytes_per_key", max_inflight_bytes_per_key, 1, 1 << 40),
                                       ("max_inflight_bytes", max_inflight_bytes, 1, 1 << 40)):
            if not isinstance(value, (int, float)) or not (low <= value <= high):
                raise ValueError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")
        self.host, self._requested_port, self.port = host, int(port), 0
        budget = Budget(per_key=max(int(max_inflight_bytes_per_key), int(max_body_bytes)),
                        total=max(int(max_inflight_bytes), int(max_body_bytes)))
        self.ingress = Ingress(members, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, budget=budget)
        # the pools answer for themselves under /trio/pools/<k>/ (their downloads are signed URLs)
        self.policy = Policy.of([host, *(allowed_hosts or ())], allowed_origins,
                                keyless_paths=(API + "/healthz", API + "/trio/export/", "/trio/pools/"))
        self.connections = Connections(header_timeout_s=float(header_timeout_s),
                                       max_waiting=int(max_waiting_connections),
                                       max_per_address=int(max_connections_per_address),
                                       max_per_key=int(max_connections_per_key), max_total=int(max_connections),
                                       new_per_address_s=float(max_new_connections_per_address_s),
                                       identify=owner_identifier(keys), keyed=bool(keys))
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stats(self) -> dict[str, int]:
        """The connection counts of guard.Connections (refused, refused_per_key, evicted, timed_out, ...)."""
        return dict(self.connections.stats)

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        response = await self.ingress(Request(scope, receive))
        await response(scope, receive, send)

    def start(self, timeout: float = 30.0) -> FrontDoor:
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from . import new_event_loop

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot serve on {self.host}:{self._requested_port}: {exc.strerror or exc}") from None
        sock.listen(256)
        sock.setblocking(False)
        self._socket, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(policy_app(self._app, self.policy, self.connections),
                                http=guarded_protocol(AutoHTTPProtocol, self.connections), log_level="warning",
                                access_log=False, log_config=None, lifespan="off", limit_concurrency=None,
                                proxy_headers=False, timeout_graceful_shutdown=5, timeout_keep_alive=30)
        self._uvicorn = server = uvicorn.Server(config)

        def run() -> None:
            loop = new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
                loop.run_until_complete(self.ingress.aclose())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="trio-fleet-door", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the fleet's front door on {self.url} did not start")
            time.sleep(0.01)
        log.info("the fleet's front door on %s", self.url)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
