"""Shared helpers. Tests use real pools over the real built-in HF model: no mocks."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import trio_widgets as trio


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
    from trio_widgets.engine.models import auto_torch_threads

    torch.set_num_threads(auto_torch_threads())


@pytest.fixture
def pool():
    with trio.LocalPool(min_cycle_s=0.0, name="test") as p:
        yield p


@pytest.fixture(autouse=True)
def no_stray_clock_threads():
    """Every test must close what it opened: no clock or GIL-watchdog thread it started may outlive it."""
    before = set(threading.enumerate())
    yield
    stray = [t for t in threading.enumerate() if t.name.startswith(("trio-clock-", "trio-gil-")) and t.is_alive()
             and t not in before and not t.name.endswith("-default")]
    assert not stray, f"pool threads left running: {stray}"
