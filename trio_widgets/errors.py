"""Errors the client raises. Bad input is a ValueError subclass that names the field.

Code written for the hosted SDKs catches their exception classes, so each of our errors is
also an instance of the SDK class that means the same thing, and nothing else:

| ours | tinker 0.38 | pytrio 0.2.9 |
| --- | --- | --- |
| every error below | `TinkerError` | `PyTrioError` |
| `InvalidInputError` (rejected at submit, nothing changed) | `BadRequestError` (HTTP 400; tinker raises it e.g. for a prompt longer than the context) | `ValidationError` (SDK-side input check) |
| `CheckpointNotFoundError` | `NotFoundError` (HTTP 404) | — |
| `CheckpointExistsError` (`save_state` of a saved name without `overwrite=True`) | `ConflictError` (HTTP 409) | — |
| `RequestFailedError` (failed inside a cycle) | `RequestFailedError` (same name, same meaning) | `EventFailedError` (a submitted event ended failed) |
| `PoolClosedError`, `ClientClosedError` | — (tinker's poisoned client raises a bare `RuntimeError`; ours are RuntimeErrors too) | — |

The SDK classes nothing here corresponds to (rate limits, authentication, connection
errors, ...) exist under their names so that `except` clauses written for a hosted
service still evaluate; the local pool never raises them. The SDK-specific attributes
(`status_code`, `code`, `request_id`, ...) are class-level defaults, so our own
constructors stay as they were; `status_code` follows tinker where the two disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

__all__ = [
    # ours
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ClientClosedError",
    "DownloadFailedError",
    "DownloadNotAllowedError",
    "InvalidInputError",
    "ModelDownloadError",
    "NotSupportedError",
    "PoolClosedError",
    "RequestFailedError",
    "ResourceNotFoundError",
    "UnknownModelError",
    # tinker's names
    "APIConnectionError",
    "APIError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "BillingError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestErrorCategory",
    "TinkerError",
    "UnprocessableEntityError",
    # pytrio's names
    "ExperimentalWarning",
    "EventError",
    "EventFailedError",
    "PyTrioError",
    "ValidationError",
]


def _message(exc: BaseException) -> str:
    return str(exc.args[0]) if exc.args else ""


# -- tinker's hierarchy (tinker/_exceptions.py) ---------------------------------------------

class TinkerError(Exception):
    """tinker's base class: every error this package raises is one."""

    @property
    def message(self) -> str:
        return _message(self)


class APIError(TinkerError):
    """tinker: an error from the service's HTTP API. `request` and `body` are None here."""

    request: Any = None
    body: object | None = None

    def __init__(self, message: str, request: Any = None, *, body: object | None = None) -> None:
        super().__init__(message)
        self.request = request
        self.body = body


class APIStatusError(APIError):
    """tinker: the API answered 4xx/5xx. `response` is None here (no HTTP)."""

    response: Any = None
    status_code: int = 0

    def __init__(self, message: str, response: Any = None, body: object | None = None) -> None:
        super().__init__(message, getattr(response, "request", None), body=body)
        self.response = response
        if response is not None:
            self.status_code = response.status_code


class APIResponseValidationError(APIError):
    """tinker: the API's answer did not match its schema. Never raised locally."""

    response: Any = None
    status_code: int = 0


class APIConnectionError(APIError):
    """tinker: the service could not be reached. Never raised locally (no network)."""


class APITimeoutError(APIConnectionError):
    """tinker: a request to the service timed out. Never raised locally."""


