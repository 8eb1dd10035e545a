"""The table of ops: what each request the client can send is, to the clock and to the views.

One row per op. The clock schedules by `kind`; the advisor, the loop, telemetry, trace
export and the dashboard read `starts_update`, `is_step`, `label` and `color` from here, and
the pool resolves `handler` in the registry when it is built. Adding an op: a row here, its
prepare/run pair in trio_widgets/engine/handlers.py and its HANDLERS entry, and the client
method that submits it.

Kinds (the clock-cycle rules, see docs/architecture.md):

* ``forward``  at most one per client per cycle, packed with every client's into one pass;
* ``optim``    at most one per client per cycle, after that client's forward;
* ``state``    checkpoints and inspection, in submission order around the two above;
* ``sample``   batched freely (up to the pool's max_samples_per_cycle per client).

This module imports nothing heavy: views read it without pulling in torch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

__all__ = ["OPS", "OpKind", "OpSpec", "UPDATE_OPS", "op_color", "spec"]

OpKind = Literal["forward", "optim", "state", "sample"]


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: OpKind
    handler: str  # its entry in the handler registry (HANDLERS in trio_widgets/engine/handlers.py)
    color: str  # timeline colour
    label: str  # how views name it
    starts_update: bool = False  # a forward_backward: the start of one training update
    is_step: bool = False  # an optimizer step: the end of one training update


_ROWS = (
    OpSpec("forward", "forward", "forward", "#7c3aed", "forward"),
    OpSpec("forward_backward", "forward", "forward", "#2563eb", "forward_backward", starts_update=True),
    # The second half of a custom loss: the client computed d(loss)/d(logprob) from a forward
    # and sends it back as cross-entropy weights (the hosted SDKs' two-step exchange).
    OpSpec("forward_backward_custom", "forward", "forward", "#1e3a8a", "forward_backward (custom)",
           starts_update=True),
    OpSpec("optim_step", "optim", "optim_step", "#f97316", "optim_step", is_step=True),
    OpSpec("save_state", "state", "save", "#64748b", "save_state"),
    OpSpec("save_weights_for_sampler", "state", "save", "#64748b", "save_weights_for_sampler"),
    OpSpec("load_state", "state", "load", "#475569", "load_state"),
    OpSpec("load_state_with_optimizer", "state", "load", "#475569", "load_state_with_optimizer"),
    OpSpec("inspect_adapter", "state", "inspect", "#94a3b8", "inspect_adapter"),
    OpSpec("sample", "sample", "sample", "#16a34a", "sample"),
    OpSpec("compute_logprobs", "sample", "logprobs", "#0d9488", "compute_logprobs"),
)
OPS: dict[str, OpSpec] = {row.name: row for row in _ROWS}

#: Ops that start a training update (a plain ``forward`` is an evaluation and does not).
UPDATE_OPS = frozenset(name for name, row in OPS.items() if row.starts_update)

_FALLBACK_COLORS = ("#db2777", "#9333ea", "#0891b2", "#65a30d", "#b45309", "#334155")


def spec(op: str) -> OpSpec:
    """The row of `op`; a KeyError names the ops there are."""
    try:
        return OPS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r}; the ops are: {', '.join(OPS)}") from None


def op_color(op: str) -> str:
    """A colour for any op name: the table's, or a stable hash for one it does not know."""
    row = OPS.get(op)
    return row.color if row is not None else _FALLBACK_COLORS[zlib.crc32(op.encode()) % len(_FALLBACK_COLORS)]
