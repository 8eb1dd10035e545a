"""A room of 40, by name, in a real JupyterLab + Chromium (issue 34, point 3).

A served pool in its own process and 40 participants training on it from another (room.py),
each named by its client ("participant NN"); the notebook's only cell is `trio.Dashboard(url)`.
In the page: the room table has a row per participant, each with cycles per update, a verdict,
a loss and a status; every name is readable in a screenshot (drawn inside the window at a legible
size, not clipped, dark on light); the table sorts by loss from its selector; picking a
participant shows their lane on the timeline. The page's main-thread cost with this room is
measured by `benchmarks/browser_cost.py --room 40` (timings are not asserted here).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import rendered
from lab import BOKEH_ERRORS, LabServer, open_notebook, write_notebook
from room import room

N = 40
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
        with open_notebook(browser, lab, "room.ipynb", viewport=(1480, 1040)) as nb:
            page = nb.page
            nb.app_eval("app.commands.execute('application:toggle-left-area')")
            nb.run_all_cells()
            nb.wait_cells_done(timeout=120)
            page.locator(".trio-dashboard .trio-room").wait_for(state="visible", timeout=180_000)
            # every participant has a row, a verdict (or "measuring") and numbers
            page.wait_for_function(
                f"() => {{ const rows = ({ROWS_JS})(); return rows.length >= {N} && "
                f"rows.every((r) => r.cells[1] !== '–' && r.cells[3] !== '–'); }}", timeout=400_000)
            rows = page.evaluate(ROWS_JS)
            names = sorted(r["cells"][0] for r in rows)
            assert names == [f"participant {i:02d}" for i in range(N)], names
            assert all(r["cells"][4] in ("training", "idle") for r in rows), [r["cells"] for r in rows]

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
