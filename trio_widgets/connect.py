"""Where a client's requests go: the one place a backend is chosen (cf. httpx's transports).

`ServiceClient` and `RestClient` both call `connect(...)`: a served pool by `base_url` (an
`HttpBackend`), an in-process pool (anything that implements `Pool`: the engine's `LocalPool`),
or the process-wide default pool. The client layer never imports the engine: the engine is an
extra (`pip install trio-widgets[engine]`) and registers its pool factory when imported, so a
participant's machine needs no torch to talk to a served pool.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .backend import Backend
from .errors import InvalidInputError
from .protocol import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "Pool", "connect", "default_pool", "register_pool_factory"]



@runtime_checkable
class Pool(Protocol):
    """What the client layer knows of an in-process pool: enough to open a session on it."""

    name: str

    @property
    def closed(self) -> bool: ...

    def connect(self, *, user_metadata: dict[str, str] | None = None, display_name: str | None = None,
                session: bool = True, owner: str | None = None) -> Backend:
        """A backend over this pool; `session=False`: one that only reads (a RestClient's) or a
        server's; `owner`: a served pool's API key (digest), whose runs and checkpoints it holds."""
        ...


#: Where `ServiceClient()` / `RestClient()` without a pool or base_url send their requests.
BASE_URL_ENV, API_KEY_ENV = "TRIO_BASE_URL", "TRIO_API_KEY"

_FACTORY: Callable[[], Pool] | None = None
_DEFAULT: Pool | None = None
_LOCK = threading.Lock()


def register_pool_factory(factory: Callable[[], Pool]) -> None:
    """The engine, when imported: how the process-wide default pool is made."""
    global _FACTORY
    _FACTORY = factory


def default_pool() -> Pool:
    """The process-wide pool that `ServiceClient()` uses, created on first use."""
    global _DEFAULT
    if _FACTORY is None:
        try:  # the engine registers itself on import (an optional extra)
            importlib.import_module("trio_widgets.engine")
        except ImportError as exc:
            raise InvalidInputError(
                f"an in-process pool needs the engine ({exc}): `pip install 'trio-widgets[engine]'`, or talk to a "
                f"served pool with ServiceClient(base_url=..., api_key=...)", field="pool") from None
    assert _FACTORY is not None
    with _LOCK:
        if _DEFAULT is None or _DEFAULT.closed:
            _DEFAULT = _FACTORY()  # shared by every cell: re-running a cell must not close it
        return _DEFAULT


def connect(pool: Pool | None = None, *, base_url: str | None = None, api_key: str | None = None,
            user_metadata: dict[str, str] | None = None, display_name: str | None = None,
            session: bool = True) -> tuple[Backend, bool]:
    """A backend for a client: over HTTP to `base_url`, else over `pool`, else to
    `$TRIO_BASE_URL` (with `$TRIO_API_KEY`) where it is set, else over the default pool. Returns
    it and whether the caller owns it (an HTTP backend's session ends when it closes)."""
    if base_url is None and pool is None and os.environ.get(BASE_URL_ENV):
        # code written as `ServiceClient()` runs against a served pool unchanged (a workshop)
        base_url, api_key = os.environ[BASE_URL_ENV], api_key or os.environ.get(API_KEY_ENV)
    if base_url is not None:
        if pool is not None:
            raise InvalidInputError("give a pool (in-process) or a base_url (a served pool), not both",
                                    field="base_url")
        from .http.client import HttpBackend

        return HttpBackend(base_url, api_key), True
    if pool is not None and not isinstance(pool, Pool):
        raise InvalidInputError(f"expected a LocalPool, got {type(pool).__name__}", field="pool")
    target = pool if pool is not None else default_pool()
    return target.connect(user_metadata=user_metadata, display_name=display_name, session=session), False
