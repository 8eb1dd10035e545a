"""What stands in front of a served pool's routes, so that one browser tab, one slow socket or
one participant cannot take the pool from the others:

* **Host** must be a name this server answers to: an IP address (a DNS-rebinding page has only
  a name), a loopback name, this machine's own names, or one of `allowed_hosts` ("*": any).
  A page that rebinds attacker.example to 127.0.0.1 meets a 403, as Jupyter's own server does.
* **Origin**: browsers send it with a foreign page's requests; the SDKs and trio's clients never
  do. A request with one is refused unless it is in `allowed_origins`, the telemetry stream too.
* **Content-Type** of a POST or PUT is JSON (or protobuf, for forward_backward): the types a
  page may send cross-site without a preflight (text/plain, forms) are refused.
* **Connections** (`Connections`, wrapped around uvicorn's protocol): a connection waiting for
  a request head (new, or idle between requests) is closed after `header_timeout_s`, at most
  `max_waiting` wait at once (a new one closes the oldest waiting one, so a flood of silent
  sockets cannot keep a keyed client out). A connection belongs to its address until a request
  on it shows a configured key; from then on to that key. One address holds at most
  `max_per_address` connections of no key, one key at most `max_per_key` (its extra requests
  are a 429 naming the limit, and their connections closed: one key trickling bodies on
  thousands of sockets holds only its own share), and the server at most `max_total` (a new
  one closes the oldest waiting one, or is refused). An address opens at most
  `new_per_address_s` connections a second: past that a new one is read only when its turn comes
  (keyless sockets opened and closed at speed cost a neighbour little), and refused when that is
  more than a second away. A refused connection is answered a 429
  or 503 naming the limit before it is closed; nothing is answered a bare 503 for being busy
  (uvicorn's own `limit_concurrency` is off: these bounds are the server's).
* **Bodies** (`Budget`): bytes of request bodies being read are bounded per key and in all;
  a body that stalls for `body_timeout_s` is dropped with a 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import socket
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..protocol import WireError
from .auth import HttpError, api_key_of, error_response

__all__ = ["Budget", "Connections", "Pace", "Policy", "guarded_protocol", "policy_app", "read_body"]

log = logging.getLogger("trio_widgets.http.server")

_JSON, _PROTOBUF = "application/json", "application/x-protobuf"
_MSGPACK = "application/msgpack"  # PyTRIO's actor events
_LOOKED_AT = frozenset((b"host", b"origin", b"content-type", b"content-length", b"transfer-encoding",
                        b"sec-fetch-site", b"x-api-key", b"authorization"))
# what a browser says of a request a page of another site made (Fetch Metadata); no client of ours
# sends the header, and a page's no-cors GET carries no Origin, only this
_FROM_ANOTHER_SITE = frozenset(("cross-site", "same-site"))

T = TypeVar("T")


def _machine_names() -> set[str]:
    names = {"localhost"}
    with contextlib.suppress(OSError):
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return names


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _host_name(value: str) -> str:
    """`host[:port]` or `[v6]:port` -> the host, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class Policy:
    """Which Host and Origin headers the server answers (see the module's doc)."""

    allowed_hosts: frozenset[str]
    allowed_origins: frozenset[str]
    #: path prefixes a keyed server answers without a key (health, signed download URLs)
    keyless_paths: tuple[str, ...] = ("/api/v1/healthz", "/api/v1/trio/export/")

    @classmethod
    def of(cls, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str] | None,
           keyless_paths: Iterable[str] | None = None) -> Policy:
        hosts = {h.strip().lower() for h in (allowed_hosts or ()) if h.strip()}
        origins = {o.strip().lower().rstrip("/") for o in (allowed_origins or ()) if o.strip()}
        if keyless_paths is None:
            return cls(frozenset(hosts | _machine_names()), frozenset(origins))
        return cls(frozenset(hosts | _machine_names()), frozenset(origins), tuple(keyless_paths))

    def host_ok(self, host: str) -> bool:
        return _host_ok(self, host)

    def origin_ok(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.strip().lower().rstrip("/") in self.allowed_origins


@functools.lru_cache(maxsize=256)  # asked on every request; a client sends the same Host each time
def _host_ok(policy: Policy, host: str) -> bool:
    name = _host_name(host)
    # (not `*.localhost`: a browser resolves any such name to this machine, so a page of
    # evil.localhost is a page of another site that reaches us; list one in allowed_hosts to allow it)
    return "*" in policy.allowed_hosts or _is_ip(name) or name in policy.allowed_hosts


def _refuse(status: int, message: str, code: str) -> JSONResponse:
    # the routes' own error body; the connection is closed too: a refused client has no reason to keep it
    return error_response(WireError(status, code, "user", message), close=True)


def policy_app(app: Any, policy: Policy, connections: Connections | None = None) -> Any:
    """`app` behind the Host / Origin / Content-Type checks (a plain ASGI wrapper)."""
    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        # only the headers looked at here (ASGI servers give names in lower case)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ()) if k in _LOOKED_AT}
        host, origin = headers.get("host", ""), headers.get("origin")
        over, key = None, api_key_of(headers)
        owner = connections.identify(key) if connections is not None else None
        if connections is not None and scope.get("client"):
            over = connections.started(tuple(scope["client"]), owner)
        if over is not None:
            refused = _refuse(429, over, "too_many_connections")
        elif not policy.host_ok(host):
            refused = _refuse(403, f"this server does not answer to the host name {host[:80]!r} (a web page may "
                                   f"have pointed that name here); serve with --allowed-hosts {_host_name(host)[:80]} "
                                   f"(allowed_hosts=[...]) if it is yours", "forbidden_host")
        elif origin is None and headers.get("sec-fetch-site", "").strip().lower() in _FROM_ANOTHER_SITE:
            refused = _refuse(403, "requests a web page of another site made are refused (Sec-Fetch-Site "
                                   f"{headers['sec-fetch-site'][:20]!r}, no Origin): the SDKs and trio's clients are "
                                   "no web page", "forbidden_origin")
        elif origin is not None and not policy.origin_ok(origin):
            refused = _refuse(403, f"requests from a web page (Origin {origin[:80]!r}) are refused: the SDKs and "
                                   f"trio's clients send none; serve with allowed_origins=[...] to allow a page",
                              "forbidden_origin")
        elif scope["method"] in ("POST", "PUT") and not _typed(headers.get("content-type", ""), headers):
            refused = _refuse(415, f"a {scope['method']} body must be {_JSON} (or {_PROTOBUF} for "
                                   f"forward_backward), got Content-Type {headers.get('content-type', '')[:60]!r}",
                              "unsupported_media_type")
        elif (connections is not None and connections.keyed and owner is None
              and not scope["path"].startswith(policy.keyless_paths)):
            # a keyed server's route without a configured key: refused here, before the routes, at the
            # cost of a few dict lookups (keyless sockets opened and closed at speed cost the pool
            # little: issue 36 point 5), logged once per 100
            connections.stats["unauthenticated"] += 1
            if connections.stats["unauthenticated"] % 100 == 1:
                log.info("refused %s %s: 401 without a configured API key (%d such so far)", scope["method"],
                         scope["path"][:80], connections.stats["unauthenticated"])
            refused = _refuse(401, "missing API key: send it in the X-API-Key header" if not key
                              else "invalid API key", "unauthenticated")
        else:
            return await app(scope, receive, send)
        await refused(scope, receive, send)

    return guarded


def _typed(ctype: str, headers: dict[str, str]) -> bool:
    media = ctype.split(";", 1)[0].strip().lower()
    if media in (_JSON, _PROTOBUF, _MSGPACK):
        return True
    # no body at all needs no type (a bodiless POST is no form a page could forge with data)
    return not media and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers


class Connections:
    """Which connections wait for a request head; connections per address (of no key), per key and
    in all; on the event loop's thread only (uvicorn's protocols call it from there).

    `identify(key)` names the owner a presented API key stands for when it is one of the server's
    configured keys, else None (without configured keys every key is anyone's: a connection then
    stays its address's)."""

    def __init__(self, *, header_timeout_s: float, max_waiting: int, max_per_address: int,
                 max_per_key: int = 512, max_total: int = 4096, new_per_address_s: float = 256.0,
                 identify: Callable[[str | None], str | None] | None = None, keyed: bool = False):
        self.header_timeout_s = header_timeout_s
        self.max_waiting = max_waiting
        self.max_per_address = max_per_address
        self.max_per_key = max_per_key
        self.max_total = max_total
        self.identify: Callable[[str | None], str | None] = identify or (lambda key: None)
        self.keyed = keyed  # the server has configured keys: a request of none is refused in front
        self.waiting: OrderedDict[Any, tuple[float, asyncio.Transport]] = OrderedDict()  # since when
        self._sweeper: asyncio.TimerHandle | None = None
        self.per_address: Counter[str] = Counter()  # connections of no key yet
        self.per_key: Counter[str] = Counter()  # connections a configured key's request was seen on
        self.total = 0
        # new connections per address: a token bucket of new_per_address_s a second (as many at once);
        # past it a new connection waits its turn, unread (up to a second's worth), or is refused
        self.new_per_address_s = float(new_per_address_s)
        self._bucket: dict[str, tuple[float, float]] = {}  # address -> (tokens, when)
        self.by_peer: dict[tuple, Any] = {}
        self.stats = {"refused": 0, "evicted": 0, "timed_out": 0, "refused_per_key": 0, "unauthenticated": 0,
                      "deferred": 0}

    def admit(self, protocol: Any, transport: asyncio.Transport) -> bool:
        """Whether a new connection may stay; a refused one has been answered (a 429 or 503 naming the
        limit) and closed."""
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        if self.per_address[address] >= self.max_per_address:
            if not self.stats["refused"] % 100:
                log.warning("%s holds %d connections of no key, the server's limit (max_connections_per_address): "
                            "refusing more", address, self.per_address[address])
            self.stats["refused"] += 1
            _answer_and_close(transport, 429, f"this address holds {self.per_address[address]} connections, the "
                                              f"server's limit (max_connections_per_address); close some first",
                              "too_many_connections")
            return False
        delay = self._turn(address)
        if delay is None:
            self.stats["refused"] += 1
            _answer_and_close(transport, 429, f"this address opens more than {self.new_per_address_s:g} connections a "
                                              f"second, the server's limit (max_new_connections_per_address_s); "
                                              f"keep connections open and reuse them", "too_many_connections")
            return False
        if self.total >= self.max_total and not self._evict_oldest_waiting():
            self.stats["refused"] += 1
            _answer_and_close(transport, 503, f"the server holds {self.total} connections, its limit "
                                              f"(max_connections), none of them idle; try again shortly", "busy")
            return False
        self.per_address[address] += 1
        self.total += 1
        protocol._trio_address = address
        protocol._trio_owner = None
        protocol._trio_peer = tuple(peer) if isinstance(peer, (tuple, list)) else None
        if protocol._trio_peer is not None:
            self.by_peer[protocol._trio_peer] = protocol
        self.wait(protocol, transport)
        protocol._trio_delay = delay  # > 0: read once its turn comes (Guarded holds what arrives till then)
        if delay > 0:
            self.stats["deferred"] += 1
        return True

    def _turn(self, address: str) -> float | None:
        """Seconds until a new connection of `address` may be read (0: now), or None: refused (its
        turn is more than a second away)."""
        rate = self.new_per_address_s
        now = asyncio.get_running_loop().time()
        tokens, when = self._bucket.get(address, (rate, now))
        tokens = min(rate, tokens + (now - when) * rate)
        if tokens < 1.0 - rate:  # a second's worth already waits
            return None
        self._bucket[address] = (tokens - 1.0, now)
        if len(self._bucket) > 4096:  # addresses whose bucket is full again are forgotten
            self._bucket = {a: (t, w) for a, (t, w) in self._bucket.items() if t + (now - w) * rate < rate}
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / rate

    def wait(self, protocol: Any, transport: asyncio.Transport) -> None:
        """`protocol` waits for a request head now (new, or idle after a response)."""
        if transport.is_closing():
            return
        self.waiting.pop(protocol, None)
        loop = asyncio.get_running_loop()
        self.waiting[protocol] = (loop.time(), transport)
        if self._sweeper is None:  # one timer for all (not one per request)
            self._sweeper = loop.call_later(self.header_timeout_s / 4, self._sweep)
        while len(self.waiting) > self.max_waiting:  # the oldest silent one makes room for a new one
            self._evict_oldest_waiting()

    def _evict_oldest_waiting(self) -> bool:
        if not self.waiting:
            return False
        _, (_, oldest) = self.waiting.popitem(last=False)
        self.stats["evicted"] += 1
        oldest.close()
        return True

    def started(self, peer: tuple, owner: str | None = None) -> str | None:
        """A request head arrived from `peer`, of `owner` (what `identify` made of its key, if anything):
        None, or why it is refused (the owner holds max_per_key connections already)."""
        protocol = self.by_peer.get(peer)
        if protocol is None:
            return None
        self._unwait(protocol)
        if protocol._trio_owner is not None or owner is None:
            return None
        if self.per_key[owner] >= self.max_per_key:
            self.stats["refused_per_key"] += 1
            if not (self.stats["refused_per_key"] - 1) % 100:
                log.warning("an API key (owner %s) holds %d connections, the server's limit "
                            "(max_connections_per_key): refusing more", owner[:12], self.per_key[owner])
            return (f"this API key holds {self.per_key[owner]} connections to the server, its limit "
                    f"(max_connections_per_key); close some (or wait for your requests to finish) first")
        # the connection is the key's now, no longer its address's
        self.per_address[protocol._trio_address] -= 1
        if self.per_address[protocol._trio_address] <= 0:
            del self.per_address[protocol._trio_address]
        self.per_key[owner] += 1
        protocol._trio_owner = owner
        return None

    def gone(self, protocol: Any) -> None:
        self._unwait(protocol)
        self.total -= 1
        owner = getattr(protocol, "_trio_owner", None)
        address = getattr(protocol, "_trio_address", None)
        if owner is not None:
            self.per_key[owner] -= 1
            if self.per_key[owner] <= 0:
                del self.per_key[owner]
        elif address is not None:
            self.per_address[address] -= 1
            if self.per_address[address] <= 0:
                del self.per_address[address]
        peer = getattr(protocol, "_trio_peer", None)
        if peer is not None and self.by_peer.get(peer) is protocol:
            del self.by_peer[peer]

    def _unwait(self, protocol: Any) -> None:
        self.waiting.pop(protocol, None)

    def _sweep(self) -> None:
        """Close the connections that waited longer than header_timeout_s (oldest first)."""
        loop = asyncio.get_running_loop()
        self._sweeper = None
        now = loop.time()
        while self.waiting:
            protocol, (since, transport) = next(iter(self.waiting.items()))
            if now - since < self.header_timeout_s:
                break
            del self.waiting[protocol]
            self.stats["timed_out"] += 1
            transport.close()
        if self.waiting:
            self._sweeper = loop.call_later(self.header_timeout_s / 4, self._sweep)


def _answer_and_close(transport: asyncio.Transport, status: int, message: str, code: str) -> None:
    """A refusal written straight to a connection no request arrived on yet (the client reads it as
    the answer to the request it sends), then closed."""
    body = json.dumps({"detail": message, "code": code, "field": None}).encode()
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "Refused")
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode("ascii")
    with contextlib.suppress(Exception):
        transport.write(head + body)
    transport.close()


