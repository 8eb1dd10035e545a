"""Serving a LocalPool over HTTP in Tinker's wire protocol, and the clients that talk to it."""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed (the serve extra installs it on Linux and
    macOS), else asyncio's. Written in C, it holds the GIL for less of each request: the
    server's HTTP thread shares the GIL with the pool's clock, a client's poller with the
    user's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
