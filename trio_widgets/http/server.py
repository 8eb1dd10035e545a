"""A LocalPool served over HTTP in Tinker's wire protocol (starlette + uvicorn).

>>> pool = trio.LocalPool()
>>> server = trio.serve(pool, port=8000)      # a background thread; server.stop() ends it
>>> # elsewhere: tinker.ServiceClient(base_url=server.url, api_key="tml-...")
>>> #       or:  trio.ServiceClient(base_url=server.url, api_key="tml-...")

Remote requests go through a `LocalBackend` of the same pool as in-process ones, so the
same clock-cycle rules apply and `trio.Dashboard(pool)` shows every remote client's lane,
labelled by its session. What the protocol is, in short (docs/serving.md has the details):

* `POST /api/v1/<op>` submits and answers `{"request_id"}` at once; the result is long-polled
  at `POST /api/v1/retrieve_future` (held up to `long_poll_s`, then `{"type": "try_again"}`;
  a failure is `{"error", "category"}`). forward / forward_backward bodies and their results,
  and sample results, are protobuf (trio_widgets/http/wire.py).
* Requests of one model carry `seq_id` and run in `seq_id` order even when they arrive out of
  order: a request whose predecessor has not arrived is held up to `reorder_wait_s`, then the
  gap is skipped (a client may consume a seq_id it never sends). A repeated
  `(model_id, seq_id)` answers the first request's id and runs nothing: retries never run an
  update twice.
* Isolation: a session belongs to the API key that created it. Models, samplers, futures and
  checkpoints of another key answer 404. Checkpoints are addressed only as
  `tinker://<model_id>/weights|sampler_weights/<name>` and live under
  `<checkpoint_dir>/served/<key digest>/<model id>/...`; a filesystem path is never accepted.
* Faults: a session without heartbeat (or any request) for `session_timeout_s` has its queued
  requests cancelled and its clients retired; stopping the server answers every pending
  future with a `server` error before the socket closes.

Everything the server keeps is bounded (sessions per key, clients per session, futures per
key, seq ids remembered per model, body bytes, telemetry streams), and the event loop's
thread is the only one that touches its tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from ..engine import checkpoints as ckpt
from ..engine.clock import LocalPool
from ..engine.served import RETRIEVED_KEPT_S
from ..errors import (
    PoolClosedError,
)
from ..export import DEFAULT_MAX_EXPORT_BYTES
from ..protocol import names, parse_tinker_path
from . import new_event_loop
from .auth import check_bind, owner_of
from .guard import Connections, Policy, guarded_protocol, policy_app
from .pytrio_wire import pytrio_routes
from .routes import build_app
from .service import Service

__all__ = ["RETRIEVED_KEPT_S", "Server", "check_bind", "freeze_heap", "serve"]

log = logging.getLogger(__name__)

# -- the HTTP layer -------------------------------------------------------------------------------

# -- the server ------------------------------------------------------------------------------------

def _run_event_loop(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """`asyncio.run(main())`, on uvloop's event loop where there is one (Python >= 3.11)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


def owner_identifier(keys: list[str]) -> Callable[[str | None], str | None]:
    """The owner a presented key stands for when it is a configured one (else None: the connection
    stays its address's; without configured keys, every connection does)."""
    owners = {owner_of(k) for k in keys}

    def identify(key: str | None) -> str | None:
        if not key or not owners:
            return None
        owner = owner_of(key)
        return owner if owner in owners else None

    return identify


