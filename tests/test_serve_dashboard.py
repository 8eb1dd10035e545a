"""`trio.Dashboard("http://...")`: a served pool watched through its telemetry stream, without
a browser (tests/browser/test_remote_dashboard.py shows it in JupyterLab)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from served import served, wait_for

import trio_widgets as trio
from trio_widgets.http.remote import RemotePool

KEYS = ["tml-remote-alice", "tml-remote-bob-1"]
WATCH = "tml-remote-watcher"
ADAM = trio.AdamParams(learning_rate=3e-3)
UPDATES = 16


def train(url: str, key: str, name: str) -> tuple[trio.ServiceClient, trio.TrainingClient]:
    """A pipelined loop over HTTP; returns the service and the client, still open (a dropped
    client is released: its lane would be retired)."""
    service = trio.ServiceClient(base_url=url, api_key=key)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=len(name),
                                             user_metadata={"name": name})
    batch = [trio.Datum(trio.ModelInput.from_ints(list(range(5, 21))), {"target_tokens": list(range(6, 22))})]
    previous = None
    for _ in range(UPDATES):
        current = (tc.forward_backward(batch), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result(timeout=120)
            previous[1].result(timeout=120)
        previous = current
    assert previous is not None
    previous[1].result(timeout=120)
    return service, tc


async def until(cond, what: str, timeout: float = 90.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_remote_dashboard_shows_every_served_client(tmp_path):
    before = set(threading.enumerate())  # another test's dropped client may still await collection

    async def main():
        with trio.LocalPool(min_cycle_s=0.05, name="watched", checkpoint_dir=str(tmp_path)) as pool, \
                served(pool, api_keys=KEYS, observer_keys=[WATCH]) as server:
            with pytest.raises(trio.PermissionDeniedError, match="observer"):
                trio.Dashboard(server.url, api_key=KEYS[0])
            dash = trio.Dashboard(server.url, api_key=WATCH, export_dir=tmp_path)
            assert isinstance(dash.pool, RemotePool) and dash.pool.min_cycle_s == 0.05
            runs = await asyncio.gather(asyncio.to_thread(train, server.url, KEYS[0], "alice"),
                                        asyncio.to_thread(train, server.url, KEYS[1], "bob"))
            ids = [server.clients()[tc.client_id] for _, tc in runs]

            def shown() -> bool:
                bars = dash.figures.bars.data
                done = [sum(1 for c, op in zip(bars["client"], bars["op"]) if c.endswith(name) and op == "optim_step")
                        for name in ("alice", "bob")]
                return done == [UPDATES, UPDATES] and all(cid in dash.diagnoses for cid in ids)

            await until(shown, "both clients' updates in the remote dashboard")
            ticks = dash.ticks
            await until(lambda: dash.ticks >= ticks + 12, "a second of ticks (the advisor runs once a second)")
            state = {"labels": sorted(v.label for v in dash.figures.clients.values()),
                     "status": dash.status_text, "causes": {cid: dash.diagnoses[cid].cause for cid in ids},
                     "start_disabled": dash.controls.buttons["Start"].disabled, "state": dash.state,
                     "patches": dash.bokeh_widget.patches_sent, "ticks": dash.ticks,
                     "remote_updates": dash.pool.telemetry.total_updates,
                     "local_updates": pool.telemetry.total_updates,
                     "remote_fb": sorted(r.cycle for r in dash.pool.telemetry.requests_of(ids[0])
                                         if r.op == "forward_backward"),
                     "local_fb": sorted(r.cycle for r in pool.telemetry.requests_of(ids[0])
                                        if r.op == "forward_backward")}
            trace = Path(dash.export_trace())
            reader = dash.pool._thread
            dash.close()
            await asyncio.sleep(0.05)
            assert not reader.is_alive()
            wait_for(lambda: server._service.streams == 0, "the server to drop the stream")
            for service, _ in runs:
                service.close()
            return state, trace

    state, trace = asyncio.run(main())
    assert sorted(state["labels"]) == ["alice", "bob"]  # the names the models were given (sessions unnamed)
    for name in ("alice", "bob"):  # each client's measured cycles per update, as for a local pool
        assert re.search(rf"{name}: <b>[\d.]+</b> cycles?/update", state["status"]), state["status"]
    assert len(state["causes"]) == 2  # and the advisor's diagnosis of each
    assert state["start_disabled"] and state["state"] == "watching"  # it watches; participants train
    assert 0 < state["patches"] <= state["ticks"]  # one batched message per tick at most, as local
    assert state["remote_updates"] == state["local_updates"]
    assert state["remote_fb"] == state["local_fb"]  # the same record, cycle for cycle
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {n.split(" (")[0] for n in names} >= {"alice", "bob"}  # a thread per lane, named by its label
    assert not [t for t in set(threading.enumerate()) - before
                if t.name.startswith(("trio-remote", "trio-http", "trio-serve"))]


def test_a_connecting_viewer_gets_a_bounded_snapshot_and_the_servers_gil_stalls(tmp_path, monkeypatch):
    """Full ring buffers (thousands of cycles and requests) give a snapshot of at most ~100 KB, and
    the GIL stalls the server's watchdog records reach a remote view (issue 23)."""
    from trio_widgets.engine import clock
    from trio_widgets.http.stream import SNAPSHOT_BYTES

    monkeypatch.setattr(clock, "_IDLE_TICK_S", 0.001)  # idle cycles fill the buffer in seconds

    with trio.LocalPool(min_cycle_s=0.0, checkpoint_dir=str(tmp_path), name="snapshot") as pool, \
            served(pool) as server:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
        batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})]
        futures = [tc.forward(batch) for _ in range(600)]
        futures[-1].result(timeout=120)
        wait_for(lambda: len(pool.telemetry.cycles) >= 4096, "full cycle buffer", 120)
        with httpx.stream("GET", f"{server.url}/api/v1/trio/telemetry", timeout=30) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        snapshot = json.loads(first[6:])["backfill"]
        assert len(first) <= SNAPSHOT_BYTES + 4096 <= 100_000 + 4096, len(first)
        assert snapshot["cycles"] and snapshot["requests"] and snapshot["boundaries"]
        assert snapshot["cycles"][-1]["index"] >= pool.cycle_index - 50  # the newest, not the oldest

        remote = RemotePool(server.url)
        try:
            wait_for(lambda: remote.telemetry.total_cycles > 0, "the stream", 30)
            before = len(remote.telemetry.gil)
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # pure Python in the server's process
                sum(i * i for i in range(20_000))
            wait_for(lambda: len(pool.telemetry.gil) > 0, "the server's watchdog saw the stall", 30)
            wait_for(lambda: len(remote.telemetry.gil) > before, "the stall streamed to the remote view", 30)
            stall = remote.telemetry.gil[-1]
            assert stall.duration_s > 0 and stall.heartbeats >= 1
        finally:
            remote.close()
