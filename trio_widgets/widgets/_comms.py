"""Closing widgets without a "No such comm" warning in the user's log.

A page may send to a widget's comm (a visibility report, a bokeh event, a control's state) in
the instant after the kernel closed it: the message and the kernel's close cross on the wire,
and the page cannot know yet. The kernel's comm manager then logs "No such comm: <id>", which
ipykernel forwards to the page (JupyterLab shows it in red in the log console). For comms this
package closed itself such a message is expected and carries nothing left to act on, so it is
dropped quietly; any other comm's warning is logged as before.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

#: the comm manager's message and logger (comm.base_comm, used by ipykernel >= 6.27)
_NO_SUCH_COMM = "No such comm: %s"
_COMM_LOGGER = "Comm"
#: ids of comms closed here, newest last (a late message arrives within a round trip)
_CLOSED: deque[str] = deque(maxlen=512)
_lock = threading.Lock()
_installed = False


class _LateToClosed(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _NO_SUCH_COMM or not isinstance(record.args, tuple) or not record.args:
            return True
        with _lock:
            return str(record.args[0]) not in _CLOSED


def closing(widgets: Iterable[Any]) -> None:
    """Call before closing `widgets`: a message the page sends to one of them afterwards is
    dropped quietly."""
    global _installed
    with _lock:
        if not _installed:
            logging.getLogger(_COMM_LOGGER).addFilter(_LateToClosed())
            _installed = True
    for w in widgets:
        comm = getattr(w, "comm", None)
        comm_id = getattr(comm, "comm_id", None)
        if isinstance(comm_id, str):
            with _lock:
                _CLOSED.append(comm_id)


def closed_quietly(comm_id: str) -> bool:
    """Whether a late message to `comm_id` is dropped without a warning (for tests)."""
    with _lock:
        return comm_id in _CLOSED