class Server:
    """Serves `pool` on host:port from a background thread (uvicorn). `stop()` (or closing the
    pool, or leaving a `with` block) answers pending futures, releases every served client and
    joins the thread. `owns_pool=True` closes the pool too (the CLI's)."""

    def __init__(self, pool: LocalPool, *, host: str = "127.0.0.1", port: int = 8000,
                 api_keys: Iterable[str] | None = None, observer_keys: Iterable[str] | None = None,
                 models: Iterable[str] | None = None, session_timeout_s: float = 60.0, long_poll_s: float = 20.0,
                 reorder_wait_s: float = 1.0, max_body_bytes: int = 16 << 20, fwdbwd_max_chunk_len: int | None = None,
                 max_sessions_per_key: int = 64, max_clients_per_session: int = 64,
                 max_futures_per_key: int = 4096, allowed_hosts: Iterable[str] | None = None,
                 allowed_origins: Iterable[str] | None = None, header_timeout_s: float = 10.0,
                 body_timeout_s: float = 30.0, max_waiting_connections: int = 256,
                 max_connections_per_address: int = 512, max_connections_per_key: int = 512,
                 max_connections: int = 4096, max_new_connections_per_address_s: float = 256.0,
                 max_inflight_bytes_per_key: int = 64 << 20,
                 max_inflight_bytes: int = 256 << 20, max_clients_per_key: int = 128,
                 max_state_bytes_per_key: int = 2 << 30, max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
                 export_url_ttl_s: float = 3600.0, export_timeout_s: float = 3600.0, owns_pool: bool = False,
                 id_tag: str = ""):
        if not isinstance(pool, LocalPool):
            raise TypeError(f"serve() takes a LocalPool, got {type(pool).__name__}")
        names.id_prefix(id_tag)  # ValueError naming a tag that is not one
        check_bind(host, [*(api_keys or ()), *(observer_keys or ())])
        for name, value, low, high in (("session_timeout_s", session_timeout_s, 1.0, 86400.0),
                                       ("long_poll_s", long_poll_s, 0.01, 40.0),
                                       ("reorder_wait_s", reorder_wait_s, 0.0, 60.0),
                                       ("header_timeout_s", header_timeout_s, 0.1, 3600.0),
                                       ("body_timeout_s", body_timeout_s, 0.1, 3600.0),
                                       ("max_waiting_connections", max_waiting_connections, 1, 1 << 20),
                                       ("max_connections_per_address", max_connections_per_address, 1, 1 << 20),
                                       ("max_connections_per_key", max_connections_per_key, 1, 1 << 20),
                                       ("max_connections", max_connections, 1, 1 << 20),
                                       ("max_new_connections_per_address_s", max_new_connections_per_address_s, 1.0,
                                        1e6),
                                       ("max_inflight_bytes_per_key", max_inflight_bytes_per_key, 1, 1 << 40),
                                       ("max_inflight_bytes", max_inflight_bytes, 1, 1 << 40),
                                       ("max_clients_per_key", max_clients_per_key, 1, 1 << 20),
                                       ("max_state_bytes_per_key", max_state_bytes_per_key, 1, 1 << 50),
                                       ("max_export_bytes", max_export_bytes, 1, 1 << 50),
                                       ("export_url_ttl_s", export_url_ttl_s, 1.0, 7 * 86400.0),
                                       ("export_timeout_s", export_timeout_s, 1.0, 86400.0)):
            if not isinstance(value, (int, float)) or not (low <= value <= high):
                raise ValueError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")
        if pool.closed:
            raise PoolClosedError(f"the pool {pool.name!r} is closed")
        self.pool = pool
        self.host = host
        self._requested_port = int(port)
        self.owns_pool = owns_pool
        self._service = Service(pool, api_keys=api_keys, observer_keys=observer_keys, models=models,
                                 session_timeout_s=session_timeout_s, long_poll_s=long_poll_s,
                                 reorder_wait_s=reorder_wait_s, max_body_bytes=max_body_bytes,
                                 fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
                                 max_sessions_per_key=max_sessions_per_key,
                                 max_clients_per_session=max_clients_per_session,
                                 max_futures_per_key=max_futures_per_key, body_timeout_s=body_timeout_s,
                                 max_inflight_bytes_per_key=max_inflight_bytes_per_key,
                                 max_inflight_bytes=max_inflight_bytes, max_clients_per_key=max_clients_per_key,
                                 max_state_bytes_per_key=max_state_bytes_per_key, max_export_bytes=max_export_bytes,
                                 export_url_ttl_s=export_url_ttl_s, export_timeout_s=export_timeout_s,
                                 id_tag=id_tag)
        self._policy = Policy.of([host, *(allowed_hosts or ())], allowed_origins)
        self._connections = Connections(header_timeout_s=float(header_timeout_s),
                                        max_waiting=int(max_waiting_connections),
                                        max_per_address=int(max_connections_per_address),
                                        max_per_key=int(max_connections_per_key), max_total=int(max_connections),
                                        new_per_address_s=float(max_new_connections_per_address_s),
                                        identify=owner_identifier([*(api_keys or ()), *(observer_keys or ())]),
                                        keyed=bool([*(api_keys or ()), *(observer_keys or ())]))
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._stopped = False
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> Server:
        import uvicorn

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
        self._socket = sock
        self.port = sock.getsockname()[1]
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        # the Host / Origin / Content-Type checks in front of the routes, the connection limits
        # around uvicorn's protocol (trio_widgets/http/guard.py)
        app = policy_app(build_app(self._service, pytrio_routes(self._service)), self._policy, self._connections)
        config = uvicorn.Config(app, http=guarded_protocol(AutoHTTPProtocol, self._connections), log_level="warning",
                                access_log=False, log_config=None, lifespan="off", limit_concurrency=None,
                                # the peer is the socket's: X-Forwarded-For from a loopback client must not
                                # move it out of its address's (or key's) count
                                proxy_headers=False,
                                timeout_graceful_shutdown=5, timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(config)
        started = threading.Event()
        service = self._service

        async def run() -> None:
            service.state.loop = asyncio.get_running_loop()  # the served state's futures settle on it
            reaper = asyncio.create_task(service.state.reap())
            started.set()
            try:
                await self._uvicorn.serve(sockets=[sock])
            finally:
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper

        self._thread = threading.Thread(target=_run_event_loop, args=(run,), name=f"trio-serve-{self.pool.name}",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not (started.is_set() and self._uvicorn.started):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        self.pool.on_close(self.stop)
        log.info("serving pool %s on %s", self.pool.name, self.url)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Answer every pending future with a `server` error, release every served client, stop
        uvicorn and join its thread (and close the pool, if the server owns it)."""
        if self._stopped:
            return
        self._stopped = True
        thread, service = self._thread, self._service
        if thread is not None and thread.is_alive() and service.state.loop is not None:
            done = threading.Event()

            def begin() -> None:
                service.state.shut_down()
                done.set()

            with contextlib.suppress(RuntimeError):
                service.state.loop.call_soon_threadsafe(begin)
                done.wait(timeout)
            time.sleep(0.2)  # long-polls answer the error just set before the sockets close
            self._uvicorn.should_exit = True
            if thread is not threading.current_thread():
                thread.join(timeout)
        if self._socket is not None:
            self._socket.close()
        service.state.close()
        if self.owns_pool:
            self.pool.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<trio Server {self.url} pool={self.pool.name!r} {state}>"

    # -- what it serves (any thread; copies) ------------------------------------------------------
    def clients(self) -> dict[str, str]:
        """Public model and sampler ids -> the pool's client ids (telemetry lanes), of the last
        4,096 clients made, closed ones too."""
        return dict(self._service.state.lanes.copy())

    def sessions(self) -> list[dict[str, Any]]:
        """The sessions it knows: id, label, state, seconds since last heard of, client ids."""
        now = time.monotonic()
        return [{"session_id": s.session_id, "label": s.label, "state": s.state,
                 "idle_s": round(now - s.last_seen, 1), "clients": list(s.clients)}
                for s in list(self._service.state.sessions.values())]

    def stats(self) -> dict[str, int]:
        """Counts since start: submitted (to the pool), duplicates (repeated seq_ids answered with
        the first request), held (arrived before a predecessor), gaps_skipped, sessions_expired;
        connections refused (per address, or the server full), refused_per_key (a key over
        max_connections_per_key), evicted (the oldest waiting, for a new one), timed_out (no request
        head in header_timeout_s)."""
        return {**self._service.state.stats, **self._connections.stats}

    def checkpoint_path(self, tinker_path: str, api_key: str | None) -> Path:
        """The directory on this machine a tinker:// path of `api_key` names (for tests, tools)."""
        parsed = parse_tinker_path(tinker_path)
        return ckpt.checkpoint_root(self.pool) / names.owner_run_dir(owner_of(api_key), parsed.run_id) / \
            parsed.segment / parsed.name


def freeze_heap() -> None:
    """For a process that serves a pool and nothing else (`trio serve`, a fleet's pool replica), once
    started: what it holds for good (torch, transformers, the base models, the app: some 400,000
    objects) out of the cyclic collector's sight. A full collection scans every tracked object, and
    whichever thread runs one holds the GIL meanwhile: a listing's thread allocating thousands of
    entries set one off every few seconds, 0.2-0.5 s each, and the event loop, heartbeats included,
    waited (issue 36: with 2,000 checkpoints listed in a loop, heartbeats up to 485 ms; frozen, 53 ms,
    benchmarks/serve_abuse.py --only listing). What is allocated later is collected as before. Not
    for a notebook's pool: the user's own objects would be frozen with it."""
    import gc

    gc.collect()
    gc.freeze()


def serve(pool: LocalPool, *, host: str = "127.0.0.1", port: int = 8000, **settings: Any) -> Server:
    """Serve `pool` over HTTP in Tinker's protocol from a background thread; returns the running
    `Server` (`server.url`, `server.stop()`). Loopback only unless API keys are given.

    Settings (all optional): api_keys, observer_keys (may also watch the whole pool's telemetry),
    models (base models clients may use; default: the pool's), session_timeout_s (60),
    long_poll_s (20), reorder_wait_s (1), max_body_bytes (16 MiB), fwdbwd_max_chunk_len,
    max_sessions_per_key (64), max_clients_per_session (64), max_futures_per_key (4096);
    in front of the routes (trio_widgets/http/guard.py): allowed_hosts (besides IP addresses,
    loopback and this machine's names), allowed_origins (none: browsers' requests are refused),
    header_timeout_s (10), body_timeout_s (30), max_waiting_connections (256),
    max_connections_per_address (512 of no key yet), max_connections_per_key (512), max_connections (4096),
    max_new_connections_per_address_s (256: past it a new connection waits its turn, up to 1 s, else 429),
    max_inflight_bytes_per_key (64 MiB), max_inflight_bytes (256 MiB);
    per key across its sessions: max_clients_per_key (128), max_state_bytes_per_key (2 GiB of
    adapter and optimizer state; a rank-r client of a model costs what `ModelHandle.state_bytes` says);
    checkpoint downloads (trio_widgets/http/exports.py): max_export_bytes (4 GiB of PEFT files),
    export_url_ttl_s (3600: how long a signed URL works), export_timeout_s (3600: one download's time).

    Example: `server = trio.serve(trio.LocalPool(), port=8000)`; clients then use
    `trio.ServiceClient(base_url=server.url)` or the tinker SDK; `server.stop()` ends it."""
    return Server(pool, host=host, port=port, **settings).start()
