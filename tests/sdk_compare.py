"""Programmatic comparison of trio-widgets with the installed hosted SDKs (tinker, pytrio).

`differences()` returns {key: what differs}; tests/test_sdk_parity.py requires every key to
be fixed or listed, with its reason. Keys are stable names, e.g.
`tinker:TrainingClient.optim_step` or `pytrio:types.SampleSequence.text`.

What "the same" means is what SDK-style code needs to run unchanged:

* a name the SDK exports exists here (top level, `types`, `errors`);
* a method accepts every call the SDK's accepts: each SDK positional parameter at the same
  position with the same name, each keyword parameter by name, a default wherever the SDK
  has one (and the same value when it is a plain value), extra parameters of ours only
  with defaults, `*args` / `**kwargs` where the SDK has them, and `async` where it is;
* a response type has every field, property and method of the SDK's;
* exception classes exist and keep the SDK's subclass relations.

* a method returns the same kind of thing (`return_kind`): a value, a future, or a client
  that is also a future of itself (tinker's Backcompat*ClientFuture, which stands for either),
  and, for an `async def`, an awaitable of one of those; read off the return annotations
  (both SDKs annotate every public method; ours do too).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_SIMPLE = (type(None), bool, int, float, str)


# -- members -----------------------------------------------------------------------------

def _field_names(cls: type) -> set[str]:
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    model_fields = getattr(cls, "model_fields", None)  # pydantic
    if isinstance(model_fields, dict):
        names |= set(model_fields)
    return names


def _pydantic_hooks(cls: type) -> set[str]:
    """Validators and serializers: pydantic calls them, users do not."""
    decorators = getattr(cls, "__pydantic_decorators__", None)
    names: set[str] = set()
    for attr in ("validators", "field_validators", "root_validators", "field_serializers",
                 "model_serializers", "model_validators"):
        names |= set(getattr(decorators, attr, None) or ())
    return names


_SELF_ATTR = re.compile(r"^\s*self\.([a-z]\w*)\s*(?::[^=]+)?=[^=]", re.M)


def _init_attributes(cls: type) -> set[str]:
    """Public instance attributes an `__init__` written in Python assigns (`self.x = ...`):
    clients keep e.g. `model_id` there, not on the class."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass.__module__ == "builtins" or klass.__module__.startswith("pydantic"):
            continue
        try:
            names |= set(_SELF_ATTR.findall(inspect.getsource(init)))
        except (OSError, TypeError):
            pass
    return names


def public_members(cls: type) -> dict[str, str]:
    """Public name -> "field" | "property" | "method" | "classmethod" | "staticmethod",
    as declared by `cls` or a base class that is not a plain builtin (or pydantic itself)."""
    out = {name: "field" for name in _field_names(cls) | _init_attributes(cls) if not name.startswith("_")}
    hooks = _pydantic_hooks(cls)
    for klass in reversed([k for k in cls.__mro__ if k.__module__ not in ("builtins", "abc", "typing")
                           and not k.__module__.startswith("pydantic")]):
        for name, value in vars(klass).items():
            if name in hooks or name == "model_config":
                continue
            if name.startswith("_") and name not in ("__await__", "__enter__", "__exit__", "__len__"):
                continue
            if isinstance(value, (property,)) or type(value).__name__ == "cached_property":
                out[name] = "property"
            elif isinstance(value, staticmethod):
                out[name] = "staticmethod"
            elif isinstance(value, classmethod):
                out[name] = "classmethod"
            elif callable(value):
                out[name] = "method"
            elif not name.startswith("_"):
                out.setdefault(name, "field")  # a class-level attribute or default
    return out


def _signature(cls: type, name: str) -> inspect.Signature | None:
    try:
        static = inspect.getattr_static(cls, name)
        fn = getattr(cls, name)
        sig = inspect.signature(fn)
    except (TypeError, ValueError, AttributeError):
        return None
    if not isinstance(static, (staticmethod, classmethod)):
        params = list(sig.parameters.values())[1:]  # self
        sig = sig.replace(parameters=params)
    return sig


def _is_async(cls: type, name: str) -> bool:
    fn = inspect.getattr_static(cls, name, None)
    fn = getattr(fn, "__func__", fn)
    return inspect.iscoroutinefunction(inspect.unwrap(fn)) if callable(fn) else False


_HEAD = re.compile(r"^(?:<class ')?([\w.]+)")


def _return_head(annotation: Any) -> str | None:
    """The outermost name of a return annotation: `APIFuture[types.X]` -> `APIFuture`,
    `concurrent.futures._base.Future[...]` -> `Future`, `<class 'pkg.SamplingClient'>` -> `SamplingClient`."""
    if annotation is _EMPTY:
        return None
    match = _HEAD.match((annotation if isinstance(annotation, str) else str(annotation)).strip("'\""))
    return match.group(1).rsplit(".", 1)[-1] if match else None


