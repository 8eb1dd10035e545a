"""The dashboard without a browser: what it shows, how it updates, what it sends.

In-process tests build the Dashboard inside a running asyncio loop (as a notebook cell
does) and observe it: the bokeh sources it streams, the messages its widgets send, the
threads that touch the bokeh document. The kernel tests run a real ipykernel: the iopub
comm messages of a busy run, and the dashboard staying live while a cell blocks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import trio_widgets as trio
from trio_widgets.ops import op_color

REPO = Path(__file__).resolve().parents[1]


def watch(dash) -> dict:
    """Observe a dashboard: messages each of its widgets sends, threads that change bokeh."""
    seen: dict = {"sends": Counter(), "threads": set()}
    for w in dash.widgets:
        original = w._send

        def counting(msg, buffers=None, original=original, name=type(w).__name__):
            seen["sends"][name] += 1
            return original(msg, buffers)

        w._send = counting
    dash.figures.layout.document.on_change(lambda event: seen["threads"].add(threading.current_thread().name))
    return seen


async def until(cond, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_import_trio_widgets_does_not_import_the_widgets():
    code = ("import sys, trio_widgets as t; assert 'bokeh' not in sys.modules and 'ipywidgets' not in sys.modules;"
            " t.Dashboard; assert 'bokeh' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_dashboard_shows_a_loop_written_by_hand(tmp_path):
    """A user's pipelined loop (the documented pattern) and a sampler show up unchanged."""
    batch = [trio.Datum(model_input=trio.ModelInput.from_ints(list(range(5, 17))),
                        loss_fn_inputs={"target_tokens": list(range(6, 18))})]

    async def main():
        with trio.LocalPool(min_cycle_s=0.02, name="observed") as pool:
            dash = trio.Dashboard(pool, export_dir=tmp_path)
            seen = watch(dash)
            tc = trio.ServiceClient(pool).create_lora_training_client(
                trio.DEFAULT_MODEL, rank=4, seed=0, user_metadata={"name": "my loop"})
            adam = trio.AdamParams(learning_rate=1e-3)
            previous = None
            for _ in range(14):  # the documented pipelined loop, untouched
                fb = await tc.forward_backward_async(batch, "cross_entropy")
                opt = await tc.optim_step_async(adam)
                if previous is not None:
                    await previous[0]
                    await previous[1]
                previous = (fb, opt)
            await previous[0]
            await previous[1]
            sampler = await tc.save_weights_and_get_sampling_client_async()
            await sampler.sample_async(trio.ModelInput.from_ints([5, 6, 7]), 1, trio.SamplingParams(max_tokens=2))
            ticks = dash.ticks
            await until(lambda: dash.ticks >= ticks + 12, "12 more ticks")  # and the advisor has run
            state = {
                "bars": dict(dash.figures.bars.data),
                "loss": dict(dash.figures.clients[tc.client_id].loss.data),
                "lanes": {v.label: v.lane for v in dash.figures.clients.values()},
                "lane_labels": dict(dash.figures.timeline.yaxis[0].major_label_overrides),
                "status": dash.status_text,
                "pill": dash.pool_state,
                "diagnosis": dash.diagnoses[tc.client_id],
                "ticks": dash.ticks,
                "patches": dash.bokeh_widget.patches_sent,
                "subscribers": pool.telemetry.subscriber_count,
                "threads": [t.name for t in threading.enumerate() if t.name.startswith("trio-dashboard")],
                "tasks": [t.get_name() for t in asyncio.all_tasks()],
            }
            await until(lambda: dash.pool_state == "idle", "the pill to say idle once nothing trains")
            paths = dash.export_trace(), dash.export_metrics(), dash.save_html()
            dash.close()
            state.update(after_close_subscribers=pool.telemetry.subscriber_count, thread_done=not dash.running,
                         final_patches=dash.bokeh_widget.patches_sent,
                         after_close_threads=[t.name for t in threading.enumerate()
                                              if t.name.startswith("trio-dashboard")])
            return state, seen, paths, dash.tick_thread.name, tc.client_id

    state, seen, paths, dash_thread, cid = asyncio.run(main())
    bars = state["bars"]
    mine = [i for i, c in enumerate(bars["client"]) if c == "my loop"]
    ops = Counter(bars["op"][i] for i in mine)
    assert ops["forward_backward"] == 14 and ops["optim_step"] == 14, ops
    assert "sample" in bars["op"]  # the sampler's lane, coloured by op
    colors = {op: bars["color"][bars["op"].index(op)] for op in ("forward_backward", "optim_step", "sample")}
    assert colors == {op: op_color(op) for op in colors} and len(set(colors.values())) == 3
    assert all(isinstance(c, int) and c >= 0 for c in bars["cycle"])
    assert all(w >= 0 for w in bars["wait_ms"])
    # the sampler made from the run shares its lane
    assert len(state["lanes"]) == 2 and set(state["lanes"].values()) == {0}
    assert state["lane_labels"] == {0: "my loop +1 sampler"}
    assert state["loss"]["step"] == list(range(1, 15))
    assert state["loss"]["loss"][-1] < state["loss"]["loss"][0]  # it learns the fixed batch
    assert "cycle " in state["status"] and "my loop: <b>1</b> cycle/update" in state["status"]
    assert state["diagnosis"].cause == "pipelined"
    # coalescing: at most one PATCH-DOC (3 messages, no binary buffers) per tick
    assert 0 < state["patches"] <= state["ticks"]
    assert seen["sends"]["BatchedBokehModel"] == 3 * state["final_patches"]
    assert seen["threads"] == {dash_thread}  # every bokeh change on the dashboard's own thread
    assert state["threads"] == [dash_thread] and dash_thread.startswith("trio-dashboard-")
    assert not [t for t in state["tasks"] if t.startswith("trio")]  # nothing of it on the caller's loop
    assert state["pill"] == "training"  # a hand-written loop trains: the pill says so
    assert state["subscribers"] == 1 and state["after_close_subscribers"] == 0
    assert state["thread_done"] and state["after_close_threads"] == []

    trace, metrics, page = (Path(p) for p in paths)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"clock", f"my loop ({cid})"} <= names
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "forward_backward"]
    assert len(spans) == 14 and all(e["dur"] > 0 and "queued_ms" in e["args"] for e in spans)
    assert any(e["ph"] == "C" and e["name"] == "queue my loop" for e in events)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["run"] == "my loop"] == list(range(1, 15))
    html = page.read_text()
    assert "cdn.bokeh.org" not in html and "Bokeh" in html and "my loop" in html and "Advisor" in html


