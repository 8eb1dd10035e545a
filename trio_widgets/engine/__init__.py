"""The local clock-cycle LoRA pool. Never imports the widgets."""

from . import checkpoints, sampling  # noqa: F401  (register the sample and checkpoint ops with the clock)
from .clock import LocalPool, register_op
from .models import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "LocalPool", "register_op"]
