"""LocalBackend: the client API's requests, run by an in-process LocalPool.

Everything that needs the model happens here or in the op handlers: loading the base,
building adapters and tenants, reading checkpoints, checking inputs against the model.
It also answers the RestClient from what the pool served in this process and from the
checkpoints under its `checkpoint_dir`.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from .._worker import BackgroundWorker
from ..backend import (
    AttachSampler,
    Call,
    CreateModelRequest,
    CreateSamplerRequest,
    ExportUrls,
    FromStateRequest,
    ModelHandle,
    Open,
    SaveRequest,
    ServedStateView,
    T,
    answer,
    opened,
)
from ..errors import (
    CheckpointNotFoundError,
    ClientClosedError,
    InvalidInputError,
    NotSupportedError,
    ResourceNotFoundError,
)
from ..export import PEFT_FILES, CheckpointExport, extract_tar
from ..futures import APIFuture
from ..protocol import names, shown_path
from ..types import (
    AdamOptimizerConfig,
    Checkpoint,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ModelOperationCapabilities,
    SupportedModel,
    TrainingRun,
    WeightsInfoResponse,
)
from ..validation import check_ttl, is_int
from . import checkpoints as ckpt
from .handlers import handle_of
from .lora import LoRAAdapter
from .models import context_length_of, is_base_model_name
from .served import ServedState
from .tenants import PoolLike, Tenant

__all__ = ["LocalBackend"]


NotFound = ResourceNotFoundError  # nothing of that id is known to the pool (404)


def _plain(export: CheckpointExport) -> None:
    if export.age_recipients:
        raise NotSupportedError(f"{export.shown!r} is an age-encrypted export: its files are encrypted when they leave "
                                f"a served pool; an in-process pool has them unencrypted on this machine")


# -- what a pool served in this process (for the RestClient) ---------------------------------

@dataclass
class _Served:
    """A training run or a sampler the pool served, kept after its client is gone."""

    kind: str  # "training" or "sampling"
    client_id: str
    base_model: str
    rank: int
    session_id: str
    model_path: str | None = None
    train_flags: tuple[bool, bool, bool] = (True, True, True)  # attn, mlp, unembed
    user_metadata: dict[str, str] | None = None
    last_request: float = field(default_factory=time.time)
    run_dir: str | None = None  # a training run's checkpoints' directory under the root (default: its id)


@dataclass
class _Session:
    user_metadata: dict[str, str] | None
    display_name: str | None
    runs: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    next_run: int = 0  # the n of the session's next <session>:train:<n> made here (names.run_id)


@dataclass
class _Ledger:
    """Per pool, weakly keyed by it (a ledger never keeps a pool alive)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    served: dict[str, _Served] = field(default_factory=dict)  # run id or sampler id -> record
    by_client: dict[str, str] = field(default_factory=dict)  # client id -> run id / sampler id
    sessions: dict[str, _Session] = field(default_factory=dict)


_MAX_SESSIONS = 4096  # sessions a pool's ledger lists (a RestClient's listing; oldest dropped first)
_LEDGERS: weakref.WeakKeyDictionary[PoolLike, _Ledger] = weakref.WeakKeyDictionary()
_LEDGERS_LOCK = threading.Lock()


def _ledger(pool: PoolLike) -> _Ledger:
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(pool)
        if ledger is None:
            ledger = _LEDGERS[pool] = _Ledger()
        return ledger


def _run_names(run_id: Any, run_dir: Any) -> tuple[str | None, str | None]:
    """A server's names for a new run: checked here, the one place runs are made."""
    if run_id is not None and (not isinstance(run_id, str) or not run_id or "/" in run_id or len(run_id) > 200):
        raise InvalidInputError(f"must be a run id without '/', got {run_id!r:.80}", field="run_id")
    return run_id, ckpt.validate_run_dir(run_dir) if run_dir is not None else None


def _utc(unix_time: float) -> datetime:
    return datetime.fromtimestamp(unix_time, tz=timezone.utc)


def _owner() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (e.g. a container without one)
        return "local"


