"""RestClient: what the hosted services' REST API tells about runs and checkpoints, answered
from a local pool.

Only what a pool on this machine can honestly answer: the server's capabilities, the
checkpoints under the pool's `checkpoint_dir` (list, info, delete, time to live), the
training runs and samplers this process served or whose checkpoints are on disk, and the
sessions (one per ServiceClient) of this process, and a checkpoint's PEFT files for download
(trio_widgets/export.py: signed URLs of a served pool, file:// URLs in-process). Publishing,
copying between projects, billing and audit logs have no local meaning and are not here.

Every method returns an `APIFuture` that is already done (tinker's return an APIFuture,
pytrio's a `concurrent.futures.Future`; both are read with `.result()`); a failure is in the
future, as on the hosted services. The `*_async` twins return the value after one await.
Checkpoint paths may be given as the directory a save returned or as tinker's
`tinker://<run>/<weights|sampler_weights>/<name>`; both name a checkpoint under the pool's
checkpoint_dir.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from .backend import (
    Backend,
    Capabilities,
    DeleteCheckpoint,
    DownloadCheckpoint,
    GetExportUrls,
    GetSampler,
    GetSession,
    GetTrainingRun,
    ListCheckpoints,
    ListSessions,
    ListTrainingRuns,
    SetCheckpointTtl,
    WeightsInfo,
)
from .connect import Pool, connect
from .errors import CheckpointNotFoundError, InvalidInputError
from .export import DEFAULT_MAX_EXPORT_BYTES
from .futures import APIFuture
from .hosted import hosted_only
from .protocol.paths import TINKER_SCHEME
from .types import (
    CheckpointArchiveUrlResponse,
    CheckpointDownloadResult,
    CheckpointDownloadSource,
    CheckpointsListResponse,
    Cursor,
    ExternalWeightsUrlsResponse,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ListSessionsResponse,
    ParsedCheckpointTinkerPath,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)
from .validation import is_int

__all__ = ["RestClient"]

T = TypeVar("T")


@runtime_checkable
class _HasBackend(Protocol):
    """A ServiceClient (without importing it: the client module imports this one)."""

    backend: Backend
AccessScope = Literal["owned", "accessible"]


def _now(work: Callable[[], T]) -> APIFuture[T]:
    """A done future of `work()`'s value, or of the exception it raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(work())
    except Exception as exc:
        future.set_exception(exc)
    return APIFuture(future, request_id=None, op="rest")


def _page(limit: Any, offset: Any) -> tuple[int, int]:
    for name, value in (("limit", limit), ("offset", offset)):
        if isinstance(value, bool) or not is_int(value) or value < 0:
            raise InvalidInputError(f"must be an integer >= 0, got {value!r}", field=name)
    return int(limit), int(offset)


def _parsed(path: Any) -> ParsedCheckpointTinkerPath:
    try:
        return ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as exc:
        raise InvalidInputError(str(exc), field="tinker_path") from None


