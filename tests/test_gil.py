"""GIL starvation, measured while a pool runs: the clock's wait per cycle, the watchdog's
stalls (who held the interpreter, where), and what starts and stops the watchdog.

Real pools, real threads, real Python holding the GIL; assertions are about who is
blamed and where, never about how long anything took.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import socket
import sys
import threading
import time
import weakref

import pytest
from conftest import random_batch

import trio_widgets as trio
from trio_widgets.advisor import gil_held, gil_where
from trio_widgets.gil import GilWatchdog, RunMeter, is_user_file, user_frames
from trio_widgets.telemetry import GC_FILE, GilStall, Telemetry, UserFrame
from trio_widgets.trace import chrome_trace, metrics_rows

# `make test` runs it alone, with no test beside it: it measures how long threads wait for the GIL
pytestmark = pytest.mark.alone


def hog(cpu_s: float) -> int:
    """Pure Python for `cpu_s` seconds of this thread's CPU time: it holds the GIL throughout."""
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < cpu_s:
        for i in range(1000):
            x += i * i
    return x


_source, _first = inspect.getsourcelines(hog)
HOG_LINES = range(_first, _first + len(_source))


def settle(watchdog: GilWatchdog) -> None:
    """Let a stretch in progress end: it closes after two on-time heartbeats. Bounded: a
    watchdog thread that died fails the test here instead of hanging it."""
    beats, deadline = watchdog.heartbeats, time.monotonic() + 30
    while watchdog.heartbeats < beats + 4:
        assert watchdog.thread is not None and watchdog.thread.is_alive(), "the GIL watchdog's thread is gone"
        assert time.monotonic() < deadline, f"the GIL watchdog beat {watchdog.heartbeats - beats} times in 30 s"
        time.sleep(watchdog.interval_s)


def blamed(pool, thread: str) -> list[GilStall]:
    return [s for s in pool.telemetry.gil if s.thread == thread]


def test_python_holding_the_gil_is_named_by_thread_function_and_line():
    with trio.LocalPool(min_cycle_s=0.02, name="gil-hog") as pool:
        watchdog = pool.gil_watchdog
        assert watchdog is not None and watchdog.thread is not None and watchdog.thread.name == "trio-gil-gil-hog"
        settle(watchdog)
        before = len(pool.telemetry.gil)
        hog(0.5)  # on this (the main) thread
        settle(watchdog)
        loader = threading.Thread(target=hog, args=(0.5,), name="data-loader")
        loader.start()
        loader.join()
        settle(watchdog)
        stalls = list(pool.telemetry.gil)[before:]
        cycles = list(pool.telemetry.cycles)
    mine = [s for s in stalls if s.thread == threading.current_thread().name]
    assert mine, stalls
    top, caller = mine[0].frames[0], mine[0].frames[1]
    assert (top.function, top.file, top.cell) == ("hog", __file__, None) and top.line in HOG_LINES, top
    assert caller.function == "test_python_holding_the_gil_is_named_by_thread_function_and_line"
    assert top.where == f"test_gil.py line {top.line}" and top.label == f"hog ({top.where})"
    theirs = [s for s in stalls if s.thread == "data-loader"]
    # (threading's own frames under it are not user code)
    assert theirs and theirs[0].frames[0].function == "hog" and len(theirs[0].frames) == 1
    assert all(s.heartbeats >= 2 and s.ended_at > s.started_at for s in stalls)
    # the clock, sleeping between its idle cycles, woke late while the GIL was held
    assert any(c.gil_wait_s > 0 for c in cycles if c.started_at >= mine[0].started_at)


def test_a_garbage_collection_is_not_blamed_on_the_function_that_runs_after_it():
    """A collection holds the GIL from start to end, so the watchdog can only look after it, at
    whatever the collecting thread runs next: the stall is the collector's, and only the hog's
    own Python is the hog's."""
    gc.freeze()  # what this process holds already is out of the passes: they visit `graph` alone
    graph = [{"i": [i]} for i in range(150_000)]  # a pass over these: tens of ms

    def collecting():
        for _ in range(20):
            gc.collect()  # a full pass, then a moment off the GIL: the watchdog looks in between
            time.sleep(0.001)

    try:
        with trio.LocalPool(min_cycle_s=0.02, name="gil-gc") as pool:
            settle(pool.gil_watchdog)
            worker = threading.Thread(target=collecting, name="collector")
            worker.start()
            worker.join()
            settle(pool.gil_watchdog)
            loader = threading.Thread(target=hog, args=(0.5,), name="loader")
            loader.start()
            loader.join()
            settle(pool.gil_watchdog)
            stalls = list(pool.telemetry.gil)
    finally:
        graph.clear()
        gc.unfreeze()
    theirs = blamed(pool, "collector")
    assert theirs and all(s.frames[0].file == GC_FILE and not s.frames[0].user for s in theirs), theirs
    assert gil_where(theirs[0]).startswith("in Python's garbage collector")
    # a hog's stalls are its own, the collector's are not user code: the culprit is the hog
    held = gil_held([s for s in stalls if s.thread in ("collector", "loader")], 0.0, time.perf_counter())
    assert held is not None and held[1].frames[0].function == "hog", held


