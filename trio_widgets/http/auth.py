"""Who is asking, and the answers other than 200 that no exception of the pool stands for:
API keys (compared in constant time), owners as key digests, the loopback-only default,
signed download URLs (`Signer`), `HttpError` / `wire_of` (an exception as the protocol's
WireError), and `answering`: a route's endpoint, authenticated, its refusals answered in JSON."""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ClientClosedError, InvalidInputError, NotSupportedError, PoolClosedError
from ..protocol import Refusal, WireError, not_found, wire_error

__all__ = ["HttpError", "Signer", "answering", "api_key_of", "authenticate", "check_bind", "is_local", "is_loopback",
           "not_found", "owner_of", "wire_of"]

log = logging.getLogger("trio_widgets.http.server")


#: An answer other than 200 that no exception of the pool stands for (trio_widgets.protocol.errors).
HttpError = Refusal


def wire_of(exc: BaseException, code: str | None = None) -> WireError:
    return wire_error(exc, code=code)


def is_local(request: Request) -> bool:
    """Whether the client is on this machine (a directory path the server names means something there)."""
    return request.client is not None and is_loopback(request.client.host)


def api_key_of(headers: Any) -> str | None:
    """The key a request presents: tinker's X-API-Key header, or PyTRIO's `Authorization: Bearer`
    (its control plane sends both; its actor calls only the bearer, which is the same key here)."""
    key = headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere


@functools.lru_cache(maxsize=1024)  # asked on every request; bounded, as keys may be anything on loopback
def owner_of(key: str | None) -> str:
    """Who a key is, as a directory-safe digest (the key itself is never written down)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:20] if key else "anonymous"


def _same(a: str, b: str) -> bool:
    """Constant-time, on bytes: compare_digest refuses non-ASCII str (a hostile header is a 401,
    not a 500)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape"))


def authenticate(key: str | None, api_keys: list[str], observer_keys: list[str], observer: bool = False) -> str:
    """The owner `key` stands for (401 / 403 as an HttpError where it may not ask)."""
    if api_keys or observer_keys:
        if not key:
            raise HttpError(401, "missing API key: send it in the X-API-Key header")
        valid = [k for k in (*api_keys, *observer_keys) if _same(k, key)]
        if not valid:
            raise HttpError(401, "invalid API key")
        if observer and not any(_same(k, key) for k in observer_keys):
            raise HttpError(403, "this key may train but not watch the whole pool: watching needs an "
                                 "observer key (serve(..., observer_keys=...))")
    return owner_of(key)


def check_bind(host: str, keys: list[str]) -> None:
    """Refuse a non-loopback address without API keys (ValueError saying why), and short keys."""
    if any(not isinstance(k, str) or len(k) < 8 for k in keys):
        raise ValueError("API keys must be strings of at least 8 characters")
    if not is_loopback(host) and not keys:
        raise ValueError(f"refusing to serve on {host!r} without API keys: anyone who can reach it could train on "
                         f"this pool and read its checkpoints. Give keys (serve(..., api_keys=[...]); CLI: "
                         f"--api-key / --api-keys-file / $TRIO_API_KEYS), or serve on 127.0.0.1")


class Signer:
    """Signed, expiring download URLs, as the hosted service gives: whoever holds one may fetch
    that one resource until it expires, with no API key (tinker_cookbook fetches them with
    urllib). HMAC-SHA256 under a secret made per server start, so a restart voids every URL.
    The owner travels as an opaque tag (an HMAC of its digest), never a digest of the key."""

    MAX_OWNERS = 100_000  # tags remembered (one per key that asked; keys are configured, so few)

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._owners: dict[str, str] = {}

    def _mac(self, *parts: str) -> str:
        message = "\0".join(parts).encode("utf-8", "surrogateescape")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, owner: str, resource: str, expires: int) -> dict[str, str]:
        """The query parameters that let `resource` of `owner` be fetched until `expires` (Unix s)."""
        tag = self._mac("owner", owner)[:24]
        if tag not in self._owners and len(self._owners) >= self.MAX_OWNERS:
            self._owners.clear()  # (only URLs already given out stop working)
        self._owners[tag] = owner
        return {"expires": str(expires), "owner": tag, "signature": self._mac("url", owner, resource, str(expires))}

    def verify(self, resource: str, expires: str | None, tag: str | None, signature: str | None) -> str:
        """The owner a signed URL of `resource` stands for; 403 if it was not signed here, is for
        another resource or has expired."""
        owner = self._owners.get(tag or "")
        if owner is None or not expires or not expires.isdigit() or not signature \
                or not _same(signature, self._mac("url", owner, resource, expires)):
            raise HttpError(403, "this download URL is not valid here (wrong signature, or signed by an earlier start "
                                 "of this server): ask for a new one (get_external_weights_urls / "
                                 "get_checkpoint_archive_url)", code="forbidden")
        if int(expires) <= time.time():
            raise HttpError(403, f"this download URL expired at {expires} (Unix time): ask for a new one",
                            code="forbidden")
        return owner


def error_response(error: WireError, *, close: bool = False) -> JSONResponse:
    body: dict[str, Any] = {"detail": error.message, "code": error.code, **error.details()}
    # a client without a valid key, or whose body was not read, keeps no connection
    return JSONResponse(body, status_code=error.status, headers={"Connection": "close"} if close else None)


_CLOSE = (401, 403, 408, 413, 415)  # refusals after which the connection is closed


def _log_refusal(request: Request, owner: str, error: WireError) -> None:
    """One line per refused request, for the server's log: never the key (its owner digest, the
    client's session or model id where the body named one)."""
    who = getattr(request.state, "client", None) or "-"
    log.info("refused %s %s: %d %s (owner %s, client %s): %s", request.method, request.url.path, error.status,
             error.code, owner[:12], str(who)[:80], error.message[:300])


def answering(service: Any, handler: Callable[[Any, str, Request], Awaitable[Any]], *, observer: bool = False,
              open_: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """A route's endpoint: `handler(service, owner, request)` for the owner `service.authenticate`
    finds (anonymous if `open_`), and every refusal as a JSON 4xx from the protocol's one table
    (never a bare 400: the SDK retries those), logged a line each."""
    async def endpoint(request: Request) -> Response:
        owner = "-"
        try:
            owner = "anonymous" if open_ else service.authenticate(request, observer)
            result = await handler(service, owner, request)
        except (Refusal, InvalidInputError, NotSupportedError, PoolClosedError, ClientClosedError) as exc:
            # one table (trio_widgets.protocol.errors): trio's client raises the in-process class
            error = wire_of(exc)
            _log_refusal(request, owner, error)
            return error_response(error, close=isinstance(exc, Refusal) and exc.status in _CLOSE)
        except Exception as exc:  # a bug: said in JSON (the SDK shows the body), logged here
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(wire_error(exc))
        if isinstance(result, Response):
            return result
        return JSONResponse(result)

    return endpoint