def guarded_protocol(base: type, connections: Connections) -> type:
    """uvicorn's HTTP protocol class `base`, reporting to `connections` (a subclass: uvicorn
    takes a protocol class for `http=`)."""

    class Guarded(base):
        _trio_admitted = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            if not connections.admit(self, transport):  # answered, naming the limit, and closed
                return
            self._trio_admitted = True
            super().connection_made(transport)
            if self._trio_delay > 0:  # its turn comes later: what arrives till then is held, unread
                self._trio_held: list[bytes] | None = []
                asyncio.get_running_loop().call_later(self._trio_delay, self._trio_turn)

        def _trio_turn(self) -> None:
            held, self._trio_held = self._trio_held, None
            if self.transport.is_closing():
                return
            with contextlib.suppress(Exception):
                self.transport.resume_reading()
            if held:
                super().data_received(b"".join(held))

        def data_received(self, data: bytes) -> None:
            if not self._trio_admitted:
                return
            held = getattr(self, "_trio_held", None)
            if held is not None:  # (one read at most: reading pauses)
                held.append(data)
                self.transport.pause_reading()
                return
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._trio_admitted:
                connections.gone(self)
                super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._trio_admitted and not self.pipeline:
                connections.wait(self, self.transport)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class Budget:
    """Bytes of request bodies being read now, per key and in all (event loop thread only)."""

    def __init__(self, *, per_key: int, total: int):
        self.per_key, self.total = per_key, total
        self.held: Counter[str] = Counter()
        self.sum = 0

    @contextlib.contextmanager
    def reading(self, owner: str) -> Iterator[Callable[[int], None]]:
        """Within: `take(n)` for each n bytes read; all are given back at the end."""
        mine = 0

        def take(n: int) -> None:
            nonlocal mine
            if self.held[owner] + n > self.per_key:
                raise HttpError(429, f"this API key is sending {self.held[owner] + n} bytes of request bodies at "
                                     f"once, more than the server's limit of {self.per_key} "
                                     f"(max_inflight_bytes_per_key); wait for some to finish", code="rate_limited")
            if self.sum + n > self.total:
                raise HttpError(503, f"the server is reading {self.sum + n} bytes of request bodies at once, its "
                                     f"limit (max_inflight_bytes); try again shortly", code="busy")
            self.held[owner] += n
            self.sum += n
            mine += n

        try:
            yield take
        finally:
            self.sum -= mine
            self.held[owner] -= mine
            if self.held[owner] <= 0:
                del self.held[owner]


