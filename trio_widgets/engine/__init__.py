"""The local clock-cycle LoRA pool. Never imports the widgets."""

from .backend import LocalBackend
from .clock import LocalPool
from .models import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "LocalBackend", "LocalPool"]
