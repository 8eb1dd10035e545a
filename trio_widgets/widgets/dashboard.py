"""Dashboard: a live view of a LocalPool, with controls, in one ipywidgets layout.

>>> dash = trio.Dashboard()   # shows the newest pool, and the next one when it is replaced
>>> dash = trio.Dashboard(pool)   # or this pool (and what replaces it if its cell runs again)

How it updates (docs/architecture.md, "Widgets"):

* the pool's telemetry calls a `TelemetryFeed` on the clock thread, which appends to
  bounded deques and does nothing else;
* the dashboard runs its own thread ("trio-dashboard-N") with an asyncio loop: one task
  wakes `refresh_hz` times a second (5 by default, 10 at most: a tick that draws repaints the
  timeline and queue plots in the page; buttons do not wait for it), drains the deques and
  makes every bokeh change of that tick inside one batch (one PATCH-DOC, three comm messages,
  however many sources were streamed); HTML (status, advisor) is sent only when its text
  changed. Its own thread, so that it stays live while a cell blocks the kernel;
* the page is sent nothing when nothing it shows changed: an idle pool's empty cycles are drawn
  for a second, then held until something happens (the timeline and its cycle count stand
  still); while no view can be seen (tab hidden, output scrolled away: the page says so, see
  `_bokeh_setup.VISIBILITY_JS`) the figures follow the pool here and the page gets one
  catch-up when a view can be seen again;
* widget callbacks (buttons, settings; they may run on a subshell thread with ipykernel 7)
  only append to a deque and wake that loop, so all bokeh mutations, run starts and
  exports happen on the dashboard's thread; the Start runs train on its loop too;
* `close()` — or re-running the cell that built it — stops the runs it started (what they
  submitted is recorded), stops the thread, leaves a static snapshot where it was shown, and
  closes its widgets (the output first, then the widgets, so the page never talks to a
  closed one). A dashboard whose kernel went away says so in the page (CSS on the
  frontend's "disconnected" class).
"""

from __future__ import annotations

import asyncio
import html
import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any, cast

import ipywidgets as W
from bokeh.core.property.validation import validate

from .. import pools
from .._notebook import CellRegistry
from ..advisor import Diagnosis, diagnose_telemetry
from ..connect import DEFAULT_MODEL
from ..futures import WaitInterrupted, on_wait_interrupted
from ..loop import MODES, TrainingRun, run_endings
from ..metrics import cycles_per_update, format_cycles, period_history
from ..ops import OPS, UPDATE_OPS
from ..trace import metrics_rows, write_chrome_trace, write_metrics_jsonl
from ._bokeh_setup import batched_bokeh_widget
from ._comms import closing
from .controls import INT_RANGES, Controls, check_setting
from .feed import TelemetryFeed
from .figures import CLIENT_COLORS, DashboardFigures
from .room import RoomTable
from .sweep import SweepLauncher, lr_multipliers

if TYPE_CHECKING:  # the dashboard drives in-process pools; it reads any pool as pools.PoolView
    from ..engine import LocalPool
    from ..watch import WatchedDiagnosis

__all__ = ["Dashboard", "lr_multipliers"]  # lr_multipliers: the sweep's, kept importable from here

log = logging.getLogger(__name__)

_CELL_DASHBOARDS = CellRegistry()
_DASHBOARD_IDS = itertools.count(1)
#: seconds an update (or any request) counts as recent for the pool's state pill
_ACTIVE_S = 2.0
#: the status and advisor text change at most this often (each change restyles the whole notebook
#: page), unless the pill or a notice changed
_TEXT_EVERY_S = 1.0
#: an idle stretch (empty cycles, nothing queued or delivered) is drawn for this long, then the
#: timeline stands still until something happens: an idle pool sends the page nothing
_IDLE_DRAWN_S = 1.0
#: a room with more live participants than this is summed up in the status and advisor lines
#: (one row each is in the room table)
ROOM_INLINE = 6
#: such a room's figures are redrawn at most this often: a room of 40 cost the page ~0.18 s/s
#: at the default 5 Hz and ~0.15 s/s at 2 Hz (benchmarks/browser_cost.py --room 40), its bound
ROOM_TICK_S = 1.0

