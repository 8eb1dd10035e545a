"""A room of participants, by name: one row each in a sortable table (issue 34, point 3).

A workshop is 40 people training on one served pool; a lane, a status entry and an advisor row
each would not be read. The room table shows, per training client: its name (the lane's label:
the name its client gave, else its session), cycles per update, the advisor's verdict, its
smoothed loss, and whether it is training, idle or finished. A finished participant keeps its
last verdict and loss, marked finished. The instructor sorts by any column and picks one
participant, whose lane the timeline then shows (first of its visible lanes).

Widget callbacks only call `on_command` (the dashboard makes that thread-safe); everything else
runs on the dashboard's thread. The table is plain HTML, rewritten at most once a second and
only when its text changed (each rewrite restyles the notebook page).
"""

from __future__ import annotations

import html
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from ..metrics import format_cycles, record_loss
from ..ops import UPDATE_OPS
from ..telemetry import RequestRecord

__all__ = ["SORT_KEYS", "Participant", "RoomTable"]

#: the table's columns, as the sort selector names them
SORT_KEYS = ("name", "cycles/update", "verdict", "loss", "status")
#: participants remembered (finished ones go first, oldest first, beyond this)
MAX_ROWS = 256
_ACTIVE_S = 2.0  # an update this recent: "training"
_SMOOTHING = 0.1
_EVERYONE = "-"

_CSS = """<style>
.trio-room table { border-collapse: collapse; font-size: 12px; width: 100%; font-variant-numeric: tabular-nums; }
.trio-room th { text-align: left; font-weight: 600; color: #374151; border-bottom: 1px solid #e5e7eb;
  padding: 2px 8px; white-space: nowrap; }
.trio-room td { padding: 0 8px; line-height: 1.5; color: #111827; white-space: nowrap;
  border-bottom: 1px solid #f3f4f6; }
.trio-room td .trio-badge { margin: 0; line-height: 1.45; }
.trio-room tr.finished td { color: #6b7280; }
.trio-room tr.picked td { background: #eff6ff; }
.trio-room .trio-room-note { font-size: 11.5px; color: #6b7280; }
</style>"""


@dataclass
class Participant:
    """What the table shows of one training client (the last values, kept once it finishes)."""

    client_id: str
    name: str
    color: str
    cycles: float | None = None
    cause: str = ""  # the advisor's, as it words it ("" until it has one)
    badge: str = "wait"  # the advisor's badge class: ok, wait, waste
    evidence: str = ""
    loss: float = math.nan
    updates: int = 0
    last_update_at: float = -math.inf
    finished: bool = False
    _ema: float = 0.0
    _weight: float = 0.0

    def status(self, now: float) -> str:
        if self.finished:
            return "finished"
        return "training" if now - self.last_update_at <= _ACTIVE_S else "idle"