def return_kind(cls: type, name: str) -> str | None:
    """What calling `cls.name` gives: "value", "future" (APIFuture, concurrent.futures.Future,
    tinker's AwaitableConcurrentFuture), "client-future" (a client that is also a future of
    itself), each as "awaitable of ..." for an `async def`; None for what is not a method, has
    no return annotation, or never returns (the hosted-only names: NoReturn, they raise)."""
    fn = inspect.getattr_static(cls, name, None)
    fn = getattr(fn, "__func__", fn)
    if fn is None or isinstance(fn, property) or not callable(fn) or isinstance(fn, type):
        return None
    fn = inspect.unwrap(fn)
    head = _return_head(getattr(fn, "__annotations__", {}).get("return", _EMPTY))
    if head is None or head in ("NoReturn", "Never"):  # (a hosted-only name raises NotSupportedError)
        return None
    kind = ("client-future" if head.startswith("Backcompat") else "future" if head.endswith("Future")
            else "awaitable" if head in ("Awaitable", "Coroutine") else "value")
    return f"awaitable of {kind}" if inspect.iscoroutinefunction(fn) else kind


def same_return_kind(sdk: str | None, ours: str | None) -> bool:
    """Whether SDK-style code gets what it expects: the same kind, or our client-future where
    the SDK gives a client or a future (it is both)."""
    if sdk is None or ours is None or sdk == ours:
        return True
    prefix = "awaitable of "
    if sdk.startswith(prefix) != ours.startswith(prefix):
        return False
    return ours.removeprefix(prefix) == "client-future" and sdk.removeprefix(prefix) in ("value", "future")


# -- signatures --------------------------------------------------------------------------

def _same_default(a: Any, b: Any) -> bool:
    if a is b or repr(a) == "<factory>" or repr(b) == "<factory>":
        return True
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return getattr(a, "value", a) == getattr(b, "value", b)
    if isinstance(a, _SIMPLE) and isinstance(b, _SIMPLE):
        return (a is None) == (b is None) and isinstance(a, str) == isinstance(b, str) and a == b
    return type(a).__name__ == type(b).__name__  # e.g. SamplingParams() vs SamplingParams()


def _fmt(sig: inspect.Signature) -> str:
    return str(sig.replace(parameters=[p.replace(annotation=_EMPTY) for p in sig.parameters.values()],
                           return_annotation=_EMPTY))


def signature_problems(sdk: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """Why some call the SDK's signature accepts would fail (or mean something else) on ours."""
    problems: list[str] = []
    sdk_params = list(sdk.parameters.values())
    our_params = list(ours.parameters.values())
    our_by_name = {p.name: p for p in our_params}
    our_pos = [p for p in our_params if p.kind in _POSITIONAL]
    our_var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in our_params)
    our_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in our_params)
    matched: set[str] = set()

    def check_default(p: inspect.Parameter, q: inspect.Parameter | None) -> None:
        if p.default is _EMPTY or q is None:
            return
        if q.default is _EMPTY:
            problems.append(f"{p.name} has a default ({p.default!r}) in the SDK but is required here")
        elif not _same_default(p.default, q.default):
            problems.append(f"{p.name} defaults to {p.default!r} in the SDK, {q.default!r} here")

    for i, p in enumerate(p for p in sdk_params if p.kind in _POSITIONAL):
        q = our_pos[i] if i < len(our_pos) else None
        if q is not None and (p.kind is inspect.Parameter.POSITIONAL_ONLY or q.name == p.name):
            matched.add(q.name)
            check_default(p, q)
            continue
        if q is not None:
            problems.append(f"positional parameter {i} is {p.name!r} in the SDK, {q.name!r} here")
        named = our_by_name.get(p.name)
        if named is not None and named.kind is not inspect.Parameter.POSITIONAL_ONLY:
            matched.add(named.name)
            check_default(p, named)
            if q is None and not our_var_pos:
                problems.append(f"{p.name!r} cannot be passed by position here")
        elif q is None and not (our_var_pos and our_var_kw):
            problems.append(f"no parameter {p.name!r}")
    for p in sdk_params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            q = our_by_name.get(p.name)
            if q is not None and q.kind is not inspect.Parameter.POSITIONAL_ONLY:
                matched.add(q.name)
                check_default(p, q)
            elif not our_var_kw:
                problems.append(f"no keyword parameter {p.name!r}")
        elif p.kind is inspect.Parameter.VAR_POSITIONAL and not our_var_pos:
            problems.append(f"no *{p.name}")
        elif p.kind is inspect.Parameter.VAR_KEYWORD and not our_var_kw:
            problems.append(f"no **{p.name}")
    for q in our_params:
        if q.name not in matched and q.default is _EMPTY and q.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY):
            problems.append(f"requires {q.name!r}, which the SDK's calls do not pass")
    return problems


# -- the response types a client's methods return ------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][\w.]*")


def _data_class_fields(cls: type) -> list[Any]:
    model_fields = getattr(cls, "model_fields", None)
    if isinstance(model_fields, dict):
        return [f.annotation for f in model_fields.values()]
    if dataclasses.is_dataclass(cls):
        return [f.type for f in dataclasses.fields(cls)]
    return []


