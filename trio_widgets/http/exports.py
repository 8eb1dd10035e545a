"""A served pool's checkpoint downloads: signed, expiring URLs of one key's checkpoint
(`POST /api/v1/trio/export_urls`, tinker's `GET .../checkpoints/{id}/external_weights_urls`)
and the endpoint they point at (`GET /api/v1/trio/export/{model_id}/{segment}/{name}/{member}`),
which streams the PEFT files (trio_widgets/export.py) with no API key: the signature is the
credential, as with the hosted service's storage URLs (tinker_cookbook fetches them with
urllib). Bounded in size (max_export_bytes), in time (export_timeout_s) and in memory (one
chunk; an age-encrypted file is encrypted into a spooled temporary file)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..errors import InvalidInputError, NotSupportedError
from ..export import ARCHIVE_NAME, PEFT_FILES, CheckpointExport
from ..protocol import parse_tinker_path
from ..validation import check_age_recipients
from .auth import Signer

__all__ = ["AGE_SUFFIX", "Exports", "parse_age_recipients"]

log = logging.getLogger("trio_widgets.http.server")

AGE_SUFFIX = ".age"  # tinker's name for an encrypted export's files
_SPOOL_BYTES = 8 << 20


def parse_age_recipients(raw: Any) -> tuple[str, ...] | None:
    """save_weights_external's recipients, checked and parsed here (the files are encrypted to
    them when they leave); NotSupportedError without the pyrage package."""
    recipients = check_age_recipients(raw)
    if recipients is None:
        return None
    try:
        import pyrage
    except ImportError:
        raise NotSupportedError("age_encryption_recipients needs the pyrage package on the server (pip install "
                                "pyrage); save without it, or install it and restart the server") from None
    for i, text in enumerate(recipients):
        kind = pyrage.x25519.Recipient if text.startswith("age1") else pyrage.ssh.Recipient
        try:
            kind.from_str(text)
        except Exception as exc:  # pyrage.RecipientError and the like
            raise InvalidInputError(f"is not a valid age recipient: {exc}", field=f"age_encryption_recipients[{i}]"
                                    ) from None
    return recipients


def _encrypted(export: CheckpointExport, name: str, deadline: float) -> tuple[Any, int]:
    """The file encrypted to the export's recipients, in a spooled temporary file (memory bounded)."""
    import pyrage

    recipients = [pyrage.x25519.Recipient.from_str(r) if r.startswith("age1") else pyrage.ssh.Recipient.from_str(r)
                  for r in export.age_recipients or ()]

    class Reader:  # pyrage reads a file-like object
        def __init__(self) -> None:
            self.chunks, self.rest = export.iter_file(name, deadline), b""

        def read(self, n: int = -1) -> bytes:
            while n < 0 or len(self.rest) < n:
                chunk = next(self.chunks, None)
                if chunk is None:
                    break
                self.rest += chunk
            out, self.rest = (self.rest, b"") if n < 0 else (self.rest[:n], self.rest[n:])
            return out

    spooled = tempfile.SpooledTemporaryFile(_SPOOL_BYTES)
    pyrage.encrypt_io(Reader(), spooled, recipients)
    size = spooled.tell()
    spooled.seek(0)
    return spooled, size


