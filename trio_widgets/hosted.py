"""The hosted SDKs' names for what only a hosted service does. Each exists on our classes so
that code written for tinker or pytrio reads, and raises `NotSupportedError` saying what it
does there and why not here, before anything is sent (tests/test_sdk_surface.py enumerates
every public name of the installed SDKs' client classes against ours)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from .errors import NotSupportedError

__all__ = ["hosted_only"]

_CONSOLE = ("opens the hosted service's web console (a session's, run's or checkpoint's page); a local pool has "
            "none: watch it with trio.Dashboard(pool) (or trio.Dashboard(url) for a served one)")
_BILLING = "reports the hosted account's {}; a local pool has no account and bills nothing"
_ACCOUNT = "{} on the hosted service's account; a local pool has no accounts, projects or publishing"

#: name -> what it does on the hosted service, and why not here
REASONS: dict[str, str] = {
    "get_console_url": _CONSOLE,
    "get_playground_url": "opens a checkpoint in the hosted service's web playground; a local pool has none: sample "
                          "it with ServiceClient.create_sampling_client(model_path=...) (its tinker:// path)",
    "copy_weights": "copies a checkpoint to another hosted account or project; here a checkpoint is a directory on "
                    "the pool's disk: copy it (RestClient.list_checkpoints gives its path)",
    "assign_session_project": _ACCOUNT.format("files a session under a project"),
    "export_session_trace": "exports the hosted service's server-side trace of a session; here trio.Dashboard's "
                            "export (Perfetto trace, metrics.jsonl) has the pool's own record",
    "get_audit_log": _ACCOUNT.format("reads the audit log"),
    "get_billing_usage": _BILLING.format("billing usage"),
    "get_current_checkpoint_storage_usage": _BILLING.format("checkpoint storage usage"),
    "publish_checkpoint_from_tinker_path": _ACCOUNT.format("publishes a checkpoint for other accounts"),
    "unpublish_checkpoint_from_tinker_path": _ACCOUNT.format("withdraws a published checkpoint"),
    "search_sessions": _ACCOUNT.format("searches the sessions"),
    "whoami": _ACCOUNT.format("names the account behind the API key"),
    "holder": "is the tinker SDK's internal connection holder (deprecated there); trio's clients have none",
    "create": "builds a SamplingClient from the tinker SDK's internal holder; use ServiceClient."
              "create_sampling_client",
}


def hosted_only(name: str, *, is_async: bool = False) -> Callable[..., Any]:
    """A method that raises NotSupportedError for the hosted-only `name` (REASONS says why)."""
    reason = REASONS[name.removesuffix("_async")]
    message = f"{name}() {reason}."

    if is_async:
        async def method_async(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            raise NotSupportedError(message)

        method_async.__name__ = method_async.__qualname__ = name
        method_async.__doc__ = f"Hosted only: {reason}. Raises NotSupportedError."
        return method_async

    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotSupportedError(message)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Hosted only: {reason}. Raises NotSupportedError."
    return method
