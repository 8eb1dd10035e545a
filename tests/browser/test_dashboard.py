"""The live dashboard in a real JupyterLab + Chromium: Start, watch, Pause, Resume, Stop.

One notebook shows `trio.Dashboard(pool)`; the test presses its buttons like a user,
reads the `trio-status` line, checks that bokeh drew the figures (pixels of the loss
curves on the canvas) and that the console has no BokehJS / widget-view errors, and
saves a screenshot (tests/browser/artifacts/dashboard.png; docs/dashboard.png is a copy).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from lab import ARTIFACTS, BOKEH_ERRORS, SUBSHELLS_OFF, SUBSHELLS_ON, LabServer, open_notebook
from lab import write_notebook as lab_write_notebook

BAD_CONSOLE = (
    *BOKEH_ERRORS,
    r"Error: .*(bokeh|patch)",
)

SETUP = """\
import trio_widgets as trio
pool = trio.LocalPool(min_cycle_s=0.05, name="demo")
dash = trio.Dashboard(pool, learning_rate=3e-3, batch_size=8, runs=3)
dash
"""

STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"


def write_notebook(path: Path) -> None:
    lab_write_notebook(path, [SETUP])


def _number(text: str, word: str) -> int:
    m = re.search(rf"{word} (\d+)", text)
    assert m, f"no '{word} <N>' in status: {text!r}"
    return int(m.group(1))


def _wait_status(page: Any, predicate_js: str, timeout_s: float) -> str:
    """Wait until `predicate_js(text)` holds for the status text; returns the text."""
    page.wait_for_function(f"() => {{ const t = ({STATUS_JS})(); return ({predicate_js})(t); }}",
                           timeout=timeout_s * 1000)
    return page.evaluate(STATUS_JS)


def _canvas_pixels(out: Any, rgb: tuple[int, int, int], tol: int = 40) -> int:
    """Pixels close to `rgb` over all the bokeh canvases (Playwright pierces the shadow DOM)."""
    return out.locator("canvas").evaluate_all(
        """(cs, [r, g, b, tol]) => cs.reduce((acc, c) => {
            if (!c.width || !c.height) return acc;
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4)
                if (Math.abs(d[i] - r) < tol && Math.abs(d[i + 1] - g) < tol && Math.abs(d[i + 2] - b) < tol
                    && d[i + 3] > 200) n++;
            return acc + n;
        }, 0)""",
        [*rgb, tol],
    )


@pytest.mark.browser
@pytest.mark.parametrize("subshells", [SUBSHELLS_ON, SUBSHELLS_OFF], ids=["subshells-on", "subshells-off"])
def test_dashboard_start_pause_resume_stop(lab: LabServer, browser: Any, subshells: str) -> None:
    """Subshells on (JupyterLab's default) is the full run with the screenshot; off repeats
    the button sequence with shorter waits (click handlers then run on the main shell)."""
    full = subshells == SUBSHELLS_ON
    lab.set_comms_over_subshells(subshells)
    name = f"dashboard-{subshells}.ipynb"
    write_notebook(lab.root_dir / name)
    with open_notebook(browser, lab, name, viewport=(1480, 1040)) as nb:
        page = nb.page
        assert nb.comms_over_subshells() == subshells
        nb.app_eval("app.commands.execute('application:toggle-left-area')")  # more room for the plots
        nb.run_all_cells()
        nb.wait_cells_done(timeout=90)
        dash = page.locator(".trio-dashboard")
        dash.wait_for(state="visible", timeout=30_000)
        # the view renders, then re-renders once from the resent document: wait for a sized canvas
        deadline, box = time.monotonic() + 45, None
        while time.monotonic() < deadline:
            canvas = dash.locator("canvas").first
            canvas.wait_for(state="visible", timeout=30_000)
            box = canvas.bounding_box()
            if box and box["width"] > 300 and box["height"] > 100:
                break
            time.sleep(0.25)
        assert box and box["width"] > 300 and box["height"] > 100, box

        # the pool ticks before anything trains: the cycle counter moves
        first = _number(_wait_status(page, "t => /cycle \\d+/.test(t)", 30), "cycle")
        text = _wait_status(page, f"t => +(t.match(/cycle (\\d+)/) || [0, 0])[1] >= {first + 5}", 30)
        assert _number(text, "cycle") > first

        button = lambda label: dash.locator("button", has_text=re.compile(rf"^\s*{label}\s*$"))  # noqa: E731
        button("Start").click()
        text = _wait_status(page, "t => +(t.match(/updates (\\d+)/) || [0, 0])[1] >= 30", 90)
        assert "running" in text.lower(), text

        button("Pause").click()
        text = _wait_status(page, "t => /paused/i.test(t)", 30)
        paused_updates, paused_cycle = _number(text, "updates"), _number(text, "cycle")
        # the pool goes on ticking (the cycle counter moves) but no update is made
        text = _wait_status(page, f"t => +(t.match(/cycle (\\d+)/) || [0, 0])[1] >= {paused_cycle + 20}", 60)
        assert _number(text, "updates") == paused_updates, (paused_updates, text)

        button("Resume").click()
        more = 150 if full else 15  # the full run trains long enough for a telling screenshot
        text = _wait_status(page, f"t => +(t.match(/updates (\\d+)/) || [0, 0])[1] >= {paused_updates + more}", 90)
        assert "running" in text.lower(), text

        # figures drawn: each run's loss curve colour is on the canvas; op bars too
        time.sleep(0.5)
        pixels = {name: _canvas_pixels(dash, rgb) for name, rgb in
                  {"run1": (0x0F, 0x76, 0x6E), "run2": (0xDC, 0x26, 0x26), "run3": (0x7C, 0x3A, 0xED),
                   "forward_backward": (0x25, 0x63, 0xEB), "optim_step": (0xF9, 0x73, 0x16)}.items()}
        advisor = dash.locator(".trio-advisor").inner_text()
        dash.scroll_into_view_if_needed()
        shot = nb.screenshot("dashboard" if full else f"dashboard-{subshells}", selector=".trio-dashboard")
        print(f"status: {text!r}\nadvisor: {advisor!r}\npixels: {pixels}\nscreenshot: {shot}")
        assert all(n > 40 for n in pixels.values()), pixels
        assert "pipelined, nothing wasted" in advisor, advisor

        button("Stop").click()
        text = _wait_status(page, "t => /stopped/i.test(t)", 30)
        stopped = _number(text, "updates")
        text = _wait_status(page, f"t => +(t.match(/cycle (\\d+)/) || [0, 0])[1] >= {_number(text, 'cycle') + 10}",
                            30)
        assert _number(text, "updates") == stopped, text

        bad = nb.find_messages(*BAD_CONSOLE)
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
        assert page.locator(".jp-OutputArea-output script").count() == 1  # BokehJS sent once
        assert shot.exists() and shot.parent == ARTIFACTS
