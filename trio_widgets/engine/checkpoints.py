"""Checkpoints: LoRA weights (+ AdamW state) on disk, in a format other tools can load.

Layout (one directory per checkpoint name, under the pool's `checkpoint_dir`, by
default `platformdirs.user_cache_dir("trio-widgets")/checkpoints`)::

    <checkpoint_dir>/<run_id>/weights/<name>/          save_state
        adapter_config.json          PEFT LoraConfig
        adapter_model.safetensors    PEFT keys: base_model.model.<module>.lora_{A,B}.weight
        optimizer.safetensors        AdamW moments; the step count in its metadata
        trio_checkpoint.json         manifest: base model, rank, targets, step, sha256 of each file
    <checkpoint_dir>/<run_id>/sampler_weights/<name>/  save_weights_for_sampler (no optimizer)

Every directory is a PEFT adapter: `peft.PeftModel.from_pretrained(base, path)` loads it.
No pickle anywhere: safetensors and JSON only.

Writes are atomic: the files go to a hidden temporary directory next to the target,
are fsynced, and the directory is renamed into place. Replacing an existing checkpoint
swaps the two directories in one step where the OS can (Linux `renameat2(RENAME_EXCHANGE)`),
then deletes the previous one under the temporary name; elsewhere it moves the old
directory aside (`.<name>.old-*`) just before the rename and deletes it just after, and a
reader that finds the name missing in that instant loads the set-aside copy. A crash at any
point leaves the previous checkpoint loadable; a half-written temporary directory is never
read. What a killed writer leaves behind is finished at the next pool start (and when a
missing name is looked up): a name with only its `.old-*` copy gets it back, stray
`.tmp-*` / `.old-*` / `.del-*` siblings are deleted. Each sibling's tag starts with its
writer's process id, so only the leftovers of writers that are gone are touched.

Reading trusts nothing in the directory. Only the layout's files are read: a manifest's
`files` are names looked up in the checkpoint directory, never paths. Each must be a
regular file (a symlink is never followed; a FIFO or device is refused before any read
that could block or never end) of at most `file_limits()` bytes, checked before reading.
Every value is checked before a client sees it: rank, alpha, seed and step in range, and
weights and AdamW moments finite float tensors of consistent shapes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointNotFoundError, InvalidInputError
from ..protocol import names, parse_tinker_path, shown_path
from ..types import (
    TINKER_SCHEME,
    CheckpointType,
    LoadWeightsResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from ..validation import check_user_metadata
from .lora import AdamState, LoRAAdapter, all_finite
from .models import BaseModel
from .tenants import PoolLike, Tenant

__all__ = [
    "LoadedCheckpoint",
    "check_compatible",
    "checkpoint_root",
    "default_checkpoint_dir",
    "read_checkpoint",
    "recover_checkpoints",
    "run_dir",
    "targets_of",
    "validate_name",
    "write_checkpoint",
]

FORMAT = "trio-widgets-checkpoint"
VERSION = 1
MANIFEST = "trio_checkpoint.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER = "optimizer.safetensors"
_PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<name>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def default_checkpoint_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("trio-widgets")) / "checkpoints"


def checkpoint_root(pool: PoolLike | None) -> Path:
    configured = pool.checkpoint_dir if pool is not None else None
    return Path(configured).expanduser() if configured else default_checkpoint_dir()


MAX_NAME_BYTES = names.MAX_NAME_BYTES


validate_name = names.validate_name  # (where every name is checked: trio_widgets/protocol/names.py)


def run_id_of(tenant: Tenant) -> str:
    """The tenant's training-run id, made on first use: its checkpoints' directory name
    (random, so that pools sharing a checkpoint_dir never mix runs) and tinker's `model_id`."""
    if tenant.run_id is None:
        tenant.run_id = f"{tenant.client_id}-{secrets.token_hex(4)}"
    return tenant.run_id


def validate_run_dir(run_dir: Any, field: str = "run_dir") -> str:
    """A run's directory relative to the checkpoint root: names joined by '/', nothing else."""
    if not isinstance(run_dir, str) or not run_dir:
        raise InvalidInputError(f"must be a non-empty relative path, got {run_dir!r}", field=field)
    for part in run_dir.split("/"):
        validate_name(part, field)
    return run_dir


def run_dir(pool: Any, tenant: Tenant) -> Path:
    return checkpoint_root(pool) / (tenant.run_dir or names.run_dirname(run_id_of(tenant)))


# -- writing ---------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sibling_tag() -> str:
    """12 hex characters for a temporary or set-aside sibling: the writer's process id (6 hex:
    Linux pids are below 2**22), then 6 random, so that recovery can tell a live writer's."""
    return f"{os.getpid() & 0xFFFFFF:06x}{secrets.token_hex(3)}"


# this process wrote no sibling before this module was imported: an older one with our pid was
# left by an earlier process that had it (a container restarted: the same small pid again)
_IMPORTED_AT = time.time()


def _writer_gone(tag: str, path: Path) -> bool:
    """Whether the writer of a sibling `path` tagged `tag` has exited (an untagged one: yes)."""
    if len(tag) != 12:
        return True  # not written by this scheme
    if os.name != "posix":
        return False  # no harmless liveness probe: leave it
    pid = int(tag[:6], 16)
    if pid == os.getpid():
        return _mtime(path) < _IMPORTED_AT - 1.0  # 1 s: filesystems' coarse timestamps
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # another user's live process, or not a pid: leave it
    return False


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2_fn: Any = None


def _renameat2() -> Any:
    global _renameat2_fn
    if _renameat2_fn is None:
        _renameat2_fn = False
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28, musl >= 1.2.3
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2_fn = fn
        except (AttributeError, OSError, TypeError):
            pass
    return _renameat2_fn or None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the OS or filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # an old kernel, or a filesystem without exchange (EPERM: some FUSE / overlay setups)
    raise OSError(err, os.strerror(err), str(b))


