"""The served pool's service: every Tinker wire endpoint's behaviour over the seam
(trio_widgets.backend.Backend) of the pool: one backend per API key, which owns that key's runs
and checkpoints (the engine answers a key's listings and paths); here: the wire's sessions of API
keys, models and samplers by the SDK's sequence numbers, futures and their long-polls.
trio_widgets/http/routes.py decodes requests and calls it; server.py runs it.
What the protocol is: server.py's docstring and docs/serving.md.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..backend import (
    Backend,
    CheckpointDir,
    CreateModelRequest,
    CreateSamplerRequest,
    DeleteCheckpoint,
    ForwardRequest,
    FromStateRequest,
    GetTrainingRun,
    ListCheckpoints,
    ListTrainingRuns,
    LoadRequest,
    ModelHandle,
    OpenSession,
    OptimStepRequest,
    SamplerCreated,
    SampleRequest,
    SaveRequest,
    SetCheckpointTtl,
    WeightsInfo,
)
from ..errors import (
    ClientClosedError,
    InvalidInputError,
    PoolClosedError,
)
from ..export import DEFAULT_MAX_EXPORT_BYTES
from ..futures import APIFuture
from ..protocol import WireError, names, row_of
from ..tokenizers import MAX_TOKENIZER_FILE_BYTES, is_tokenizer_file
from ..types import SaveWeightsForSamplerResponse, SaveWeightsResponse
from ..validation import check_loss
from . import wire
from .auth import HttpError as _HttpError
from .auth import api_key_of, authenticate, owner_of, wire_of
from .auth import not_found as _not_found
from .exports import Exports, parse_age_recipients
from .guard import Budget
from .sequencer import Sequencer

__all__ = ["RETRIEVED_KEPT_S", "Service"]

log = logging.getLogger("trio_widgets.http.server")

_SEEN_PER_SAMPLER = 4096
_MAX_TOKENIZER_BYTES = 64 << 20
# How long an answered result stays retrievable: the tinker SDK reads a retrieve for up to 45 s and then
# asks again (an answer lost on the way, e.g. a connection its own garbage collection closed from
# another event loop), so this must outlast that. Unretrieved results stay 600 s.
RETRIEVED_KEPT_S = 120.0


# -- the tables ---------------------------------------------------------------------------------

@dataclass
class _Entry:
    """One request a client long-polls: its result, encoded once, or its error."""

    request_id: str
    owner: str
    session: ServedSession | None
    kind: str
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    body: bytes | dict | None = None
    protobuf: bool = False
    error: WireError | None = None
    cycle: int | None = None
    future: APIFuture | None = None  # while in the pool: for cancel
    retrieved: float | None = None

    def settle(self, body: bytes | dict | None = None, *, protobuf: bool = False,
               error: WireError | None = None) -> None:
        if self.done.is_set():
            return
        self.body, self.protobuf, self.error = body, protobuf, error
        self.future = None
        self.done.set()


@dataclass
class _Pending:
    """A model's request as its sequencer holds it until its turn."""

    entry: _Entry
    submit: Callable[[], APIFuture]
    encode: Callable[[Any], tuple[bytes | dict, bool]]


class _Ordered:
    """A model's requests in seq_id order: the pure Sequencer (trio_widgets/http/sequencer.py)
    decides, this launches what it says and keeps its one timer. On the event loop's thread."""

    def __init__(self, service: Service):
        self.service = service
        self.seq: Sequencer[_Pending] = Sequencer(remember=lambda pending: pending.entry.request_id)
        self.timer: asyncio.TimerHandle | None = None

    def arrive(self, seq: Any, entry: _Entry, submit: Callable[[], APIFuture],
               encode: Callable[[Any], tuple[bytes | dict, bool]]) -> str:
        """The request id the client gets: `entry`'s, or the first one's for a repeated seq_id."""
        arrival = self.seq.arrive(seq, _Pending(entry, submit, encode))
        if arrival.kind == "duplicate":
            self.service.stats["duplicates"] += 1
            return str(arrival.item)
        elif arrival.kind == "held":
            self.service.stats["held"] += 1
        else:
            try:
                self.service.launch(entry, submit, encode, raise_invalid=seq is not None)
            except BaseException:
                self.seq.unsee(seq)  # refused with a 4xx: no request id was given out for it
                raise
            finally:
                self._launch(arrival.ready)
        self._time()
        return entry.request_id

    def refuse(self, seq: Any) -> None:
        self._launch(self.seq.refuse(seq))
        self._time()

    def fail_held(self, error: WireError) -> None:
        for pending in self.seq.drop_held():
            pending.entry.settle(error=error)
        self._time()

    def forget_seen(self) -> None:
        """The session takes no more requests: nothing to deduplicate."""
        self.seq.seen.clear()

    def _launch(self, ready: list[_Pending]) -> None:
        for pending in ready:
            self.service.launch(pending.entry, pending.submit, pending.encode)

    def _time(self) -> None:
        if self.seq.waiting and self.timer is None:
            self.timer = self.service.loop.call_later(self.service.reorder_wait_s, self._skip_gap)
        elif not self.seq.waiting and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _skip_gap(self) -> None:
        self.timer = None
        if not self.seq.waiting:
            return
        first, missing, ready = self.seq.skip_gap()
        self.service.stats["gaps_skipped"] += 1
        log.info("seq_ids %d..%d never arrived within %.1f s; running what came after them",
                 first, missing, self.service.reorder_wait_s)
        self._launch(ready)
        self._time()


@dataclass
class ServedSession:
    session_id: str
    owner: str
    label: str
    named: bool = False  # the label is a name the user gave (else the session id's start)
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "live"  # live, finished, expired
    model_requests: dict[int, _Entry] = field(default_factory=dict)  # model_seq_id -> its create / load
    sampler_ids: dict[int, str] = field(default_factory=dict)  # sampling_session_seq_id -> sampler id
    clients: list[str] = field(default_factory=list)  # model and sampler ids, for release
    released: deque[str] = field(default_factory=lambda: deque(maxlen=256))  # closed ones: "closed", not "unknown"
    # ids a client chose for its requests (PyTRIO's event ids) -> our request ids; bounded
    aliases: OrderedDict[str, str] = field(default_factory=OrderedDict)


