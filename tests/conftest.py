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
    for i in range(n):
        size = length + (rng.randint(-length // 2, length // 2) if vary else 0)
        tokens = [rng.randrange(3, vocab) for _ in range(size + 1)]
        weights = [rng.uniform(0.5, 1.5) for _ in range(size)]
        batch.append(make_datum(tokens, weights))
    return batch


def adapter_weights(tc: trio.TrainingClient) -> dict[str, torch.Tensor]:
    adapter = tc._tenant.adapter
    return {f"{name}.{ab}": t.detach().clone() for name, pair in adapter.weights.items()
            for ab, t in zip("AB", pair)}


def close_to_1e5(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Max difference within 1e-5 of the gradient's scale (fp32 sums of O(10) values
    carry about 1e-6 of rounding per unit, so a bare 1e-5 would test the rounding)."""
    return float((actual - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))


@pytest.fixture
def pool():
    with trio.LocalPool(min_cycle_s=0.0, name="test") as p:
        yield p


@pytest.fixture(autouse=True)
def no_stray_clock_threads():
    """Every test must close what it opened: no clock thread it started may outlive it."""
    before = set(threading.enumerate())
    yield
    stray = [t for t in threading.enumerate() if t.name.startswith("trio-clock-") and t.is_alive()
             and t not in before and not t.name.endswith("-default")]
    assert not stray, f"clock threads left running: {stray}"
