"""The local clock-cycle LoRA pool. Never imports the widgets."""

from ..connect import register_pool_factory
from .backend import LocalBackend
from .clock import LocalPool
from .models import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "LocalBackend", "LocalPool"]


def _default_pool() -> LocalPool:
    return LocalPool(name="default", owned_by_cell=False)  # shared by every cell: re-running one keeps it


register_pool_factory(_default_pool)