def test_buttons_from_other_threads_drive_training(tmp_path):
    """Clicks arrive on a non-loop thread (a subshell): training still runs on the loop."""

    async def main():
        with trio.LocalPool(min_cycle_s=0.03, name="buttons") as pool:
            dash = trio.Dashboard(pool, runs=2, batch_size=2, rank=4, learning_rate=2e-3, export_dir=tmp_path)
            seen = watch(dash)

            def click(name):
                button = dash.controls.buttons.get(name) or dash.controls.export_buttons[name]
                t = threading.Thread(target=button.click, name=f"clicker-{name}")
                t.start()
                t.join()

            click("Start")
            await until(lambda: dash.state == "running" and pool.telemetry.total_updates >= 6, "training")
            await until(lambda: dash.pool_state == "training", "the pill to say training")
            lrs = [r.learning_rate for r in dash.runs]
            labels = [pool.telemetry.clients[r.client.client_id].label for r in dash.runs]
            for key, value in (("lr", 1e-3), ("log", True)):  # settings changed from another thread too
                threading.Thread(target=setattr, args=(dash.controls.settings[key], "value", value)).start()
            await until(lambda: dash.runs[0].learning_rate == 5e-4, "new learning rate")
            await until(lambda: dash.figures.loss_figs[1].visible, "log-scale loss figure")
            assert not dash.figures.loss_figs[0].visible
            # the labels follow the learning rate
            await until(lambda: dash.figures.clients[dash.runs[0].client_id].label == "run1 lr=0.0005", "relabel")
            relabelled = [dash.figures.clients[r.client_id].label for r in dash.runs]
            click("Pause")
            await until(lambda: dash.state == "paused", "paused")
            updates, cycle = pool.telemetry.total_updates, pool.cycle_index
            await until(lambda: pool.cycle_index >= cycle + 10, "10 idle cycles")
            paused_updates = pool.telemetry.total_updates
            paused_text = dash.status_text
            click("Resume")
            await until(lambda: pool.telemetry.total_updates >= updates + 4, "resumed")
            click("Stop")
            await until(lambda: dash.state == "stopped", "stopped")
            for name in ("trace", "metrics", "html"):
                click(name)
            await until(lambda: "trio-dashboard.html" in dash.controls.export_note.value, "exports")
            pool.close()  # the dashboard notices and lets go of the pool
            await until(lambda: dash.state == "closed" and not dash.subscribed, "the dashboard to let go")
            await until(lambda: "CLOSED" in dash.status_text.upper() and "tokens/s" not in dash.status_text,
                        "a closed pill without a stale rate")
            out = dict(lrs=lrs, labels=labels, relabelled=relabelled, updates=updates, paused_updates=paused_updates,
                       paused_text=paused_text, seen=seen, subscribed=dash.subscribed, state=dash.state,
                       steps=[r.step for r in dash.runs], dash_thread=dash.tick_thread.name)
            dash.close()
            return out

    out = asyncio.run(main())
    assert out["lrs"] == [1e-3, 2e-3] and out["labels"] == ["run1", "run2"]
    assert out["relabelled"] == ["run1 lr=0.0005", "run2 lr=0.001"]
    assert out["paused_updates"] == out["updates"] and "paused" in out["paused_text"]
    assert out["seen"]["threads"] == {out["dash_thread"]}
    assert not out["subscribed"] and out["state"] == "closed"
    assert all(s > 0 for s in out["steps"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "trio-dashboard.html", "trio-trace.json"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["run"] for r in rows} == {"run1", "run2"} and "time/wait" in rows[0]


KERNEL_SETUP = """
import asyncio, json, time
import trio_widgets as trio
from IPython.display import display
pool = trio.LocalPool(min_cycle_s=0.05, name="kernel")
dash = trio.Dashboard(pool, runs=3, batch_size=4, rank=4)
display(dash)
"""

KERNEL_BUSY = """
dash.start()
while not (dash.state == "running" and pool.telemetry.total_updates >= 9 and dash.bokeh_widget.live):
    await asyncio.sleep(0.05)
t0, u0, p0 = time.time(), pool.telemetry.total_updates, dash.bokeh_widget.patches_sent
await asyncio.sleep(6.0)
print(json.dumps({"t0": t0, "t1": time.time(), "updates": pool.telemetry.total_updates - u0,
                  "patches": dash.bokeh_widget.patches_sent - p0}))
dash.stop()
"""

KERNEL_AFTER = """
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9)
batches = [[trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7, 8]),
                       loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})]] * 3
run = trio.run_sync(trio.train(tc, batches))  # a blocking cell, inside the kernel's running loop
import threading
print(json.dumps({"steps": run.step, "threads": sum(t.name.startswith("trio-dashboard") for t in threading.enumerate()),
                  "old_closed": old.closed}))
"""


def _execute(kc, code: str, cell_id: str, timeout: float = 120) -> tuple[str, list[dict]]:
    """Run `code` as notebook cell `cell_id`; returns (stdout, every iopub message meanwhile)."""
    msg = kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                         metadata={"cellId": cell_id})
    kc.shell_channel.send(msg)
    msg_id, out, seen = msg["header"]["msg_id"], [], []
    deadline = time.monotonic() + timeout
    while True:
        m = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        seen.append(m)
        parent = m["parent_header"].get("msg_id")
        if parent == msg_id and m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        if parent == msg_id and m["msg_type"] == "error":
            raise AssertionError("\n".join(m["content"]["traceback"]))
        if parent == msg_id and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(out), seen


