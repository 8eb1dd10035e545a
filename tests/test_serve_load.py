"""The served-pool benchmarks the README quotes (benchmarks/serve_load.py,
benchmarks/serve_event_loop.py), small: they run end to end and their checks can fail. Two
tinker SDK and two trio HTTP client processes x 3 pipelined updates against a served pool,
one round of each arm. Nothing here reads a time: ratios are only checked to be printed
(their targets live in the README, measured by the full runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# `make test` runs it alone, with no test beside it: it compares update times over HTTP and in-process
pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the tinker SDK needs Python >= 3.11")
def test_serve_load_runs_small_with_nothing_lost_and_clients_isolated() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_load.py"), "--sdk-clients", "2",
                           "--trio-clients", "2", "--updates", "3", "--rounds", "1"],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "client processes at nice 19" in out
    assert re.search(r"^lost or duplicated updates: 0$", out, re.M), out[-4000:]
    # every client: the pool ran its 3 updates and the client saw steps 1..3
    counts = re.findall(r"(?:sdk|trio)-\d+ (\d+)/(\d+)", out)
    assert counts == [("3", "3")] * 8, counts  # 4 clients in each of 2 HTTP arms
    assert "isolation: OK" in out
    assert re.search(r"per-update time: HTTP [\d.]+ ms, in-process [\d.]+ ms -> ratio [\d.]+", out), out[-2000:]
    # the clock thread's figures are real numbers in every arm
    assert len(re.findall(r"clock thread: \d+\.\d ms CPU, \d+\.\d ms waiting to run", out)) == 4, out[-3000:]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the tinker SDK and the server's uvloop need Python >= 3.11")
def test_serve_event_loop_compares_the_two_loops_it_says() -> None:
    """benchmarks/serve_event_loop.py, small: each arm really ran on the loop it is named
    after (the script checks the server's loop type) and the HTTP thread's CPU is measured."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_event_loop.py"), "--rounds", "1",
                           "--clients", "2", "--updates", "3"], capture_output=True, text=True, timeout=900, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    arms = re.findall(r"round 1 +(asyncio|uvloop): HTTP thread ([\d.]+) ms CPU per update", out)
    assert [loop for loop, _ in arms] == ["asyncio", "uvloop", "uvloop", "asyncio"], out[-3000:]
    assert all(float(ms) > 0 for _, ms in arms), arms
    assert re.search(r"-> uvloop / asyncio [\d.]+$", out, re.M), out[-2000:]
