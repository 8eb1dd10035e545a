"""One table: each exception the pool raises <-> the HTTP status, error code and category it
travels as. The server encodes with `wire_error`, trio's HTTP client decodes with
`error_from_wire`, so a request refused or failed over HTTP raises the class it raises
in-process, and every exception has exactly one category.

The codes travel in the JSON bodies of 4xx answers (`{"detail", "field", "code"}`) and of failed
futures (`{"error", "category", "code", "field"}`). The tinker SDK ignores them and reads the
status (refusals) or the category (failed futures), so neither may change meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import (
    AuthenticationError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ClientClosedError,
    InvalidInputError,
    NotSupportedError,
    PermissionDeniedError,
    PoolClosedError,
    RequestErrorCategory,
    RequestFailedError,
    ResourceNotFoundError,
)

__all__ = ["ERRORS", "ErrorRow", "Refusal", "WireError", "error_from_wire", "not_found", "row_of", "wire_error"]

Category = Literal["user", "server"]


@dataclass(frozen=True)
class ErrorRow:
    kind: type[BaseException]
    status: int  # the HTTP status of a refusal at submit
    code: str
    category: Category  # tinker's RequestErrorCategory of a failed future


#: Most specific first: an exception takes the first row it is an instance of.
ERRORS: tuple[ErrorRow, ...] = (
    ErrorRow(CheckpointNotFoundError, 404, "checkpoint_not_found", "user"),
    # 400, not tinker's 409: the SDK's retry handler retries every 409 (for minutes)
    ErrorRow(CheckpointExistsError, 400, "checkpoint_exists", "user"),
    ErrorRow(CheckpointError, 400, "checkpoint_invalid", "user"),
    ErrorRow(ResourceNotFoundError, 404, "not_found", "user"),
    ErrorRow(InvalidInputError, 400, "invalid_input", "user"),
    ErrorRow(RequestFailedError, 400, "request_failed", "user"),
    ErrorRow(NotSupportedError, 400, "not_supported", "user"),
    ErrorRow(AuthenticationError, 401, "unauthenticated", "user"),
    ErrorRow(PermissionDeniedError, 403, "forbidden", "user"),
    # the caller closed its own client (or its session expired): its doing
    ErrorRow(ClientClosedError, 410, "client_closed", "user"),
    # the pool or the server went away under the request: not the caller's doing
    ErrorRow(PoolClosedError, 410, "pool_closed", "server"),
)

#: Codes that name a reason as well as a class (the message says the rest).
# (pool_failed: a fleet's pool whose replica died or restarted: trio_widgets/http/fleet.py)
_ALIASES: dict[str, str] = {"session_expired": "client_closed", "server_shutdown": "pool_closed",
                            "pool_failed": "pool_closed"}
_BY_CODE: dict[str, ErrorRow] = {row.code: row for row in ERRORS}
_INTERNAL = ErrorRow(Exception, 500, "internal", "server")


def row_of(exc: BaseException) -> ErrorRow:
    """The table's row for `exc` (anything else is a 500 `internal`, category server)."""
    return next((row for row in ERRORS if isinstance(exc, row.kind)), _INTERNAL)


@dataclass(frozen=True)
class WireError:
    status: int
    code: str
    category: Category
    message: str
    field: str | None = None
    datum_index: int | None = None
    path: str | None = None  # the checkpoint it is about, as the caller named it

    def details(self) -> dict[str, Any]:
        """What rides along with the message, in every body: the field at fault, the datum, the path."""
        return {key: value for key, value in (("field", self.field), ("datum_index", self.datum_index),
                                              ("path", self.path)) if value is not None}

    def future_body(self) -> dict[str, Any]:
        """A failed future's body, as retrieve_future answers it."""
        return {"error": self.message, "category": self.category, "code": self.code, **self.details()}

    def pytrio_body(self) -> dict[str, Any]:
        """The same refusal or failure in PyTRIO's shape (its control plane and actor read `code` and
        `message`; `field` and `category` ride along in its `details`)."""
        body: dict[str, Any] = {"code": self.code, "message": self.message, "category": self.category,
                                **self.details()}
        return body


class Refusal(Exception):
    """An answer other than 200 that no exception of the pool stands for (auth, limits, the
    body, a session that ended): status, message, the field at fault and, where the client should
    raise one of the protocol's classes, its code. The served engine raises them too (its limits
    and sessions are what a client observes), so they live here, below both."""

    def __init__(self, status: int, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field
        self.code = code

    def wire(self) -> WireError:
        return WireError(self.status, self.code or "refused", "user", str(self), self.field)


def not_found(what: str) -> Refusal:
    return Refusal(404, f"{what} was not found for this API key", code="not_found")


def wire_error(exc: BaseException, *, code: str | None = None) -> WireError:
    """How `exc` travels. `code` may name a reason that maps to the same class (an alias)."""
    if isinstance(exc, Refusal):
        return exc.wire()
    row = row_of(exc)
    if code is not None:
        assert _BY_CODE[_ALIASES.get(code, code)] is row, (code, row)
    field = getattr(exc, "field", None)
    message = str(exc)
    if isinstance(exc, InvalidInputError) and field and message.startswith(f"{field}: "):
        message = message[len(field) + 2:]  # the field travels apart; the client's error adds it back
    elif row is _INTERNAL:
        message = f"internal error: {type(exc).__name__}: {exc}"
    index, path = getattr(exc, "datum_index", None), getattr(exc, "path", None)
    return WireError(row.status, code or row.code, row.category, message, field if isinstance(field, str) else None,
                     index if isinstance(index, int) else None, path if isinstance(path, str) else None)


def error_from_wire(code: Any, message: str, *, field: str | None = None, path: str | None = None,
                    category: Any = None, request_id: str = "", client_id: str | None = None,
                    cycle: int | None = None, datum_index: Any = None) -> Exception | None:
    """The exception `code` stands for, or None for a code not in the table (the caller then
    goes by the HTTP status, or raises RequestFailedError with the category)."""
    row = _BY_CODE.get(_ALIASES.get(code, code)) if isinstance(code, str) else None
    if row is None:
        return None
    kind = row.kind
    if issubclass(kind, CheckpointError):
        default = "name" if kind is CheckpointExistsError else "path"
        return kind(message, path=path, field=field or default)
    if issubclass(kind, InvalidInputError):
        refused = kind(message, field=field)
        refused.datum_index = datum_index if isinstance(datum_index, int) and not isinstance(datum_index, bool) \
            else None
        return refused
    if kind is RequestFailedError:
        try:
            cat = RequestErrorCategory(category) if category is not None else RequestErrorCategory.User
        except ValueError:
            cat = RequestErrorCategory.Unknown
        return RequestFailedError(message, client_id=client_id, cycle=cycle, request_id=request_id, category=cat)
    made = kind(message)
    assert isinstance(made, Exception)
    return made
