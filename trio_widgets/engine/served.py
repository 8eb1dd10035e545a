"""What a served pool keeps for its remote clients, whatever the wire: sessions and their
heartbeats and TTL, the futures a client long-polls (and their retry deduplication), each model's
requests in seq_id order, per-key budgets, run and sampler slots, and the request aliases a client
chose. Protocol-neutral: a wire codec (trio_widgets/http/service.py and pytrio_wire.py) decodes a
request, asks these tables through the seam (`Backend.call(ServedTables(...))`, answered by
LocalBackend) and encodes what they answer; no codec keeps a table of its own.

On the server's event loop thread (futures settle there; `launch` hops back to it from the clock).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import itertools
import logging
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..backend import (
    Backend,
    CheckpointDir,
    CreateModelRequest,
    CreateSamplerRequest,
    FromStateRequest,
    ModelHandle,
    OpenSession,
    SampleRequest,
    ServedEntry,
    ServedModelView,
    ServedSamplerView,
    ServedSessionView,
)
from ..errors import ClientClosedError, InvalidInputError, PoolClosedError
from ..futures import APIFuture
from ..protocol import Refusal, WireError, names, not_found, row_of, wire_error
from ..tokenizers import MAX_TOKENIZER_FILE_BYTES, is_tokenizer_file
from .sequencer import Sequencer

__all__ = ["RETRIEVED_KEPT_S", "Entry", "ServedModel", "ServedSampler", "ServedSession", "ServedState"]

log = logging.getLogger("trio_widgets.http.server")  # (the server's log: one logger for what a server does)

_SEEN_PER_SAMPLER = 4096
_MAX_TOKENIZER_BYTES = 64 << 20
# How long an answered result stays retrievable: the tinker SDK reads a retrieve for up to 45 s and then
# asks again (an answer lost on the way, e.g. a connection its own garbage collection closed from
# another event loop), so this must outlast that. Unretrieved results stay 600 s.
RETRIEVED_KEPT_S = 120.0
_REFUSED = (InvalidInputError, PoolClosedError, ClientClosedError, Refusal)
Encode = Callable[[Any], tuple[bytes | dict, bool]]
T = TypeVar("T")
# The codecs see this state through the seam's protocol (trio_widgets.backend.ServedStateView): a row
# they hand back (typed there as a view) is one of this state's own, which a method that reads more of
# it than the view names asserts.


# -- the tables ---------------------------------------------------------------------------------

@dataclass
class Entry:
    """One request a client long-polls: its result, encoded once (by the codec's `encode`), or its error."""

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

    entry: Entry
    submit: Callable[[], APIFuture]
    encode: Encode


class _Ordered:
    """A model's requests in seq_id order: the pure Sequencer (trio_widgets/engine/sequencer.py)
    decides, this launches what it says and keeps its one timer. On the event loop's thread."""

    def __init__(self, state: ServedState):
        self.state = state
        self.seq: Sequencer[_Pending] = Sequencer(remember=lambda pending: pending.entry.request_id)
        self.timer: asyncio.TimerHandle | None = None

    def arrive(self, seq: Any, entry: Entry, submit: Callable[[], APIFuture], encode: Encode) -> str:
        """The request id the client gets: `entry`'s, or the first one's for a repeated seq_id."""
        arrival = self.seq.arrive(seq, _Pending(entry, submit, encode))
        if arrival.kind == "duplicate":
            self.state.stats["duplicates"] += 1
            return str(arrival.item)
        elif arrival.kind == "held":
            self.state.stats["held"] += 1
        else:
            try:
                self.state.launch(entry, submit, encode, raise_invalid=seq is not None)
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
            self.state.launch(pending.entry, pending.submit, pending.encode)

    def _time(self) -> None:
        if self.seq.waiting and self.timer is None:
            self.timer = self.state.loop.call_later(self.state.reorder_wait_s, self._skip_gap)
        elif not self.seq.waiting and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _skip_gap(self) -> None:
        self.timer = None
        if not self.seq.waiting:
            return
        first, missing, ready = self.seq.skip_gap()
        self.state.stats["gaps_skipped"] += 1
        log.info("seq_ids %d..%d never arrived within %.1f s; running what came after them",
                 first, missing, self.state.reorder_wait_s)
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
    model_requests: dict[int, Entry] = field(default_factory=dict)  # model_seq_id -> its create / load
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


# -- the state: every behaviour a served client observes, but the wire --------------------------------

class ServedState:
    """A served pool's tables (made by `LocalBackend` for `Backend.call(ServedTables(...))`).
    `backend`: the server's own backend (ops and releases); each API key gets its own (`of`)."""

    def __init__(self, backend: Backend, *, models: list[str], key_names: dict[str, str], session_timeout_s: float,
                 reorder_wait_s: float, max_sessions_per_key: int, max_clients_per_session: int,
                 max_futures_per_key: int, max_clients_per_key: int, max_state_bytes_per_key: int, id_tag: str):
        self.backend = backend
        self.pool = backend.pool
        self._owned: dict[str, Backend] = {}  # per API key (digest): its runs, checkpoints and listings
        self.models, self.key_names, self.id_tag = models, key_names, id_tag
        self.session_timeout_s = float(session_timeout_s)
        self.reorder_wait_s = float(reorder_wait_s)
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
        self.entries: dict[str, Entry] = {}
        self.unretrieved: dict[str, int] = {}  # per key: results not yet retrieved (bounded)
        self.stopping = False
        # what happened, for tests and benchmarks: submits, repeats answered from the table, early
        # arrivals held for their predecessors, gaps given up on, sessions expired
        self.stats = {"submitted": 0, "duplicates": 0, "held": 0, "gaps_skipped": 0, "sessions_expired": 0}
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set when the server starts
        name = self.pool.name
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"trio-serve-{name}")
        # the checkpoint catalog's disk work (listings, manifests, tokenizer files): never on the event
        # loop, whose heartbeats and long-polls must answer while a key lists thousands of checkpoints;
        # one thread of its own, so a flood of listings cannot hold up creating models either
        self.catalog = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"trio-serve-{name}-catalog")
        self.numbers = itertools.count(1)  # request ids, and any other number the codecs give out once
        self._tasks: set[asyncio.Task] = set()
        self._tokenizer_dirs: dict[str, str] = {}
        self._tmp: str | None = None  # tokenizers saved for the SDK's get_tokenizer (made on first use)

    def of(self, owner: str) -> Backend:
        """The backend of an API key (made on its first request; one per key the server was given)."""
        backend = self._owned.get(owner)
        if backend is None:
            backend = self._owned[owner] = self.pool.connect(session=False, owner=owner)
        return backend

    # -- sessions -----------------------------------------------------------------------
    def session(self, session_id: Any, owner: str, *, live: bool = True) -> ServedSession:
        """A session of `owner`'s (404 otherwise; 410 once expired, 404 once finished, if `live`);
        asking is a sign of life (a heartbeat)."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.owner != owner:
            raise not_found(f"session {session_id!r:.60}")
        if live and session.state != "live":
            why = "was finished" if session.state == "finished" else \
                f"expired (no heartbeat for {self.session_timeout_s:g} s)"
            raise Refusal(404 if session.state == "finished" else 410,
                          f"session {session_id} {why}: create a new ServiceClient",
                          code="client_closed" if session.state == "finished" else "session_expired")
        session.last_seen = time.monotonic()
        return session

    def create_session(self, owner: str, user_metadata: Any = None, display_name: Any = None) -> str:
        mine = sum(1 for s in self.sessions.values() if s.owner == owner and s.state == "live")
        if mine >= self.max_sessions_per_key:
            raise Refusal(400, f"this API key has {mine} live sessions, the server's limit "
                               f"(max_sessions_per_key); close some ServiceClients")
        session_id = names.new_session_id(self.id_tag)
        random = session_id[-16:]
        meta = user_metadata if isinstance(user_metadata, dict) else None
        # a person's name for the lanes: the SDKs' "name", a tinker-cookbook recipe's "recipe_name"
        named = [meta.get(k) for k in ("name", "run_name", "recipe_name")] if meta is not None else []
        name = next((n for n in named if isinstance(n, str) and n.strip()), None) or display_name \
            or self.key_names.get(owner)
        label = str(name)[:40] if name else f"sess-{random[:8]}"
        self.sessions[session_id] = ServedSession(session_id, owner, label, named=bool(name))
        # the pool's one session table lists it, with the runs and samplers it makes
        self.backend.call(OpenSession(session_id, meta, str(display_name) if display_name else None))
        return session_id

    def end_session(self, session: ServedSessionView, state: str, why: str) -> None:
        """Finish or expire a session: its queued requests are cancelled (expire) or left to run
        (finish), and its clients are retired once nothing of theirs is queued.

        The new state is set last: `Server.sessions()` reads it from other threads, and "expired"
        promises that its queued requests are already cancelled. (On the loop's thread nothing
        else runs in between.)"""
        expired = wire_error(ClientClosedError(why), code="session_expired")
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

    def finish(self, session_id: Any, owner: str, why: str) -> ServedSession:
        """A client finished its session (again: nothing more)."""
        session = self.session(session_id, owner, live=False)
        if session.state == "live":
            self.end_session(session, "finished", why)
        return session

    def _client_id(self, public_id: str) -> str:
        found = self.trained.get(public_id) or self.samplers.get(public_id)
        return found.handle.client_id if found is not None else public_id

    # -- futures --------------------------------------------------------------------------
    def new_entry(self, owner: str, session: ServedSessionView | None, kind: str) -> Entry:
        assert session is None or isinstance(session, ServedSession)
        pending = self.unretrieved.get(owner, 0)
        if pending >= self.max_futures_per_key:
            raise Refusal(400, f"this API key has {pending} results not yet retrieved, the server's limit "
                               f"(max_futures_per_key): retrieve (await) some before submitting more")
        entry = Entry(names.request_id(next(self.numbers), self.id_tag), owner, session, kind)
        self.entries[entry.request_id] = entry
        self.unretrieved[owner] = pending + 1
        return entry

    def entry(self, request_id: Any, owner: str) -> Entry:
        """A request of `owner`'s (404 otherwise); asking for it is a sign of life of its session."""
        entry = self.entries.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.owner != owner:
            raise not_found(f"request {request_id!r:.60}")
        return entry

    def forget(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None and entry.retrieved is None:
            self.unretrieved[entry.owner] -= 1

    def mark_retrieved(self, entry: ServedEntry) -> None:
        assert isinstance(entry, Entry)
        if entry.retrieved is None:
            entry.retrieved = time.monotonic()
            self.unretrieved[entry.owner] -= 1

    async def wait(self, entry: ServedEntry, timeout_s: float) -> bool:
        """Long-poll `entry` for up to `timeout_s`; True (and retrieved) once it is settled."""
        assert isinstance(entry, Entry)
        if entry.session is not None:
            # a request arriving is a sign of life; one held open is not (a killed client's polls
            # stay open until they time out)
            entry.session.last_seen = time.monotonic()
        if not entry.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.done.wait(), timeout_s)
        if not entry.done.is_set():
            return False
        self.mark_retrieved(entry)
        return True

    def cancel(self, request_id: Any, owner: str) -> bool:
        entry = self.entry(request_id, owner)
        return bool(entry.future is not None and entry.future.cancel())

    def launch(self, entry: Entry, submit: Callable[[], APIFuture], encode: Encode,
               raise_invalid: bool = False) -> None:
        """Put a request into the pool now; its future settles `entry` (on the loop's thread)."""
        if self.stopping:
            entry.settle(error=wire_error(PoolClosedError("the server is shutting down"), code="server_shutdown"))
            return
        try:
            future = submit()
            self.stats["submitted"] += 1
        except _REFUSED as exc:
            if raise_invalid:
                self.forget(entry.request_id)
                raise
            entry.settle(error=wire_error(exc))
            return
        entry.future = future
        loop = self.loop

        def delivered(f: APIFuture) -> None:  # on the pool's clock thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
                loop.call_soon_threadsafe(self._finish, entry, f, encode)

        future.add_done_callback(delivered)

    def _finish(self, entry: Entry, future: APIFuture, encode: Encode) -> None:
        entry.cycle = future.cycle
        if future.cancelled():
            if not entry.done.is_set():
                entry.settle(error=WireError(400, "cancelled", "user", "cancelled before it ran"))
            return
        exc = future.exception()
        if exc is not None:
            error = wire_error(exc)
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

    def in_background(self, entry: Entry, work: Callable[[], Any], then: Callable[[Any], dict]) -> None:
        """Run blocking `work` (loading models, reading checkpoints) on the server's worker
        threads, then `then(result)` on the loop; both settle `entry`."""
        async def run() -> None:
            try:
                value = await self.loop.run_in_executor(self.executor, work)
                entry.settle(then(value))
            except _REFUSED as exc:
                entry.settle(error=wire_error(exc))
            except Exception as exc:
                log.exception("%s failed", entry.kind)
                entry.settle(error=WireError(500, "internal", "server",
                                             f"{entry.kind} failed: {type(exc).__name__}: {exc}"))

        task = self.loop.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` on the catalog's thread (disk reads and writes of checkpoints), awaited."""
        return await self.loop.run_in_executor(self.catalog, work)

    # -- models and samplers ---------------------------------------------------------------
    def model(self, model_id: Any, owner: str) -> ServedModel:
        model = self.trained.get(model_id) if isinstance(model_id, str) else None
        if model is None or model.session.owner != owner:
            self._closed(model_id, owner)
            raise not_found(f"model {model_id!r:.80}")
        self.session(model.session.session_id, owner)  # 404 / 410 once the session ended
        return model

    def sampler(self, sampler_id: Any, owner: str) -> ServedSampler:
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler is None or sampler.session.owner != owner:
            self._closed(sampler_id, owner)
            raise not_found(f"sampling session {sampler_id!r:.80}")
        self.session(sampler.session.session_id, owner)
        return sampler

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

    def check_model_slot(self, session: ServedSessionView, n: Any, field_name: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or not (0 <= n < 10**9):
            raise InvalidInputError(f"must be an integer from 0, got {n!r:.40}", field=field_name)
        if len(session.clients) >= self.max_clients_per_session:
            raise Refusal(400, f"this session has {len(session.clients)} clients, the server's limit "
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
            raise Refusal(410, f"session {session.session_id} ended while the {what} was being created",
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

    def model_label(self, session: ServedSessionView, n: int, meta: Any) -> str:
        """A lane's label says whose it is in the words the user gave: "ada" (a named session's
        first model), "grace" (a named model), "ada · grace" (both), "ada:train:1" (a named
        session's later models); sess-1db27469:train:0 only when nothing was named."""
        assert isinstance(session, ServedSession)
        name = meta.get("name") if isinstance(meta, dict) else None
        name = str(name).strip()[:40] if isinstance(name, str | int) and str(name).strip() else None
        if name:
            return f"{session.label} · {name}" if session.named and name != session.label else name
        return session.label if session.named and n == 0 else names.run_id(session.label, n)

    def run_slot(self, session: ServedSessionView, n: Any, meta: Any) -> tuple[int, str, str, Entry | None]:
        """Run `n` of `session` (a model_seq_id; the session's and its key's budgets checked): its
        public id, its lane's label, and the entry of its first request if this is a retry."""
        assert isinstance(session, ServedSession)
        n = self.check_model_slot(session, n, "model_seq_id")
        return n, names.run_id(session.session_id, n), self.model_label(session, n, meta), session.model_requests.get(n)

    def reserve_run(self, owner: str, session: ServedSessionView) -> int:
        """The session's next run number, held for a run made later (PyTRIO's control plane names a
        run before its actor's init_run makes it): a "reserved" entry, settled at once, in its slot. It
        counts against the key's unretrieved results until open_run replaces it (or the reaper drops it)."""
        assert isinstance(session, ServedSession)
        n = self.check_model_slot(session, len(session.model_requests), "model_seq_id")
        entry = self.new_entry(owner, session, "reserved")
        session.model_requests[n] = entry
        entry.settle({})
        return n

    def open_run(self, owner: str, session: ServedSessionView, n: int, request: CreateModelRequest | FromStateRequest,
                 label: str, then: Callable[[dict], dict] = lambda out: out, kind: str = "create_model") -> Entry:
        """Run `n` of `session` (a new adapter, or one from a checkpoint) made on the worker threads;
        its entry settles with `then` of the registered model (both wire codecs)."""
        assert isinstance(session, ServedSession)
        model_id = names.run_id(session.session_id, n)
        entry = self.new_entry(owner, session, kind)
        session.model_requests[n] = entry
        self.in_background(entry, lambda: self.of(owner).open(request),
                           lambda handle: then(self._register_model(session, model_id, handle, label)))
        return entry

    def sampler_slot(self, session: ServedSessionView, n: Any) -> int:
        """A new sampler's sampling_session_seq_id `n` in `session` (its budgets checked; unused)."""
        assert isinstance(session, ServedSession)
        self.check_model_slot(session, n, "sampling_session_seq_id")
        if n in session.sampler_ids:
            raise InvalidInputError(f"sampling_session_seq_id {n} was used already in this session",
                                    field="sampling_session_seq_id")
        return n

    def register_sampler(self, session: ServedSessionView, sampler_id: str, handle: ModelHandle,
                         model_path: str | None, n: int) -> None:
        assert isinstance(session, ServedSession)
        self._admit(session, handle, "sampler")
        self.samplers[sampler_id] = ServedSampler(sampler_id, session, handle, model_path)
        self._lane(sampler_id, handle)
        session.sampler_ids[n] = sampler_id
        session.clients.append(sampler_id)

    async def open_sampler(self, owner: str, session: ServedSessionView, n: Any, model_path: Any, base: Any) -> str:
        """Sampler `n` of `session` over saved weights (`model_path`, this key's) or a base model, made
        once: a retry, or a concurrent one, gets the first."""
        assert isinstance(session, ServedSession)
        n = self.check_model_slot(session, n, "sampling_session_seq_id")
        if n not in session.sampler_ids:
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
                self.register_sampler(session, sampler_id, handle, model_path, n)
        return session.sampler_ids[n]

    def sample(self, owner: str, sampler: ServedSamplerView, request: Any, encode: Encode) -> Entry:
        """A sample request of `sampler` into the pool (both wire codecs); a refusal raises."""
        entry = self.new_entry(owner, sampler.session, "sample")
        self.launch(entry, lambda: self.backend.submit(sampler.handle.client_id, "sample", request), encode,
                    raise_invalid=True)
        return entry

    def sample_once(self, owner: str, sampler: ServedSamplerView, caller: str | None, seq: Any,
                    decode: Callable[[], SampleRequest], encode: Encode) -> tuple[str, list[str]]:
        """A sample request deduplicated by (caller, seq_id): a retry gets the first one's request
        and sequence ids, and runs (and decodes) nothing."""
        assert isinstance(sampler, ServedSampler)
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**31):
            raise InvalidInputError(f"must be an integer from 0 to 2^31-1, got {seq!r:.40}", field="seq_id")
        if seq is not None and (caller, seq) in sampler.seen:
            return sampler.seen[(caller, seq)]
        request = decode()
        entry = self.sample(owner, sampler, request, encode)
        found = (entry.request_id, [f"seq-{secrets.token_hex(8)}" for _ in range(int(request.num_samples))])
        if seq is not None:
            sampler.seen[(caller, seq)] = found
            while len(sampler.seen) > _SEEN_PER_SAMPLER:
                sampler.seen.popitem(last=False)
        return found

    def release(self, owner: str, public: Any) -> None:
        """A client closed a training or sampling client: retire it once its queue is empty."""
        found = self.trained.get(public) or self.samplers.get(public) if isinstance(public, str) else None
        if found is None or found.session.owner != owner:
            raise not_found(f"client {public!r:.80}")
        if public in found.session.clients:
            found.session.clients.remove(public)
            with contextlib.suppress(PoolClosedError, ClientClosedError):
                self.backend.release(found.handle.client_id)
        assert isinstance(public, str)
        # freed now (its queued requests still run and answer): the model, its seq_id table
        if isinstance(found, ServedModel):
            found.seq.fail_held(wire_error(ClientClosedError(f"client {public} was closed before this request's turn")))
            self.trained.pop(public, None)
        else:
            self.samplers.pop(public, None)
        found.session.released.append(public)

    # -- requests of a model, in seq_id order -------------------------------------------------
    @contextlib.contextmanager
    def consumes(self, model: ServedModelView, seq: Any) -> Iterator[None]:
        """Around the checks of a model's request: a refusal still uses up its seq_id."""
        assert isinstance(model, ServedModel)
        try:
            yield
        except (InvalidInputError, Refusal):
            model.seq.refuse(seq)
            raise

    def sequenced(self, model: ServedModelView, owner: str, seq: Any, op: str, request: Any, encode: Encode) -> dict:
        assert isinstance(model, ServedModel)
        entry = self.new_entry(owner, model.session, op)
        client_id = model.handle.client_id
        found = model.seq.arrive(seq, entry, lambda: self.of(owner).submit(client_id, op, request), encode)
        if found != entry.request_id:  # a repeat: the first one's id, nothing run
            self.forget(entry.request_id)
        return {"request_id": found, "model_id": model.model_id}

    def refuse_seq(self, owner: str, model_id: Any, seq: Any) -> None:
        """A request of a model refused before its checks (unsupported): its seq_id is used up."""
        model = self.trained.get(model_id) if isinstance(model_id, str) else None
        if model is not None and model.session.owner == owner:
            model.seq.refuse(seq)  # the SDK used a seq_id for it: don't wait for it

    # -- tokenizers ---------------------------------------------------------------------------
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
        why = wire_error(PoolClosedError("the server is shutting down; this request did not finish (one already in "
                                         "a cycle may have run)"), code="server_shutdown")
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

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.catalog.shutdown(wait=True, cancel_futures=True)
        for backend in [self.backend, *self._owned.values()]:
            backend.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
