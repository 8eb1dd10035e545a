"""Numbers derived from what the pool did, computed one way everywhere.

The loop's metrics, the trace export, the advisor, the dashboard and the demo all read
these: loss per weighted token, a batch's weight, cycles per update (the *period*: cycles
between one update's forward_backward and the next one's, in steady state), the typical
cycle duration, and rows made safe for JSON.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["PERIOD_WINDOW", "batch_weight", "cycle_duration", "cycles_per_update", "format_cycles", "gil_wait",
           "json_safe", "loss_per_token", "period_history", "record_loss"]

#: Updates the cycles-per-update median looks back over.
PERIOD_WINDOW = 16


def loss_per_token(loss_sum: float, weight: float) -> float:
    """A summed loss per loss-weighted token (NaN when nothing carried weight)."""
    return loss_sum / weight if weight > 0 and math.isfinite(loss_sum) else math.nan


def batch_weight(batch: Sequence[Any]) -> tuple[float, int]:
    """(loss-weighted tokens, input tokens) of a batch of Datum: a loss is a sum over the former
    (weights default to 1 for every token)."""
    weight, tokens = 0.0, 0
    for datum in batch:
        n = datum.model_input.length
        tokens += n
        w = datum.loss_fn_inputs.get("weights")
        weight += float(sum(w.data)) if w is not None else float(n)
    return weight, tokens


def record_loss(metrics: dict[str, float]) -> float:
    """Loss per weighted token of a forward request's telemetry record."""
    return loss_per_token(metrics.get("loss:sum", math.nan), metrics.get("weight:sum", 0.0))


def cycles_per_update(update_cycles: Iterable[int | None], window: int = PERIOD_WINDOW) -> float | None:
    """Median cycles between successive updates' forward_backward (over the last `window`)."""
    cycles = [c for c in update_cycles if c is not None][-(window + 1):]
    if len(cycles) < 2:
        return None
    return float(statistics.median(b - a for a, b in zip(cycles, cycles[1:])))


def period_history() -> deque[int]:
    """A bounded history of update cycles, exactly as long as `cycles_per_update` reads."""
    return deque(maxlen=PERIOD_WINDOW + 1)


def cycle_duration(durations: Iterable[float], default: float | None = None, window: int = 32) -> float | None:
    """Median of the most recent positive cycle durations (seconds), else `default`."""
    recent = [d for d in list(durations)[-window:] if d > 0]
    return float(statistics.median(recent)) if recent else default


def gil_wait(telemetry: Any, cycles: Iterable[int | None]) -> float | None:
    """Seconds the pool's clock waited for the interpreter (GIL) in these cycles (each counted
    once), from its telemetry; None when none of them is still in its buffer."""
    records = [telemetry.cycle(i) for i in set(cycles) if i is not None]
    known = [r.gil_wait_s for r in records if r is not None]
    return round(sum(known), 6) if known else None


def format_cycles(value: float) -> str:
    """4 -> '4', 1.5 -> '1.5'."""
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


def json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities become null: JSON has no such numbers."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