def test_sampling_frames_keeps_no_dropped_pool_alive():
    """The watchdog reads every thread's frames, locals and all: it must let go of them, or a
    pool the user dropped (a local of a sampled frame) would run on until a garbage collection."""

    def work():
        victim = trio.LocalPool(min_cycle_s=0.02, name="victim", gil_watchdog=False)
        hog(0.4)  # sampled while `victim` is a local of this frame
        return weakref.ref(victim)

    gc.disable()  # nothing may depend on the cycle collector
    try:
        with trio.LocalPool(min_cycle_s=0.02, name="gil-watcher") as pool:
            settle(pool.gil_watchdog)
            ref = work()
            settle(pool.gil_watchdog)
            sampled = [s for s in pool.telemetry.gil if s.frames and s.frames[0].function == "hog"]
            deadline = time.monotonic() + 30
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.01)  # (its clock thread may hold it for the rest of a cycle)
            gone = ref() is None
    finally:
        gc.enable()
    assert sampled and sampled[0].frames[1].function == "work"
    assert gone


def test_sleeping_and_waiting_on_io_hold_no_gil():
    with trio.LocalPool(min_cycle_s=0.02, name="gil-sleep") as pool:
        settle(pool.gil_watchdog)
        before = len(pool.telemetry.gil)
        time.sleep(0.3)
        a, b = socket.socketpair()
        with a, b:
            a.settimeout(0.3)
            try:
                a.recv(1)  # blocks, GIL released, until the timeout
            except TimeoutError:
                pass
        event = threading.Event()
        event.wait(0.3)
        settle(pool.gil_watchdog)
        stalls = list(pool.telemetry.gil)[before:]
    assert not [s for s in stalls if s.thread == threading.current_thread().name], stalls


def test_the_watchdog_starts_and_stops_with_its_pool():
    def threads(name):
        return [t.name for t in threading.enumerate() if t.is_alive() and t.name.endswith(name)
                and t.name.startswith(("trio-clock-", "trio-gil-"))]

    pool = trio.LocalPool(min_cycle_s=0.01, name="wd-close")
    assert sorted(threads("wd-close")) == ["trio-clock-wd-close", "trio-gil-wd-close"]
    pool.close()
    assert threads("wd-close") == [] and not pool.gil_watchdog.thread.is_alive()

    with trio.LocalPool(min_cycle_s=0.01, name="wd-off", gil_watchdog=False) as pool:
        assert pool.gil_watchdog is None and threads("wd-off") == ["trio-clock-wd-off"]

    pool = trio.LocalPool(min_cycle_s=0.01, name="wd-dropped")
    watchdog = pool.gil_watchdog
    del pool  # garbage-collected: its finalizer stops both threads
    deadline = time.monotonic() + 30
    while threads("wd-dropped") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads("wd-dropped") == [] and not watchdog.thread.is_alive()


def test_the_clock_meter_counts_time_off_the_cpu_and_out_of_the_run_queue():
    meter = RunMeter()
    mark = meter.mark()
    hog(0.05)
    _, cpu = meter.waited(mark)
    assert cpu >= 0.05
    mark = meter.mark()
    time.sleep(0.05)  # off the CPU for at least 50 ms: all of it counts, less any run-queue wait after
    waited, _ = meter.waited(mark)
    assert waited >= 0.04
    asleep = meter.mark()
    deadline = time.perf_counter() + 0.01
    time.sleep(0.02)
    assert meter.overslept(asleep, deadline) > 0  # woke after the deadline it was asked to keep
    meter.close()


