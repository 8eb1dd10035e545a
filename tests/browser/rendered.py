"""What a dashboard's plots show in the page, read from BokehJS and from screenshots (issue 34).

Not a test module. `plots(page, within)` reads every visible bokeh figure under the element
`within` from the page's own views: its title, x and y ranges, where its frame (the data area)
is on the page, and for each visible glyph renderer the rows it holds (their x and y extent, how
many lie in the x range). `check_rendered` asserts that a dashboard's main plots are drawn:

* the x and y ranges cover the data: no row is right of the view; of each renderer with a y
  (bars, lines) the newest row is in view, most rows are (a rolling window holds a little
  history before what it shows), and every row's y is;
* the frame, cut from a screenshot, has pixels other than the background (white; grid lines
  and the frame's outline are near-white and do not count);

and `check_moved_on` that a second reading, taken later, shows the view moved on: the x range
advanced and the plot's pixels changed (data or time axis). `drawn` reads and checks again while
a stream the page got an instant before is not painted yet.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import ARTIFACTS

# Every figure whose view is under `within` (bokeh's views live in shadow roots: walked from
# Bokeh.index's roots, the views of the page's documents).
PLOTS_JS = """
(within) => {
  const host = document.querySelector(within);
  if (host == null || !window.Bokeh || !Bokeh.index) return [];
  const figs = [], seen = new Set();
  const walk = (v) => {
    if (v == null || seen.has(v)) return;
    seen.add(v);
    if (v.frame != null && v.model.x_range != null) figs.push(v);
    for (const c of (v.child_views || [])) walk(c);
  };
  for (const root of (Bokeh.index.roots || [])) {
    if (root.el != null && root.el.isConnected && host.contains(root.el.getRootNode().host || root.el)) walk(root);
  }
  const column = (data, name) => (data instanceof Map ? data.get(name) : data[name]);
  const field = (glyph, names) => {
    for (const n of names) {
      const s = glyph[n];
      if (s != null && typeof s === "object" && "field" in s) return s.field;
    }
    return null;
  };
  const out = [];
  for (const v of figs) {
    const m = v.model;
    if (!m.visible || !v.canvas_view || !v.canvas_view.el.isConnected) continue;
    const canvas = v.canvas_view.el.getBoundingClientRect();
    if (canvas.width === 0) continue;
    const b = v.frame.bbox;
    const x0 = m.x_range.start, x1 = m.x_range.end, y0 = m.y_range.start, y1 = m.y_range.end;
    const renderers = [];
    for (const r of m.renderers) {
      if (!r.visible || r.glyph == null || r.data_source == null) continue;
      const data = r.data_source.data;
      const xs = ["left", "right", "x"].map((n) => field(r.glyph, [n])).filter((f) => f != null);
      const ys = ["bottom", "top", "y"].map((n) => field(r.glyph, [n])).filter((f) => f != null);
      const cols = (names) => names.map((n) => column(data, n)).filter((c) => c != null);
      const xc = cols(xs), yc = cols(ys);
      const n = xc.length ? xc[0].length : 0;
      let rows = 0, inside = 0, xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
      for (let i = 0; i < n; i++) {
        const rx = xc.map((c) => Number(c[i])).filter(Number.isFinite);
        const ry = yc.map((c) => Number(c[i])).filter(Number.isFinite);
        if (!rx.length) continue;
        rows++;
        const lo = Math.min(...rx), hi = Math.max(...rx);
        xmin = Math.min(xmin, lo); xmax = Math.max(xmax, hi);
        if (hi >= Math.min(x0, x1) && lo <= Math.max(x0, x1)) inside++;
        for (const y of ry) { ymin = Math.min(ymin, y); ymax = Math.max(ymax, y); }
      }
      if (rows) renderers.push({glyph: r.glyph.type, rows, inside, x: [xmin, xmax], y: [ymin, ymax]});
    }
    out.push({title: (m.title && m.title.text) || "", x: [x0, x1], y: [y0, y1], log_y: m.y_scale.type === "LogScale",
              canvas: {x: canvas.left, y: canvas.top, width: canvas.width, height: canvas.height},
              frame: {x: canvas.left + b.x0, y: canvas.top + b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0},
              renderers});
  }
  return out;
}
"""


@dataclass
class Plot:
    title: str
    x: tuple[float, float]
    y: tuple[float, float]
    frame: dict[str, float]
    canvas: dict[str, float]
    renderers: list[dict[str, Any]]
    shot: bytes = b""  # the frame, as a PNG cut from a screenshot
    whole: bytes = b""  # the whole plot (axes, ticks and title too)

    @property
    def rows(self) -> int:
        return sum(r["rows"] for r in self.renderers)

    def drawn_pixels(self) -> int:
        """Pixels of the frame (2 px in from its outline) farther than 24/255 from white in some
        channel: what bokeh drew there, not the background, its grid or its outline."""
        import numpy as np
        from PIL import Image

        img = Image.open(io.BytesIO(self.shot)).convert("RGB")
        w, h = img.size
        px = np.asarray(img.crop((2, 2, max(3, w - 2), max(3, h - 2))))
        return int((px.min(axis=2) < 231).sum())

    def differs_from(self, other: Plot) -> int:
        """Pixels that changed between two cuts of the whole plot (its time axis moves on even
        where the data drew the same picture: a queue that stays at one)."""
        import numpy as np
        from PIL import Image, ImageChops

        a = Image.open(io.BytesIO(self.whole)).convert("L")
        b = Image.open(io.BytesIO(other.whole)).convert("L")
        if a.size != b.size:
            return a.size[0] * a.size[1]
        diff = ImageChops.difference(a, b)
        return int((np.asarray(diff) > 24).sum())


def show_whole(page: Any, within: str = ".trio-dashboard") -> None:
    """Make the window tall enough for all of `within` (same width: the layout stays) and scroll
    it into view: every frame can be cut from a screenshot, and the view counts as seen (a
    dashboard sends nothing to a view nobody sees)."""
    element = page.locator(within).first
    size = page.viewport_size
    height = int(element.evaluate("(el) => el.getBoundingClientRect().height"))
    if size is not None and height + 250 > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": height + 250})
        page.wait_for_timeout(1000)  # bokeh lays out again after a resize
    element.scroll_into_view_if_needed()
    page.wait_for_timeout(300)


def plots(page: Any, within: str = ".trio-dashboard", *, name: str | None = None) -> list[Plot]:
    """The visible figures under `within`, each with a screenshot of its frame (saved as
    artifacts/<name>-<i>.png when `name` is given). Call `show_whole` first."""
    found = []
    for i, raw in enumerate(page.evaluate(PLOTS_JS, within)):
        p = Plot(raw["title"], tuple(raw["x"]), tuple(raw["y"]), raw["frame"], raw["canvas"], raw["renderers"])
        f, c = p.frame, p.canvas
        if f["width"] >= 4 and f["height"] >= 4:
            p.shot = page.screenshot(clip={"x": f["x"], "y": f["y"], "width": f["width"], "height": f["height"]})
            p.whole = page.screenshot(clip={"x": c["x"], "y": c["y"], "width": c["width"], "height": c["height"]})
            if name:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                Path(ARTIFACTS / f"{name}-{i}.png").write_bytes(p.shot)
        found.append(p)
    return found


def drawn(page: Any, titles: list[str], within: str = ".trio-dashboard", *, name: str | None = None,
          tries: int = 4) -> dict[str, Plot]:
    """`check_rendered` of `plots`, read again (up to `tries` times, 0.5 s apart) while it fails: a
    stream that reached the page an instant before the reading is not painted yet, and BokehJS moves
    an auto-ranged view (the loss plots) on its next paint, so such a reading holds rows right of the
    view. A view that never covers its data fails every time."""
    for attempt in range(tries):
        try:
            return check_rendered(plots(page, within, name=name), titles)
        except AssertionError:
            if attempt == tries - 1:
                raise
            page.wait_for_timeout(500)
    raise AssertionError("tries must be at least 1")


def check_rendered(shown: list[Plot], titles: list[str]) -> dict[str, Plot]:
    """Each plot whose title starts with one of `titles` is there, drawn, with ranges covering
    its data; returns them by that title."""
    by = {}
    for want in titles:
        match = [p for p in shown if p.title.startswith(want)]
        assert match, f"no visible plot titled {want!r}: {[p.title for p in shown]}"
        p = by[want] = match[0]
        assert p.rows > 0, f"{want!r} holds no rows: {p.renderers}"
        x0, x1 = min(p.x), max(p.x)
        assert (x0, x1) != (0.0, 1.0) and x1 > x0, f"{want!r}: the x range is still {p.x}"
        span = x1 - x0
        y0, y1 = min(p.y), max(p.y)
        data = [r for r in p.renderers if math.isfinite(r["y"][0])]
        assert data, f"{want!r}: no rows with a y (bars, lines): {p.renderers}"
        for r in p.renderers:
            # nothing held is ahead of the view (a bar may be drawn a little wider than it ran)
            assert r["x"][1] <= x1 + 0.1 * span, f"{want!r}: a row at {r['x'][1]} right of {p.x}: {r}"
        for r in data:
            # the newest row is in view, and most rows are; every row's y is. (Shading that spans
            # the whole height, cycle bands and GIL stalls, rolls over by count: only the above.)
            assert x0 <= r["x"][1], f"{want!r}: the newest row, at {r['x'][1]}, is left of {p.x}: {r}"
            assert r["inside"] >= 0.5 * r["rows"], f"{want!r}: most rows outside the x range {p.x}: {r}"
            assert y0 <= r["y"][0] and r["y"][1] <= y1, f"{want!r}: y data {r['y']} outside {p.y}"
        drawn = p.drawn_pixels()
        area = p.frame["width"] * p.frame["height"]
        assert drawn >= max(50, 0.002 * area), f"{want!r}: {drawn} drawn pixels of {area:.0f} in its frame"
    return by


def check_moved_on(before: dict[str, Plot], after: list[Plot]) -> None:
    """The same plots, later: each time axis moved on, and each frame's pixels changed."""
    for want, old in before.items():
        new = next((p for p in after if p.title.startswith(want)), None)
        assert new is not None, f"{want!r} is gone: {[p.title for p in after]}"
        assert new.x != old.x, f"{want!r}: the x range stood still at {old.x}"
        assert new.differs_from(old) >= 50, f"{want!r}: the picture did not change"
