"""The pools of this process as the views see them: a typed view of a pool (an in-process
`LocalPool`, or a served pool's `RemotePool` seen through its telemetry stream), the set of live
pools, and which pool a notebook cell built to replace another. Torch-free: the engine registers
its pools here, the widgets read them, and neither imports the other's internals."""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol, runtime_checkable

from ._notebook import CellRegistry
from .telemetry import Telemetry

__all__ = ["PoolView", "claim_cell", "is_live", "live_pools", "newest_pool", "next_serial", "register", "successor",
           "unregister"]


@runtime_checkable
class PoolView(Protocol):
    """What the dashboard, the advisor and the exports read of a pool."""

    name: str
    min_cycle_s: float
    cycle_index: int
    telemetry: Telemetry

    @property
    def closed(self) -> bool: ...

    @property
    def device_type(self) -> str:
        """"cpu", "cuda", ... where the pool computes."""
        ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_CELLS = CellRegistry()
_SERIALS = itertools.count(1)


def next_serial() -> int:
    """Creation order: a Dashboard() without a pool follows the newest."""
    return next(_SERIALS)


def register(pool: PoolView) -> None:
    _LIVE.add(pool)


def unregister(pool: PoolView) -> None:
    _LIVE.discard(pool)


def claim_cell(pool: Any) -> None:
    """A pool built by a notebook cell closes the pool the same cell built before."""
    _CELLS.claim(pool)


def live_pools() -> list[Any]:
    """The pools of this process not yet closed."""
    return [p for p in list(_LIVE) if not p.closed]


def is_live(pool: Any) -> bool:
    return pool in _LIVE


def newest_pool() -> Any | None:
    return max(live_pools(), key=lambda p: getattr(p, "serial", 0), default=None)


def successor(pool: Any) -> Any | None:
    """The pool that the cell which built `pool` built next (a re-run cell), if any."""
    return _CELLS.successor(pool)