def atomic_write_dir(final: Path, files: dict[str, bytes]) -> None:
    """Make `final` a directory holding exactly `files`, all at once (see the module doc)."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{final.name}.tmp-{_sibling_tag()}"
    tmp.mkdir()
    try:
        for fname, data in files.items():
            _write_file(tmp / fname, data)
        _fsync_dir(tmp)
        if final.exists():
            if _exchange(tmp, final):  # the name never goes missing; tmp now holds the previous one
                _fsync_dir(parent)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                old = parent / f".{final.name}.old-{_sibling_tag()}"
                os.rename(final, old)
                os.rename(tmp, final)
                _fsync_dir(parent)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<tag>[0-9a-f]+)$")
_RECOVER_DEPTH = 4  # run directories nest (a served run's is <key dir>/<run>): how deep to look for them


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def recover_folder(folder: Path) -> None:
    """Finish what writers killed mid-save left in one `weights` / `sampler_weights` folder: a
    name whose directory is missing gets its newest set-aside copy back; every other sibling
    of a writer that is gone (temporary, set-aside, being deleted) is deleted, and so are
    temporary manifests inside checkpoints."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    aside: dict[str, list[Path]] = {}
    for entry in names:
        match = _SIBLING.match(entry)
        if match is None:
            if not entry.startswith("."):
                _recover_manifest_tmp(folder / entry)
            continue
        if not _writer_gone(match["tag"], folder / entry):
            continue
        if match["kind"] == "old":
            aside.setdefault(match["name"], []).append(folder / entry)
        else:
            _remove(folder / entry)
    for name, copies in aside.items():
        final = folder / name
        copies.sort(key=_mtime, reverse=True)
        for copy in copies:
            if not os.path.lexists(final) and is_checkpoint_dir(copy):
                try:
                    os.rename(copy, final)
                    continue
                except OSError:
                    pass
            _remove(copy)
    _fsync_dir(folder)


def _recover_manifest_tmp(directory: Path) -> None:
    if not is_checkpoint_dir(directory):
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for entry in names:
        if entry.startswith(f".{MANIFEST}.tmp-") and _writer_gone(entry.rsplit("-", 1)[1], directory / entry):
            _remove(directory / entry)


def recover_checkpoints(root: Path) -> None:
    """`recover_folder` for every run under a checkpoint root (a pool runs it when it starts)."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name in SEGMENTS:
                recover_folder(Path(entry.path))
            elif depth < _RECOVER_DEPTH:
                stack.append((Path(entry.path), depth + 1))


def _peft_config(adapter: LoRAAdapter, base: BaseModel) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.source if base.source != "builtin" else base.name,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        # exact module names: a suffix match in PEFT, so nothing else gets an adapter
        "target_modules": sorted(adapter.weights),
    }


def peft_tensors(adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
    out = {}
    for name, (a, b) in adapter.weights.items():
        out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().to("cpu", torch.float32).contiguous()
        out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().to("cpu", torch.float32).contiguous()
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(path: Path, tenant: Tenant, kind: str, name: str, adapter: LoRAAdapter | None = None, *,
                     user_metadata: dict[str, str] | None = None, expires_at: float | None = None,
                     age_recipients: tuple[str, ...] | None = None) -> int:
    """Write the tenant's adapter (and, for kind "state", its AdamW state) to `path`; returns
    the bytes written. `user_metadata`, `expires_at` (Unix time) and `age_recipients` (an
    export's: a server encrypts its files to them when they leave) go into the manifest."""
    from safetensors.torch import save

    adapter = adapter if adapter is not None else tenant.adapter
    if adapter is None:
        raise ValueError(f"client {tenant.client_id} samples the bare base model: there are no weights to save")
    files: dict[str, bytes] = {ADAPTER_WEIGHTS: save(peft_tensors(adapter), metadata={"format": "pt"})}
    if kind == "state":
        moments = {}
        for which, table in (("exp_avg", adapter.adam.exp_avg), ("exp_avg_sq", adapter.adam.exp_avg_sq)):
            for mod, (ma, mb) in table.items():
                moments[f"{which}.{mod}.lora_A"] = ma.detach().to("cpu", torch.float32).contiguous()
                moments[f"{which}.{mod}.lora_B"] = mb.detach().to("cpu", torch.float32).contiguous()
        files[OPTIMIZER] = save(moments, metadata={"format": "pt", "step": str(adapter.adam.step)})
    files[ADAPTER_CONFIG] = json.dumps(_peft_config(adapter, tenant.base), indent=2).encode()
    manifest = {
        "format": FORMAT, "version": VERSION, "kind": kind, "name": name,
        "base_model": tenant.base.name, "base_model_source": tenant.base.source,
        "rank": adapter.rank, "alpha": adapter.alpha, "seed": tenant.seed,
        "targets": sorted(adapter.weights),
        "train_attn": tenant.train_attn, "train_mlp": tenant.train_mlp, "train_unembed": tenant.train_unembed,
        "step": adapter.adam.step, "client_id": tenant.client_id, "run_id": tenant.run_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "saved_at": time.time(),
        "files": {fname: {"sha256": _sha256(data), "bytes": len(data)} for fname, data in files.items()},
    }
    if user_metadata is not None:
        manifest["user_metadata"] = dict(user_metadata)
    if expires_at is not None:
        manifest["expires_at"] = float(expires_at)
    if age_recipients is not None:
        manifest["age_recipients"] = list(age_recipients)
    files[MANIFEST] = json.dumps(manifest, indent=2).encode()
    atomic_write_dir(path, files)
    return sum(len(data) for data in files.values())


# -- reading ------------------------------------------------------------------------------------

@dataclass
class LoadedCheckpoint:
    path: str
    kind: str  # "state", "sampler", or "peft" (a PEFT adapter written by another tool)
    base_model: str | None
    rank: int
    alpha: float
    seed: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    adam: AdamState | None  # None: the checkpoint holds no optimizer state
    meta: dict

    def state_dict(self) -> dict:
        """In the form `LoRAAdapter.load_state_dict` takes."""
        adam = self.adam or AdamState()
        return {"rank": self.rank, "alpha": self.alpha, "seed": self.seed, "weights": self.weights,
                "adam_step": adam.step, "exp_avg": adam.exp_avg, "exp_avg_sq": adam.exp_avg_sq}


# directory -> tinker's checkpoint type
SEGMENTS: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler",
                                       "external_weights": "external"}


