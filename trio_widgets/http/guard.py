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
  sockets cannot keep a keyed client out), and one address holds at most `max_per_address`.
* **Bodies** (`Budget`): bytes of request bodies being read are bounded per key and in all;
  a body that stalls for `body_timeout_s` is dropped with a 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from ..protocol import WireError
from .auth import HttpError, error_response

__all__ = ["Budget", "Connections", "Policy", "guarded_protocol", "policy_app"]

log = logging.getLogger("trio_widgets.http.server")

_JSON, _PROTOBUF = "application/json", "application/x-protobuf"
_LOOKED_AT = frozenset((b"host", b"origin", b"content-type", b"content-length", b"transfer-encoding",
                        b"sec-fetch-site"))
# what a browser says of a request a page of another site made (Fetch Metadata); no client of ours
# sends the header, and a page's no-cors GET carries no Origin, only this
_FROM_ANOTHER_SITE = frozenset(("cross-site", "same-site"))


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

    @classmethod
    def of(cls, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str] | None) -> Policy:
        hosts = {h.strip().lower() for h in (allowed_hosts or ()) if h.strip()}
        origins = {o.strip().lower().rstrip("/") for o in (allowed_origins or ()) if o.strip()}
        return cls(frozenset(hosts | _machine_names()), frozenset(origins))

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
        if connections is not None and scope.get("client"):
            connections.started(tuple(scope["client"]))
        # only the headers looked at here (ASGI servers give names in lower case)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ()) if k in _LOOKED_AT}
        host, origin = headers.get("host", ""), headers.get("origin")
        if not policy.host_ok(host):
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
        else:
            return await app(scope, receive, send)
        await refused(scope, receive, send)

    return guarded


def _typed(ctype: str, headers: dict[str, str]) -> bool:
    media = ctype.split(";", 1)[0].strip().lower()
    if media in (_JSON, _PROTOBUF):
        return True
    # no body at all needs no type (a bodiless POST is no form a page could forge with data)
    return not media and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers


class Connections:
    """Which connections wait for a request head, per address counts; on the event loop's
    thread only (uvicorn's protocols call it from there)."""

    def __init__(self, *, header_timeout_s: float, max_waiting: int, max_per_address: int):
        self.header_timeout_s = header_timeout_s
        self.max_waiting = max_waiting
        self.max_per_address = max_per_address
        self.waiting: OrderedDict[Any, tuple[float, asyncio.Transport]] = OrderedDict()  # since when
        self._sweeper: asyncio.TimerHandle | None = None
        self.per_address: Counter[str] = Counter()
        self.by_peer: dict[tuple, Any] = {}
        self.stats = {"refused": 0, "evicted": 0, "timed_out": 0}

    def admit(self, protocol: Any, transport: asyncio.Transport) -> bool:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        if self.per_address[address] >= self.max_per_address:
            if not self.stats["refused"] % 100:
                log.warning("%s holds %d connections, the server's limit (max_connections_per_address): "
                            "refusing more", address, self.per_address[address])
            self.stats["refused"] += 1
            return False
        self.per_address[address] += 1
        protocol._trio_address = address
        protocol._trio_peer = tuple(peer) if isinstance(peer, (tuple, list)) else None
        if protocol._trio_peer is not None:
            self.by_peer[protocol._trio_peer] = protocol
        self.wait(protocol, transport)
        return True

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
            _, (_, oldest) = self.waiting.popitem(last=False)
            self.stats["evicted"] += 1
            oldest.close()

    def started(self, peer: tuple) -> None:
        protocol = self.by_peer.get(peer)
        if protocol is not None:
            self._unwait(protocol)

    def gone(self, protocol: Any) -> None:
        self._unwait(protocol)
        address = getattr(protocol, "_trio_address", None)
        if address is not None:
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


def guarded_protocol(base: type, connections: Connections) -> type:
    """uvicorn's HTTP protocol class `base`, reporting to `connections` (a subclass: uvicorn
    takes a protocol class for `http=`)."""

    class Guarded(base):
        _trio_admitted = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            if not connections.admit(self, transport):
                transport.abort()
                return
            self._trio_admitted = True
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._trio_admitted:
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