def test_busy_run_sends_at_most_100_comm_messages_per_second_real_kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _execute(kc, KERNEL_SETUP, "setup")
        text, messages = _execute(kc, KERNEL_BUSY, "busy")
        window = json.loads(text.strip().splitlines()[-1])
        comm = [m for m in messages if m["msg_type"] == "comm_msg"
                and window["t0"] <= m["header"]["date"].timestamp() <= window["t1"]]
        seconds = window["t1"] - window["t0"]
        rate = len(comm) / seconds
        kinds = Counter(m["content"]["data"].get("method", "?") + ":" + str(m["content"]["data"].get("content", {})
                        .get("msg", "") if isinstance(m["content"]["data"].get("content"), dict) else "")
                        for m in comm)
        print(f"{len(comm)} comm messages in {seconds:.1f} s = {rate:.1f}/s; {window['updates']} updates, "
              f"{window['patches']} bokeh patches; {dict(kinds)}")
        assert window["updates"] >= 30  # it was busy
        assert window["patches"] >= 2 * seconds  # and the dashboard streamed all along
        assert rate <= 100, rate
        # re-running the cell that built it replaces the dashboard: one task, the old one closed
        _execute(kc, "old = dash", "keep")
        _execute(kc, KERNEL_SETUP, "setup")
        text, _ = _execute(kc, KERNEL_AFTER, "after")
        after = json.loads(text.strip().splitlines()[-1])
        assert after == {"steps": 3, "threads": 1, "old_closed": True}, after
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
