"""Real-browser harness: a private JupyterLab server plus headless Chromium.

Not a test module.  Typical use::

    with jupyter_lab(comms_over_subshells="disabled") as lab, chromium() as browser:
        with open_notebook(browser, lab, "nb.ipynb") as nb:
            nb.run_all_cells()
            nb.wait_cells_done()
            nb.screenshot("after-run")

Findings this harness is built on (JupyterLab 4.6, ipykernel 7.4,
jupyterlab_widgets 3.0 / @jupyter-widgets/jupyterlab-manager 5.0,
jupyter_bokeh 4.1):

* Isolation: JUPYTER_CONFIG_DIR, JUPYTER_DATA_DIR, JUPYTER_RUNTIME_DIR,
  IPYTHONDIR, JUPYTERLAB_SETTINGS_DIR, JUPYTERLAB_WORKSPACES_DIR and HOME point
  into a private temp dir, so ~/.jupyter, ~/.ipython and user lab settings
  do not leak in.  Only the *user* level is replaced: the venv's
  ``etc/jupyter`` (server-extension enablement) and ``share/jupyter``
  (labextensions: @jupyter-widgets/jupyterlab-manager, @bokeh/jupyter_bokeh;
  the ``python3`` kernelspec, whose ``python`` argv jupyter_client maps to
  the server's own interpreter) are still found via sys.prefix.
* Kernel comms over subshells is a *frontend* setting, not a widgets one:
  plugin ``@jupyterlab/apputils-extension:kernels-settings``, key
  ``commsOverSubshells``, values ``"disabled"``, ``"perComm"``,
  ``"perCommTarget"`` (default: ``"perCommTarget"``, i.e. ON by default in
  JupyterLab 4.6 when the kernel advertises ``kernel subshells``, which
  ipykernel 7 does).  The plugin ``...:subshell-settings`` copies it into
  ``app.serviceManager.kernels.commsOverSubshells``.  When on, the frontend
  creates one subshell per comm target (``jupyter.widget``) and widget
  comm messages (e.g. a Button click) carry that ``subshell_id`` in their
  header.  But ipykernel 7.4 re-routes an incoming ``comm_msg`` to the
  subshell that *last published* on that comm (``BaseComm._reply_subshell_for``
  in ipykernel/comm/comm.py); widgets created and updated from a cell on the
  main shell therefore still get their click handlers run on MainThread.
  Handlers must work on either thread.  We set the setting either at start
  (``overrides.json`` in a private ``--LabApp.app_settings_dir``) or live with
  :meth:`LabServer.set_setting` (REST ``PUT /lab/api/settings/<plugin>``,
  user level, takes effect for pages opened afterwards).
* ``--LabApp.expose_app_in_browser=True`` exposes ``window.jupyterapp`` so a
  test can read state such as the effective ``commsOverSubshells``.
* News/update checks are turned off in overrides (no internet here), the
  extension manager is ``readonly`` (no PyPI), and ``--allow-root`` is added
  when running as root (else: "Running as root is not recommended. Use
  --allow-root to bypass." and exit 1).
* Run > Run All Cells is the lumino item ``data-command="runmenu:run-all"``
  (not ``notebook:run-all-cells``); we match it by its label.
* Kernels are started in their own session (jupyter_client uses
  ``start_new_session``), so killing the server's process group is not
  enough: on exit we delete kernels over REST, ``POST /api/shutdown``, then
  terminate any psutil descendants that remain.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

KERNELS_SETTINGS = "@jupyterlab/apputils-extension:kernels-settings"
SUBSHELLS_ON = "perCommTarget"
SUBSHELLS_OFF = "disabled"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python() -> str:
    exe = VENV / "bin" / "python"
    return str(exe) if exe.exists() else sys.executable


@dataclass
class LabServer:
    url: str  # base URL ending in "/"
    token: str
    port: int
    root_dir: Path
    private_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]

    # -- REST -------------------------------------------------------------
    def api(self, method: str, path: str, body: Any | None = None, timeout: float = 10) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data, method=method)
        req.add_header("Authorization", f"token {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def set_setting(self, plugin_id: str, values: dict[str, Any]) -> None:
        """Write user-level settings for a lab plugin (pages opened later see them)."""
        self.api("PUT", f"lab/api/settings/{plugin_id}", {"raw": json.dumps(values)})

    def set_comms_over_subshells(self, mode: str) -> None:
        self.set_setting(KERNELS_SETTINGS, {"commsOverSubshells": mode})

    def kernels(self) -> list[dict[str, Any]]:
        return list(self.api("GET", "api/kernels"))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def lab_url(self, notebook: str, workspace: str | None = None) -> str:
        ws = workspace or f"ws-{secrets.token_hex(6)}"
        return f"{self.url}lab/workspaces/{ws}/tree/{notebook}?reset&token={self.token}"


def _private_env(private: Path, extra_env: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    dirs = {
        "HOME": private / "home",
        "JUPYTER_CONFIG_DIR": private / "config",
        "JUPYTER_DATA_DIR": private / "data",
        "JUPYTER_RUNTIME_DIR": private / "runtime",
        "IPYTHONDIR": private / "ipython",
        "JUPYTERLAB_SETTINGS_DIR": private / "user-settings",
        "JUPYTERLAB_WORKSPACES_DIR": private / "workspaces",
        "MPLCONFIGDIR": private / "mpl",
    }
    for key, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[key] = str(path)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["JUPYTER_PREFER_ENV_PATH"] = "1"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    if extra_env:
        env.update(extra_env)
    return env


def _wait_ready(server: LabServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {server.proc.returncode}:\n{server.log_text()[-4000:]}")
        try:
            server.api("GET", "api/status", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.25)
    raise TimeoutError(f"jupyter lab not ready after {timeout}s:\n{server.log_text()[-4000:]}")


def _stop(server: LabServer, grace: float = 10) -> None:
    try:
        tracked = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tracked = []
    if server.proc.poll() is None:
        with contextlib.suppress(Exception):
            for k in server.kernels():
                server.api("DELETE", f"api/kernels/{k['id']}", timeout=grace)
        with contextlib.suppress(Exception):
            server.api("POST", "api/shutdown", timeout=grace)
        try:
            server.proc.wait(grace)
        except subprocess.TimeoutExpired:
            server.proc.terminate()
            try:
                server.proc.wait(5)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(5)
    alive = [p for p in tracked if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, still = psutil.wait_procs(alive, timeout=5)
    for p in still:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@contextlib.contextmanager
def jupyter_lab(
    root_dir: str | Path | None = None,
    *,
    comms_over_subshells: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    startup_timeout: float = 60,
) -> Iterator[LabServer]:
    """Run a private ``jupyter lab`` on 127.0.0.1; stop it and its kernels on exit.

    ``comms_over_subshells``: None (JupyterLab default, which is on),
    ``SUBSHELLS_ON``/``"perComm"`` or ``SUBSHELLS_OFF``; written as an
    app-level default in ``overrides.json``.
    """
    private = Path(tempfile.mkdtemp(prefix="trio-lab-"))
    root = Path(root_dir) if root_dir is not None else private / "root"
    root.mkdir(parents=True, exist_ok=True)
    app_settings = private / "app-settings"
    app_settings.mkdir()
    ov: dict[str, dict[str, Any]] = {
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    }
    if comms_over_subshells is not None:
        ov[KERNELS_SETTINGS] = {"commsOverSubshells": comms_over_subshells}
    for plugin, values in (overrides or {}).items():
        ov.setdefault(plugin, {}).update(values)
    (app_settings / "overrides.json").write_text(json.dumps(ov, indent=1))

    port, token = free_port(), secrets.token_hex(24)
    cmd = [
        _python(), "-m", "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.terminals_enabled=False",
        f"--LabApp.app_settings_dir={app_settings}",
        f"--LabApp.user_settings_dir={private / 'user-settings'}",
        f"--LabApp.workspaces_dir={private / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",  # no PyPI queries
        *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
        *extra_args,
    ]
    env = _private_env(private, extra_env)
    log_path = private / "jupyter-lab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = LabServer(f"http://127.0.0.1:{port}/", token, port, root, private, log_path, proc)
    try:
        _wait_ready(server, startup_timeout)
        yield server
    finally:
        _stop(server)
        shutil.rmtree(private, ignore_errors=True)


# ---------------------------------------------------------------- browser


@contextlib.contextmanager
def chromium(headless: bool = True, extra_args: Sequence[str] = ()) -> Iterator[Any]:
    """Playwright's Chromium driver with Debian's /usr/bin/chromium binary."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=headless, args=[*CHROMIUM_ARGS, *extra_args]
        )
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class LabPage:
    page: Any  # playwright.sync_api.Page
    lab: LabServer
    notebook: str
    console: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    #: bokeh PATCH-DOC messages the page received over the kernel websocket (one per dashboard tick)
    patches_received: int = 0
    #: comm messages (any widget's) the page received over the kernel websocket
    comm_received: int = 0
    #: kernel messages the page received, by type
    received: collections.Counter[str] = field(default_factory=collections.Counter)
    #: set to a list to keep the text of each comm message received (for a test to read)
    comm_log: list[str] | None = None
    #: kernel messages that report a comm error (e.g. the kernel's "No such comm" warnings,
    #: which JupyterLab shows in red in its log console)
    comm_errors: list[str] = field(default_factory=list)
    #: ids of the comms JupyterLab's widget manager opens to probe a new kernel for widgets
    #: ("jupyter.widget.control"): before ipywidgets is imported the kernel answers "No such
    #: comm" to those, in any notebook. Not the dashboard's doing: see `own_comm_errors`.
    probe_comms: set[str] = field(default_factory=set)
    #: comm id -> the start of the last comm message the page sent to it (to say who sent late)
    last_sent: dict[str, str] = field(default_factory=dict)

    def own_comm_errors(self) -> list[str]:
        """Comm errors other than the widget manager's probe of a kernel without ipywidgets,
        each with what the page last sent to that comm."""
        return [f"{e} (the page last sent it: {self.last_sent.get(e.rsplit(' ', 1)[-1], '?')})"
                for e in self.comm_errors if "jupyter.widget.control" not in e
                and not any(c in e for c in self.probe_comms)]

    def messages(self) -> list[str]:
        return [*self.console, *(f"pageerror: {e}" for e in self.page_errors)]

    def find_messages(self, *patterns: str) -> list[str]:
        rx = re.compile("|".join(patterns), re.IGNORECASE)
        return [m for m in self.messages() if rx.search(m)]

    def wait_kernel_idle(self, timeout: float = 60) -> None:
        """Kernel started, connected and idle (via window.jupyterapp, else the toolbar)."""
        self.page.wait_for_function(
            """() => {
                const app = window.jupyterapp;
                if (app && app.shell) {
                    const w = app.shell.currentWidget;
                    const k = w && w.sessionContext && w.sessionContext.session
                        && w.sessionContext.session.kernel;
                    return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
                }
                return !!document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                    + '.jp-Notebook-ExecutionIndicator[data-status="idle"]');
            }""",
            timeout=timeout * 1000,
        )

    def run_all_cells(self) -> None:
        """Run > Run All Cells, through the menu bar like a user."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        label = self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$"))
        self.page.locator(".lm-Menu-item").filter(has=label).click()  # data-command="runmenu:run-all"

    def wait_cells_done(self, timeout: float = 60, *, min_count: int = 1) -> None:
        """Every code cell shows an execution count (none pending: ``[*]``/``[ ]``),
        and the highest one is at least ``min_count`` (use it when re-running)."""
        self.page.wait_for_function(
            """(minCount) => {
                const ps = [...document.querySelectorAll(
                    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')];
                const ns = ps.map(p => (p.textContent.match(/\\[(\\d+)\\]/) || [])[1]);
                return ns.length > 0 && ns.every(n => n !== undefined)
                    && Math.max(...ns.map(Number)) >= minCount;
            }""",
            arg=min_count,
            timeout=timeout * 1000,
        )

    def add_cell(self, code: str) -> str:
        """Append a code cell holding `code` (not run), make it the active cell; its model id."""
        return str(self.page.evaluate(
            """(code) => {
                const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = nb.widgets.length - 1;
                nb.mode = 'command';
                return window.jupyterapp.commands.execute('notebook:insert-cell-below').then(() => {
                    nb.activeCell.model.sharedModel.setSource(code);
                    nb.mode = 'command';
                    nb.node.focus();  // keys go to the notebook, as after a click on the cell
                    return nb.activeCell.model.id;
                });
            }""",
            code,
        ))

    def cell_outputs(self, cell_id: str) -> str:
        """The text of a cell's outputs (stream text, text/plain and error lines), joined."""
        return str(self.page.evaluate(
            """(id) => {
                const nb = window.jupyterapp.shell.currentWidget.content;
                const cell = nb.widgets.find(w => w.model.id === id);
                if (!cell) return '';
                return cell.model.outputs.toJSON().map(o => {
                    if (o.output_type === 'stream') return [].concat(o.text).join('');
                    if (o.output_type === 'error') return o.ename + ': ' + o.evalue;
                    const d = o.data || {};
                    return [].concat(d['text/plain'] || '').join('');
                }).join('\\n');
            }""",
            cell_id,
        ))

    def cell_text(self, index: int) -> str:
        """The output text of the notebook's `index`-th cell."""
        cell_id = self.page.evaluate(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].model.id", index)
        return self.cell_outputs(str(cell_id))

    def run_cell(self, code: str, *, timeout: float = 60, until: str | None = None) -> tuple[str, float]:
        """Append a cell, run it as a user does (Ctrl+Enter on the selected cell) and wait until
        it has run (and, with `until`, its output matches that regex); (output text, seconds
        from the key press until the page showed the result)."""
        cell_id = self.add_cell(code)
        t0 = time.perf_counter()
        self.page.keyboard.press("Control+Enter")
        self.page.wait_for_function(
            """([id, pattern]) => {
                const nb = window.jupyterapp.shell.currentWidget.content;
                const cell = nb.widgets.find(w => w.model.id === id);
                if (!cell || cell.model.executionCount === null) return false;
                if (!pattern) return true;
                const text = cell.model.outputs.toJSON().map(o => [].concat(o.text || (o.data || {})['text/plain']
                    || (o.ename ? o.ename + ': ' + o.evalue : '')).join('')).join('\\n');
                return new RegExp(pattern).test(text);
            }""",
            arg=[cell_id, until],
            timeout=timeout * 1000,
        )
        seconds = time.perf_counter() - t0
        return self.cell_outputs(cell_id), seconds

    def rerun_cell(self, cell: int | str) -> None:
        """Select a cell (its index, or its model id from `add_cell`) and run it again
        (Ctrl+Enter), as a user does."""
        self.page.evaluate(
            """(cell) => {
                const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = typeof cell === 'number' ? cell : nb.widgets.findIndex(w => w.model.id === cell);
                nb.mode = 'command';
                nb.node.focus();
            }""",
            cell,
        )
        self.page.keyboard.press("Control+Enter")

    def cell_prompt(self, index: int) -> str:
        """The `index`-th cell's prompt: "[*]:" while it runs (or waits), "[7]:" once it ran."""
        return str(self.page.evaluate(
            """(i) => {
                const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
                const p = cell.node.querySelector('.jp-InputArea-prompt');
                return p ? p.textContent : '';
            }""",
            index,
        ))

    def app_eval(self, expression: str) -> Any:
        """Evaluate JS with ``app`` bound to ``window.jupyterapp``."""
        return self.page.evaluate(f"() => {{ const app = window.jupyterapp; return ({expression}); }}")

    def comms_over_subshells(self) -> str:
        return str(self.app_eval("app.serviceManager.kernels.commsOverSubshells"))

    def screenshot(self, name: str, *, selector: str | None = None) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        if selector:
            # an element taller than the viewport comes out cut and overlaid by JupyterLab's bars:
            # make the window tall enough for all of it (same width: the layout does not change)
            element = self.page.locator(selector).first
            size = self.page.viewport_size
            height = int(element.evaluate("(el) => el.getBoundingClientRect().height"))
            grow = size is not None and height + 250 > size["height"]
            if grow:
                self.page.set_viewport_size({"width": size["width"], "height": height + 250})
                time.sleep(1.0)  # bokeh lays out again after a resize
            try:
                element.scroll_into_view_if_needed()
                element.screenshot(path=str(path))
            finally:
                if grow:
                    self.page.set_viewport_size(size)
        else:
            self.page.screenshot(path=str(path), full_page=False)
        return path


@contextlib.contextmanager
def open_notebook(
    browser: Any,
    lab: LabServer,
    notebook: str,
    *,
    viewport: tuple[int, int] = (1280, 900),
    timeout: float = 90,
    shutdown_kernel: bool = True,
) -> Iterator[LabPage]:
    """Open ``notebook`` (path relative to root_dir) in a fresh workspace, kernel idle.

    On exit the browser context is closed and (by default) the notebook's
    session and kernel are deleted, so background tasks stop using the CPU."""
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    page = context.new_page()
    page.set_default_timeout(timeout * 1000)
    lp = LabPage(page, lab, notebook)
    page.on("console", lambda m: lp.console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: lp.page_errors.append(str(e)))

    def on_frame(payload: str | bytes) -> None:
        # the header part of a bokeh patch names its type; it is one websocket frame per comm message
        text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
        if "PATCH-DOC" in text:
            lp.patches_received += 1
        kind = _MSG_TYPE.search(text, 0, 4096)  # the first is the header's (later: its parent's)
        if kind is not None:
            lp.received[kind.group(1)] += 1
        if kind is not None and kind.group(1) == "comm_msg":
            lp.comm_received += 1
            if lp.comm_log is not None:
                lp.comm_log.append(text)
        for m in re.finditer(r"No such comm[^\\\"]*|Cannot send[^\\\"]*", text):
            lp.comm_errors.append(m.group(0))

    def on_sent(payload: str | bytes) -> None:
        text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
        if "jupyter.widget.control" in text:
            lp.probe_comms.update(re.findall(r'"comm_id":\s*"([^"]+)"', text))
        for comm_id in re.findall(r'"comm_id":\s*"([^"]+)"', text)[:1]:
            lp.last_sent.pop(comm_id, None)
            lp.last_sent[comm_id] = text[:600]
            while len(lp.last_sent) > 256:
                del lp.last_sent[next(iter(lp.last_sent))]

    def on_ws(ws: Any) -> None:
        ws.on("framereceived", on_frame)
        ws.on("framesent", on_sent)

    page.on("websocket", on_ws)
    try:
        page.goto(lab.lab_url(notebook), wait_until="domcontentloaded")
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout * 1000)
        lp.wait_kernel_idle(timeout)
        yield lp
    finally:
        with contextlib.suppress(Exception):
            context.close()
        if shutdown_kernel:
            with contextlib.suppress(Exception):
                for sess in lab.api("GET", "api/sessions"):
                    if sess.get("path") == notebook:
                        lab.api("DELETE", f"api/sessions/{sess['id']}", timeout=15)


_MSG_TYPE = re.compile(r'"msg_type":\s*"([a-z_]+)"')

#: Makes the page's Page Visibility API say `hidden` (True) or `visible` again, with the
#: visibilitychange event. Headless Chromium keeps every tab visible (another tab in front or a
#: minimized window change nothing), so this is how a test hides one; the page still renders
#: as if seen, so what it costs meanwhile is an upper bound of a really hidden tab's.
EMULATE_HIDDEN_JS = """(hidden) => {
    Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => hidden ? 'hidden' : 'visible'});
    Object.defineProperty(document, 'hidden', {configurable: true, get: () => hidden});
    document.dispatchEvent(new Event('visibilitychange'));
}"""


def write_notebook(path: Path, cells: Sequence[str]) -> None:
    """A python3 notebook with these code cells, for a test to open."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)


# Console messages that mean BokehJS or a bokeh view failed in the page.
BOKEH_ERRORS = (
    r"Could not create a view",
    r"Could not create child view",
    r"BokehJS (does not appear to have successfully loaded|failed to load)",
    r"Bokeh is not defined",
    r"reading 'require'",
    r"Failed to load resource.*bokeh",
)


@contextlib.contextmanager
def process(args: list[str], log: Path, env: dict[str, str], grace: float = 0.0) -> Iterator[subprocess.Popen]:
    """A process that is stopped on exit: after `grace` seconds to end by itself, SIGTERM, then SIGKILL."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        yield proc
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
