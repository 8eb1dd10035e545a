"""Base models: the built-in tiny Llama (no download), local Hugging Face causal LMs, and
Hugging Face Hub models, downloaded only when the user allows it.

A loaded base is frozen, put in eval mode, switched to the packed attention
implementation, and has its LoRA-able linears wrapped by `MultiLoRALinear` once; every
tenant of that base then shares it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..connect import DEFAULT_MODEL
from ..errors import DownloadFailedError, DownloadNotAllowedError, ModelDownloadError, UnknownModelError
from ..tokenizers import byte_tokenizer, load_tokenizer
from ..validation import ModelLimits
from .kernels import PackedLinears
from .packing import ATTN_IMPLEMENTATION, MultiLoRALinear, register_attention

LoRAKind = Literal["attn", "mlp", "unembed"]


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=259,  # ByT5 byte tokenizer: pad, eos, unk, then 256 bytes
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )


BUILTIN_MODELS: dict[str, str] = {
    DEFAULT_MODEL: "tiny Llama (4 layers, d=128) with a byte-level tokenizer; deterministic init, no download",
}


@dataclass
class BaseModel:
    name: str
    model: Any  # a transformers PreTrainedModel (its attribute access is too dynamic to type)
    tokenizer: Any
    vocab_size: int
    context_length: int
    device: torch.device
    dtype: torch.dtype
    # Wrapped linear name -> (kind, in_features, out_features)
    lora_targets: dict[str, tuple[LoRAKind, int, int]]
    source: str  # "builtin" or a local path
    # its large linears packed for the decode step (engine/kernels.py), made on first use
    linears: PackedLinears = field(default_factory=PackedLinears, compare=False, repr=False)

    @property
    def limits(self) -> ModelLimits:
        """What it accepts, as plain data for the input checks."""
        return ModelLimits(self.name, self.vocab_size, self.context_length, self.tokenizer is not None)

    def targets_for(self, train_attn: bool, train_mlp: bool, train_unembed: bool) -> dict[str, tuple[int, int]]:
        allowed = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
        return {name: (i, o) for name, (kind, i, o) in self.lora_targets.items() if allowed[kind]}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

    Binder and docker limits leave `os.cpu_count()` at the host's count (often 16-64),
    and that many OpenMP threads on a 1-CPU quota is many times slower than one.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, int(quota))) if quota is not None else max(1, cpus)


TORCH_THREADS_ENV = "TRIO_TORCH_THREADS"


def auto_torch_threads() -> int:
    """`LocalPool(torch_threads="auto")` on CPU: $TRIO_TORCH_THREADS if set, else half the
    usable CPUs. Small per-cycle ops on a shared machine (kernel, server, browser) run far
    steadier so: OpenMP spin-waits collapse under contention."""
    configured = os.environ.get(TORCH_THREADS_ENV, "").strip()
    if configured:
        try:
            value = int(configured)
        except ValueError:
            raise ValueError(f"{TORCH_THREADS_ENV} must be a whole number of threads, got {configured!r}") from None
        if value < 1:
            raise ValueError(f"{TORCH_THREADS_ENV} must be at least 1, got {value}")
        return value
    return max(1, usable_cpus() // 2)


def cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of quota from cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); None if unlimited."""
    try:
        quota_text, period_text = (root / "cpu.max").read_text().split()[:2]
        return None if quota_text == "max" else int(quota_text) / int(period_text)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _classify(name: str) -> LoRAKind | None:
    leaf = name.rsplit(".", 1)[-1]
    path = name.lower()
    if "attn" in path or "attention" in path:
        return "attn"
    if "mlp" in path or "feed_forward" in path or "ffn" in path or leaf in {"gate_proj", "up_proj", "down_proj"}:
        return "mlp"
    return None


def _install_lora_wrappers(model: Any) -> dict[str, tuple[LoRAKind, int, int]]:
    head = model.get_output_embeddings()
    targets: dict[str, tuple[LoRAKind, int, int]] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        kind: LoRAKind | None = "unembed" if module is head else _classify(name)
        if kind is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, MultiLoRALinear(module, name))
        targets[name] = (kind, module.in_features, module.out_features)
    return targets


