"""The dashboard without a browser: what it shows, how it updates, what it sends.

In-process tests build the Dashboard inside a running asyncio loop (as a notebook cell
does) and observe it: the bokeh sources it streams, the messages its widgets send, the
threads that touch the bokeh document. The kernel tests run a real ipykernel: the iopub
comm messages of a busy run, and the dashboard staying live while a cell blocks.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

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
            # 6 more ticks (>= 1.2 s at the default 5 Hz): the advisor (once a second) and the loss
            # curve (redrawn once a second) have caught up, and the pill still says training
            await until(lambda: dash.ticks >= ticks + 6, "6 more ticks")
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


# -- bounded series, lanes, inputs, following a pool (no kernel needed) ---------------------------

def test_loss_series_stays_bounded_and_keeps_recent_steps_exactly():
    from trio_widgets.widgets.series import LossSeries

    series = LossSeries(recent=50, history=40)
    source_rows: list[float] = []  # what a bokeh source fed by flush() would hold
    for step in range(1, 100_001):
        series.add(step, 1.0 / step, 2.0 / step)
        out = series.flush()
        if out is None:
            continue
        kind, rows = out
        source_rows = rows["step"] if kind == "replace" else source_rows + rows["step"]
        assert len(source_rows) <= 40 + 1 + 2 * 50
    assert source_rows == series.rows()["step"] and len(series) == len(source_rows)
    assert source_rows == sorted(source_rows)  # in order: one line, no zig-zags
    assert source_rows[-50:] == list(range(100_000 - 49, 100_001))  # the recent window, every step
    assert series.stride >= 1024  # history buckets doubled as the run grew
    assert source_rows[0] == (1 + series.stride) / 2  # the start of the run is still there, averaged


def _info(cid: str, kind: str = "training", parent: str | None = None):
    from trio_widgets.telemetry import ClientInfo

    return ClientInfo(cid, kind, trio.DEFAULT_MODEL, cid, 4, parent=parent)


def test_lanes_reuse_samplers_join_their_parent_and_none_is_dropped():
    from trio_widgets.widgets.figures import DashboardFigures

    figs = DashboardFigures(0.0, lanes_visible=4, max_curves=6)
    models = len(figs.layout.document.models) if figs.layout.document else None
    for i in range(7):  # more clients than lanes shown
        figs.add_client(_info(f"t{i}"))
    assert [figs.clients[f"t{i}"].lane for i in range(7)] == list(range(7)) and figs.lane_count == 7
    assert figs.timeline.y_range.start == -3.6  # four lanes shown...
    figs.scroll_lanes(3)  # ...and the others reached by scrolling
    assert (figs.timeline.y_range.start, figs.timeline.y_range.end) == (-6.6, -2.05)
    # a sampler made from t1 shares its lane; the lane says so
    figs.add_client(_info("s1", "sampling", parent="t1"))
    assert figs.clients["s1"].lane == 1
    assert figs.timeline.yaxis[0].major_label_overrides[-1] == "t1 +1 sampler"
    # seven live runs, six curve slots: one is not drawn, and the title says so
    assert figs.hidden_curves == 1 and "1 more run not drawn" in figs.loss_figs[0].title.text
    assert figs.clients["t6"].curve is None
    # retiring gives the lane back (the next client takes the lowest free one), and its curve
    # slot goes to the live run that had none
    figs.retire_client("t2")
    assert figs.clients["t6"].curve is not None and "t2" not in figs.clients and figs.hidden_curves == 0
    figs.add_client(_info("t7"))
    assert figs.clients["t7"].lane == 2 and figs.hidden_curves == 1
    # t1 retires while its sampler lives on: the lane passes to the sampler, not to a newcomer
    figs.retire_client("t1")
    figs.add_client(_info("t8"))
    assert figs.clients["s1"].lane == 1 and figs.clients["t8"].lane == 7
    drawn = {c for c, v in figs.clients.items() if v.curve is not None}
    assert drawn == {"t0", "t3", "t4", "t5", "t6", "t7"} and figs.hidden_curves == 1  # live runs first
    if models is not None:
        assert len(figs.layout.document.models) == models  # nothing is added to the document afterwards


def test_every_model_is_built_up_front():
    """A model added to a live bokeh document makes bokeh walk the whole document: the figures
    only change values after they are built."""
    from bokeh.document import Document

    from trio_widgets.widgets.figures import DashboardFigures

    figs = DashboardFigures(0.0, lanes_visible=3, max_curves=4)
    doc = Document()
    doc.add_root(figs.layout)
    before = {m.id for m in doc.models}
    for i in range(6):
        figs.add_client(_info(f"t{i}"))
    figs.add_client(_info("s0", "sampling", parent="t0"))
    figs.set_log_scale(True)
    figs.retire_client("t3")
    figs.relabel("t0", "renamed")
    figs.reset()
    assert {m.id for m in doc.models} == before


def test_settings_are_checked_clamped_or_confirmed():
    from trio_widgets.widgets.controls import check_setting

    assert check_setting("lr", 0, 3e-3)[0] == "refuse"
    assert check_setting("lr", -1, 3e-3) == ("refuse", 3e-3, "lr must be a number above 0 (got -1): kept 0.003")
    assert check_setting("lr", float("nan"), 3e-3)[0] == "refuse"
    verdict, value, question = check_setting("lr", 1e9, 3e-3)
    assert verdict == "confirm" and value == 1e9 and "far outside 1e-06–0.1" in question
    assert check_setting("lr", 1e-3, 3e-3) == ("apply", 1e-3, "")
    assert check_setting("batch_size", 100, 8) == ("apply", 64, "batch 100 is outside 1–64: using 64")
    assert check_setting("runs", 0, 3) == ("apply", 1, "runs 0 is outside 1–16: using 1")
    assert check_setting("lookahead", "x", 1)[0] == "refuse"


def test_settings_given_in_code_are_refused_or_said_never_clamped():
    """Issue 14 item 8 for the constructor: lr 0 / -1 / NaN and out-of-range integers are errors
    (not clamped), lr 1e9 is kept as given and said in the dashboard's status."""
    with trio.LocalPool(min_cycle_s=0.02, name="ctor-inputs") as pool:
        for kw, message in ((dict(learning_rate=0), "learning_rate must be a number above 0; got 0"),
                            (dict(learning_rate=-1), "learning_rate must be a number above 0; got -1"),
                            (dict(learning_rate=float("nan")), "above 0; got nan"),
                            (dict(batch_size=100), "batch_size must be a whole number from 1 to 64; got 100"),
                            (dict(runs=0), "runs must be a whole number from 1 to 16; got 0"),
                            (dict(lookahead=2.5), "lookahead must be a whole number from 0 to 8; got 2.5")):
            with pytest.raises(ValueError, match=re.escape(message)):
                trio.Dashboard(pool, **kw)
        dash = trio.Dashboard(pool, learning_rate=1e9)
        try:
            assert dash.controls.settings["lr"].value == 1e9
            assert any("lr=1e+09 is far outside 1e-06–0.1" in n and "used as given" in n for n in dash.notices)
            deadline = time.monotonic() + 10
            while "far outside" not in dash._status.value:  # the line shows in the status, where one looks
                assert time.monotonic() < deadline, dash._status.value
                time.sleep(0.1)
        finally:
            dash.close()


