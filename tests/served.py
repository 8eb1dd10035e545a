"""Helpers of the serve tests (not a test module): loops written three ways, cycles read from the
pool's telemetry, a lossy proxy, checkpoint reads. Everything runs for real: a served pool on
127.0.0.1, the official tinker SDK, trio's HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import trio_widgets as trio

NEEDS_SDK = pytest.mark.skipif(sys.version_info < (3, 11), reason="the tinker SDK needs Python >= 3.11")


def tinker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the SDK must see in tests: no telemetry, no network for tokenizers."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def sdk_client(server: Any, key: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The tinker SDK's ServiceClient against `server`, finished after use (a fixture's body:
    `yield from sdk_client(...)`)."""
    import tinker

    tinker_env(monkeypatch)
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    yield sc
    sc.close("success").result(timeout=60)


def pairs_from_telemetry(pool: trio.LocalPool, client_id: str, since: int = 0) -> list[tuple[int, int]]:
    """(forward_backward cycle, optim_step cycle) of each update of `client_id`, in order, for
    requests with pool request id > `since` (the pool's own record, not the client's)."""
    records = sorted((r for r in pool.telemetry.requests_of(client_id) if r.request_id > since and r.status == "ok"),
                     key=lambda r: r.request_id)
    fbs = [r.cycle for r in records if r.op == "forward_backward"]
    opts = [r.cycle for r in records if r.op == "optim_step"]
    assert len(fbs) == len(opts), (fbs, opts)
    return list(zip(fbs, opts))


def spans_and_periods(pairs: list[tuple[int, int]]) -> tuple[set[int], set[int]]:
    spans = {opt - fb + 1 for fb, opt in pairs}
    starts = [fb for fb, _ in pairs]
    periods = {b - a for a, b in zip(starts[1:], starts[2:])}  # the first is not steady state
    return spans, periods


def last_request_id(pool: trio.LocalPool) -> int:
    return max((r.request_id for r in list(pool.telemetry.requests)), default=0)


def in_threads(calls: dict[str, Callable[[], Any]], timeout: float = 300.0) -> None:
    """Run each call in its own thread, all at once (loops of several clients on one pool);
    raises if any raised, or did not end within `timeout`."""
    errors: list[tuple[str, BaseException]] = []

    def run(name: str) -> None:
        try:
            calls[name]()
        except BaseException as exc:  # reported below, on the test's thread
            errors.append((name, exc))

    threads = [threading.Thread(target=run, args=(name,), name=f"loop-{name}") for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"loops still running after {timeout} s"


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Bounded wait for a condition (behaviour, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def drop_while_held(holder: list, lock: Any, what: str, timeout: float = 30.0) -> None:
    """Drop the last reference, in `holder`, on another thread while this one holds `lock`, and
    collect: the object's finalizer runs there, as when the collector interrupts code that holds
    the lock. The drop must return within `timeout` (a finalizer that takes the lock never does)."""
    import gc

    def drop() -> None:
        holder.clear()
        gc.collect()

    dropper = threading.Thread(target=drop, daemon=True)
    with lock:
        dropper.start()
        dropper.join(timeout=timeout)
        finished = not dropper.is_alive()
    assert finished, f"dropping {what} waited for a lock its finalizer took"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving_process(where: Path, *, keys: str, min_cycle_s: float, args: Sequence[str] = (),
                  env: dict[str, str] | None = None, observers: str = "") -> Iterator[tuple[str, Path]]:
    """A real `python -m trio_widgets serve` on a free 127.0.0.1 port (one torch thread, `keys` as
    $TRIO_API_KEYS and `observers` as $TRIO_OBSERVER_KEYS: never on its command line, checkpoints in
    `where`/ckpt, its log in `where`/server.log; `env`: its environment, by default this one's without
    TRIO_ and TINKER_ variables). Yields (its URL, its log); terminated after."""
    port, log = free_port(), where / "server.log"
    base = env if env is not None else {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_", "TINKER_"))}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trio_widgets", "serve", "--port", str(port), "--checkpoint-dir",
                                 str(where / "ckpt"), "--min-cycle-s", str(min_cycle_s), *args],
                                env={**base, "TRIO_API_KEYS": keys, "TRIO_OBSERVER_KEYS": observers,
                                     "TRIO_TORCH_THREADS": "1"},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "serving" in log.read_text() or proc.poll() is not None, "the server to start", 120)
        if proc.poll() is not None:
            raise RuntimeError(f"the server did not start:\n{log.read_text()}")
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def fleet_process(where: Path, *, keys: str, observer: str, min_cycle_s: float, session_timeout_s: float = 30.0,
                  pools: int = 2) -> Iterator[Any]:
    """A real `python -m trio_widgets serve --ray` (its own local Ray instance, pools of one CPU and
    one torch thread, checkpoints in `where`/ckpt): Ray runs in that process, never in the test's
    (a Ray driver leaves threads and heap behind it). Yields (url, checkpoint_dir, port, proc, log:
    its stdout and stderr); SIGINT after, unless a test stopped it already."""
    import signal
    from types import SimpleNamespace

    port, log = free_port(), where / "fleet.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_", "TINKER_", "RAY_"))}
    # (Ray's raylet gives its agents 30 s to start, then aborts the node: a busy 2-core machine takes longer)
    env.update(TRIO_API_KEYS=keys, TRIO_OBSERVER_KEYS=observer, TRIO_TORCH_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
               RAY_agent_register_timeout_ms="180000")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trio_widgets", "serve", "--ray", "--pools", str(pools),
                                 "--port", str(port), "--checkpoint-dir",
                                 str(where / "ckpt"), "--min-cycle-s", str(min_cycle_s),
                                 "--session-timeout-s", str(session_timeout_s)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "serving a fleet" in log.read_text() or proc.poll() is not None, "the fleet to start", 300)
        if proc.poll() is not None:
            raise RuntimeError(f"the fleet did not start:\n{log.read_text()[-3000:]}")
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", checkpoint_dir=str(where / "ckpt"), port=port,
                              proc=proc, log=log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


