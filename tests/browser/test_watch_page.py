"""Issue 26 in a real JupyterLab: `trio.Dashboard(watch=...)` watching an official-SDK loop.

The notebook serves a pool in its kernel (as notebook 07 does), watches the unmodified
`tinker.ServiceClient` made for it, shows `trio.Dashboard(watch=watched)` and runs a pipelined
SDK loop in a background thread (the kernel stays free for the page's messages). In the page:

* the status line goes live: "in flight", "updates N" growing, "round trips/update";
* the advisor says "pipelined" (and what the client side cannot know);
* lanes and bars are drawn: the page receives bokeh patches and draws the figures; what is drawn
  is checked (rendered.py): the ranges cover the requests, the frames have drawn pixels, and
  the view moves on;
* no page error, no BokehJS error, no comm error of the dashboard's own.

Then, in the kernel, `trio.unwatch(...)`: the SDK's classes (`vars()` of ServiceClient,
TrainingClient, SamplingClient, APIFuture and the futures of clients) have the same keys and the
same objects as before watching, the proxy hands back the very client, and the dashboard says
that watching stopped. Everything is closed at the end. Behaviour only, no timings.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import rendered
from lab import BOKEH_ERRORS, LabServer, open_notebook, write_notebook

SETUP = """\
import os, threading
os.environ["TINKER_TELEMETRY"] = "0"  # the SDK would otherwise send its telemetry to our server
os.environ["HF_HUB_OFFLINE"] = "1"
import tinker
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.backcompat_training_client_future import BackcompatTrainingClientFuture
SDK_CLASSES = [tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.APIFuture,
               AwaitableConcurrentFuture, BackcompatTrainingClientFuture]
sdk_before = {cls: dict(vars(cls)) for cls in SDK_CLASSES}  # before anything is watched

import trio_widgets as trio
from trio_widgets.watch import watcher_of
pool = trio.LocalPool(min_cycle_s=0.1, name="watched-room")
server = trio.serve(pool, port=0)
sdk = tinker.ServiceClient(base_url=server.url, api_key="tml-watch-page")
watched = trio.watch(sdk)
tc = watched.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=0).result()
dash = trio.Dashboard(watch=watched)
dash
"""
LOOP = """\
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]
ADAM = types.AdamParams(learning_rate=1e-2)
stop = threading.Event()
loop_errors = []


def datum(i, length=16):
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + length + 1]
    return types.Datum(model_input=types.ModelInput.from_ints(chunk[:-1]), loss_fn_inputs={"target_tokens": chunk[1:]})


def pipelined():
    \"\"\"One update ahead, until told to stop (the SDK's plain sync API, in a thread of its own).\"\"\"
    try:
        previous, i = None, 0
        while not stop.is_set():
            current = (tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(ADAM))
            if previous is not None:
                previous[0].result(timeout=120)
                previous[1].result(timeout=120)
            previous, i = current, i + 1
        previous[0].result(timeout=120)
        previous[1].result(timeout=120)
    except BaseException as exc:
        loop_errors.append(repr(exc))


loop_thread = threading.Thread(target=pipelined, name="sdk-loop", daemon=True)
loop_thread.start()
print("loop started")
"""
UNWATCH = """\
stop.set()
loop_thread.join(120)
client = trio.unwatch(watched)
sdk_after = {cls: dict(vars(cls)) for cls in SDK_CLASSES}
changed = [cls.__name__ for cls in SDK_CLASSES
           if sdk_after[cls].keys() != sdk_before[cls].keys()
           or any(sdk_after[cls][k] is not v for k, v in sdk_before[cls].items())]
