"""Every built-in loss against an independent computation (values with numpy, gradients via PEFT)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from numerics import assert_fp32_close, model_terms, tiny_config
from test_gradients import _peft_model
from transports import inspect

import trio_widgets as trio
from trio_widgets.engine.compute import make_forward_job, run_forward_jobs
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import DEFAULT_MODEL, _build_builtin, load_base_model


def rl_batch(seed: int, n: int = 2) -> list[trio.Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.randint(6, 14)
        tokens = [rng.randrange(3, 259) for _ in range(size + 1)]
        out.append(trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [rng.uniform(0.2, 1.0) for _ in range(size)],
            # sampler logprobs near the model's (about -5.5 for an untrained byte model)
            "logprobs": np.array([-5.55 + rng.uniform(-0.4, 0.4) for _ in range(size)], dtype=np.float32),
            "advantages": torch.tensor([rng.uniform(-1, 1) for _ in range(size)]),
            # gspo's ratio runs over the sampled tokens: the first third stands for the prompt
            "sequence_ratio_mask": [0] * (size // 3) + [1] * (size - size // 3),
        }))
    return out


def reference_loss(name: str, logp, d: dict, config: dict):
    """Written from the Tinker docs, independently of trio_widgets.engine.losses; works for numpy and torch."""
    lib = torch if isinstance(logp, torch.Tensor) else np
    target_q, adv = d.get("logprobs"), d.get("advantages")
    if name == "cross_entropy":
        return (-(d["weights"] * logp)).sum()
    ratio = lib.exp(logp - target_q)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    clip = torch.clamp(ratio, lo, hi) if lib is torch else np.clip(ratio, lo, hi)
    if name == "importance_sampling":
        return (-ratio * adv).sum()
    if name == "ppo":
        return (-lib.minimum(ratio * adv, clip * adv)).sum()
    if name == "cispo":
        clip = clip.detach() if lib is torch else clip
        return (-(clip * logp * adv)).sum()
    if name == "dro":
        beta = config.get("beta", 0.05)
        return (-(logp * adv - 0.5 * beta * (logp - target_q) ** 2)).sum()
    if name == "gspo":  # GSPO-token: sg[s] * p / sg[p], s the geometric-mean ratio over the mask
        marked = d["sequence_ratio_mask"] != 0
        if lib is torch:
            s = torch.exp((logp.detach() - target_q)[marked].mean())
            ratio = s * torch.exp(logp - logp.detach())
            clip = torch.clamp(ratio, lo, hi)
        else:
            ratio = np.full_like(logp, np.exp(np.mean((logp - target_q)[marked])))
            clip = np.clip(ratio, lo, hi)
        return (-lib.minimum(ratio * adv, clip * adv)).sum()
    raise AssertionError(name)


CONFIG = tiny_config()


def loss_magnitude(logp: np.ndarray, d: dict, loss_fn: str) -> float:
    """Σ over tokens of |logp|·|∂loss/∂logp|, bounded for all five token-wise losses: a rounding
    error of relative size e in each logp moves the loss by at most e times this. (∂/∂logp is w
    for cross_entropy; ratio·adv for importance_sampling and ppo; clip·adv for cispo;
    adv + beta·|logp − q| for dro; ratio ≤ e^|logp − q|, clip ≤ 1.2.)

    gspo couples the tokens: its value -Σ_t min(s·A_t, clip(s)·A_t) depends on each marked
    logp_u only through s = exp(mean_M(logp − q)), so ∂loss/∂logp_u ≤ s·Σ|A|/|M| and the sum is
    at most s·Σ|A|·max_M|logp|; each of its terms is at most (s + 1.2)·|A_t|, and
    s ≤ exp(mean_M |logp − q|)."""
    if loss_fn == "gspo":
        marked = d["sequence_ratio_mask"] != 0
        s = np.exp(np.mean(np.abs(logp - d["logprobs"])[marked]))
        return float((1.2 + s) * np.sum(np.abs(d["advantages"])) * (1.0 + np.max(np.abs(logp[marked]))))
    ratio = np.exp(np.abs(logp - d["logprobs"])) if "logprobs" in d else 1.0
    w = np.abs(d.get("weights", 0.0)) + np.abs(d.get("advantages", 0.0)) * (1.2 + ratio) + 0.3 * np.abs(logp)
    return float(np.sum(np.abs(logp) * w))


CASES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
         ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}), ("cispo", None),
         ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}), ("dro", None), ("dro", {"beta": 0.3}),
         ("gspo", None), ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})]


@pytest.fixture(scope="module")
def models():
    device = torch.device("cpu")
    return load_base_model(DEFAULT_MODEL, device), _build_builtin(DEFAULT_MODEL, torch.float32)[0]


@pytest.mark.parametrize("loss_fn,config", CASES)
def test_loss_value_and_gradient(models, loss_fn, config):
    base, plain = models
    adapter = LoRAAdapter(base.targets_for(True, True, True), rank=4, seed=1, device=base.device)
    with torch.no_grad():
        for _, lora_b in adapter.weights.values():
            lora_b.copy_(torch.randn(lora_b.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    batch = rl_batch(hash((loss_fn, str(config))) % 1000)
    from trio_widgets.engine.losses import resolved_config

    job, _ = make_forward_job(base, batch, loss_fn, resolved_config(loss_fn, config), backward=True)
    (out,) = run_forward_jobs(base, [(adapter, job, "t")], token_budget=4096)
    assert isinstance(out, trio.ForwardBackwardOutput), out

    model = _peft_model(plain, adapter)
    model.zero_grad()
    expected_total = total_magnitude = 0.0
    tokens = sum(d.model_input.length for d in batch)
    longest = max(d.model_input.length for d in batch)
    for datum, outputs in zip(batch, out.loss_fn_outputs):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1).gather(1, targets[:, None])[:, 0]
        inputs = {k: torch.tensor(v.data) for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}
        loss = reference_loss(loss_fn, logp, inputs, config or {})
        loss.backward()
        np_inputs = {k: np.asarray(v.data, dtype=np.float64) for k, v in datum.loss_fn_inputs.items()}
        np_loss = reference_loss(loss_fn, logp.detach().double().numpy(), np_inputs, config or {})
        expected_total += float(np_loss)
        n = datum.model_input.length
        assert_fp32_close(outputs["logprobs"].to_numpy(), logp.detach().numpy(), model_terms(CONFIG, n),
                          f"{loss_fn} logprobs")
        magnitude = loss_magnitude(logp.detach().double().numpy(), np_inputs, loss_fn)
        total_magnitude += magnitude
        assert_fp32_close(float(outputs["elementwise_loss"].to_numpy().sum()), float(np_loss),
                          model_terms(CONFIG, n) + n, f"{loss_fn} loss of one datum", magnitude=magnitude)
    assert_fp32_close(out.metrics["loss:sum"], expected_total, model_terms(CONFIG, longest) + tokens,
                      f"{loss_fn} loss:sum", magnitude=total_magnitude)
    named = dict(model.named_parameters())
    for name, (ga, gb) in adapter.grad.items():
        ref_a = named[f"base_model.model.{name}.lora_A.default.weight"].grad
        ref_b = named[f"base_model.model.{name}.lora_B.default.weight"].grad
        terms = model_terms(CONFIG, longest, batch_tokens=tokens)
        assert_fp32_close(ga, ref_a, terms, f"{loss_fn} {name}.lora_A gradient")
        assert_fp32_close(gb, ref_b, terms, f"{loss_fn} {name}.lora_B gradient")


def test_custom_loss_gradient_equals_builtin(pool, svc):
    """forward_backward_custom with the cross-entropy written by hand gives the built-in's gradient."""
    builtin, custom = (svc.create_lora_training_client(DEFAULT_MODEL, rank=4, seed=7) for _ in range(2))
    batch = rl_batch(3)

    def my_ce(data, logprobs):
        total = sum(-(torch.tensor(d.loss_fn_inputs["weights"].data) * lp).sum() for d, lp in zip(data, logprobs))
        return total, {"tokens:sum": float(sum(len(lp) for lp in logprobs))}

    a = builtin.forward_backward(batch, "cross_entropy")
    b = custom.forward_backward_custom(batch, my_ce)
    ra, rb = a.result(timeout=60), b.result(timeout=60)
    tokens = sum(d.model_input.length for d in batch)
    longest = max(d.model_input.length for d in batch)
    magnitude = sum(float(o["elementwise_loss"].to_torch().abs().sum()) for o in ra.loss_fn_outputs)
    assert_fp32_close(rb.metrics["loss:sum"], ra.metrics["loss:sum"], model_terms(CONFIG, longest) + tokens,
                      "custom loss:sum", magnitude=magnitude)
    assert rb.metrics["tokens:sum"] == tokens
    builtin_grad = inspect(svc, pool, builtin).grad_dict()
    custom_grad = inspect(svc, pool, custom).grad_dict()
    for key, g in builtin_grad.items():
        assert_fp32_close(custom_grad[key], g, model_terms(CONFIG, longest, batch_tokens=tokens), f"custom {key}")


