"""Shared helpers. Tests use real pools over the real built-in HF model: no mocks."""

from __future__ import annotations

import os
import random
import re
import threading

import pytest
import torch
from served import SharedFleet
from transports import TRANSPORTS, service

import trio_widgets as trio

#: Python run first in a subprocess that must behave as if torch were not installed (the core
#: install): the path finder finds nothing by its names, so imports fail with
#: ModuleNotFoundError and importlib.util.find_spec answers None.
HIDE_TORCH = """
import importlib.machinery, sys
# torch as if not installed: the path finder finds nothing by its names, so imports fail with
# ModuleNotFoundError and importlib.util.find_spec answers None (how transformers asks)
class _NoTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "peft"):
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_NoTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def make_datum(tokens: list[int], weights: list[float] | None = None) -> trio.Datum:
    inputs: dict = {"target_tokens": tokens[1:]}
    if weights is not None:
        inputs["weights"] = weights
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def random_batch(seed: int, n: int = 2, length: int = 33, vocab: int = 259, vary: bool = False) -> list[trio.Datum]:
    rng = random.Random(seed)
    batch = []
    for _ in range(n):
        size = length + (rng.randint(-length // 2, length // 2) if vary else 0)
        tokens = [rng.randrange(3, vocab) for _ in range(size + 1)]
        weights = [rng.uniform(0.5, 1.5) for _ in range(size)]
        batch.append(make_datum(tokens, weights))
    return batch


def adapter_weights(tc: trio.TrainingClient) -> dict[str, torch.Tensor]:
    """`name.lora_A` / `name.lora_B` -> a copy, as of the requests submitted so far."""
    return tc.inspect_adapter().result(timeout=120).state_dict()


def pytest_configure(config):
    """Numeric tests must hold at any thread count (sums split across threads add in another
    order): `make test` runs them at TRIO_TORCH_THREADS=1 and again at 2. Pools read the
    variable too (torch_threads="auto"); tests that drive the engine directly get it here."""
    from trio_widgets.engine.models import ALLOW_DOWNLOAD_ENV, auto_torch_threads

    torch.set_num_threads(auto_torch_threads())
    # Tests never reach the Hugging Face Hub because of a developer's shell setting; the ones
    # about downloads set it themselves (tests/test_downloads.py).
    os.environ.pop(ALLOW_DOWNLOAD_ENV, None)


def write_peft_adapter(path, target_modules: list[str], rank: int, alpha: float, seed: int,
                       b_scale: float) -> str:
    """A LoRA adapter for DEFAULT_MODEL written by the peft library itself, with random non-zero
    B (so alpha matters and every A gets a gradient from the first step)."""
    import json

    import peft

    from trio_widgets.engine.models import _build_builtin

    plain, _ = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=target_modules)
    model = peft.get_peft_model(plain, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * b_scale)
    model.save_pretrained(path, save_embedding_layers=False)  # only the LoRA pairs
    config_file = path / "adapter_config.json"
    saved = json.loads(config_file.read_text())
    saved["base_model_name_or_path"] = trio.DEFAULT_MODEL  # the pool resolves the base by this name
    config_file.write_text(json.dumps(saved))
    return str(path)


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request) -> str:
    """The codec a client-facing test reaches its pool through, once per entry of
    tests/transports.py's TRANSPORTS (in-process, Tinker's wire over HTTP; a third codec is one
    more entry there). `transports.service(transport, pool)` is a ServiceClient through it.
    Module-scoped, so a module's shared clients can be built once per codec."""
    return request.param


_FLEET = SharedFleet()


@pytest.fixture
def fleet(tmp_path_factory):
    """A fleet of two pools on a local Ray instance (`serve --ray` in its own process), shared by
    every test that asks for it (tests/served.py's SharedFleet, with its keys)."""
    return _FLEET.get(tmp_path_factory)


def _uses_fleet(item) -> bool:
    return "fleet" in getattr(item, "fixturenames", ())


#: Under pytest-xdist (`make test` runs the tests not marked `alone` on 2 workers), this process
#: runs whole groups of tests (`_group`), each in order, and nothing of the others.
_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def _group(nodeid: str) -> str:
    """The tests one xdist worker runs together, in order: a module's (its module fixtures are
    built once); every module named test_fleet* (a local Ray instance beside another would cost
    ~40 s of both cores; those that start Ray are `alone` under `make test`, run serially after
    the others); the other browser modules (one JupyterLab, one Chromium: tests/browser/conftest.py)."""
    module = nodeid.split("::")[0]
    name = module.rsplit("/", 1)[-1]
    return "fleet" if name.startswith("test_fleet") else "browser" if "/browser/" in module else module


def pytest_xdist_make_scheduler(config, log):
    """`_group` as pytest-xdist's scope. (Its own `--dist loadgroup` renames items' node ids,
    which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class _Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return _Groups(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _uses_fleet(item) and not item.path.name.startswith("test_fleet"):
            raise pytest.UsageError(f"{item.nodeid} uses the shared `fleet`: its module's name must start with "
                                    "test_fleet, so that one xdist worker runs every such module (conftest._group)")
        if _uses_fleet(item) and item.get_closest_marker("alone") is None:
            raise pytest.UsageError(f"{item.nodeid} uses the shared `fleet`: mark its module `alone`, as every "
                                    "such module, so that the fleet starts once and its cycles are read with "
                                    "nothing beside them")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses `fleet` (its own fixtures torn down): the fleet stops, cleanly.
    An xdist worker runs its group's tests one after another, and no other's."""
    result = yield
    if _uses_fleet(item):
        later = item.session.items[item.session.items.index(item) + 1:] if nextitem is not None else []
        if _WORKER:
            later = [other for other in later if _group(other.nodeid) == _group(item.nodeid)]
        if not any(_uses_fleet(other) for other in later):
            _FLEET.stop()
    return result


def pytest_sessionfinish(session, exitstatus):
    """A run stopped before the last test that uses `fleet` (-x, Ctrl-C): the fleet stops with it."""
    try:
        _FLEET.stop()
    except AssertionError as exc:  # (its clean stop is checked after the last test that uses it)
        print(f"\n{exc}")


@pytest.fixture
def pool():
    with trio.LocalPool(min_cycle_s=0.0, name="test") as p:
        yield p


@pytest.fixture
def svc(pool, transport):
    """A ServiceClient of `pool` through each codec (a module with pools of its own overrides it)."""
    with service(transport, pool) as s:
        yield s


@pytest.fixture(autouse=True)
def no_stray_clock_threads():
    """Every test must close what it opened: no clock, GIL-watchdog, server, HTTP-client or
    remote-dashboard thread it started may outlive it (a module's server fixture starts first)."""
    before = set(threading.enumerate())
    yield
    stray = [t for t in threading.enumerate()
             if t.name.startswith(("trio-clock-", "trio-gil-", "trio-serve", "trio-http", "trio-remote"))
             and t.is_alive() and t not in before and not t.name.endswith("-default")
             and not re.fullmatch(r"trio-serve-.*_\d+", t.name)]  # a server's workers start on first use
    assert not stray, f"threads left running: {stray}"