def tinker_path_dir(text: str, pool: Any = None) -> Path:
    """The directory of `tinker://<run>/<weights|sampler_weights>/<name>` under the pool's
    checkpoint_dir: the layout is tinker's, so its paths name our checkpoints too."""
    parsed = parse_tinker_path(text)
    directory = validate_name(names.run_dirname(parsed.run_id), "path")
    validate_name(parsed.name, "path")
    root = checkpoint_root(pool)
    run = root / directory
    if not run.is_dir() and names.RUN_ID_RE.match(parsed.run_id):
        # a run this pool served over HTTP lives in its API key's directory (the pool's owner, in
        # this process, may read every key's; run ids are random, so at most one key has it)
        with contextlib.suppress(OSError):
            run = next((k / directory for k in (root / names.SERVED_DIR).iterdir() if (k / directory).is_dir()), run)
    return run / parsed.segment / parsed.name


def tinker_path_of(directory: Path) -> str:
    """`tinker://<run>/<segment>/<name>` for a checkpoint directory laid out under a checkpoint_dir."""
    run = directory.parent.parent.name
    return f"{TINKER_SCHEME}{names.run_id_of_dirname(run) or run}/{directory.parent.name}/{directory.name}"


def resolve_path(path: Any, pool: Any = None, owner: str | None = None) -> Path:
    """The checkpoint directory `path` names; set-aside copies stand in mid-replace. For an
    `owner` (a served client's API key): only a tinker:// path of one of its own runs."""
    if owner is not None:
        return _owned_dir(path, pool, owner)
    if isinstance(path, (SaveWeightsResponse, SaveWeightsForSamplerResponse, LoadWeightsResponse)):
        path = path.path
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise InvalidInputError(f"must be a checkpoint directory path, got {path!r}", field="path")
    text = os.fspath(path)
    if not isinstance(text, str) or "\0" in text:
        raise InvalidInputError(f"must be a checkpoint directory path (text, no NUL), got {_brief(text)}",
                                field="path")
    given = text  # (a tinker:// path not found is named as the caller gave it)
    if text.startswith(TINKER_SCHEME):
        text = str(tinker_path_dir(text, pool))
    elif "://" in text:
        raise CheckpointNotFoundError(
            f"{text!r} is a hosted-service path; local checkpoints are directories on disk "
            f"(the `path` that save_state / save_weights_for_sampler returned)", path=text)
    try:
        p = Path(text).expanduser()
        if not p.is_absolute() and not p.exists() and pool is not None:
            under_root = checkpoint_root(pool) / p
            if under_root.exists():
                p = under_root
        p = p.absolute()
        if p.is_dir():
            return p
        if p.exists():
            raise CheckpointError(f"{str(p)!r} is a file; a checkpoint is the directory that holds "
                                  f"{ADAPTER_WEIGHTS}", path=str(p))
        if p.parent.name in SEGMENTS:  # a writer killed mid-replace: its set-aside copy gets the name back
            recover_folder(p.parent)
            if p.is_dir():
                return p
        aside = sorted(p.parent.glob(f".{p.name}.old-*"), key=lambda q: q.stat().st_mtime, reverse=True) \
            if p.parent.is_dir() else []
    except OSError as exc:  # e.g. a name too long for the filesystem, or a directory we may not list
        raise CheckpointError(f"cannot look up checkpoint {text!r}: {exc.strerror or exc}", path=text) from None
    for candidate in aside:
        if os.path.lexists(candidate / MANIFEST) or os.path.lexists(candidate / ADAPTER_CONFIG):
            return candidate
    shown = given if given.startswith(TINKER_SCHEME) else str(p)
    raise CheckpointNotFoundError(f"no checkpoint at {shown!r}", path=shown)


# -- reading: what may be read, and how much ---------------------------------------------------

# The files a checkpoint holds besides its manifest. A manifest's `files` may list only these:
# an entry is a name looked up in the checkpoint directory, never a path.
LAYOUT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER)
# A manifest or PEFT config names a few hundred targets at most (~100 KB for an 8B model with
# every target); 4 MiB is ample and bounds what json has to parse.
MAX_JSON_BYTES = 4 << 20
# The largest legitimate adapter is rank x sum(in + out) over its targets x 4 bytes (float32).
# An 8B Llama-class model with every target (attention, MLP, unembedding) has a sum near
# 2.75M; 2**22 covers it. At LocalPool's default max_rank 128 that allows 2 GiB of weights and
# 4 GiB of optimizer moments (two per weight); a pool with a smaller max_rank reads less. A
# pool attribute `max_checkpoint_bytes` replaces the bound for both tensor files.
MAX_LORA_FEATURES = 1 << 22
DEFAULT_MAX_RANK = 128  # LocalPool's default, for reads without a pool
_HEADER_BYTES = 16 << 20  # a safetensors header: ~150 bytes of JSON per tensor
# lora_alpha: PEFT adapters use 1 to a few times the rank; NaN, inf, 0 or a negative scale
# is never an adapter, and 1e308 turns every LoRA product into inf.
MAX_ALPHA = 65536.0
MAX_STEP = 2 ** 53  # AdamW takes the step as a float: larger counts are not exact
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)  # what torch.Generator.manual_seed accepts

_O_READ = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
           | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
_DIR_FD = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd


def _pool_max_rank(pool: PoolLike | None) -> int:
    value = pool.max_rank if pool is not None else None
    return int(value) if isinstance(value, int) and value >= 1 else DEFAULT_MAX_RANK


def file_limits(pool: PoolLike | None = None) -> dict[str, int]:
    """The most bytes read from each file of a checkpoint (see MAX_LORA_FEATURES)."""
    weights = _pool_max_rank(pool) * MAX_LORA_FEATURES * 4 + _HEADER_BYTES
    limits = {MANIFEST: MAX_JSON_BYTES, ADAPTER_CONFIG: MAX_JSON_BYTES, ADAPTER_WEIGHTS: weights,
              OPTIMIZER: 2 * weights}
    configured = pool.max_checkpoint_bytes if pool is not None else None
    if configured is not None:
        if isinstance(configured, bool) or not isinstance(configured, int) or configured < 1:
            raise ValueError(f"max_checkpoint_bytes must be a positive number of bytes, got {configured!r}")
        limits[ADAPTER_WEIGHTS] = limits[OPTIMIZER] = configured
    return limits


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