@dataclass
class ServedModel:
    model_id: str
    session: ServedSession
    handle: ModelHandle
    label: str
    seq: _Ordered


@dataclass
class ServedSampler:
    sampler_id: str
    session: ServedSession
    handle: ModelHandle
    model_path: str | None
    # (session, seq_id) -> request and sequence ids, not results (processes sharing a sampler through
    # a handle number their requests independently)
    seen: OrderedDict[tuple[str | None, int], tuple[str, list[str]]] = field(default_factory=OrderedDict)


# -- the service: every endpoint's behaviour ---------------------------------------------------

class Service:
    def __init__(self, pool: Any, *, api_keys: Iterable[str] | None, observer_keys: Iterable[str] | None,
                 models: Iterable[str] | None, session_timeout_s: float, long_poll_s: float,
                 reorder_wait_s: float, max_body_bytes: int, fwdbwd_max_chunk_len: int | None,
                 max_sessions_per_key: int, max_clients_per_session: int, max_futures_per_key: int,
                 body_timeout_s: float = 30.0, max_inflight_bytes_per_key: int = 64 << 20,
                 max_inflight_bytes: int = 256 << 20, max_clients_per_key: int = 128,
                 max_state_bytes_per_key: int = 2 << 30, max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
                 export_url_ttl_s: float = 3600.0, export_timeout_s: float = 3600.0, id_tag: str = ""):
        self.pool = pool  # a LocalPool (trio_widgets.connect.Pool): read for its name, clock and telemetry
        self.id_tag = id_tag
        self.backend: Backend = pool.connect(session=False)  # ops and releases (client ids are the pool's)
        self._owned: dict[str, Backend] = {}  # per API key (digest): its runs, checkpoints and listings
        self.api_keys = [k for k in (api_keys or ())]
        # a participant's name, where the keys were given with names ({key: name}: a keys file's
        # "KEY Name" lines): a session of that key is labelled by it unless it names itself
        self.key_names = {owner_of(k): str(n).strip()[:40] for k, n in api_keys.items() if str(n).strip()} \
            if isinstance(api_keys, Mapping) else {}
        self.observer_keys = [k for k in (observer_keys or ())]
        self.models = list(dict.fromkeys(models if models is not None else pool.supported_models()))
        self.session_timeout_s = float(session_timeout_s)
        self.long_poll_s = float(long_poll_s)
        self.reorder_wait_s = float(reorder_wait_s)
        self.max_body_bytes = int(max_body_bytes)
        self.body_timeout_s = float(body_timeout_s)
        self.budget = Budget(per_key=max(int(max_inflight_bytes_per_key), self.max_body_bytes),
                             total=max(int(max_inflight_bytes), self.max_body_bytes))
        self.fwdbwd_max_chunk_len = int(fwdbwd_max_chunk_len or pool.limits.max_request_data)
        self.max_sessions_per_key = max_sessions_per_key
        self.max_clients_per_session = max_clients_per_session
        self.max_futures_per_key = max_futures_per_key
        self.max_clients_per_key = int(max_clients_per_key)
        self.max_state_bytes_per_key = int(max_state_bytes_per_key)
        self.sessions: dict[str, ServedSession] = {}
        self.trained: dict[str, ServedModel] = {}
        self.samplers: dict[str, ServedSampler] = {}
        # public id -> the pool's client id of the last clients made, closed ones too (telemetry
        # lanes outlive their clients; ids only, bounded)
        self.lanes: OrderedDict[str, str] = OrderedDict()
        self.entries: dict[str, _Entry] = {}
        self.unretrieved: dict[str, int] = {}  # per key: results not yet retrieved (bounded)
        self.streams = 0
        self.streams_of: dict[str, int] = {}  # open telemetry streams per key (or address, without keys)
        self.stopping = False
        # what happened, for tests and benchmarks: submits, repeats answered from the table, early
        # arrivals held for their predecessors, gaps given up on, sessions expired
        self.stats = {"submitted": 0, "duplicates": 0, "held": 0, "gaps_skipped": 0, "sessions_expired": 0}
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set when the server starts
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"trio-serve-{pool.name}")
        # the checkpoint catalog's disk work (listings, manifests, tokenizer files): never on the event
        # loop, whose heartbeats and long-polls must answer while a key lists thousands of checkpoints;
        # one thread of its own, so a flood of listings cannot hold up creating models either
        self.catalog = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"trio-serve-{pool.name}-catalog")
        self.numbers = itertools.count(1)  # request ids, and any other number the codecs give out once
        self._tasks: set[asyncio.Task] = set()
        self._tokenizer_dirs: dict[str, str] = {}
        self._tmp: str | None = None  # tokenizers saved for the SDK's get_tokenizer (made on first use)
        self.exports = Exports(lambda owner, path: self.of(owner).call(CheckpointDir(path)),
                               max_bytes=max_export_bytes, url_ttl_s=export_url_ttl_s, timeout_s=export_timeout_s)

    # -- auth ---------------------------------------------------------------------------
    def authenticate(self, request: Request, observer: bool = False) -> str:
        return authenticate(api_key_of(request.headers), self.api_keys, self.observer_keys, observer)

    def of(self, owner: str) -> Backend:
        """The backend of an API key (made on its first request; one per key the server was given)."""
        backend = self._owned.get(owner)
        if backend is None:
            backend = self._owned[owner] = self.pool.connect(session=False, owner=owner)
        return backend

    # -- sessions -----------------------------------------------------------------------
    def session(self, session_id: Any, owner: str, *, live: bool = True) -> ServedSession:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.owner != owner:
            raise _not_found(f"session {session_id!r:.60}")
        if live and session.state != "live":
            why = "was finished" if session.state == "finished" else \
                f"expired (no heartbeat for {self.session_timeout_s:g} s)"
            raise _HttpError(404 if session.state == "finished" else 410,
                             f"session {session_id} {why}: create a new ServiceClient",
                             code="client_closed" if session.state == "finished" else "session_expired")
        session.last_seen = time.monotonic()
        return session

    def create_session(self, owner: str, body: dict) -> dict:
        mine = sum(1 for s in self.sessions.values() if s.owner == owner and s.state == "live")
        if mine >= self.max_sessions_per_key:
            raise _HttpError(400, f"this API key has {mine} live sessions, the server's limit "
                                  f"(max_sessions_per_key); close some ServiceClients")
        session_id = names.new_session_id(self.id_tag)
        random = session_id[-16:]
        meta = body.get("user_metadata")
        # a person's name for the lanes: the SDKs' "name", a tinker-cookbook recipe's "recipe_name"
        named = [meta.get(k) for k in ("name", "run_name", "recipe_name")] if isinstance(meta, dict) else []
        name = next((n for n in named if isinstance(n, str) and n.strip()), None) or body.get("display_name") \
            or self.key_names.get(owner)
        label = str(name)[:40] if name else f"sess-{random[:8]}"
        self.sessions[session_id] = ServedSession(session_id, owner, label, named=bool(name))
        # the pool's one session table lists it, with the runs and samplers it makes
        self.backend.call(OpenSession(session_id, meta if isinstance(meta, dict) else None,
                                      str(body["display_name"]) if body.get("display_name") else None))
        return {"session_id": session_id, "type": "create_session"}

    def end_session(self, session: ServedSession, state: str, why: str) -> None:
        """Finish or expire a session: its queued requests are cancelled (expire) or left to run
        (finish), and its clients are retired once nothing of theirs is queued.

        The new state is set last: `Server.sessions()` reads it from other threads, and "expired"
        promises that its queued requests are already cancelled. (On the loop's thread nothing
        else runs in between.)"""
        expired = wire_of(ClientClosedError(why), "session_expired")
        if state == "expired":
            for entry in self.entries.values():
                if entry.session is session and not entry.done.is_set():
                    if entry.future is not None:
                        entry.future.cancel()  # withdrawn if still queued; one in a cycle finishes
                    if entry.future is None or entry.future.cancelled():
                        entry.settle(error=expired)
        for cid in session.clients:
            model, sampler = self.trained.get(cid), self.samplers.get(cid)
            if model is not None:
                if state == "expired":
                    model.seq.fail_held(expired)
                model.seq.forget_seen()
            if sampler is not None:
                sampler.seen.clear()
            with contextlib.suppress(PoolClosedError, ClientClosedError):
                self.backend.release(self._client_id(cid))
        # results nobody will ask for again are freed now: retrieved ones, and all of an expired session
        for rid, entry in list(self.entries.items()):
            if entry.session is session and entry.done.is_set() and \
                    (entry.retrieved is not None or state == "expired"):
                self.forget(rid)
        if state == "expired":
            self.stats["sessions_expired"] += 1
        session.state = state
        log.info("session %s %s: %s", session.session_id, state, why)

    def _client_id(self, public_id: str) -> str:
        found = self.trained.get(public_id) or self.samplers.get(public_id)
        return found.handle.client_id if found is not None else public_id

    # -- futures --------------------------------------------------------------------------
    def new_entry(self, owner: str, session: ServedSession | None, kind: str) -> _Entry:
        pending = self.unretrieved.get(owner, 0)
        if pending >= self.max_futures_per_key:
            raise _HttpError(400, f"this API key has {pending} results not yet retrieved, the server's limit "
                                  f"(max_futures_per_key): retrieve (await) some before submitting more")
        entry = _Entry(names.request_id(next(self.numbers), self.id_tag), owner, session, kind)
        self.entries[entry.request_id] = entry
        self.unretrieved[owner] = pending + 1
        return entry

    def forget(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None and entry.retrieved is None:
            self.unretrieved[entry.owner] -= 1

    def mark_retrieved(self, entry: _Entry) -> None:
        if entry.retrieved is None:
            entry.retrieved = time.monotonic()
            self.unretrieved[entry.owner] -= 1

    def launch(self, entry: _Entry, submit: Callable[[], APIFuture],
               encode: Callable[[Any], tuple[bytes | dict, bool]], raise_invalid: bool = False) -> None:
        """Put a request into the pool now; its future settles `entry` (on the loop's thread)."""
        if self.stopping:
            entry.settle(error=wire_of(PoolClosedError("the server is shutting down"), "server_shutdown"))
            return
        try:
            future = submit()
            self.stats["submitted"] += 1
        except (InvalidInputError, PoolClosedError, ClientClosedError, _HttpError) as exc:
            if raise_invalid:
                self.forget(entry.request_id)
                raise
            entry.settle(error=wire_of(exc))
            return
        entry.future = future
        loop = self.loop

        def delivered(f: APIFuture) -> None:  # on the pool's clock thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
                loop.call_soon_threadsafe(self._finish, entry, f, encode)

        future.add_done_callback(delivered)

    def _finish(self, entry: _Entry, future: APIFuture, encode: Callable[[Any], tuple[bytes | dict, bool]]) -> None:
        entry.cycle = future.cycle
        if future.cancelled():
            if not entry.done.is_set():
                entry.settle(error=WireError(400, "cancelled", "user", "cancelled before it ran"))
            return
        exc = future.exception()
        if exc is not None:
            error = wire_of(exc)
            session = entry.session.session_id if entry.session is not None else "-"
            log.log(logging.ERROR if row_of(exc).status >= 500 else logging.INFO, "%s (%s, session %s) failed: %s %s",
                    entry.request_id, entry.kind, session, error.code, error.message[:300])
            entry.settle(error=error)
            return
        try:
            body, protobuf = encode(future.result())
        except Exception as exc:  # a bug in an encoder: the client hears of it
            log.exception("encoding the result of %s failed", entry.request_id)
            entry.settle(error=WireError(500, "internal", "server", f"the server could not encode the result: {exc}"))
            return
        entry.settle(body, protobuf=protobuf)

    def in_background(self, entry: _Entry, work: Callable[[], Any],
                      then: Callable[[Any], dict]) -> None:
        """Run blocking `work` (loading models, reading checkpoints) on the server's worker
        threads, then `then(result)` on the loop; both settle `entry`."""
        async def run() -> None:
            try:
                value = await self.loop.run_in_executor(self.executor, work)
                entry.settle(then(value))
            except (InvalidInputError, PoolClosedError, ClientClosedError, _HttpError) as exc:
                entry.settle(error=wire_of(exc))
            except Exception as exc:
                log.exception("%s failed", entry.kind)
                entry.settle(error=WireError(500, "internal", "server",
                                             f"{entry.kind} failed: {type(exc).__name__}: {exc}"))

        task = self.loop.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retrieve(self, owner: str, body: dict) -> Response:
        request_id = body.get("request_id")
        entry = self.entries.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.owner != owner:
            raise _not_found(f"request {request_id!r:.60}")
        if entry.session is not None:
            # a request arriving is a sign of life; one held open is not (a killed client's polls
            # stay open until they time out)
            entry.session.last_seen = time.monotonic()
        if not entry.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.done.wait(), self.long_poll_s)
        if not entry.done.is_set():
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        self.mark_retrieved(entry)
        headers = {"X-Trio-Cycle": str(entry.cycle)} if entry.cycle is not None else {}
        if entry.error is not None:
            return JSONResponse(entry.error.future_body(), headers=headers)
        if entry.protobuf:
            assert isinstance(entry.body, bytes)
            return Response(entry.body, media_type=wire.PROTOBUF, headers=headers)
        return JSONResponse(entry.body, headers=headers)

    def cancel(self, owner: str, body: dict) -> dict:
        request_id = body.get("request_id")
        entry = self.entries.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.owner != owner:
            raise _not_found(f"request {request_id!r:.60}")
        cancelled = entry.future is not None and entry.future.cancel()
        return {"request_id": request_id, "cancelled": bool(cancelled)}

    # -- models ----------------------------------------------------------------------------
    def model(self, model_id: Any, owner: str) -> ServedModel:
        model = self.trained.get(model_id) if isinstance(model_id, str) else None
        if model is None or model.session.owner != owner:
            self._closed(model_id, owner)
            raise _not_found(f"model {model_id!r:.80}")
        self.session(model.session.session_id, owner)  # 404 / 410 once the session ended
        return model

    def _lane(self, public_id: str, handle: ModelHandle) -> None:
        self.lanes[public_id] = handle.client_id
        while len(self.lanes) > 4096:
            self.lanes.popitem(last=False)

    def _closed(self, public_id: Any, owner: str) -> None:
        """A client this key closed (released) is named so, not reported unknown."""
        if not isinstance(public_id, str):
            return
        session = self.sessions.get(public_id.split(":", 1)[0])
        if session is not None and session.owner == owner and public_id in session.released:
            raise ClientClosedError(f"client {public_id} was closed: create a new one")

    def _key_clients(self, owner: str) -> list[ModelHandle]:
        """The handles of this key's clients the pool holds now (live sessions)."""
        found: list[ServedModel | ServedSampler] = [*self.trained.values(), *self.samplers.values()]
        return [c.handle for c in found if c.session.owner == owner and c.session.state == "live"]

    def _check_key_budget(self, owner: str, handle: ModelHandle | None = None) -> None:
        """A key's clients in all its sessions: at most max_clients_per_key, holding at most
        max_state_bytes_per_key of adapter and optimizer state (refused before and after building)."""
        mine = self._key_clients(owner)
        if len(mine) >= self.max_clients_per_key:
            raise InvalidInputError(f"this API key has {len(mine)} clients open, the server's limit "
                                    f"(max_clients_per_key); close some first")
        if handle is not None:
            held = sum(h.state_bytes for h in mine) + handle.state_bytes
            if held > self.max_state_bytes_per_key:
                raise InvalidInputError(f"this API key's clients would hold {held / 2**20:.2f} MiB of adapter and "
                                        f"optimizer state, more than the server's limit of "
                                        f"{self.max_state_bytes_per_key / 2**20:.2f} MiB (max_state_bytes_per_key); "
                                        f"close some clients or use a smaller rank", field="rank")

    def check_model_slot(self, session: ServedSession, n: Any, field_name: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or not (0 <= n < 10**9):
            raise InvalidInputError(f"must be an integer from 0, got {n!r:.40}", field=field_name)
        if len(session.clients) >= self.max_clients_per_session:
            raise _HttpError(400, f"this session has {len(session.clients)} clients, the server's limit "
                                  f"(max_clients_per_session)")
        self._check_key_budget(session.owner)
        return n

    def base_model(self, name: Any) -> str:
        if name not in self.models:
            raise InvalidInputError(f"unknown model {name!r:.80}: this server serves {', '.join(self.models)}",
                                    field="base_model")
        return name

    def _admit(self, session: ServedSession, handle: ModelHandle, what: str) -> None:
        """A client the engine just made, kept only if its session is live and its key's budget holds
        (else released, and the request refused)."""
        if session.state != "live" or self.stopping:  # it ended while the client was being built
            self.backend.release(handle.client_id)
            raise _HttpError(410, f"session {session.session_id} ended while the {what} was being created",
                             code="client_closed")
        try:
            self._check_key_budget(session.owner, handle)
        except InvalidInputError:
            self.backend.release(handle.client_id)
            raise

    def _register_model(self, session: ServedSession, model_id: str, handle: ModelHandle, label: str) -> dict:
        self._admit(session, handle, "model")
        self.trained[model_id] = ServedModel(model_id, session, handle, label, _Ordered(self))
        self._lane(model_id, handle)
        session.clients.append(model_id)
        return {"model_id": model_id, "type": "create_model"}

    def model_label(self, session: ServedSession, n: int, meta: Any) -> str:
        """A lane's label says whose it is in the words the user gave: "ada" (a named session's
        first model), "grace" (a named model), "ada · grace" (both), "ada:train:1" (a named
        session's later models); sess-1db27469:train:0 only when nothing was named."""
        name = meta.get("name") if isinstance(meta, dict) else None
        name = str(name).strip()[:40] if isinstance(name, str | int) and str(name).strip() else None
        if name:
            return f"{session.label} · {name}" if session.named and name != session.label else name
        return session.label if session.named and n == 0 else names.run_id(session.label, n)

    def create_model(self, owner: str, body: dict) -> dict:
        session = self.session(body.get("session_id"), owner)
        n = self.check_model_slot(session, body.get("model_seq_id"), "model_seq_id")
        if n in session.model_requests:  # a retry of the same create
            return {"request_id": session.model_requests[n].request_id}
        base = self.base_model(body.get("base_model"))
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise InvalidInputError("must be an object", field="lora_config")
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise InvalidInputError(f"only AdamW is supported here, got {optimizer!r:.80}", field="optimizer_config")
        # rank, seed and the train_* flags are the engine's to check (LocalBackend.create_model), as in-process
        rank, seed = lora.get("rank", 32), lora.get("seed")
        model_id = names.run_id(session.session_id, n)
        label = self.model_label(session, n, body.get("user_metadata"))
        # the key's backend puts the run's checkpoints where its tinker:// paths point
        request = CreateModelRequest(base, rank, seed,
                                     train_mlp=bool(lora.get("train_mlp", True)),
                                     train_attn=bool(lora.get("train_attn", True)),
                                     train_unembed=bool(lora.get("train_unembed", True)), label=label,
                                     user_metadata=_metadata(body.get("user_metadata")), run_id=model_id,
                                     session_id=session.session_id)
        entry = self.open_run(owner, session, n, request, label)
        return {"request_id": entry.request_id, "model_id": model_id}

    def open_run(self, owner: str, session: ServedSession, n: int, request: CreateModelRequest | FromStateRequest,
                 label: str, then: Callable[[dict], dict] = lambda out: out, kind: str = "create_model") -> _Entry:
        """Run `n` of `session` (a new adapter, or one from a checkpoint) made on the worker threads;
        its entry settles with `then` of the registered model (both wire codecs)."""
        model_id = names.run_id(session.session_id, n)
        entry = self.new_entry(owner, session, kind)
        session.model_requests[n] = entry
        self.in_background(entry, lambda: self.of(owner).open(request),
                           lambda handle: then(self._register_model(session, model_id, handle, label)))
        return entry

    def load_weights(self, owner: str, body: dict) -> dict:
        optimizer = body.get("optimizer")
        if not isinstance(optimizer, bool):
            raise InvalidInputError(f"must be true or false, got {optimizer!r:.40}", field="optimizer")
        if body.get("weights_access_token"):
            raise InvalidInputError("loading checkpoints of another account is not supported here",
                                    field="weights_access_token")
        if "session_id" not in body:  # the legacy form: load into an existing model, in its order
            model = self.model(body.get("model_id"), owner)
            with self.consumes(model, body.get("seq_id")):
                self.of(owner).call(CheckpointDir(body.get("path")))  # refused now if it is not this key's
            op = "load_state_with_optimizer" if optimizer else "load_state"
            path = body["path"]
            return self.sequenced(model, owner, body.get("seq_id"), op, LoadRequest(path),
                                   lambda _r: ({"path": path, "model_id": model.model_id, "type": "load_weights"},
                                               False))
        session = self.session(body.get("session_id"), owner)
        n = self.check_model_slot(session, body.get("model_seq_id"), "model_seq_id")
        if n in session.model_requests:
            return {"request_id": session.model_requests[n].request_id}
        self.of(owner).call(CheckpointDir(body.get("path")))  # refused now if it is not this key's
        model_id = names.run_id(session.session_id, n)
        label = self.model_label(session, n, body.get("user_metadata"))
        base = body.get("base_model")  # compared with the checkpoint's by the engine, as in-process
        request = FromStateRequest(body["path"], optimizer, label, base_model=base if isinstance(base, str) else None,
                                   user_metadata=_metadata(body.get("user_metadata")), run_id=model_id,
                                   session_id=session.session_id)
        entry = self.open_run(owner, session, n, request, label, kind="load_weights",
                              then=lambda _out: {"path": body["path"], "model_id": model_id, "type": "load_weights"})
        return {"request_id": entry.request_id, "model_id": model_id}

    def get_info(self, owner: str, body: dict, local: bool = True) -> dict:
        model = self.model(body.get("model_id"), owner)
        h = model.handle
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": h.rank,
                "model_name": h.base_model,
                "model_data": {"arch": "llama", "model_name": h.base_model,
                               "tokenizer_id": self.tokenizer_id(h.base_model, local)},
                # trio's client reads these (the tinker SDK ignores extra fields)
                "trio": {"alpha": h.alpha, "seed": h.seed, "train_attn": h.train_attn, "train_mlp": h.train_mlp,
                         "train_unembed": h.train_unembed, "label": model.label}}

    def tokenizer_id(self, name: str, local: bool) -> str | None:
        """What the SDK's get_tokenizer loads (model_data.tokenizer_id): a hub model's name; for a
        client on this machine, the directory the server saved its tokenizer to; for one elsewhere,
        the model's name, which `python -m trio_widgets pull-tokenizer` stores in that machine's
        Hugging Face cache (a directory here means nothing there)."""
        where = self._tokenizer_dir(name)
        if where is None:
            return None
        base = self.pool.get_base_model(name)
        hub = base.source not in ("builtin", where) and not Path(base.source).is_dir()
        return name if hub or not local else where

    def tokenizer_files(self, owner: str, name: Any) -> dict:
        """The served model's tokenizer files (for pull-tokenizer), base64, bounded in size."""
        if not isinstance(name, str) or name not in self.models:
            raise InvalidInputError(f"unknown model {name!r:.80}: this server serves {', '.join(self.models)}",
                                    field="base_model")
        where = self._tokenizer_dir(name)
        if where is None:
            raise InvalidInputError(f"{name} has no tokenizer", field="base_model")
        files, total = {}, 0
        for path in sorted(Path(where).iterdir()):
            # the tokenizer's own files only, by name: a model directory holds its weights too
            if not is_tokenizer_file(path.name) or path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            total += size
            if size > MAX_TOKENIZER_FILE_BYTES or total > _MAX_TOKENIZER_BYTES:
                raise InvalidInputError(f"{name}'s tokenizer file {path.name} ({size} bytes) is over the limits "
                                        f"({MAX_TOKENIZER_FILE_BYTES >> 20} MiB a file, "
                                        f"{_MAX_TOKENIZER_BYTES >> 20} MiB in all)", field="base_model")
            files[path.name] = base64.b64encode(path.read_bytes()).decode("ascii")
        config = getattr(self.pool.get_base_model(name).model, "config", None)
        if "config.json" not in files and config is not None:
            # AutoTokenizer reads the model's config too (its model type), as a hub repository has it
            files["config.json"] = base64.b64encode(config.to_json_string().encode()).decode("ascii")
        return {"base_model": name, "files": files}

    def _tokenizer_dir(self, name: str) -> str | None:
        """A local directory AutoTokenizer loads: the model's own, or one the server saved its tokenizer to."""
        if name not in self._tokenizer_dirs:
            base = self.pool.get_base_model(name)
            if base.tokenizer is None:
                return None
            if base.source != "builtin" and Path(base.source).is_dir():
                self._tokenizer_dirs[name] = str(base.source)
            else:
                self._tmp = self._tmp or tempfile.mkdtemp(prefix="trio-serve-")
                target = Path(self._tmp) / f"tokenizer-{len(self._tokenizer_dirs)}"
                base.tokenizer.save_pretrained(str(target))
                self._tokenizer_dirs[name] = str(target)
        return self._tokenizer_dirs[name]

    # -- requests of a model, in seq_id order -------------------------------------------------
    @contextlib.contextmanager
    def consumes(self, model: ServedModel, seq: Any) -> Any:
        """Around the checks of a model's request: a refusal still uses up its seq_id."""
        try:
            yield
        except (InvalidInputError, _HttpError):
            model.seq.refuse(seq)
            raise

    def sequenced(self, model: ServedModel, owner: str, seq: Any, op: str, request: Any,
                   encode: Callable[[Any], tuple[bytes | dict, bool]]) -> dict:
        entry = self.new_entry(owner, model.session, op)
        client_id = model.handle.client_id
        found = model.seq.arrive(seq, entry, lambda: self.of(owner).submit(client_id, op, request), encode)
        if found != entry.request_id:  # a repeat: the first one's id, nothing run
            self.forget(entry.request_id)
        return {"request_id": found, "model_id": model.model_id}

    def forward_backward(self, owner: str, body: bytes) -> dict:
        model_id, seq, data, loss_fn, config, forward_only = wire.decode_forward_request(
            body, self.pool.limits.max_request_tokens)
        model = self.model(model_id, owner)
        # a trio client marks the second half of a custom loss so the dashboard names it
        op = "forward" if forward_only else ("forward_backward_custom" if config.pop("trio_op", None) ==
                                             "forward_backward_custom" else "forward_backward")
        with self.consumes(model, seq):
            if loss_fn == "custom":
                raise InvalidInputError("server-side custom losses are not supported here: call "
                                        "forward_backward_custom (the two-step exchange), which needs nothing "
                                        "from the server", field="loss_fn")
            loss_fn, config = check_loss(loss_fn, config or None)
        return self.sequenced(model, owner, seq or None, op, ForwardRequest(data, loss_fn, config),
                               lambda out: (wire.encode_forward_output(out), True))

    def optim_step(self, owner: str, body: dict) -> dict:
        model = self.model(body.get("model_id"), owner)
        with self.consumes(model, body.get("seq_id")):
            if "optimizer_params" in body:
                raise InvalidInputError("only AdamW (adam_params) is supported here", field="optimizer_params")
            params = wire.adam_from_json(body.get("adam_params", body.get("optim_params")))
        return self.sequenced(model, owner, body.get("seq_id"), "optim_step", OptimStepRequest(params),
                               lambda r: ({"metrics": wire.tinker_metric_keys(r.metrics)}, False))

    def save_weights(self, owner: str, body: dict) -> dict:
        model = self.model(body.get("model_id"), owner)
        with self.consumes(model, body.get("seq_id")):
            name = names.validate_name(body.get("path"), "path")
            overwrite = body.get("overwrite", False)
            if not isinstance(overwrite, bool):
                raise InvalidInputError(f"must be true or false, got {overwrite!r:.40}", field="overwrite")

        def encode(result: SaveWeightsResponse) -> tuple[dict, bool]:
            # the engine's path and fields, as in-process (model, size: pytrio's; the tinker SDK ignores them)
            return {"path": result.path, "type": "save_weights", "model": result.model, "size": result.size}, False

        # overwrite, TTL and metadata are the engine's to check and enforce, as in-process
        request = SaveRequest(name, overwrite=overwrite, ttl_seconds=body.get("ttl_seconds"),
                              user_metadata=body.get("user_metadata"))
        return self.sequenced(model, owner, body.get("seq_id"), "save_state", request, encode)

    def save_weights_external(self, owner: str, body: dict) -> dict:
        """tinker's export: the weights as a PEFT directory under external_weights/, fetched with
        the signed URLs of get_external_weights_urls (trio_widgets/http/exports.py)."""
        model = self.model(body.get("model_id"), owner)
        with self.consumes(model, body.get("seq_id")):
            name = names.validate_name(body.get("path"), "path")
            recipients = parse_age_recipients(body.get("age_encryption_recipients"))
        path = names.checkpoint_path(model.model_id, "external_weights", name)
        request = SaveRequest(name, ttl_seconds=body.get("ttl_seconds"), external=True, age_recipients=recipients)
        return self.sequenced(model, owner, body.get("seq_id"), "save_weights_for_sampler", request,
                               lambda _r: ({"path": path, "type": "save_weights_external"}, False))

    def save_weights_for_sampler(self, owner: str, body: dict) -> dict:
        model = self.model(body.get("model_id"), owner)
        with self.consumes(model, body.get("seq_id")):
            return self._save_for_sampler(model, owner, body)

    def _save_for_sampler(self, model: ServedModel, owner: str, body: dict) -> dict:
        if body.get("kind", "snapshot") != "snapshot":
            raise InvalidInputError(f"only 'snapshot' sampling clients are supported here (a copy of the weights "
                                    f"as of this request), got {body.get('kind')!r:.40}", field="kind")
        name = body.get("path")
        n = body.get("sampling_session_seq_id")
        if name is None and n is None:
            raise InvalidInputError("give a name (path) or sampling_session_seq_id", field="path")
        if name is not None:
            names.validate_name(name, "path")
        session = model.session
        if n is not None:
            self.check_model_slot(session, n, "sampling_session_seq_id")
            if n in session.sampler_ids:
                raise InvalidInputError(f"sampling_session_seq_id {n} was used already in this session",
                                        field="sampling_session_seq_id")
        path = names.checkpoint_path(model.model_id, "sampler_weights", name) if name is not None else None
        label = names.sampler_id(session.label, n) if n is not None else None

        def encode(result: Any) -> tuple[dict, bool]:
            out: dict[str, Any] = {"type": "save_weights_for_sampler"}
            if path is not None:
                out["path"] = path
            if isinstance(result, SaveWeightsForSamplerResponse):
                out.update(model=result.model, size=result.size)
            if isinstance(result, SamplerCreated):
                assert n is not None  # only a request with sampling_session_seq_id makes a sampler
                sampler_id = names.sampler_id(session.session_id, n)
                self._register_sampler(session, sampler_id, result.sampler, path, n)
                out["sampling_session_id"] = sampler_id
            return out, False

        return self.sequenced(model, owner, body.get("seq_id"), "save_weights_for_sampler",
                               SaveRequest(name, make_sampler=n is not None, label=label,
                                           ttl_seconds=body.get("ttl_seconds"),
                                           user_metadata=body.get("user_metadata"),
                                           sampler_id=names.sampler_id(session.session_id, n) if n is not None
                                           else None),
                               encode)

    # -- sampling ----------------------------------------------------------------------------
    def _register_sampler(self, session: ServedSession, sampler_id: str, handle: ModelHandle, model_path: str | None,
                          n: int) -> None:
        self._admit(session, handle, "sampler")
        self.samplers[sampler_id] = ServedSampler(sampler_id, session, handle, model_path)
        self._lane(sampler_id, handle)
        session.sampler_ids[n] = sampler_id
        session.clients.append(sampler_id)

    async def create_sampling_session(self, owner: str, body: dict) -> dict:
        session = self.session(body.get("session_id"), owner)
        n = self.check_model_slot(session, body.get("sampling_session_seq_id"), "sampling_session_seq_id")
        if n in session.sampler_ids:
            return {"sampling_session_id": session.sampler_ids[n], "type": "create_sampling_session"}
        model_path, base = body.get("model_path"), body.get("base_model")
        if model_path is None and base is None:
            raise InvalidInputError("give model_path (a tinker:// path) or base_model", field="model_path")
        if model_path is not None:
            self.of(owner).call(CheckpointDir(model_path))  # refused now if it is not this key's
        if base is not None:
            self.base_model(base)
        sampler_id = names.sampler_id(session.session_id, n)
        request = CreateSamplerRequest(model_path, base, names.sampler_id(session.label, n),
                                       session_id=session.session_id, sampler_id=sampler_id)
        # a refusal propagates as its own class (the protocol's table maps it)
        handle = await self.loop.run_in_executor(self.executor, lambda: self.of(owner).open(request))
        if n in session.sampler_ids:  # a concurrent retry won: keep one
            self.backend.release(handle.client_id)
        else:
            self._register_sampler(session, sampler_id, handle, model_path, n)
        return {"sampling_session_id": session.sampler_ids[n], "type": "create_sampling_session"}

    def sampler(self, sampler_id: Any, owner: str) -> ServedSampler:
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler is None or sampler.session.owner != owner:
            self._closed(sampler_id, owner)
            raise _not_found(f"sampling session {sampler_id!r:.80}")
        self.session(sampler.session.session_id, owner)
        return sampler

    def get_sampler(self, owner: str, sampler_id: str, local: bool = True) -> dict:
        sampler = self.sampler(sampler_id, owner)
        h = sampler.handle
        out: dict[str, Any] = {"sampler_id": sampler_id, "base_model": h.base_model,
                               "trio": {"rank": h.rank, "alpha": h.alpha, "seed": h.seed,
                                        "tokenizer_id": self.tokenizer_id(h.base_model, local)}}
        if sampler.model_path is not None:
            out["model_path"] = sampler.model_path
        return out

    def asample(self, owner: str, body: dict) -> dict:
        if body.get("sampling_session_id") is None:
            raise InvalidInputError("sample through a sampling session (create_sampling_client); sampling by "
                                    "model_path or base_model per request is not supported here",
                                    field="sampling_session_id")
        sampler = self.sampler(body.get("sampling_session_id"), owner)
        if body.get("record_stability_info") not in (False, None):
            raise InvalidInputError("is not supported by the local pool; leave it at False",
                                    field="record_stability_info")
        seq = body.get("seq_id")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**31):
            raise InvalidInputError(f"must be an integer from 0 to 2^31-1, got {seq!r:.40}", field="seq_id")
        caller = body.get("session_id") if isinstance(body.get("session_id"), str) else None
        if seq is not None and (caller, seq) in sampler.seen:
            request_id, ids = sampler.seen[(caller, seq)]
            return {"request_id": request_id, "sample_sequence_ids": ids}
        prompt = wire.model_input_from_json(body.get("prompt"))
        params = wire.sampling_params_from_json(body.get("sampling_params") or {})
        num = body.get("num_samples", 1)
        target = body.get("target_prompt_logprobs")
        # the options are the engine's to check, as in-process (the same errors, naming the same fields)
        request = SampleRequest(prompt, num, params, bool(body.get("prompt_logprobs")),
                                topk_prompt_logprobs=body.get("topk_prompt_logprobs") or 0,
                                topk_sample_logprobs=body.get("topk_sample_logprobs") or 0,
                                prompt_logprobs_last_n=body.get("prompt_logprobs_last_n"),
                                target_prompt_logprobs=None if target is None else
                                wire.tensor_from_json(target, "target_prompt_logprobs", 1 << 22, pad=-1),
                                prompt_alt_tokens_k=body.get("prompt_alt_tokens_k") or 0)
        entry = self.sample(owner, sampler, request, lambda r: (wire.encode_sample_response(r), True))
        ids = [f"seq-{secrets.token_hex(8)}" for _ in range(int(num))]
        if seq is not None:
            sampler.seen[(caller, seq)] = (entry.request_id, ids)
            while len(sampler.seen) > _SEEN_PER_SAMPLER:
                sampler.seen.popitem(last=False)
        return {"request_id": entry.request_id, "sample_sequence_ids": ids}

    def sample(self, owner: str, sampler: ServedSampler, request: SampleRequest,
               encode: Callable[[Any], tuple[bytes | dict, bool]]) -> _Entry:
        """A sample request of `sampler` into the pool (both wire codecs); a refusal raises."""
        entry = self.new_entry(owner, sampler.session, "sample")
        self.launch(entry, lambda: self.backend.submit(sampler.handle.client_id, "sample", request), encode,
                    raise_invalid=True)
        return entry

    def release(self, owner: str, body: dict) -> dict:
        """trio's client closed a training or sampling client: retire it once its queue is empty."""
        public = body.get("id")
        found = self.trained.get(public) or self.samplers.get(public) if isinstance(public, str) else None
        if found is None or found.session.owner != owner:
            raise _not_found(f"client {public!r:.80}")
        if public in found.session.clients:
            found.session.clients.remove(public)
            with contextlib.suppress(PoolClosedError, ClientClosedError):
                self.backend.release(found.handle.client_id)
        assert isinstance(public, str)
        # freed now (its queued requests still run and answer): the model, its seq_id table
        if isinstance(found, ServedModel):
            found.seq.fail_held(wire_of(ClientClosedError(f"client {public} was closed before this request's turn")))
            self.trained.pop(public, None)
        else:
            self.samplers.pop(public, None)
        found.session.released.append(public)
        return {"released": public}

    # -- the REST catalog: this key's runs and checkpoints, as the key's backend lists them ------------
    def list_checkpoints(self, owner: str, model_id: str) -> dict:
        found = self.of(owner).call(ListCheckpoints(model_id))[:1000]  # a listing, bounded
        return {"checkpoints": [_json_safe(dataclasses.asdict(c)) for c in found]}

    def training_run(self, owner: str, model_id: str) -> dict:
        return _json_safe(dataclasses.asdict(self.of(owner).call(GetTrainingRun(model_id))))

    def training_runs(self, owner: str, limit: int, offset: int) -> dict:
        runs = self.of(owner).call(ListTrainingRuns())
        return {"training_runs": [_json_safe(dataclasses.asdict(r)) for r in runs[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> dict:
        found = self.of(owner).call(ListCheckpoints(None))[::-1]  # newest first, as in-process
        return {"checkpoints": [_json_safe(dataclasses.asdict(c)) for c in found[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}

    def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> dict:
        self.of(owner).call(DeleteCheckpoint(model_id, checkpoint_id))
        return {}

    def set_checkpoint_ttl(self, owner: str, model_id: str, checkpoint_id: str, body: dict) -> dict:
        self.of(owner).call(SetCheckpointTtl(model_id, checkpoint_id, body.get("ttl_seconds")))
        return {}

    def export_urls(self, owner: str, tinker_path: Any, base_url: str) -> dict:
        return self.exports.urls(owner, tinker_path, base_url)

    def weights_info(self, owner: str, body: dict) -> dict:
        return _json_safe(dataclasses.asdict(self.of(owner).call(WeightsInfo(body.get("tinker_path")))))

    # -- upkeep -------------------------------------------------------------------------------
    async def reap(self) -> None:
        """Expire silent sessions, forget old results (every second, on the loop)."""
        while not self.stopping:
            await asyncio.sleep(min(1.0, self.session_timeout_s / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.state == "live" and now - session.last_seen > self.session_timeout_s:
                    self.end_session(session, "expired", f"session {session.session_id} expired: no heartbeat "
                                                         f"for {self.session_timeout_s:g} s; its queued requests "
                                                         f"were cancelled")
            for rid, entry in list(self.entries.items()):
                kept = RETRIEVED_KEPT_S if entry.retrieved is not None else 600.0
                if entry.done.is_set() and now - (entry.retrieved or entry.created) > kept:
                    self.forget(rid)
            ended = [s for s in self.sessions.values() if s.state != "live" and now - s.last_seen > 600]
            for session in ended:  # tombstones answer "expired" for 10 minutes, then are forgotten
                del self.sessions[session.session_id]
                for cid in session.clients:
                    self.trained.pop(cid, None)
                    self.samplers.pop(cid, None)

    def shut_down(self) -> None:
        """Every pending future gets a `server` error now; every served client is released."""
        self.stopping = True
        why = wire_of(PoolClosedError("the server is shutting down; this request did not finish (one already in a "
                                    "cycle may have run)"), "server_shutdown")
        for entry in self.entries.values():
            if not entry.done.is_set():
                if entry.future is not None:
                    entry.future.cancel()
                entry.settle(error=why)
        for model in self.trained.values():
            model.seq.fail_held(why)
        for session in self.sessions.values():
            if session.state == "live":
                for cid in session.clients:
                    with contextlib.suppress(PoolClosedError, ClientClosedError):
                        self.backend.release(self._client_id(cid))
                session.state = "finished"
        for task in list(self._tasks):
            task.cancel()

    async def off_loop(self, work: Callable[[], Any]) -> Any:
        """`work()` on the catalog's thread (disk reads and writes of checkpoints), awaited."""
        return await self.loop.run_in_executor(self.catalog, work)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.catalog.shutdown(wait=True, cancel_futures=True)
        for backend in [self.backend, *self._owned.values()]:
            backend.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- telemetry (observers) -------------------------------------------------------------------
    def info(self) -> dict:
        pool = self.pool
        return {"name": pool.name, "min_cycle_s": pool.min_cycle_s, "device": pool.device_type,
                "cycle_index": pool.cycle_index, "models": self.models, "now": time.perf_counter(),
                "stats": dict(self.stats)}

    def totals(self) -> dict:
        t = self.pool.telemetry
        return {"total_cycles": t.total_cycles, "total_updates": t.total_updates, "total_tokens": t.total_tokens}


def _json_safe(value: Any) -> Any:
    """Datetimes as ISO 8601 (what the SDK's models parse), at any depth."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value.isoformat() if hasattr(value, "isoformat") else value


def _metadata(value: Any) -> dict[str, str] | None:
    """A model's user_metadata as the engine keeps it (strings only; anything else is dropped:
    the SDK sends what the user gave, and a label is no reason to refuse a model)."""
    if not isinstance(value, dict):
        return None
    return {str(k)[:200]: str(v)[:1000] for k, v in list(value.items())[:64]}