class Exports:
    """Signs and serves downloads. `locate(owner, tinker_path)` is the server's: the directory
    of one of that key's unexpired checkpoints (the engine's answer), CheckpointNotFoundError
    (404) for anything else."""

    def __init__(self, locate: Callable[[str, str], Path], *, max_bytes: int, url_ttl_s: float,
                 timeout_s: float):
        self.locate = locate
        self.max_bytes, self.url_ttl_s, self.timeout_s = int(max_bytes), float(url_ttl_s), float(timeout_s)
        self.signer = Signer()

    def _open(self, owner: str, tinker_path: str, *, verify: bool) -> CheckpointExport:
        return CheckpointExport(self.locate(owner, tinker_path), max_bytes=self.max_bytes, shown=tinker_path,
                                verify=verify, limit_name="max_export_bytes")

    def urls(self, owner: str, tinker_path: Any, base_url: str) -> dict[str, Any]:
        """Signed URLs of the archive and of each file (`.age` names for an encrypted export)."""
        parsed = parse_tinker_path(tinker_path, "tinker_path")
        path = str(parsed)
        with self._open(owner, path, verify=False) as export:  # refused now (size, files), not at download
            names = [n + AGE_SUFFIX for n in PEFT_FILES] if export.age_recipients else list(PEFT_FILES)
        expires = math.ceil(time.time() + self.url_ttl_s)  # never less than url_ttl_s
        prefix = f"{base_url.rstrip('/')}/api/v1/trio/export/{quote(parsed.run_id, safe='')}/{parsed.segment}/" \
                 f"{quote(parsed.name, safe='')}/"

        def url(member: str) -> str:
            resource = f"{parsed.run_id}/{parsed.segment}/{parsed.name}/{member}"
            return prefix + member + "?" + urlencode(self.signer.sign(owner, resource, expires))

        return {"archive_url": url(ARCHIVE_NAME), "urls": {name: url(name) for name in names},
                "expires": datetime.datetime.fromtimestamp(expires, datetime.timezone.utc).isoformat()}

    async def download(self, request: Request) -> Response:
        p, q = request.path_params, request.query_params
        run, segment, name, member = p["model_id"], p["segment"], p["name"], p["member"]
        resource = f"{run}/{segment}/{name}/{member}"
        owner = self.signer.verify(resource, q.get("expires"), q.get("owner"), q.get("signature"))
        tinker_path = f"tinker://{run}/{segment}/{name}"
        parse_tinker_path(tinker_path)  # a signed resource is one we named; checked again all the same
        export = await run_in_threadpool(self._open, owner, tinker_path, verify=True)  # reads every byte once
        deadline = time.monotonic() + self.timeout_s
        try:
            encrypted = bool(export.age_recipients)
            if member == ARCHIVE_NAME and not encrypted:
                body, size, media = export.iter_tar(deadline), export.tar_size, "application/x-tar"
            elif member in PEFT_FILES and not encrypted:
                body, size, media = export.iter_file(member, deadline), export.file(member).size, \
                    "application/octet-stream"
            elif encrypted and member.removesuffix(AGE_SUFFIX) in PEFT_FILES and member.endswith(AGE_SUFFIX):
                spooled, size = await run_in_threadpool(_encrypted, export, member.removesuffix(AGE_SUFFIX),
                                                        deadline)
                body, media = _drain(spooled), "application/octet-stream"
            else:
                what = "file by file, as .age files" if encrypted else f"as {ARCHIVE_NAME} or its files"
                raise InvalidInputError(f"{tinker_path} has no {member!r:.80} to download: it is downloaded {what}",
                                        field="member")
        except BaseException:
            export.close()
            raise
        headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{member}"'}
        return _Bounded(_closing(body, export), export, deadline, media_type=media, headers=headers)


class _Bounded(StreamingResponse):
    """A download that ends at `deadline` also when the client stops reading: each send waits
    (flow control) at most until then; then the response stops unfinished and the server drops
    the connection (the client sees a short body)."""

    def __init__(self, body: Iterator[bytes], export: CheckpointExport, deadline: float, **kwargs: Any):
        super().__init__(body, **kwargs)
        self.export, self.deadline = export, deadline

    async def stream_response(self, send: Any) -> None:
        async def timed(message: Any) -> None:
            await asyncio.wait_for(send(message), max(0.0, self.deadline - time.monotonic()))

        try:
            await super().stream_response(timed)
        except asyncio.TimeoutError:  # (while sending: no read of the files is in flight)
            log.info("download of %s stopped: it ran past export_timeout_s", self.export.shown)
            self.export.close()


def _drain(spooled: Any) -> Iterator[bytes]:
    with spooled:
        while chunk := spooled.read(1 << 20):
            yield chunk


def _closing(body: Iterator[bytes], export: CheckpointExport) -> Iterator[bytes]:
    """The body, then the export's descriptors closed (also when the client goes away)."""
    try:
        yield from body
    finally:
        export.close()
