"""Every check on user input, in one place.

Checks that need no model (types, shapes, ranges) are what the client runs before it builds
a request; checks against a model (vocabulary, context length, tokenizer) take that model's
`ModelLimits` and run behind the backend, before anything is queued. Either way a rejected
request raises an `InvalidInputError` (a ValueError) naming the field and, for data, the
datum, and nothing is queued or changed.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._numbers import is_finite_number, is_int, is_number
from .errors import InvalidInputError
from .protocol.losses import (
    FLOAT_INPUTS,
    IGNORE_TARGET,
    REQUIRED_INPUTS,
    check_loss_inputs,
    normalise_loss_name,
    resolved_config,
)
from .types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

__all__ = ["MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_STOP_TOTAL_CHARS",
           "CheckedDatum", "ModelLimits", "RequestLimits", "SampleSpec", "check_adam_params", "check_batch",
           "check_logprob_options", "check_loss", "check_sample", "check_prompt", "check_save_extras", "check_ttl",
           "check_user_metadata", "custom_loss_problem", "is_int", "is_number"]


@dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask of a pool (LocalPool's `max_request_*` settings): bounds
    that keep one client's request from holding the clock (and its neighbours) for minutes or
    exhausting memory. Checked at submit."""

    max_request_tokens: int = 16_384  # tokens of one forward request, all its data together
    max_request_data: int = 1024  # data (sequences) of one forward request
    max_num_samples: int = 128  # samples of one sample request
    max_sampled_tokens: int = 32_768  # num_samples × max_tokens of one sample request


@dataclass(frozen=True)
class ModelLimits:
    """What a base model accepts: plain data, so a check can run wherever the model is described."""

    name: str
    vocab_size: int
    context_length: int
    has_tokenizer: bool = True


# -- training data -----------------------------------------------------------------------

@dataclass(frozen=True)
class CheckedDatum:
    """A datum that passed every check: token ids and loss inputs as plain lists."""

    tokens: list[int]
    target_tokens: list[int] | None
    floats: dict[str, list[float]]  # weights, logprobs, advantages

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def read(self) -> list[bool]:
        """Per position, whether the loss reads it: not a target of -100 (IGNORE_TARGET, pytrio's rule)."""
        if self.target_tokens is None:
            return [True] * len(self.tokens)
        return [t != IGNORE_TARGET for t in self.target_tokens]

    @property
    def weight(self) -> float:
        """Loss-weighted tokens (every token weighs 1 without `weights`); a target of -100 weighs 0."""
        weights = self.floats.get("weights")
        if weights is None:
            return float(sum(self.read))
        return float(sum(w for w, r in zip(weights, self.read) if r))


