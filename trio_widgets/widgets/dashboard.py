"""Dashboard: a live view of a LocalPool, with controls, in one ipywidgets layout.

>>> pool = trio.LocalPool(min_cycle_s=0.05)
>>> dash = trio.Dashboard(pool)
>>> dash            # displays; press Start, or run your own loop on `pool`

How it updates (docs/architecture.md, "Widgets"):

* the pool's telemetry calls a `TelemetryFeed` on the clock thread, which appends to
  bounded deques and does nothing else;
* one asyncio task on the kernel's event loop (the loop the dashboard was built on)
  wakes at most `refresh_hz` (10) times a second, drains the deques, and makes every
  bokeh change of that tick inside one batch: one PATCH-DOC (three comm messages) per
  tick however many sources were streamed; HTML (status, advisor) is sent only when its
  text changed;
* widget callbacks (buttons, settings; they may run on a subshell thread with ipykernel 7)
  only append to a deque and `call_soon_threadsafe` the handler onto that loop, so all
  bokeh mutations, run starts and exports happen on one thread;
* `close()` — or the pool closing, or re-running the cell that built it — stops the task
  and unsubscribes.
"""

from __future__ import annotations

import asyncio
import html
import logging
import os
import threading
import time
from collections import deque
from typing import Any, cast

import ipywidgets as W
from bokeh.core.property.validation import validate

from .._notebook import CellRegistry
from ..advisor import Diagnosis, diagnose_telemetry
from ..client import default_pool
from ..engine import DEFAULT_MODEL, LocalPool
from ..loop import MODES, TrainingRun
from ..metrics import cycles_per_update, format_cycles, period_history
from ..ops import UPDATE_OPS
from ..trace import metrics_rows, write_chrome_trace, write_metrics_jsonl
from ._bokeh_setup import batched_bokeh_widget
from .controls import Controls
from .feed import TelemetryFeed
from .figures import CLIENT_COLORS, DashboardFigures
from .sweep import SweepLauncher, lr_multipliers

__all__ = ["Dashboard", "lr_multipliers"]  # lr_multipliers: the sweep's, kept importable from here

log = logging.getLogger(__name__)

_CELL_DASHBOARDS = CellRegistry()

_CSS = """<style>
.trio-dashboard { font-family: Inter, 'Segoe UI', Helvetica, Arial, sans-serif; background: #ffffff;
  border: 1px solid #e5e7eb; border-radius: 10px; padding: 10px 14px 12px 14px; box-sizing: border-box; }
.trio-dashboard .trio-title { font-size: 16px; font-weight: 650; color: #111827; letter-spacing: .01em; }
.trio-dashboard .trio-title .trio-sub { font-size: 12px; font-weight: 400; color: #6b7280; margin-left: 8px; }
.trio-dashboard .trio-status { font-size: 12.5px; color: #374151; line-height: 1.5; }
.trio-dashboard .trio-status b { color: #111827; font-variant-numeric: tabular-nums; }
.trio-dashboard .trio-pill { display: inline-block; padding: 0 8px; border-radius: 999px; font-size: 11px;
  font-weight: 600; text-transform: uppercase; letter-spacing: .04em; margin-right: 6px; }
.trio-dashboard .trio-pill.idle, .trio-dashboard .trio-pill.stopped { background: #f3f4f6; color: #4b5563; }
.trio-dashboard .trio-pill.running { background: #dcfce7; color: #166534; }
.trio-dashboard .trio-pill.starting, .trio-dashboard .trio-pill.watching { background: #e0f2fe; color: #075985; }
.trio-dashboard .trio-pill.paused { background: #fef3c7; color: #92400e; }
.trio-dashboard .trio-pill.closed, .trio-dashboard .trio-pill.error { background: #fee2e2; color: #991b1b; }
.trio-dashboard .trio-cpu { display: inline-block; margin-right: 12px; white-space: nowrap; }
.trio-dashboard .trio-dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%;
  margin-right: 5px; vertical-align: baseline; }
.trio-dashboard .trio-advisor { font-size: 12.5px; color: #1f2937; border-top: 1px solid #f1f5f9;
  padding-top: 6px; }
.trio-dashboard .trio-advisor .trio-adv-title { font-weight: 600; color: #111827; margin-bottom: 2px; }
.trio-dashboard .trio-adv-row { margin: 2px 0; }
.trio-dashboard .trio-badge { display: inline-block; min-width: 62px; text-align: center; padding: 0 6px;
  border-radius: 4px; font-size: 10.5px; font-weight: 600; margin: 0 6px; text-transform: uppercase; }
.trio-dashboard .trio-badge.ok { background: #dcfce7; color: #166534; }
.trio-dashboard .trio-badge.waste { background: #fee2e2; color: #991b1b; }
.trio-dashboard .trio-badge.wait { background: #f3f4f6; color: #6b7280; }
.trio-dashboard .trio-exports { font-size: 11.5px; color: #6b7280; }
.trio-dashboard .widget-label { color: #4b5563; }
</style>"""


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