def test_start_runs_labels_name_their_lr_even_if_drawn_before_the_run_existed():
    """A Start run's client can be drawn before its run is made (the label is then the bare
    client name, as seen once in a closed snapshot: "run1" beside "run2 lr=0.003"): the next
    tick gives it its name and lr."""
    async def main():
        with trio.LocalPool(min_cycle_s=0.02, name="labels") as pool:
            dash = trio.Dashboard(pool, runs=2, batch_size=2, rank=4, learning_rate=2e-3)
            dash.start()
            await until(lambda: dash.state == "running" and all(r.step >= 1 and r.client_id in dash.figures.clients
                                                                 for r in dash.runs), "training, drawn")
            cid = dash.runs[0].client_id
            dash._on_thread(lambda: dash.figures.relabel(cid, "run1"))  # the stale label
            await until(lambda: dash.figures.clients[cid].label == "run1 lr=0.001", "the label back")
            labels = [dash.figures.clients[r.client_id].label for r in dash.runs]
            dash.close()
            return labels

    assert asyncio.run(main()) == ["run1 lr=0.001", "run2 lr=0.002"]


def test_dashboard_says_what_it_did_with_odd_inputs():
    async def main():
        with trio.LocalPool(min_cycle_s=0.02, name="inputs") as pool:
            dash = trio.Dashboard(pool, runs=2, batch_size=2, rank=4, learning_rate=2e-3)
            dash.start()
            await until(lambda: dash.state == "running" and all(r.step >= 2 for r in dash.runs), "training")
            dash.set(lr=-1)
            await until(lambda: "kept 0.002" in dash.controls.setting_note.value, "a refusal")
            assert dash.controls.settings["lr"].value == 2e-3 and dash.runs[0].learning_rate == 1e-3
            dash.set(lr=1.0)  # far outside the usual range: asks first, applies nothing yet
            await until(lambda: dash.controls.confirm.layout.display is None, "a question")
            asked = dash.controls.setting_note.value
            assert dash.runs[0].learning_rate == 1e-3
            dash.controls.confirm.click()
            # the lr is applied, then the labels follow it (on the dashboard's thread: wait for both)
            # (the lane may be drawn a tick after the lr changed: looked up, not assumed)
            await until(lambda: dash.runs[0].learning_rate == 0.5 and "0.5" in getattr(
                dash.figures.clients.get(dash.runs[0].client_id), "label", ""), "the confirmed lr and its label")
            label = dash.figures.clients[dash.runs[0].client_id].label
            dash.set(batch_size=1000)
            await until(lambda: "using 64" in dash.controls.setting_note.value, "a clamp")
            out = dict(asked=asked, label=label, batch=dash.controls.settings["batch_size"].value,
                       notices=dash.notices, hidden=dash.controls.confirm.layout.display)
            dash.close()
            return out

    out = asyncio.run(main())
    assert "lr=1 is far outside" in out["asked"] and out["hidden"] == "none"
    assert out["label"] == "run1 lr=0.5" and out["batch"] == 64
    assert any("lr set to 1" in n for n in out["notices"])


