"""The dashboard's buttons and settings: every widget event becomes one command.

Widget callbacks may run on another thread than the dashboard's (ipykernel 7 runs comms on
subshell threads), so they only call `on_command(command, argument)`, which the dashboard
makes thread-safe; the widgets themselves are changed on the dashboard's thread (`show`,
`enable`, `note`, `ask`).

Settings are plain text fields, not bounded ones: a bounded field clamps in the browser
without a word. The dashboard checks every value (:func:`check_setting`), says what it
changed, and asks before using a learning rate far outside the usual range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ..loop import MODES

__all__ = ["INT_RANGES", "LR_USUAL", "WHY_ALL", "Controls", "check_setting"]

_BUTTONS = (("Start", "success", "train `runs` clients on the addition task"),
            ("Pause", "warning", "pause at the next update"),
            ("Resume", "info", "resume"),
            ("Stop", "danger", "stop at the next update"))
_BUTTONS_TIPS = {name: tip for name, _style, tip in _BUTTONS}
_EXPORTS = (("trace", "Export trace (Perfetto)"), ("metrics", "Export metrics.jsonl"),
            ("html", "Save HTML snapshot"))
# which buttons a state of the runs enables
_ENABLED = {"Start": ("idle", "stopped", "error"), "Pause": ("running",), "Resume": ("paused", "pausing"),
            "Stop": ("running", "paused", "pausing")}
# why a button is disabled, by button, in a state of the runs (its tooltip says it)
_WHY = {"Start": "the runs of the last Start are {state}: Stop them first",
        "Pause": "no Start run is running", "Resume": "no Start run is paused",
        "Stop": "no Start run is running or paused"}
#: why every button is disabled, in a state that is not the runs' (the page says it beside them)
WHY_ALL = {"no pool": "no pool yet: build one (trio.LocalPool) in any cell and the dashboard shows it",
           "closed": "the pool is closed: build a new one (trio.LocalPool) and the dashboard follows it",
           "watching": "this dashboard only watches (others' loops train); these buttons drive Start runs "
                       "on a pool in this kernel: trio.Dashboard(pool)"}
#: integer settings: (lowest, highest)
INT_RANGES = {"lookahead": (0, 8), "batch_size": (1, 64), "runs": (1, 16)}
#: learning rates outside this range are used only once confirmed (LoRA with Adam: ~1e-5 ... 1e-2)
LR_USUAL = (1e-6, 0.1)
_NAMES = {"lookahead": "lookahead", "batch_size": "batch", "runs": "runs", "lr": "lr"}


def check_setting(key: str, value: Any, current: Any) -> tuple[str, Any, str]:
    """How to treat a new value of a setting: ("apply", value, note), ("refuse", current, why)
    or ("confirm", value, question). `note` says what was changed ("" if nothing)."""
    name = _NAMES.get(key, key)
    if key in INT_RANGES:
        low, high = INT_RANGES[key]
        try:
            number = int(value)
        except (TypeError, ValueError):
            return "refuse", current, f"{name} must be a whole number from {low} to {high}: kept {current}"
        if number < low or number > high:
            clamped = min(max(number, low), high)
            return "apply", clamped, f"{name} {number} is outside {low}–{high}: using {clamped}"
        return "apply", number, ""
    if key == "lr":
        try:
            lr = float(value)
        except (TypeError, ValueError):
            lr = math.nan
        if not (math.isfinite(lr) and lr > 0):
            return "refuse", current, f"lr must be a number above 0 (got {value!r}): kept {current:g}"
        if lr < LR_USUAL[0] or lr > LR_USUAL[1]:
            return "confirm", lr, (f"lr={lr:g} is far outside {LR_USUAL[0]:g}–{LR_USUAL[1]:g}, the usual range "
                                   f"for LoRA with Adam (the loss may blow up). Apply it to the running runs?")
        return "apply", lr, ""
    if key == "mode" and value not in MODES:
        return "refuse", current, f"mode must be one of {', '.join(MODES)}: kept {current}"
    return "apply", value, ""


class Controls:
    def __init__(self, settings: dict[str, Any], on_command: Callable[[str, Any], None]):
        self.buttons: dict[str, W.Button] = {}
        for name, style, tip in _BUTTONS:
            b = W.Button(description=name, button_style=style, tooltip=tip, layout=W.Layout(width="80px"))
            b.add_class(f"trio-{name.lower()}")
            b.on_click(lambda _b, cmd=name.lower(): on_command(cmd, None))
            self.buttons[name] = b

        def field(cls: type, key: str, label: str, width: str, **kw: Any) -> W.DOMWidget:
            w = cls(value=settings[key], description=label, style={"description_width": "initial"},
                    layout=W.Layout(width=width), **kw)
            w.add_class(f"trio-setting-{key}")
            return w

        self.settings: dict[str, W.DOMWidget] = {
            "mode": field(W.Dropdown, "mode", "mode", "150px", options=list(MODES)),
            "lookahead": field(W.IntText, "lookahead", "lookahead", "112px"),
            "lr": field(W.FloatText, "lr", "lr", "118px"),
            "batch_size": field(W.IntText, "batch_size", "batch", "92px"),
            "runs": field(W.IntText, "runs", "runs", "84px", tooltip="a learning-rate sweep, applied at Start"),
            "log": W.ToggleButton(value=settings["log"], description="log y", tooltip="loss on a log scale",
                                  layout=W.Layout(width="64px")),
        }
        for key, w in self.settings.items():
            w.observe(lambda change, key=key: on_command("setting", (key, change["new"])), names="value")
        # asked for when a value needs a yes (a learning rate far outside the usual range)
        self.confirm = W.Button(description="Apply", button_style="warning", layout=W.Layout(width="68px",
                                display="none"))
        self.confirm.add_class("trio-confirm")
        self.confirm.on_click(lambda _b: on_command("confirm", None))
        self.setting_note = W.HTML("")
        self.setting_note.add_class("trio-setting-note")
        # more lanes than the timeline shows: this scrolls them (hidden until then)
        self.lanes = W.IntSlider(value=1, min=1, max=1, description="lanes", readout=False,
                                 continuous_update=False, style={"description_width": "initial"},
                                 layout=W.Layout(width="300px", display="none"))
        self.lanes.add_class("trio-lanes")
        self.lanes.observe(lambda change: on_command("lanes", change["new"]), names="value")
        row = W.Layout(flex_flow="row wrap", align_items="center", margin="2px 0")
        # why the buttons are disabled, when it is not the runs' state (a watching dashboard, a closed pool)
        self.why = W.HTML("", layout=W.Layout(margin="0 0 0 8px"))
        self.why.add_class("trio-why")
        self.button_bar = W.HBox([*self.buttons.values(), self.why], layout=row)
        self.settings_bar = W.HBox([*self.settings.values(), self.confirm], layout=row)
        self.bar = W.VBox([self.button_bar, self.settings_bar, self.setting_note, self.lanes],
                          layout=W.Layout(margin="4px 0 6px 0"))
        self.export_buttons: dict[str, W.Button] = {}
        for key, label in _EXPORTS:
            b = W.Button(description=label, icon="download", layout=W.Layout(width="auto"))
            b.on_click(lambda _b, cmd=key: on_command("export", cmd))
            self.export_buttons[key] = b
        self.export_note = W.HTML("")
        self.export_note.add_class("trio-exports")
        self.exports = W.HBox([*self.export_buttons.values(), self.export_note],
                              layout=W.Layout(align_items="center", margin="6px 0 0 0", flex_flow="row wrap"))

    @property
    def widgets(self) -> list[W.Widget]:
        """Every widget, containers last (the order they are closed in)."""
        return [*self.buttons.values(), self.why, *self.settings.values(), self.confirm, self.setting_note, self.lanes,
                *self.export_buttons.values(), self.export_note, self.button_bar, self.settings_bar, self.bar,
                self.exports]

    def enable(self, state: str) -> None:
        """Enable the buttons that make sense in `state` (of the Start runs, or "watching" /
        "closed"); a disabled one says why on hover, and beside them when none can be used."""
        every = WHY_ALL.get(state)
        tips = dict(_BUTTONS_TIPS)
        for name, b in self.buttons.items():
            disabled = state not in _ENABLED[name]
            if b.disabled != disabled:
                b.disabled = disabled
            why = every or _WHY[name].format(state=state)
            tip = f"disabled: {why}" if disabled else tips[name]
            if b.tooltip != tip:
                b.tooltip = tip
        text = f"<span class='trio-setting-note'>disabled: {every}</span>" if every else ""
        if self.why.value != text:
            self.why.value = text

    def show(self, key: str, value: Any) -> None:
        w = self.settings[key]
        if w.value != value:
            w.value = value

    def say(self, text: str) -> None:
        """A one-line remark under the settings (what was clamped, refused or needs a yes)."""
        if self.setting_note.value != text:
            self.setting_note.value = text

    def ask(self, question: str | None) -> None:
        """Show the Apply button with `question`, or hide it (None)."""
        self.say(f"<span class='trio-ask'>{question}</span>" if question else "")  # the question, then its button
        self.confirm.layout.display = None if question else "none"

    def show_lanes(self, first: int, total: int, visible: int) -> None:
        """The lane scroller: shown only when there are more lanes than the timeline shows."""
        more = total > visible
        display = None if more else "none"
        if self.lanes.layout.display != display:
            self.lanes.layout.display = display
        top = max(1, total - visible + 1)
        if self.lanes.max != top:
            self.lanes.max = top
        if more and self.lanes.value != first + 1:
            self.lanes.value = first + 1
        text = f"lanes {first + 1}–{min(first + visible, total)} of {total}"
        if self.lanes.description != text:
            self.lanes.description = text

    def note(self, text: str) -> None:
        self.export_note.value = text
