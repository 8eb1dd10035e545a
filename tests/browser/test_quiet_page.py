"""Issue 24 item 2 in a real JupyterLab: the dashboard sends the page nothing that nobody sees.

* An idle pool (min_cycle_s=0: its clock ticks empty cycles): once the dashboard has settled,
  no comm message reaches the page for several seconds.
* A run trains; the tab is hidden (the Page Visibility API, emulated: headless Chromium keeps
  every tab visible): no comm message while hidden, though the pool goes on training; shown
  again, the status catches up to at least the cycle and update the kernel had reached.
* The same for the output scrolled out of view (IntersectionObserver) and back.

Behaviour only: message counts over a few seconds and what the page shows, no timings.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from lab import BOKEH_ERRORS, EMULATE_HIDDEN_JS, LabServer, open_notebook, write_notebook

SETUP = """\
import trio_widgets as trio
pool = trio.LocalPool(min_cycle_s=0.0, name="quiet")
dash = trio.Dashboard(pool)
dash
"""
TRAIN = """\
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=1, seed=0,
                                                            user_metadata={"name": "quiet-run"})
batch = [trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7, 8]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})]
import itertools
run = trio.train(tc, itertools.repeat(batch), learning_rate=1e-3, steps=1_000_000, history=50)
"""
STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"
SCROLLER = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
ON_SCREEN_JS = """() => { const el = document.querySelector('.trio-dashboard'); if (!el) return false;
    const r = el.getBoundingClientRect(); return r.height > 0 && r.bottom > 0 && r.top < window.innerHeight; }"""
QUIET_S = 5.0


def _comm_over(nb: Any, seconds: float) -> list[str]:
    """The comm messages the page received over `seconds` (Playwright hands frames over while called)."""
    nb.page.wait_for_timeout(200)
    nb.comm_log = []
    nb.page.wait_for_timeout(seconds * 1000)
    out, nb.comm_log = nb.comm_log, None
    return out


def _kernel(nb: Any) -> dict[str, Any]:
    """What the kernel knows now (a cell's output; no comm message)."""
    out, _ = nb.run_cell("import json; print(json.dumps({'cycle': pool.cycle_index, "
                         "'updates': pool.telemetry.total_updates, "
                         "'hidden': dash.bokeh_widget.views_hidden(), "
                         "'reports': dash.bokeh_widget.visibility_reports}))", until=r"\{", timeout=60)
    return dict(json.loads(out.strip().splitlines()[-1]))


def _wait_kernel(nb: Any, hidden: bool, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = _kernel(nb)
        if state["hidden"] == hidden:
            return state
        assert time.monotonic() < deadline, f"the kernel never heard that the view is {'hidden' if hidden else 'seen'}"
        nb.page.wait_for_timeout(300)


def _numbers(text: str) -> tuple[int, int]:
    m = re.search(r"cycle (\d+) · updates (\d+)", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def _catches_up(nb: Any, seen: dict[str, Any]) -> str:
    """The status shows at least the cycle and updates the kernel had reached (bounded wait)."""
    nb.page.wait_for_function(
        f"""([cycle, updates]) => {{
            const m = ({STATUS_JS})().match(/cycle (\\d+) · updates (\\d+)/);
            return m != null && Number(m[1]) >= cycle && Number(m[2]) >= updates;
        }}""", arg=[seen["cycle"], seen["updates"]], timeout=30_000)
    return str(nb.page.evaluate(STATUS_JS))


@pytest.mark.browser
def test_idle_hidden_and_scrolled_away_dashboards_send_nothing(lab: LabServer, browser: Any) -> None:
    write_notebook(lab.root_dir / "quiet.ipynb", [SETUP])
    with open_notebook(browser, lab, "quiet.ipynb") as nb:
        page = nb.page
        nb.run_all_cells()
        nb.wait_cells_done(timeout=120)
        page.locator(".trio-dashboard canvas").first.wait_for(state="visible", timeout=60_000)

        # idle pool: after it settles (its first second of empty cycles is drawn), nothing
        page.wait_for_function(f"() => /idle/i.test(({STATUS_JS})())", timeout=30_000)  # (the pill is upper-cased)
        page.wait_for_timeout(3000)
        idle = _comm_over(nb, QUIET_S)
        assert idle == [], f"{len(idle)} comm messages from an idle pool's dashboard: {idle[:3]}"
        idle_state = _kernel(nb)
        assert idle_state["cycle"] > 20  # its clock ticked all along

        nb.run_cell(TRAIN, timeout=120)
        page.wait_for_function(f"() => /updates [1-9]/.test(({STATUS_JS})())", timeout=120_000)
        assert _comm_over(nb, 1.0), "a training pool's dashboard sends its changes"

        # hidden tab: nothing while hidden, though the pool trains on
        page.evaluate(EMULATE_HIDDEN_JS, True)
        before = _wait_kernel(nb, hidden=True)
        hidden = _comm_over(nb, QUIET_S)
        assert hidden == [], f"{len(hidden)} comm messages to a hidden tab: {hidden[:3]}"
        seen = _wait_kernel(nb, hidden=True)
        assert seen["updates"] > before["updates"], (before, seen)
        page.evaluate(EMULATE_HIDDEN_JS, False)
        text = _catches_up(nb, seen)
        print("shown again:", text.splitlines()[0])

        # scrolled away: the same through the IntersectionObserver
        nb.add_cell("# spacer\n" * 120)
        page.evaluate(f"() => {{ const s = document.querySelector('{SCROLLER}'); s.scrollTop = s.scrollHeight; }}")
        page.wait_for_function(f"() => !({ON_SCREEN_JS})()", timeout=10_000)
        before = _wait_kernel(nb, hidden=True)
        away = _comm_over(nb, QUIET_S)
        assert away == [], f"{len(away)} comm messages to a dashboard scrolled away: {away[:3]}"
        seen = _wait_kernel(nb, hidden=True)
        assert seen["updates"] > before["updates"], (before, seen)
        page.evaluate(f"() => {{ document.querySelector('{SCROLLER}').scrollTop = 0; }}")
        page.wait_for_function(ON_SCREEN_JS, timeout=10_000)
        _catches_up(nb, seen)
        assert _comm_over(nb, 1.0), "seen again, the dashboard streams again"
        assert seen["reports"] >= 2

        nb.run_cell("run.stop(); dash.close(); pool.close()", timeout=60)
        bad = nb.find_messages(*BOKEH_ERRORS, r"Bad column name")
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
        assert not nb.own_comm_errors(), nb.own_comm_errors()
