"""Issue 24: the dashboard's words describe the present, in a real JupyterLab.

* The loop's cell runs again (twice): the status says which pool it shows now, once — not
  "showing pool 'pool-1'" above "now showing its new pool 'pool-2'", piling up with each re-run.
* Kernel → Interrupt of the README's loop, with `await` and with `.result()`: the cell ends in one
  line (WaitInterrupted, naming the request) and the dashboard says which wait stopped.
* Kernel → Shut Down: the dashboard does not promise to wait for a new pool.
* Notebook 01 under Run All: scrolled back to, the dashboard is live while the run trains (its
  update count moves on the page), then leaves its final picture (the snapshot, all 200 updates).
"""

from __future__ import annotations

import re
import shutil
import time
from typing import Any

import pytest
from lab import BOKEH_ERRORS, REPO, LabServer, open_notebook, write_notebook

STATUS_JS = "(i) => (document.querySelectorAll('.trio-dashboard .trio-status')[i] || {innerText: ''}).innerText"
FOLLOWER = "import trio_widgets as trio\ntrio.Dashboard()"
POOL = "pool = trio.LocalPool(min_cycle_s=0.05)\nprint('built', pool.name)"
LOOP = """\
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, user_metadata={"name": "readme"})
batches = trio.data.addition_batches(tc.get_tokenizer(), batch_size=4)
in_flight = None
for step in range(100_000):
    fb = tc.forward_backward(next(batches), "cross_entropy")
    opt = tc.optim_step(trio.AdamParams(learning_rate=3e-3))
    if in_flight:
        result = {wait}
    in_flight = (fb, opt)
"""


def _menu(page: Any, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{menu}$")).click()
    label = page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{item}$"))
    page.locator(".lm-Menu-item").filter(has=label).click()


def _status(nb: Any, index: int = 0) -> str:
    return nb.page.evaluate(STATUS_JS, index)


def _updates(nb: Any) -> int:
    m = re.search(r"updates (\d+)", _status(nb))
    return int(m.group(1)) if m else 0


def _wait_status(nb: Any, pattern: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, text := _status(nb)):
        assert time.monotonic() < deadline, f"no {pattern!r} in the status: {text!r}"
        time.sleep(0.25)
    return text


def _error_output(nb: Any, index: int) -> dict:
    return nb.page.evaluate(
        """(i) => {
            const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
            return cell.model.outputs.toJSON().find(o => o.output_type === 'error') || {};
        }""", index)


def _busy(nb: Any, index: int) -> bool:
    return "*" in nb.cell_prompt(index)


@pytest.mark.browser
def test_notices_and_interrupts_say_what_is_true_now(lab: LabServer, browser: Any) -> None:
    write_notebook(lab.root_dir / "words.ipynb", [FOLLOWER, POOL])
    with open_notebook(browser, lab, "words.ipynb", viewport=(1440, 900)) as nb:
        nb.run_all_cells()
        nb.wait_cells_done(timeout=120, min_count=2)
        first = re.search(r"built (\S+)", nb.cell_text(1)).group(1)
        _wait_status(nb, rf"showing pool '{first}'")

        # -- the pool's cell again, twice: one line says which pool is shown now ----------------
        names = [first]
        for _ in range(2):
            nb.rerun_cell(1)
            deadline = time.monotonic() + 60
            while not (m := re.search(r"built (\S+)", nb.cell_text(1))) or m.group(1) in names:
                assert time.monotonic() < deadline, nb.cell_text(1)
                time.sleep(0.2)
            names.append(m.group(1))
            text = _wait_status(nb, rf"'{names[-1]}'")
        print("status after two re-runs:", repr(text))
        assert len(re.findall(r"showing", text)) == 1, text  # the present, once
        assert f"'{names[0]}'" not in text, text  # the first switch's line gave way to the latest

        # -- Kernel → Interrupt of the README loop, both styles ---------------------------------
        for index, wait in ((2, "await in_flight[0]; await in_flight[1]"),
                            (3, "in_flight[0].result(); in_flight[1].result()")):
            nb.add_cell(LOOP.replace("{wait}", wait))
            nb.page.keyboard.press("Control+Enter")
            start, before = time.monotonic(), _updates(nb)
            while _updates(nb) < before + 15:
                assert time.monotonic() - start < 180, f"not training: {_status(nb)!r}"
                time.sleep(0.3)
            assert _busy(nb, index)
            _menu(nb.page, "Kernel", "Interrupt Kernel")
            nb.page.wait_for_function(
                "(i) => !document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')[i].textContent.includes('*')",
                arg=index, timeout=60_000)
            error = _error_output(nb, index)
            print(f"{wait!r} interrupted:", error)
            assert error.get("ename") == "WaitInterrupted" and len(error.get("traceback", [])) == 1, error
            m = re.search(r"interrupted while waiting for ((?:forward_backward|optim_step) \(request #\d+\))",
                          error["traceback"][0])
            assert m, error
            text = _wait_status(nb, rf"readme: the wait for {re.escape(m.group(1))} stopped \(interrupted\)", 30)
            print("dashboard after it:", repr(text))

        # -- Kernel → Shut Down: no promise of a new pool ----------------------------------------
        _menu(nb.page, "Kernel", "Shut Down Kernel")
        dialog = nb.page.locator(".jp-Dialog button.jp-mod-accept")
        try:
            dialog.first.click(timeout=5_000)
        except Exception:  # this JupyterLab asks no confirmation
            pass
        time.sleep(5.0)
        text = _status(nb)
        print("after Kernel → Shut Down:", repr(text))
        assert "waiting for a new one" not in text, text
        nb.screenshot("words-shut-down", selector=".trio-dashboard")
        bad = nb.find_messages(*BOKEH_ERRORS)
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors


@pytest.mark.browser
def test_notebook_01_run_all_is_live_then_final(lab: LabServer, browser: Any) -> None:
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", lab.root_dir / "01_quickstart.ipynb")
    with open_notebook(browser, lab, "01_quickstart.ipynb", viewport=(1440, 900)) as nb:
        nb.run_all_cells()
        # Run All moves the notebook on to its last cell; the reader scrolls back up to the
        # dashboard while the run trains: it catches up at once and stays live
        dashboard = nb.page.locator(".trio-dashboard").first
        dashboard.wait_for(state="attached", timeout=120_000)
        seen: list[int] = []
        deadline = time.monotonic() + 300
        snapshot = nb.page.locator(".trio-snapshot")
        while not snapshot.count():
            if not seen:
                dashboard.scroll_into_view_if_needed(timeout=5_000)
            assert time.monotonic() < deadline, f"no final picture; status {_status(nb)!r}"
            if (n := _updates(nb)) and (not seen or n != seen[-1]):
                seen.append(n)
            time.sleep(0.2)
        print("update counts the live dashboard showed:", seen)
        live = [n for n in seen if 0 < n < 200]
        assert len(live) >= 3, seen  # it moved on the page while the run trained
        snapshot.first.wait_for(state="visible", timeout=30_000)
        text = snapshot.first.inner_text()
        print("final picture:", text[:300])
        assert "Snapshot of the dashboard when it closed" in text and re.search(r"updates 200\b", text), text
        nb.wait_cells_done(timeout=120)
        assert not nb.page_errors, nb.page_errors