class BadRequestError(APIStatusError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class BillingError(APIStatusError):
    status_code = 402


class PermissionDeniedError(APIStatusError):
    status_code = 403


class NotFoundError(APIStatusError):
    status_code = 404


class ConflictError(APIStatusError):
    status_code = 409


class UnprocessableEntityError(APIStatusError):
    status_code = 422


class RateLimitError(APIStatusError):
    status_code = 429


class InternalServerError(APIStatusError):
    status_code = 500


class ExperimentalWarning(FutureWarning):
    """tinker: calling an API that may change without notice. Never emitted here; it exists
    so that `warnings.filterwarnings(..., category=ExperimentalWarning)` keeps working."""


class RequestErrorCategory(str, Enum):
    """tinker.types.RequestErrorCategory (a StrEnum there; str + Enum works on Python 3.10)."""

    Unknown = "unknown"
    Server = "server"
    User = "user"

    def __str__(self) -> str:
        return self.value


# -- pytrio's hierarchy (pytrio/errors/*.py) ------------------------------------------------

class PyTrioError(Exception):
    """pytrio's base class: every error this package raises is one.

    pytrio's diagnostic attributes are here as class-level defaults; `code` says what
    kind of error it is, the rest are empty (there is no server, actor or event here).
    """

    code: str = "pytrio.error"
    hint: str = ""
    details: Mapping[str, object] = MappingProxyType({})
    source: str = ""
    status_code: int = 0
    retryable: bool = False
    operation: str = ""
    server: str = ""
    request_id: str = ""
    task_cuid: str = ""
    event_cuid: str = ""
    actor_cuid: str = ""

    def __init__(self, message: str, *, code: str | None = None, hint: str = "",
                 details: Mapping[str, object] | None = None, **context: Any) -> None:
        super().__init__(message)
        if code:
            self.code = code
        if hint:
            self.hint = hint
        if details:
            self.details = dict(details)
        for key, value in context.items():
            setattr(self, key, value)

    @property
    def message(self) -> str:
        return _message(self)

    def diagnostic_fields(self) -> dict[str, object]:
        """pytrio's structured-log view: message, code, the non-empty fields, retryable."""
        fields: dict[str, object] = {"message": self.message, "code": self.code}
        for key in ("hint", "source", "operation", "server", "request_id", "task_cuid", "event_cuid",
                    "actor_cuid", "details"):
            value = getattr(self, key)
            if value:
                fields[key] = dict(value) if key == "details" else value
        if self.status_code > 0:
            fields["status_code"] = self.status_code
        fields["retryable"] = self.retryable
        return fields


class ValidationError(PyTrioError):
    """pytrio: input did not pass the SDK's checks (not pydantic's ValidationError)."""

    code = "validation.failed"
    source = "sdk"


class EventError(PyTrioError):
    code = "event.error"
    source = "event"


class EventFailedError(EventError):
    """pytrio: a submitted operation ended in the failed state."""

    @property
    def event_message(self) -> str:
        return self.message


# -- ours ------------------------------------------------------------------------------------

class InvalidInputError(ValueError, BadRequestError, ValidationError):
    """A request was rejected at submit time; nothing was queued or changed.

    `field` names what is wrong (e.g. ``data[2].loss_fn_inputs['weights']``) and
    `datum_index` is the index of the offending datum, or None.
    """

    def __init__(self, message: str, *, field: str | None = None, datum_index: int | None = None):
        self.field = field
        self.datum_index = datum_index
        super().__init__(f"{field}: {message}" if field else message)


class UnknownModelError(InvalidInputError):
    """The base model is neither built in nor a local Hugging Face model."""


class ModelDownloadError(UnknownModelError):
    """A Hugging Face Hub model is not on this machine and was not downloaded (the message says
    why: not allowed, unreachable, no such model, gated)."""


class DownloadNotAllowedError(ModelDownloadError):
    """The model would have to be downloaded, and the user has not allowed downloads:
    `LocalPool(allow_download=True)` or `TRIO_ALLOW_DOWNLOAD=1`."""


class DownloadFailedError(ModelDownloadError):
    """Downloads are allowed, but the Hub could not be reached (offline, HF_HUB_OFFLINE, a
    wrong HF_ENDPOINT, a refused connection)."""


class CheckpointError(InvalidInputError):
    """A checkpoint path cannot be used: corrupted, incomplete, or made for another model.

    `path` is the checkpoint directory (or file) at fault.
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = "path"):
        self.path = path
        super().__init__(message, field=field)


class CheckpointNotFoundError(CheckpointError, NotFoundError, FileNotFoundError):
    """No checkpoint at that path. Also a FileNotFoundError, so `except OSError` catches it,
    and tinker's NotFoundError (404)."""

    status_code = 404

    def __init__(self, message: str, *, path: str | None = None, field: str | None = "path"):
        super().__init__(message, path=path, field=field)
        self._text = Exception.__str__(self)
        self.filename = path

    def __str__(self) -> str:  # not OSError's "[Errno None] ..." form
        return self._text


class CheckpointExistsError(CheckpointError, ConflictError):
    """`save_state(name)` where a checkpoint of that name exists and `overwrite` is False.
    Also tinker's ConflictError (409)."""

    status_code = 409

    def __init__(self, message: str, *, path: str | None = None, field: str | None = "name"):
        super().__init__(message, path=path, field=field)


class ResourceNotFoundError(InvalidInputError, NotFoundError):
    """No training run, sampler or session of that id is known (tinker's NotFoundError, 404)."""

    status_code = 404


class RequestFailedError(RuntimeError, TinkerError, EventFailedError):
    """A request failed inside a cycle (its own fault); its tenant's state is unchanged.

    tinker's `request_id` / `category` and pytrio's `task_cuid` / `event_cuid` carry the
    pool's request id (stamped when the future is failed) and the client id.
    """

    code = "request.failed"
    source = "pool"

    def __init__(self, message: str, *, client_id: str | None = None, cycle: int | None = None,
                 request_id: str = "", category: RequestErrorCategory = RequestErrorCategory.Unknown):
        self.client_id = client_id
        self.cycle = cycle
        self.request_id = request_id
        self.category = category
        super().__init__(message)

    # pytrio's class attributes, read-only here: derived from ours
    @property
    def task_cuid(self) -> str:  # type: ignore[override]  # pytrio names the run a request belongs to "task"
        return self.client_id or ""

    @property
    def event_cuid(self) -> str:  # type: ignore[override]
        return self.request_id


class PoolClosedError(RuntimeError, TinkerError, PyTrioError):
    """The pool was closed before this request could finish."""

    code = "pool.closed"


class ClientClosedError(RuntimeError, TinkerError, PyTrioError):
    """The client was closed (or garbage-collected): it accepts no more requests."""

    code = "client.closed"


class NotSupportedError(NotImplementedError, TinkerError, PyTrioError):
    """A name of the hosted SDKs for what only a hosted service does (billing, a web console,
    uploading weights elsewhere, ...): it exists here so that code written for them reads,
    and raises this saying what it does there and why it does not here. Nothing was sent."""

    code = "not_supported"
