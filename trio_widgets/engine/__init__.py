"""The local clock-cycle LoRA pool. Never imports the widgets."""

from .clock import LocalPool, register_op
from .models import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "LocalPool", "register_op"]