def test_a_dashboard_without_a_pool_follows_the_newest():
    async def main():
        dash = trio.Dashboard()
        try:
            await until(lambda: dash.ticks >= 2, "ticks")
            first = dash.pool
            with trio.LocalPool(min_cycle_s=0.02, name="follow-a") as a:
                await until(lambda: dash.pool is a and "follow-a" in dash.status_text, "the new pool")
                text_a = dash.status_text
                with trio.LocalPool(min_cycle_s=0.02, name="follow-b") as b:
                    await until(lambda: dash.pool is b, "the newer pool")
                    await until(lambda: any("now showing the newest pool 'follow-b'" in n for n in dash.notices),
                                "the switch said")
                await until(lambda: dash.pool is a and "was closed" in dash.status_text, "back to the open one")
            await until(lambda: dash.pool_state in ("closed", "waiting") or dash.pool is not a, "a's end")
            return first, text_a, dash.notices
        finally:
            dash.close()

    first, text_a, notices = asyncio.run(main())
    assert "follow-a" in text_a
    # which pool is shown is said once, as it stands now: each switch's line replaced the one before
    shown = [n for n in notices if "showing" in n or "was closed" in n]
    assert len(shown) == 1 and "'follow-a'" in shown[0], notices


def test_a_pool_closed_by_its_cells_rerun_reads_waiting_then_the_new_pool(monkeypatch):
    """Re-running the cell that built the pool closes it before the new one is ready: the pill
    says WAITING meanwhile, never CLOSED, and then shows the new pool."""
    import trio_widgets._notebook as notebook

    monkeypatch.setattr(notebook, "current_cell_id", lambda: "cell-rerun")
    a = trio.LocalPool(min_cycle_s=0.02, name="rerun-a")
    dash = trio.Dashboard(a)
    seen = []
    close_a = a.close

    def close_and_look(*args, **kwargs):  # called by the new pool's constructor, before it is ready
        close_a(*args, **kwargs)
        seen.append(dash.pool_state)

    a.close = close_and_look
    try:
        with trio.LocalPool(min_cycle_s=0.02, name="rerun-b") as b:
            deadline = time.monotonic() + 30
            while dash.pool is not b and time.monotonic() < deadline:
                time.sleep(0.02)
            assert dash.pool is b and dash.pool_state != "closed"
        assert seen == ["waiting"], seen
        assert any("ran again: now showing its new pool 'rerun-b'" in n for n in dash.notices), dash.notices
    finally:
        dash.close()
        close_a()