def test_user_code_is_told_from_libraries():
    assert is_user_file(__file__)
    assert not is_user_file(json.__file__) and not is_user_file(trio.__file__) and not is_user_file("<string>")

    def inner():
        return user_frames(inspect.currentframe())

    frames = inner()
    assert [f.function for f in frames[:2]] == ["inner", "test_user_code_is_told_from_libraries"]
    # a thread with no user code on its stack: its innermost frame stands in
    event = threading.Event()
    waiter = threading.Thread(target=event.wait, args=(30,), name="waiter")
    waiter.start()
    try:
        while True:
            frame = sys._current_frames().get(waiter.ident)
            if frame is not None and frame.f_code.co_name == "wait" and frame.f_back.f_code.co_name == "wait":
                break
            time.sleep(0.001)
        (only,) = user_frames(frame)
    finally:
        event.set()
        waiter.join()
    assert only.file == threading.__file__ and only.function == "Condition.wait" and only.cell is None
    assert not only.user and all(f.user for f in frames)


def test_a_stretch_is_blamed_on_user_code_over_the_library_it_calls():
    """Notebook 06's case: the loop's thread spent more samples in trio's validation (its batch being
    checked, no user frame on the stack) than in the user's loader; the loader is named."""
    from trio_widgets.gil import _as_stall, _Stretch
    from trio_widgets.telemetry import UserFrame

    stretch = _Stretch(0.0)
    loader = (UserFrame("/home/me/loop.py", "heavy_batches", 7),)
    validation = (UserFrame(trio.validation.__file__, "check_batch", 182, user=False),)
    for key, frames, n in [(("MainThread", loader[0].file, "heavy_batches"), loader, 2),
                           (("MainThread", validation[0].file, "check_batch"), validation, 5),
                           (("other", "/home/me/x.py", "f"), (UserFrame("/home/me/x.py", "f", 1),), 1)]:
        stretch.samples[key] += n
        stretch.frames[key] = frames
    stall = _as_stall(stretch)
    assert stall.thread == "MainThread" and stall.frames == loader
    # with no user code sampled at all, the library frame stands in
    del stretch.samples[("MainThread", loader[0].file, "heavy_batches")]
    assert _as_stall(stretch).frames == validation


def test_a_thread_that_blocks_after_running_is_blamed_for_what_ran_not_where_it_waits():
    """A loop runs its loader's Python, then blocks on a result (the GIL released, nothing runs): the
    look that follows finds it waiting in the loop, yet the window's CPU was the loader's. (CI: a
    pipelined loop blocked in `.result()` after each batch was named instead of its loader.)"""
    telemetry = Telemetry()
    watchdog = GilWatchdog(telemetry, "blocks").start()
    result = threading.Event()  # never set: each wait is a blocked `.result()` that times out

    def training_loop():
        for _ in range(8):
            hog(0.15)  # a few looks each: a look costs the watchdog a switch interval per system call
            result.wait(0.05)

    thread = threading.Thread(target=training_loop, name="training-loop")
    try:
        settle(watchdog)
        thread.start()
        thread.join()
        settle(watchdog)
    finally:
        watchdog.stop()
    names = [s.frames[0].function for s in telemetry.gil if s.thread == "training-loop" and s.frames]
    assert "hog" in names and "training_loop" not in names, f"{names}"


def test_a_stretch_begun_by_one_late_heartbeat_goes_on_while_its_holder_runs():
    """A loader that hands the GIL to the clock's torch calls lets most heartbeats through on time:
    a stretch begun by one late heartbeat (which only takes the threads' CPU baseline) goes on
    while the holder keeps running, and is recorded. (CI caught a loop whose stretches were all
    one late heartbeat then on-time ones: none was recorded, and the advisor missed `gil`.)"""
    telemetry = Telemetry()
    watchdog = GilWatchdog(telemetry, "convoy", max_stretch_s=60.0)  # (one stretch, however many looks it takes)
    stop = threading.Event()

    def loader():
        while not stop.is_set():
            hog(0.005)

    thread = threading.Thread(target=loader, name="data-loader")
    thread.start()
    try:
        time.sleep(0.05)
        now = time.perf_counter()
        watchdog._late(now - 0.005, now, 0.005)
        assert watchdog._stretch is not None and not watchdog._stretch.samples
        # the loader runs meanwhile, as it does between the clock's torch calls; a look whose window a
        # busy machine's other threads took from it (the whole suite runs beside) says so, and the next goes on
        hits = 0
        for _ in range(40):
            time.sleep(0.05)
            hits += watchdog._convoy(watchdog._stretch, time.perf_counter())
            if hits == 3:
                break
        assert hits == 3
    finally:
        stop.set()
        thread.join()
    time.sleep(0.05)  # now the loader has ended: an on-time heartbeat is no convoy
    assert not watchdog._convoy(watchdog._stretch, time.perf_counter())
    watchdog._close_stretch()
    (stall,) = telemetry.gil
    assert stall.thread == "data-loader" and stall.frames[0].function == "hog", stall