class RestClient:
    """The hosted services' REST client over a local pool.

    `RestClient()` (tinker 0.38) uses the process-wide pool, as `ServiceClient()` does;
    `RestClient(pool=pool)` or `RestClient(pool)` a pool of yours; `ServiceClient.create_rest_client()`
    (pytrio; deprecated in tinker) its service's pool. `RestClient(base_url=..., api_key=...)`
    asks a served pool (`trio.serve`) in a session of its own; over HTTP a session sees only the
    runs and samplers it made, and deleting checkpoints, their time to live and weights info
    are refused (InvalidInputError, tinker's BadRequestError). `close()` (or `with`) ends that
    session and stops its connection threads.
    """

    def __init__(self, _holder: Any = None, *, base_url: str | None = None, api_key: str | None = None,
                 pool: Pool | None = None):
        self._own_backend: Backend | None = None  # made here from base_url: close() ends its session
        if isinstance(_holder, _HasBackend):  # a ServiceClient: its session's backend
            backend: Backend = _holder.backend
        elif isinstance(_holder, Pool) or _holder is None:
            # over HTTP it is a session of its own; over a pool, a reader of the pool's ledger
            backend, owned = connect(pool or _holder, base_url=base_url, api_key=api_key, session=False)
            if owned:
                self._own_backend = backend
        else:
            raise InvalidInputError(f"expected a LocalPool or a ServiceClient, got {type(_holder).__name__}",
                                    field="RestClient()")
        self._backend = backend

    def __repr__(self) -> str:
        return f"<RestClient {self._backend!r}>"

    def close(self) -> None:
        """A RestClient made with `base_url=`: finish its session on the server and stop its
        connection threads (dropping it does the same, later). Otherwise nothing: the pool or the
        ServiceClient it asks is not its to close. A second call does nothing."""
        if self._own_backend is not None:
            self._own_backend.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_telemetry(self) -> None:
        """tinker: its SDK's own event reporter, None when off. Off here (see `pool.telemetry`)."""
        return None

    # -- the server ----------------------------------------------------------------------------
    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        """What the pool serves: its base models (an `APIFuture`)."""
        return _now(lambda: self._backend.call(Capabilities()))

    # -- checkpoints ---------------------------------------------------------------------------
    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """The checkpoints of one run (its `model_id` / `training_run_cuid`), oldest first."""
        return _now(lambda: CheckpointsListResponse(checkpoints=self._backend.call(ListCheckpoints(training_run_id))))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """Every checkpoint under the pool's checkpoint_dir, newest first, a page at a time."""
        def page() -> CheckpointsListResponse:
            lim, off = _page(limit, offset)
            every = list(reversed(self._backend.call(ListCheckpoints(None))))
            return CheckpointsListResponse(checkpoints=every[off:off + lim],
                                           cursor=Cursor(offset=off, limit=lim, total_count=len(every)))
        return _now(page)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete `checkpoint_id` ("weights/<name>" or "sampler_weights/<name>") of a run."""
        return _now(lambda: self._backend.call(DeleteCheckpoint(training_run_id, checkpoint_id)))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Delete the checkpoint a `tinker://` path names."""
        def delete() -> None:
            parsed = _parsed(tinker_path)
            self._backend.call(DeleteCheckpoint(parsed.training_run_id, parsed.checkpoint_id))
        return _now(delete)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """Expire the checkpoint `ttl_seconds` from now (1 hour to 10 years), or never (None).
        An expired checkpoint is deleted when it is next listed or opened."""
        def set_ttl() -> None:
            parsed = _parsed(tinker_path)
            self._backend.call(SetCheckpointTtl(parsed.training_run_id, parsed.checkpoint_id, ttl_seconds))
        return _now(set_ttl)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        """The base model, rank and kind of the checkpoint a `tinker://` path names."""
        return _now(lambda: self._backend.call(WeightsInfo(tinker_path)))

    # -- downloads (trio_widgets/export.py) -------------------------------------------------------
    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """tinker: a URL per file of a checkpoint's PEFT directory (adapter_config.json,
        adapter_model.safetensors; `.age` files for an export encrypted by save_weights_external),
        valid until `expires`. A served pool signs them for this key's checkpoints (no key in
        the URL); in-process they are file:// URLs of the checkpoint itself."""
        return _now(lambda: self._external_urls(tinker_path))

    def _external_urls(self, tinker_path: str) -> ExternalWeightsUrlsResponse:
        urls = self._backend.call(GetExportUrls(tinker_path))
        return ExternalWeightsUrlsResponse(urls=dict(urls.file_urls), expires=urls.expires)

    def _checkpoint_ref(self, checkpoint_id: Any) -> str:
        """pytrio's `checkpoint_id` as the backend takes it. A tinker:// path (or, in-process, a
        checkpoint's absolute directory) is taken as it is; anything else is the `checkpoint_id`
        of one of this key's checkpoints as `list_checkpoints` / `list_user_checkpoints` give it
        (`"weights/<name>"`), found in that listing: never a path from the current directory."""
        if not isinstance(checkpoint_id, str) or not checkpoint_id.strip():
            raise InvalidInputError(f"must be a checkpoint_id from list_checkpoints or a tinker:// path, got "
                                    f"{checkpoint_id!r:.80}", field="checkpoint_id")
        if checkpoint_id.startswith(TINKER_SCHEME) or os.path.isabs(checkpoint_id):
            return checkpoint_id
        found: list[str] = []
        offset = 0
        while True:
            page = self.list_user_checkpoints(limit=100, offset=offset).result()
            found += [c.tinker_path for c in page.checkpoints if c.checkpoint_id == checkpoint_id]
            offset += len(page.checkpoints)
            if not page.checkpoints or page.cursor is None or offset >= page.cursor.total_count:
                break
        if len(found) == 1:
            return found[0]
        if not found:
            raise CheckpointNotFoundError(
                f"no checkpoint of yours has the id {checkpoint_id!r:.120}; pass a checkpoint_id that "
                f"list_checkpoints(run_id) lists, or the checkpoint's tinker:// path", path=checkpoint_id,
                field="checkpoint_id")
        raise InvalidInputError(f"{len(found)} of your runs have a checkpoint {checkpoint_id!r:.120} "
                                f"({', '.join(found[:5])}): pass the tinker:// path of the one you mean",
                                field="checkpoint_id")

    def get_checkpoint_archive_url(self, checkpoint_id: str) -> APIFuture[CheckpointArchiveUrlResponse]:
        """pytrio: the URL of the checkpoint's PEFT directory as one tar, valid until `expires`
        (`checkpoint_id`: as listed by `list_checkpoints`, its tinker:// path, or its directory
        in-process, where the URL is the directory's file:// URL)."""
        def archive() -> CheckpointArchiveUrlResponse:
            urls = self._backend.call(GetExportUrls(self._checkpoint_ref(checkpoint_id)))
            return CheckpointArchiveUrlResponse(url=urls.archive_url, expires=urls.expires)
        return _now(archive)

    def get_checkpoint_download_url(self, checkpoint_id: str) -> APIFuture[CheckpointDownloadSource]:
        """pytrio: the archive's URL as a download source (the pool itself, always ready)."""
        def source() -> CheckpointDownloadSource:
            urls = self._backend.call(GetExportUrls(self._checkpoint_ref(checkpoint_id)))
            return CheckpointDownloadSource(checkpoint_id=str(checkpoint_id), url=urls.archive_url,
                                            expires=urls.expires)
        return _now(source)

    def download_checkpoint(self, checkpoint_id: str, destination_path: str | os.PathLike[str], *,
                            resume: bool = True, max_bytes: int = DEFAULT_MAX_EXPORT_BYTES
                            ) -> APIFuture[CheckpointDownloadResult]:
        """pytrio: download a checkpoint. `destination_path` becomes a PEFT directory
        (adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained`),
        made if absent; its files are replaced only once the whole archive has arrived. At most
        `max_bytes`; `resume` is accepted and nothing is resumed (the archive is small and whole)."""
        def download() -> CheckpointDownloadResult:
            if not isinstance(resume, bool):
                raise InvalidInputError(f"must be True or False, got {resume!r:.40}", field="resume")
            if isinstance(max_bytes, bool) or not is_int(max_bytes) or max_bytes < 1:
                raise InvalidInputError(f"must be a positive number of bytes, got {max_bytes!r:.40}", field="max_bytes")
            if not isinstance(destination_path, (str, os.PathLike)) or not os.fspath(destination_path):
                raise InvalidInputError(f"must be a directory path, got {destination_path!r:.80}",
                                        field="destination_path")
            destination = Path(os.fspath(destination_path)).expanduser()
            source = self._checkpoint_ref(checkpoint_id)
            sizes = self._backend.call(DownloadCheckpoint(source, destination, int(max_bytes)))
            total = sum(sizes.values())
            return CheckpointDownloadResult(checkpoint_id=str(checkpoint_id), path=str(destination),
                                            bytes_written=total, file_size_bytes=total)
        return _now(download)

    # -- training runs, samplers, sessions -----------------------------------------------------
    def get_training_run(self, training_run_id: str, access_scope: AccessScope = "owned") -> APIFuture[TrainingRun]:
        """The record of one training run, by its id."""
        return _now(lambda: self._backend.call(GetTrainingRun(training_run_id)))

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: AccessScope = "owned"
                                        ) -> APIFuture[TrainingRun]:
        """The record of the training run a `tinker://` path belongs to."""
        return _now(lambda: self._backend.call(GetTrainingRun(_parsed(tinker_path).training_run_id)))

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned",
                           project_id: str | None = None) -> APIFuture[TrainingRunsResponse]:
        """Runs this process served and runs with checkpoints on disk, most recent first."""
        def page() -> TrainingRunsResponse:
            lim, off = _page(limit, offset)
            runs = self._backend.call(ListTrainingRuns())
            return TrainingRunsResponse(training_runs=runs[off:off + lim],
                                        cursor=Cursor(offset=off, limit=lim, total_count=len(runs)))
        return _now(page)

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        """A sampler this process made (`SamplingClient.sampling_run_cuid`)."""
        return _now(lambda: self._backend.call(GetSampler(sampler_id)))

    def get_session(self, session_id: str, access_scope: AccessScope = "owned") -> APIFuture[GetSessionResponse]:
        """A session is one ServiceClient of this process (`service_session_cuid`)."""
        return _now(lambda: self._backend.call(GetSession(session_id)))

    def list_sessions(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
                      ) -> APIFuture[ListSessionsResponse]:
        """The sessions (one per `ServiceClient`) this pool has seen, a page at a time."""
        def page() -> ListSessionsResponse:
            lim, off = _page(limit, offset)
            return ListSessionsResponse(sessions=self._backend.call(ListSessions())[off:off + lim])
        return _now(page)

    # -- hosted-only names (trio_widgets/hosted.py): they exist, and say why not here ---------------
    copy_weights = hosted_only("copy_weights")
    copy_weights_async = hosted_only("copy_weights_async", is_async=True)
    assign_session_project = hosted_only("assign_session_project")
    assign_session_project_async = hosted_only("assign_session_project_async", is_async=True)
    export_session_trace = hosted_only("export_session_trace")
    export_session_trace_async = hosted_only("export_session_trace_async", is_async=True)
    get_audit_log = hosted_only("get_audit_log")
    get_audit_log_async = hosted_only("get_audit_log_async", is_async=True)
    get_billing_usage = hosted_only("get_billing_usage")
    get_billing_usage_async = hosted_only("get_billing_usage_async", is_async=True)
    get_current_checkpoint_storage_usage = hosted_only("get_current_checkpoint_storage_usage")
    get_current_checkpoint_storage_usage_async = hosted_only(
        "get_current_checkpoint_storage_usage_async", is_async=True)
    publish_checkpoint_from_tinker_path = hosted_only("publish_checkpoint_from_tinker_path")
    publish_checkpoint_from_tinker_path_async = hosted_only(
        "publish_checkpoint_from_tinker_path_async", is_async=True)
    unpublish_checkpoint_from_tinker_path = hosted_only("unpublish_checkpoint_from_tinker_path")
    unpublish_checkpoint_from_tinker_path_async = hosted_only(
        "unpublish_checkpoint_from_tinker_path_async", is_async=True)
    search_sessions = hosted_only("search_sessions")
    search_sessions_async = hosted_only("search_sessions_async", is_async=True)
    whoami = hosted_only("whoami")
    whoami_async = hosted_only("whoami_async", is_async=True)

    # -- the awaitable twins (tinker deprecates them, pytrio does not) ---------------------------
    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        """The async twin of `list_checkpoints`: the same answer, awaited."""
        return await self.list_checkpoints(training_run_id)

    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        """The async twin of `list_user_checkpoints`: the same answer, awaited."""
        return await self.list_user_checkpoints(limit, offset)

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        """The async twin of `delete_checkpoint`: the same answer, awaited."""
        return await self.delete_checkpoint(training_run_id, checkpoint_id)

    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        """The async twin of `delete_checkpoint_from_tinker_path`: the same answer, awaited."""
        return await self.delete_checkpoint_from_tinker_path(tinker_path)

    async def set_checkpoint_ttl_from_tinker_path_async(self, tinker_path: str, ttl_seconds: int | None) -> None:
        """The async twin of `set_checkpoint_ttl_from_tinker_path`: the same answer, awaited."""
        return await self.set_checkpoint_ttl_from_tinker_path(tinker_path, ttl_seconds)

    async def get_external_weights_urls_async(self, tinker_path: str) -> ExternalWeightsUrlsResponse:
        """The async twin of `get_external_weights_urls`: the same answer, awaited."""
        return await self.get_external_weights_urls(tinker_path)

    async def get_checkpoint_archive_url_async(self, checkpoint_id: str) -> CheckpointArchiveUrlResponse:
        """The async twin of `get_checkpoint_archive_url`: the same answer, awaited."""
        return await self.get_checkpoint_archive_url(checkpoint_id)

    async def get_checkpoint_download_url_async(self, checkpoint_id: str) -> CheckpointDownloadSource:
        """The async twin of `get_checkpoint_download_url`: the same answer, awaited."""
        return await self.get_checkpoint_download_url(checkpoint_id)

    async def download_checkpoint_async(self, checkpoint_id: str, destination_path: str | os.PathLike[str], *,
                                        resume: bool = True, max_bytes: int = DEFAULT_MAX_EXPORT_BYTES
                                        ) -> CheckpointDownloadResult:
        """The async twin of `download_checkpoint`: the same answer, awaited."""
        return await self.download_checkpoint(checkpoint_id, destination_path, resume=resume, max_bytes=max_bytes)

    async def get_training_run_async(self, training_run_id: str, access_scope: AccessScope = "owned"
                                     ) -> TrainingRun:
        """The async twin of `get_training_run`: the same answer, awaited."""
        return await self.get_training_run(training_run_id, access_scope)

    async def get_training_run_by_tinker_path_async(self, tinker_path: str, access_scope: AccessScope = "owned"
                                                    ) -> TrainingRun:
        """The async twin of `get_training_run_by_tinker_path`: the same answer, awaited."""
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    async def list_training_runs_async(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned",
                                       project_id: str | None = None) -> TrainingRunsResponse:
        """The async twin of `list_training_runs`: the same answer, awaited."""
        return await self.list_training_runs(limit, offset, access_scope, project_id)

    async def get_sampler_async(self, sampler_id: str) -> GetSamplerResponse:
        """The async twin of `get_sampler`: the same answer, awaited."""
        return await self.get_sampler(sampler_id)

    async def get_session_async(self, session_id: str, access_scope: AccessScope = "owned") -> GetSessionResponse:
        """The async twin of `get_session`: the same answer, awaited."""
        return await self.get_session(session_id, access_scope)

    async def list_sessions_async(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
                                  ) -> ListSessionsResponse:
        """The async twin of `list_sessions`: the same answer, awaited."""
        return await self.list_sessions(limit, offset, access_scope)