def test_cycle_labels_never_touch_even_when_cycles_are_uneven():
    """Issue 14 item 7 ("837838839"): labels are round cycle numbers, and at the narrowest
    width (a 900 px column) no two visible ones are closer than their own width."""
    from trio_widgets.telemetry import CycleRecord
    from trio_widgets.widgets.figures import MIN_PLOT_PX, DashboardFigures

    figs = DashboardFigures(0.0)
    t, cycles, labelled = 0.0, [], 0
    for i in range(1000, 1400):
        d = 0.4 if i % 37 == 0 else 0.004  # a long cycle now and then squeezes the short ones
        cycles.append(CycleRecord(i, t, t + d, d, 0, 0))
        t += d
        if len(cycles) == 7:
            figs.update(cycles, [], [])
            cycles = []
            data = figs.bands.data
            span = figs.x_range.end - figs.x_range.start
            shown = [(m, text) for m, text in zip(data["mid"], data["label"])
                     if text and figs.x_range.start <= m <= figs.x_range.end]
            for (m0, a), (m1, b) in zip(shown, shown[1:]):
                gap = (m1 - m0) * MIN_PLOT_PX / span
                assert gap >= 3.5 * (len(a) + len(b)), (a, b, gap)
            labelled += bool(shown)
    assert labelled >= 50  # and there are labels to read


def test_an_idle_pool_sends_nothing_and_a_hidden_view_gets_one_catch_up():
    """Issue 24 item 2: an idle pool's dashboard stops sending once its first idle second is
    drawn; a page that says every view is hidden gets nothing until a view is seen again, then
    one PATCH-DOC of the current values (the latest cycles included)."""
    batch = [trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})]

    def report(bk, view: str, visible: bool) -> None:
        # what the page's VISIBILITY_JS sends (its plain object may arrive as BokehJS's map)
        data = {"type": "map", "entries": [["name", "trio_visibility"], ["view", view], ["visible", visible]]}
        bk._sync_model(None, {"event": "jsevent", "kind": "MessageSent", "msg_data": data}, [])

    async def main():
        with trio.LocalPool(min_cycle_s=0.0, name="quiet") as pool:
            dash = trio.Dashboard(pool)
            seen = watch(dash)
            bk = dash.bokeh_widget
            try:
                await until(lambda: dash.pool_state == "idle" and dash.ticks >= 12, "an idle, settled dashboard")
                sends, cycle = sum(seen["sends"].values()), pool.cycle_index
                ticks = dash.ticks
                await until(lambda: dash.ticks >= ticks + 10 and pool.cycle_index >= cycle + 10, "idle ticks")
                idle = {"sends": sum(seen["sends"].values()) - sends, "status": dash.status_text}

                report(bk, "a", False)
                report(bk, "b", True)  # one view still seen: it is sent to
                assert not bk.views_hidden()
                report(bk, "b", False)
                assert bk.views_hidden()
                tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=1, seed=0)
                sends, patches = sum(seen["sends"].values()), bk.patches_sent
                for _ in range(3):
                    await tc.forward_backward_async(batch, "cross_entropy")
                    await (await tc.optim_step_async(trio.AdamParams(learning_rate=1e-3)))
                ticks = dash.ticks
                await until(lambda: dash.ticks >= ticks + 3, "ticks while hidden")
                hidden = {"sends": sum(seen["sends"].values()) - sends, "patches": bk.patches_sent - patches,
                          "paused": bk.paused, "bars": len(dash.figures.bars.data["left"])}
                report(bk, "a", True)
                await until(lambda: not bk.paused and bk.patches_sent > patches, "the catch-up")
                ticks = dash.ticks
                await until(lambda: dash.ticks >= ticks + 2, "two more ticks")
                shown = {"patches": bk.patches_sent - patches, "status": dash.status_text, "cycle": pool.cycle_index}
                return idle, hidden, shown
            finally:
                dash.close()

    idle, hidden, shown = asyncio.run(main())
    assert idle["sends"] == 0, idle
    assert hidden["sends"] == 0 and hidden["patches"] == 0 and hidden["paused"], hidden
    assert hidden["bars"] >= 6  # the figures followed the pool meanwhile (in Python)
    assert shown["patches"] >= 1, shown  # the catch-up (then the idle second after the run is drawn)
    assert "updates <b>3</b>" in shown["status"], shown


