"""A room of 40, by name, in a real JupyterLab + Chromium (issue 34, point 3).

A served pool in its own process and 40 participants training on it from another (room.py),
each named by its client ("participant NN"); the notebook's only cell is `trio.Dashboard(url)`.
In the page: the room table has a row per participant, each with cycles per update, a verdict,
a loss and a status; no verdict is `gil` (the participants' Python runs in another process than
the pool's: what holds the server's interpreter is the server's own); every name is readable in
a screenshot (drawn inside the window at a legible size, not clipped, dark on light); the table
sorts by loss from its selector; picking a participant shows their lane on the timeline. The
page's main-thread cost with this room, the room table filled and the room training, is at most
0.15 s/s (issue 34's bound): the median of 5 windows of 4 s, measured as
`benchmarks/browser_cost.py --room 40` does (cost.py's `measure`: Chromium's TaskDuration per
second; a task's wall time, so a loaded machine can only raise it).
"""

from __future__ import annotations

import os
import re
import statistics
from typing import Any

import pytest
import rendered
from cost import ROOM_VIEWPORT, measure, show_room
from lab import BOKEH_ERRORS, LabServer, open_notebook, write_notebook
from room import room

N = 40
#: issue 34: the page's main-thread time per second with a room of 40, at most
ROOM_BUSY_S_PER_S = 0.15
ROWS_JS = """() => [...document.querySelectorAll('.trio-dashboard .trio-room tbody tr')].map((tr) => {
    const cells = [...tr.querySelectorAll('td')];
    const name = cells[0], r = name.getBoundingClientRect(), style = getComputedStyle(name);
    return {cells: cells.map((c) => c.innerText.trim()), cls: tr.className,
            box: {top: r.top, bottom: r.bottom, left: r.left, right: r.right},
            clipped: name.scrollWidth > name.clientWidth + 1, size: parseFloat(style.fontSize),
            color: style.color, window: [innerWidth, innerHeight]};
})"""


def _dark(color: str) -> bool:
    rgb = [int(v) for v in re.findall(r"\d+", color)[:3]]
    return sum(rgb) / 3 < 140  # on the table's white


