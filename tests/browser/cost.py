"""What a page costs its browser: Chromium's own counters (CDP `Performance.getMetrics`) read over a
window. One method for benchmarks/browser_cost.py and the browser tests that hold a page to its
bounds (test_room_page: a room of 40 at <= 0.15 s/s). Not a test module.

`measure` gives, per second of the window: the page's main-thread busy time (TaskDuration: every
task it ran, JavaScript and layout and paint; on a shared machine a task's wall time also counts
its waits for a core), the JavaScript part (ScriptDuration), the main thread's CPU time
(ThreadTime), style recalculations, layouts, and the kernel's comm messages the page received.
"""

from __future__ import annotations

import re
import time
from typing import Any

__all__ = ["ROOM_ROWS_JS", "ROOM_VIEWPORT", "metrics", "measure", "show_room", "what"]

#: the room page as the test and the benchmark show it: a window this size, JupyterLab's left area
#: closed, the room table filled
ROOM_VIEWPORT = (1480, 1040)
ROOM_ROWS_JS = "() => document.querySelectorAll('.trio-dashboard .trio-room tbody tr').length"


def metrics(cdp: Any) -> dict[str, float]:
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}


def what(text: str) -> str:
    """A comm message in a few words: the widget method and the start of what it carries."""
    m = re.search(r'"data":\s*\{', text)
    return re.sub(r"\s+", " ", text[m.start():m.start() + 110]) if m else text[-110:]


def measure(label: str, cdp: Any, nb: Any, window: float, *, verbose: bool = False) -> dict[str, float]:
    """Main-thread time per second (TaskDuration: wall time of its tasks, which on a shared
    machine also counts waits for a core; ThreadTime: its CPU time) and comm messages per second
    over `window` seconds; printed on one line under `label`. `cdp`: a CDP session of `nb.page`
    with `Performance.enable` sent."""
    nb.page.wait_for_timeout(100)  # Playwright hands over websocket frames only while it is called
    nb.comm_log = []
    kinds = dict(nb.received)
    m0, c0, t0 = metrics(cdp), nb.comm_received, time.monotonic()
    nb.page.wait_for_timeout(window * 1000)
    m1, c1, t1 = metrics(cdp), nb.comm_received, time.monotonic()
    if verbose:
        print("    kernel messages:", {k: n - kinds.get(k, 0) for k, n in nb.received.items() if n > kinds.get(k, 0)})
        print("\n".join(f"    {what(text)}" for text in nb.comm_log[:12]))
    dt = t1 - t0
    out = {"busy_s_per_s": (m1["TaskDuration"] - m0["TaskDuration"]) / dt,
           "script_s_per_s": (m1["ScriptDuration"] - m0["ScriptDuration"]) / dt,
           "cpu_s_per_s": (m1["ThreadTime"] - m0["ThreadTime"]) / dt,
           "style_recalcs_per_s": (m1["RecalcStyleCount"] - m0["RecalcStyleCount"]) / dt,
           "layouts_per_s": (m1["LayoutCount"] - m0["LayoutCount"]) / dt,
           "comm_msgs_per_s": (c1 - c0) / dt}
    print(f"{label:<22} busy {out['busy_s_per_s']:.3f} s/s (script {out['script_s_per_s']:.3f}, "
          f"CPU {out['cpu_s_per_s']:.3f}), {out['style_recalcs_per_s']:.0f} style recalcs/s, "
          f"{out['layouts_per_s']:.1f} layouts/s, {out['comm_msgs_per_s']:.1f} comm messages/s", flush=True)
    return out


def show_room(nb: Any, n: int, timeout_s: float = 600) -> None:
    """Run the notebook's `trio.Dashboard(url)` cell and wait until the room table has `n` rows
    (JupyterLab's left area closed first, as the test and the benchmark both show it)."""
    nb.app_eval("app.commands.execute('application:toggle-left-area')")
    nb.run_all_cells()
    nb.wait_cells_done(timeout=120)
    nb.page.wait_for_function(f"() => ({ROOM_ROWS_JS})() >= {n}", timeout=timeout_s * 1000)