def test_visibility_reports_are_bounded_and_a_stale_hidden_is_not_trusted():
    from trio_widgets.widgets import _bokeh_setup

    pool = trio.LocalPool(min_cycle_s=0.05, name="stale")
    dash = trio.Dashboard(pool, refresh_hz=1)
    bk = dash.bokeh_widget
    try:
        for i in range(40):
            bk._sync_model(None, {"event": "jsevent", "kind": "MessageSent",
                                  "msg_data": {"name": "trio_visibility", "view": f"v{i}", "visible": False}}, [])
        assert len(bk.visibility) == _bokeh_setup._VIEWS_KEPT and bk.visibility_reports == 40
        assert bk.views_hidden()
        # a "hidden" not said again lately may be a page the kernel cannot hear (a cell blocks it)
        assert not bk.views_hidden(time.monotonic() + _bokeh_setup.HIDDEN_TRUST_S + 1)
    finally:
        dash.close()
        pool.close()


def test_a_wait_stopped_in_this_kernel_is_said_in_the_dashboard():
    """Kernel → Interrupt (SIGINT, as the kernel gets it) of `.result()`: the cell's one line, and
    the dashboard's status says whose wait stopped and what became of the request."""
    import os
    import signal

    from trio_widgets.futures import WaitInterrupted

    with trio.LocalPool(min_cycle_s=0.02, name="wait-stop") as pool:
        dash = trio.Dashboard(pool)
        try:
            tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4,
                                                                      user_metadata={"name": "mine"})
            batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})]
            with pool.hold():  # it stays queued: the wait stops, the request stays
                future = tc.forward_backward(batch)
                timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
                timer.start()
                with pytest.raises(WaitInterrupted, match="it is still queued and will run"):
                    future.result(timeout=60)
                timer.join()
            said = re.compile(r"mine: the wait for forward_backward \(request #\d+\) stopped \(interrupted\); "
                              r"it is still queued and will run")
            asyncio.run(until(lambda: any(said.match(n) for n in dash.notices), "the dashboard to say so", 30))
            assert future.result(timeout=60).metrics  # it ran once the hold ended
        finally:
            dash.close()


