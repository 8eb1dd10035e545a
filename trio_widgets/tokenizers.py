"""Tokenizers without the engine: the built-in models' byte tokenizer and a checked loader of a
tokenizer directory. transformers is imported when one is loaded (no torch needed); the engine
and the HTTP client both use these."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from .errors import UnknownModelError

__all__ = ["MAX_TOKENIZER_FILE_BYTES", "TOKENIZER_FILES", "byte_tokenizer", "is_tokenizer_file", "load_tokenizer",
           "pull_tokenizer"]

#: What a tokenizer is made of, and all a server sends for pull-tokenizer (never a model's weights,
#: whatever else its directory holds): transformers' tokenizer files, sentencepiece / tiktoken
#: vocabularies, chat templates, and the model's config.json (AutoTokenizer reads its model_type).
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "tokenizer.tiktoken", "chat_template.jinja", "chat_template.json", "config.json",
})
#: One file's bound: the largest real tokenizer.json files are ~20 MiB (large multilingual vocabularies).
MAX_TOKENIZER_FILE_BYTES = 32 << 20


def is_tokenizer_file(name: str) -> bool:
    """Whether a file of this name is part of a tokenizer (TOKENIZER_FILES)."""
    return name in TOKENIZER_FILES


# transformers' lazy module is not safe to import from two threads at once the first time (a
# sampler's threads meeting there got "cannot import name 'ByT5Tokenizer'"): loads take turns
_LOADING = threading.RLock()


def byte_tokenizer():
    """A real Hugging Face tokenizer that needs no vocabulary file: one token per byte."""
    with _LOADING:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)


def _named_tokenizer_classes(path: str) -> dict[str, str]:
    """file name -> the `tokenizer_class` it gives (AutoTokenizer reads both files)."""

    names = {}
    for fname in ("tokenizer_config.json", "config.json"):
        file = os.path.join(path, fname)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError, RecursionError):
            continue  # unreadable: transformers reports it, or loads no tokenizer
        named = config.get("tokenizer_class") if isinstance(config, dict) else None
        if named is None:
            continue
        if not isinstance(named, str) or not named.isidentifier():
            raise UnknownModelError(f"{file} names {named!r} as its tokenizer class, which is not a class name",
                                    field="base_model")
        names[fname] = named
    return names


def _tokenizer_class(file: str, named: str) -> Any:
    """The transformers tokenizer class `named` means, or None if transformers has none by that name.

    `transformers.<named>` is looked up (an import, never an instantiation), and so are the
    names AutoTokenizer would also try (with "Fast" added or stripped): any of them that is
    not a tokenizer class (`AutoModelForCausalLM` would load a second model) is an error.
    Falling back to AutoTokenizer is no way out: it resolves the same names the same way.
    """
    import transformers

    candidates = [named, named + "Fast"]
    stem = named
    while stem.endswith("Fast"):
        stem = stem[:-4]
        candidates.append(stem)
    found = None
    for candidate in candidates:
        try:
            obj = getattr(transformers, candidate, None)
        except (ImportError, RuntimeError):  # its module needs a missing dependency: never resolved, never called
            obj = None
        if obj is None:
            continue
        # a placeholder for a tokenizer whose optional dependency is missing: it raises ImportError
        placeholder = type(obj).__name__ == "DummyObject"
        if not placeholder and not (isinstance(obj, type) and issubclass(obj, transformers.PreTrainedTokenizerBase)):
            raise UnknownModelError(f"{file} names {named!r} as its tokenizer class, but transformers.{candidate} is "
                                    f"not a tokenizer class (only subclasses of PreTrainedTokenizerBase are loaded)",
                                    field="base_model")
        if found is None and candidate == named:
            found = obj
    return found


def load_tokenizer(path: str) -> Any:
    """The tokenizer class the directory names, else AutoTokenizer's pick.

    transformers 5 lets AutoTokenizer prefer the model type's tokenizer over the saved
    `tokenizer_class` (a Qwen2 config with a byte tokenizer loads a 4-token Qwen2Tokenizer).
    A name that is not a tokenizer class is an UnknownModelError (see `_tokenizer_class`);
    code shipped with the model (`auto_map`) is never run.
    """
    with _LOADING:
        return _load_tokenizer(path)


def _load_tokenizer(path: str) -> Any:
    import transformers

    named = _named_tokenizer_classes(path)
    classes = {fname: _tokenizer_class(os.path.join(path, fname), name) for fname, name in named.items()}
    cls = classes.get("tokenizer_config.json")
    try:
        if cls is not None:
            return cls.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError):
        return None


# -- pull-tokenizer: a served model's tokenizer in this machine's Hugging Face cache ---------------

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def pull_tokenizer(base_url: str, api_key: str | None = None, model: str | None = None, *,
                   cache_dir: str | os.PathLike | None = None, timeout_s: float = 60.0) -> Path:
    """Fetch the tokenizer of `model` (default: the server's first) from a served pool and store
    it in the Hugging Face cache (huggingface_hub's layout: blobs, a snapshot, refs/main) under
    the model's name, so `AutoTokenizer.from_pretrained(model)` works with HF_HUB_OFFLINE=1 (as
    the tinker SDK's get_tokenizer and tinker-cookbook load it). Returns the snapshot directory."""
    import base64

    import httpx
    from huggingface_hub import constants

    headers = {"X-API-Key": api_key} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/") + "/api/v1", headers=headers, timeout=timeout_s) as http:
        if model is None:
            caps = _json(http.get("/get_server_capabilities"))
            names = [m.get("model_name") for m in caps.get("supported_models", []) if isinstance(m, dict)]
            if not names:
                raise UnknownModelError(f"{base_url} serves no models", field="base_model")
            model = str(names[0])
        if not _REPO_ID.match(model):
            raise UnknownModelError(f"{model!r} is not a Hugging Face model name (org/name): its tokenizer cannot be "
                                    f"stored under it", field="base_model")
        body = _json(http.get("/trio/tokenizer", params={"base_model": model}))
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or not files:
        raise UnknownModelError(f"{base_url} sent no tokenizer files for {model}", field="base_model")
    contents = {}
    for name, data in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name) or not is_tokenizer_file(name) \
                or not isinstance(data, str):
            raise UnknownModelError(f"the server sent a file named {str(name)[:80]!r}, not a tokenizer file name",
                                    field="base_model")
        contents[name] = base64.b64decode(data, validate=True)
    # a revision from the contents: the same files give the same snapshot, new ones a new one
    digest = hashlib.sha1()
    for name in sorted(contents):
        digest.update(name.encode() + b"\0" + hashlib.sha256(contents[name]).digest())
    revision = digest.hexdigest()
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        _write(blob, data)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        try:
            link.symlink_to(os.path.relpath(blob, snapshot))
        except OSError:  # no symlinks here (some Windows setups): a copy, as huggingface_hub falls back to
            _write(link, data)
    (repo / "refs").mkdir(exist_ok=True)
    _write(repo / "refs" / "main", revision.encode())
    return snapshot


def _json(response: Any) -> Any:
    if response.status_code != 200:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text[:200]
        raise UnknownModelError(f"the server answered {response.status_code}: {detail}", field="base_model")
    return response.json()


def _write(path: Path, data: bytes) -> None:
    """Written whole or not at all (another process may read the cache meanwhile)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
