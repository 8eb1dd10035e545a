"""A run's loss curve with a bounded number of points, however long the run.

The browser redraws a whole line whenever a point is added to it, so a curve that grows
without bound makes every tick slower. A :class:`LossSeries` keeps every step of the last
`recent` steps and, before them, a decimated history of at most `history` points: buckets
of a power-of-two number of steps (mean step, mean raw loss, the smoothed value at the
bucket's end), merged pairwise whenever the history is full. TensorBoard bounds its scalar
series the same way (its reservoir keeps a fixed number of points per series, the newest
always). Pure Python: the figures stream what :meth:`flush` returns.
"""

from __future__ import annotations

from collections import deque

__all__ = ["LossSeries"]

Rows = dict[str, list[float]]


def _rows() -> Rows:
    return {"step": [], "loss": [], "smooth": []}


class LossSeries:
    def __init__(self, recent: int = 200, history: int = 200):
        if recent < 1 or history < 2:
            raise ValueError(f"recent must be >= 1 and history >= 2, got {recent}, {history}")
        self.recent_cap = recent
        self.history_cap = history
        self.stride = 1  # steps per history bucket
        # buckets: [step_sum, loss_sum, smooth (last), n]
        self._history: list[list[float]] = []
        self._partial: list[float] | None = None
        self._recent: deque[tuple[float, float, float]] = deque()
        self._new: list[tuple[float, float, float]] = []
        self._replace = True  # the next flush sends every row (a fresh source)
        self.steps = 0

    def __len__(self) -> int:
        """Rows a source holding this series has."""
        return len(self._history) + (self._partial is not None) + len(self._recent)

    def add(self, step: float, loss: float, smooth: float) -> None:
        row = (step, round(loss, 6), round(smooth, 6))
        self._recent.append(row)
        self._new.append(row)
        self.steps += 1
        if len(self._recent) >= 2 * self.recent_cap:
            self._compact()

    def _compact(self) -> None:
        """Fold the oldest rows beyond `recent` into the history (rare: once per `recent` steps)."""
        while len(self._recent) > self.recent_cap:
            step, loss, smooth = self._recent.popleft()
            b = self._partial
            if b is None:
                b = self._partial = [0.0, 0.0, smooth, 0]
            b[0] += step
            b[1] += loss
            b[2] = smooth
            b[3] += 1
            if b[3] >= self.stride:
                self._history.append(b)
                self._partial = None
                if len(self._history) >= self.history_cap:
                    self._merge_pairs()
        self._new = []
        self._replace = True

    def _merge_pairs(self) -> None:
        merged = []
        h = self._history
        for i in range(0, len(h) - 1, 2):
            a, b = h[i], h[i + 1]
            merged.append([a[0] + b[0], a[1] + b[1], b[2], a[3] + b[3]])
        if len(h) % 2:
            merged.append(h[-1])
        self._history = merged
        self.stride *= 2

    def rows(self) -> Rows:
        """Every row, oldest first (what a source showing this series holds)."""
        out = _rows()
        buckets = [*self._history, *([self._partial] if self._partial is not None else [])]
        for step_sum, loss_sum, smooth, n in buckets:
            out["step"].append(round(step_sum / n, 3))
            out["loss"].append(round(loss_sum / n, 6))
            out["smooth"].append(smooth)
        for step, loss, smooth in self._recent:
            out["step"].append(step)
            out["loss"].append(loss)
            out["smooth"].append(smooth)
        return out

    def flush(self) -> tuple[str, Rows] | None:
        """What changed since the last flush: ("replace", all rows), ("stream", new rows) or None."""
        if self._replace:
            self._replace = False
            self._new = []
            return "replace", self.rows()
        if not self._new:
            return None
        out = _rows()
        for step, loss, smooth in self._new:
            out["step"].append(step)
            out["loss"].append(loss)
            out["smooth"].append(smooth)
        self._new = []
        return "stream", out

    def resend(self) -> None:
        """The next flush sends every row (the source was emptied or is new)."""
        self._replace = True