class RoomTable:
    """The room's table and its two selectors (sort by, show the timeline of)."""

    def __init__(self, on_command: Callable[[str, Any], None]):
        self.people: OrderedDict[str, Participant] = OrderedDict()
        self.sort_key = "name"
        self.descending = False
        self.picked: str | None = None
        self._text = ""
        self.sort = W.Dropdown(options=list(SORT_KEYS), value="name", description="sort by",
                               style={"description_width": "initial"}, layout=W.Layout(width="190px"))
        self.sort.observe(lambda change: on_command("room", ("sort", change["new"])), names="value")
        self.order = W.ToggleButton(value=False, description="descending", tooltip="sort the other way round",
                                    layout=W.Layout(width="100px"))
        self.order.observe(lambda change: on_command("room", ("descending", change["new"])), names="value")
        self.pick = W.Dropdown(options=[("everyone (lanes in order)", _EVERYONE)], value=_EVERYONE,
                               description="timeline of", style={"description_width": "initial"},
                               layout=W.Layout(width="320px"))
        self.pick.observe(lambda change: on_command("room", ("pick", change["new"])), names="value")
        self.table = W.HTML("")
        self.table.add_class("trio-room-table")
        row = W.Layout(flex_flow="row wrap", align_items="center", margin="2px 0")
        self.bar = W.HBox([self.sort, self.order, self.pick], layout=row)
        self.box = W.VBox([self.bar, self.table], layout=W.Layout(margin="2px 0 6px 0", display="none"))
        self.box.add_class("trio-room")

    @property
    def widgets(self) -> list[W.Widget]:
        """Every widget, containers last (the order they are closed in)."""
        return [self.sort, self.order, self.pick, self.table, self.bar, self.box]

    # -- what happened (dashboard thread) ------------------------------------------------------
    def join(self, client_id: str, name: str, color: str) -> None:
        """A training client: a row of its own (a name it is given later replaces the old one)."""
        p = self.people.get(client_id)
        if p is None:
            self.people[client_id] = Participant(client_id, name, color)
            self._bound()
        else:
            p.name, p.color, p.finished = name, color, False

    def observe(self, delivered: Iterable[RequestRecord], now: float) -> None:
        """Each participant's updates: when the last one came, and the smoothed loss."""
        for r in delivered:
            p = self.people.get(r.client_id)
            if p is None or r.op not in UPDATE_OPS or r.status != "ok":
                continue
            p.updates += 1
            p.last_update_at = now
            loss = record_loss(r.metrics)
            if math.isfinite(loss):
                p._ema = (1 - _SMOOTHING) * p._ema + _SMOOTHING * loss
                p._weight = (1 - _SMOOTHING) * p._weight + _SMOOTHING
                p.loss = p._ema / p._weight

    def finish(self, client_id: str) -> None:
        """The client closed: its row stays, with its last verdict, marked finished."""
        p = self.people.get(client_id)
        if p is not None:
            p.finished = True

    def judge(self, client_id: str, cycles: float | None, cause: str | None, badge: str, evidence: str) -> None:
        """The latest cycles per update and verdict of a live participant (a finished one keeps its last)."""
        p = self.people.get(client_id)
        if p is None or p.finished:
            return
        if cycles is not None:
            p.cycles = cycles
        if cause:
            p.cause, p.badge, p.evidence = cause, badge, evidence

    def reset(self) -> None:
        """Another pool: another room."""
        self.people.clear()
        self.picked = None

    def _bound(self) -> None:
        while len(self.people) > MAX_ROWS:
            done = next((cid for cid, p in self.people.items() if p.finished), None)
            self.people.pop(done if done is not None else next(iter(self.people)))

    # -- what the instructor asks (dashboard thread) -------------------------------------------
    def command(self, what: str, value: Any) -> str | None:
        """Apply a selector's change; returns the client id picked (or None: everyone) for "pick"."""
        if what == "sort" and value in SORT_KEYS:
            self.sort_key = value
        elif what == "descending":
            self.descending = bool(value)
        elif what == "pick":
            self.picked = value if value in self.people else None
            return self.picked
        return None

    def rows(self, now: float) -> list[Participant]:
        """The participants in the table's order (unknown values last, whichever way it sorts)."""
        key = self.sort_key

        def value(p: Participant) -> Any:
            if key == "name":
                return p.name.lower()
            if key == "cycles/update":
                return p.cycles
            if key == "verdict":
                return p.cause or None
            if key == "loss":
                return p.loss if math.isfinite(p.loss) else None
            return p.status(now)

        known = [p for p in self.people.values() if value(p) is not None]
        unknown = [p for p in self.people.values() if value(p) is None]
        known.sort(key=lambda p: (value(p), p.name.lower()), reverse=self.descending)
        return known + unknown

    # -- what the page shows -------------------------------------------------------------------
    def render(self, now: float) -> None:
        """Rewrite the table (and the pick list) if its text changed; shown from the first row."""
        people = self.rows(now)
        display = None if people else "none"
        if self.box.layout.display != display:
            self.box.layout.display = display
        options = [("everyone (lanes in order)", _EVERYONE),
                   *sorted(((p.name + (" (finished)" if p.finished else ""), p.client_id)
                            for p in self.people.values()), key=lambda o: o[0].lower())]
        if list(self.pick.options) != options:
            value = self.picked if self.picked in self.people else _EVERYONE
            self.pick.options = options
            if self.pick.value != value:
                self.pick.value = value
        body = []
        for p in people:
            status = p.status(now)
            cycles = format_cycles(p.cycles) if p.cycles is not None else "–"
            verdict = (f"<span class='trio-badge {p.badge}' title='{html.escape(p.evidence)}'>"
                       f"{html.escape(p.cause)}</span>") if p.cause else "<i>measuring</i>"
            if p.finished and p.cause:
                verdict += " <span class='trio-room-note'>(last, finished)</span>"
            loss = f"{p.loss:.3f}" if math.isfinite(p.loss) else "–"
            classes = " ".join(c for c in ("finished" if p.finished else "",
                                           "picked" if p.client_id == self.picked else "") if c)
            body.append(f"<tr class='{classes}'><td><span class='trio-dot' style='background:{p.color}'></span>"
                        f"{html.escape(p.name)}</td><td>{cycles}</td><td>{verdict}</td><td>{loss}</td>"
                        f"<td>{status}</td><td>{p.updates}</td></tr>")
        arrow = " ▼" if self.descending else " ▲"
        head = "".join(f"<th>{name}{arrow if name == self.sort_key else ''}</th>"
                       for name in (*SORT_KEYS, "updates"))
        live = sum(1 for p in self.people.values() if not p.finished)
        text = (f"{_CSS}<div class='trio-room-note'>Room: {live} training client{'s' if live != 1 else ''}"
                f"{f', {len(people) - live} finished' if len(people) > live else ''}. Cycles per update: 1 is "
                f"pipelined; the verdict's words are the advisor's (hover: what it measured); loss: smoothed, "
                f"per token.</div><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table>")
        if text != self._text:
            self._text = text
            self.table.value = text

    def verdicts(self) -> Mapping[str, int]:
        """How many live participants each verdict has (the advisor's summary in a room)."""
        counts: dict[str, int] = {}
        for p in self.people.values():
            if not p.finished and p.cause:
                counts[p.cause] = counts.get(p.cause, 0) + 1
        return counts