print("LOOP-ALIVE", loop_thread.is_alive(), "LOOP-ERRORS", loop_errors)
print("SAME-CLIENT", client is sdk, "RECORDING", watcher_of(watched).active)
print("SDK-CHANGED", changed)
"""
CLOSE = """\
dash.close()
sdk.close("success").result(timeout=60)
server.stop()
pool.close()
print("closed", dash.closed, pool.closed, [t.name for t in threading.enumerate() if t.name.startswith("trio-")])
"""
WATCH_PLOTS = ["Requests seen from the client", "Requests in flight", "Loss per token"]
STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"
ADVISOR_JS = "() => (document.querySelector('.trio-dashboard .trio-advisor') || {innerText: ''}).innerText"


def _updates(text: str) -> int:
    m = re.search(r"updates (\d+)", text)
    assert m, text
    return int(m.group(1))


@pytest.mark.browser
def test_a_watched_sdk_loop_goes_live_in_the_page_and_unwatch_leaves_the_sdk_as_it_was(
        lab: LabServer, browser: Any) -> None:
    write_notebook(lab.root_dir / "watch.ipynb", [SETUP])
    with open_notebook(browser, lab, "watch.ipynb") as nb:
        page = nb.page
        nb.run_all_cells()
        nb.wait_cells_done(timeout=180)
        page.locator(".trio-dashboard canvas").first.wait_for(state="visible", timeout=60_000)
        assert "seen from this process" in page.locator(".trio-dashboard .trio-title").inner_text()

        patches_before = nb.patches_received
        out, _ = nb.run_cell(LOOP, until="loop started", timeout=60)
        page.locator(".trio-dashboard").first.scroll_into_view_if_needed()

        # the status line goes live: requests in flight, updates counted, round trips per update
        page.wait_for_function(f"() => /updates [1-9]/.test(({STATUS_JS})())", timeout=120_000)
        first = _updates(str(page.evaluate(STATUS_JS)))
        page.wait_for_function(
            f"(n) => {{ const m = ({STATUS_JS})().match(/updates (\\d+)/); return m && Number(m[1]) > n; }}",
            arg=first, timeout=120_000)
        page.wait_for_function(f"() => /round trips\\/update/.test(({STATUS_JS})())", timeout=120_000)
        status = str(page.evaluate(STATUS_JS))
        assert "in flight" in status and _updates(status) > first, status
        assert re.search(r"[\d.]+ round trips?/update", status), status

        # the advisor: the watcher's diagnosis, and what it cannot know from here
        page.wait_for_function(f"() => /pipelined/.test(({ADVISOR_JS})())", timeout=120_000)
        advisor = str(page.evaluate(ADVISOR_JS))
        assert "round trips per update" in advisor and "server's cycle boundaries" in advisor, advisor

        # lanes and bars: the page received the figures' patches and drew them
        for _ in range(300):  # (Playwright hands the page's frames over while it is called)
            if nb.patches_received > patches_before:
                break
            page.wait_for_timeout(100)
        assert nb.patches_received > patches_before, "no bokeh patch reached the page while the loop trained"
        assert page.locator(".trio-dashboard canvas").count() > 0
        # what is drawn (issue 34: the two main plots stayed at x 0..1, empty): ranges cover the
        # requests, the frames have drawn pixels, and a few updates later the view moved on
        rendered.show_whole(page)
        first = rendered.drawn(page, WATCH_PLOTS, name="watch-first")
        page.wait_for_timeout(2500)
        rendered.check_moved_on(first, rendered.plots(page, name="watch-later"))
        nb.screenshot("watch-page", selector=".trio-dashboard")

        # unwatch, in the kernel: the SDK as it was, the very client handed back
        out, _ = nb.run_cell(UNWATCH, until="SDK-CHANGED", timeout=180)
        assert "LOOP-ALIVE False LOOP-ERRORS []" in out, out
        assert "SAME-CLIENT True RECORDING False" in out, out
        assert "SDK-CHANGED []" in out, out
        # (the cells run since may have scrolled it away: a dashboard nobody sees is sent nothing)
        page.locator(".trio-dashboard").first.scroll_into_view_if_needed()
        page.wait_for_function(f"() => /watching stopped/.test(({STATUS_JS})())", timeout=60_000)

        out, _ = nb.run_cell(CLOSE, until="closed", timeout=120)
        assert "closed True True []" in out, out
        bad = nb.find_messages(*BOKEH_ERRORS, r"Bad column name")
        assert not bad, "\n".join(bad)
        assert not nb.page_errors, nb.page_errors
        assert not nb.own_comm_errors(), nb.own_comm_errors()