_CSS = """<style>
.trio-dashboard { font-family: Inter, 'Segoe UI', Helvetica, Arial, sans-serif; background: #ffffff;
  border: 1px solid #e5e7eb; border-radius: 10px; padding: 8px 12px 10px 12px; box-sizing: border-box;
  max-width: 100%; min-width: 0; }
.trio-dashboard .trio-title { font-size: 15px; font-weight: 650; color: #111827; letter-spacing: .01em; }
.trio-dashboard .trio-title .trio-sub { font-size: 12px; font-weight: 400; color: #6b7280; margin-left: 8px; }
.trio-dashboard .trio-status { font-size: 12.5px; color: #374151; line-height: 1.55; }
.trio-dashboard .trio-status b { color: #111827; font-variant-numeric: tabular-nums; }
.trio-dashboard .trio-pill { display: inline-block; padding: 0 8px; border-radius: 999px; font-size: 11px;
  font-weight: 600; text-transform: uppercase; letter-spacing: .04em; margin-right: 6px; }
.trio-dashboard .trio-pill.idle, .trio-dashboard .trio-pill.waiting { background: #f3f4f6; color: #4b5563; }
.trio-dashboard .trio-pill.training { background: #dcfce7; color: #166534; }
.trio-dashboard .trio-pill.sampling { background: #e0f2fe; color: #075985; }
.trio-dashboard .trio-pill.paused { background: #fef3c7; color: #92400e; }
.trio-dashboard .trio-pill.closed { background: #fee2e2; color: #991b1b; }
.trio-dashboard .trio-pill.snapshot { background: #e5e7eb; color: #374151; }
.trio-dashboard .trio-runs { color: #4b5563; margin-left: 6px; }
.trio-dashboard .trio-cpu { display: inline-block; margin-right: 12px; white-space: nowrap; }
.trio-dashboard .trio-dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%;
  margin-right: 5px; vertical-align: baseline; }
.trio-dashboard .trio-notice { color: #92400e; }
.trio-dashboard .trio-notice.bad { color: #991b1b; }
.trio-dashboard .trio-advisor { font-size: 12.5px; color: #1f2937; border-top: 1px solid #f1f5f9;
  padding-top: 6px; }
.trio-dashboard .trio-advisor .trio-adv-title { font-weight: 600; color: #111827; margin-bottom: 2px; }
.trio-dashboard .trio-adv-row { margin: 2px 0; }
.trio-dashboard .trio-badge { display: inline-block; min-width: 62px; text-align: center; padding: 0 6px;
  border-radius: 4px; font-size: 10.5px; font-weight: 600; margin: 0 6px; text-transform: uppercase; }
.trio-dashboard .trio-badge.ok { background: #dcfce7; color: #166534; }
.trio-dashboard .trio-badge.waste { background: #fee2e2; color: #991b1b; }
.trio-dashboard .trio-badge.wait { background: #f3f4f6; color: #6b7280; }
.trio-dashboard .trio-exports, .trio-dashboard .trio-setting-note { font-size: 11.5px; color: #6b7280; }
.trio-dashboard .trio-ask { color: #92400e; font-weight: 600; }
.trio-dashboard .widget-label { color: #4b5563; }
.trio-dashboard .widget-toggle-button, .trio-dashboard .widget-button { white-space: nowrap; }
.trio-dashboard .trio-snapshot-note { font-size: 11px; color: #6b7280; margin-top: 4px; }
/* the kernel restarted or the dashboard closed: the page keeps the last picture; say so */
.trio-dashboard.jupyter-widgets-disconnected::before { content: "Disconnected: the kernel restarted or this \
dashboard was closed. What you see is frozen; run its cell again for a live one."; display: block;
  font-family: inherit; font-size: 12.5px; font-weight: 600; color: #991b1b; background: #fee2e2;
  border-radius: 6px; padding: 4px 8px; margin-bottom: 6px; }
.trio-dashboard .jupyter-widgets-disconnected::before { content: none !important; display: none !important; }
.trio-dashboard.jupyter-widgets-disconnected .trio-pill,
.trio-dashboard.jupyter-widgets-disconnected .trio-rate { display: none; }
.trio-dashboard.jupyter-widgets-disconnected .trio-status,
.trio-dashboard.jupyter-widgets-disconnected .trio-advisor { opacity: .5; }
</style>"""


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _badge(d: Diagnosis | WatchedDiagnosis) -> tuple[str, str]:
    """The advisor's badge for a diagnosis: (class, word). Causes are the advisor's own words."""
    if d.cause == "pipelined":
        return "ok", "pipelined"
    if d.cause == "warming-up":
        return "wait", "measuring"
    return ("waste" if d.wasted else "wait"), str(d.cause)


def _newest_pool() -> LocalPool | None:
    return pools.newest_pool()


