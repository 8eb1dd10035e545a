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
moves the old directory aside (`.<name>.old-*`) just before the rename and deletes it
just after; a reader that finds the name missing in that instant (or after a crash in
it) loads the set-aside copy. A crash at any point leaves the previous checkpoint
loadable; a half-written temporary directory is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointNotFoundError, InvalidInputError
from ..types import LoadWeightsResponse, SaveWeightsForSamplerResponse, SaveWeightsResponse
from .clock import Tenant
from .lora import AdamState, LoRAAdapter
from .models import BaseModel

__all__ = [
    "LoadedCheckpoint",
    "check_compatible",
    "checkpoint_root",
    "default_checkpoint_dir",
    "read_checkpoint",
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


def checkpoint_root(pool: Any) -> Path:
    configured = getattr(pool, "checkpoint_dir", None)
    return Path(configured).expanduser() if configured else default_checkpoint_dir()


def validate_name(name: Any, field: str = "name") -> str:
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
    return name


def run_dir(pool: Any, tenant: Tenant) -> Path:
    run_id = tenant.extra.get("run_id")
    if run_id is None:
        run_id = tenant.extra["run_id"] = f"{tenant.client_id}-{secrets.token_hex(4)}"
    return checkpoint_root(pool) / run_id


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


def atomic_write_dir(final: Path, files: dict[str, bytes]) -> None:
    """Make `final` a directory holding exactly `files`, all at once (see the module doc)."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{final.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        for fname, data in files.items():
            _write_file(tmp / fname, data)
        _fsync_dir(tmp)
        if final.exists():
            old = parent / f".{final.name}.old-{secrets.token_hex(6)}"
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


def write_checkpoint(path: Path, tenant: Tenant, kind: str, name: str, adapter: LoRAAdapter | None = None) -> None:
    """Write the tenant's adapter (and, for kind "state", its AdamW state) to `path`."""
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
        "step": adapter.adam.step, "client_id": tenant.client_id, "run_id": tenant.extra.get("run_id"),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {fname: {"sha256": _sha256(data), "bytes": len(data)} for fname, data in files.items()},
    }
    files[MANIFEST] = json.dumps(manifest, indent=2).encode()
    atomic_write_dir(path, files)


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


def resolve_path(path: Any, pool: Any = None) -> Path:
    """The checkpoint directory `path` names; set-aside copies stand in mid-replace."""
    if isinstance(path, (SaveWeightsResponse, SaveWeightsForSamplerResponse, LoadWeightsResponse)):
        path = path.path
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise InvalidInputError(f"must be a checkpoint directory path, got {path!r}", field="path")
    text = os.fspath(path)
    if "://" in text:
        raise CheckpointNotFoundError(
            f"{text!r} is a hosted-service path; local checkpoints are directories on disk "
            f"(the `path` that save_state / save_weights_for_sampler returned)", path=text)
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
    aside = sorted(p.parent.glob(f".{p.name}.old-*"), key=lambda q: q.stat().st_mtime, reverse=True) \
        if p.parent.is_dir() else []
    for candidate in aside:
        if (candidate / MANIFEST).is_file() or (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise CheckpointNotFoundError(f"no checkpoint at {str(p)!r}", path=str(p))


def _read_bytes(directory: Path, fname: str, shown: str) -> bytes:
    try:
        return (directory / fname).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {shown!r} is incomplete: {fname} is missing", path=shown) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {fname} of checkpoint {shown!r}: {exc}", path=shown) from None


def _load_tensors(data: bytes, fname: str, shown: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
    except Exception as exc:  # truncated or not a safetensors file at all
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not a valid safetensors file "
                              f"({type(exc).__name__}: {exc})", path=shown) from None
    return tensors, dict(header.get("__metadata__") or {})


def _load_json(data: bytes, fname: str, shown: str) -> dict:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not valid JSON ({exc})",
                              path=shown) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} is not a JSON object", path=shown)
    return value


def _weights_from_peft(tensors: dict[str, torch.Tensor], shown: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise CheckpointError(f"checkpoint {shown!r} holds {key!r}, which is not a LoRA A/B weight "
                                  f"(only plain LoRA on linear layers is supported)", path=shown)
        halves.setdefault(match["name"], {})[match["ab"]] = tensor.to(torch.float32)
    weights = {}
    for name, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"checkpoint {shown!r} has only lora_{''.join(pair)} for {name}", path=shown)
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(f"checkpoint {shown!r}: {name} has lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)}, which do not make a LoRA pair", path=shown)
        weights[name] = (a, b)
    if not weights:
        raise CheckpointError(f"checkpoint {shown!r} holds no LoRA weights", path=shown)
    return weights


