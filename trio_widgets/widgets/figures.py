"""The dashboard's bokeh figures: cycle timeline, queue depth, loss curves.

Built once; afterwards :meth:`DashboardFigures.update` only *streams* new rows into the
sources and moves the shared time range. Call everything on one thread (the dashboard's).

What the browser holds is bounded, and so is what it redraws per tick, however long the
pool trains (issue 14): the timeline's sources roll over at what its window shows, each
loss curve is a :class:`~trio_widgets.widgets.series.LossSeries` (every recent step, a
decimated history before it), only the visible loss figure (linear or log) is fed, and
legends have fixed items (a legend labelled from a data column is rebuilt, canvases and
all, whenever the column's first values change, i.e. on every tick of a rolling source).

Lanes: one per live client on the timeline; a sampler made from a training client
(``save_weights_and_get_sampling_client``) shares its parent's lane; a retired client gives
its lane back. Lanes beyond ``lanes_visible`` are reached by scrolling (:meth:`scroll_lanes`);
none is dropped. The page holds the bars of the lanes it shows, for the whole window (a room of
40 held a quarter of it for each: the other lanes' bars filled the rollover); each client's recent
bars are kept here and sent when its lane is scrolled to.

Every bokeh model (renderers, legend items, tickers) is made here, up front: a model added
to a live document makes bokeh walk the whole document (a quarter of a second with these
figures, holding the GIL), so later changes only set plain values: data, labels, colours,
visibility. Loss curves live in `max_curves` slots, reused oldest-retired first.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from typing import Any

from bokeh.core.properties import value
from bokeh.layouts import column
from bokeh.models import BasicTicker, ColumnDataSource, CustomJS, FixedTicker, HoverTool, Range1d
from bokeh.models.annotations import LabelSet, Legend, LegendItem
from bokeh.plotting import figure

from ..metrics import cycle_duration, record_loss
from ..ops import OPS, UPDATE_OPS, op_color
from ..telemetry import ClientInfo, CycleRecord, GilStall, QueueDepthRecord, RequestRecord
from .series import LossSeries

__all__ = ["CLIENT_COLORS", "GIL_LEGEND", "DashboardFigures"]

CLIENT_COLORS = ("#0f766e", "#dc2626", "#7c3aed", "#ca8a04", "#db2777", "#2563eb", "#16a34a", "#475569",
                 "#ea580c", "#0891b2", "#92400e", "#65a30d")
# cycle bands, alternating: slate for cycles that ran work, pale amber for idle ones
_BAND_FILL = {False: ("#e2e8f0", "#edf1f6"), True: ("#fbf0d9", "#fdf7ea")}
_FONT = "Inter, 'Segoe UI', Helvetica, Arial, sans-serif"
#: the narrowest the timeline is drawn (a 900 px notebook column): cycle labels are thinned for it
MIN_PLOT_PX = 560
_LABEL_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def _style(fig, title: str) -> None:
    fig.title.text = title
    fig.title.text_font = _FONT
    fig.title.text_font_size = "10.5pt"
    fig.title.text_color = "#111827"
    fig.outline_line_color = "#e5e7eb"
    fig.background_fill_color = "#ffffff"
    fig.border_fill_color = "#ffffff"
    fig.min_border_right = 16  # the last tick label is not clipped
    for axis in (*fig.xaxis, *fig.yaxis):
        axis.axis_line_color = "#d1d5db"
        axis.major_tick_line_color = "#d1d5db"
        axis.minor_tick_line_color = None
        axis.major_label_text_color = "#4b5563"
        axis.major_label_text_font_size = "8pt"
        axis.axis_label_text_font_size = "8pt"
        axis.axis_label_text_color = "#6b7280"
        axis.axis_label_text_font_style = "normal"
    fig.ygrid.grid_line_color = "#f1f5f9"
    fig.toolbar.logo = None


def _legend(**kw: Any) -> Legend:
    base = dict(label_text_font_size="8pt", glyph_width=14, glyph_height=9, spacing=6, padding=3, margin=2,
                border_line_color=None, background_fill_alpha=0.0)
    base.update(kw)
    return Legend(**base)


class _Curve:
    """A slot for one training client's loss curve: its series, a source per loss figure
    (only the shown one holds data), its renderers and legend items (made once, reused)."""

    __slots__ = ("index", "client_id", "series", "sources", "renderers", "proxies", "items", "ema", "ema_weight",
                 "steps")

    def __init__(self, index: int):
        self.index = index
        self.client_id: str | None = None
        self.series = LossSeries()
        self.sources = (ColumnDataSource(data={"step": [], "loss": [], "smooth": []}),
                        ColumnDataSource(data={"step": [], "loss": [], "smooth": []}))
        self.renderers: list = []
        self.proxies: list = []
        self.items: list[LegendItem] = []
        self.ema = 0.0
        self.ema_weight = 0.0
        self.steps = 0


class ClientView:
    """How one client shows: its label, lane (None once retired), colour and loss curve."""

    __slots__ = ("client_id", "label", "kind", "owner", "lane", "color", "curve", "retired", "_figs")

    def __init__(self, figs: DashboardFigures, info: ClientInfo, label: str, owner: str, lane: int | None,
                 color: str):
        self._figs = figs
        self.client_id, self.kind, self.label, self.owner = info.client_id, info.kind, label, owner
        self.lane, self.color = lane, color
        self.curve: _Curve | None = None
        self.retired = False

    @property
    def loss(self) -> ColumnDataSource:
        """The source of the loss figure now shown (linear or log)."""
        if self.curve is None:
            return ColumnDataSource(data={"step": [], "loss": [], "smooth": []})
        return self.curve.sources[self._figs.log_index]


_EMPTY: dict[str, list] = {"step": [], "loss": [], "smooth": []}
_NAN = float("nan")
_FAILED = "failed"
#: the red shading's legend label (its hover names the Python that held the interpreter)
GIL_LEGEND = "red shade: Python held the GIL (hover: which code)"


class DashboardFigures:
    """Timeline and queue depth (one time axis) above the loss curves, as one bokeh layout
    that stretches to the width of its cell (from a 900 px notebook column up)."""

    def __init__(self, t0: float, *, window: int = 24, lanes_visible: int = 10, max_curves: int = 16,
                 smoothing: float = 0.1, recent: int = 200, history: int = 200, loss_height: int = 250,
                 loss_every_s: float = 1.0):
        self.t0 = t0
        # The loss figure is redrawn at most this often: each redraw repaints all its curve slots
        # and legend (the page's costliest paint), and a loss curve needs no 10 Hz.
        self.loss_every_s = loss_every_s
        self._losses_at = float("-inf")
        self.window = max(4, int(window))
        self.lanes_visible = max(1, int(lanes_visible))
        self.max_curves = max(1, int(max_curves))
        self.smoothing = smoothing
        self.recent, self.history = recent, history
        self.band_rollover = self.window + 4
        self.queue_rollover = self.window + 4
        self.clients: dict[str, ClientView] = {}
        self.lanes: dict[int, str] = {}  # lane -> owning client id (live clients only)
        self.first_lane = 0  # the first lane shown (scroll_lanes)
        self.log_index = 0  # which loss figure (and source) is shown: 0 linear, 1 log
        self.streams = 0  # stream() calls made (for tests: one per source per update at most)
        self.hidden_curves = 0  # training clients without a curve (more live runs than slots)
        self._color_seq = 0
        self._band_starts: deque[float] = deque(maxlen=self.window)
        self._last_end: float | None = None
        self._cycle_s: deque[float] = deque(maxlen=32)
        self._band_rows: deque[tuple[float, float, str, float, int]] = deque(maxlen=self.band_rollover)
        self._boundary_t: deque[float] = deque(maxlen=4096)
        self._boundary_i: deque[int] = deque(maxlen=4096)
        self._depth_max: deque[int] = deque(maxlen=self.window)
        self._bar_lefts: deque[float] = deque(maxlen=4096)  # each bar's left, as streamed (newest last)
        # each client's recent bars (rows in the bars' column order), shown or not: what a scroll sends
        self._bar_rows: dict[str, deque[tuple]] = {}
        # trio.watch: no cycles, so the time axis follows the bars and in-flight marks (client_side)
        self._client_side = False

        self.x_range = Range1d(start=0.0, end=1.0)
        self._lanes_range = Range1d(start=-0.6, end=0.95)
        tl = figure(height=self._timeline_height(1), sizing_mode="stretch_width", x_range=self.x_range,
                    y_range=self._lanes_range, tools="", toolbar_location=None, x_axis_location=None)
        _style(tl, "Cycle timeline: a lane per client, a band per cycle (amber: idle)")
        # the queue-depth plot below shows the shared time axis: no axis here (a hidden one is still
        # measured, its every label, at every paint)
        tl.xgrid.visible = False
        self._lane_ticker = FixedTicker(ticks=[])
        tl.yaxis.ticker = self._lane_ticker
        tl.yaxis.major_label_overrides = {}
        tl.ygrid.visible = False
        self.bands = ColumnDataSource(data={"left": [], "right": [], "fill": [], "mid": [], "label": [],
                                            "index": []})
        tl.quad(left="left", right="right", bottom=-10_000, top=1.5, source=self.bands, fill_color="fill",
                line_color="#ffffff", line_width=0.5, level="underlay")
        tl.add_layout(LabelSet(x="mid", y=0.62, text="label", source=self.bands, text_font_size="7.5pt",
                               text_align="center", text_color="#64748b"))
        self.bars = ColumnDataSource(data={
            "left": [], "right": [], "bottom": [], "top": [], "color": [], "op": [], "rid": [], "client": [],
            "cycle": [], "wait_ms": [], "waited": [], "run_ms": [], "status": []})
        self._bar_glyphs = tl.quad(left="left", right="right", bottom="bottom", top="top", source=self.bars,
                                   fill_color="color", line_color="color", fill_alpha=0.9)
        self._bar_hover = HoverTool(renderers=[self._bar_glyphs], tooltips=[
            ("request", "#@rid @op"), ("client", "@client"), ("cycle", "@cycle"),
            ("waited in queue", "@wait_ms{0.0} ms (@waited cycles)"), ("ran", "@run_ms{0.00} ms"),
            ("status", "@status")])
        tl.add_tools(self._bar_hover)
        # a fixed legend item per op (an empty glyph of its colour), shown once the op is seen
        self._op_items: dict[str, LegendItem] = {}
        for name, color in [*((op, op_color(op)) for op in OPS), (_FAILED, "#991b1b")]:
            # one row that is never drawn (NaN): the legend draws its item from row 0
            swatch = tl.quad(left=[_NAN], right=[_NAN], bottom=[_NAN], top=[_NAN], fill_color=color, line_color=color)
            spec = OPS.get(name)
            self._op_items[name] = LegendItem(label=value(spec.label if spec else name), renderers=[swatch],
                                              visible=False)
        self._op_legend = _legend(items=list(self._op_items.values()), orientation="horizontal", location="top_left")
        tl.add_layout(self._op_legend, "below")
        self.timeline = tl
        self._add_gil_shading(tl)

        self._depth_range = Range1d(start=0, end=4)
        qd = figure(height=150, sizing_mode="stretch_width", x_range=self.x_range, y_range=self._depth_range,
                    tools="", toolbar_location=None, y_axis_label="queued", x_axis_label="time (s)")
        _style(qd, "Queue depth at each cycle boundary: a line per lane, in its client's colour")
        qd.xgrid.visible = False
        qd.yaxis.ticker = BasicTicker(desired_num_ticks=3, min_interval=1)
        # a column per visible lane (its client and samplers summed): one stream per tick
        self.queue = ColumnDataSource(data={"t": [], **{f"d{i}": [] for i in range(self.lanes_visible)}})
        self._queue_steps = []
        for i in range(self.lanes_visible):
            # equal depths overlap exactly: earlier lanes are drawn wider, so every line stays visible
            step = qd.step(x="t", y=f"d{i}", source=self.queue, mode="after", line_color=CLIENT_COLORS[0],
                           line_width=max(1.5, 6.0 - 1.5 * (i % 4)), line_alpha=0.9, visible=False)
            self._queue_steps.append(step)
        self._queue_hover = HoverTool(renderers=list(self._queue_steps), tooltips=[("queued", "$y{0}")],
                                      mode="vline")
        self._queue_axis = qd.yaxis[0]
        qd.add_tools(self._queue_hover)
        self.queue_fig = qd

        self.loss_figs = []
        for kind in ("linear", "log"):
            lf = figure(height=loss_height, sizing_mode="stretch_width", y_axis_type=kind,
                        tools="box_zoom,reset", toolbar_location=None, x_axis_label="step",
                        y_axis_label="loss per token", visible=(kind == "linear"))
            _style(lf, "Loss per token (thin: raw, thick: smoothed)" + (", log scale" if kind == "log" else ""))
            self.loss_figs.append(lf)
        self._curves = [_Curve(i) for i in range(self.max_curves)]
        for lf, fig_index in zip(self.loss_figs, (0, 1)):
            items, lines = [], []
            for curve in self._curves:
                source = curve.sources[fig_index]
                raw = lf.line(x="step", y="loss", source=source, line_color=CLIENT_COLORS[0], line_alpha=0.25,
                              line_width=1, visible=False)
                # identical curves (same data, same seed) would hide each other: earlier ones are wider
                width = 5.5 - 1.1 * (curve.index % 4)
                smooth = lf.line(x="step", y="smooth", source=source, line_color=CLIENT_COLORS[0],
                                 line_width=width, line_alpha=0.95, visible=False)
                # The legend draws a stand-in (same style, no data): BokehJS rebuilds a legend,
                # a canvas per item, whenever anything its items reach changes, and the real
                # line's source changes on every tick.
                proxy = lf.line(x=[_NAN], y=[_NAN], line_color=CLIENT_COLORS[0], line_width=min(width, 3.5))
                item = LegendItem(label=value(""), renderers=[proxy], visible=False)
                curve.renderers += [raw, smooth]
                curve.proxies.append(proxy)
                curve.items.append(item)
                items.append(item)
                lines.append([raw, smooth])
            legend = _legend(items=items, location="top_left", click_policy="hide", label_width=40)
            # a click hides the stand-in (greying the item) and, here, the real lines
            legend.js_on_event("legend_item_click", CustomJS(args={"items": items, "lines": lines}, code="""
                const i = items.indexOf(cb_obj.item);
                if (i < 0) return;
                const shown = cb_obj.item.renderers.every((r) => r.visible);
                for (const r of lines[i]) r.visible = shown;
            """))
            lf.add_layout(legend, "right")
        self.layout = column(tl, qd, *self.loss_figs, sizing_mode="stretch_width", spacing=4)

    # -- lanes and clients ------------------------------------------------------------------
    def client_side(self) -> None:
        """Titles for requests seen from the client (trio.watch): a bar from submit to result, the
        requests in flight instead of a queue at each boundary; there are no cycle bands."""
        _style(self.timeline, "Requests seen from the client: a bar from submit to result (forward ops above)")
        _style(self.queue_fig, "Requests in flight (submitted, result not yet back): a line per lane, in its "
               "client's colour")
        self._queue_axis.axis_label = "in flight"
        self._queue_hover.tooltips = [("in flight", "$y{0}")]
        self._client_side = True
        # a pipelined loop's requests overlap in time: each op keeps to its half of the lane and
        # a white edge parts one bar from the next, so each request can be told apart
        self._bar_glyphs.glyph.line_color = "#ffffff"
        # a mark per submit and per result: twice the bars' rows keeps both plots over the same time
        self._depth_max = deque(maxlen=2 * 3 * self.window * max(2, self.lanes_visible))
        self._bar_hover.tooltips = [("request", "#@rid @op"), ("client", "@client"),
                                    ("submit → result", "@run_ms{0.0} ms"), ("status", "@status")]

    @staticmethod
    def _timeline_height(lanes: int) -> int:
        return 96 + 30 * max(2, lanes)

    def _free_lane(self) -> int:
        lane = 0
        while lane in self.lanes:
            lane += 1
        return lane

    def _next_color(self) -> str:
        """A colour no shown client has, if one is left (lanes are reused; curves stay)."""
        used = {v.color for v in self.clients.values()}
        for i in range(len(CLIENT_COLORS)):
            color = CLIENT_COLORS[(self._color_seq + i) % len(CLIENT_COLORS)]
            if color not in used:
                self._color_seq += i + 1
                return color
        self._color_seq += 1
        return CLIENT_COLORS[(self._color_seq - 1) % len(CLIENT_COLORS)]

    def add_client(self, info: ClientInfo, label: str | None = None) -> bool:
        """Show a client: a lane of its own, or its parent's (a sampler of a live training client)."""
        if info.client_id in self.clients and not self.clients[info.client_id].retired:
            return False
        labels = {v.label for v in self.clients.values() if not v.retired}
        label = label or info.label
        if label in labels:
            label = f"{label} ({info.client_id})"
        parent = getattr(info, "parent", None)
        owner_view = self.clients.get(parent) if parent else None
        if owner_view is not None and not owner_view.retired and owner_view.lane is not None:
            view = ClientView(self, info, label, owner_view.client_id, owner_view.lane, owner_view.color)
        else:
            lane = self._free_lane()
            view = ClientView(self, info, label, info.client_id, lane, self._next_color())
            self.lanes[lane] = info.client_id
        old = self.clients.pop(info.client_id, None)
        if old is not None and old.curve is not None:
            self._free_curve(old.curve)
        self.clients[info.client_id] = view
        self._rebalance_curves()
        self._relabel_lanes()
        return True

    def retire_client(self, client_id: str) -> None:
        """The pool let go of the client: its lane is free again; its loss curve stays until
        its slot is needed for a newer client."""
        view = self.clients.get(client_id)
        if view is None or view.retired:
            return
        view.retired = True
        self._bar_rows.pop(client_id, None)
        lane = view.lane
        if view.owner == client_id and lane is not None and self.lanes.get(lane) == client_id:
            members = [v for v in self.clients.values() if not v.retired and v.owner == client_id]
            if members:  # its samplers live on: the lane passes to them
                heir = members[0]
                for v in members:
                    v.owner = heir.client_id
                self.lanes[lane] = heir.client_id
            else:
                del self.lanes[lane]
        view.lane = None
        if view.curve is None:
            del self.clients[client_id]
        self._rebalance_curves()
        self._relabel_lanes()

    def relabel(self, client_id: str, label: str) -> None:
        """A new label for a client (e.g. a run whose learning rate changed)."""
        view = self.clients.get(client_id)
        if view is None or view.label == label:
            return
        view.label = label
        if view.curve is not None:
            for item in view.curve.items:
                item.label = value(label)  # a plain string would name a data column
        self._relabel_lanes()

    def _lane_label(self, lane: int) -> str:
        owner = self.clients[self.lanes[lane]]
        samplers = sum(1 for v in self.clients.values() if not v.retired and v.owner == owner.client_id
                       and v.client_id != owner.client_id)
        return owner.label + (f" +{samplers} sampler{'s' if samplers > 1 else ''}" if samplers else "")

    def _relabel_lanes(self) -> None:
        n = self.lane_count
        first = max(0, min(self.first_lane, n - self.lanes_visible))
        if first != self.first_lane:  # fewer lanes: the view moved up
            self.first_lane = first
            self._resend_bars()
        shown = max(1, min(n, self.lanes_visible))
        start = self.first_lane
        self._lanes_range.update(start=-(start + shown - 1) - 0.6, end=-start + 0.95)
        height = self._timeline_height(shown)
        if self.timeline.height != height:
            self.timeline.height = height
        ticks = [-lane for lane in sorted(self.lanes)]
        if self._lane_ticker.ticks != ticks:
            self._lane_ticker.ticks = ticks
        labels: dict[float | str, Any] = {-lane: self._lane_label(lane) for lane in self.lanes}
        axis = self.timeline.yaxis[0]
        if axis.major_label_overrides != labels:
            axis.major_label_overrides = labels
        for slot, step in enumerate(self._queue_steps):
            owner = self.lanes.get(start + slot)
            visible = owner is not None
            if step.visible != visible:
                step.visible = visible
            if owner is not None and step.glyph.line_color != self.clients[owner].color:
                step.glyph.line_color = self.clients[owner].color

    @property
    def lane_count(self) -> int:
        """Lanes in use (the highest one in use, plus one)."""
        return max(self.lanes, default=-1) + 1

    def scroll_lanes(self, first: int) -> None:
        """Show lanes `first` ... `first + lanes_visible - 1` (the queue view starts afresh)."""
        first = max(0, min(int(first), self.lane_count - self.lanes_visible))
        if first == self.first_lane:
            return
        self.first_lane = first
        self.queue.data = {k: [] for k in self.queue.data}
        self._relabel_lanes()
        self._resend_bars()

    def _assign_curve(self, view: ClientView) -> bool:
        """A slot for a training client's loss curve: a free one, else the oldest retired one's;
        False if every slot shows a live client."""
        free = [c for c in self._curves if c.client_id is None]
        if not free:
            retired = [c for c in self._curves if c.client_id is not None and self.clients[c.client_id].retired]
            if not retired:
                return False
            oldest = retired[0]
            assert oldest.client_id is not None
            del self.clients[oldest.client_id]
            self._free_curve(oldest)
            free = [oldest]
        curve = free[0]
        self._curves.remove(curve)
        self._curves.append(curve)  # oldest first: the next eviction takes the longest-retired
        curve.client_id = view.client_id
        curve.series = LossSeries(self.recent, self.history)
        curve.ema = curve.ema_weight = 0.0
        curve.steps = 0
        for source in curve.sources:
            source.data = dict(_EMPTY)
        for r in curve.renderers:
            r.glyph.line_color = view.color
            r.visible = False  # then True: the page may have hidden it (a legend click we never hear of)
            r.visible = True
        for r in curve.proxies:
            r.glyph.line_color = view.color
            r.visible = False
            r.visible = True
        for item in curve.items:
            item.label = value(view.label)
            item.visible = True
        view.curve = curve
        return True

    def _rebalance_curves(self) -> None:
        """Live training clients without a curve (more than `max_curves`) get the slots of
        retired ones first, oldest client first."""
        waiting = [v for v in self.clients.values() if v.kind == "training" and not v.retired and v.curve is None]
        for view in waiting:
            if not self._assign_curve(view):
                break
        hidden = sum(1 for v in waiting if v.curve is None)
        if hidden != self.hidden_curves:
            self.hidden_curves = hidden
            self._title_loss()

    def _free_curve(self, curve: _Curve) -> None:
        curve.client_id = None
        for r in curve.renderers:
            r.visible = False
        for item in curve.items:
            item.visible = False
        for source in curve.sources:
            source.data = dict(_EMPTY)

    def _title_loss(self) -> None:
        n = self.hidden_curves
        extra = f" ({n} more run{'s' if n > 1 else ''} not drawn: {self.max_curves} curves at most)" if n else ""
        for lf, kind in zip(self.loss_figs, ("", ", log scale")):
            title: Any = lf.title
            title.text = f"Loss per token (thin: raw, thick: smoothed){kind}{extra}"

    def set_log_scale(self, on: bool) -> None:
        index = 1 if on else 0
        if index == self.log_index:
            return
        linear, log = self.loss_figs
        log.visible, linear.visible = on, not on
        self.log_index = index
        for curve in self._curves:  # only the shown figure holds data: the other is not redrawn
            curve.sources[1 - index].data = dict(_EMPTY)
            curve.series.resend()
        self._flush_curves()

    def reset(self) -> None:
        """Forget every client and row (the dashboard follows another pool)."""
        for curve in self._curves:
            if curve.client_id is not None:
                self._free_curve(curve)
        self.clients.clear()
        self.lanes.clear()
        self.hidden_curves = 0
        self._color_seq = 0
        self._title_loss()
        for source in (self.bands, self.bars, self.queue):
            source.data = {k: [] for k in source.data}
        for item in self._op_items.values():
            item.visible = False
        self.gil.data = {k: [] for k in self.gil.data}  # the old pool's stalls are not the new one's
        self._gil_item.visible = False
        self._band_starts.clear()
        self._bar_lefts.clear()
        self._bar_rows.clear()
        self._band_rows.clear()
        self._last_end = None
        self._boundary_t.clear()
        self._boundary_i.clear()
        self._relabel_lanes()

    # -- streaming -----------------------------------------------------------------------------
    def _rel(self, t: float) -> float:
        return round(t - self.t0, 6)

    def cycle_estimate(self) -> float:
        return cycle_duration(self._cycle_s, default=None, window=len(self._cycle_s) or 1) or 0.05

    def _label_step(self, rows: list[tuple[float, float, str, float, int]]) -> int:
        """Label the multiples of k (k = 1, 2, 5, 10, ...), the smallest k for which no two
        labels on screen touch at the narrowest width (a 900 px column). Cycles of uneven
        length squeeze the short ones together, so the gaps are measured where they are."""
        if not rows:
            return 1
        span = max(1e-9, rows[-1][1] - self._band_starts[0]) if self._band_starts else 1e-9
        px_per_s = MIN_PLOT_PX / span
        shown = [(mid, index) for _l, _r, _f, mid, index in rows if mid >= self._band_starts[0]]
        for k in _LABEL_STEPS:
            marks = [(mid, index) for mid, index in shown if index % k == 0]
            if all((m1 - m0) * px_per_s >= 7.0 * (len(str(i0)) + len(str(i1))) / 2 + 12
                   for (m0, i0), (m1, i1) in zip(marks, marks[1:])):
                return k
        return _LABEL_STEPS[-1]

    def _stream(self, source: ColumnDataSource, data: dict, rollover: int | None) -> None:
        source.stream(data, rollover=rollover)
        self.streams += 1

    def _waited_cycles(self, record: RequestRecord) -> int | None:
        """Cycles between the first one the request was eligible for and the one it ran in."""
        k = bisect_right(self._boundary_t, record.queued_at)
        if k >= len(self._boundary_t) or record.cycle is None:
            return None
        return max(0, record.cycle - self._boundary_i[k])

    def update(self, cycles: Iterable[CycleRecord], boundaries: Iterable[QueueDepthRecord],
               delivered: Iterable[RequestRecord]) -> bool:
        """Stream what is new, one stream per source at most; returns whether anything changed."""
        delivered = [r for r in delivered if r.client_id in self.clients]
        changed = self._stream_bands(list(cycles)[-self.band_rollover:])
        changed |= self._stream_queue(list(boundaries))
        changed |= self._stream_bars(delivered)
        changed |= self._stream_losses(delivered)
        changed |= self._follow_time()
        return changed

    def _stream_bands(self, cycles: list[CycleRecord]) -> bool:
        """The timeline's cycle bands (and the durations the bars are sized by). The few rows
        are sent whole each time: which cycles get a label depends on the whole window."""
        if not cycles:
            return False
        for c in cycles:
            if c.ended_at > c.started_at:
                self._cycle_s.append(c.ended_at - c.started_at)
            left, right = self._rel(c.started_at), self._rel(max(c.ended_at, c.started_at))
            fill = _BAND_FILL[c.n_requests == 0][c.index % 2]
            self._band_rows.append((left, right, fill, round((left + right) / 2, 6), c.index))
            self._band_starts.append(left)
            self._last_end = right
        rows = list(self._band_rows)
        k = self._label_step(rows)
        self.bands.data = {"left": [r[0] for r in rows], "right": [r[1] for r in rows],
                           "fill": [r[2] for r in rows], "mid": [r[3] for r in rows],
                           "label": [str(r[4]) if r[4] % k == 0 else "" for r in rows],
                           "index": [r[4] for r in rows]}
        return True

    def _stream_queue(self, boundaries: list[QueueDepthRecord]) -> bool:
        """Queue depths at each boundary: a column per lane (its client and samplers summed)."""
        if not boundaries:
            return False
        self._boundary_t.extend(b.time for b in boundaries)
        self._boundary_i.extend(b.cycle for b in boundaries)
        columns = [f"d{i}" for i in range(self.lanes_visible)]
        first, last = self.first_lane, self.first_lane + self.lanes_visible
        column_of = {cid: f"d{v.lane - first}" for cid, v in self.clients.items()
                     if v.lane is not None and first <= v.lane < last}
        rows: dict[str, list] = {k: [] for k in self.queue.data}
        rollover = 2 * self.bar_rollover if self._client_side else self.queue_rollover
        for b in boundaries[-rollover:]:
            rows["t"].append(self._rel(b.time))
            depth = dict.fromkeys(columns, 0)
            for cid, n in b.depths.items():
                name = column_of.get(cid)
                if name is not None:
                    depth[name] += n
            for k in columns:
                rows[k].append(depth[k])
            self._depth_max.append(max(depth.values(), default=0))
        changed = bool(self.lanes)
        if changed:
            self._stream(self.queue, rows, rollover)
        top = max(4, max(self._depth_max, default=0) + 1)
        if self._depth_range.end != top:
            self._depth_range.end = top
        return changed

    def _show_op(self, op: str) -> None:
        item = self._op_items.get(op)
        if item is not None and not item.visible:
            item.visible = True

    def _stream_bars(self, delivered: list[RequestRecord]) -> bool:
        """A bar per request that ran, in its client's lane, coloured by op (red: failed); sent
        if its lane is shown, kept for when it is (scroll_lanes) either way."""
        min_w = max(0.0015, 0.05 * self.cycle_estimate())
        columns = list(self.bars.data)
        bars: dict[str, list] = {k: [] for k in columns}
        first, last = self.first_lane, self.first_lane + self.lanes_visible
        for r in delivered:
            if r.started_at is None or r.finished_at is None:
                continue  # cancelled, or failed before it ran
            view = self.clients[r.client_id]
            if view.lane is None:
                continue  # retired before its results were drawn
            self._show_op(r.op if r.status == "ok" else _FAILED)
            left = self._rel(r.started_at)
            y = -view.lane
            if self._client_side:  # forward ops above, the rest (optim_step, sample...) below
                upper = r.op in UPDATE_OPS
                bottom, top = (y, y + 0.32) if upper else (y - 0.32, y)
            else:
                bottom, top = y - 0.3, y + 0.3
            waited = self._waited_cycles(r)
            row = {"left": left, "right": round(max(self._rel(r.finished_at), left + min_w), 6),
                   "bottom": bottom, "top": top,
                   "color": op_color(r.op) if r.status == "ok" else "#991b1b", "op": r.op, "rid": r.request_id,
                   "client": view.label, "cycle": r.cycle if r.cycle is not None else -1,
                   "wait_ms": round((r.started_at - r.queued_at) * 1e3, 2),
                   "waited": waited if waited is not None else -1,
                   "run_ms": round((r.finished_at - r.started_at) * 1e3, 3), "status": r.status}
            kept = self._bar_rows.get(r.client_id)
            if kept is None:
                kept = self._bar_rows[r.client_id] = deque(maxlen=3 * self.window)
            kept.append(tuple(row[k] for k in columns))
            if first <= view.lane < last:
                for k in columns:
                    bars[k].append(row[k])
        if not bars["left"]:
            return False
        self._bar_lefts.extend(bars["left"])
        keep = self._bars_to_keep()
        self._stream(self.bars, {k: v[-keep:] for k, v in bars.items()}, keep)
        return True

    def _resend_bars(self) -> None:
        """The shown lanes' recent bars, whole (the lanes shown changed)."""
        columns = list(self.bars.data)
        at = columns.index("left")
        first, last = self.first_lane, self.first_lane + self.lanes_visible
        rows = sorted((row for cid, view in self.clients.items()
                       if view.lane is not None and first <= view.lane < last for row in self._bar_rows.get(cid, ())),
                      key=lambda row: row[at])[-self.bar_rollover:]
        self._bar_lefts.clear()
        self._bar_lefts.extend(row[at] for row in rows)
        self.bars.data = {k: [row[i] for row in rows] for i, k in enumerate(columns)}

    def _bars_to_keep(self) -> int:
        """The bars of the cycles the window shows, and a few more (the page holds no bars left of
        the time axis: a client with fewer ops a cycle than `bar_rollover` assumes left two thirds
        of them there). Without cycles (trio.watch) the time axis follows the bars instead."""
        most = self.bar_rollover
        if self._client_side or not self._band_starts:
            return most
        start = self._band_starts[0]
        shown = sum(1 for left in itertools.islice(reversed(self._bar_lefts), most) if left >= start)
        return max(1, min(most, shown + 2 * max(1, min(self.lanes_visible, self.lane_count))))

    @property
    def bar_rollover(self) -> int:
        """Bars kept: about what the window shows (three ops a cycle in every visible lane)."""
        return 3 * self.window * max(2, min(self.lanes_visible, self.lane_count))

    def _stream_losses(self, delivered: list[RequestRecord]) -> bool:
        """Each training client's loss per token (raw and smoothed) of its successful updates."""
        for r in delivered:
            if r.op not in UPDATE_OPS or r.status != "ok":
                continue
            loss = record_loss(r.metrics)
            if not math.isfinite(loss):
                continue
            curve = self.clients[r.client_id].curve
            if curve is None:
                continue
            curve.steps += 1
            a = self.smoothing
            curve.ema = (1 - a) * curve.ema + a * loss
            curve.ema_weight = (1 - a) * curve.ema_weight + a
            curve.series.add(curve.steps, loss, curve.ema / curve.ema_weight)
        now = time.perf_counter()
        if now - self._losses_at < self.loss_every_s:
            return False
        self._losses_at = now
        return self._flush_curves()

    def flush_losses(self) -> bool:
        """Send every loss row not sent yet (a final picture: the dashboard closes)."""
        return self._flush_curves()

    def _flush_curves(self) -> bool:
        changed = False
        for curve in self._curves:
            if curve.client_id is None:
                continue
            out = curve.series.flush()
            if out is None:
                continue
            kind, rows = out
            source = curve.sources[self.log_index]
            if kind == "replace":
                source.data = rows
            else:
                self._stream(source, rows, None)  # bounded by the series (it replaces when it compacts)
            changed = True
        return changed

    def _follow_time(self) -> bool:
        """The shared time axis shows the cycles the bands still hold; without cycles (trio.watch,
        seen from the client) the bars and in-flight marks the sources still hold."""
        if self._last_end is not None and self._band_starts:
            start, end = self._band_starts[0], self._last_end
        else:
            span = self._held_span()
            if span is None:
                return False
            start, end = span
        if end - start < 1e-3:
            end = start + 1e-3
        if (self.x_range.start, self.x_range.end) == (start, end):
            return False
        self.x_range.update(start=start, end=end)
        return True

    def _held_span(self) -> tuple[float, float] | None:
        """(first, last) time of the bars and queue marks the page holds (bounded lists)."""
        bars, marks = self.bars.data, self.queue.data["t"]
        lows = [*([min(bars["left"])] if bars["left"] else []), *marks[:1]]
        highs = [*([max(bars["right"])] if bars["right"] else []), *marks[-1:]]
        if not lows:
            return None
        return min(lows), max(highs)

    # -- GIL stalls: shading across the lanes -------------------------------------------------
    def _add_gil_shading(self, tl) -> None:
        """Red shading over the lanes where other Python held the interpreter (GIL) and the
        pool waited for it (above the cycle bands, below the request bars)."""
        self.gil = ColumnDataSource(data={"left": [], "right": [], "what": []})
        shade = tl.quad(left="left", right="right", bottom=-10_000, top=1.5, source=self.gil,
                        fill_color="#dc2626", fill_alpha=0.14, line_color=None, level="underlay")
        tl.add_tools(HoverTool(renderers=[shade], tooltips=[("GIL held by", "@what")]))
        # its legend item, shown once a stall is drawn: the red says what it is on the page
        swatch = tl.quad(left=[_NAN], right=[_NAN], bottom=[_NAN], top=[_NAN], fill_color="#dc2626",
                         fill_alpha=0.14, line_color=None)
        self._gil_item = LegendItem(label=value(GIL_LEGEND), renderers=[swatch], visible=False)
        self._op_legend.items = [*self._op_legend.items, self._gil_item]

    def stream_gil(self, stalls: Iterable[GilStall]) -> bool:
        """Stream the watchdog's stalls into the shading; returns whether any was new."""
        data: dict[str, list] = {"left": [], "right": [], "what": []}
        for s in stalls:
            top = s.frames[0] if s.frames else None
            data["left"].append(self._rel(s.started_at))
            data["right"].append(self._rel(max(s.ended_at, s.started_at)))
            data["what"].append(top.label if top else s.thread)
        if not data["left"]:
            return False
        if not self._gil_item.visible:
            self._gil_item.visible = True
        self._stream(self.gil, {k: v[-self.band_rollover:] for k, v in data.items()}, self.band_rollover)
        return True

    def loss_points(self, client_id: str) -> int:
        """Rows the browser holds for a client's loss curve (bounded however long it trains)."""
        curve = self.clients[client_id].curve
        return len(curve.sources[self.log_index].data["step"]) if curve is not None else 0

    def rows_in_browser(self) -> int:
        """Every row of every source (for tests and benchmarks: bounded)."""
        sources = [self.bands, self.bars, self.queue, self.gil, *(c.sources[i] for c in self._curves for i in (0, 1))]
        return sum(len(next(iter(s.data.values()), [])) for s in sources)
