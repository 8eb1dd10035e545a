"""The dashboard's buttons and settings: every widget event becomes one command.

Widget callbacks may run on another thread than the dashboard's loop (ipykernel 7 runs
comms on subshell threads), so they only call `on_command(command, argument)`, which the
dashboard makes thread-safe; the widgets themselves are changed on the loop (`show`,
`enable`, `note`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ..loop import MODES

__all__ = ["Controls"]

_BUTTONS = (("Start", "success", "train `runs` clients on the addition task"),
            ("Pause", "warning", "pause at the next update"),
            ("Resume", "info", "resume"),
            ("Stop", "danger", "stop at the next update"))
_EXPORTS = (("trace", "Export trace (Perfetto)"), ("metrics", "Export metrics.jsonl"),
            ("html", "Save HTML snapshot"))
# which buttons a state of the runs enables
_ENABLED = {"Start": ("idle", "stopped", "error"), "Pause": ("running",), "Resume": ("paused", "pausing"),
            "Stop": ("running", "paused", "pausing")}


class Controls:
    def __init__(self, settings: dict[str, Any], max_clients: int, on_command: Callable[[str, Any], None]):
        narrow = {"description_width": "initial"}
        self.buttons: dict[str, W.Button] = {}
        for name, style, tip in _BUTTONS:
            b = W.Button(description=name, button_style=style, tooltip=tip, layout=W.Layout(width="78px"))
            b.add_class(f"trio-{name.lower()}")
            b.on_click(lambda _b, cmd=name.lower(): on_command(cmd, None))
            self.buttons[name] = b
        self.settings: dict[str, W.DOMWidget] = {
            "mode": W.Dropdown(options=list(MODES), value=settings["mode"], description="mode", style=narrow,
                               layout=W.Layout(width="160px")),
            "lookahead": W.BoundedIntText(value=settings["lookahead"], min=0, max=8, description="lookahead",
                                          style=narrow, layout=W.Layout(width="120px")),
            "lr": W.BoundedFloatText(value=settings["lr"], min=1e-6, max=1.0, step=5e-4, description="lr",
                                     style=narrow, layout=W.Layout(width="130px")),
            "batch_size": W.BoundedIntText(value=settings["batch_size"], min=1, max=64, description="batch",
                                           style=narrow, layout=W.Layout(width="105px")),
            "runs": W.BoundedIntText(value=settings["runs"], min=1, max=max_clients, description="runs",
                                     style=narrow, layout=W.Layout(width="95px"),
                                     tooltip="a learning-rate sweep, applied at Start"),
            "log": W.ToggleButton(value=settings["log"], description="log y", tooltip="loss on a log scale",
                                  layout=W.Layout(width="70px")),
        }
        for key, w in self.settings.items():
            w.observe(lambda change, key=key: on_command("setting", (key, change["new"])), names="value")
        self.bar = W.HBox([*self.buttons.values(), W.HTML("&nbsp;"), *self.settings.values()],
                          layout=W.Layout(flex_flow="row wrap", align_items="center", margin="4px 0 6px 0"))
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
        return [*self.buttons.values(), *self.settings.values(), self.bar, *self.export_buttons.values(),
                self.export_note, self.exports]

    def enable(self, state: str) -> None:
        """Enable the buttons that make sense in `state` (of the Start runs)."""
        for name, b in self.buttons.items():
            disabled = state not in _ENABLED[name]
            if b.disabled != disabled:
                b.disabled = disabled

    def show(self, key: str, value: Any) -> None:
        w = self.settings[key]
        if w.value != value:
            w.value = value

    def note(self, text: str) -> None:
        self.export_note.value = text