def test_a_message_crossing_a_dashboards_close_is_dropped_without_a_warning():
    """The page may send to a widget in the instant after the kernel closed it (the two cross on
    the wire). For the dashboard's own comms the kernel says nothing; any other comm still gets
    the comm manager's "No such comm" (which JupyterLab shows in red)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _execute(kc, KERNEL_SETUP, "setup")
        text, _ = _execute(kc, "print(json.dumps([w.model_id for w in [dash, *dash.widgets]]))", "ids")
        ids = json.loads(text.strip().splitlines()[-1])
        _execute(kc, "dash.close(); pool.close()", "close")
        stranger = "f" * 32

        def said_after(comm_id: str) -> list[str]:
            kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
                "method": "custom", "content": {"event": "late"}}}))
            # a cell after it: its idle says the kernel has handled the comm message before it
            _, seen = _execute(kc, "pass", "after")
            return [m["content"]["text"] for m in seen if m["msg_type"] == "stream"
                    and "No such comm" in m["content"]["text"]]

        assert any(stranger in t for t in said_after(stranger))  # the kernel does say it
        for comm_id in ids:
            assert said_after(comm_id) == [], comm_id
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_watched_loops_time_axis_follows_its_requests_without_cycles():
    """trio.watch has no cycles: the timeline and in-flight plots follow the bars and marks they
    hold (they stayed at 0..1), and the y ranges hold every lane and depth."""
    from trio_widgets.telemetry import ClientInfo, QueueDepthRecord, RequestRecord
    from trio_widgets.widgets.figures import DashboardFigures

    figs = DashboardFigures(100.0, window=8)
    figs.client_side()
    for k in range(3):
        figs.add_client(ClientInfo(f"c{k}", "training", "m", f"client {k}"))
    t, marks, requests = 100.0, [], []
    for i in range(200):  # more than either source keeps: both roll over
        cid = f"c{i % 3}"
        r = RequestRecord(i, cid, "forward_backward", queued_at=t, started_at=t, finished_at=t + 0.3,
                          status="ok")
        requests.append(r)
        marks.append(QueueDepthRecord(2 * i, t, {cid: 1 + i % 4}))
        marks.append(QueueDepthRecord(2 * i + 1, t + 0.3, {cid: i % 4}))
        t += 0.1
        if i % 10 == 9:
            assert figs.update([], marks, requests)
            marks, requests = [], []
    bars, queue = figs.bars.data, figs.queue.data
    x0, x1 = figs.x_range.start, figs.x_range.end
    assert (x0, x1) != (0.0, 1.0)
    assert x0 <= min(bars["left"]) and max(bars["right"]) <= x1, (x0, x1)
    assert x0 <= queue["t"][0] and queue["t"][-1] <= x1
    # the two plots show the same stretch of time: the marks reach back as far as the bars
    assert queue["t"][0] <= min(bars["left"]) + 0.5
    lanes = figs.timeline.y_range
    assert lanes.start <= min(bars["bottom"]) and max(bars["top"]) <= lanes.end
    depths = [v for k, col in queue.items() if k != "t" for v in col]
    assert figs.queue_fig.y_range.start <= min(depths) and max(depths) < figs.queue_fig.y_range.end


def test_every_mark_is_explained_and_a_disabled_button_says_why():
    """The red GIL shading has a legend item once drawn; the queue lines' colours are said; a
    disabled button's tooltip says why, and a watching dashboard says it beside the buttons."""
    from trio_widgets.telemetry import GilStall
    from trio_widgets.widgets.controls import WHY_ALL, Controls
    from trio_widgets.widgets.figures import GIL_LEGEND, DashboardFigures

    figs = DashboardFigures(0.0)
    labels = [item.label.value for item in figs.timeline.below[0].items]
    assert GIL_LEGEND in labels and "GIL" in GIL_LEGEND
    assert not figs._gil_item.visible
    assert figs.stream_gil([GilStall(1.0, 1.2, 0.2, 4, "MainThread")]) and figs._gil_item.visible
    assert "colour" in figs.queue_fig.title.text
    figs.reset()  # another pool: its stalls are not the new one's
    assert not figs._gil_item.visible and figs.gil.data["left"] == []

    controls = Controls({"mode": "pipelined", "lookahead": 1, "lr": 3e-3, "batch_size": 8, "runs": 3,
                         "log": False}, lambda *_: None)
    controls.enable("idle")
    b = controls.buttons
    assert not b["Start"].disabled and not b["Start"].tooltip.startswith("disabled")
    assert b["Pause"].disabled and b["Pause"].tooltip == "disabled: no Start run is running"
    assert controls.why.value == ""
    controls.enable("running")
    assert b["Start"].tooltip == "disabled: the runs of the last Start are running: Stop them first"
    for state in ("watching", "closed", "no pool"):
        controls.enable(state)
        assert all(w.disabled and w.tooltip == f"disabled: {WHY_ALL[state]}" for w in b.values())
        assert WHY_ALL[state] in controls.why.value
    for w in controls.widgets:
        w.close()


def test_notices_go_with_the_pool_they_are_about():
    """An interrupted wait is said about its pool's client; when the pool is replaced under the
    live dashboard (a newer pool), that line and the old pool's GIL shading go; the line saying
    which pool is shown stays, and a line about no pool (a setting) stays too."""
    import os
    import signal

    from trio_widgets.futures import WaitInterrupted
    from trio_widgets.telemetry import GilStall

    dash = trio.Dashboard(learning_rate=0.5)  # far outside the usual range: a line about the dashboard
    a = trio.LocalPool(min_cycle_s=0.02, name="scoped-a")
    b = None
    try:
        deadline = time.monotonic() + 30
        while dash.pool is not a and time.monotonic() < deadline:
            time.sleep(0.02)
        tc = trio.ServiceClient(a).create_lora_training_client(trio.DEFAULT_MODEL, rank=4,
                                                               user_metadata={"name": "mine"})
        batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})]
        with a.hold():
            future = tc.forward_backward(batch)
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(WaitInterrupted):
                future.result(timeout=60)
            timer.join()
        future.result(timeout=60)
        a.telemetry.add_gil_stall(GilStall(time.perf_counter() - 0.2, time.perf_counter(), 0.2, 4, "MainThread"))
        asyncio.run(until(lambda: any("mine: the wait" in n for n in dash.notices), "the interrupt said", 30))
        asyncio.run(until(lambda: bool(dash.figures.gil.data["left"]), "the stall drawn", 30))
        b = trio.LocalPool(min_cycle_s=0.02, name="scoped-b")  # replaces a under the dashboard
        asyncio.run(until(lambda: dash.pool is b, "the new pool", 30))
        asyncio.run(until(lambda: any("'scoped-b'" in n for n in dash.notices), "the switch said", 30))
        notices = dash.notices
        assert not any("mine: the wait" in n for n in notices), notices
        assert any("far outside" in n for n in notices), notices
        assert dash.figures.gil.data["left"] == []
        assert "mine: the wait" not in dash.status_text
    finally:
        dash.close()
        a.close()
        if b is not None:
            b.close()