def check_loss(loss_fn: Any, loss_fn_config: Any) -> tuple[str, dict[str, float]]:
    """A known loss name (case and surrounding spaces ignored, as pytrio does) and its config with
    defaults filled in, every value a finite number in its range (a NaN clip bound would only fail
    later, inside the cycle)."""
    try:
        loss_fn = normalise_loss_name(loss_fn)
    except ValueError as exc:
        raise InvalidInputError(str(exc), field="loss_fn") from None
    if loss_fn_config is not None and not isinstance(loss_fn_config, dict):
        raise InvalidInputError(f"must be a dict of numbers (or None), got {type(loss_fn_config).__name__}",
                                field="loss_fn_config")
    for key, value in (loss_fn_config or {}).items():
        if not is_finite_number(value):
            raise InvalidInputError(f"{key!r} must be a finite number, got {value!r:.40}", field="loss_fn_config")
    try:
        config = resolved_config(loss_fn, loss_fn_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(str(exc).strip('"'), field="loss_fn_config") from None
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and high is not None and not (0 <= low <= high):
        raise InvalidInputError(f"needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}",
                                field="loss_fn_config")
    if config.get("beta", 0.0) < 0:
        raise InvalidInputError(f"beta must be >= 0, got {config['beta']}", field="loss_fn_config")
    return loss_fn, config


def _check_tokens(tokens: Sequence[int], vocab: int | None, where: str, index: int | None) -> None:
    """Token ids in [0, vocab) (without a model: >= 0)."""
    for pos, tok in enumerate(tokens):
        if tok < 0 or (vocab is not None and tok >= vocab):
            bound = f"outside the vocabulary [0, {vocab})" if vocab is not None else "negative: a token id is >= 0"
            raise InvalidInputError(f"token id {tok} at position {pos} is {bound}", field=where, datum_index=index)


def _check_targets(targets: Sequence[int], vocab: int | None, where: str, index: int | None) -> None:
    """Target ids in [0, vocab), or -100 (IGNORE_TARGET: the position is not read, pytrio's rule)."""
    for pos, tok in enumerate(targets):
        if tok != IGNORE_TARGET and (tok < 0 or (vocab is not None and tok >= vocab)):
            bound = f"outside the vocabulary [0, {vocab})" if vocab is not None and tok >= 0 else "negative"
            raise InvalidInputError(f"target token id {tok} at position {pos} is {bound} and not {IGNORE_TARGET} "
                                    f"(ignore this position)", field=where, datum_index=index)


def check_batch(data: Any, loss_fn: str, limits: ModelLimits | None = None,
                request_limits: RequestLimits | None = None) -> list[CheckedDatum]:
    """A batch against the loss (and, given `limits`, the model; given `request_limits`, the
    pool's bounds): the checked data, in order."""
    if isinstance(data, Datum):
        raise InvalidInputError("expected a list of Datum, got a single Datum (wrap it in a list)", field="data")
    if not isinstance(data, (list, tuple)):
        what = "a generator or iterator (pass a list)" if hasattr(data, "__next__") else type(data).__name__
        raise InvalidInputError(f"expected a list of Datum, got {what}", field="data")
    if len(data) == 0:
        raise InvalidInputError("the batch is empty: pass at least one Datum", field="data")
    if request_limits is not None and len(data) > request_limits.max_request_data:
        raise InvalidInputError(f"has {len(data)} data, more than this pool's limit of "
                                f"{request_limits.max_request_data} per request (LocalPool(max_request_data=...)); "
                                f"split it into several requests", field="data")
    needed = REQUIRED_INPUTS.get(loss_fn, ("target_tokens",))
    checked = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        if not isinstance(datum, Datum):
            raise InvalidInputError(f"expected a Datum, got {type(datum).__name__}", field=where, datum_index=i)
        if not isinstance(datum.model_input, ModelInput):
            raise InvalidInputError("model_input must be a ModelInput", field=f"{where}.model_input", datum_index=i)
        tokens = datum.model_input.to_ints()
        length = len(tokens)
        if length == 0:
            raise InvalidInputError("model_input is empty", field=f"{where}.model_input", datum_index=i)
        for pos, tok in enumerate(tokens):
            if not is_int(tok):
                raise InvalidInputError(f"token {pos} is {tok!r}, not an integer token id",
                                        field=f"{where}.model_input", datum_index=i)
        if limits is not None and length > limits.context_length:
            raise InvalidInputError(f"model_input has {length} tokens, more than the context of {limits.name} "
                                    f"({limits.context_length})", field=f"{where}.model_input", datum_index=i)
        _check_tokens(tokens, limits.vocab_size if limits is not None else None, f"{where}.model_input", i)
        for key in needed:
            if key not in datum.loss_fn_inputs:
                have = ", ".join(sorted(datum.loss_fn_inputs)) or "nothing"
                raise InvalidInputError(f"loss {loss_fn!r} needs loss_fn_inputs[{key!r}] (got {have})",
                                        field=f"{where}.loss_fn_inputs", datum_index=i)
        target: list[int] | None = None
        floats: dict[str, list[float]] = {}
        for key, raw in datum.loss_fn_inputs.items():
            field_name = f"{where}.loss_fn_inputs[{key!r}]"
            try:
                td = TensorData.from_any(raw)
            except TypeError as exc:
                raise InvalidInputError(str(exc), field=field_name, datum_index=i) from None
            if td.shape is not None and len(td.shape) != 1:
                raise InvalidInputError(f"must be one value per token (1-D), got shape {list(td.shape)}",
                                        field=field_name, datum_index=i)
            if len(td.data) != length:
                raise InvalidInputError(f"has length {len(td.data)} but model_input has length {length}",
                                        field=field_name, datum_index=i)
            if key == "target_tokens":
                if td.dtype != "int64":
                    raise InvalidInputError("target tokens must be integers, got floats", field=field_name,
                                            datum_index=i)
                target = [int(t) for t in td.data]
                _check_targets(target, limits.vocab_size if limits is not None else None, field_name, i)
            elif key in FLOAT_INPUTS:
                values = np.asarray(td.data, dtype=np.float64)
                bad = np.flatnonzero(~np.isfinite(values))
                if bad.size:
                    raise InvalidInputError(
                        f"value {values[bad[0]]} at position {int(bad[0])} is not finite (NaN or infinite)",
                        field=field_name, datum_index=i)
                floats[key] = [float(v) for v in td.data]
        try:
            check_loss_inputs(loss_fn, floats, target)
        except ValueError as exc:  # the message names the loss_fn_inputs key
            raise InvalidInputError(str(exc), field=where, datum_index=i) from None
        checked.append(CheckedDatum(tokens, target, floats))
    total = sum(d.length for d in checked)
    if request_limits is not None and total > request_limits.max_request_tokens:
        raise InvalidInputError(f"has {total} tokens, more than this pool's limit of "
                                f"{request_limits.max_request_tokens} per request "
                                f"(LocalPool(max_request_tokens=...)); split it into several requests", field="data")
    return checked


def check_adam_params(params: Any) -> AdamParams:
    """The optimizer settings, copied: later edits by the caller don't reach a queued step."""
    if not isinstance(params, AdamParams):
        raise InvalidInputError(f"expected AdamParams, got {type(params).__name__}", field="adam_params")
    lr = params.learning_rate
    if not is_finite_number(lr) or lr <= 0:
        raise InvalidInputError(f"must be a finite number > 0, got {lr!r}", field="adam_params.learning_rate")
    for name in ("beta1", "beta2"):
        value = getattr(params, name)
        if not (is_number(value) and 0 <= value < 1):
            raise InvalidInputError(f"must be in [0, 1), got {value!r}", field=f"adam_params.{name}")
    # eps divides: 0 turns an entry with no gradient history into 0/0
    if not (is_finite_number(params.eps) and params.eps > 0):
        raise InvalidInputError(f"must be a finite number > 0, got {params.eps!r}", field="adam_params.eps")
    for name in ("weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not (is_finite_number(value) and value >= 0):
            raise InvalidInputError(f"must be a finite number >= 0, got {value!r:.40}", field=f"adam_params.{name}")
    # plain floats: numpy scalars are fine to give, and the step kernel wants Python numbers
    return replace(params, **{name: float(getattr(params, name)) for name in
                              ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")})


# -- sampling --------------------------------------------------------------------------------

# Stop strings are matched on the clock thread after every sampled token of every row, so their
# count and length bound that work for every tenant sharing the cycle (issue 22). Token ids cost
# a set lookup; their count only bounds the request's size.
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_STRING_CHARS = 256  # characters of one stop string
MAX_STOP_TOTAL_CHARS = 4096  # characters of all of a request's stop strings together
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request


@dataclass(frozen=True)
class SampleSpec:
    """One checked sampling request: a prompt and how to continue it (or only score it)."""

    prompt: list[int]
    num_samples: int  # 0 for compute_logprobs
    max_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    # the stop strings by their last character, built at submit so that the clock thread only
    # checks, per new character, whether the text ends with a stop string ending in it
    stop_by_last: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False, repr=False)
    seed: int = 0
    prompt_logprobs: bool = False
    logprobs_only: bool = False
    # tinker's logprob options (check_logprob_options)
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt positions
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_ids: tuple[tuple[int, ...], ...] | None = None  # [len(prompt) - 1][K], -1: none
    prompt_alt_tokens_k: int = 0


def check_prompt(prompt: Any, limits: ModelLimits | None = None, field_name: str = "prompt") -> list[int]:
    if isinstance(prompt, ModelInput):
        tokens = prompt.to_ints()
    elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
        tokens = [int(t) for t in prompt]
    else:
        raise InvalidInputError(f"expected a ModelInput (or a list of token ids), got {type(prompt).__name__}",
                                field=field_name)
    if not tokens:
        raise InvalidInputError("the prompt is empty: give at least one token", field=field_name)
    if limits is not None:
        if len(tokens) > limits.context_length:
            raise InvalidInputError(f"the prompt has {len(tokens)} tokens, more than the context of {limits.name} "
                                    f"({limits.context_length})", field=field_name)
        _check_tokens(tokens, limits.vocab_size, field_name, None)
    return tokens


def _stops(stop: Any, limits: ModelLimits | None) -> tuple[frozenset[int], tuple[str, ...]]:
    where = "sampling_params.stop"
    if stop is None:
        return frozenset(), ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidInputError(f"must be a string, a list of strings or a list of token ids, got "
                                f"{type(stop).__name__}", field=where)
    if len(stop) > MAX_STOP_STRINGS + MAX_STOP_TOKEN_IDS:  # refused before looking at each entry
        raise InvalidInputError(f"has {len(stop)} entries, more than the limit of {MAX_STOP_STRINGS} stop strings "
                                f"and {MAX_STOP_TOKEN_IDS} stop token ids", field=where)
    ids: set[int] = set()
    strings: list[str] = []
    total = 0
    for item in stop:
        if isinstance(item, str):
            if not item:
                raise InvalidInputError("an empty stop string would stop at once", field=where)
            if len(strings) == MAX_STOP_STRINGS:
                raise InvalidInputError(f"has more than the limit of {MAX_STOP_STRINGS} stop strings per request",
                                        field=where)
            if len(item) > MAX_STOP_STRING_CHARS:
                raise InvalidInputError(f"a stop string has {len(item)} characters, more than the limit of "
                                        f"{MAX_STOP_STRING_CHARS}", field=where)
            total += len(item)
            if total > MAX_STOP_TOTAL_CHARS:
                raise InvalidInputError(f"the stop strings have more than the limit of {MAX_STOP_TOTAL_CHARS} "
                                        f"characters together", field=where)
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no text can ever contain it
                raise InvalidInputError(f"stop string {item!r} is not valid text ({exc.reason})", field=where) from None
            strings.append(item)
        elif is_int(item):
            if limits is not None and not (0 <= item < limits.vocab_size):
                raise InvalidInputError(f"stop token id {item} is outside the vocabulary [0, {limits.vocab_size})",
                                        field=where)
            ids.add(int(item))
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise InvalidInputError(f"has more than the limit of {MAX_STOP_TOKEN_IDS} stop token ids per "
                                        f"request", field=where)
        else:
            raise InvalidInputError(f"stop entries must be strings or token ids, got {type(item).__name__}",
                                    field=where)
    if strings and limits is not None and not limits.has_tokenizer:
        raise InvalidInputError(f"{limits.name} has no tokenizer, so stop strings cannot be matched; "
                                f"pass stop token ids instead", field=where)
    return frozenset(ids), tuple(strings)


def _by_last_char(strings: Sequence[str]) -> dict[str, tuple[str, ...]]:
    by_last: dict[str, list[str]] = {}
    for s in dict.fromkeys(strings):  # a repeated stop string is checked once
        by_last.setdefault(s[-1], []).append(s)
    return {last: tuple(group) for last, group in by_last.items()}


def check_sample(prompt: Any, num_samples: Any, params: Any, include_prompt_logprobs: bool,
                 limits: ModelLimits | None = None, request_limits: RequestLimits | None = None) -> SampleSpec:
    tokens = check_prompt(prompt, limits)
    if not is_int(num_samples) or num_samples < 1:
        raise InvalidInputError(f"must be an integer >= 1, got {num_samples!r}", field="num_samples")
    if request_limits is not None and num_samples > request_limits.max_num_samples:
        raise InvalidInputError(f"{num_samples} is more than this pool's limit of {request_limits.max_num_samples} "
                                f"samples per request (LocalPool(max_num_samples=...))", field="num_samples")
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"expected SamplingParams, got {type(params).__name__}", field="sampling_params")
    mt = params.max_tokens
    if not is_int(mt) or mt < 1:
        raise InvalidInputError(f"must be an integer >= 1, got {mt!r}", field="sampling_params.max_tokens")
    if request_limits is not None and num_samples * mt > request_limits.max_sampled_tokens:
        raise InvalidInputError(f"num_samples × max_tokens = {num_samples * mt} is more than this pool's limit of "
                                f"{request_limits.max_sampled_tokens} sampled tokens per request "
                                f"(LocalPool(max_sampled_tokens=...))", field="sampling_params.max_tokens")
    if limits is not None and len(tokens) + mt > limits.context_length:
        raise InvalidInputError(f"prompt ({len(tokens)} tokens) + max_tokens ({mt}) is more than the context of "
                                f"{limits.name} ({limits.context_length})", field="sampling_params.max_tokens")
    temp = params.temperature
    if not is_finite_number(temp) or temp < 0:
        raise InvalidInputError(f"must be a finite number >= 0 (0 is greedy), got {temp!r}",
                                field="sampling_params.temperature")
    top_k = params.top_k
    if not is_int(top_k) or top_k < -1:
        raise InvalidInputError(f"must be -1 (off) or an integer >= 1, got {top_k!r}", field="sampling_params.top_k")
    if limits is not None:
        top_k = min(int(top_k), limits.vocab_size)  # more than the vocabulary keeps every token
    top_p = params.top_p
    if not is_number(top_p) or not (0 < top_p <= 1):
        raise InvalidInputError(f"must be in (0, 1], got {top_p!r}", field="sampling_params.top_p")
    seed = params.seed
    if seed is not None and not is_int(seed):
        raise InvalidInputError(f"must be an integer or None, got {seed!r}", field="sampling_params.seed")
    stop_ids, stop_strings = _stops(params.stop, limits)
    return SampleSpec(prompt=tokens, num_samples=int(num_samples), max_tokens=int(mt), temperature=float(temp),
                      top_k=max(int(top_k), 0), top_p=float(top_p), stop_ids=stop_ids, stop_strings=stop_strings,
                      stop_by_last=_by_last_char(stop_strings),
                      seed=int(seed) % 2**64 if seed is not None else secrets.randbits(63),
                      prompt_logprobs=bool(include_prompt_logprobs))


def check_logprobs_prompt(prompt: Any, limits: ModelLimits | None = None) -> SampleSpec:
    return SampleSpec(prompt=check_prompt(prompt, limits), num_samples=0, prompt_logprobs=True, logprobs_only=True)


def _count(value: Any, field_name: str, limit: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not is_int(value) or value < 0:
        raise InvalidInputError(f"must be an integer >= 0 (0: off), got {value!r}", field=field_name)
    if limit is not None and value > limit:
        raise InvalidInputError(f"must be at most {limit}{what}, got {value}", field=field_name)
    return int(value)


def check_logprob_options(spec: SampleSpec, *, include_prompt_logprobs: bool, topk_prompt_logprobs: Any = 0,
                          topk_sample_logprobs: Any = 0, prompt_logprobs_last_n: Any = None,
                          target_prompt_logprobs: Any = None, prompt_alt_tokens_k: Any = 0,
                          limits: ModelLimits | None = None) -> SampleSpec:
    """tinker's logprob options of `sample` / `compute_logprobs`, checked and added to `spec`."""
    vocab = limits.vocab_size if limits is not None else None
    in_vocab = f" (the vocabulary of {limits.name})" if limits is not None else ""
    n = len(spec.prompt)
    last_n = prompt_logprobs_last_n
    if last_n is not None:
        if isinstance(last_n, bool) or not is_int(last_n) or last_n < 1:
            raise InvalidInputError(f"must be an integer >= 1 or None, got {last_n!r}",
                                    field="prompt_logprobs_last_n")
        if not (include_prompt_logprobs or spec.logprobs_only):
            raise InvalidInputError("prompt_logprobs_last_n applies to prompt logprobs; set include_prompt_logprobs",
                                    field="prompt_logprobs_last_n")
        if last_n > n - 1:
            raise InvalidInputError(f"the prompt has {n} tokens, so at most {n - 1} positions have a logprob "
                                    f"(the first has no context), got {last_n}", field="prompt_logprobs_last_n")
        last_n = int(last_n)
    alt_k = _count(prompt_alt_tokens_k, "prompt_alt_tokens_k")
    for name, asked in (("target_prompt_logprobs", target_prompt_logprobs is not None),
                        ("prompt_alt_tokens_k", alt_k > 0)):
        if asked and n < 2:
            raise InvalidInputError("the prompt has 1 token: no position after the first to score", field=name)
    targets = None
    if target_prompt_logprobs is not None:
        where = "target_prompt_logprobs"
        try:
            td = TensorData.from_any(target_prompt_logprobs)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(str(exc), field=where) from None
        if td.dtype != "int64":
            raise InvalidInputError(f"must hold int64 token ids (-1: none), got {td.dtype}", field=where)
        if len(td.shape) != 2 or td.shape[0] != n - 1:
            raise InvalidInputError(f"must have shape [len(prompt) - 1, K] = [{n - 1}, K], got {td.shape}",
                                    field=where)
        bad = [t for t in td.data if t < -1 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is neither -1 (none) nor in [0, {vocab}){in_vocab}",
                                    field=where)
        k = td.shape[1]
        targets = tuple(tuple(int(t) for t in td.data[i * k:(i + 1) * k]) for i in range(n - 1))
    return replace(spec, prompt_logprobs_last_n=last_n,
                   topk_prompt_logprobs=_count(topk_prompt_logprobs, "topk_prompt_logprobs", vocab, in_vocab),
                   topk_sample_logprobs=_count(topk_sample_logprobs, "topk_sample_logprobs", vocab, in_vocab),
                   target_prompt_ids=targets, prompt_alt_tokens_k=alt_k)


# -- custom losses ----------------------------------------------------------------------------

def custom_loss_problem(loss: Any) -> str | None:
    """What is wrong with the loss a custom loss function returned (None: a tensor of one
    element, which is what torch's `backward()`, and so tinker, takes). A vector is refused, not
    summed on the user's behalf."""
    if not (hasattr(loss, "shape") and hasattr(loss, "numel") and hasattr(loss, "backward")):
        return f"your loss function must return (scalar tensor, dict); its loss is a {type(loss).__name__}"
    if loss.numel() != 1:
        return (f"your loss function returned a loss of shape {list(loss.shape)}, not a scalar: reduce it "
                f"(.sum() or .mean()) before returning it")
    return None


# -- checkpoints ------------------------------------------------------------------------------

TTL_RANGE = (3600, 10 * 365 * 24 * 3600)  # tinker's: one hour to ten years


def check_ttl(ttl_seconds: Any, field_name: str = "ttl_seconds") -> int | None:
    if ttl_seconds is None:
        return None
    low, high = TTL_RANGE
    if isinstance(ttl_seconds, bool) or not is_int(ttl_seconds) or not low <= ttl_seconds <= high:
        raise InvalidInputError(f"must be None (keep forever) or seconds from {low} (1 hour) to {high} (10 years), "
                                f"got {ttl_seconds!r}", field=field_name)
    return int(ttl_seconds)


#: A checkpoint's user_metadata: at most this many entries and this many bytes as JSON. Saving and
#: loading check the same bound (a checkpoint that saved always loads).
MAX_USER_METADATA_ENTRIES = 64
MAX_USER_METADATA_BYTES = 64 << 10


def check_user_metadata(user_metadata: Any, field_name: str = "user_metadata") -> dict[str, str] | None:
    if user_metadata is None:
        return None
    if not isinstance(user_metadata, dict):
        raise InvalidInputError(f"must be a dict of strings, got {type(user_metadata).__name__}", field=field_name)
    if len(user_metadata) > MAX_USER_METADATA_ENTRIES:
        raise InvalidInputError(f"must have at most {MAX_USER_METADATA_ENTRIES} entries, got {len(user_metadata)}",
                                field=field_name)
    for key, value in user_metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInputError(f"must map strings to strings, got {key!r:.80}: {value!r:.80}", field=field_name)
    try:
        size = len(json.dumps(user_metadata).encode())
    except UnicodeError:  # e.g. a lone surrogate: no file can hold it
        raise InvalidInputError("must be text a file can store (no lone surrogates)", field=field_name) from None
    if size > MAX_USER_METADATA_BYTES:
        raise InvalidInputError(f"must be at most {MAX_USER_METADATA_BYTES} bytes as JSON, got {size}",
                                field=field_name)
    return dict(user_metadata)


MAX_AGE_RECIPIENTS = 10  # tinker's limit


def check_age_recipients(recipients: Any, field_name: str = "age_encryption_recipients") -> tuple[str, ...] | None:
    """tinker's save_weights_external: at most 10 age recipients, native `age1...` keys or SSH
    public keys (the server parses them; this checks their form)."""
    if recipients is None:
        return None
    if isinstance(recipients, str) or not isinstance(recipients, (list, tuple)) or not recipients \
            or len(recipients) > MAX_AGE_RECIPIENTS:
        raise InvalidInputError(f"must be a list of 1 to {MAX_AGE_RECIPIENTS} age recipients (age1... keys or SSH "
                                f"public keys), got {recipients!r:.80}", field=field_name)
    for i, r in enumerate(recipients):
        if not isinstance(r, str) or len(r) > 16384 or not r.startswith(("age1", "ssh-ed25519 ", "ssh-rsa ")):
            raise InvalidInputError(f"must be an age1... key or an SSH public key, got {r!r:.80}",
                                    field=f"{field_name}[{i}]")
    return tuple(recipients)


def check_save_extras(ttl_seconds: Any, user_metadata: Any) -> None:
    check_ttl(ttl_seconds)
    check_user_metadata(user_metadata)
