"""Browser-test configuration: registers the ``browser`` marker."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can `import lab`

from lab import LabServer, chromium, jupyter_lab  # noqa: E402


@pytest.fixture(scope="module")
def lab() -> Iterator[LabServer]:
    with jupyter_lab() as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives a real JupyterLab in headless Chromium")