class Dashboard(W.VBox):
    """Live cycle timeline, queue depth, loss curves, status, advisor and controls for a pool.

    The dashboard observes the pool: requests from any loop on it show up. Its Start
    button trains `runs` LoRA clients (a learning-rate sweep ×0.5/×1/×2 for 3 runs) on the
    built-in addition task with :func:`trio_widgets.loop.train`.

    Methods `start()`, `pause()`, `resume()`, `stop()` do what the buttons do, from any
    thread. Exports: `export_trace()`, `export_metrics()`, `save_html()`.
    """

    def __init__(self, pool: LocalPool | str | None = None, *, api_key: str | None = None, window: int = 24,
                 refresh_hz: float = 10.0,
                 max_clients: int = 8, base_model: str = DEFAULT_MODEL, rank: int = 8,
                 learning_rate: float = 3e-3, batch_size: int = 8, runs: int = 3, mode: str = "pipelined",
                 lookahead: int = 1, export_dir: str | os.PathLike = ".", title: str = "trio · live training"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if not (0 < refresh_hz <= 10):
            raise ValueError(f"refresh_hz must be in (0, 10], got {refresh_hz!r}")
        remote = None
        if isinstance(pool, str):  # a served pool's URL: its telemetry streams in (trio_widgets/http/remote.py)
            from ..http.remote import RemotePool

            try:
                remote = RemotePool(pool, api_key=api_key)
            except BaseException:
                # what close() reads when this half-built widget is dropped (ipywidgets' __del__ calls it)
                self._closed = True
                self._owned: list[W.Widget] = []
                raise
            pool = cast(LocalPool, remote)  # it has what the views read of a pool
        pool = pool if pool is not None else default_pool()
        t0 = time.perf_counter()
        figs = DashboardFigures(t0, window=window, max_clients=max_clients, width=680, loss_width=390)
        plot = batched_bokeh_widget(figs.layout)

        header = W.HTML(f"{_CSS}<div class='trio-title'>{html.escape(title)}"
                        f"<span class='trio-sub'>{html.escape(pool.name)} · min cycle "
                        f"{pool.min_cycle_s * 1e3:.0f} ms · {html.escape(pool.device.type)}</span></div>")
        status = W.HTML("<span class='trio-pill idle'>idle</span> cycle 0")
        status.add_class("trio-status")
        advisor = W.HTML("<div class='trio-advisor'><div class='trio-adv-title'>Advisor</div>"
                         "<i>waiting for training requests…</i></div>")
        settings: dict[str, Any] = {"mode": mode, "lookahead": lookahead, "lr": learning_rate,
                                    "batch_size": batch_size, "runs": runs, "log": False}
        controls = Controls(settings, max_clients, self._request)
        super().__init__(children=[header, status, controls.bar, plot, advisor, controls.exports])
        self.add_class("trio-dashboard")

        self.pool = pool
        self._remote = remote  # watched, not driven: Start trains in-process only
        self.controls = controls
        self.sweep = SweepLauncher(pool, base_model, rank, settings)
        self._settings = settings
        self._figs = figs
        self._bokeh = plot
        self._status = status
        self._advisor_w = advisor
        self._header = header
        self._owned = [header, status, *controls.widgets, plot, advisor]
        self.export_dir = os.fspath(export_dir)
        self.refresh_hz = float(refresh_hz)
        self._closed = False
        self._pool_closed = False
        self._error: str | None = None
        self._commands: deque[tuple[str, Any]] = deque(maxlen=256)
        self._update_cycles: dict[str, deque[int]] = {}
        self._rates: deque[tuple[float, int]] = deque(maxlen=64)
        self._diagnoses: dict[str, Diagnosis] = {}
        self._status_text = ""
        self._advisor_text = ""
        self._advised_at = float("-inf")
        self._expect_views = 0
        self._ready_seen = 0
        self._displayed_at: float | None = None
        self.ticks = 0
        self.tick_thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

        self._feed = TelemetryFeed(pool.telemetry)
        _CELL_DASHBOARDS.claim(self)  # the cell that built one before runs again: one live dashboard per cell
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # no loop (a script): call tick() yourself, or build it inside one
        else:
            self._task = self._loop.create_task(self._pump(), name="trio-dashboard")

    # -- public controls (any thread) -------------------------------------------------------
    def start(self) -> None:
        self._request("start")

    def pause(self) -> None:
        self._request("pause")

    def resume(self) -> None:
        self._request("resume")

    def stop(self) -> None:
        self._request("stop")

    def set(self, **settings: Any) -> None:
        """Change settings (mode, lookahead, lr, batch_size, runs, log) like the controls do."""
        for key, value in settings.items():
            if key not in self.controls.settings:
                raise KeyError(f"unknown setting {key!r}; one of {', '.join(self.controls.settings)}")
            self._request("setting", (key, value))

    @property
    def state(self) -> str:
        """The Start runs' state: idle, starting, running, pausing, paused, stopped, error; or closed;
        "watching" for a served pool's dashboard (it has no Start runs)."""
        if self._pool_closed:
            return "closed"
        return "watching" if self._remote is not None else self.sweep.state

    @property
    def runs(self) -> list[TrainingRun]:
        """The runs of the last Start."""
        return self.sweep.runs

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def diagnoses(self) -> dict[str, Diagnosis]:
        return dict(self._diagnoses)

    @property
    def status_text(self) -> str:
        return self._status.value

    @property
    def figures(self) -> DashboardFigures:
        return self._figs

    @property
    def bokeh_widget(self) -> W.DOMWidget:
        return self._bokeh

    # -- commands: any thread in, loop thread out ---------------------------------------------
    def _request(self, command: str, arg: Any = None) -> None:
        if self._closed:
            return
        self._commands.append((command, arg))
        loop = self._loop
        if loop is None:
            if threading.current_thread() is threading.main_thread():
                self._process_commands()
            return
        try:
            loop.call_soon_threadsafe(self._process_commands)
        except RuntimeError:  # loop closed
            pass

    def _process_commands(self) -> None:
        while self._commands:
            try:
                command, arg = self._commands.popleft()
            except IndexError:
                return
            try:
                self._handle(command, arg)
            except Exception as exc:
                log.exception("dashboard command %s failed", command)
                self._error = f"{command}: {exc}"

    def _handle(self, command: str, arg: Any) -> None:
        if command == "start":
            if self._pool_closed:
                return
            if self._loop is None:
                raise RuntimeError("Start needs a running event loop: build the Dashboard in a notebook cell")
            self.sweep.start(self._loop)
        elif command in ("pause", "resume", "stop"):
            self.sweep.control(command)
        elif command == "setting":
            key, value = arg
            self._settings[key] = value
            self.sweep.apply(key, value)
            self.controls.show(key, value)
        elif command == "export":
            what = {"trace": self.export_trace, "metrics": self.export_metrics, "html": self.save_html}[arg]
            path = what()
            size = os.path.getsize(path)
            self.controls.note(f"wrote <code>{html.escape(path)}</code> ({_si(size)}B)")

    # -- the periodic task -------------------------------------------------------------------------
    async def _pump(self) -> None:
        interval = 1.0 / self.refresh_hz
        try:
            while not self._closed:
                await asyncio.sleep(interval)
                if self._closed:
                    break
                try:
                    self.tick()
                except Exception:
                    log.exception("dashboard tick failed")
                if self.pool.closed:
                    self._on_pool_closed()
                    break
        except asyncio.CancelledError:
            pass

    def tick(self) -> None:
        """One update: drain the feed, stream into the figures (one batched message),
        refresh status / advisor text if it changed. Runs on the dashboard's loop thread."""
        self.tick_thread = threading.current_thread()
        self.ticks += 1
        clients, cycles, boundaries, delivered = self._feed.drain()
        self._sync_views()
        with self._bokeh.batch(), validate(False):  # rows we build are well-formed: skip bokeh's checks
            for info in clients:
                self._figs.add_client(info)
            self._figs.set_log_scale(bool(self._settings["log"]))
            self._figs.update(cycles, boundaries, delivered)
        for r in delivered:
            if r.op in UPDATE_OPS and r.cycle is not None and r.status == "ok":
                self._update_cycles.setdefault(r.client_id, period_history()).append(r.cycle)
        for info in self._feed.drain_retired():
            self._update_cycles.pop(info.client_id, None)
        now = time.perf_counter()
        self._rates.append((now, self.pool.telemetry.total_tokens))
        if now - self._advised_at >= 1.0:  # the advisor reads whole buffers: once a second
            self._advised_at = now
            self._update_advisor()
        self._update_status()
        self._update_buttons()

    def _sync_views(self) -> None:
        """After a display, send nothing until the new view has rendered, then resend the
        whole document once (see `batched_bokeh_widget`)."""
        bk = self._bokeh
        ready = bk.views_ready
        if ready != self._ready_seen:
            new, self._ready_seen = ready - self._ready_seen, ready
            if self._expect_views > 0:  # a view we displayed has rendered (others: re-renders)
                self._expect_views = max(0, self._expect_views - new)
                if bk.stale:
                    bk.resync()
                bk.live = True
        if not bk.live and self._displayed_at is not None and time.perf_counter() - self._displayed_at > 3.0:
            bk.live = True  # no view said it rendered (no browser, e.g. nbclient): send anyway

    def _tokens_per_s(self) -> float:
        if len(self._rates) < 2:
            return 0.0
        now, tokens = self._rates[-1]
        for t, n in self._rates:
            if now - t <= 3.0:
                return (tokens - n) / (now - t) if now > t else 0.0
        return 0.0

    def _update_status(self) -> None:
        t = self.pool.telemetry
        state = self.state
        parts = [f"<span class='trio-pill {state if state != 'pausing' else 'paused'}'>{state}</span>"
                 f"cycle <b>{self.pool.cycle_index}</b> · updates <b>{t.total_updates}</b> · "
                 f"<b>{_si(self._tokens_per_s())}</b> tokens/s"]
        per_client = []
        for cid, views in self._figs.clients.items():
            p = cycles_per_update(self._update_cycles.get(cid, ()))
            if p is None:
                continue
            per_client.append(f"<span class='trio-cpu'><span class='trio-dot' style='background:{views.color}'>"
                              f"</span>{html.escape(views.label)}: <b>{format_cycles(p)}</b> "
                              f"{'cycle' if format_cycles(p) == '1' else 'cycles'}/update</span>")
        if per_client:
            parts.append("<br>" + "".join(per_client))
        for error in (self._error, self.sweep.error):
            if error:
                parts.append(f"<br><span style='color:#991b1b'>{html.escape(error)}</span>")
        for run in self.runs:
            if run.error is not None:
                parts.append(f"<br><span style='color:#991b1b'>{html.escape(str(run.name))}: "
                             f"{html.escape(str(run.error))}</span>")
        text = "".join(parts)
        if text != self._status_text:
            self._status_text = text
            self._status.value = text

    def _update_advisor(self) -> None:
        self._diagnoses = diagnose_telemetry(self.pool.telemetry, self.pool.min_cycle_s or None)
        rows = []
        for cid, d in self._diagnoses.items():
            views = self._figs.clients.get(cid)
            color = views.color if views is not None else CLIENT_COLORS[-1]
            label = views.label if views is not None else d.label
            badge = ("ok", "pipelined") if d.cause == "pipelined" else (
                ("wait", "measuring") if d.cause == "warming-up" else ("waste", d.cause))
            rows.append(f"<div class='trio-adv-row'><span class='trio-dot' style='background:{color}'></span>"
                        f"<b>{html.escape(label)}</b><span class='trio-badge {badge[0]}'>{badge[1]}</span>"
                        f"{html.escape(d.message)}</div>")
        body = "".join(rows) or "<i>waiting for training requests…</i>"
        text = f"<div class='trio-advisor'><div class='trio-adv-title'>Advisor</div>{body}</div>"
        if text != self._advisor_text:
            self._advisor_text = text
            self._advisor_w.value = text

    def _update_buttons(self) -> None:
        self.controls.enable(self.state)  # ("watching" enables none)

    # -- display: hold patches until the new view has rendered ----------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any):
        self._expect_views += 1
        self._displayed_at = time.perf_counter()
        self._bokeh.live = False
        return super()._repr_mimebundle_(**kwargs)

    # -- exports -------------------------------------------------------------------------------------
    def _path(self, path: str | os.PathLike | None, default: str) -> str:
        return os.fspath(path) if path is not None else os.path.join(self.export_dir, default)

    def export_trace(self, path: str | os.PathLike | None = None) -> str:
        """Chrome / Perfetto trace JSON of what the pool's buffers hold (open in ui.perfetto.dev)."""
        return write_chrome_trace(self.pool.telemetry, self._path(path, "trio-trace.json"), name=self.pool.name)

    def export_metrics(self, path: str | os.PathLike | None = None) -> str:
        """metrics.jsonl: the Start runs' per-step metrics, plus telemetry rows for other clients."""
        rows = [{"run": run.name, **row} for run in self.runs for row in list(run.metrics)]
        mine = {run.client.client_id for run in self.runs}
        rows += [row for row in metrics_rows(self.pool.telemetry) if row["client_id"] not in mine]
        return write_metrics_jsonl(rows, self._path(path, "metrics.jsonl"))

    def save_html(self, path: str | os.PathLike | None = None) -> str:
        """A standalone HTML snapshot (BokehJS inline: opens offline) of the figures and text."""
        from bokeh.embed import file_html
        from bokeh.resources import INLINE

        page = file_html(self._figs.layout, INLINE, title="trio dashboard snapshot")
        head = (f"<div class='trio-dashboard' style='margin:8px'>{self._header.value}"
                f"<div class='trio-status'>{self._status.value}</div>{self._advisor_w.value}</div>")
        before, tag, after = page.rpartition("<body>")  # the last one: BokehJS's source has "<body>" too
        page = before + tag + "\n" + head + after
        path = self._path(path, "trio-dashboard.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
        return path

    # -- lifecycle --------------------------------------------------------------------------------------
    def _on_pool_closed(self) -> None:
        self._pool_closed = True
        self._feed.close()
        self._update_status()
        self._update_buttons()

    def _shutdown(self) -> None:
        self._closed = True
        self._feed.close()
        if self._remote is not None:
            self._remote.close()
        self.sweep.close(timeout=10.0)
        task, loop = self._task, self._loop
        if task is not None and not task.done() and loop is not None and not loop.is_closed():
            try:
                if asyncio.get_running_loop() is loop:
                    task.cancel()
                else:
                    loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        """Stop the periodic task, unsubscribe from the pool, stop the Start runs, close the widgets."""
        if not self._closed:
            self._shutdown()
        owned, self._owned = self._owned, []
        for w in owned:
            w.close()
        super().close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def widgets(self) -> list[W.Widget]:
        """Every widget the dashboard built (and closes with it)."""
        return list(self._owned)

    @property
    def subscribed(self) -> bool:
        return self._feed.subscribed