class Pace:
    """One key's catalog work (listings, deletes, TTLs: disk and JSON on the catalog's thread, with
    the GIL) one job at a time, and its next job not before it has rested as long as the last one
    took: a key listing 2,000 checkpoints back to back gets at most half of that thread, and the
    clock, which needs the GIL too, keeps its neighbours' cycles (event loop thread only)."""

    def __init__(self, keys: int = 4096):
        self.keys = keys
        self.locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.ready: OrderedDict[str, float] = OrderedDict()  # key -> when its next job may start

    async def run(self, owner: str, job: Callable[[], Awaitable[T]]) -> T:
        lock = self.locks.get(owner)
        if lock is None:
            lock = self.locks[owner] = asyncio.Lock()
        async with lock:
            rest = self.ready.pop(owner, 0.0) - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
            start = time.monotonic()
            try:
                return await job()
            finally:
                now = time.monotonic()
                self.ready[owner] = now + min(now - start, 1.0)
                while len(self.ready) > self.keys:
                    self.ready.popitem(last=False)


async def read_body(request: Request, service: Any, owner: str) -> bytes:
    """The body, bounded in size (max_body_bytes), in bytes held while it arrives (per key and in
    all: a stalled body holds its bytes: `service.budget`, a `Budget`) and in time: a body that
    stalls for body_timeout_s is a 408. (`service`: the server's Service, which routes to here.)"""
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