@pytest.mark.browser
def test_a_room_of_40_by_name(lab: LabServer, browser: Any) -> None:
    with room(N) as url:
        cell = f"import trio_widgets as trio\ndash = trio.Dashboard({url!r})\ndash"
        write_notebook(lab.root_dir / "room.ipynb", [cell])
        with open_notebook(browser, lab, "room.ipynb", viewport=ROOM_VIEWPORT) as nb:
            page = nb.page
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            show_room(nb, N, timeout_s=400)
            # every participant has a row, a verdict (or "measuring") and numbers
            page.wait_for_function(
                f"() => {{ const rows = ({ROWS_JS})(); return rows.length >= {N} && "
                f"rows.every((r) => r.cells[1] !== '–' && r.cells[3] !== '–'); }}", timeout=400_000)
            rows = page.evaluate(ROWS_JS)
            names = sorted(r["cells"][0] for r in rows)
            assert names == [f"participant {i:02d}" for i in range(N)], names
            assert all(r["cells"][4] in ("training", "idle") for r in rows), [r["cells"] for r in rows]
            # their loops run in another process: the server's own Python holding its interpreter is no
            # participant's GIL (the advisor's evidence says it on hover), whatever the load here
            assert not [r["cells"] for r in rows if r["cells"][2].lower().startswith("gil")], rows

            # what the page costs with the room training (before anything else is done to it)
            page.wait_for_timeout(3000)
            before = {r["cells"][0]: int(r["cells"][5]) for r in page.evaluate(ROWS_JS)}
            costs = [measure(f"room of {N} ({i + 1})", cdp, nb, 4.0) for i in range(5)]
            busy = statistics.median(c["busy_s_per_s"] for c in costs)
            # (a task's wall time: on a loaded machine its waits for a core too; the load is said)
            assert busy <= ROOM_BUSY_S_PER_S, (busy, costs, f"load average {os.getloadavg()}")
            after = {r["cells"][0]: int(r["cells"][5]) for r in page.evaluate(ROWS_JS)}
            moved = [name for name, n in after.items() if n > before[name]]
            assert len(moved) == N, (before, after)  # measured while every participant trained and was shown

            # every name readable in a screenshot: inside the window, legible, not clipped, dark on white
            rendered.show_whole(page, ".trio-dashboard .trio-room")
            rows = page.evaluate(ROWS_JS)
            shot = nb.screenshot("room-40", selector=".trio-dashboard")
            for r in rows:
                box, (width, height) = r["box"], r["window"]
                assert 0 <= box["top"] and box["bottom"] <= height and 0 <= box["left"] and box["right"] <= width, r
                assert r["size"] >= 11 and not r["clipped"] and _dark(r["color"]), r
            print(f"screenshot: {shot}")

            # sortable: by loss, from the page's selector
            page.locator(".trio-dashboard .trio-room select").first.select_option("loss")
            page.wait_for_function("() => /loss ▲/.test(document.querySelector('.trio-dashboard .trio-room thead')"
                                   ".innerText)", timeout=30_000)
            losses = [float(r["cells"][3]) for r in page.evaluate(ROWS_JS)]
            assert losses == sorted(losses), losses

            # the instructor picks one: their lane on the timeline
            page.locator(".trio-dashboard .trio-room select").nth(1).select_option(label="participant 37")
            page.wait_for_function("() => [...document.querySelectorAll('.trio-dashboard .trio-room tr.picked')]"
                                   ".some((tr) => tr.innerText.includes('participant 37'))", timeout=30_000)
            out, _ = nb.run_cell("v = [v for v in dash.figures.clients.values() if v.label == 'participant 37'][0]\n"
                                 "f = dash.figures\n"
                                 "print('SHOWN', f.first_lane <= v.lane < f.first_lane + f.lanes_visible)",
                                 until="SHOWN", timeout=60)
            assert "SHOWN True" in out, out
            nb.run_cell("dash.close()\nprint('closed')", until="closed", timeout=60)
            bad = nb.find_messages(*BOKEH_ERRORS)
            assert not bad, "\n".join(bad)
            assert not nb.page_errors, nb.page_errors


def test_a_rooms_timeline_holds_each_shown_lanes_whole_window() -> None:
    """Without a browser: 40 clients, 10 lanes shown, two ops a cycle each for far more cycles than
    the window. The page holds the shown lanes' bars only, each lane's back to the window's start (the
    other 30 lanes' bars filled the rollover: a room's lanes were empty over most of the window), and a
    scroll to lanes 30-39 sends theirs, whole."""
    from trio_widgets.telemetry import ClientInfo, CycleRecord, RequestRecord
    from trio_widgets.widgets.figures import DashboardFigures

    figs = DashboardFigures(0.0, window=24, lanes_visible=10)
    for k in range(N):
        figs.add_client(ClientInfo(f"c{k}", "training", "m", f"participant {k:02d}"))
    rid = 0
    for i in range(60):
        t, done = 0.1 * i, []
        for k in range(N):
            for op, (a, b) in (("forward_backward", (0.0, 0.06)), ("optim_step", (0.06, 0.08))):
                rid += 1
                done.append(RequestRecord(rid, f"c{k}", op, queued_at=t, cycle=i, started_at=t + a,
                                          finished_at=t + b, status="ok"))
        figs.update([CycleRecord(i, t, t + 0.1, 0.08, 2 * N, 10)], [], done)

    def held() -> dict[str, list[float]]:
        lefts: dict[str, list[float]] = {}
        for client, left in zip(figs.bars.data["client"], figs.bars.data["left"]):
            lefts.setdefault(client, []).append(left)
        return lefts

    for first in (0, 30):
        if first:
            figs.scroll_lanes(first)
        lefts = held()
        assert sorted(lefts) == [f"participant {k:02d}" for k in range(first, first + 10)], sorted(lefts)
        start = figs.x_range.start
        for client, xs in lefts.items():  # every cycle the window shows, in every shown lane
            assert min(xs) <= start + 0.1 and len([x for x in xs if x >= start]) >= 2 * 23, (client, min(xs), start)