class _CheckpointFiles:
    """The plain files directly inside one checkpoint directory.

    Read through one open handle on the directory (a concurrent replace cannot mix two
    checkpoints), by plain name only, never following a symlink (O_NOFOLLOW), and only
    regular files of bounded size: a FIFO would block the reader and a device never ends.
    """

    def __init__(self, directory: Path, shown: str, limits: dict[str, int]):
        self.directory, self.shown, self.limits = directory, shown, limits
        self.fd: int | None = None
        if _DIR_FD:
            try:
                self.fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise CheckpointError(f"cannot open checkpoint {shown!r}: {exc.strerror or exc}", path=shown) from None

    def __enter__(self) -> _CheckpointFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _where(self, fname: str) -> Any:
        return fname if self.fd is not None else self.directory / fname

    def lstat(self, fname: str) -> os.stat_result | None:
        """The entry itself (a symlink is not followed), or None if there is none."""
        try:
            return os.stat(self._where(fname), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {fname} of checkpoint {self.shown!r}: {exc.strerror or exc}",
                                  path=self.shown) from None

    def _not_regular(self, fname: str, mode: int) -> CheckpointError:
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        return CheckpointError(f"checkpoint {self.shown!r} is invalid: {fname} is {kind}; a checkpoint holds only "
                               f"regular files (symbolic links are not followed)", path=self.shown)

    def read(self, fname: str, expected_size: int | None = None) -> bytes:
        # only the layout's names get here; the assert guards the invariant, not user input
        assert fname == MANIFEST or fname in LAYOUT_FILES, fname
        shown = self.shown
        st = self.lstat(fname)
        if st is None:
            raise CheckpointError(f"checkpoint {shown!r} is incomplete: {fname} is missing", path=shown)
        if not stat.S_ISREG(st.st_mode):
            raise self._not_regular(fname, st.st_mode)
        limit = self.limits[fname]
        if st.st_size > limit:
            raise CheckpointError(f"checkpoint {shown!r} is invalid: {fname} is {st.st_size} bytes, more than the "
                                  f"{limit} bytes a {fname} may have", path=shown)
        if expected_size is not None and st.st_size != expected_size:
            raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} does not match the checksum in "
                                  f"{MANIFEST} (it is {st.st_size} bytes, the manifest says {expected_size})",
                                  path=shown)
        try:
            fd = os.open(self._where(fname), _O_READ, dir_fd=self.fd)
        except OSError as exc:  # ELOOP: it became a symlink since the lstat
            raise CheckpointError(f"cannot read {fname} of checkpoint {shown!r}: {exc.strerror or exc}",
                                  path=shown) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # swapped since the lstat
                raise self._not_regular(fname, st.st_mode)
            if st.st_size > limit:
                raise CheckpointError(f"checkpoint {shown!r} is invalid: {fname} is {st.st_size} bytes, more "
                                      f"than the {limit} bytes a {fname} may have", path=shown)
            try:
                data = f.read(st.st_size + 1)  # one byte more: a file still growing is caught
            except OSError as exc:
                raise CheckpointError(f"cannot read {fname} of checkpoint {shown!r}: {exc.strerror or exc}",
                                      path=shown) from None
        if len(data) != st.st_size:
            raise CheckpointError(f"checkpoint {shown!r} changed while it was read ({fname}); load it again",
                                  path=shown)
        return data


# -- reading: parsing and validating ---------------------------------------------------------------

def _invalid(shown: str, where: str, key: str, expected: str, got: Any) -> CheckpointError:
    return CheckpointError(f"checkpoint {shown!r} is invalid: {where} {key!r} must be {expected}, got {_brief(got)}",
                           path=shown)