#: The fleet tests/test_fleet.py, tests/test_fleet_dashboard.py and tests/test_fleet_pytrio.py share
#: (conftest.py's `fleet`): their key, observer key, and the keys of two users who see only their own runs.
FLEET_KEY, FLEET_OBSERVER = "tml-fleet-tests", "tml-fleet-observer"
FLEET_USER_KEYS = ("pt-fleet-ada-0001", "pt-fleet-bob-0002")
# (a round trip through the front door, Serve and the ingress fits in a cycle: 2 busy cores, 4 loops)
FLEET_CYCLE_S = 0.75
FLEET_SESSION_TIMEOUT_S = 30.0


class SharedFleet:
    """One fleet_process (two pools of FLEET_CYCLE_S, the keys above) for the tests
    that use conftest.py's `fleet` fixture: a local Ray instance's start costs ~40 s of a 2-core
    machine, so the modules share one. The first of them starts it; after the last it is stopped
    with SIGINT (conftest.py's pytest_runtest_teardown), and must stop as the CLI says it does:
    exit status 0, its last line "trio: stopped". A start that failed fails each later test at once."""

    def __init__(self) -> None:
        self.fleet: Any = None
        self._stack: contextlib.ExitStack | None = None
        self._failed: BaseException | None = None

    def get(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        if self._failed is not None:
            raise RuntimeError("the shared fleet did not start (see the first test that used it)") from self._failed
        if self.fleet is None:
            stack = contextlib.ExitStack()
            try:
                self.fleet = stack.enter_context(fleet_process(
                    tmp_path_factory.mktemp("fleet"), keys=",".join((FLEET_KEY, *FLEET_USER_KEYS)),
                    observer=FLEET_OBSERVER, min_cycle_s=FLEET_CYCLE_S, session_timeout_s=FLEET_SESSION_TIMEOUT_S))
            except BaseException as exc:
                self._failed = exc
                raise
            self._stack = stack
        return self.fleet

    def stop(self) -> None:
        fleet, stack = self.fleet, self._stack
        if fleet is None or stack is None:
            return
        self.fleet = self._stack = None
        stack.close()
        printed = [line for line in fleet.log.read_text().splitlines() if line.startswith("trio: ")]
        assert fleet.proc.returncode == 0 and printed and printed[-1] == "trio: stopped", (
            f"the fleet did not stop cleanly on SIGINT (exit {fleet.proc.returncode}):\n"
            f"{fleet.log.read_text()[-3000:]}")


def three_loops(forward_backward: Callable[[], Any], optim_step: Callable[[], Any],
                wait: Callable[[Any], Any], n: int = 4) -> None:
    """naive, together and pipelined, written once for any client (sync futures)."""
    for _ in range(n):
        fb = forward_backward()
        wait(fb)
        wait(optim_step())
    for _ in range(n):
        fb, opt = forward_backward(), optim_step()
        wait(fb)
        wait(opt)
    previous = None
    for _ in range(n + 1):
        current = (forward_backward(), optim_step())
        if previous is not None:
            wait(previous[0])
            wait(previous[1])
        previous = current
    assert previous is not None
    wait(previous[0])
    wait(previous[1])


async def three_loops_async(forward_backward: Callable[[], Any], optim_step: Callable[[], Any], n: int = 4) -> None:
    """The same three loops with the async API: each call awaited once to submit, once for the result."""
    for _ in range(n):
        fb = await forward_backward()
        await fb
        opt = await optim_step()
        await opt
    for _ in range(n):
        fb = await forward_backward()
        opt = await optim_step()
        await fb
        await opt
    previous = None
    for _ in range(n + 1):
        current = (await forward_backward(), await optim_step())
        if previous is not None:
            await previous[0]
            await previous[1]
        previous = current
    assert previous is not None
    await previous[0]
    await previous[1]


def check_three_loops(pool: trio.LocalPool, client_id: str, since: int, n: int = 4) -> None:
    pairs = pairs_from_telemetry(pool, client_id, since)
    assert len(pairs) == 3 * n + 1, pairs
    naive, together, pipelined = pairs[:n], pairs[n:2 * n], pairs[2 * n:]
    assert spans_and_periods(naive) == ({3}, {4}), naive
    assert spans_and_periods(together) == ({1}, {2}), together
    assert spans_and_periods(pipelined) == ({1}, {1}), pipelined


def adapter_file(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- a network that loses one answer ------------------------------------------------------------

_HEAD_END = b"\r\n\r\n"


async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message with a Content-Length body (what our server and clients send)."""
    try:
        head = await reader.readuntil(_HEAD_END)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    m = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.I)
    body = await reader.readexactly(int(m.group(1))) if m else b""
    return head, body


class LossyProxy:
    """A TCP proxy on 127.0.0.1 in front of a server that relays every HTTP/1.1 exchange but the
    first one to `path`: that request reaches the server, which answers it, and then the proxy
    closes the client's connection instead of relaying the answer, as a network that loses a
    response. The client sees a broken connection and retries."""

    def __init__(self, target_port: int, path: str):
        self.target_port = target_port
        self.path = path.encode()
        self.dropped = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lossy-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        try:
            while True:
                request = await _read_message(reader)
                if request is None:
                    return
                up_writer.write(request[0] + request[1])
                await up_writer.drain()
                response = await _read_message(up_reader)
                if response is None:
                    return
                line = request[0].split(b"\r\n", 1)[0]
                if not self.dropped and self.path in line:
                    self.dropped += 1
                    return  # answered by the server, lost on the way back
                writer.write(response[0] + response[1])
                await writer.drain()
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._relay, "127.0.0.1", 0), self._loop)
        self._server = started.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def served(pool: trio.LocalPool, **settings: Any) -> Iterator[Any]:
    from trio_widgets.http.server import serve

    server = serve(pool, port=0, **settings)
    try:
        yield server
    finally:
        server.stop()


def assert_no_secret_in_arguments(secrets: Sequence[str]) -> int:
    """No process this one started (children, their children: a server, a fleet's Ray workers and
    replicas) has a key in its arguments, which `ps` shows every user; returns how many were read."""
    import psutil

    read = 0
    for child in psutil.Process().children(recursive=True):
        try:
            argv = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        read += 1
        leaked = [k for k in secrets if k and k in argv]
        assert not leaked, f"process {child.pid} has a key in its arguments: {argv[:300]}"
    return read