def test_the_page_holds_the_bars_of_the_cycles_it_shows():
    """One client, two ops a cycle, far more cycles than the window: the bars held are those of
    the window's cycles (and a few more), not three times as many left of the time axis."""
    from trio_widgets.telemetry import ClientInfo, CycleRecord, RequestRecord
    from trio_widgets.widgets.figures import DashboardFigures

    figs = DashboardFigures(0.0, window=24)
    figs.add_client(ClientInfo("c0", "training", "m", "alone"))
    rid = 0
    for i in range(120):
        t = 0.1 * i
        done = []
        for op, (a, b) in (("forward_backward", (0.0, 0.06)), ("optim_step", (0.06, 0.08))):
            rid += 1
            done.append(RequestRecord(rid, "c0", op, queued_at=t, cycle=i, started_at=t + a, finished_at=t + b,
                                      status="ok"))
        figs.update([CycleRecord(i, t, t + 0.1, 0.08, 2, 10)], [], done)
    lefts = figs.bars.data["left"]
    inside = sum(1 for x in lefts if figs.x_range.start <= x <= figs.x_range.end)
    assert len(lefts) <= 2 * 24 + 2 * 4 and inside >= 0.8 * len(lefts), (len(lefts), inside, figs.x_range.start)


def test_a_room_names_each_participant_sorts_and_keeps_a_finished_ones_verdict():
    """Issue 34 point 3, without a browser: eight named participants, one row each (name, cycles
    per update, verdict, loss, status); the status and advisor lines sum the room up; sorting by
    loss orders the rows; one participant finishes and keeps its last verdict, marked finished;
    picking one shows its lane on the timeline."""
    with trio.LocalPool(min_cycle_s=0.02, name="room") as pool:
        dash = trio.Dashboard(pool, room=True, lanes=3)
        try:
            service = trio.ServiceClient(pool)
            names = [f"participant {i:02d}" for i in range(8)]
            tcs = [service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i, user_metadata={"name": n})
                   for i, n in enumerate(names)]
            batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]
            adam = trio.AdamParams(learning_rate=1e-2)
            for _ in range(6):
                futures = [(tc.forward_backward(batch), tc.optim_step(adam)) for tc in tcs]
                for fb, opt in futures:
                    fb.result(timeout=60)
                    opt.result(timeout=60)
            room = dash._room
            assert room is not None
            asyncio.run(until(lambda: len(room.people) == 8 and all(p.cause and p.cycles is not None and p.loss > 0
                                                                    for p in room.people.values()),
                              "every participant judged", 60))
            assert sorted(p.name for p in room.people.values()) == names
            assert "8 clients: one row each in the room table" in dash.status_text
            assert "participant 00" not in dash.status_text  # summed up, not listed
            first = tcs[0].client_id
            kept = room.people[first].cause
            tcs[0].close()
            asyncio.run(until(lambda: room.people[first].finished, "the finished participant", 30))
            dash._request("room", ("sort", "loss"))
            asyncio.run(until(lambda: room.sort_key == "loss", "the sort", 10))
            losses = [p.loss for p in room.rows(time.perf_counter())]
            assert losses == sorted(losses)
            asyncio.run(until(lambda: "(last, finished)" in room.table.value, "the finished row drawn", 10))
            assert room.people[first].cause == kept and room.people[first].status(time.perf_counter()) == "finished"
            last = tcs[-1].client_id
            dash._request("room", ("pick", last))
            lane = dash.figures.clients[last].lane
            assert lane is not None and lane >= 3
            asyncio.run(until(lambda: dash.figures.first_lane <= lane < dash.figures.first_lane + 3,
                              "the picked lane shown", 10))
            assert room.picked == last and "picked" in room.table.value
        finally:
            dash.close()
