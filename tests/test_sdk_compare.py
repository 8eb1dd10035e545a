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
