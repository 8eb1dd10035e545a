"""A checkpoint's PEFT files leaving the pool's machine: read safely into a tar stream, and a
tar stream written back into a PEFT directory (adapter_config.json + adapter_model.safetensors).

Both ends are bounded: the reader opens only the PEFT files, by name, directly in the
checkpoint directory, never following a symlink, regular files only, checked against the
manifest's sizes and checksums, within `max_bytes`; it streams from open descriptors (memory
is one chunk whatever the checkpoint's size). The writer accepts only those two names as
plain files, within `max_bytes`, into a staging directory that replaces the destination's
files only once the whole archive has arrived. Used alike in-process (LocalBackend), by the
server (trio_widgets/http/server.py) and by the HTTP client, so the three give the same bytes.
Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InvalidInputError

__all__ = ["ARCHIVE_NAME", "DEFAULT_MAX_EXPORT_BYTES", "PEFT_FILES", "CheckpointExport", "extract_tar"]

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PEFT's from_pretrained reads
ARCHIVE_NAME = "checkpoint.tar"
_MANIFEST = "trio_checkpoint.json"  # engine/checkpoints.py writes it (its sizes and checksums are checked here)
_MAX_MANIFEST_BYTES = 4 << 20
#: the largest export by default: an 8B model's rank-128 adapter with every target is ~2 GiB
DEFAULT_MAX_EXPORT_BYTES = 4 << 30
_CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class _File:
    name: str
    fd: int
    size: int
    sha256: str | None  # the manifest's, where there is one


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, 0, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _pad(size: int) -> int:
    return -size % _BLOCK


class CheckpointExport:
    """The PEFT files of one checkpoint directory, opened and checked; `iter_tar()` / `iter_file()`
    stream them. Use as a context manager (it holds a descriptor per file). CheckpointError
    names what is wrong (a file missing, not a regular file, a symlink, larger than `max_bytes`
    in all, not matching its manifest); nothing is sent before the checks pass."""

    def __init__(self, directory: Path, *, max_bytes: int = DEFAULT_MAX_EXPORT_BYTES, shown: str | None = None,
                 verify: bool = True, limit_name: str = "max_bytes"):
        self.shown = shown or str(directory)
        self.max_bytes = int(max_bytes)
        self.files: list[_File] = []
        try:
            self._dir = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_READ)
        except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where the checkpoint should be
            raise CheckpointError(f"cannot open checkpoint {self.shown!r}: {exc.strerror or exc}",
                                  path=self.shown) from None
        self.age_recipients: list[str] | None = None  # an export's (save_weights_external): files leave encrypted
        try:
            listed = self._manifest_files()
            for name in PEFT_FILES:
                self.files.append(self._open(name, listed))
            total = sum(f.size for f in self.files)
            if total > self.max_bytes:
                raise InvalidInputError(f"checkpoint {self.shown!r} has {total} bytes of PEFT files, more than the "
                                        f"{self.max_bytes} bytes an export may have here ({limit_name})",
                                        field=limit_name)
            if verify:
                for f in self.files:
                    self._verify(f)
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------------------
    def _manifest_files(self) -> dict[str, Any]:
        """name -> {bytes, sha256} of the manifest, or {} for a PEFT directory from elsewhere."""
        try:
            fd = os.open(_MANIFEST, _O_READ, dir_fd=self._dir)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointError(f"cannot read {_MANIFEST} of checkpoint {self.shown!r}: {exc.strerror or exc}",
                                  path=self.shown) from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"checkpoint {self.shown!r} is invalid: {_MANIFEST} is not a regular file",
                                      path=self.shown)
            data = f.read(_MAX_MANIFEST_BYTES + 1)
        try:
            meta = json.loads(data) if len(data) <= _MAX_MANIFEST_BYTES else None
        except (ValueError, RecursionError):
            meta = None
        files = meta.get("files") if isinstance(meta, dict) else None
        recipients = meta.get("age_recipients") if isinstance(meta, dict) else None
        if not isinstance(files, dict) or not (recipients is None or isinstance(recipients, list) and recipients
                                               and all(isinstance(r, str) for r in recipients)):
            raise CheckpointError(f"checkpoint {self.shown!r} is invalid: {_MANIFEST} lists no files or bad "
                                  f"age_recipients", path=self.shown)
        self.age_recipients = recipients
        return files

    def _open(self, name: str, listed: dict[str, Any]) -> _File:
        try:
            fd = os.open(name, _O_READ, dir_fd=self._dir)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.shown!r} has no {name}: it is not a PEFT adapter directory",
                                  path=self.shown) from None
        except OSError as exc:  # ELOOP: a symlink, never followed
            raise CheckpointError(f"checkpoint {self.shown!r} is invalid: {name} cannot be read "
                                  f"({exc.strerror or exc}); a checkpoint holds only regular files",
                                  path=self.shown) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"checkpoint {self.shown!r} is invalid: {name} is not a regular file",
                                      path=self.shown)
            entry = listed.get(name) if listed else None
            if listed and (not isinstance(entry, dict) or entry.get("bytes") != st.st_size
                           or not isinstance(entry.get("sha256"), str)):
                raise CheckpointError(f"checkpoint {self.shown!r} is corrupted: {name} does not match {_MANIFEST}",
                                      path=self.shown)
            return _File(name, fd, st.st_size, entry["sha256"] if entry else None)
        except BaseException:
            os.close(fd)
            raise

    def _verify(self, f: _File) -> None:
        if f.sha256 is None:
            return
        digest = hashlib.sha256()
        for chunk in self._chunks(f):
            digest.update(chunk)
        if digest.hexdigest() != f.sha256:
            raise CheckpointError(f"checkpoint {self.shown!r} is corrupted: {f.name} does not match the checksum in "
                                  f"{_MANIFEST}", path=self.shown)

    # -- streaming ------------------------------------------------------------------------------
    def _chunks(self, f: _File, deadline: float | None = None) -> Iterator[bytes]:
        offset = 0
        while offset < f.size:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the export of {self.shown!r} ran out of time")
            chunk = os.pread(f.fd, min(_CHUNK, f.size - offset), offset)
            if not chunk:  # truncated since it was opened: the stream ends short, the reader refuses it
                raise CheckpointError(f"checkpoint {self.shown!r} changed while it was exported ({f.name})",
                                      path=self.shown)
            offset += len(chunk)
            yield chunk

    @property
    def tar_size(self) -> int:
        return sum(len(_header(f.name, f.size)) + f.size + _pad(f.size) for f in self.files) + 2 * _BLOCK

    def file(self, name: str) -> _File:
        found = next((f for f in self.files if f.name == name), None)
        if found is None:
            raise CheckpointError(f"a checkpoint export holds only {', '.join(PEFT_FILES)}, not {name!r:.80}",
                                  path=self.shown)
        return found

    def iter_file(self, name: str, deadline: float | None = None) -> Iterator[bytes]:
        return self._chunks(self.file(name), deadline)

    def iter_tar(self, deadline: float | None = None) -> Iterator[bytes]:
        """The files as an uncompressed tar (safetensors do not compress), `tar_size` bytes."""
        for f in self.files:
            yield _header(f.name, f.size)
            yield from self._chunks(f, deadline)
            if _pad(f.size):
                yield bytes(_pad(f.size))
        yield bytes(2 * _BLOCK)

    def close(self) -> None:
        for f in self.files:
            os.close(f.fd)
        self.files = []
        if getattr(self, "_dir", None) is not None:
            os.close(self._dir)
            self._dir = None  # type: ignore[assignment]

    def __enter__(self) -> CheckpointExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- back into a directory ----------------------------------------------------------------------

class _Stream:
    """The chunks as a file tarfile reads in stream mode, refusing more than `limit` bytes
    (each byte copied once more: tarfile reads 10 KiB at a time, chunks are 1 MiB)."""

    def __init__(self, chunks: Iterable[bytes], limit: int):
        self._chunks = iter(chunks)
        self._chunk, self._pos = b"", 0
        self.read_bytes = 0
        self._limit = limit

    def read(self, n: int = -1) -> bytes:
        parts, want = [], n
        while n < 0 or want > 0:
            if self._pos >= len(self._chunk):
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self.read_bytes += len(chunk)
                if self.read_bytes > self._limit:
                    raise InvalidInputError(f"the archive is more than {self._limit} bytes, the limit of this "
                                            f"download; pass a larger max_bytes", field="max_bytes")
                self._chunk, self._pos = bytes(chunk), 0
            end = len(self._chunk) if n < 0 else min(len(self._chunk), self._pos + want)
            parts.append(self._chunk[self._pos:end])
            want -= end - self._pos
            self._pos = end
        return b"".join(parts)


def _bad(why: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint archive is invalid: {why}; nothing was written")


def extract_tar(chunks: Iterable[bytes], destination: Path, *, max_bytes: int = DEFAULT_MAX_EXPORT_BYTES
                ) -> dict[str, int]:
    """Write the PEFT files of a tar stream into the directory `destination` (made if absent);
    returns name -> size. Only adapter_config.json and adapter_model.safetensors, as plain
    files at the archive's top, within `max_bytes` in all; anything else (a link, a directory,
    `../`, another name, a truncated archive) is refused and nothing is written."""
    destination = Path(destination)
    if os.path.lexists(destination) and (destination.is_symlink() or not destination.is_dir()):
        raise InvalidInputError(f"{str(destination)!r} exists and is not a directory (a symlink is not followed): "
                                f"the download is a PEFT directory", field="destination_path")
    parent = destination.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{destination.name}.download-"))
    except OSError as exc:
        raise InvalidInputError(f"cannot write into {str(parent)!r}: {exc.strerror or exc}",
                                field="destination_path") from None
    sizes: dict[str, int] = {}
    try:
        stream = _Stream(chunks, max_bytes + 64 * _BLOCK)  # the headers' and padding's bytes on top
        try:
            with tarfile.open(fileobj=stream, mode="r|") as archive:  # type: ignore[call-overload]
                for member in archive:
                    if member.name not in PEFT_FILES or not member.isreg():
                        raise _bad(f"it holds {member.name!r:.120} ({'a file' if member.isreg() else 'not a file'}); "
                                   f"an export holds only {', '.join(PEFT_FILES)} as plain files")
                    if member.name in sizes:
                        raise _bad(f"it holds {member.name} twice")
                    if sum(sizes.values()) + member.size > max_bytes:
                        raise InvalidInputError(f"the archive's files are more than {max_bytes} bytes, the limit of "
                                                f"this download; pass a larger max_bytes", field="max_bytes")
                    source = archive.extractfile(member)
                    assert source is not None  # a regular file
                    with open(staging / member.name, "xb") as out:
                        shutil.copyfileobj(source, out, _CHUNK)
                    if (staging / member.name).stat().st_size != member.size:
                        raise _bad(f"{member.name} ends early")
                    sizes[member.name] = member.size
        except tarfile.TarError as exc:
            raise _bad(f"{exc}") from None
        missing = [name for name in PEFT_FILES if name not in sizes]
        if missing:
            raise _bad(f"{', '.join(missing)} is missing")
        destination.mkdir(exist_ok=True)
        for name in PEFT_FILES:  # each a rename: a reader of the destination sees whole files only
            os.replace(staging / name, destination / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sizes
