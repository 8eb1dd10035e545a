"""Issue 14, items 2 and 4: the README's "Ten lines" work live, exactly as documented.

The cells are taken from README.md itself (the two python blocks of "## Ten lines"), so this
test follows the README when its code changes. Run All in JupyterLab: the dashboard cell
comes first, the loop second; while the loop's cell is still running (its prompt shows
[*]) the dashboard must count its updates and its pill must say TRAINING (the loop is
hand-written: the pill describes the pool, not only the dashboard's own runs). Then the
loop's cell runs again: the dashboard must follow (a new pool replaces the old one when
the loop builds its own) and show the new loop live too, never a CLOSED pool.

A second case runs a blocking loop (`.result()`, the synchronous style of the hosted SDKs):
the kernel's main thread is busy for the whole cell, and the dashboard must still be live.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from lab import BOKEH_ERRORS, REPO, LabServer, open_notebook, write_notebook

STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"
HEADER_JS = "() => (document.querySelector('.trio-dashboard .trio-title') || {innerText: ''}).innerText"

BLOCKING_LOOP = """\
import trio_widgets as trio

pool = trio.LocalPool(min_cycle_s=0.05)
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=16)
batches = trio.data.addition_batches(tc.get_tokenizer(), batch_size=8)
for step in range(80):                 # blocks the cell: submit both, then wait for both
    fb = tc.forward_backward(next(batches), "cross_entropy")
    opt = tc.optim_step(trio.AdamParams(learning_rate=3e-3))
    fb.result(); opt.result()
"""


def readme_cells() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Ten lines", 1)[1].split("\n## ", 1)[0]
    # whole cells only: an indented block is a fragment to swap into the loop (the two-await style)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if not b.startswith((" ", "\t"))]
    assert len(blocks) == 2, f"expected the dashboard cell and the loop cell in 'Ten lines', got {len(blocks)}"
    assert "trio.Dashboard(" in blocks[0] and "LocalPool(" in blocks[1], blocks
    return blocks


def _updates(text: str) -> int:
    m = re.search(r"updates (\d+)", text)
    return int(m.group(1)) if m else 0


def _watch_while_running(nb: Any, cell: int, timeout_s: float) -> list[tuple[bool, int, str]]:
    """(cell still running, updates, status text) samples until the cell has run."""
    samples = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = "*" in nb.cell_prompt(cell)
        text = nb.page.evaluate(STATUS_JS)
        samples.append((running, _updates(text), text))
        if not running and len(samples) > 1:
            return samples
        time.sleep(0.5)
    raise AssertionError(f"cell {cell} still running after {timeout_s:.0f} s; last status {samples[-1][2]!r}")


def _check_live(samples: list[tuple[bool, int, str]], what: str) -> None:
    during = [(n, text) for running, n, text in samples if running]
    counts = [n for n, _ in during]
    # the dashboard counted updates while the loop's cell was still running, and more and more
    assert len(set(c for c in counts if c > 0)) >= 3, f"{what}: not live while the cell ran: {counts}"
    assert any(text.upper().startswith("TRAINING") for _, text in during), \
        f"{what}: no TRAINING pill while the loop trained: {[t for _, t in during][-3:]}"
    assert not any("CLOSED" in text.upper().split("\n")[0] for _, _, text in samples), samples[-1]


@pytest.mark.browser
@pytest.mark.parametrize("loop", ["readme", "blocking"])
def test_ten_lines_live_as_documented(lab: LabServer, browser: Any, loop: str) -> None:
    dash_cell, loop_cell = readme_cells()
    if loop == "blocking":
        loop_cell = BLOCKING_LOOP
    name = f"ten-lines-{loop}.ipynb"
    write_notebook(lab.root_dir / name, [dash_cell, loop_cell])
    with open_notebook(browser, lab, name, viewport=(1440, 900)) as nb:
        page = nb.page
        nb.run_all_cells()
        page.locator(".trio-dashboard").wait_for(state="visible", timeout=60_000)
        samples = _watch_while_running(nb, 1, 300)
        _check_live(samples, "first run")
        first_header = page.evaluate(HEADER_JS)
        first_updates = samples[-1][1]
        print(f"[{loop}] first run: {first_header!r}; updates seen while it ran: "
              f"{sorted(set(n for r, n, _ in samples if r))[:3]}...{first_updates}")

        nb.rerun_cell(1)  # the loop's cell again: a new pool (or the same default one)
        page.wait_for_function("() => document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')[1]"
                               ".textContent.includes('*')", timeout=30_000)
        samples = _watch_while_running(nb, 1, 300)
        _check_live(samples, "second run")
        header, status = page.evaluate(HEADER_JS), page.evaluate(STATUS_JS)
        print(f"[{loop}] second run: {header!r}; status {status!r}")
        if header != first_header:  # the loop builds its own pool: the dashboard says it moved
            assert "now showing its new pool" in status or "now showing the newest pool" in status, status
        nb.screenshot(f"ten-lines-{loop}", selector=".trio-dashboard")
        bad = nb.find_messages(*BOKEH_ERRORS, r"Bad column name")
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