def _int_field(value: Any, low: int, high: int, shown: str, where: str, key: str, expected: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(shown, where, key, expected or f"an integer from {low} to {high}", value)
    return value


def _alpha_field(value: Any, shown: str, where: str, key: str) -> float:
    # comparisons are False for NaN and exact for any int, so no float() can overflow first
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_ALPHA:
        raise _invalid(shown, where, key, f"a finite number above 0 and at most {MAX_ALPHA:g}", value)
    return float(value)


def _rank_field(value: Any, max_rank: int, shown: str, where: str, key: str) -> int:
    return _int_field(value, 1, max_rank, shown, where, key,
                      f"an integer from 1 to the pool's max_rank {max_rank}")


def _bool_field(meta: dict, key: str, shown: str) -> None:
    if key in meta and not isinstance(meta[key], bool):
        raise _invalid(shown, MANIFEST, key, "true or false", meta[key])


def _load_tensors(data: bytes, fname: str, shown: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("__metadata__ is not an object")
    except Exception as exc:  # truncated or not a safetensors file at all
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not a valid safetensors file "
                              f"({type(exc).__name__}: {exc})", path=shown) from None
    return tensors, dict(metadata)


def _load_json(data: bytes, fname: str, shown: str) -> dict:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: [[[[...
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not valid JSON "
                              f"({type(exc).__name__}: {_brief(str(exc))})", path=shown) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not a JSON object", path=shown)
    return value


def _float_tensor(tensor: torch.Tensor, fname: str, key: str, shown: str, *, non_negative: bool = False
                  ) -> torch.Tensor:
    """`tensor` as float32, or a CheckpointError: weights and moments are finite floats."""
    if not tensor.dtype.is_floating_point:
        raise CheckpointError(f"checkpoint {shown!r} is invalid: {fname} tensor {key!r} has dtype "
                              f"{str(tensor.dtype).removeprefix('torch.')}; LoRA weights and optimizer moments are "
                              f"floating point", path=shown)
    tensor = tensor.to(torch.float32)  # a float64 beyond float32's range becomes inf, caught next
    if not all_finite(tensor):
        raise CheckpointError(f"checkpoint {shown!r} is invalid: {fname} tensor {key!r} holds NaN or infinite "
                              f"values (as float32)", path=shown)
    if non_negative and tensor.numel() and float(tensor.min()) < 0:
        raise CheckpointError(f"checkpoint {shown!r} is invalid: {fname} tensor {key!r} holds negative values; "
                              f"AdamW's second moment is a mean of squares", path=shown)
    return tensor


def _weights_from_peft(tensors: dict[str, torch.Tensor], shown: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise CheckpointError(f"checkpoint {shown!r} holds {_brief(key)}, which is not a LoRA A/B weight "
                                  f"(only plain LoRA on linear layers is supported)", path=shown)
        pair = halves.setdefault(match["name"], {})
        if match["ab"] in pair:  # e.g. `x.lora_A.weight` and `x.lora_A.default.weight`
            raise CheckpointError(f"checkpoint {shown!r} holds two lora_{match['ab']} weights for "
                                  f"{_brief(match['name'])}", path=shown)
        pair[match["ab"]] = _float_tensor(tensor, ADAPTER_WEIGHTS, key, shown)
    weights = {}
    for name, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"checkpoint {shown!r} has only lora_{''.join(pair)} for {_brief(name)}",
                                  path=shown)
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.numel() == 0 or b.numel() == 0:
            raise CheckpointError(f"checkpoint {shown!r}: {_brief(name)} has lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)}, which do not make a LoRA pair", path=shown)
        weights[name] = (a, b)
    if not weights:
        raise CheckpointError(f"checkpoint {shown!r} holds no LoRA weights", path=shown)
    return weights


def _manifest_files(meta: dict, shown: str) -> dict[str, int]:
    """The manifest's `files`, checked before anything is read: name -> expected size."""
    listed = meta.get("files")
    if not isinstance(listed, dict) or ADAPTER_WEIGHTS not in listed:
        raise CheckpointError(f"{shown!r}: {MANIFEST} lists no adapter weights", path=shown)
    sizes = {}
    for fname, info in listed.items():
        if fname not in LAYOUT_FILES:
            raise CheckpointError(f"checkpoint {shown!r} is invalid: {MANIFEST} lists the file {_brief(fname)}; a "
                                  f"checkpoint holds only {', '.join(LAYOUT_FILES)} (names in its own directory, "
                                  f"never paths)", path=shown)
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) \
                or not re.fullmatch(r"[0-9a-f]{64}", info["sha256"]):
            raise _invalid(shown, MANIFEST, f"files.{fname}.sha256", "a sha256 hex digest",
                           info.get("sha256") if isinstance(info, dict) else info)
        sizes[fname] = _int_field(info.get("bytes"), 0, 2 ** 63, shown, MANIFEST, f"files.{fname}.bytes",
                                  "a size in bytes")
    return sizes


def _check_manifest(meta: dict, shown: str, max_rank: int) -> tuple[str, str, int, float, int]:
    """kind, base_model, rank, alpha, seed: every field the load uses, checked."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{shown!r}: {MANIFEST} is not a trio-widgets manifest", path=shown)
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _invalid(shown, MANIFEST, "version", "a format version from 1", version)
    if version > VERSION:
        raise CheckpointError(f"{shown!r} was written by a newer trio-widgets (format version "
                              f"{version}); upgrade to load it", path=shown)
    kind = meta.get("kind")
    if kind not in ("state", "sampler"):
        raise _invalid(shown, MANIFEST, "kind", "'state' or 'sampler'", kind)
    base_model = meta.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise _invalid(shown, MANIFEST, "base_model", "a model name", base_model)
    rank = _rank_field(meta.get("rank"), max_rank, shown, MANIFEST, "rank")
    alpha = _alpha_field(meta.get("alpha"), shown, MANIFEST, "alpha")
    seed = _int_field(meta.get("seed", 0), *SEED_RANGE, shown, MANIFEST, "seed",
                      f"an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (what torch takes as a seed)")
    if "step" in meta:
        _int_field(meta["step"], 0, MAX_STEP, shown, MANIFEST, "step")
    targets = meta.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) \
            or len(set(targets)) != len(targets):
        raise _invalid(shown, MANIFEST, "targets", "a list of distinct module names", targets)
    for key in ("train_attn", "train_mlp", "train_unembed"):
        _bool_field(meta, key, shown)
    try:  # the bound a save checks: what saved always loads, and nothing else does
        check_user_metadata(meta.get("user_metadata"))
    except InvalidInputError as exc:
        raise _invalid(shown, MANIFEST, "user_metadata", f"a dict of strings or null ({exc})",
                       meta.get("user_metadata")) from None
    return kind, base_model, rank, alpha, seed


def _read_optimizer(data: bytes, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], shown: str) -> AdamState:
    moments, header = _load_tensors(data, OPTIMIZER, shown)
    text = header.get("step")
    if text is None:
        raise CheckpointError(f"checkpoint {shown!r}: {OPTIMIZER} has no step count", path=shown)
    if not isinstance(text, str) or not re.fullmatch(r"[0-9]{1,16}", text) or int(text) > MAX_STEP:
        raise _invalid(shown, OPTIMIZER, "step", f"a whole number from 0 to {MAX_STEP}", text)
    step = int(text)
    adam = AdamState(step=step)
    used: set[str] = set()
    for which, table in (("exp_avg", adam.exp_avg), ("exp_avg_sq", adam.exp_avg_sq)):
        for name, (a, b) in weights.items():
            ka, kb = f"{which}.{name}.lora_A", f"{which}.{name}.lora_B"
            if ka not in moments and kb not in moments and step == 0:
                continue
            ma, mb = moments.get(ka), moments.get(kb)
            if ma is None or mb is None or ma.shape != a.shape or mb.shape != b.shape:
                raise CheckpointError(f"checkpoint {shown!r}: the optimizer state of {name} is missing or has "
                                      f"the wrong shape", path=shown)
            second = which == "exp_avg_sq"
            table[name] = (_float_tensor(ma, OPTIMIZER, ka, shown, non_negative=second),
                           _float_tensor(mb, OPTIMIZER, kb, shown, non_negative=second))
            used.update((ka, kb))
    extra = sorted(set(moments) - used)
    if extra:
        raise CheckpointError(f"checkpoint {shown!r} is invalid: {OPTIMIZER} holds {_brief(extra[0])}, which is not "
                              f"a moment of one of its LoRA weights", path=shown)
    return adam


def _owned_dir(path: Any, pool: Any, owner: str) -> Path:
    parsed = parse_tinker_path(path)  # a malformed path is refused naming the field
    missing = CheckpointNotFoundError(f"checkpoint {path!r:.200} was not found for this API key",
                                      path=str(path)[:200])
    if not names.RUN_ID_RE.match(parsed.run_id):
        raise missing
    validate_name(parsed.name, "path")
    local = checkpoint_root(pool) / names.owner_run_dir(owner, parsed.run_id) / parsed.segment / parsed.name
    try:  # (as in-process: a name a killed writer set aside is given back)
        return resolve_path(local)
    except CheckpointError:  # (its message names this machine's directories: not the caller's)
        raise missing from None


def read_checkpoint(path: Any, pool: Any = None, *, require_optimizer: bool = False,
                    owner: str | None = None) -> LoadedCheckpoint:
    """Read and verify a checkpoint directory; every problem is a CheckpointError naming the path.

    Only the layout's files are read, each a regular file directly in the directory and of
    bounded size (`file_limits`), and every value is checked: ranks, alpha, seed and step in
    range, weights and moments finite float tensors of consistent shapes.
    """
    directory = resolve_path(path, pool, owner)
    shown = shown_path(path, directory)
    max_rank = _pool_max_rank(pool)
    with _CheckpointFiles(directory, shown, file_limits(pool)) as files:
        base_model: str | None
        has_manifest = files.lstat(MANIFEST) is not None
        if not has_manifest and files.lstat(ADAPTER_CONFIG) is None:
            raise CheckpointNotFoundError(f"{shown!r} is not a checkpoint: it has neither {MANIFEST} nor "
                                          f"{ADAPTER_CONFIG}", path=shown)
        if has_manifest:
            meta = _load_json(files.read(MANIFEST), MANIFEST, shown)
            kind, base_model, rank, alpha, seed = _check_manifest(meta, shown, max_rank)
            if expired(meta, shown):
                _remove_expired(directory)
                raise CheckpointNotFoundError(f"checkpoint {shown!r} has expired (its ttl_seconds ran out) and was "
                                              f"deleted", path=shown)
            blobs = {}
            for fname, size in _manifest_files(meta, shown).items():
                data = files.read(fname, expected_size=size)
                if _sha256(data) != meta["files"][fname]["sha256"]:
                    raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} does not match the checksum "
                                          f"in {MANIFEST}", path=shown)
                blobs[fname] = data
            if ADAPTER_CONFIG in blobs:  # PEFT reads this one: it must describe the same adapter
                config = _load_json(blobs[ADAPTER_CONFIG], ADAPTER_CONFIG, shown)
                if config.get("r") != rank or config.get("lora_alpha") != alpha:
                    raise CheckpointError(f"checkpoint {shown!r} is invalid: {ADAPTER_CONFIG} has r="
                                          f"{_brief(config.get('r'))}, lora_alpha={_brief(config.get('lora_alpha'))}; "
                                          f"{MANIFEST} has rank {rank}, alpha {alpha}", path=shown)
        else:  # a PEFT adapter directory written by another tool
            config = _load_json(files.read(ADAPTER_CONFIG), ADAPTER_CONFIG, shown)
            meta = {"kind": "peft", "peft_config": config}
            if config.get("peft_type", "LORA") != "LORA":
                raise CheckpointError(f"{shown!r} is a {_brief(config.get('peft_type'))} adapter; only LoRA is "
                                      f"supported", path=shown)
            unsupported = [k for k in ("use_rslora", "use_dora") if config.get(k)]
            unsupported += [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save") if config.get(k)]
            if config.get("bias", "none") != "none":
                unsupported.append("bias")
            if unsupported:
                raise CheckpointError(f"{shown!r} uses PEFT options this pool does not support: "
                                      f"{', '.join(unsupported)}", path=shown)
            kind, seed = "peft", 0
            rank = _rank_field(config.get("r"), max_rank, shown, ADAPTER_CONFIG, "r")
            alpha = _alpha_field(config.get("lora_alpha", 8), shown, ADAPTER_CONFIG, "lora_alpha")
            base_model = config.get("base_model_name_or_path")
            if base_model is not None and (not isinstance(base_model, str) or not base_model):
                raise _invalid(shown, ADAPTER_CONFIG, "base_model_name_or_path", "a model name or null", base_model)
            blobs = {ADAPTER_WEIGHTS: files.read(ADAPTER_WEIGHTS)}
    tensors, _ = _load_tensors(blobs[ADAPTER_WEIGHTS], ADAPTER_WEIGHTS, shown)
    weights = _weights_from_peft(tensors, shown)
    for name, (a, _b) in weights.items():
        if a.shape[0] != rank:
            raise CheckpointError(f"checkpoint {shown!r}: {name} has rank {a.shape[0]}, the config says {rank}",
                                  path=shown)
    if has_manifest and sorted(weights) != sorted(meta["targets"]):
        raise CheckpointError(f"checkpoint {shown!r}: the weights do not match the targets in {MANIFEST}", path=shown)
    adam = _read_optimizer(blobs[OPTIMIZER], weights, shown) if OPTIMIZER in blobs else None
    if adam is not None and kind == "state" and meta.get("step", adam.step) != adam.step:
        raise CheckpointError(f"checkpoint {shown!r} is invalid: {MANIFEST} says step {meta['step']}, "
                              f"{OPTIMIZER} says {adam.step}", path=shown)
    if require_optimizer and adam is None:
        what = "a sampler checkpoint (weights only)" if kind == "sampler" else "a weights-only adapter"
        raise CheckpointError(f"{shown!r} is {what}: it has no optimizer state to continue; use load_state() "
                              f"for the weights alone, or a path from save_state()", path=shown)
    return LoadedCheckpoint(path=str(directory), kind=kind, base_model=base_model, rank=rank, alpha=alpha,
                            seed=seed, weights=weights, adam=adam, meta=meta)


def check_compatible(loaded: LoadedCheckpoint, tenant: Tenant, shown: str) -> None:
    """A checkpoint can go into `tenant` only if it has the same base, rank and LoRA targets."""
    if loaded.base_model is not None and loaded.kind != "peft" and loaded.base_model != tenant.base.name:
        raise CheckpointError(f"checkpoint {shown!r} is for base model {loaded.base_model!r}, this client trains "
                              f"{tenant.base.name!r}", path=shown)
    if tenant.adapter is None:
        raise CheckpointError("this client has no adapter to load weights into", path=shown)
    if loaded.rank != tenant.adapter.rank:
        raise CheckpointError(f"checkpoint {shown!r} has LoRA rank {loaded.rank}, this client has rank "
                              f"{tenant.adapter.rank}", path=shown)
    if set(loaded.weights) != set(tenant.adapter.weights):
        missing = sorted(set(tenant.adapter.weights) - set(loaded.weights))
        extra = sorted(set(loaded.weights) - set(tenant.adapter.weights))
        raise CheckpointError(f"checkpoint {shown!r} adapts other layers than this client (missing: "
                              f"{missing[:3]}{'...' if len(missing) > 3 else ''}, extra: {extra[:3]}"
                              f"{'...' if len(extra) > 3 else ''}); create a client with the same train_* "
                              f"flags, or use create_training_client_from_state", path=shown)
    for name, (a, b) in loaded.weights.items():
        ta, tb = tenant.adapter.weights[name]
        if a.shape != ta.shape or b.shape != tb.shape:
            raise CheckpointError(f"checkpoint {shown!r}: {name} has shapes {tuple(a.shape)}/{tuple(b.shape)}, "
                                  f"this model needs {tuple(ta.shape)}/{tuple(tb.shape)}", path=shown)
    if loaded.alpha != tenant.adapter.alpha:
        raise CheckpointError(f"checkpoint {shown!r} has lora_alpha {loaded.alpha}, this pool trains with "
                              f"{tenant.adapter.alpha}", path=shown)


def targets_of(loaded: LoadedCheckpoint, base: BaseModel, shown: str) -> dict[str, tuple[int, int]]:
    """The checkpoint's LoRA targets as `LoRAAdapter` wants them, checked against `base`."""
    targets = {}
    for name, (a, b) in loaded.weights.items():
        if name not in base.lora_targets:
            raise CheckpointError(f"checkpoint {shown!r} adapts {name!r}, which {base.name} has no LoRA-able "
                                  f"linear layer called", path=shown)
        _kind, fan_in, fan_out = base.lora_targets[name]
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise CheckpointError(f"checkpoint {shown!r}: {name} is {fan_in}->{fan_out} in {base.name}, the "
                                  f"checkpoint has {a.shape[1]}->{b.shape[0]}", path=shown)
        targets[name] = (fan_in, fan_out)
    return targets


# -- bookkeeping: expiry, listing and deleting (what the RestClient shows) -------------------

def expired(meta: dict, shown: str, now: float | None = None) -> bool:
    expires_at = meta.get("expires_at")
    if expires_at is None:
        return False
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) or expires_at != expires_at:
        raise _invalid(shown, MANIFEST, "expires_at", "a Unix time or null", expires_at)
    return float(expires_at) <= (time.time() if now is None else now)


def _remove_expired(directory: Path) -> None:
    """Delete an expired checkpoint; a racing reader or deleter may have been first."""
    if is_checkpoint_dir(directory):
        shutil.rmtree(directory, ignore_errors=True)


def is_checkpoint_dir(directory: Path) -> bool:
    """A real directory (not a symlink to one) holding a manifest or a PEFT config."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (os.path.lexists(directory / MANIFEST)
                                         or os.path.lexists(directory / ADAPTER_CONFIG))


def read_manifest(directory: Path, pool: Any = None, shown: str | None = None) -> dict:
    """The checked manifest of a checkpoint directory (bounded read, no symlinks), or
    CheckpointError naming it as `shown` (the caller's path); a checkpoint without one (a PEFT
    directory) gives {}."""
    shown = str(directory) if shown is None else shown
    with _CheckpointFiles(directory, shown, file_limits(pool)) as files:
        if files.lstat(MANIFEST) is None:
            return {}
        meta = _load_json(files.read(MANIFEST), MANIFEST, shown)
    _check_manifest(meta, shown, _pool_max_rank(pool))
    expired(meta, shown)  # a bad expires_at is refused here, not later
    return meta


@dataclass
class CheckpointEntry:
    """One checkpoint found under a checkpoint_dir."""

    run_id: str
    segment: str  # "weights" or "sampler_weights"
    name: str
    directory: Path
    meta: dict  # read-only: a listing shares it with the next (copy what you hand out)
    size: int | None = None  # its files' bytes, where the listing knew them already

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def created(self) -> float:
        """Unix time the checkpoint was written: its manifest's `saved_at` (or `created_at`), else (a PEFT
        directory from elsewhere) the directory's mtime."""
        exact = self.meta.get("saved_at")
        if isinstance(exact, float) and exact == exact:
            return exact
        stamp = self.meta.get("created_at")
        if isinstance(stamp, str):
            try:
                return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
            except ValueError:
                pass
        try:
            return os.lstat(self.directory).st_mtime
        except OSError:
            return 0.0

    @property
    def size_bytes(self) -> int:
        """The bytes of its files (what saving it wrote)."""
        if self.size is not None:
            return self.size
        total = 0
        for fname in (MANIFEST, *LAYOUT_FILES):
            try:
                st = os.lstat(self.directory / fname)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total


# What listings read of each checkpoint (its checked manifest, its size), kept while neither the
# directory nor its manifest changed (inode, mtime, size: a save replaces the directory, a TTL
# rewrites the manifest). Listing a key's thousands of checkpoints is then a stat or two each,
# not a read, parse and check: the catalog's one thread stays mostly idle under a listing loop.
_LISTED: OrderedDict[tuple, tuple[tuple, dict, int]] = OrderedDict()
_LISTED_MAX = 16384
_LISTED_LOCK = threading.Lock()


def _stamp(directory: str) -> tuple | None:
    """What changes when a checkpoint directory or its manifest does; None: not a real directory."""
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    try:
        m = os.lstat(os.path.join(directory, MANIFEST))
        manifest: tuple | None = (m.st_ino, m.st_mtime_ns, m.st_size, m.st_mode)
    except OSError:
        manifest = None
    return st.st_ino, st.st_mtime_ns, manifest


def _listed(directory: Path, pool: Any, stamp: tuple | None = None, limits: tuple | None = None
            ) -> tuple[dict, int]:
    """A listed checkpoint's checked manifest and size (CheckpointError / OSError as read_manifest);
    `stamp` and `limits` where the caller has them already (_entries_of_run: one lstat of each, not
    two; the pool's limits once a listing)."""
    path = os.fspath(directory)
    key = (path, *(limits or _limits_key(pool)))
    stamp = stamp or _stamp(path)
    with _LISTED_LOCK:
        hit = _LISTED.get(key)
        if hit is not None and stamp is not None and hit[0] == stamp:
            _LISTED.move_to_end(key)
            return hit[1], hit[2]
    meta = read_manifest(directory, pool)
    size = CheckpointEntry("", "", "", directory, meta).size_bytes
    if stamp is not None and _stamp(path) == stamp:  # unchanged while it was read: keep it
        with _LISTED_LOCK:
            _LISTED[key] = (stamp, meta, size)
            while len(_LISTED) > _LISTED_MAX:
                _LISTED.popitem(last=False)
    return meta, size


def _limits_key(pool: Any) -> tuple:
    return _pool_max_rank(pool), tuple(sorted(file_limits(pool).items()))


def _entries_of_run(root: Path, run_id: str, pool: Any, now: float, run_dir: str | None = None
                    ) -> list[CheckpointEntry]:
    entries = []
    limits = _limits_key(pool)
    for segment in SEGMENTS:
        folder = root / (run_dir or names.run_dirname(run_id)) / segment
        where = os.fspath(folder)
        try:
            found = sorted(os.listdir(where))
        except OSError:
            continue
        for name in found:
            if name.startswith("."):
                continue  # temporary and set-aside copies of an atomic write
            # is_checkpoint_dir, from the stamp the listing cache reads anyway (string paths: a
            # listing of thousands runs on the catalog's thread, holding the GIL while it runs)
            path = os.path.join(where, name)
            stamp = _stamp(path)
            if stamp is None or stamp[2] is None and not os.path.lexists(os.path.join(path, ADAPTER_CONFIG)):
                continue  # stray files, symlinks, directories that are no checkpoint
            directory = folder / name
            try:
                meta, size = _listed(directory, pool, stamp, limits)
            except (CheckpointError, OSError):
                continue  # a broken checkpoint is not listed (loading it names the problem)
            if meta and expired(meta, path, now):
                _remove_expired(directory)
                continue
            entries.append(CheckpointEntry(run_id, segment, name, directory, meta, size))
    return entries


def list_checkpoints(pool: Any, run_id: str | None = None, *, run_dir: str | None = None) -> list[CheckpointEntry]:
    """The checkpoints of one run (or of every run) under the pool's checkpoint_dir, oldest
    first. Expired ones are deleted instead of listed. `run_dir`: the run's directory, where it
    is not `<run_id>` (a served run's)."""
    root = checkpoint_root(pool)
    now = time.time()
    if run_id is not None and run_dir is not None:
        entries = _entries_of_run(root, run_id, pool, now, validate_run_dir(run_dir))
        return sorted(entries, key=lambda e: (e.created, e.checkpoint_id))
    if run_id is not None:
        validate_name(names.run_dirname(run_id), "training_run_id")
        runs = [run_id]
    else:
        try:  # a directory holds the run whose run_dirname it is (older runs: the name itself)
            runs = sorted(names.run_id_of_dirname(n) or n for n in os.listdir(root) if not n.startswith("."))
        except OSError:
            runs = []
    entries = [e for run in runs for e in _entries_of_run(root, run, pool, now)]
    return sorted(entries, key=lambda e: (e.created, e.run_id, e.checkpoint_id))


def checkpoint_dir_of(pool: Any, run_id: str, checkpoint_id: str, *, run_dir: str | None = None) -> Path:
    """The directory of `checkpoint_id` ("weights/<name>" or "sampler_weights/<name>") of a run
    (in `run_dir` where that is not `<run_id>`)."""
    if run_dir is not None:
        run_id = validate_run_dir(run_dir)
    else:
        run_id = validate_name(names.run_dirname(run_id), "training_run_id")
    segment, _, name = checkpoint_id.partition("/") if isinstance(checkpoint_id, str) else ("", "", "")
    if segment not in SEGMENTS:
        raise InvalidInputError(f"must be 'weights/<name>', 'sampler_weights/<name>' or 'external_weights/<name>', "
                                f"got {checkpoint_id!r}",
                                field="checkpoint_id")
    validate_name(name, "checkpoint_id")
    return checkpoint_root(pool) / run_id / segment / name


def delete_checkpoint(directory: Path) -> None:
    """Delete one checkpoint directory; CheckpointNotFoundError if there is none."""
    if not is_checkpoint_dir(directory):
        raise CheckpointNotFoundError(f"no checkpoint at {str(directory)!r}", path=str(directory))
    # set aside first (one rename), so that no reader sees a half-deleted checkpoint
    aside = directory.parent / f".{directory.name}.del-{_sibling_tag()}"
    os.rename(directory, aside)
    shutil.rmtree(aside, ignore_errors=True)


def set_expiry(directory: Path, expires_at: float | None, pool: Any = None) -> None:
    """Rewrite a checkpoint's manifest with a new `expires_at` (None: never), atomically."""
    if not is_checkpoint_dir(directory):
        raise CheckpointNotFoundError(f"no checkpoint at {str(directory)!r}", path=str(directory))
    meta = read_manifest(directory, pool)
    if not meta:
        raise CheckpointError(f"{str(directory)!r} was not written by trio-widgets (no {MANIFEST}): it has no "
                              f"expiry to set", path=str(directory))
    if expires_at is None:
        meta.pop("expires_at", None)
    else:
        meta["expires_at"] = float(expires_at)
    tmp = directory / f".{MANIFEST}.tmp-{_sibling_tag()}"
    try:
        _write_file(tmp, json.dumps(meta, indent=2).encode())
        os.replace(tmp, directory / MANIFEST)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(directory)
