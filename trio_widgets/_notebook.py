"""Which notebook cell is running, and "the object this cell built last time".

Re-running a cell that builds a pool or a dashboard should not leave the previous one's
thread or task running in the background: objects built with `owned_by_cell=True` close the
object of their kind that the same cell built before (JupyterLab and nbclient send the
cell's id with every execute request).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol


def current_cell_id() -> str | None:
    """The id of the notebook cell being executed, or None outside a notebook cell."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None:
            return None
        parent = kernel.get_parent() if hasattr(kernel, "get_parent") else kernel._parent_header
        return (parent or {}).get("metadata", {}).get("cellId")
    except Exception:  # no IPython, or a kernel without parent headers
        return None


class _Closable(Protocol):
    @property
    def closed(self) -> bool: ...

    def close(self) -> Any: ...


class CellRegistry:
    """Live objects of one kind, by the cell that built them."""

    def __init__(self) -> None:
        self._live: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # what replaced what (a re-run cell): a dashboard follows its pool to the replacement
        self._next: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()

    def claim(self, obj: _Closable) -> str | None:
        """Record `obj` as the current cell's, closing what the cell built before; its cell id."""
        cell = current_cell_id()
        if cell is None:
            return None
        previous = self._live.get(cell)
        if previous is not None and previous is not obj:
            self._next[previous] = weakref.ref(obj)  # before closing it: whoever sees it closed finds the new one
            if not previous.closed:
                previous.close()
        self._live[cell] = obj
        return cell

    def successor(self, obj: Any) -> Any | None:
        """The object that replaced `obj` (the newest, if its cell ran several times), or None."""
        seen, current = set(), obj
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            ref = self._next.get(current)
            nxt = ref() if ref is not None else None
            if nxt is None:
                break
            current = nxt
        return current if current is not obj else None
