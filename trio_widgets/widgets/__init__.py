"""Jupyter widgets over a pool's telemetry (ipywidgets + bokeh, imported on first use)."""

__all__ = ["Dashboard", "lr_multipliers"]


def __getattr__(name: str):
    if name in __all__:
        from . import dashboard

        return getattr(dashboard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