def _build_builtin(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same base weights in every process
        model: Any = LlamaForCausalLM(_tiny_llama_config())
    return model.to(dtype), byte_tokenizer()


# What a causal LM needs from a Hub repo: config, safetensors weights, tokenizer files. Not the
# ONNX / GGUF / original-checkpoint copies many repos also hold (often several times the size).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
ALLOW_DOWNLOAD_ENV = "TRIO_ALLOW_DOWNLOAD"
_HOW_TO_ALLOW = f"pass allow_download=True to trio.LocalPool(...) or set {ALLOW_DOWNLOAD_ENV}=1"


def download_allowed(allow_download: bool | None) -> bool:
    """`LocalPool(allow_download=...)`: True/False as given; None reads $TRIO_ALLOW_DOWNLOAD."""
    if allow_download is not None:
        return bool(allow_download)
    value = os.environ.get(ALLOW_DOWNLOAD_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ALLOW_DOWNLOAD_ENV} must be 1 or 0 (or true/false, yes/no), got {value!r}")


def _local_model_dir(name: str) -> str | None:
    """A directory holding `name`: the path itself, or its snapshot in the local HF cache.

    Resolved here, never by transformers, so that no lookup ever reaches the network.
    """
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        # Complete means: every file a download fetches is there (not the ONNX copies and the like);
        # a PyTorch-pickle-only repo's *.bin files come with the same snapshot folder.
        return snapshot_download(name, local_files_only=True, allow_patterns=HUB_FILES)
    except Exception:  # not cached, or not a valid repo id
        return None


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _download(name: str) -> str:
    """Fetch `name` from the Hugging Face Hub into the HF cache with the hub client's own
    `snapshot_download`: its progress bars are tqdm.auto, a widget in a notebook and text in
    a terminal; files already cached are not fetched again."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = constants.ENDPOINT
    try:
        path = snapshot_download(name, allow_patterns=HUB_FILES)
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):  # older repos: PyTorch pickles only
            path = snapshot_download(name, allow_patterns=HUB_FILES + ["*.bin"])
    except GatedRepoError as exc:
        raise ModelDownloadError(
            f"{name!r} is gated on the Hugging Face Hub: accept its terms at {endpoint}/{name} and log in "
            f"(`hf auth login` or $HF_TOKEN), then try again", field="base_model") from exc
    except RepositoryNotFoundError as exc:
        raise ModelDownloadError(
            f"unknown model {name!r}: there is none on the Hugging Face Hub at {endpoint} (or it is private: "
            f"log in with `hf auth login` or set $HF_TOKEN); check the id", field="base_model") from exc
    except RevisionNotFoundError as exc:
        raise ModelDownloadError(f"{name!r} has no 'main' revision on the Hugging Face Hub at {endpoint}",
                                 field="base_model") from exc
    except Exception as exc:  # no network, offline mode, a refused or broken connection, a full disk
        cause = exc.__cause__ or exc
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise DownloadFailedError(
            f"could not download {name!r} from the Hugging Face Hub at {endpoint} (offline?){offline}: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''} -- check the network, "
            f"$HF_ENDPOINT and $HF_HUB_OFFLINE, or fetch it where there is a network (`hf download {name}`) and "
            f"pass its directory", field="base_model") from exc
    return path


def _load_local(name: str, dtype: torch.dtype, allow_download: bool | None = None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    path = _local_model_dir(name)
    known = ", ".join(BUILTIN_MODELS)
    if path is None and not _is_repo_id(name):
        raise UnknownModelError(
            f"unknown model {name!r}: it is not built in ({known}), not a local directory with a saved "
            f"Hugging Face model, and not a Hugging Face Hub id", field="base_model")
    if path is None:
        where = (f"unknown model {name!r}: it is not built in ({known}), not a local directory, and not in the "
                 f"local Hugging Face cache")
        if not download_allowed(allow_download):
            raise DownloadNotAllowedError(
                f"{where}; downloading it from the Hugging Face Hub is not allowed: {_HOW_TO_ALLOW} "
                f"(or save the model to a directory and pass its path)", field="base_model")
        path = _download(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise UnknownModelError(f"could not load {name!r} as a Hugging Face causal LM from {path}: {exc}",
                                field="base_model") from exc
    return model, load_tokenizer(path)


_REGISTER_LOCK = threading.Lock()


def load_base_model(name: str, device: torch.device, allow_download: bool | None = None) -> BaseModel:
    """`name` built in, from a local directory or the local HF cache, or (`allow_download`,
    None: $TRIO_ALLOW_DOWNLOAD) fetched from the Hugging Face Hub; frozen and wrapped."""
    with _REGISTER_LOCK:
        register_attention()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"base_model must be a non-empty string, got {name!r}", field="base_model")
    if name in BUILTIN_MODELS:
        model, tokenizer = _build_builtin(name, dtype)
        source = "builtin"
    else:
        model, tokenizer = _load_local(name, dtype, allow_download)
        source = os.path.abspath(name) if os.path.isdir(name) else name
    model.requires_grad_(False)
    model.eval()
    model.config.use_cache = False
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    targets = _install_lora_wrappers(model)
    model.to(device)
    context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    vocab = int(model.get_input_embeddings().num_embeddings)
    return BaseModel(name=name, model=model, tokenizer=tokenizer, vocab_size=vocab, context_length=context,
                     device=device, dtype=dtype, lora_targets=targets, source=source)


def is_base_model_name(name: object) -> bool:
    """Whether `name` names a base model this machine has (built in, a local model directory,
    or an id in the local HF cache), without loading it."""
    if not isinstance(name, str) or not name:
        return False
    if name in BUILTIN_MODELS:
        return True
    path = _local_model_dir(name)
    return path is not None and os.path.isfile(os.path.join(path, "config.json"))


def context_length_of(name: str) -> int | None:
    """A base model's context length from its config, without loading its weights (None if
    it cannot be read). The same number `load_base_model` uses."""
    if name in BUILTIN_MODELS:
        return int(_tiny_llama_config().max_position_embeddings)
    path = _local_model_dir(name)
    if path is None:
        return None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings", 2048) if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 2048
