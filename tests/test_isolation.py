"""Tenants packed into one pass get exactly what they would get alone."""

from __future__ import annotations

import math

import pytest
import torch

import trio_widgets as trio
from conftest import adapter_weights, random_batch

TENANTS = [  # seed, rank, learning rate, flags
    dict(seed=11, rank=4, lr=3e-3, flags={}),
    dict(seed=22, rank=8, lr=1e-3, flags={"train_unembed": False}),
    dict(seed=33, rank=16, lr=5e-3, flags={"train_attn": False}),
    dict(seed=44, rank=2, lr=2e-3, flags={"train_mlp": False}),
]
STEPS = 10


def batches_for(t: int) -> list[list[trio.Datum]]:
    # Different lengths per tenant and per datum exercise the varlen packing.
    return [random_batch(1000 * t + s, n=2, length=12 + 5 * t, vary=True) for s in range(STEPS)]


def train(pool: trio.LocalPool, which: list[int]) -> dict[int, tuple[list[float], dict]]:
    service = trio.ServiceClient(pool)
    clients = {t: service.create_lora_training_client(
        trio.DEFAULT_MODEL, rank=TENANTS[t]["rank"], seed=TENANTS[t]["seed"], **TENANTS[t]["flags"]) for t in which}
    data = {t: batches_for(t) for t in which}
    losses: dict[int, list[float]] = {t: [] for t in which}
    for step in range(STEPS):
        with pool.hold():  # all tenants in the same cycle
            futures = {t: (clients[t].forward_backward(data[t][step], "cross_entropy"),
                           clients[t].optim_step(trio.AdamParams(learning_rate=TENANTS[t]["lr"])))
                       for t in which}
        cycles = set()
        for t, (fb, opt) in futures.items():
            losses[t].append(fb.result(timeout=120).metrics["loss:sum"])
            opt.result(timeout=120)
            cycles.add(fb.cycle)
        assert len(cycles) == 1
    return {t: (losses[t], adapter_weights(clients[t])) for t in which}


def test_four_tenants_match_solo_runs():
    with trio.LocalPool(min_cycle_s=0.0, name="joint") as pool:
        joint = train(pool, [0, 1, 2, 3])
    for t in range(4):
        with trio.LocalPool(min_cycle_s=0.0, name=f"solo-{t}") as pool:
            solo = train(pool, [t])[t]
        joint_losses, joint_weights = joint[t]
        assert joint_losses[-1] < joint_losses[0]  # it trained
        for a, b in zip(joint_losses, solo[0]):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), (t, joint_losses, solo[0])
        assert joint_weights.keys() == solo[1].keys()
        for name, w in joint_weights.items():
            torch.testing.assert_close(w, solo[1][name], atol=1e-5, rtol=0, msg=f"tenant {t} {name}")
        moved = sum(float((w - 0).abs().sum()) for n, w in joint_weights.items() if n.endswith(".B"))
        assert moved > 0


def test_flags_choose_the_wrapped_layers(pool):
    service = trio.ServiceClient(pool)
    only_attn = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0, train_mlp=False,
                                                    train_unembed=False)
    names = only_attn._tenant.adapter.weights.keys()
    assert names and all("self_attn" in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    every = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    assert "lm_head" in every._tenant.adapter.weights
    assert any(n.endswith("mlp.down_proj") for n in every._tenant.adapter.weights)


def test_same_seed_same_init_different_seed_different(pool):
    service = trio.ServiceClient(pool)
    a, b, c = (service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=s) for s in (5, 5, 6))
    wa, wb, wc = adapter_weights(a), adapter_weights(b), adapter_weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.A"], wc["lm_head.A"])
    assert all(float(v.abs().sum()) == 0 for k, v in wa.items() if k.endswith(".B"))


@pytest.mark.parametrize("budget", [7, 40])
def test_micro_batches_give_the_same_gradient(budget):
    """A cycle cut into micro-batches by the token budget accumulates the same gradient."""
    grads = {}
    for b in (budget, 100_000):
        with trio.LocalPool(min_cycle_s=0.0, max_tokens_per_pass=b, name=f"mb-{b}") as pool:
            tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9)
            with torch.no_grad():  # non-zero B so that A gets a gradient too
                for _, lora_b in tc._tenant.adapter.weights.values():
                    lora_b.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
            tc.forward_backward(random_batch(77, n=5, length=12, vary=True)).result(timeout=60)
            grads[b] = {n: (ga.clone(), gb.clone()) for n, (ga, gb) in tc._tenant.adapter.grad.items()}
    for name, (ga, gb) in grads[budget].items():
        torch.testing.assert_close(ga, grads[100_000][name][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(gb, grads[100_000][name][1], atol=1e-6, rtol=1e-5)
