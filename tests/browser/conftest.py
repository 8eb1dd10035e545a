"""Browser-test configuration: registers the ``browser`` marker; the JupyterLab server and the
Chromium the browser modules drive.

One server and one Chromium for all the browser modules (each took seconds to start, once per
module), started by the first module that asks and stopped after the last browser test (the rest
of the suite runs without them). Each module still gets them as a fresh server's: its `lab` fixture
clears the user-level settings a module before it wrote (commsOverSubshells: test_bokeh_smoke and
test_dashboard set it) and shuts down any kernel left running; each page is its own browser context
(`open_notebook`): no page shares cookies, storage or cache with another.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # so tests can `import lab`

from lab import KERNELS_SETTINGS, LabServer, chromium, jupyter_lab  # noqa: E402

_shared: dict[str, Any] = {}
_stack = contextlib.ExitStack()


def _close_shared() -> None:
    _shared.clear()
    _stack.close()


def _shut_down_kernels(server: LabServer) -> None:
    """Every session and kernel of the server, deleted (what a module's pages left running)."""
    for session in server.api("GET", "api/sessions"):
        with contextlib.suppress(Exception):
            server.api("DELETE", f"api/sessions/{session['id']}", timeout=15)
    for kernel in server.kernels():
        with contextlib.suppress(Exception):
            server.api("DELETE", f"api/kernels/{kernel['id']}", timeout=15)


@pytest.fixture(scope="module")
def lab() -> Iterator[LabServer]:
    """The browser modules' JupyterLab, as a fresh one: no user-level settings, no kernel running."""
    if "lab" not in _shared:
        _shared["lab"] = _stack.enter_context(jupyter_lab())
    server: LabServer = _shared["lab"]
    assert server.proc.poll() is None, f"jupyter lab exited:\n{server.log_text()[-4000:]}"
    server.set_setting(KERNELS_SETTINGS, {})  # JupyterLab's default: comms over subshells on
    _shut_down_kernels(server)
    yield server
    if server.proc.poll() is None:
        _shut_down_kernels(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """The browser modules' Chromium (each page opens in a context of its own)."""
    if "browser" not in _shared:
        _shared["browser"] = _stack.enter_context(chromium())
    yield _shared["browser"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last browser test (its module's fixtures torn down), stop the server and Chromium."""
    yield
    if _shared and (nextitem is None or Path(nextitem.path).resolve().parent != HERE):
        _close_shared()


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Iterator[None]:
    yield
    _close_shared()  # (a run stopped early: -x, Ctrl+C)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives a real JupyterLab in headless Chromium")
