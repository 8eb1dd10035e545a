"""Issue 14 item 3 (and issue 10 item 6) in a real JupyterLab: Kernel → Interrupt stops the run.

* `await trio.train(...)` interrupted: the cell ends with one line (RunInterrupted: where the
  run stopped), not a traceback; the run stops (the pool's update count stays put) and the
  dashboard says so in its status line.
* `trio.run_sync(run)` in a blocking cell, interrupted: the same, and the run's metrics,
  its metrics.jsonl and the adapter's optimizer step count agree (every update that was
  applied is recorded; nothing queued runs later).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from lab import BOKEH_ERRORS, LabServer, open_notebook, write_notebook

SETUP = """\
import itertools, json
import trio_widgets as trio
pool = trio.LocalPool(min_cycle_s=0.05, name="interrupt")
dash = trio.Dashboard(pool)
dash
"""
CLIENT = """\
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0,
                                                           user_metadata={"name": "awaited"})
batches = trio.data.addition_batches(tc.get_tokenizer(), batch_size=4, seed=0)
"""
AWAITED = "await trio.train(tc, batches, learning_rate=3e-3, steps=100_000)"
BLOCKING = """\
tc2 = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
run = trio.train(tc2, batches, learning_rate=3e-3, steps=100_000, lookahead=3, name="blocking",
                 metrics_path="blocking.jsonl")
trio.run_sync(run)
"""
CHECK = """\
import time; time.sleep(0.5)
snap = tc2.inspect_adapter().result(timeout=60)
print(json.dumps({"state": run.state, "reason": run.stop_reason, "step": run.step, "metrics": len(run.metrics),
                  "lines": len(open("blocking.jsonl").read().splitlines()), "adam_step": snap.step,
                  "grad_pending": snap.grad is not None}))
"""
STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"


def _updates(page: Any) -> int:
    m = re.search(r"updates (\d+)", page.evaluate(STATUS_JS))
    return int(m.group(1)) if m else 0


def _interrupt(nb: Any) -> None:
    """Kernel → Interrupt Kernel, through the menu bar like a user."""
    page = nb.page
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Kernel$")).click()
    label = page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Interrupt Kernel$"))
    page.locator(".lm-Menu-item").filter(has=label).click()


def _error_output(nb: Any, index: int) -> dict:
    return nb.page.evaluate(
        """(i) => {
            const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
            return cell.model.outputs.toJSON().find(o => o.output_type === 'error') || {};
        }""",
        index,
    )


def _interrupt_cell(nb: Any, index: int, at_updates: int) -> dict:
    page = nb.page
    start = _updates(page)
    deadline = time.monotonic() + 180
    while _updates(page) < start + at_updates:
        assert time.monotonic() < deadline, f"not training: {page.evaluate(STATUS_JS)!r}"
        time.sleep(0.3)
    assert "*" in nb.cell_prompt(index)
    _interrupt(nb)
    page.wait_for_function(
        "(i) => !document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')[i].textContent.includes('*')",
        arg=index, timeout=60_000)
    return _error_output(nb, index)


@pytest.mark.browser
def test_kernel_interrupt_stops_the_awaited_run(lab: LabServer, browser: Any) -> None:
    write_notebook(lab.root_dir / "interrupt.ipynb", [SETUP, CLIENT, AWAITED])
    with open_notebook(browser, lab, "interrupt.ipynb", viewport=(1440, 900)) as nb:
        page = nb.page
        nb.run_all_cells()
        page.locator(".trio-dashboard").wait_for(state="visible", timeout=60_000)

        error = _interrupt_cell(nb, 2, at_updates=25)
        print("awaited cell's error output:", error)
        assert error.get("ename") == "RunInterrupted", error
        assert len(error.get("traceback", [])) == 1, error  # one line, no traceback
        assert re.search(r"interrupted: run 'awaited' stopped at step \d+ of 100000", error["traceback"][0]), error
        # the run has stopped: the pool's update count stays put, and the dashboard says what happened
        page.wait_for_function(f"() => /stopped at step \\d+ of 100000: interrupted/.test(({STATUS_JS})())",
                               timeout=30_000)
        stopped = _updates(page)
        time.sleep(3.0)
        text = page.evaluate(STATUS_JS)
        assert _updates(page) == stopped, text
        assert text.upper().startswith("IDLE"), text
        print("dashboard after the interrupt:", repr(text))

        # a blocking cell: run_sync(train(...)) interrupted
        nb.add_cell(BLOCKING)
        nb.page.keyboard.press("Control+Enter")
        page.wait_for_function(
            "() => document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')[3].textContent.includes('*')",
            timeout=30_000)
        error = _interrupt_cell(nb, 3, at_updates=25)
        print("blocking cell's error output:", error)
        assert error.get("ename") == "RunInterrupted" and len(error.get("traceback", [])) == 1, error
        out, _ = nb.run_cell(CHECK, until=r"\{", timeout=120)
        result = json.loads(out.strip().splitlines()[-1])
        print("blocking run after the interrupt:", result)
        assert result["state"] == "stopped" and result["reason"] == "interrupted", result
        assert result["step"] == result["metrics"] == result["lines"] == result["adam_step"], result
        assert not result["grad_pending"], result
        nb.screenshot("interrupted", selector=".trio-dashboard")
        bad = nb.find_messages(*BOKEH_ERRORS)
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