class Dashboard(W.VBox):
    """Live cycle timeline, queue depth, loss curves, status, advisor and controls for a pool.

    The dashboard observes the pool: requests from any loop on it show up. ``Dashboard()``
    without a pool shows the newest pool in the kernel and moves to a newer one when it is
    built (a cell that builds a pool ran again); ``Dashboard(pool)`` shows that pool, and
    what replaces it when the cell that built it runs again. ``Dashboard(url, api_key=...)``
    watches a served pool; given a fleet's URL it returns a `FleetDashboard` (widgets/fleet.py:
    the fleet's totals, a pool selector, the selected pool's Dashboard). Its Start button trains `runs`
    LoRA clients (a learning-rate sweep ×0.5/×1/×2 for 3 runs) on the built-in addition task
    with :func:`trio_widgets.loop.train`.

    A served pool's dashboard (or ``room=True``) has a room table: a row per participant by
    name (cycles per update, verdict, loss, status; sortable; finished ones keep their last
    verdict) and a picker that shows one participant's lane (widgets/room.py).

    Methods `start()`, `pause()`, `resume()`, `stop()` do what the buttons do, from any
    thread. Exports (`export_trace()`, `export_metrics()`, `save_html()`) write into
    `export_dir` ("trio-exports" by default).

    Example: `trio.Dashboard()` as the last line of a cell, before the cell that builds a pool
    and trains; `trio.Dashboard("http://127.0.0.1:8000", api_key=key)` for a served pool.
    """

    def __new__(cls, pool: LocalPool | str | None = None, *args: Any, api_key: str | None = None,
                **settings: Any) -> Dashboard:
        """A fleet's URL (trio_widgets/http/fleet.py) gives a `FleetDashboard` instead: the fleet's
        totals, a pool selector and the selected pool's Dashboard, built with these settings
        (widgets/fleet.py). Any other pool or URL: a Dashboard, as ever."""
        if isinstance(pool, str) and not args and settings.get("watch") is None:
            from .fleet import FleetDashboard, fleet_info

            info = fleet_info(pool, api_key)  # None for a served pool's URL (it answers 404)
            if info is not None:
                given = {k: v for k, v in settings.items() if k != "owned_by_cell"}

                def pool_dashboard(url: str) -> Dashboard:
                    return Dashboard(url, api_key=api_key, owned_by_cell=False, **given)

                view = FleetDashboard(pool, api_key=api_key, pool_dashboard=pool_dashboard, info=info)
                if settings.get("owned_by_cell", True):
                    _CELL_DASHBOARDS.claim(view)
                # not a Dashboard, so Python calls no __init__ on it: the fleet view is what you get
                return cast("Dashboard", view)
        return super().__new__(cls, pool, *args, api_key=api_key, **settings)

    def __init__(self, pool: LocalPool | str | None = None, *, api_key: str | None = None, window: int = 24,
                 refresh_hz: float = 5.0, lanes: int = 10, base_model: str = DEFAULT_MODEL, rank: int = 8,
                 learning_rate: float = 3e-3, batch_size: int = 8, runs: int = 3, mode: str = "pipelined",
                 lookahead: int = 1, export_dir: str | os.PathLike = "trio-exports",
                 title: str = "trio · live training", max_clients: int | None = None, watch: Any = None,
                 owned_by_cell: bool = True, room: bool | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if not (0 < refresh_hz <= 10):
            raise ValueError(f"refresh_hz must be in (0, 10], got {refresh_hz!r}")
        if max_clients is not None:  # its old name
            lanes = max_clients
        # the settings given in code are checked as the fields are: refused or out of range is an error
        # (never a silent clamp); a learning rate far outside the usual range is kept and said
        far_lr = ""
        for key, value, default in (("lr", learning_rate, 3e-3), ("batch_size", batch_size, 8),
                                    ("runs", runs, 3), ("lookahead", lookahead, 1)):
            verdict, checked, text = check_setting(key, value, default)
            if key == "lr" and verdict == "refuse":
                raise ValueError(f"learning_rate must be a number above 0; got {value!r}")
            if key != "lr" and (text or checked != value):
                low, high = INT_RANGES[key]
                raise ValueError(f"{key} must be a whole number from {low} to {high}; got {value!r}")
            if verdict == "confirm":
                far_lr = text.split(". Apply")[0]
        if watch is not None and pool is not None:
            raise ValueError("a dashboard shows a pool or watches clients: give Dashboard(pool) or "
                             "Dashboard(watch=...), not both")
        remote = None
        if isinstance(pool, str):  # a served pool's URL: its telemetry streams in (trio_widgets/http/remote.py)
            from ..http.remote import RemotePool

            try:
                remote = RemotePool(pool, api_key=api_key)
            except BaseException:
                # what close() reads when this half-built widget is dropped (ipywidgets' __del__ calls it)
                self._closed = True
                raise
            pool = cast("LocalPool", remote)  # it has what the views read of a pool
        watcher = None
        if watch is not None:  # a loop of the official SDK, seen from this process (trio_widgets/watch.py)
            from ..watch import Watcher, watcher_of

            try:
                watcher = watch if isinstance(watch, Watcher) else watcher_of(watch)
            except AttributeError:
                raise TypeError(f"watch= takes what trio.watch(client) returned (or its Watcher); got a "
                                f"{type(watch).__qualname__}") from None
            pool = cast("LocalPool", watcher)  # it has what the views read of a pool, without cycles
        self.follow = pool is None  # (a served pool is watched until it stops; never replaced)
        if pool is None:
            pool = _newest_pool()
        t0 = time.perf_counter()
        figs = DashboardFigures(t0, window=window, lanes_visible=lanes)
        plot = batched_bokeh_widget(figs.layout)
        plot.layout = W.Layout(width="100%", min_width="0")

        self._title = title
        header = W.HTML("")
        status = W.HTML("<span class='trio-pill waiting'>waiting</span>")
        status.add_class("trio-status")
        advisor = W.HTML("<div class='trio-advisor'><div class='trio-adv-title'>Advisor</div>"
                         "<i>waiting for training requests…</i></div>")
        settings: dict[str, Any] = {"mode": mode, "lookahead": lookahead, "lr": learning_rate,
                                    "batch_size": batch_size, "runs": runs, "log": False}
        controls = Controls(settings, self._request)
        # a room: a served pool's participants, one row each (None: a served pool's dashboard has one)
        self._room = RoomTable(self._request) if (room if room is not None else remote is not None) else None
        room_box = [self._room.box] if self._room is not None else []
        super().__init__(children=[header, status, controls.bar, *room_box, plot, advisor, controls.exports],
                         layout=W.Layout(width="100%", max_width="100%", overflow="hidden"))
        self.add_class("trio-dashboard")

        self.pool: LocalPool | None = pool
        self._remote = remote  # watched, not driven: Start trains in-process only
        self._watcher = watcher  # the same, for the SDK's clients in this process
        if watcher is not None:
            figs.client_side()
        self.controls = controls
        self.sweep = SweepLauncher(pool, base_model, rank, settings)  # type: ignore[arg-type]
        self._settings = settings
        self._figs = figs
        self._bokeh = plot
        self._status = status
        self._advisor_w = advisor
        self._header = header
        self._owned = [header, status, *controls.widgets, *(self._room.widgets if self._room else []), plot, advisor]
        self.export_dir = os.fspath(export_dir)
        self.refresh_hz = float(refresh_hz)
        self._closed = False
        self._stopping = False
        self._pool_closed = False
        self._error: str | None = None
        self._commands: deque[tuple[str, Any]] = deque(maxlen=256)
        self._update_cycles: dict[str, deque[int]] = {}
        self._rates: deque[tuple[float, int]] = deque(maxlen=64)
        # the advisor's (a WatchedDiagnosis for watched clients: the same fields the page shows)
        self._diagnoses: dict[str, Diagnosis | WatchedDiagnosis] = {}
        # (text, bad, about): what just happened, one line each; `about` is what it concerns (the pool's
        # `_scope`, or that and a client id): the line goes when that is replaced or closed
        self._notices: deque[tuple[str, bool, tuple]] = deque(maxlen=3)
        # the line of each kind that says how things stand (which pool is shown): a newer one replaces it
        self._notice_of_kind: dict[str, tuple[str, bool, tuple]] = {}
        # waits for results that stopped in this process (Kernel → Interrupt), heard on their thread
        self._interrupts: deque[WaitInterrupted] = deque(maxlen=8)
        self._stop_hearing = on_wait_interrupted(self._interrupts.append)
        self._endings_seen = run_endings()[-1].seq if run_endings() else 0
        # every client this dashboard has drawn (bounded): a run on them ending is reported
        self._shown_ids: deque[str] = deque(maxlen=512)
        self._pending_lr: float | None = None
        self._last_update_at = float("-inf")
        if far_lr:
            self._notice(f"{far_lr}; it is used as given", bad=True)
        self._last_busy_at = float("-inf")
        self._status_text = ""
        self._status_key: tuple | None = None
        self._status_at = float("-inf")
        self._advisor_text = ""
        self._advised_at = float("-inf")
        self._expect_views = 0
        self._ready_seen = 0
        self._displayed_at: float | None = None
        # an idle stretch: when it began, and its newest empty cycles and boundaries (drawn once
        # something happens, so that the timeline then shows the window before it)
        self._idle_since: float | None = None
        self._held_cycles: deque = deque(maxlen=figs.band_rollover)
        self._held_boundaries: deque = deque(maxlen=figs.queue_rollover)
        self._drawn_cycles = 0  # the status line's cycle count: the timeline's, while it stands still
        self._hidden = False  # no view can be seen: nothing is sent (a catch-up when one can again)
        self._display_id = f"trio-dashboard-{uuid.uuid4().hex}"
        self._shown = False
        self.ticks = 0
        self.tick_thread: threading.Thread | None = None
        self._feed: TelemetryFeed | None = None
        if pool is not None:
            self._attach(pool)
        self._update_header()
        if owned_by_cell:  # (False: a fleet view's pool dashboard, which the fleet view owns)
            _CELL_DASHBOARDS.claim(self)  # the cell that built one before runs again: one live dashboard per cell
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"trio-dashboard-{next(_DASHBOARD_IDS)}",
                                        daemon=True)
        self._thread.start()

    # -- public controls (any thread) -------------------------------------------------------
    def start(self) -> None:
        """Start training the dashboard's own runs (the Start button)."""
        self._request("start")

    def pause(self) -> None:
        """Pause the dashboard's own runs between updates (the Pause button)."""
        self._request("pause")

    def resume(self) -> None:
        """Resume paused runs (the Resume button)."""
        self._request("resume")

    def stop(self) -> None:
        """Stop the dashboard's own runs between updates (the Stop button)."""
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
        return "watching" if self._remote is not None or self._watcher is not None else self.sweep.state

    @property
    def pool_state(self) -> str:
        """What the pill says about the pool: training, sampling, paused, idle, closed or waiting."""
        if self.pool is None:
            return "waiting"
        if self._pool_closed:
            return "closed"
        if self.pool.closed:
            # closed by the cell that is building its successor, which shows up in a moment
            return "waiting" if pools.successor(self.pool) is not None else "closed"
        now = time.perf_counter()
        if now - self._last_update_at <= _ACTIVE_S:
            return "training"
        if self.sweep.state in ("paused", "pausing"):
            return "paused"
        if now - self._last_busy_at <= _ACTIVE_S:
            return "sampling"
        return "idle"

    @property
    def runs(self) -> list[TrainingRun]:
        """The runs of the last Start."""
        return self.sweep.runs

    @property
    def running(self) -> bool:
        """True while the dashboard's thread runs (until `close()`)."""
        return self._thread.is_alive()

    @property
    def diagnoses(self) -> dict[str, Diagnosis | WatchedDiagnosis]:
        """The advisor's, by client id (what `trio.watch` diagnoses, for a dashboard that watches)."""
        return dict(self._diagnoses)

    @property
    def status_text(self) -> str:
        """The status line's text, as shown."""
        return self._status.value

    @property
    def notices(self) -> list[str]:
        """The one-line messages the status line shows (newest last)."""
        return [text for text, _bad, _about in self._notices]

    @property
    def figures(self) -> DashboardFigures:
        """The bokeh figures the dashboard draws into."""
        return self._figs

    @property
    def bokeh_widget(self) -> W.DOMWidget:
        """The widget that holds the bokeh figures."""
        return self._bokeh

    # -- commands: any thread in, dashboard thread out ---------------------------------------------
    def _request(self, command: str, arg: Any = None) -> None:
        if self._closed or self._stopping:
            return
        self._commands.append((command, arg))
        try:
            self._loop.call_soon_threadsafe(self._process_commands)
        except RuntimeError:  # the loop closed meanwhile
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

    def _scope(self, client_id: str | None = None) -> tuple:
        """What a notice is about: the pool shown now (and one of its clients)."""
        return (id(self.pool),) if client_id is None else (id(self.pool), client_id)

    def _forget(self, about: tuple) -> None:
        """Drop the notices about `about` (a pool's scope: also those about its clients)."""
        for entry in [e for e in self._notices if e[2][:len(about)] == about]:
            self._notices.remove(entry)

    def _notice(self, text: str, bad: bool = False, kind: str | None = None, about: tuple = ()) -> None:
        """One line in the status where the user looks (plain text). A line of a `kind` replaces
        the previous line of that kind: it says how things stand now, not what happened. A line
        `about` a pool or client (`_scope`) goes when that pool is replaced or the client closes."""
        entry = (text, bad, about)
        if kind is not None:
            old = self._notice_of_kind.get(kind)
            if old is not None and old in self._notices:
                self._notices.remove(old)
            self._notice_of_kind[kind] = entry
        self._notices.append(entry)

    def _hear_interrupts(self) -> None:
        while self._interrupts:
            exc = self._interrupts.popleft()
            who = "your loop"
            if exc.client_id is not None and self.pool is not None:
                info = self.pool.telemetry.all_clients().get(exc.client_id)
                if info is None:
                    continue  # a client of another pool
                who = self._label_of(exc.client_id, info.label)
            what = f"{exc.op} (request #{exc.request_id})" if exc.request_id is not None else exc.op
            self._notice(f"{who}: the wait for {what} stopped (interrupted); {exc.state}", kind="interrupt",
                         about=self._scope(exc.client_id))

    def _handle(self, command: str, arg: Any) -> None:
        if command == "start":
            if self._remote is not None:
                self._notice("this dashboard watches a served pool: its participants train; Start trains "
                             "in-process only (trio.Dashboard(pool))", True)
                return
            if self._watcher is not None:
                self._notice("this dashboard watches your tinker clients: your loop trains; Start trains on a "
                             "local pool (trio.Dashboard(pool))", True)
                return
            if self.pool is None or self._pool_closed:
                self._notice("Start needs a pool: build one (trio.LocalPool(...)) and press Start again", True)
                return
            self.sweep.start(self._loop)
        elif command in ("pause", "resume", "stop"):
            self.sweep.control(command)
        elif command == "setting":
            self._setting(*arg)
        elif command == "confirm":
            if self._pending_lr is not None:
                self._apply_setting("lr", self._pending_lr)
                self._notice(f"lr set to {self._pending_lr:g} (outside the usual range, as you confirmed)")
                self._pending_lr = None
                self.controls.ask(None)
        elif command == "lanes":
            self._figs.scroll_lanes(int(arg) - 1)
        elif command == "room" and self._room is not None:
            what, value = arg
            picked = self._room.command(what, value)
            if what == "pick":
                self._show_picked(picked)
            self._room.render(time.perf_counter())
        elif command == "export":
            what = {"trace": self.export_trace, "metrics": self.export_metrics, "html": self.save_html}[arg]
            path = what()
            size = os.path.getsize(path)
            self.controls.note(f"wrote <code>{html.escape(path)}</code> ({_si(size)}B)")
        elif command == "call":  # a method called from another thread, run here (exports)
            fn, done = arg
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

    def _setting(self, key: str, value: Any) -> None:
        current = self._settings[key]
        if value == current or (key == "lr" and self._pending_lr is not None and value == self._pending_lr):
            return  # nothing new: often the echo of a value we put in the field ourselves
        verdict, value, text = check_setting(key, value, current)
        if key == "lr":
            self._pending_lr = None
            self.controls.ask(None)
        if verdict == "refuse":
            self.controls.show(key, current)
            self.controls.say(html.escape(text))
            return
        if verdict == "confirm":
            self._pending_lr = value
            self.controls.ask(html.escape(text))
            return
        self.controls.say(html.escape(text))
        self._apply_setting(key, value)

    def _apply_setting(self, key: str, value: Any) -> None:
        self._settings[key] = value
        self.sweep.apply(key, value)
        self.controls.show(key, value)
        if key == "lr":
            self._relabel_runs()

    def _relabel_runs(self) -> None:
        for run in self.sweep.runs:
            if run.client_id is not None:
                self._figs.relabel(run.client_id, self.sweep.label(run))

    # -- the dashboard's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._pump())
        except Exception:
            log.exception("the dashboard's loop failed")
        finally:
            try:
                tasks = asyncio.all_tasks(self._loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            finally:
                self._loop.close()

    async def _pump(self) -> None:
        interval = 1.0 / self.refresh_hz
        while not self._stopping:
            # nothing to draw without an open pool: look for one twice a second
            idle = self.pool is None or self._pool_closed
            slowest = 0.5 if idle else ROOM_TICK_S if self._crowded() else 0.0
            await asyncio.sleep(max(interval, slowest))
            if self._stopping:
                break
            try:
                self.tick()
            except Exception:
                log.exception("dashboard tick failed")
        # closing: the Start runs stop at their next update and record what they applied
        try:
            await self.sweep.close(timeout=10.0)
            await asyncio.sleep(0)
            self.tick()  # draw their last updates: the snapshot shows where they stopped
            with self._bokeh.batch():
                self._figs.flush_losses()  # (the loss figure is otherwise redrawn once a second)
        except Exception:
            log.exception("stopping the dashboard's runs failed")
        if self._feed is not None:
            self._feed.close()

    def tick(self) -> None:
        """One update: follow the pool, drain the feed, stream into the figures (one batched
        message), refresh status / advisor text if it changed. Runs on the dashboard's thread."""
        self.tick_thread = threading.current_thread()
        self.ticks += 1
        self._follow_pool()
        self._sync_views()
        bk = self._bokeh
        hidden = bk.views_hidden()
        if hidden and not bk.paused:
            bk.pause()  # the figures still follow the pool here; the page gets one catch-up later
        with bk.batch(), validate(False):  # rows we build are well-formed: skip bokeh's checks
            if not hidden and bk.paused:
                bk.resume()  # what changed while hidden, in this tick's one PATCH-DOC
            self._figs.set_log_scale(bool(self._settings["log"]))
            if self._feed is not None:
                clients, cycles, boundaries, delivered = self._feed.drain()
                cycles, boundaries = self._hold_idle(clients, cycles, boundaries, delivered)
                for info in clients:
                    self._figs.add_client(info, self._label_of(info.client_id, info.label))
                    self._shown_ids.append(info.client_id)
                    view = self._figs.clients.get(info.client_id)
                    if self._room is not None and info.kind == "training" and view is not None:
                        self._room.join(info.client_id, view.label, view.color)
                # a Start run's client can reach the feed before the run exists (it then got the
                # client's own name): its label is its name and current lr, whenever it was drawn
                for run in self.sweep.runs:
                    if run.client_id is not None:
                        self._figs.relabel(run.client_id, self.sweep.label(run))
                self._figs.update(cycles, boundaries, delivered)
                if self._room is not None:
                    self._room.observe(delivered, time.perf_counter())
                self._figs.stream_gil(self._feed.drain_gil())
                self._note_activity(cycles, delivered)
                for info in self._feed.drain_retired():
                    self._forget(self._scope(info.client_id))  # e.g. its interrupted wait: it closed
                    if self._room is not None:  # its row keeps its last verdict, marked finished
                        self._judge(info.client_id)
                        self._room.finish(info.client_id)
                    self._update_cycles.pop(info.client_id, None)
                    self._figs.retire_client(info.client_id)
            if not hidden:
                self.controls.show_lanes(self._figs.first_lane, self._figs.lane_count, self._figs.lanes_visible)
        self._watch_runs()
        self._hear_interrupts()
        now = time.perf_counter()
        if self.pool is not None and not self._pool_closed:
            self._rates.append((now, self.pool.telemetry.total_tokens))
        if hidden:  # nobody sees the text either; it catches up on the first tick seen again
            self._hidden = True
            return
        if self._hidden:
            self._hidden = False
            self._status_key = None
            self._advised_at = float("-inf")
        if now - self._advised_at >= 1.0:  # the advisor reads whole buffers: once a second
            self._advised_at = now
            self._update_advisor()
            self._update_room(now)
        self._update_status(now)
        self._update_buttons()

    def _hold_idle(self, clients: list, cycles: list, boundaries: list, delivered: list) -> tuple[list, list]:
        """An idle pool's empty cycles are drawn for `_IDLE_DRAWN_S`, then held (the newest few)
        until something happens; returns the cycles and boundaries to draw now."""
        quiet = (not clients and not delivered and not self._feed_has_other()
                 and all(c.n_requests == 0 for c in cycles) and all(not any(b.depths.values()) for b in boundaries))
        now = time.perf_counter()
        if not quiet:
            self._idle_since = None
            if self._held_cycles or self._held_boundaries:
                cycles = [*self._held_cycles, *cycles]
                boundaries = [*self._held_boundaries, *boundaries]
                self._held_cycles.clear()
                self._held_boundaries.clear()
        elif cycles or boundaries:
            if self._idle_since is None:
                self._idle_since = now
            if now - self._idle_since >= _IDLE_DRAWN_S:
                self._held_cycles.extend(cycles)
                self._held_boundaries.extend(boundaries)
                return [], []
        if cycles:
            self._drawn_cycles = cycles[-1].index + 1
        return cycles, boundaries

    def _feed_has_other(self) -> bool:
        """GIL stalls or retired clients are waiting in the feed (they are drawn this tick)."""
        feed = self._feed
        return feed is not None and bool(feed.gil or feed.retired)

    def _label_of(self, client_id: str, default: str) -> str:
        for run in self.sweep.runs:
            if run.client_id == client_id:
                return self.sweep.label(run)
        return default

    def _note_activity(self, cycles: list, delivered: list) -> None:
        now = time.perf_counter()
        if any(c.n_requests for c in cycles):
            self._last_busy_at = now
        for r in delivered:
            if r.status != "ok":
                continue
            spec = OPS.get(r.op)
            if spec is not None and (spec.is_step or r.op in UPDATE_OPS):
                self._last_update_at = now
                if r.op in UPDATE_OPS and r.cycle is not None:
                    self._update_cycles.setdefault(r.client_id, period_history()).append(r.cycle)

    def _watch_runs(self) -> None:
        """Say in one line how a run we showed ended (stopped, interrupted, pool closed...)."""
        endings = run_endings(self._endings_seen)
        if not endings:
            return
        self._endings_seen = endings[-1].seq
        for e in endings:
            if e.client_id is None or e.client_id not in self._shown_ids:
                continue  # a run on another pool
            total = f" of {e.steps}" if e.steps is not None else ""
            if e.reason == "finished":
                self._notice(f"run {e.name!r} finished: {e.step}{total} updates", about=self._scope())
            else:
                self._notice(f"run {e.name!r} stopped at step {e.step}{total}: {e.reason}",
                             bad=e.state == "error" or e.reason == "the pool was closed", about=self._scope())

    # -- following a pool ------------------------------------------------------------------------------
    def _attach(self, pool: LocalPool) -> None:
        self.pool = pool
        self._pool_closed = False
        self._feed = TelemetryFeed(pool.telemetry)
        self._rates.clear()

    def _follow_pool(self) -> None:
        """Move to the pool that replaced ours (its cell ran again) or, without a pool of our
        own, to the newest one; otherwise note that ours closed."""
        pool = self.pool
        successor = None
        if pool is not None and pool.closed:
            successor = pools.successor(pool)
            if successor is not None and not successor.closed and not pools.is_live(successor):
                return  # being built right now (it closed ours on its way): next tick
            if successor is not None and successor.closed:
                successor = None
            if successor is not None:
                self._switch(successor)
                self._notice(f"the cell that built pool {pool.name!r} ran again: now showing its new pool "
                             f"{successor.name!r}", kind="pool")
                return
        if self.follow:
            newest = _newest_pool()
            if newest is not None and newest is not pool and (
                    pool is None or pool.closed or getattr(newest, "serial", 0) > getattr(pool, "serial", 0)):
                self._switch(newest)
                if pool is None:
                    self._notice(f"showing pool {newest.name!r}", kind="pool")
                elif pool.closed:
                    self._notice(f"pool {pool.name!r} was closed: now showing {newest.name!r}", kind="pool")
                else:
                    self._notice(f"now showing the newest pool {newest.name!r} (was {pool.name!r})", kind="pool")
                return
        if pool is not None and pool.closed and not self._pool_closed:
            self._on_pool_closed()

    def _switch(self, pool: LocalPool) -> None:
        if self._feed is not None:
            self._feed.close()
        self._forget(self._scope())  # what was said about the old pool and its clients
        self._figs.reset()
        if self._room is not None:
            self._room.reset()
        self._update_cycles.clear()
        self._diagnoses = {}
        self._attach(pool)
        self.sweep.retarget(pool)
        self._update_header()

    def _on_pool_closed(self) -> None:
        self._pool_closed = True
        for cid in {e[2][1] for e in self._notices if len(e[2]) == 2 and e[2][0] == id(self.pool)}:
            self._forget(self._scope(cid))  # its clients closed with it (what its runs did stays)
        if self._feed is not None:
            self._feed.close()
        assert self.pool is not None
        if self._watcher is not None:
            self._notice("watching stopped (unwatch): this is the last picture", kind="pool")
        elif not threading.main_thread().is_alive():  # the interpreter is exiting (Kernel → Shut Down)
            self._notice(f"pool {self.pool.name!r} was closed: the kernel shut down; this is its last picture",
                         kind="pool")
        else:
            self._notice(f"pool {self.pool.name!r} was closed" + (": waiting for a new one" if self.follow else ""),
                         kind="pool")

    def _update_header(self) -> None:
        title = f"{_CSS}<div class='trio-title'>{html.escape(self._title)}"
        pool = self.pool
        if pool is None:
            sub = "waiting for a pool: build one (trio.LocalPool) in any cell"
        elif self._watcher is not None:
            sub = (f"{pool.name} · seen from this process: a bar per request from submit to result; the "
                   f"server's cycles are not visible here")
        else:
            sub = f"{pool.name} · min cycle {pool.min_cycle_s * 1e3:.0f} ms · {pool.device_type}"
        value = f"{title}<span class='trio-sub'>{html.escape(sub)}</span></div>"
        if self._header.value != value:
            self._header.value = value

    # -- what the page shows ---------------------------------------------------------------------------
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
            # No view said it rendered: no browser (nbclient), or the kernel cannot read the page's
            # messages yet (a cell blocks it). Send anyway, from the whole document: a view that
            # rendered meanwhile would otherwise miss what changed since.
            if bk.stale:
                bk.resync()
            bk.live = True

    def _tokens_per_s(self) -> float:
        if len(self._rates) < 2:
            return 0.0
        now, tokens = self._rates[-1]
        for t, n in self._rates:
            if now - t <= 3.0:
                return (tokens - n) / (now - t) if now > t else 0.0
        return 0.0

    def _update_status(self, now: float | None = None) -> None:
        state = self.pool_state
        key = (state, len(self._notices), self._notices[-1] if self._notices else None, self._error, self.sweep.state)
        if now is not None and key == self._status_key and now - self._status_at < _TEXT_EVERY_S:
            return  # the numbers move on every tick; the page need not restyle for each of them
        self._status_key, self._status_at = key, now if now is not None else time.perf_counter()
        text = self._status_html(state)
        if text != self._status_text:
            self._status_text = text
            self._status.value = text

    def _status_html(self, state: str) -> str:
        pool = self.pool
        head = f"<span class='trio-pill {state}'>{state}</span>"
        if pool is not None:
            t = pool.telemetry
            # while an idle timeline stands still, so does its count (the page is sent nothing)
            if self._watcher is not None:
                head += f"in flight <b>{sum(self._watcher.in_flight().values())}</b> · updates <b>{t.total_updates}</b>"
            else:
                cycle = self._drawn_cycles if self._idle_since is not None and self._drawn_cycles else pool.cycle_index
                head += f"cycle <b>{cycle}</b> · updates <b>{t.total_updates}</b>"
            if state not in ("closed", "snapshot"):
                head += f"<span class='trio-rate'> · <b>{_si(self._tokens_per_s())}</b> tokens/s</span>"
        runs = self.sweep.state
        if runs not in ("idle",) and self.sweep.runs:
            head += f"<span class='trio-runs'>· Start runs: {runs}</span>"
        elif runs == "starting":
            head += "<span class='trio-runs'>· starting runs…</span>"
        parts = [head]
        per_client = []
        live = [v for v in self._figs.clients.values() if not v.retired]
        crowd = self._room is not None and len(live) > ROOM_INLINE
        if crowd:  # one row each is in the room table
            parts.append(f"<br>{len(live)} clients: one row each in the room table below")
        for cid, view in self._figs.clients.items():
            if view.retired or crowd:
                continue
            if self._watcher is not None:  # round trips, as the watcher counts them (no cycles here)
                trips = getattr(self._diagnoses.get(cid), "round_trips_per_update", None)
                text, unit = (f"{trips:g}", "round trip" if trips == 1 else "round trips") if trips else ("", "")
            else:
                p = cycles_per_update(self._update_cycles.get(cid, ()))
                text = format_cycles(p) if p is not None else ""
                unit = "cycle" if text == "1" else "cycles"
            if not text:
                continue
            per_client.append(f"<span class='trio-cpu'><span class='trio-dot' style='background:{view.color}'>"
                              f"</span>{html.escape(view.label)}: <b>{text}</b> {unit}/update</span>")
        if per_client:
            parts.append("<br>" + "".join(per_client))
        for error in (self._error, self.sweep.error):
            if error:
                parts.append(f"<br><span class='trio-notice bad'>{html.escape(error)}</span>")
        for text, bad, _about in self._notices:
            parts.append(f"<br><span class='trio-notice{' bad' if bad else ''}'>{html.escape(text)}</span>")
        return "".join(parts)

    def _update_advisor(self) -> None:
        if self.pool is None:
            return
        if self._watcher is not None:
            self._diagnoses = dict(self._watcher.diagnose())
        else:
            self._diagnoses = dict(diagnose_telemetry(self.pool.telemetry, self.pool.min_cycle_s or None,
                                                      served=self._remote is not None))
        rows = []
        order = {cid: i for i, cid in enumerate(self._figs.clients)}  # as the lanes and the status list them
        for cid, d in sorted(self._diagnoses.items(), key=lambda item: order.get(item[0], len(order))):
            view = self._figs.clients.get(cid)
            if view is not None and view.retired:
                continue
            color = view.color if view is not None else CLIENT_COLORS[-1]
            label = view.label if view is not None else d.label
            badge = _badge(d)
            # the evidence (what was measured, against which threshold) on hover
            rows.append(f"<div class='trio-adv-row' title='{html.escape(d.evidence)}'>"
                        f"<span class='trio-dot' style='background:{color}'></span>"
                        f"<b>{html.escape(label)}</b><span class='trio-badge {badge[0]}'>{badge[1]}</span>"
                        f"{html.escape(d.message)}</div>")
        body = "".join(rows) or "<i>waiting for training requests…</i>"
        if self._room is not None and len(rows) > ROOM_INLINE:  # one verdict each is in the room table
            counts = self._room.verdicts()
            body = ("<div class='trio-adv-row'>" + " · ".join(f"<b>{n}</b> {html.escape(cause)}" for cause, n in
                                                              sorted(counts.items(), key=lambda kv: -kv[1]))
                    + f" ({len(rows)} clients: each one's verdict, with what it measured, is in the room table)"
                    + "</div>")
        if self._watcher is not None and rows:
            from ..watch import UNKNOWN

            body += f"<div class='trio-adv-row'><i>{html.escape(UNKNOWN[0].upper() + UNKNOWN[1:])}.</i></div>"
        text = f"<div class='trio-advisor'><div class='trio-adv-title'>Advisor</div>{body}</div>"
        if text != self._advisor_text:
            self._advisor_text = text
            self._advisor_w.value = text

    def _crowded(self) -> bool:
        """A room with more live participants than the status lists (see ROOM_TICK_S)."""
        return self._room is not None and sum(1 for v in self._figs.clients.values() if not v.retired) > ROOM_INLINE

    def _judge(self, client_id: str) -> None:
        """The room row's cycles per update and verdict, from what the status and advisor read."""
        assert self._room is not None
        p = cycles_per_update(self._update_cycles.get(client_id, ()))
        d = self._diagnoses.get(client_id)
        if d is None:
            self._room.judge(client_id, p, None, "wait", "")
            return
        badge, word = _badge(d)
        self._room.judge(client_id, p if p is not None else getattr(d, "cycles_per_update", None), word, badge,
                         d.evidence)

    def _update_room(self, now: float) -> None:
        room = self._room
        if room is None:
            return
        for cid, view in self._figs.clients.items():
            if not view.retired and cid in room.people:
                room.people[cid].name = view.label  # (a relabelled client)
                self._judge(cid)
        self._show_picked(room.picked, keep=True)
        room.render(now)

    def _show_picked(self, client_id: str | None, keep: bool = False) -> None:
        """The timeline shows the picked participant's lane first (`keep`: only if it is out of view)."""
        view = self._figs.clients.get(client_id) if client_id is not None else None
        figs = self._figs
        if view is None or view.lane is None:
            if client_id is None and not keep:
                figs.scroll_lanes(0)
            return
        if keep and figs.first_lane <= view.lane < figs.first_lane + figs.lanes_visible:
            return
        figs.scroll_lanes(view.lane)

    def _update_buttons(self) -> None:
        # ("watching", a served pool's dashboard, enables none)
        self.controls.enable(self.state if self.pool is not None else "no pool")

    # -- display: hold patches until the new view has rendered; a snapshot when closed ------------------
    def _repr_mimebundle_(self, **kwargs: Any):
        self.expect_view()
        return super()._repr_mimebundle_(**kwargs)

    def expect_view(self) -> None:
        """A view of this dashboard renders now (displayed, or shown inside another widget: a
        fleet's view): hold patches until it has, then send it the whole document."""
        self._expect_views += 1
        self._displayed_at = time.perf_counter()
        self._bokeh.live = False
        # A new view is in the output of the cell that runs now, where the notebook looks: it
        # counts as seen (a busy kernel may not hear it say so until the cell ends) until the
        # page reports again, whatever the other views said (scrolled away: Run All moved on).
        self._bokeh.visibility = {}

    def _ipython_display_(self) -> None:
        # Shown under a display id, so that close() can put a static snapshot in its place
        from IPython.display import display

        if self._closed:
            display(self._snapshot_bundle(), raw=True)
            return
        self._shown = True
        display(self._repr_mimebundle_(), raw=True, display_id=self._display_id)

    def _snapshot_bundle(self) -> dict[str, str]:
        """The last picture as static HTML: header, status, advisor and the figures (BokehJS
        is already in the page; without it the text remains)."""
        from bokeh.embed import components

        try:
            script, div = components(self._figs.layout)
        except Exception:  # a figure that cannot be embedded must not break close()
            log.exception("dashboard snapshot of the figures failed")
            script, div = "", ""
        when = time.strftime("%H:%M:%S")
        self._watch_runs()  # how the Start runs ended belongs in the last picture
        body = (f"<div class='trio-dashboard trio-snapshot'>{self._header.value}"
                f"<div class='trio-status'>{self._status_html('snapshot')}</div>{div}{self._advisor_w.value}"
                f"<div class='trio-snapshot-note'>Snapshot of the dashboard when it closed ({when}); "
                f"it no longer updates.</div></div>{script}")
        return {"text/html": body, "text/plain": f"<trio dashboard snapshot, closed {when}>"}

    # -- exports -------------------------------------------------------------------------------------
    def _path(self, path: str | os.PathLike | None, default: str) -> str:
        if path is not None:
            return os.fspath(path)
        os.makedirs(self.export_dir, exist_ok=True)
        return os.path.join(self.export_dir, default)

    def _on_thread(self, fn: Any) -> Any:
        """Run `fn` on the dashboard's thread (it owns the figures) and return its result."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        import concurrent.futures

        done: concurrent.futures.Future = concurrent.futures.Future()
        self._request("call", (fn, done))
        return done.result(timeout=60)

    def export_trace(self, path: str | os.PathLike | None = None) -> str:
        """Chrome / Perfetto trace JSON of what the pool's buffers hold (open in ui.perfetto.dev)."""
        if self.pool is None:
            raise RuntimeError("no pool to export yet")
        if self._watcher is not None:  # bars from submit to result, when the loop asked, in flight
            return self._watcher.write_chrome_trace(self._path(path, "trio-trace.json"))
        return write_chrome_trace(self.pool.telemetry, self._path(path, "trio-trace.json"), name=self.pool.name)

    def export_metrics(self, path: str | os.PathLike | None = None) -> str:
        """metrics.jsonl: the Start runs' per-step metrics, plus telemetry rows for other clients."""
        rows = [{"run": run.name, **row} for run in self.runs for row in list(run.metrics)]
        mine = {run.client.client_id for run in self.runs}
        if self._watcher is not None:
            rows += self._watcher.metrics_rows()
        elif self.pool is not None:
            rows += [row for row in metrics_rows(self.pool.telemetry) if row["client_id"] not in mine]
        return write_metrics_jsonl(rows, self._path(path, "metrics.jsonl"))

    def save_html(self, path: str | os.PathLike | None = None) -> str:
        """A standalone HTML snapshot (BokehJS inline: opens offline) of the figures and text."""
        return self._on_thread(lambda: self._save_html(path))

    def _save_html(self, path: str | os.PathLike | None) -> str:
        from bokeh.embed import file_html
        from bokeh.resources import INLINE

        page = file_html(self._figs.layout, INLINE, title="trio dashboard snapshot")
        head = (f"<div class='trio-dashboard' style='margin:8px'>{self._header.value}"
                f"<div class='trio-status'>{self._status.value}</div>{self._advisor_w.value}</div>")
        before, tag, after = page.rpartition("<body>")  # the last one: BokehJS's source has "<body>" too
        page = before + tag + "\n" + head + after
        target = self._path(path, "trio-dashboard.html")
        with open(target, "w", encoding="utf-8") as f:
            f.write(page)
        return target

    # -- lifecycle --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the Start runs (what they submitted is recorded), the thread and the feed; leave
        a static snapshot where the dashboard was shown; close the widgets."""
        if getattr(self, "_closed", True):  # closed, or its __init__ refused its arguments
            return
        self._stopping = True
        self._stop_hearing()
        try:
            self._loop.call_soon_threadsafe(lambda: None)  # wake the pump
        except RuntimeError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(30.0)
        self._closed = True
        if self._feed is not None:
            self._feed.close()
        if self._remote is not None:
            self._remote.close()  # its reader thread and the server's stream
        # The output first: the page drops the widget views, then the comms close unobserved
        # (closing a comm a view still uses makes the page send to it: "No such comm").
        if self._shown:
            try:
                from IPython.display import update_display

                update_display(self._snapshot_bundle(), raw=True, display_id=self._display_id)
            except Exception:
                log.exception("could not leave a snapshot of the dashboard")
        owned, self._owned = self._owned, []
        closing([self, *owned])
        super().close()
        for w in owned:
            w.close()

    @property
    def closed(self) -> bool:
        """True once `close()` has run."""
        return self._closed

    @property
    def widgets(self) -> list[W.Widget]:
        """Every widget the dashboard built (and closes with it)."""
        return list(self._owned)

    @property
    def subscribed(self) -> bool:
        """True while the dashboard receives the pool's telemetry."""
        return self._feed is not None and self._feed.subscribed
