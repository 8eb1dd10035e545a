"""Numerics against independent references: PEFT's LoRA for gradients, torch's AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_batch
from numerics import assert_fp32_close, model_terms, tiny_config
from transports import adapter_of

import trio_widgets as trio
from trio_widgets.engine.compute import make_forward_job, run_forward_jobs
from trio_widgets.engine.lora import LORA_ALPHA, LoRAAdapter
from trio_widgets.engine.models import DEFAULT_MODEL, _build_builtin, load_base_model

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _peft_model(plain: torch.nn.Module, adapter: LoRAAdapter) -> torch.nn.Module:
    config = peft.LoraConfig(r=adapter.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                             bias="none")
    model = peft.get_peft_model(copy.deepcopy(plain), config)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, (lora_a, lora_b) in adapter.weights.items():
            named[f"base_model.model.{name}.lora_A.default.weight"].copy_(lora_a)
            named[f"base_model.model.{name}.lora_B.default.weight"].copy_(lora_b)
    return model


def _peft_grads(model, adapter: LoRAAdapter, batch: list[trio.Datum]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    model.zero_grad()
    for datum in batch:  # one sequence at a time: no packing, no padding
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
        weights = torch.tensor(datum.loss_fn_inputs["weights"].data)
        logits = model(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]
        (-(weights * logp).sum()).backward()
    named = dict(model.named_parameters())
    return {name: (named[f"base_model.model.{name}.lora_A.default.weight"].grad,
                   named[f"base_model.model.{name}.lora_B.default.weight"].grad) for name in adapter.weights}


@pytest.mark.parametrize("ranks", [[4, 8, 2], [8]], ids=["three tenants", "one tenant"])
def test_packed_multi_adapter_gradients_match_peft(ranks):
    device = torch.device("cpu")
    base = load_base_model(DEFAULT_MODEL, device)
    plain, _ = _build_builtin(DEFAULT_MODEL, torch.float32)  # the same weights, unwrapped
    targets = base.targets_for(True, True, True)
    adapters, batches = [], []
    for t, rank in enumerate(ranks):
        adapter = LoRAAdapter(targets, rank, seed=100 + t, device=device)
        with torch.no_grad():  # non-zero B so that every A and B gets a gradient
            g = torch.Generator().manual_seed(t)
            for _, lora_b in adapter.weights.values():
                lora_b.copy_(torch.randn(lora_b.shape, generator=g) * 0.05)
        adapters.append(adapter)
        batches.append(random_batch(500 + t, n=3, length=20, vary=True))
    jobs = [(a, make_forward_job(base, b, "cross_entropy", {}, backward=True)[0], f"t{i}")
            for i, (a, b) in enumerate(zip(adapters, batches))]
    outcomes = run_forward_jobs(base, jobs, token_budget=4096)
    assert not any(isinstance(o, BaseException) for o in outcomes)
    for adapter, batch in zip(adapters, batches):
        reference = _peft_grads(_peft_model(plain, adapter), adapter, batch)
        terms = model_terms(tiny_config(), max(d.model_input.length for d in batch),
                            batch_tokens=sum(d.model_input.length for d in batch))
        for name, (ga, gb) in adapter.grad.items():
            ref_a, ref_b = reference[name]
            assert float(ref_a.abs().max()) > 0 and float(ref_b.abs().max()) > 0
            assert_fp32_close(ga, ref_a, terms, f"{name}.lora_A gradient vs PEFT")
            assert_fp32_close(gb, ref_b, terms, f"{name}.lora_B gradient vs PEFT")


def test_adamw_matches_torch_with_changing_hyperparameters():
    device = torch.device("cpu")
    adapter = LoRAAdapter({"layer": (6, 5)}, rank=3, seed=0, device=device)
    reference = [t.detach().clone().requires_grad_(True) for t in adapter.weights["layer"]]
    schedule = [trio.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
                trio.AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0),
                trio.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01)]
    opt = torch.optim.AdamW(reference, lr=1.0)
    g = torch.Generator().manual_seed(0)
    for step in range(9):
        params = schedule[step % 3]
        grads = (torch.randn(3, 6, generator=g), torch.randn(5, 3, generator=g))
        adapter.accumulate({"layer": grads})
        adapter.adamw_step(params)
        for group in opt.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        for p, grad in zip(reference, grads):
            p.grad = grad.clone()
        opt.step()
        # Each AdamW update is ~10 roundings of size max(|w|, lr) (moments, bias corrections,
        # sqrt, division, decay), in another order than torch's; they add up over the steps.
        for mine, theirs in zip(adapter.weights["layer"], reference):
            assert_fp32_close(mine, theirs.detach(), 10 * (step + 1), f"AdamW step {step + 1}")


def test_grad_clip_clips_only_that_tenant():
    device = torch.device("cpu")
    grads = {"layer": (torch.full((2, 4), 3.0), torch.full((4, 2), 4.0))}
    norm = (8 * 9 + 8 * 16) ** 0.5
    clipped = LoRAAdapter({"layer": (4, 4)}, rank=2, seed=0, device=device)
    free = LoRAAdapter({"layer": (4, 4)}, rank=2, seed=0, device=device)
    scaled = LoRAAdapter({"layer": (4, 4)}, rank=2, seed=0, device=device)
    clipped.accumulate(grads)
    free.accumulate(grads)
    scaled.accumulate({"layer": tuple(g * (2.0 / (norm + 1e-6)) for g in grads["layer"])})
    params = dict(learning_rate=0.1, beta1=0.0, beta2=0.0, eps=1e-3)
    out = clipped.adamw_step(trio.AdamParams(grad_clip_norm=2.0, **params))
    free.adamw_step(trio.AdamParams(**params))
    scaled.adamw_step(trio.AdamParams(**params))
    # a norm over 16 entries: 16 squares summed, one sqrt
    assert_fp32_close(out["grad_norm:mean"], norm, 17, "grad norm", magnitude=norm ** 2)
    # With beta2 = 0 Adam divides g by |g| + eps, so clipping changes the step only through eps;
    # the clipped and the pre-scaled gradients differ by the rounding of one multiplication,
    # and the updates by that and AdamW's ~10 roundings.
    for c, s, f in zip(clipped.weights["layer"], scaled.weights["layer"], free.weights["layer"]):
        assert_fp32_close(c, s, 11, "clipped vs pre-scaled")
        assert float((c - f).abs().max()) > 1e-4  # eps = 1e-3 against |g| ~ 0.1 vs 3: a real difference


def test_overflowing_step_changes_nothing():
    """A step whose new weights overflow raises, and leaves weights, moments and the pending
    gradient bitwise as they were; the next sane step then runs from that state."""
    adapter = LoRAAdapter({"layer": (4, 4)}, rank=2, seed=0, device=torch.device("cpu"))
    adapter.accumulate({"layer": (torch.full((2, 4), 0.5), torch.full((4, 2), -0.5))})
    adapter.adamw_step(trio.AdamParams(learning_rate=0.1))
    with torch.no_grad():
        adapter.weights["layer"][1].fill_(3.0e38)  # one more step of +lr overflows float32
    adapter.accumulate({"layer": (torch.full((2, 4), 1.0), torch.full((4, 2), -1.0))})
    before = [t.clone() for t in (adapter.flat, adapter._grad, *adapter.adam.flat)]
    with pytest.raises(FloatingPointError, match="non-finite"):
        adapter.adamw_step(trio.AdamParams(learning_rate=1e38))
    after = [adapter.flat, adapter._grad, *adapter.adam.flat]
    assert all(torch.equal(b, a) for b, a in zip(before, after)) and adapter.adam.step == 1
    adapter.adamw_step(trio.AdamParams(learning_rate=0.1))
    assert adapter.adam.step == 2 and bool(torch.isfinite(adapter.flat).all())


def test_learning_rate_change_between_steps_is_honoured(pool, svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=3)
    batch = random_batch(8, n=1, length=10)
    deltas = []
    for lr in (1e-3, 1e-2):
        before = {k: w for k, w in adapter_of(svc, pool, tc).items() if k.endswith("lora_B")}
        tc.forward_backward(batch).result(timeout=60)
        tc.optim_step(trio.AdamParams(learning_rate=lr, beta1=0.0, beta2=0.0, eps=1e-30)).result(timeout=60)
        # beta = 0: each element moves by exactly lr * sign(grad) (where the gradient is non-zero)
        after = adapter_of(svc, pool, tc)
        deltas.append(max(float((after[k] - w).abs().max()) for k, w in before.items()))
    # B starts at 0 and holds at most 1e-3 + 1e-2, so w + Δ rounds by at most ulp(0.011) ≈ 1e-9:
    # relative 1e-6 of the smaller lr; 1e-4 leaves room for the division's own rounding.
    assert deltas[0] == pytest.approx(1e-3, rel=1e-4) and deltas[1] == pytest.approx(1e-2, rel=1e-4)