class LocalBackend:
    """Runs a ServiceClient's requests on `pool` (see trio_widgets.backend.Backend). One backend
    is one session: the runs and samplers it creates are listed under `session_id`.

    `owner`: a served pool's API key (its digest): that key's backend, whose runs live under
    `served/<owner>/`, which reads checkpoints by its own runs' tinker:// paths only and lists
    its own runs and checkpoints only (another key's read as absent: no existence oracle).
    Ownership is this object: a server holds one per key."""

    def __init__(self, pool: PoolLike, *, user_metadata: dict[str, str] | None = None,
                 display_name: str | None = None, session: bool = True, owner: str | None = None):
        self.pool = pool
        self.name = pool.name
        self.owner = owner
        self.session_id = names.new_session_id()
        self._worker = BackgroundWorker(f"trio-client-{pool.name}")
        # the hook holds the worker, not this backend: no cycle keeps a dropped pool alive
        pool.on_close(self._worker.stop)
        self._ledger = _ledger(pool)
        if session:  # a RestClient's backend reads the ledger only: it is no session
            self._on_open_session(self.session_id, user_metadata, display_name)

    def _on_open_session(self, session_id: str, user_metadata: dict[str, str] | None = None,
                     display_name: str | None = None) -> None:
        """List a session in the pool's one session table (a server opens one per remote
        ServiceClient; requests that name it list their runs and samplers under it)."""
        with self._ledger.lock:
            self._ledger.sessions.setdefault(session_id, _Session(user_metadata, display_name))
            while len(self._ledger.sessions) > _MAX_SESSIONS:  # bounded: the oldest go first
                del self._ledger.sessions[next(iter(self._ledger.sessions))]

    def _on_served_tables(self, models: tuple[str, ...], key_names: dict[str, str], session_timeout_s: float,
                          reorder_wait_s: float, max_sessions_per_key: int, max_clients_per_session: int,
                          max_futures_per_key: int, max_clients_per_key: int, max_state_bytes_per_key: int,
                          id_tag: str = "") -> ServedStateView:
        """A server's served state over this backend (trio_widgets/engine/served.py)."""
        return ServedState(self, models=list(models), key_names=dict(key_names), session_timeout_s=session_timeout_s,
                           reorder_wait_s=reorder_wait_s, max_sessions_per_key=max_sessions_per_key,
                           max_clients_per_session=max_clients_per_session, max_futures_per_key=max_futures_per_key,
                           max_clients_per_key=max_clients_per_key, max_state_bytes_per_key=max_state_bytes_per_key,
                           id_tag=id_tag)

    def __repr__(self) -> str:
        return f"<LocalBackend {self.pool!r} {self.session_id}>"

    # -- the seam (trio_widgets.backend.Backend) ------------------------------------------------
    def open(self, request: Open) -> ModelHandle:
        return opened(self, request)

    def call(self, request: Call[T]) -> T:
        return answer(self, request)

    # -- ownership ------------------------------------------------------------------------------
    def _resolve(self, path: Any) -> Path:
        """The directory a checkpoint path names: any path in-process; for a key's backend, the
        tinker:// path of one of its own runs, that exists."""
        return ckpt.resolve_path(path, self.pool, self.owner)

    def _on_checkpoint_dir(self, path: Any) -> Path:
        """(A served pool streams a checkpoint's files from it: an expired one reads as absent, as
        listings do.)"""
        directory = self._resolve(path)
        try:
            meta = ckpt.read_manifest(directory, self.pool, shown_path(path))
        except OSError as exc:
            raise ckpt.CheckpointError(f"cannot read checkpoint {str(path)!r:.200}: {exc.strerror or exc}",
                                       path=str(path)[:200]) from None
        if meta and ckpt.expired(meta, str(path)):
            raise CheckpointNotFoundError(f"checkpoint {str(path)!r:.200} has expired", path=str(path)[:200])
        return directory

    def _owned(self, run_id: Any) -> str:
        """The directory of `run_id` under this key's tree (NotFound for a malformed id)."""
        if not isinstance(run_id, str) or not names.RUN_ID_RE.match(run_id):
            raise NotFound(f"training run {run_id!r:.80} was not found for this API key", field="training_run_id")
        return names.owner_run_dir(self.owner, run_id)

    def _owned_runs(self) -> list[str]:
        """This key's run ids: served here, or with checkpoints on disk (from an earlier start); a
        listing, bounded."""
        ids = set(self._runs_in(f"{names.SERVED_DIR}/{self.owner}"))
        with contextlib.suppress(OSError):
            for entry in (ckpt.checkpoint_root(self.pool) / names.SERVED_DIR / str(self.owner)).iterdir():
                run_id = names.run_id_of_dirname(entry.name)
                if run_id is not None:
                    ids.add(run_id)
        return sorted(ids)[:10_000]

    # -- clients ------------------------------------------------------------------------
    def _on_supported_models(self) -> list[str]:
        return self.pool.supported_models()

    def _on_is_base_model(self, name: Any) -> bool:
        return is_base_model_name(name)

    def _on_is_checkpoint(self, path: Any) -> bool:
        """Whether `path` names a checkpoint (a directory with a manifest or a PEFT config)."""
        if not isinstance(path, (str, os.PathLike)):
            return False
        try:
            directory = ckpt.resolve_path(path, self.pool, self.owner)
        except (InvalidInputError, OSError):
            return False
        return ckpt.is_checkpoint_dir(directory)

    def _on_create_model(self, request: CreateModelRequest) -> ModelHandle:
        pool = self.pool
        rank = request.rank
        if not is_int(rank):
            raise InvalidInputError(f"must be an integer, got {rank!r}", field="rank")
        if rank < 1 or rank > pool.max_rank:
            raise InvalidInputError(f"must be between 1 and the pool's max_rank {pool.max_rank}, got {rank}",
                                    field="rank")
        if not (request.train_mlp or request.train_attn or request.train_unembed):
            raise InvalidInputError("nothing to train: train_mlp, train_attn and train_unembed are all False",
                                    field="train_mlp")
        if request.seed is not None and (not is_int(request.seed) or not -2**63 <= request.seed < 2**64):
            # what torch's generator takes (a larger one failed later, as a server error over HTTP)
            raise InvalidInputError(f"must be None or an integer from -2**63 to 2**64 - 1, got {request.seed!r:.40}",
                                    field="seed")
        base = pool.get_base_model(request.base_model)
        targets = base.targets_for(train_attn=request.train_attn, train_mlp=request.train_mlp,
                                   train_unembed=request.train_unembed)
        if not targets:
            raise InvalidInputError(f"{request.base_model} has no linear layers of the kinds asked for",
                                    field="train_mlp")
        run_id, run_dir = self._new_run(request.run_id, request.run_dir, request.session_id)
        seed = int(request.seed) if request.seed is not None else secrets.randbits(31)
        adapter = LoRAAdapter(targets, int(rank), seed, base.device)
        tenant = Tenant(pool.new_client_id("lora"), base, adapter, int(rank), seed, train_attn=request.train_attn,
                        train_mlp=request.train_mlp, train_unembed=request.train_unembed, run_id=run_id,
                        run_dir=run_dir, owner=self.owner)
        pool.add_tenant(tenant, request.label)
        return self._served(handle_of(tenant, label=request.label), request.user_metadata, request.session_id)

    def _on_create_model_from_state(self, request: FromStateRequest) -> ModelHandle:
        pool = self.pool
        _run_names(request.run_id, request.run_dir)  # refused before the checkpoint is read
        loaded = ckpt.read_checkpoint(request.path, pool, require_optimizer=request.with_optimizer,
                                      owner=self.owner)
        shown = shown_path(request.path, loaded.path)
        if loaded.base_model is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts", field="path")
        if request.base_model is not None and loaded.kind != "peft" and loaded.base_model != request.base_model:
            raise ckpt.CheckpointError(f"checkpoint {shown!r} is for base model {loaded.base_model!r}, not "
                                       f"{request.base_model!r}", path=shown, field="base_model")
        base = pool.get_base_model(loaded.base_model)
        targets = ckpt.targets_of(loaded, base, shown)
        if loaded.rank > pool.max_rank:
            raise ckpt.CheckpointError(f"checkpoint {shown!r} has rank {loaded.rank}, more than the pool's "
                                       f"max_rank {pool.max_rank}", path=shown)
        kinds = {base.lora_targets[name][0] for name in targets}
        meta = loaded.meta

        def flag(key: str, kind: str) -> bool:  # saved by us; else what the weights adapt
            return bool(meta.get(key, kind in kinds))

        adapter = LoRAAdapter(targets, loaded.rank, loaded.seed, base.device, alpha=loaded.alpha)
        adapter.load_state_dict(loaded.state_dict(), with_optimizer=request.with_optimizer)
        run_id, run_dir = self._new_run(request.run_id, request.run_dir, request.session_id)
        tenant = Tenant(pool.new_client_id("lora"), base, adapter, loaded.rank, loaded.seed,
                        train_attn=flag("train_attn", "attn"), train_mlp=flag("train_mlp", "mlp"),
                        train_unembed=flag("train_unembed", "unembed"), run_id=run_id, run_dir=run_dir,
                        resumed_from=loaded.path, owner=self.owner)
        pool.add_tenant(tenant, request.label)
        return self._served(handle_of(tenant, model_path=loaded.path, label=request.label), request.user_metadata,
                            request.session_id)

    def _next_run(self, session_id: str | None) -> tuple[str, int]:
        """The session a new run is listed under, and its number there."""
        session_id = session_id or self.session_id
        with self._ledger.lock:
            session = self._ledger.sessions.get(session_id)
            if session is None:
                session = self._ledger.sessions[session_id] = _Session(None, None)
            n = session.next_run
            session.next_run += 1
        return session_id, n

    def _new_run(self, run_id: Any, run_dir: Any, session_id: str | None) -> tuple[str, str]:
        """A new run's id and directory: a server's (it numbers runs by the SDK's model_seq_id), else
        the session's next `<session>:train:<n>` (protocol/names.py: the same names either way)."""
        run_id, run_dir = _run_names(run_id, run_dir)
        if run_id is None:
            session, n = self._next_run(session_id)
            run_id = names.run_id(session, n)
        return run_id, run_dir or names.owner_run_dir(self.owner, run_id)

    def _on_sampler_handle(self, client_id: str) -> str:
        raise NotSupportedError("get_sampler_handle() passes a sampler to another process; an in-process pool's "
                                "samplers live in this process: serve the pool (trio.serve) and sample through its "
                                "URL, or create a sampling client from the saved path in the other process")

    def _on_attach_sampler(self, request: AttachSampler) -> ModelHandle:
        raise NotSupportedError("from_sampler_handle() reaches a served pool's sampler; an in-process pool has none "
                                "to reach")

    def _on_create_sampler(self, request: CreateSamplerRequest) -> ModelHandle:
        pool = self.pool
        if request.model_path is None:
            if request.base_model is None:
                raise InvalidInputError("give model_path (saved weights) or base_model", field="model_path")
            base = pool.get_base_model(request.base_model)
            tenant = Tenant(pool.new_client_id("sampler"), base, None, 0, 0, kind="sampling",
                            owner=self.owner)
            pool.add_tenant(tenant, request.label)
            return self._served(handle_of(tenant, label=request.label), session_id=request.session_id,
                                key=request.sampler_id)
        loaded = ckpt.read_checkpoint(request.model_path, pool, owner=self.owner)
        path = request.model_path
        shown = shown_path(path, loaded.path)
        name = request.base_model or loaded.base_model
        if name is None:
            raise InvalidInputError(f"{shown!r} does not say which base model it adapts: pass base_model",
                                    field="base_model")
        if request.base_model is not None and loaded.kind != "peft" and loaded.base_model != request.base_model:
            raise ckpt.CheckpointError(f"checkpoint {shown!r} is for base model {loaded.base_model!r}, not "
                                       f"{request.base_model!r}", path=shown, field="base_model")
        base = pool.get_base_model(name)
        ckpt.targets_of(loaded, base, shown)
        adapter = LoRAAdapter.from_weights(loaded.weights, loaded.rank, loaded.alpha, loaded.seed, base.device)
        tenant = Tenant(pool.new_client_id("sampler"), base, adapter, adapter.rank, adapter.seed, kind="sampling",
                        owner=self.owner)
        pool.add_tenant(tenant, request.label)
        return self._served(handle_of(tenant, model_path=shown, label=request.label), session_id=request.session_id,
                            key=request.sampler_id)

    def release(self, client_id: str, *, dropped: bool = False) -> None:
        if not self.pool.closed:
            self.pool.retire_tenant(client_id, dropped=dropped)

    def _on_tokenizer(self, base_model: str) -> Any:
        return self.pool.get_base_model(base_model).tokenizer

    # -- requests --------------------------------------------------------------------------
    def submit(self, client_id: str, op: str, request: Any) -> APIFuture:
        future = self.pool.submit(client_id, op, request)
        ledger = self._ledger
        key = ledger.by_client.get(client_id)
        record = ledger.served.get(key) if key is not None else None
        if record is not None:
            record.last_request = time.time()
        if isinstance(request, SaveRequest) and request.make_sampler:
            # a snapshot sampler belongs to its training run's session, once the pool has made it
            session_id = record.session_id if record is not None else self.session_id
            future.add_done_callback(lambda f: self._adopt_snapshot(f, session_id, request.sampler_id))
        return future

    def _adopt_snapshot(self, future: APIFuture, session_id: str, key: str | None) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        created = future.result()
        self._served(created.sampler, session_id=session_id, key=key)

    def reserve(self, client_id: str, op: str) -> Any:
        return self.pool.reserve(client_id, op)

    def run_in_background(self, work: Callable[[], None]) -> None:
        self._worker.submit(work)

    def close(self) -> None:
        """Stop the client-side thread (the pool is not closed: other clients may share it)."""
        self._worker.close()

    # -- what the RestClient shows ------------------------------------------------------------
    def _served(self, handle: ModelHandle, user_metadata: dict[str, str] | None = None,
                session_id: str | None = None, key: str | None = None) -> ModelHandle:
        """Record a client in the ledger under its public id: a run's id, or a sampler's `key`
        (a server's name for it) or client id."""
        training = handle.run_id is not None
        key = handle.run_id if handle.run_id is not None else (key or handle.client_id)
        session_id = session_id or self.session_id
        run_dir = None
        if training:
            with contextlib.suppress(ClientClosedError):
                run_dir = self.pool.tenant(handle.client_id).run_dir
        record = _Served("training" if training else "sampling", handle.client_id, handle.base_model, handle.rank,
                         session_id, handle.model_path,
                         (handle.train_attn, handle.train_mlp, handle.train_unembed), user_metadata, run_dir=run_dir)
        ledger = self._ledger
        with ledger.lock:
            ledger.served[key] = record
            ledger.by_client[handle.client_id] = key
            session = ledger.sessions.get(session_id)
            if session is not None:
                (session.runs if training else session.samplers).append(key)
        return handle

    def _on_capabilities(self) -> GetServerCapabilitiesResponse:
        models = []
        for name in self._on_supported_models():
            context = context_length_of(name)
            ops = ModelOperationCapabilities(available=True, max_batch_size=None,
                                             max_tokens_per_request=self.pool.max_tokens_per_pass,
                                             max_seq_len=context)
            models.append(SupportedModel(name, max_context_length=context, trainable=True, sampleable=True,
                                         training=ops, sampling=ops))
        return GetServerCapabilitiesResponse(models)

    def _checkpoint(self, entry: ckpt.CheckpointEntry) -> Checkpoint:
        """A checkpoint as every transport lists it: `path` is what its save returned, the tinker://
        path (pytrio's field; LocalPool.checkpoint_path gives the directory)."""
        expires = entry.meta.get("expires_at")
        path = names.checkpoint_path(entry.run_id, entry.segment, entry.name)  # type: ignore[arg-type]
        return Checkpoint(checkpoint_id=entry.checkpoint_id, checkpoint_type=ckpt.SEGMENTS[entry.segment],
                          time=_utc(entry.created), tinker_path=path,
                          path=path, size_bytes=entry.size_bytes, public=False,
                          user_metadata=dict(entry.meta["user_metadata"]) if entry.meta.get("user_metadata")
                          else entry.meta.get("user_metadata"),
                          expires_at=_utc(expires) if expires is not None else None)

    def _on_checkpoints(self, run_id: str | None = None) -> list[Checkpoint]:
        """Checkpoints under the pool's checkpoint_dir (of one run, or all), oldest first; a key's
        backend: its own."""
        if self.owner is not None:
            if run_id is None:
                found = [c for r in self._owned_runs()
                         for c in self._run_checkpoints(r, names.owner_run_dir(self.owner, r))]
                return sorted(found, key=lambda c: (c.time, c.tinker_path))
            run_dir = self._owned(run_id)
            if not (ckpt.checkpoint_root(self.pool) / run_dir).is_dir():
                record = self._record(run_id)
                if record is not None and record.run_dir == run_dir:
                    return []  # this key's run, nothing saved yet
                raise NotFound(f"training run {run_id!r:.80} was not found for this API key",
                               field="training_run_id")
            return self._run_checkpoints(run_id, run_dir)
        if run_id is None:
            return [self._checkpoint(e) for e in ckpt.list_checkpoints(self.pool)]
        return [self._checkpoint(e) for e in self._entries(run_id, self._record(run_id))]

    def _run_checkpoints(self, run_id: str, run_dir: str) -> list[Checkpoint]:
        """A run's checkpoints in its directory `run_dir` (a server names its runs' directories;
        its clients see tinker:// paths, never the server's directories)."""
        return [self._checkpoint(e) for e in ckpt.list_checkpoints(self.pool, run_id, run_dir=run_dir)]

    def _run_in(self, run_id: str, run_dir: str) -> TrainingRun:
        """A served run by its id and directory: what this pool recorded of it (if that run is the
        one in `run_dir`) and its checkpoints there, named by tinker:// paths only."""
        record = self._record(run_id)
        record = record if record is not None and record.run_dir == run_dir else None
        entries = ckpt.list_checkpoints(self.pool, run_id, run_dir=run_dir)
        if record is None and not entries:
            raise NotFound(f"no training run {run_id!r:.80}", field="training_run_id")
        return self._run(run_id, record, entries)

    def _runs_in(self, prefix: str) -> list[str]:
        """The ids of the runs this pool served whose directories are under `prefix/`."""
        with self._ledger.lock:
            return [key for key, r in self._ledger.served.items()
                    if r.kind == "training" and r.run_dir is not None and r.run_dir.startswith(prefix + "/")]

    def _record(self, run_id: Any) -> _Served | None:
        with self._ledger.lock:
            record = self._ledger.served.get(run_id) if isinstance(run_id, str) else None
        return record if record is not None and record.kind == "training" else None

    def _run_dir(self, run_id: Any) -> str | None:
        record = self._record(run_id)
        return record.run_dir if record is not None else None

    def _on_delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        run_dir = self._owned(run_id) if self.owner is not None else self._run_dir(run_id)
        ckpt.delete_checkpoint(ckpt.checkpoint_dir_of(self.pool, run_id, checkpoint_id, run_dir=run_dir))

    def _on_set_checkpoint_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        run_dir = self._owned(run_id) if self.owner is not None else self._run_dir(run_id)
        ttl = check_ttl(ttl_seconds)
        directory = ckpt.checkpoint_dir_of(self.pool, run_id, checkpoint_id, run_dir=run_dir)
        ckpt.set_expiry(directory, None if ttl is None else time.time() + ttl, self.pool)

    def _live_checkpoint(self, path: Any) -> Path:
        """The directory of an unexpired checkpoint (an expired one reads as absent, as listings do)."""
        directory = self._resolve(path)
        meta = ckpt.read_manifest(directory, self.pool, shown_path(path))
        if meta and ckpt.expired(meta, str(path)):  # (named as the caller named it: not this machine's directory)
            raise CheckpointNotFoundError(f"checkpoint {str(path)!r:.200} has expired", path=str(path)[:200])
        return directory

    def _on_export_urls(self, path: Any) -> ExportUrls:
        """file:// URLs of the checkpoint's own directory and files: in-process, they are on this
        machine already (checked as an export is: PEFT files, regular, no symlinks)."""
        directory = self._live_checkpoint(path)
        with CheckpointExport(directory, shown=str(path), verify=False) as export:
            _plain(export)
        return ExportUrls(directory.as_uri(), {name: (directory / name).as_uri() for name in PEFT_FILES},
                          datetime.now(timezone.utc) + timedelta(hours=1))

    def _on_download_checkpoint(self, path: Any, destination: Path, max_bytes: int) -> dict[str, int]:
        with CheckpointExport(self._live_checkpoint(path), max_bytes=max_bytes, shown=str(path)) as export:
            _plain(export)
            return extract_tar(export.iter_tar(), destination, max_bytes=max_bytes)

    def _on_weights_info(self, path: Any) -> WeightsInfoResponse:
        directory = self._resolve(path)
        meta = ckpt.read_manifest(directory, self.pool, shown_path(path))
        if not meta:  # a PEFT directory from elsewhere: read it whole
            loaded = ckpt.read_checkpoint(path, self.pool, owner=self.owner)
            if loaded.base_model is None:
                raise InvalidInputError(f"{str(path)!r:.200} does not say which base model it adapts", field="path")
            return WeightsInfoResponse(base_model=loaded.base_model, is_lora=True, lora_rank=loaded.rank)
        if ckpt.expired(meta, str(path)):
            raise CheckpointNotFoundError(f"checkpoint {str(path)!r:.200} has expired", path=str(path)[:200])
        return WeightsInfoResponse(base_model=meta["base_model"], is_lora=True,
                                   optimizer_config=AdamOptimizerConfig(), lora_rank=meta["rank"],
                                   train_unembed=meta.get("train_unembed"), train_mlp=meta.get("train_mlp"),
                                   train_attn=meta.get("train_attn"))

    def _on_training_runs(self) -> list[TrainingRun]:
        """Runs served in this process and runs with checkpoints on disk, most recent first; a key's
        backend: its own."""
        if self.owner is not None:
            runs = []
            for run_id in self._owned_runs():
                with contextlib.suppress(InvalidInputError):
                    runs.append(self._run_in(run_id, names.owner_run_dir(self.owner, run_id)))
            return sorted(runs, key=lambda r: (r.last_request_time, r.training_run_id), reverse=True)
        by_run: dict[str, list[ckpt.CheckpointEntry]] = {}
        for entry in ckpt.list_checkpoints(self.pool):
            by_run.setdefault(entry.run_id, []).append(entry)
        with self._ledger.lock:
            served = {k: v for k, v in self._ledger.served.items() if v.kind == "training"}
        for run_id, record in served.items():
            if record.run_dir is not None:  # a served run: its checkpoints are in its own directory
                by_run[run_id] = self._entries(run_id, record)
        runs = [self._run(run_id, served.get(run_id), by_run.get(run_id, [])) for run_id in {*served, *by_run}]
        return sorted(runs, key=lambda r: (r.last_request_time, r.training_run_id), reverse=True)

    def _on_training_run(self, run_id: str) -> TrainingRun:
        if self.owner is not None:
            return self._run_in(run_id, self._owned(run_id))
        if not isinstance(run_id, str) or not run_id:
            raise InvalidInputError(f"must be a run id, got {run_id!r}", field="training_run_id")
        with self._ledger.lock:
            record = self._ledger.served.get(run_id)
        entries = self._entries(run_id, record)
        if (record is None or record.kind != "training") and not entries:
            raise NotFound(f"no training run {run_id!r} in this pool or under {ckpt.checkpoint_root(self.pool)}",
                           field="training_run_id")
        return self._run(run_id, record if record is not None and record.kind == "training" else None, entries)

    def _entries(self, run_id: str, record: _Served | None) -> list[ckpt.CheckpointEntry]:
        """A run's checkpoints: in its own directory (a server's runs) or the root's `<run_id>`."""
        if record is not None and record.run_dir is not None:
            return ckpt.list_checkpoints(self.pool, run_id, run_dir=record.run_dir)
        return ckpt.list_checkpoints(self.pool, run_id)

    def _run(self, run_id: str, record: _Served | None, entries: list[ckpt.CheckpointEntry]) -> TrainingRun:
        last = {segment: next((e for e in reversed(entries) if e.segment == segment), None)
                for segment in ckpt.SEGMENTS}
        newest = entries[-1] if entries else None
        rank: int | None
        if record is not None:
            base, rank, metadata, when = record.base_model, record.rank, record.user_metadata, record.last_request
        else:
            assert newest is not None
            base = str(newest.meta.get("base_model", ""))
            rank, metadata, when = newest.meta.get("rank"), None, newest.created
        return TrainingRun(training_run_id=run_id, base_model=base, model_owner=_owner(), is_lora=True,
                           last_request_time=_utc(when), lora_rank=rank,
                           last_checkpoint=self._checkpoint(last["weights"]) if last["weights"] else None,
                           last_sampler_checkpoint=(self._checkpoint(last["sampler_weights"])
                                                    if last["sampler_weights"] else None),
                           user_metadata=metadata)

    def _on_sampler(self, sampler_id: str) -> GetSamplerResponse:
        with self._ledger.lock:
            record = self._ledger.served.get(sampler_id) if isinstance(sampler_id, str) else None
        if record is None or record.kind != "sampling":
            raise NotFound(f"no sampler {sampler_id!r} was made in this pool", field="sampler_id")
        return GetSamplerResponse(sampler_id=sampler_id, base_model=record.base_model, model_path=record.model_path)

    def _on_sessions(self) -> list[str]:
        with self._ledger.lock:
            return list(reversed(self._ledger.sessions))

    def _on_session(self, session_id: str) -> GetSessionResponse:
        with self._ledger.lock:
            found = self._ledger.sessions.get(session_id) if isinstance(session_id, str) else None
            if found is None:
                raise NotFound(f"no session {session_id!r} in this pool (a session is one ServiceClient)",
                               field="session_id")
            return GetSessionResponse(training_run_ids=list(found.runs), sampler_ids=list(found.samplers),
                                      user_metadata=found.user_metadata, display_name=found.display_name)