def read_checkpoint(path: Any, pool: Any = None, *, require_optimizer: bool = False) -> LoadedCheckpoint:
    """Read and verify a checkpoint directory; every problem is a CheckpointError naming the path."""
    directory = resolve_path(path, pool)
    shown = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(directory)
    has_manifest = (directory / MANIFEST).is_file()
    if not has_manifest and not (directory / ADAPTER_CONFIG).is_file():
        raise CheckpointNotFoundError(f"{shown!r} is not a checkpoint: it has neither {MANIFEST} nor "
                                      f"{ADAPTER_CONFIG}", path=shown)
    if has_manifest:
        meta = _load_json(_read_bytes(directory, MANIFEST, shown), MANIFEST, shown)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{shown!r}: {MANIFEST} is not a trio-widgets manifest", path=shown)
        if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
            raise CheckpointError(f"{shown!r} was written by a newer trio-widgets (format version "
                                  f"{meta.get('version')!r}); upgrade to load it", path=shown)
        listed = meta.get("files")
        if not isinstance(listed, dict) or ADAPTER_WEIGHTS not in listed:
            raise CheckpointError(f"{shown!r}: {MANIFEST} lists no adapter weights", path=shown)
        blobs = {}
        for fname, info in listed.items():
            data = _read_bytes(directory, fname, shown)
            if not isinstance(info, dict) or _sha256(data) != info.get("sha256"):
                raise CheckpointError(f"checkpoint {shown!r} is corrupted: {fname} does not match the checksum "
                                      f"in {MANIFEST}", path=shown)
            blobs[fname] = data
        kind = meta.get("kind")
        try:
            rank, alpha, seed = int(meta["rank"]), float(meta["alpha"]), int(meta.get("seed", 0))
            base_model = str(meta["base_model"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{shown!r}: {MANIFEST} is missing or has a bad field ({exc})", path=shown) from None
    else:  # a PEFT adapter directory written by another tool
        config = _load_json(_read_bytes(directory, ADAPTER_CONFIG, shown), ADAPTER_CONFIG, shown)
        meta = {"kind": "peft", "peft_config": config}
        if config.get("peft_type", "LORA") != "LORA":
            raise CheckpointError(f"{shown!r} is a {config.get('peft_type')} adapter; only LoRA is supported",
                                  path=shown)
        unsupported = [k for k in ("use_rslora", "use_dora") if config.get(k)]
        unsupported += [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save") if config.get(k)]
        if config.get("bias", "none") != "none":
            unsupported.append("bias")
        if unsupported:
            raise CheckpointError(f"{shown!r} uses PEFT options this pool does not support: "
                                  f"{', '.join(unsupported)}", path=shown)
        blobs = {ADAPTER_WEIGHTS: _read_bytes(directory, ADAPTER_WEIGHTS, shown)}
        kind = "peft"
        try:
            rank, alpha, seed = int(config["r"]), float(config.get("lora_alpha", 8)), 0
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{shown!r}: {ADAPTER_CONFIG} has no valid 'r' ({exc})", path=shown) from None
        base_model = config.get("base_model_name_or_path")
    tensors, _ = _load_tensors(blobs[ADAPTER_WEIGHTS], ADAPTER_WEIGHTS, shown)
    weights = _weights_from_peft(tensors, shown)
    for name, (a, _b) in weights.items():
        if a.shape[0] != rank:
            raise CheckpointError(f"checkpoint {shown!r}: {name} has rank {a.shape[0]}, the config says {rank}",
                                  path=shown)
    if has_manifest and sorted(weights) != sorted(meta.get("targets", [])):
        raise CheckpointError(f"checkpoint {shown!r}: the weights do not match the targets in {MANIFEST}", path=shown)
    adam = None
    if OPTIMIZER in blobs:
        moments, header = _load_tensors(blobs[OPTIMIZER], OPTIMIZER, shown)
        try:
            step = int(header["step"])
        except (KeyError, ValueError):
            raise CheckpointError(f"checkpoint {shown!r}: {OPTIMIZER} has no step count", path=shown) from None
        adam = AdamState(step=step)
        for which, table in (("exp_avg", adam.exp_avg), ("exp_avg_sq", adam.exp_avg_sq)):
            for name, (a, b) in weights.items():
                ka, kb = f"{which}.{name}.lora_A", f"{which}.{name}.lora_B"
                if ka not in moments and kb not in moments and step == 0:
                    continue
                ma, mb = moments.get(ka), moments.get(kb)
                if ma is None or mb is None or ma.shape != a.shape or mb.shape != b.shape:
                    raise CheckpointError(f"checkpoint {shown!r}: the optimizer state of {name} is missing or has "
                                          f"the wrong shape", path=shown)
                table[name] = (ma, mb)
    if require_optimizer and adam is None:
        what = "a sampler checkpoint (weights only)" if kind == "sampler" else "a weights-only adapter"
        raise CheckpointError(f"{shown!r} is {what}: it has no optimizer state to continue; use load_state() "
                              f"for the weights alone, or a path from save_state()", path=shown)
    return LoadedCheckpoint(path=str(directory), kind=str(kind), base_model=base_model, rank=rank, alpha=alpha,
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