def test_the_watchdog_feeds_the_trace_metrics_and_dashboard():
    telemetry = Telemetry()
    frames = (UserFrame("/tmp/ipykernel_1/abc.py", "heavy_batches", 7, 3), UserFrame("/x/main.py", "main", 2))
    stall = GilStall(1.0, 1.2, 0.05, 9, "MainThread", frames)
    telemetry.add_gil_stall(stall)
    trace = chrome_trace(telemetry)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "GIL (other Python held the interpreter)" in names
    (span,) = [e for e in trace["traceEvents"] if e.get("cat") == "gil"]
    assert span["name"] == "GIL held: heavy_batches (cell In[3] line 7)"
    assert span["args"]["where"] == "cell In[3] line 7"
    assert span["dur"] == 200_000.0 and span["args"]["thread"] == "MainThread"

    async def main():
        # (no watchdog: building the dashboard holds the GIL for a while, which it would record)
        with trio.LocalPool(min_cycle_s=0.02, name="gil-dash", gil_watchdog=False) as pool:
            pool.telemetry.add_gil_stall(stall)  # before the dashboard: its backfill
            dash = trio.Dashboard(pool)
            later = GilStall(2.0, 2.1, 0.02, 4, "MainThread", frames)
            pool.telemetry.add_gil_stall(later)  # live
            dash.tick()
            dash.tick()
            shade = dict(dash.figures.gil.data)
            dash.close()
            return shade, dash.figures.t0

    shade, t0 = asyncio.run(main())
    assert shade["what"] == ["heavy_batches (cell In[3] line 7)"] * 2
    assert shade["left"] == [round(1.0 - t0, 6), round(2.0 - t0, 6)]


def test_a_clock_waiting_for_the_gil_is_in_metrics_rows():
    async def main(tc):
        return await trio.train(tc, [random_batch(0, n=1, length=8)] * 3, learning_rate=1e-3)

    with trio.LocalPool(min_cycle_s=0.02, name="gil-rows") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        run = asyncio.run(main(tc))
        rows = metrics_rows(pool.telemetry)
    assert len(run.metrics) == 3 and all(isinstance(r["time/gil_wait"], float) for r in run.metrics)
    assert len(rows) == 3 and all(isinstance(r["time/gil_wait"], float) for r in rows)


KERNEL_DEFINE = """\
import json, time
import trio_widgets as trio

def hog(cpu_s):
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < cpu_s:
        x += 1
pool = trio.LocalPool(min_cycle_s=0.02, name="kernel-gil")
"""

KERNEL_HOG = """\
hog(0.5)
time.sleep(0.2)
print("STALLS " + json.dumps([[s.thread, [[f.function, f.cell, f.line, f.where] for f in s.frames]]
                              for s in pool.telemetry.gil]))
pool.close()
"""


def test_in_a_kernel_a_cell_is_named_by_its_number_and_line():
    """ipykernel compiles each cell to /tmp/ipykernel_<pid>/<hash>.py: the stall names In[n]."""
    from jupyter_client.manager import start_new_kernel

    def execute(kc, code):
        """(the cell's execution count, what it printed)"""
        msg_id = kc.execute(code, store_history=True)
        out = []
        while True:
            m = kc.get_iopub_msg(timeout=120)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "stream":
                out.append(m["content"]["text"])
            elif m["msg_type"] == "error":
                raise AssertionError("\n".join(m["content"]["traceback"]))
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                break
        while True:  # (a kernel_info reply from the start may come first)
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["execution_count"], "".join(out)

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        count, _ = execute(kc, KERNEL_DEFINE)
        _, text = execute(kc, KERNEL_HOG)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    stalls = json.loads(text.split("STALLS ", 1)[1])
    mine = [frames for thread, frames in stalls if thread == "MainThread" and frames[0][0] == "hog"]
    assert mine, stalls
    (function, cell, line, where), (caller, caller_cell, caller_line, _) = mine[0][:2]
    assert cell == count and line in (7, 8) and where == f"cell In[{count}] line {line}", mine[0]  # its loop
    assert (caller, caller_cell, caller_line) == ("<module>", count + 1, 1), mine[0]
