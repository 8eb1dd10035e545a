"""The one parser of tinker's checkpoint paths: `tinker://<run>/<weights|sampler_weights|external_weights>/<name>`
(external_weights: what save_weights_external wrote, a PEFT directory for download)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import InvalidInputError

__all__ = ["SEGMENTS", "TINKER_SCHEME", "TinkerPath", "parse_checkpoint_id", "parse_tinker_path", "shown_path"]

TINKER_SCHEME = "tinker://"
#: a path's segment -> tinker's checkpoint type
SEGMENTS: dict[str, Literal["training", "sampler", "external"]] = {
    "weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_PATH = re.compile(r"^tinker://(?P<run>[^/]+)/(?P<segment>weights|sampler_weights|external_weights)/(?P<name>[^/]+)$")


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    segment: Literal["weights", "sampler_weights", "external_weights"]
    name: str

    def __str__(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.segment}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def checkpoint_type(self) -> Literal["training", "sampler", "external"]:
        return SEGMENTS[self.segment]


def parse_tinker_path(path: Any, field: str = "path") -> TinkerPath:
    """The parts of a tinker:// checkpoint path; InvalidInputError naming `field` otherwise.
    (The parts are not checked as file names here: whoever maps them to a directory does.)"""
    m = _PATH.match(path) if isinstance(path, str) else None
    if m is None:
        raise InvalidInputError(f"must be a tinker://<run>/weights|sampler_weights|external_weights/<name> "
                                f"path (what save_state / save_weights_for_sampler returned), got {path!r:.200}",
                                field=field)
    return TinkerPath(m["run"], m["segment"], m["name"])  # type: ignore[arg-type]


def parse_checkpoint_id(checkpoint_id: Any, field: str = "checkpoint_id") -> tuple[str, str]:
    """(segment, name) of tinker's `weights/<name>` or `sampler_weights/<name>`; InvalidInputError
    for anything else, `..` and separators in the name included (it becomes part of a URL and a
    directory)."""
    segment, _, name = checkpoint_id.partition("/") if isinstance(checkpoint_id, str) else ("", "", "")
    if segment not in SEGMENTS or not name or "/" in name or "\\" in name or ".." in name or name.startswith("."):
        raise InvalidInputError(f"must be 'weights/<name>', 'sampler_weights/<name>' or 'external_weights/<name>', got "
                                f"{checkpoint_id!r:.80}",
                                field=field)
    return segment, name


def shown_path(path: Any, directory: Any = None) -> str:
    """A checkpoint path as the caller named it, for messages and answers (not this machine's
    directory): a str or os.PathLike as given; anything else (a save's response) by `directory`,
    the directory it was found at, when given, else by the path it holds."""
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    if directory is not None:
        return str(directory)
    return str(getattr(path, "path", path))