def response_types(clients: dict[str, type], package: str, namespaces: list[Any]) -> dict[str, tuple[type, set[str]]]:
    """Every data type of `package` that a public method of `clients` returns (inside a future,
    a list, a union...), and every data type their fields hold, by name: (the class, the
    `Client.method` names that reach it). Read off the annotations (strings or objects), each
    name looked up in `namespaces` (e.g. the SDK's `types` module, then the SDK)."""
    found: dict[str, tuple[type, set[str]]] = {}
    client_types = set(clients.values())

    def resolve(annotation: Any) -> list[type]:
        out = []
        for ident in _IDENT.findall(annotation if isinstance(annotation, str) else str(annotation)):
            name = ident.rsplit(".", 1)[-1]
            for ns in namespaces:
                obj = getattr(ns, name, None)
                if isinstance(obj, type) and obj.__module__.split(".")[0] == package and obj not in client_types \
                        and (hasattr(obj, "model_fields") or dataclasses.is_dataclass(obj)):
                    out.append(obj)
                    break
        return out

    def visit(cls: type, via: str) -> None:
        seen = cls.__name__ in found
        found.setdefault(cls.__name__, (cls, set()))[1].add(via)
        if not seen:
            for annotation in _data_class_fields(cls):
                for inner in resolve(annotation):
                    visit(inner, via)

    for client_name, client in clients.items():
        for name in dir(client):
            fn = inspect.getattr_static(client, name, None)
            fn = getattr(fn, "__func__", fn)
            if name.startswith("_") or fn is None or isinstance(fn, property) or not callable(fn):
                continue
            annotation = getattr(inspect.unwrap(fn), "__annotations__", {}).get("return", _EMPTY)
            if annotation is not _EMPTY:
                for cls in resolve(annotation):
                    visit(cls, f"{client_name}.{name}")
    return found


# -- comparisons ---------------------------------------------------------------------------

def compare_class(key: str, sdk_cls: type, our_cls: type | None, *, constructor: bool = False,
                  skip: Iterable[str] = ()) -> dict[str, str]:
    """Members of `sdk_cls` missing on `our_cls`, or differing in kind or signature."""
    if our_cls is None:
        return {key: "missing"}
    diffs: dict[str, str] = {}
    ours = public_members(our_cls)
    skip = set(skip)
    if constructor:
        problems = signature_problems(inspect.signature(sdk_cls), inspect.signature(our_cls))
        if problems:
            diffs[f"{key}()"] = (f"SDK {_fmt(inspect.signature(sdk_cls))} vs ours "
                                 f"{_fmt(inspect.signature(our_cls))}: " + "; ".join(problems))
    for name, kind in public_members(sdk_cls).items():
        if name in skip:
            continue
        where = f"{key}.{name}"
        if name not in ours:
            diffs[where] = f"missing ({kind} in the SDK)"
            continue
        if kind in ("field", "property"):
            if ours.get(name) in ("method", "classmethod", "staticmethod"):
                diffs[where] = f"a {ours[name]} here, a {kind} in the SDK"
            continue
        if ours.get(name) in ("field", "property"):
            diffs[where] = f"a {ours[name]} here, a {kind} in the SDK"
            continue
        sdk_sig, our_sig = _signature(sdk_cls, name), _signature(our_cls, name)
        if sdk_sig is None or our_sig is None:
            continue
        problems = signature_problems(sdk_sig, our_sig)
        if _is_async(sdk_cls, name) != _is_async(our_cls, name):
            problems.append("async in the SDK, not here" if _is_async(sdk_cls, name) else "async here, not in the SDK")
        sdk_kind, our_kind = return_kind(sdk_cls, name), return_kind(our_cls, name)
        if not same_return_kind(sdk_kind, our_kind):
            problems.append(f"returns a {sdk_kind} in the SDK, a {our_kind} here")
        if problems:
            diffs[where] = f"SDK {_fmt(sdk_sig)} vs ours {_fmt(our_sig)}: " + "; ".join(problems)
    return diffs


def compare_names(key: str, sdk_names: Iterable[str], has: Callable[[str], bool]) -> dict[str, str]:
    return {f"{key}.{n}": "missing" for n in sorted(sdk_names) if not has(n)}


def compare_exceptions(key: str, sdk_classes: dict[str, type], ours: Callable[[str], Any]) -> dict[str, str]:
    diffs: dict[str, str] = {}
    for name, cls in sdk_classes.items():
        mine = ours(name)
        if not (isinstance(mine, type) and issubclass(mine, BaseException)):
            diffs[f"{key}.{name}"] = "missing"
            continue
        for base_name, base in sdk_classes.items():
            if base is not cls and issubclass(cls, base):
                my_base = ours(base_name)
                if isinstance(my_base, type) and not issubclass(mine, my_base):
                    diffs[f"{key}.{name}<{base_name}"] = f"{name} is a {base_name} in the SDK, not here"
    return diffs
