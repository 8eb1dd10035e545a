"""Errors the client raises. Bad input is a ValueError subclass that names the field."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ClientClosedError",
    "DownloadFailedError",
    "DownloadNotAllowedError",
    "InvalidInputError",
    "ModelDownloadError",
    "PoolClosedError",
    "RequestFailedError",
    "UnknownModelError",
]


class InvalidInputError(ValueError):
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


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at that path. Also a FileNotFoundError, so `except OSError` catches it."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = "path"):
        super().__init__(message, path=path, field=field)
        self._text = Exception.__str__(self)
        self.filename = path

    def __str__(self) -> str:  # not OSError's "[Errno None] ..." form
        return self._text


class RequestFailedError(RuntimeError):
    """A request failed inside a cycle (its own fault); its tenant's state is unchanged."""

    def __init__(self, message: str, *, client_id: str | None = None, cycle: int | None = None):
        self.client_id = client_id
        self.cycle = cycle
        super().__init__(message)


class PoolClosedError(RuntimeError):
    """The pool was closed before this request could finish."""


class ClientClosedError(RuntimeError):
    """The client was closed (or garbage-collected): it accepts no more requests."""
