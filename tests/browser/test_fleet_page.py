"""A fleet's dashboard in a real JupyterLab + Chromium (issue 34, point 1): `trio.Dashboard(fleet_url)`
on a fleet of two pools (`serve --ray`, its own process and local Ray instance) while a client of this
process trains on it. The page's pool selector picks the pool the session was placed on; that
pool's plots are drawn: their ranges cover their data, their frames have drawn pixels, and a
later reading shows the view moved on (rendered.py).
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import rendered
from lab import BOKEH_ERRORS, LabServer, open_notebook, write_notebook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/served.py
pytest.importorskip("ray.serve", reason="the cluster extra (Ray Serve) is not installed")

from served import fleet_process  # noqa: E402

import trio_widgets as trio  # noqa: E402

# `make test` runs it alone, with no test beside it: a fleet of Ray processes, JupyterLab and Chromium
# on a CPU another test keeps busy drew a timeline row seconds ahead of its view once
pytestmark = pytest.mark.alone

KEY = "tml-fleet-page"
OBSERVER = "tml-fleet-page-observer"
MAIN_PLOTS = ["Cycle timeline", "Queue depth", "Loss per token"]
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]


def _train(url: str, stop: threading.Event, errors: list[str]) -> None:
    """A pipelined loop on the fleet until `stop` (bounded: each wait has a timeout)."""
    try:
        service = trio.ServiceClient(base_url=url, api_key=KEY)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0,
                                                 user_metadata={"name": "fleet-page"})
        adam, previous, i = trio.AdamParams(learning_rate=3e-3), None, 0
        while not stop.is_set():
            chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + 17]
            batch = [trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})]
            current = (tc.forward_backward(batch), tc.optim_step(adam))
            if previous is not None:
                previous[0].result(timeout=120)
                previous[1].result(timeout=120)
            previous, i = current, i + 1
        service.backend.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(repr(exc))


@pytest.mark.browser
def test_a_fleets_selected_pool_is_drawn_and_moves_on(lab: LabServer, browser: Any, tmp_path: Path) -> None:
    with fleet_process(tmp_path, keys=KEY, observer=OBSERVER, min_cycle_s=0.1) as fleet:
        stop, errors = threading.Event(), []
        loop = threading.Thread(target=_train, args=(fleet.url, stop, errors), name="fleet-page-loop", daemon=True)
        loop.start()
        try:
            write_notebook(lab.root_dir / "fleet.ipynb", [
                f"import trio_widgets as trio\ndash = trio.Dashboard({fleet.url!r}, api_key={OBSERVER!r})\ndash"])
            with open_notebook(browser, lab, "fleet.ipynb", viewport=(1480, 1040)) as nb:
                page = nb.page
                nb.app_eval("app.commands.execute('application:toggle-left-area')")
                nb.run_all_cells()
                nb.wait_cells_done(timeout=120)
                fleet_view = page.locator(".trio-fleet")
                fleet_view.wait_for(state="visible", timeout=60_000)
                # the pool holding the session: its selector button says "1 session"
                busy = fleet_view.locator("button", has_text=re.compile(r"1 session"))
                busy.first.wait_for(state="visible", timeout=120_000)
                busy.first.click()
                within = ".trio-fleet .trio-dashboard"
                page.wait_for_function(
                    "() => /fleet-page[^\\n]*cycles?\\/update/.test((document.querySelector("
                    "'.trio-fleet .trio-dashboard .trio-status') || {innerText: ''}).innerText)", timeout=120_000)
                rendered.show_whole(page, ".trio-fleet")
                first = rendered.drawn(page, MAIN_PLOTS, within, name="fleet-first")
                page.wait_for_timeout(2500)  # a couple of dozen cycles at 0.1 s
                rendered.check_moved_on(first, rendered.plots(page, within, name="fleet-later"))
                shot = nb.screenshot("fleet-page", selector=".trio-fleet")
                print(f"screenshot: {shot}")
                nb.run_cell("dash.close()\nprint('closed')", until="closed", timeout=60)
                bad = nb.find_messages(*BOKEH_ERRORS)
                assert not bad, "\n".join(bad)
                assert not nb.page_errors, nb.page_errors
        finally:
            stop.set()
            loop.join(180)
        assert not loop.is_alive() and errors == [], errors
