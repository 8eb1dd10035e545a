"""The signature comparison behind test_sdk_parity.py catches what breaks an SDK-style call,
and nothing else (it runs without the SDKs installed)."""

from __future__ import annotations

import inspect

from sdk_compare import signature_problems


def problems(sdk, ours) -> list[str]:
    return signature_problems(inspect.signature(sdk), inspect.signature(ours))


def test_compatible_supersets_pass():
    def sdk(data, loss_fn, loss_fn_config=None): ...
    def ours(data, loss_fn="cross_entropy", loss_fn_config=None, *, extra=1, **kw): ...
    def kwonly(optim_params=None, *, adam_params=None): ...
    def ours_kw(optim_params=None, adam_params=None): ...
    assert problems(sdk, ours) == [] and problems(kwonly, ours_kw) == []


def test_order_defaults_and_missing_parameters_are_caught():
    def sdk(base_model, model_path=None, retry=None, *, flag=False): ...
    def swapped(model_path=None, base_model=None, retry=None, *, flag=False): ...
    def no_default(base_model, model_path, retry=None, *, flag=False): ...
    def other_default(base_model, model_path=None, retry=None, *, flag=True): ...
    def missing(base_model, model_path=None): ...
    def extra_required(base_model, model_path=None, retry=None, *, flag=False, token): ...
    assert any("positional parameter 0 is 'base_model' in the SDK, 'model_path' here" in p
               for p in problems(sdk, swapped))
    assert problems(sdk, no_default) == ["model_path has a default (None) in the SDK but is required here"]
    assert problems(sdk, other_default) == ["flag defaults to False in the SDK, True here"]
    assert problems(sdk, missing) == ["no parameter 'retry'", "no keyword parameter 'flag'"]
    assert problems(sdk, extra_required) == ["requires 'token', which the SDK's calls do not pass"]


def test_return_kinds_are_read_off_the_annotations_and_mismatches_caught():
    """A value, a future or a client-future (a client that is a future of itself), and each as
    an awaitable for an `async def`: ours must give what SDK-style code expects."""
    from typing import NoReturn

    from sdk_compare import return_kind, same_return_kind

    class APIFuture: ...

    class SDK:
        def fb(self) -> APIFuture: ...
        async def fb_async(self) -> APIFuture: ...
        def make(self) -> BackcompatSamplingClientFuture: ...  # noqa: F821
        def info(self) -> types.GetInfoResponse: ...  # noqa: F821
        def rest(self) -> concurrent.futures._base.Future[None]: ...  # noqa: F821
        async def sample_async(self) -> SampleResponse: ...  # noqa: F821

    class Ours:
        def fb(self) -> APIFuture: ...
        def fb_async(self) -> APIFuture: ...  # not async: one await boundary too few
        def make(self) -> SamplingClient: ...  # noqa: F821 - a plain client where the SDK's is also a future
        def info(self) -> APIFuture[GetInfoResponse]: ...  # noqa: F821
        def rest(self) -> APIFuture[None]: ...  # noqa: F821
        async def sample_async(self) -> NoReturn: ...

    kinds = {n: (return_kind(SDK, n), return_kind(Ours, n)) for n in ("fb", "fb_async", "make", "info", "rest",
                                                                     "sample_async")}
    assert kinds == {"fb": ("future", "future"), "fb_async": ("awaitable of future", "future"),
                     "make": ("client-future", "value"), "info": ("value", "future"), "rest": ("future", "future"),
                     "sample_async": ("awaitable of value", None)}
    verdicts = {n: same_return_kind(*k) for n, k in kinds.items()}
    assert verdicts == {"fb": True, "fb_async": False, "make": False, "info": False, "rest": True,
                        "sample_async": True}
    # ours a client-future where the SDK gives the client (pytrio) or a future of it (tinker): both hold
    assert same_return_kind("value", "client-future") and same_return_kind("future", "client-future")
    assert same_return_kind("awaitable of value", "awaitable of client-future")
    assert not same_return_kind("client-future", "future") and not same_return_kind("value", "awaitable of value")
