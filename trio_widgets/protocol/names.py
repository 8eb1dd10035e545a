"""Every public name a pool makes, made and read here only: session ids, training-run ids (tinker's
`model_id`), sampler ids, request ids, a run's directory under the checkpoint root, and the
`tinker://<run>/<segment>/<name>` path of a checkpoint (trio_widgets/protocol/paths.py parses it).

The same script gets the same names in-process and over HTTP: a run is `<session>:train:<n>`, a
sampler `<session>:sample:<n>`, a checkpoint `tinker://<run>/weights/<name>`. A fleet's pools tag the
ids they make (`sess-<tag>-<hex>`, `req-<tag>-<n>`, trio_widgets/http/fleet.py), so its ingress routes
a request by the id it names without a table.
"""

from __future__ import annotations

import os
import re
import secrets
import urllib.parse
from typing import Any, Literal

from ..errors import InvalidInputError
from .paths import SEGMENTS, TinkerPath

__all__ = [
    "ID_TAG_RE", "MAX_NAME_BYTES", "RUN_ID_RE", "SAMPLER_ID_RE", "SERVED_DIR", "SESSION_ID_RE", "checkpoint_path",
    "id_prefix", "new_session_id", "owner_run_dir", "request_id", "run_dirname", "run_id", "run_id_of_dirname",
    "same_origin", "sampler_id", "validate_name",
]

#: a fleet pool's tag: p<index>r<epoch>
ID_TAG_RE = re.compile(r"^[a-z0-9]{1,24}$")
_TAG = r"(?:[a-z0-9]{1,24}-)?"
_SESSION = rf"sess-{_TAG}[0-9a-f]{{16}}"
SESSION_ID_RE = re.compile(rf"^{_SESSION}$")
RUN_ID_RE = re.compile(rf"^(?P<session>{_SESSION}):train:(?P<n>\d{{1,9}})$")
SAMPLER_ID_RE = re.compile(rf"^(?P<session>{_SESSION}):sample:(?P<n>\d{{1,9}})$")
#: where a served pool keeps each API key's runs, under the checkpoint root
SERVED_DIR = "served"

# Most filesystems allow 255 bytes per path component (ext4, XFS, btrfs, APFS; NTFS allows 255
# UTF-16 units, never more than the UTF-8 bytes). engine/checkpoints.py's atomic_write_dir puts `.<name>.tmp-<hex>`
# and `.<name>.old-<hex>` (secrets.token_hex(6): 12 characters) beside a checkpoint.
MAX_NAME_BYTES = 255 - len(".") - len(".tmp-") - 12


def id_prefix(tag: str = "") -> str:
    """What a pool puts after `sess-` / `req-`: its fleet tag and a dash, or nothing."""
    if tag and not ID_TAG_RE.match(tag):
        raise ValueError(f"id_tag must be 1 to 24 lowercase letters and digits, got {tag!r:.40}")
    return f"{tag}-" if tag else ""


def new_session_id(tag: str = "") -> str:
    """A new session's id: `sess-[<tag>-]<16 hex>` (random: pools sharing a checkpoint root never mix runs)."""
    return f"sess-{id_prefix(tag)}{secrets.token_hex(8)}"


def request_id(n: int, tag: str = "") -> str:
    return f"req-{id_prefix(tag)}{n}"


def run_id(session_id: str, n: int) -> str:
    """The `n`th training run of a session (tinker's model_id; `n` is the SDK's model_seq_id)."""
    return f"{session_id}:train:{n}"


def sampler_id(session_id: str, n: int) -> str:
    """The `n`th sampler of a session (tinker's sampling_session_id)."""
    return f"{session_id}:sample:{n}"


def run_dirname(run: str) -> str:
    """A run's directory name: its id with ':' made '_' (a file name may not hold ':' everywhere)."""
    return run.replace(":", "_")


def run_id_of_dirname(name: str) -> str | None:
    """The run id a directory of `run_dirname` holds, or None when the name is no run of ours."""
    candidate = name.replace("_train_", ":train:")
    return candidate if RUN_ID_RE.match(candidate) else None


def owner_run_dir(owner: str | None, run: str) -> str:
    """A run's directory relative to the checkpoint root: `<run>` in-process, `served/<key>/<run>` for
    a served pool's API key (a key's runs are its own directory tree)."""
    return run_dirname(run) if owner is None else f"{SERVED_DIR}/{owner}/{run_dirname(run)}"


def checkpoint_path(run: str, segment: Literal["weights", "sampler_weights", "external_weights"], name: str) -> str:
    """`tinker://<run>/<segment>/<name>`: what every save returns, on every transport."""
    assert segment in SEGMENTS, segment
    return str(TinkerPath(run, segment, name))


def same_origin(a: str, b: str) -> bool:
    """Whether two server URLs are the same server: scheme, host and port (a default port
    spelled out or not), and path. A key configured for one is never sent to the other."""
    def origin(url: str) -> tuple[str, str, int | None, str] | None:
        try:
            u = urllib.parse.urlsplit(url.strip())
            port = u.port or {"http": 80, "https": 443}.get(u.scheme)
        except ValueError:  # e.g. a port out of range
            return None
        if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password:
            return None
        return u.scheme, u.hostname.lower().rstrip("."), port, u.path.rstrip("/")

    left, right = origin(a), origin(b)
    return left is not None and left == right


def validate_name(name: Any, field: str = "name") -> str:
    """A checkpoint's name (the last part of its path), checked: one path segment, no control characters."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"must be a non-empty string, got {name!r}", field=field)
    if "/" in name or "\\" in name or (os.sep in name) or (os.altsep and os.altsep in name):
        raise InvalidInputError(f"must not contain path separators, got {name!r}", field=field)
    if ".." in name:
        raise InvalidInputError(f"must not contain '..', got {name!r}", field=field)
    if name.startswith("."):
        raise InvalidInputError(f"must not start with '.', got {name!r}", field=field)
    if "\0" in name or any(ord(c) < 32 for c in name) or ":" in name:
        raise InvalidInputError(f"must not contain control characters or ':', got {name!r}", field=field)
    if len(name) > 200:
        raise InvalidInputError(f"must be at most 200 characters, got {len(name)}", field=field)
    try:
        encoded = os.fsencode(name)
    except UnicodeError:  # e.g. a lone surrogate
        raise InvalidInputError(f"must be text the filesystem can store, got {name!r}", field=field) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidInputError(f"must be at most {MAX_NAME_BYTES} bytes encoded (a file name has at most 255, "
                                f"and saving writes `.<name>.tmp-<12 hex>` beside it), got {len(encoded)} bytes",
                                field=field)
    return name
