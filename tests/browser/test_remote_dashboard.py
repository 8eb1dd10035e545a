"""The remote dashboard in a real JupyterLab + Chromium: a pool served by its own process
(`python -m trio_widgets serve`), two clients training from two more processes (the official
tinker SDK where it is installed, and trio's HTTP client), and a notebook whose only cell is
`trio.Dashboard(url, api_key=...)`. The page must show both clients' lanes, labelled by their
sessions, and their cycles per update, drawn by bokeh without console errors; every plot's
ranges cover its data, its frame is drawn and the view moves on (rendered.py); the disabled
Start says why.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import rendered
from lab import ARTIFACTS, BOKEH_ERRORS, LabServer, free_port, open_notebook, process, write_notebook

REPO = Path(__file__).resolve().parents[2]
KEYS = ("tml-browser-sdk-1", "tml-browser-trio-2")
WATCH = "tml-browser-watcher"
MAIN_PLOTS = ["Cycle timeline", "Queue depth", "Loss per token"]
STATUS_JS = "() => (document.querySelector('.trio-dashboard .trio-status') || {innerText: ''}).innerText"

# Both loops are bounded: they stop when the stop file appears, or after 150 s.
SDK_CLIENT = """
    import os, sys, time
    import tinker
    from tinker import types as tt
    url, key, stop = sys.argv[1:4]
    sc = tinker.ServiceClient(base_url=url, api_key=key, user_metadata={"name": "sdk-proc"})
    tc = sc.create_lora_training_client(base_model="trio/tiny-llama-byte", rank=4, seed=1).result()
    batch = [tt.Datum(model_input=tt.ModelInput.from_ints(list(range(5, 37))),
                      loss_fn_inputs={"target_tokens": list(range(6, 38))})]
    adam, previous, deadline = tt.AdamParams(learning_rate=3e-3), None, time.monotonic() + 150
    while not os.path.exists(stop) and time.monotonic() < deadline:
        current = (tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam))
        if previous:
            previous[0].result(); previous[1].result()
        previous = current
    sc.close("success").result()
"""
TRIO_CLIENT = """
    import os, sys, time
    import trio_widgets as trio
    url, key, stop = sys.argv[1:4]
    service = trio.ServiceClient(base_url=url, api_key=key)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=2, user_metadata={"name": "trio-proc"})
    batch = [trio.Datum(trio.ModelInput.from_ints(list(range(5, 37))), {"target_tokens": list(range(6, 38))})]
    adam, previous, deadline = trio.AdamParams(learning_rate=3e-3), None, time.monotonic() + 150
    while not os.path.exists(stop) and time.monotonic() < deadline:
        current = (tc.forward_backward(batch), tc.optim_step(adam))
        if previous:
            previous[0].result(); previous[1].result()
        previous = current
    service.backend.close()
"""


def _wait_status(page: Any, predicate_js: str, timeout_s: float) -> str:
    page.wait_for_function(f"() => {{ const t = ({STATUS_JS})(); return ({predicate_js})(t); }}",
                           timeout=timeout_s * 1000)
    return page.evaluate(STATUS_JS)


@pytest.mark.browser
def test_remote_dashboard_shows_two_clients_of_two_other_processes(lab: LabServer, browser: Any,
                                                                   tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "TRIO_TORCH_THREADS": "1"}
    stop = tmp_path / "stop"
    serve = [sys.executable, "-m", "trio_widgets", "serve", "--port", str(port), "--min-cycle-s", "0.1",
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--observer-key", WATCH, *sum((["--api-key", k]
                                                                                        for k in KEYS), [])]
    with process(serve, tmp_path / "server.log", env) as server:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        first = SDK_CLIENT if sys.version_info >= (3, 11) else TRIO_CLIENT.replace("trio-proc", "sdk-proc")
        scripts = {"sdk-proc": first, "trio-proc": TRIO_CLIENT}
        with contextlib.ExitStack() as clients:
            for (name, source), key in zip(scripts.items(), KEYS):
                script = tmp_path / f"{name}.py"
                script.write_text(textwrap.dedent(source))
                clients.enter_context(process([sys.executable, str(script), url, key, str(stop)],
                                              tmp_path / f"{name}.log", env, grace=30))
            name = "remote-dashboard.ipynb"
            write_notebook(lab.root_dir / name, [f"import trio_widgets as trio\n"
                                                 f"dash = trio.Dashboard({url!r}, api_key={WATCH!r})\ndash"])
            try:
                with open_notebook(browser, lab, name, viewport=(1480, 1040)) as nb:
                    page = nb.page
                    nb.app_eval("app.commands.execute('application:toggle-left-area')")
                    nb.run_all_cells()
                    nb.wait_cells_done(timeout=90)
                    dash = page.locator(".trio-dashboard")
                    dash.wait_for(state="visible", timeout=30_000)
                    assert url.split("//")[1] in dash.locator(".trio-title").inner_text()
                    text = _wait_status(page, "t => /sdk-proc[^\\n]*cycles?\\/update/.test(t) && "
                                              "/trio-proc[^\\n]*cycles?\\/update/.test(t)", 150)
                    assert re.search(r"updates (\d+)", text) and int(re.search(r"updates (\d+)", text)[1]) > 10
                    time.sleep(1.5)  # a few more ticks: the advisor (once a second) and more bars
                    pixels = {op: _pixels(dash, rgb) for op, rgb in
                              {"forward_backward": (0x25, 0x63, 0xEB), "optim_step": (0xF9, 0x73, 0x16)}.items()}
                    advisor = dash.locator(".trio-advisor").inner_text()
                    start = dash.locator("button", has_text=re.compile(r"^\s*Start\s*$"))
                    assert start.is_disabled()  # watching, not driving, and it says why
                    assert start.get_attribute("title").startswith("disabled: this dashboard only watches")
                    assert "disabled: this dashboard only watches" in dash.locator(".trio-why").inner_text()
                    # what is drawn (issue 34): ranges cover the data, frames drawn, the view moves on
                    rendered.show_whole(page)
                    first_plots = rendered.drawn(page, MAIN_PLOTS, name="remote-first")
                    page.wait_for_timeout(2500)  # a couple of dozen cycles at 0.1 s
                    rendered.check_moved_on(first_plots, rendered.plots(page, name="remote-later"))
                    shot = nb.screenshot("remote-dashboard", selector=".trio-dashboard")
                    print(f"status: {text!r}\nadvisor: {advisor!r}\npixels: {pixels}\nscreenshot: {shot}")
                    assert all(n > 40 for n in pixels.values()), pixels
                    assert "sdk-proc" in advisor and "trio-proc" in advisor, advisor
                    bad = nb.find_messages(*BOKEH_ERRORS)
                    assert not bad, "\n".join(bad)
                    assert not nb.page_errors, nb.page_errors
                    assert shot.exists() and shot.parent == ARTIFACTS
            finally:
                stop.write_text("stop")  # the clients' loops end by themselves
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert "Traceback" not in logs.get("server.log", ""), logs


def _pixels(out: Any, rgb: tuple[int, int, int], tol: int = 40) -> int:
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
