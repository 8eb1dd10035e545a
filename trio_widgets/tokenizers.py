"""Tokenizers without the engine: the built-in models' byte tokenizer and a checked loader of a
tokenizer directory. transformers is imported when one is loaded (no torch needed); the engine
and the HTTP client both use these."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from .errors import UnknownModelError

__all__ = ["byte_tokenizer", "load_tokenizer"]


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