def test_forward_has_no_side_effects(pool, svc):
    tc = svc.create_lora_training_client(DEFAULT_MODEL, rank=4, seed=7)
    out = tc.forward(rl_batch(4), "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0 and inspect(svc, pool, tc).grad is None


def test_gspo_sequence_ratio_properties():
    """Properties that follow from the GSPO-token definition alone: on-policy (q = logp) the
    ratio is 1, so the gradient is -A as for importance sampling; the sampler logprobs of
    tokens outside the mask do not matter; an empty mask is refused before a cycle."""
    from trio_widgets.engine.losses import LOSSES, check_loss_inputs, resolved_config

    config = resolved_config("gspo", None)
    logp = torch.tensor([-2.0, -1.0, -3.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.25])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    inputs = {"logprobs": logp.detach().clone(), "advantages": adv, "sequence_ratio_mask": mask}
    LOSSES["gspo"](logp, inputs, config).sum().backward()
    assert torch.equal(logp.grad, -adv)
    moved = dict(inputs, logprobs=inputs["logprobs"] + torch.tensor([5.0, 0.0, 0.0, 0.0]))
    assert torch.equal(LOSSES["gspo"](logp, moved, config), LOSSES["gspo"](logp, inputs, config))
    check_loss_inputs("gspo", inputs)
    with pytest.raises(ValueError, match=r"sequence_ratio_mask'\] marks no token"):
        check_loss_inputs("gspo", dict(inputs, sequence_ratio_mask=torch.zeros(4)))
    assert torch.isnan(LOSSES["gspo"](logp, dict(inputs, sequence_ratio_mask=torch.zeros(4)), config)).all()


def test_loss_names_fold_case_and_hosted_only_losses_are_refused_with_the_reason():
    from trio_widgets.engine.losses import normalise_loss_name

    assert [normalise_loss_name(n) for n in (" PPO ", "Cross_Entropy", "gspo", "DRO")] == \
        ["ppo", "cross_entropy", "gspo", "dro"]
    with pytest.raises(ValueError, match="objective is not published"):
        normalise_loss_name("stable_reinforce")
    with pytest.raises(ValueError, match="forward_backward_custom"):
        normalise_loss_name("custom")
    with pytest.raises(ValueError, match=r"unknown loss_fn 'mse'; choose one of cross_entropy, .*gspo"):
        normalise_loss_name("mse")
    with pytest.raises(ValueError, match="must be a string"):
        normalise_loss_name(None)
