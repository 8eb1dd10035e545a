"""The dashboard's bokeh figures: cycle timeline, queue depth, loss curves.

Built once; afterwards :meth:`DashboardFigures.update` only *streams* new rows into the
sources (with rollover) and moves the shared time range. Call everything on one thread
(the dashboard's periodic task on the kernel loop).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable

from bokeh.layouts import column, row
from bokeh.models import BasicTicker, ColumnDataSource, FixedTicker, HoverTool, Range1d
from bokeh.models.annotations import LabelSet, Legend, LegendItem
from bokeh.plotting import figure

from ..metrics import cycle_duration, record_loss
from ..ops import UPDATE_OPS, op_color
from ..telemetry import ClientInfo, CycleRecord, GilStall, QueueDepthRecord, RequestRecord

__all__ = ["CLIENT_COLORS", "DashboardFigures"]

CLIENT_COLORS = ("#0f766e", "#dc2626", "#7c3aed", "#ca8a04", "#db2777", "#2563eb", "#16a34a", "#475569")
# cycle bands, alternating: slate for cycles that ran work, pale amber for idle ones
_BAND_FILL = {False: ("#e2e8f0", "#edf1f6"), True: ("#fbf0d9", "#fdf7ea")}
_FONT = "Inter, 'Segoe UI', Helvetica, Arial, sans-serif"


def _style(fig, title: str) -> None:
    fig.title.text = title
    fig.title.text_font = _FONT
    fig.title.text_font_size = "11pt"
    fig.title.text_color = "#111827"
    fig.outline_line_color = "#e5e7eb"
    fig.background_fill_color = "#ffffff"
    fig.border_fill_color = "#ffffff"
    for axis in (*fig.xaxis, *fig.yaxis):
        axis.axis_line_color = "#d1d5db"
        axis.major_tick_line_color = "#d1d5db"
        axis.minor_tick_line_color = None
        axis.major_label_text_color = "#4b5563"
        axis.major_label_text_font_size = "8pt"
        axis.axis_label_text_font_size = "8pt"
        axis.axis_label_text_color = "#6b7280"
        axis.axis_label_text_font_style = "normal"
    fig.xgrid.grid_line_color = None
    fig.ygrid.grid_line_color = "#f1f5f9"
    fig.toolbar.logo = None


class _ClientViews:
    __slots__ = ("client_id", "label", "lane", "color", "loss", "step", "ema", "ema_weight")

    def __init__(self, client_id: str, label: str, lane: int, color: str):
        self.client_id, self.label, self.lane, self.color = client_id, label, lane, color
        self.loss = ColumnDataSource(data={"step": [], "loss": [], "smooth": []})
        self.step = 0
        self.ema = 0.0
        self.ema_weight = 0.0


class DashboardFigures:
    """Timeline + queue depth (one time axis) beside the loss curves, as one bokeh layout."""

    def __init__(self, t0: float, *, window: int = 24, max_clients: int = 8, bars: int = 1500,
                 loss_points: int = 2000, smoothing: float = 0.1, width: int = 760, loss_width: int = 430):
        self.t0 = t0
        self.window = max(4, int(window))
        self.max_clients = max_clients
        self.bar_rollover = bars
        self.loss_rollover = loss_points
        self.smoothing = smoothing
        self.band_rollover = 4 * self.window
        self.queue_rollover = 4 * self.window
        self.width = width
        self.clients: dict[str, _ClientViews] = {}
        self._band_starts: deque[float] = deque(maxlen=self.window)
        self._last_end: float | None = None
        self._cycle_s: deque[float] = deque(maxlen=32)
        self._durations: deque[float] = deque(maxlen=self.window)
        self._last_label_mid: float | None = None
        self._depth_max: deque[int] = deque(maxlen=self.window)
        self._boundary_t: list[float] = []
        self._boundary_i: list[int] = []
        self.streams = 0  # stream() calls made (for tests: one per source per update at most)

        self.x_range = Range1d(start=0.0, end=1.0)
        self._lanes_range = Range1d(start=-0.6, end=0.95)
        tl = figure(height=250, width=width, x_range=self.x_range, y_range=self._lanes_range,
                    tools="xpan,xwheel_zoom,reset", toolbar_location=None, x_axis_label="time (s)")
        _style(tl, "Cycle timeline — a lane per client; bands are cycles (amber: idle)")
        tl.yaxis.ticker = FixedTicker(ticks=[])
        tl.yaxis.major_label_overrides = {}
        tl.ygrid.grid_line_color = None
        self.bands = ColumnDataSource(data={"left": [], "right": [], "fill": [], "mid": [],
                                            "label": [], "index": []})
        tl.quad(left="left", right="right", bottom=-(max_clients + 0.5), top=1.5, source=self.bands,
                fill_color="fill", line_color="#ffffff", line_width=0.5, level="underlay")
        tl.add_layout(LabelSet(x="mid", y=0.62, text="label", source=self.bands, text_font_size="7.5pt",
                               text_align="center", text_color="#64748b"))
        self.bars = ColumnDataSource(data={
            "left": [], "right": [], "bottom": [], "top": [], "color": [], "op": [], "rid": [], "client": [],
            "cycle": [], "wait_ms": [], "waited": [], "run_ms": [], "status": []})
        bar_glyphs = tl.quad(left="left", right="right", bottom="bottom", top="top", source=self.bars,
                       fill_color="color", line_color="color", fill_alpha=0.9)
        tl.add_tools(HoverTool(renderers=[bar_glyphs], tooltips=[
            ("request", "#@rid @op"), ("client", "@client"), ("cycle", "@cycle"),
            ("waited in queue", "@wait_ms{0.0} ms (@waited cycles)"), ("ran", "@run_ms{0.00} ms"),
            ("status", "@status")]))
        tl.add_layout(Legend(items=[LegendItem(label={"field": "op"}, renderers=[bar_glyphs])],
                             orientation="horizontal",
                             location="top_left", label_text_font_size="8pt", glyph_width=14, glyph_height=10,
                             spacing=12, padding=4, margin=2, border_line_color=None,
                             background_fill_alpha=0.0), "below")
        self.timeline = tl
        self._add_gil_shading(tl, max_clients)

        self._depth_range = Range1d(start=0, end=4)
        qd = figure(height=160, width=width, x_range=self.x_range, y_range=self._depth_range,
                    tools="xpan,xwheel_zoom,reset", toolbar_location=None, y_axis_label="queued")
        _style(qd, "Queue depth at each cycle boundary")
        qd.yaxis.ticker = BasicTicker(desired_num_ticks=4, min_interval=1)
        # one source for every lane (a column per lane): one stream per tick, not one per client
        self.queue = ColumnDataSource(data={"t": [], **{f"d{i}": [] for i in range(max_clients)}})
        # Legends exist from the start (items are appended per client): a legend added later
        # and configured in the same patch makes BokehJS fail with "cannot find a view".
        qd.add_layout(Legend(items=[], location="top_left", orientation="horizontal", label_text_font_size="8pt",
                             background_fill_alpha=0.6, border_line_color=None, padding=2, spacing=8,
                             glyph_width=14, glyph_height=8), "center")
        self.queue_fig = qd

        self.loss_figs = []
        for kind in ("linear", "log"):
            lf = figure(height=410, width=loss_width, y_axis_type=kind, tools="pan,wheel_zoom,box_zoom,reset",
                        toolbar_location=None, x_axis_label="step", y_axis_label="loss per token",
                        visible=(kind == "linear"))
            _style(lf, "Loss per token (thin: raw, thick: smoothed)" + (" — log scale" if kind == "log" else ""))
            lf.add_layout(Legend(items=[], location="top_right", label_text_font_size="8pt",
                                 background_fill_alpha=0.8, border_line_color="#e5e7eb", click_policy="hide",
                                 padding=4, spacing=1), "center")
            self.loss_figs.append(lf)
        self.layout = row(column(tl, qd, spacing=2), column(*self.loss_figs), spacing=8)

    # -- clients (lanes) ----------------------------------------------------------------------
    def add_client(self, info: ClientInfo) -> bool:
        if info.client_id in self.clients or len(self.clients) >= self.max_clients:
            return False
        labels = {v.label for v in self.clients.values()}
        label = info.label if info.label not in labels else f"{info.label} ({info.client_id})"
        lane = len(self.clients)
        views = _ClientViews(info.client_id, label, lane, CLIENT_COLORS[lane % len(CLIENT_COLORS)])
        self.clients[info.client_id] = views
        n = len(self.clients)
        tl = self.timeline
        self._lanes_range.start = -(n - 1) - 0.6
        tl.yaxis.ticker = FixedTicker(ticks=[-v.lane for v in self.clients.values()])
        tl.yaxis.major_label_overrides = {-v.lane: v.label for v in self.clients.values()}
        # equal depths overlap exactly: earlier lanes are drawn wider, so every line stays visible
        step = self.queue_fig.step(x="t", y=f"d{lane}", source=self.queue, mode="after", line_color=views.color,
                                   line_width=max(1.5, 6.0 - 1.5 * lane), line_alpha=0.9, name=f"d{lane}")
        self.queue_fig.add_tools(HoverTool(renderers=[step], tooltips=[("client", label), ("queued", f"@d{lane}")],
                                           mode="vline"))
        legend = self.queue_fig.legend[0]
        legend.items = [*legend.items, LegendItem(label=label, renderers=[step])]
        for lf in self.loss_figs:
            raw = lf.line(x="step", y="loss", source=views.loss, line_color=views.color, line_alpha=0.25,
                          line_width=1)
            smooth = lf.line(x="step", y="smooth", source=views.loss, line_color=views.color, line_width=2.5)
            lf.legend[0].items = [*lf.legend[0].items, LegendItem(label=label, renderers=[raw, smooth])]
        return True

    def set_log_scale(self, on: bool) -> None:
        linear, log = self.loss_figs
        if log.visible != on:
            log.visible, linear.visible = on, not on

    # -- streaming -----------------------------------------------------------------------------------
    def _rel(self, t: float) -> float:
        return round(t - self.t0, 6)

    def cycle_estimate(self) -> float:
        return cycle_duration(self._cycle_s, default=None, window=len(self._cycle_s) or 1) or 0.05

    def _label(self, index: int, left: float, right: float) -> str:
        """The band's label, or "" where it would overlap the previous one (about 6 px a digit)."""
        span = sum(self._durations) or 1e-9
        px_per_s = self.width / span
        mid = (left + right) / 2
        need = 6.0 * len(str(index)) + 8
        if self._last_label_mid is not None and (mid - self._last_label_mid) * px_per_s < need:
            return ""
        self._last_label_mid = mid
        return str(index)

    def _stream(self, source: ColumnDataSource, data: dict, rollover: int) -> None:
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
        """The timeline's cycle bands (and the durations the labels and bars are sized by)."""
        if not cycles:
            return False
        for c in cycles:
            if c.ended_at > c.started_at:
                self._cycle_s.append(c.ended_at - c.started_at)
            self._durations.append(max(0.0, c.ended_at - c.started_at))
        data: dict[str, list] = {k: [] for k in self.bands.data}
        for c in cycles:
            left, right = self._rel(c.started_at), self._rel(max(c.ended_at, c.started_at))
            idle = c.n_requests == 0
            data["left"].append(left)
            data["right"].append(right)
            data["mid"].append(round((left + right) / 2, 6))
            data["fill"].append(_BAND_FILL[idle][c.index % 2])
            data["label"].append(self._label(c.index, left, right))
            data["index"].append(c.index)
            self._band_starts.append(left)
            self._last_end = right
        self._stream(self.bands, data, self.band_rollover)
        return True

    def _stream_queue(self, boundaries: list[QueueDepthRecord]) -> bool:
        """Queue depths at each boundary: one column per lane, one source for all lanes."""
        if not boundaries:
            return False
        self._boundary_t.extend(b.time for b in boundaries)
        self._boundary_i.extend(b.cycle for b in boundaries)
        if len(self._boundary_t) > 8192:
            del self._boundary_t[:4096], self._boundary_i[:4096]
        rows: dict[str, list] = {k: [] for k in self.queue.data}
        lanes = [(f"d{v.lane}", cid) for cid, v in self.clients.items()]
        absent = [k for k in rows if k != "t" and k not in {name for name, _ in lanes}]
        for b in boundaries[-self.queue_rollover:]:
            rows["t"].append(self._rel(b.time))
            depth_max = 0
            for name, cid in lanes:
                depth = b.depths.get(cid, 0)
                rows[name].append(depth)
                depth_max = max(depth_max, depth)
            for name in absent:
                rows[name].append(0)
            self._depth_max.append(depth_max)
        changed = False
        if self.clients:
            self._stream(self.queue, rows, self.queue_rollover)
            changed = True
        top = max(4, max(self._depth_max, default=0) + 1)
        if self._depth_range.end != top:
            self._depth_range.end = top
        return changed

    def _stream_bars(self, delivered: list[RequestRecord]) -> bool:
        """A bar per request that ran, in its client's lane, coloured by op (red: failed)."""
        min_w = max(0.0015, 0.05 * self.cycle_estimate())
        bars: dict[str, list] = {k: [] for k in self.bars.data}
        for r in delivered:
            if r.started_at is None or r.finished_at is None:
                continue  # cancelled, or failed before it ran
            views = self.clients[r.client_id]
            left = self._rel(r.started_at)
            y = -views.lane
            bars["left"].append(left)
            bars["right"].append(round(max(self._rel(r.finished_at), left + min_w), 6))
            bars["bottom"].append(y - 0.3)
            bars["top"].append(y + 0.3)
            bars["color"].append(op_color(r.op) if r.status == "ok" else "#991b1b")
            bars["op"].append(r.op)
            bars["rid"].append(r.request_id)
            bars["client"].append(views.label)
            bars["cycle"].append(r.cycle if r.cycle is not None else -1)
            bars["wait_ms"].append(round((r.started_at - r.queued_at) * 1e3, 2))
            waited = self._waited_cycles(r)
            bars["waited"].append(waited if waited is not None else -1)
            bars["run_ms"].append(round((r.finished_at - r.started_at) * 1e3, 3))
            bars["status"].append(r.status)
        if not bars["left"]:
            return False
        keep = self.bar_rollover
        self._stream(self.bars, {k: v[-keep:] for k, v in bars.items()}, keep)
        return True

    def _stream_losses(self, delivered: list[RequestRecord]) -> bool:
        """Each client's loss per token (raw and smoothed) of its successful updates."""
        losses: dict[str, dict[str, list]] = {}
        for r in delivered:
            if r.op not in UPDATE_OPS or r.status != "ok":
                continue
            loss = record_loss(r.metrics)
            if not math.isfinite(loss):
                continue
            views = self.clients[r.client_id]
            views.step += 1
            a = self.smoothing
            views.ema = (1 - a) * views.ema + a * loss
            views.ema_weight = (1 - a) * views.ema_weight + a
            d = losses.setdefault(r.client_id, {"step": [], "loss": [], "smooth": []})
            d["step"].append(views.step)
            d["loss"].append(round(loss, 6))
            d["smooth"].append(round(views.ema / views.ema_weight, 6))
        for cid, d in losses.items():
            self._stream(self.clients[cid].loss, d, self.loss_rollover)
        return bool(losses)

    def _follow_time(self) -> bool:
        """The shared time axis shows the cycles the bands still hold."""
        if self._last_end is None or not self._band_starts:
            return False
        start, end = self._band_starts[0], self._last_end
        if end - start < 1e-3:
            end = start + 1e-3
        if (self.x_range.start, self.x_range.end) == (start, end):
            return False
        self.x_range.update(start=start, end=end)
        return True

    # -- GIL stalls: shading across the lanes -------------------------------------------------
    def _add_gil_shading(self, tl, max_clients: int) -> None:
        """Red shading over the lanes where other Python held the interpreter (GIL) and the
        pool waited for it (above the cycle bands, below the request bars)."""
        self.gil = ColumnDataSource(data={"left": [], "right": [], "what": []})
        shade = tl.quad(left="left", right="right", bottom=-(max_clients + 0.5), top=1.5, source=self.gil,
                        fill_color="#dc2626", fill_alpha=0.14, line_color=None, level="underlay")
        tl.add_tools(HoverTool(renderers=[shade], tooltips=[("GIL held by", "@what")]))

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
        self._stream(self.gil, {k: v[-self.band_rollover:] for k, v in data.items()}, self.band_rollover)
        return True

    def loss_points(self, client_id: str) -> int:
        return len(self.clients[client_id].loss.data["step"])
