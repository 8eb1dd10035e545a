"""Helpers for running client-level tests through both transports (not a test module).

`service(transport, pool)` is a ServiceClient that reaches `pool` through the codec named
`transport`: in-process (`"in-process"`), or Tinker's wire protocol over HTTP to the same pool
served on 127.0.0.1 (`"tinker-http"`). conftest.py's `transport` fixture runs a test once per
entry of TRANSPORTS (a third codec, PyTRIO's wire, is one more entry in CODECS). `adapter_of(tc)`
reads a client's adapter from the pool that knows the truth, whichever way the client reached it.
What still differs between the transports is DIFFERENCES, each with its reason: a test that meets
one calls `differs(transport, name)`, and tests/test_transports.py checks each entry still holds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from served import served

import trio_widgets as trio
from trio_widgets.backend import InspectRequest
from trio_widgets.engine.checkpoints import tinker_path_dir

KEY = "tml-both-transports"

#: Each entry: a difference between the transports that stays, with its reason.
DIFFERENCES: dict[str, str] = {
    "filesystem-paths": "over HTTP a checkpoint is named only by its tinker:// path, a base model only by a name "
                        "the server serves; the server's directories are not the caller's to name (in-process, "
                        "a directory loads too)",
    "client-ids": "in-process a client's id is the pool's (its lane) and its model_id names its run; over HTTP "
                  "both are the model_id the server gave (the pool's ids are the server's business)",
    "inspect-adapter": "inspect_adapter reads the adapter in the pool's memory; over HTTP it is refused "
                       "(save_state and read the checkpoint)",
    "closed-pool": "a pool's close stops its server: what was pending fails with PoolClosedError on both, but a new "
                   "request over HTTP cannot reach the server (APIConnectionError, as the tinker SDK raises), where "
                   "in-process it is refused with PoolClosedError",
    "rest-catalog": "over HTTP a RestClient sees its API key's runs and checkpoints (every session of the key); "
                    "the pool's own RestClient sees every run of the pool",
}

IN_PROCESS = "in-process"


@contextlib.contextmanager
def _in_process(pool: trio.LocalPool) -> Iterator[trio.ServiceClient]:
    with trio.ServiceClient(pool) as svc:
        yield svc


@contextlib.contextmanager
def _tinker_http(pool: trio.LocalPool) -> Iterator[trio.ServiceClient]:
    with served(pool) as server, trio.ServiceClient(base_url=server.url, api_key=KEY) as svc:
        svc._server = server  # type: ignore[attr-defined]  # for adapter_of: the pool behind it
        assert svc.service_session_cuid.startswith("sess-")  # open it now: its threads belong to the fixture
        yield svc


#: Each codec a client reaches a pool through: name -> a ServiceClient of `pool` through it.
CODECS: dict[str, Callable[[trio.LocalPool], contextlib.AbstractContextManager[trio.ServiceClient]]] = {
    IN_PROCESS: _in_process,
    "tinker-http": _tinker_http,
}
TRANSPORTS = list(CODECS)


def differs(transport: str, name: str) -> bool:
    """Whether the listed difference `name` applies on `transport` (a typo fails): every listed
    difference is one of a wire's, so it applies to every codec but the in-process one."""
    assert name in DIFFERENCES, f"{name!r} is not in tests/transports.py DIFFERENCES"
    assert transport in CODECS, f"{transport!r} is not in tests/transports.py CODECS"
    return transport != IN_PROCESS


@contextlib.contextmanager
def service(transport: str, pool: trio.LocalPool) -> Iterator[trio.ServiceClient]:
    with CODECS[transport](pool) as svc:
        yield svc


def pool_client_id(svc: trio.ServiceClient, client: Any) -> str:
    """The pool's id of a client (over HTTP the client knows its model id, the server maps it)."""
    server = getattr(svc, "_server", None)
    return client.client_id if server is None else server.clients()[client.client_id]


def inspect(svc: trio.ServiceClient, pool: trio.LocalPool, client: Any) -> trio.types.AdapterSnapshot:
    """The client's adapter (weights, optimizer state, gradient), read in the pool that knows the
    truth: `inspect_adapter()` in-process; over HTTP, where it is not offered, the pool is asked
    directly. Await what the client submitted first (over HTTP its requests travel apart)."""
    if getattr(svc, "_server", None) is None:
        return client.inspect_adapter().result(timeout=120)
    return pool.submit(pool_client_id(svc, client), "inspect_adapter", InspectRequest()).result(timeout=120)


def adapter_of(svc: trio.ServiceClient, pool: trio.LocalPool, client: Any) -> dict[str, torch.Tensor]:
    """`name.lora_A` / `name.lora_B` -> a copy, read in the pool."""
    return inspect(svc, pool, client).state_dict()


def checkpoint_dir(svc: trio.ServiceClient, pool: trio.LocalPool, path: Any) -> Path:
    """The directory on this machine a save's path names (over HTTP a tinker:// path of the key)."""
    path = getattr(path, "path", path)
    server = getattr(svc, "_server", None)
    if server is not None and str(path).startswith("tinker://"):
        return server.checkpoint_path(str(path), KEY)
    if str(path).startswith("tinker://"):  # (whether or not it exists)
        return tinker_path_dir(str(path), pool)
    return Path(path)




def queued(pool: trio.LocalPool, count: int, timeout: float = 30.0) -> None:
    """Wait until `count` requests wait in the pool's queues: inside `pool.hold()`, what a client
    submitted over HTTP is in the pool before the boundary (in-process it is at once)."""
    deadline = time.monotonic() + timeout
    while sum(pool.queue_depths().values()) < count:
        assert time.monotonic() < deadline, f"{sum(pool.queue_depths().values())} of {count} requests queued " \
                                            f"after {timeout:.0f} s"
        time.sleep(0.005)
