"""Smoke test: inline BokehJS + ipywidgets + a kernel-loop task, in real JupyterLab.

One JupyterLab server and one Chromium for the module; each case writes its
own notebook (own kernel) and flips ``commsOverSubshells`` over REST first.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from lab import (
    BOKEH_ERRORS,
    REPO,
    SUBSHELLS_OFF,
    SUBSHELLS_ON,
    LabServer,
    open_notebook,
)
from lab import write_notebook as lab_write_notebook

BAD_CONSOLE = BOKEH_ERRORS

IMPORT_CELL = f"""\
import importlib.util, sys
REPO = {str(REPO)!r}
if REPO not in sys.path:
    sys.path.insert(0, REPO)
try:
    from trio_widgets.widgets import _bokeh_setup as bokeh_setup
    how = "package"
except Exception as exc:  # trio_widgets/__init__.py may be mid-edit by others
    spec = importlib.util.spec_from_file_location(
        "_trio_bokeh_setup", REPO + "/trio_widgets/widgets/_bokeh_setup.py")
    bokeh_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bokeh_setup)
    how = f"file ({{type(exc).__name__}}: {{exc}})"
print("bokeh_setup imported via", how)
"""

DASHBOARD_CELL = """\
import asyncio, math, threading
import ipywidgets as W
from bokeh.models import ColumnDataSource
from bokeh.plotting import figure

from IPython import get_ipython

kernel = get_ipython().kernel
state = {"clicks": 0, "thread": "-", "sent_on": "-"}

def on_start(_button):
    # may run on a subshell thread: only plain thread-safe state here
    state["thread"] = threading.current_thread().name
    state["sent_on"] = kernel.get_parent().get("header", {}).get("subshell_id") or "main"
    state["clicks"] += 1

def n_subshells():
    sct = getattr(kernel, "shell_channel_thread", None)
    return len(sct.manager.list_subshell()) if sct is not None else 0

start = W.Button(description="Start")
start.on_click(on_start)
status = W.HTML("cycle 0")
status.add_class("trio-status")
clicks = W.HTML("clicks 0")
clicks.add_class("trio-clicks")
source = ColumnDataSource(data={"x": [], "y": []})
fig = figure(height=260, width=600, title="trio smoke", toolbar_location=None)
fig.line("x", "y", source=source, line_width=3, line_color="#d62728")
plot = bokeh_setup.bokeh_widget(fig)
bokeh_setup.ensure_bokehjs()  # idempotent: must not send BokehJS again

async def ticker():
    n = 0
    while True:
        n += 1
        source.stream({"x": [n], "y": [math.sin(n / 4)]}, rollover=60)
        status.value = f"cycle {n}"
        clicks.value = (f"clicks {state['clicks']} on {state['thread']} sent-on {state['sent_on']}"
                        f" subshells {n_subshells()}")
        await asyncio.sleep(0.1)  # <= 10 Hz

if "ticker_task" in globals():  # re-run: one ticker only
    ticker_task.cancel()
ticker_task = asyncio.get_running_loop().create_task(ticker())
W.VBox([start, status, clicks, plot])
"""


def write_notebook(path: Path) -> None:
    lab_write_notebook(path, [IMPORT_CELL, DASHBOARD_CELL])


def cycle(page: Any) -> int:
    text = page.locator(".trio-status").inner_text(timeout=10_000)
    m = re.search(r"cycle (\d+)", text)
    assert m, text
    return int(m.group(1))


@pytest.mark.browser
@pytest.mark.parametrize("subshells", [SUBSHELLS_ON, SUBSHELLS_OFF], ids=["subshells-on", "subshells-off"])
def test_bokeh_dashboard_renders_and_updates(lab: LabServer, browser: Any, subshells: str) -> None:
    lab.set_comms_over_subshells(subshells)
    name = f"smoke-{subshells}.ipynb"
    write_notebook(lab.root_dir / name)

    with open_notebook(browser, lab, name) as nb:
        page = nb.page
        assert nb.comms_over_subshells() == subshells
        nb.run_all_cells()
        nb.wait_cells_done()

        out = page.locator(".jp-OutputArea-output").filter(has=page.locator(".trio-status"))
        # BokehJS view: a sized <canvas> (inside bokeh's shadow DOM; Playwright pierces it)
        canvas = out.locator("canvas").first
        canvas.wait_for(state="visible", timeout=30_000)
        box = canvas.bounding_box()
        assert box and box["width"] > 100 and box["height"] > 100, box

        first = cycle(page)
        page.wait_for_function(
            f"() => /cycle (\\d+)/.test(document.querySelector('.trio-status').innerText)"
            f" && +document.querySelector('.trio-status').innerText.match(/cycle (\\d+)/)[1] >= {first + 3}",
            timeout=15_000,
        )
        assert cycle(page) > first

        out.locator("button.jupyter-button", has_text=re.compile(r"^Start$")).click()
        page.wait_for_function(
            "() => /clicks 1 on /.test(document.querySelector('.trio-clicks').innerText)", timeout=15_000
        )
        m = re.search(r"on (\S+) sent-on (\S+) subshells (\d+)", page.locator(".trio-clicks").inner_text())
        assert m, page.locator(".trio-clicks").inner_text()
        handler_thread, sent_on, n_sub = m.group(1), m.group(2), int(m.group(3))
        print(f"[{subshells}] click handler ran on {handler_thread}; comm_msg subshell_id={sent_on}; "
              f"kernel subshells={n_sub}")
        if subshells == SUBSHELLS_OFF:
            assert (sent_on, n_sub, handler_thread) == ("main", 0, "MainThread")
        else:
            # the frontend sends widget comm messages on a per-comm-target subshell; ipykernel 7.4
            # routes a comm's replies to the subshell that last published on it (here: the main
            # shell, which created the widgets and runs the ticker), so the handler may still run
            # on MainThread; handlers must not assume either.
            assert sent_on != "main" and n_sub >= 1, (sent_on, n_sub)

        # the streamed line (#d62728) is really drawn on the bokeh canvas
        time.sleep(0.3)
        red = out.locator("canvas").evaluate_all(
            """cs => cs.reduce((acc, c) => {
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0;
                for (let i = 0; i < d.length; i += 4)
                    if (d[i] > 180 && d[i + 1] < 80 && d[i + 2] < 80 && d[i + 3] > 0) n++;
                return acc + n;
            }, 0)"""
        )
        nb.screenshot(f"bokeh-smoke-{subshells}")
        assert red > 50, f"no line pixels on the bokeh canvas ({red})"

        bad = nb.find_messages(*BAD_CONSOLE)
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
        # BokehJS was sent exactly once for this kernel
        loads = page.locator(".jp-OutputArea-output script").count()
        assert loads == 1, loads

        # Re-run everything in the same kernel/page: BokehJS is not sent again, plots still render.
        nb.run_all_cells()
        nb.wait_cells_done(min_count=4)
        out.locator("canvas").first.wait_for(state="visible", timeout=30_000)
        first = cycle(page)
        page.wait_for_function(
            f"() => +(document.querySelector('.trio-status').innerText.match(/cycle (\\d+)/) || [0, 0])[1]"
            f" >= {first + 2}",
            timeout=15_000,
        )
        assert page.locator(".jp-OutputArea-output script").count() == 0
        bad = nb.find_messages(*BAD_CONSOLE)
        assert not bad, "\n".join(bad)


def test_headless_nbclient_sends_bokehjs_once(tmp_path: Path) -> None:
    """Kernel rung: the same notebook under nbclient (no browser) runs without errors."""
    from nbclient import NotebookClient

    path = tmp_path / "headless.ipynb"
    write_notebook(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("await asyncio.sleep(0.35)\nprint(len(source.data['x']) >= 2)"))
    NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    loads = [o for o in outputs if "application/vnd.bokehjs_load.v0+json" in o.get("data", {})]
    assert len(loads) == 1
    assert outputs[-1].text.strip() == "True"
