"""The GPU's dtype path on CPU: a bf16 base with fp32 LoRA weights, for training and for
sampling (the decode's own Llama step, RowLoRA, the preallocated KV cache), against the same
adapters over the fp32 base within the rounding a bf16 base allows (tests/numerics.py). So a
dtype bug of that path shows here, not first on a lent GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch
from numerics import assert_close, model_roundings, model_terms, tiny_config

from trio_widgets.engine.compute import make_forward_job, run_forward_jobs
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import DEFAULT_MODEL, BaseModel, load_base_model
from trio_widgets.engine.sampling import forward_logits, run_sample_batch
from trio_widgets.types import AdamParams
from trio_widgets.validation import SampleSpec

CONFIG = tiny_config()
ROUNDINGS = model_roundings(CONFIG)
SPECS = [(8, 16.0), (4, 32.0)]  # (rank, alpha) per tenant


def _bases() -> tuple[BaseModel, BaseModel]:
    fp32 = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    bf16 = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    bf16.model.to(torch.bfloat16)  # the base only: adapters stay fp32, as on CUDA
    bf16.dtype = torch.bfloat16
    return fp32, bf16


def _adapters(base: BaseModel, specs: list[tuple[int, float]] = SPECS) -> list[LoRAAdapter]:
    out = []
    for i, (rank, alpha) in enumerate(specs):
        adapter = LoRAAdapter(base.targets_for(True, True, True), rank, seed=i, device=base.device, alpha=alpha)
        generator = torch.Generator().manual_seed(50 + i)
        with torch.no_grad():
            for _, b in adapter.weights.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
        out.append(adapter)
    return out


@pytest.fixture(scope="module")
def bases() -> tuple[BaseModel, BaseModel]:
    return _bases()


# one tenant: engine/llama.py's one-tenant products, fp32 LoRA on a bf16 base
@pytest.mark.parametrize("specs", [SPECS, SPECS[:1]], ids=["two tenants", "one tenant"])
def test_training_on_a_bf16_base_matches_fp32_within_bf16_rounding(bases, specs):
    fp32, bf16 = bases
    results = {}
    for base in (fp32, bf16):
        adapters = _adapters(base, specs)
        items = []
        for i, adapter in enumerate(adapters):
            job, _ = make_forward_job(base, random_batch(10 + i, n=2, length=12), "cross_entropy", {}, True)
            items.append((adapter, job, f"t{i}"))
        outputs = run_forward_jobs(base, items, 4096)
        assert all(not isinstance(o, Exception) for o in outputs), outputs
        grads = [a.grad for a in adapters]
        for a in adapters:
            assert a.flat.dtype == torch.float32 and a._grad is not None and a._grad.dtype == torch.float32
            a.adamw_step(AdamParams(learning_rate=1e-3))
            assert a.flat.dtype == torch.float32 and bool(torch.isfinite(a.flat).all())
        results[base.dtype] = (outputs, grads)
    (out32, grads32), (out16, grads16) = results[torch.float32], results[torch.bfloat16]
    terms = model_terms(CONFIG, 12, batch_tokens=24)
    for i in range(len(specs)):
        for d in range(2):
            lp16 = out16[i].loss_fn_outputs[d]["logprobs"].to_torch()
            lp32 = out32[i].loss_fn_outputs[d]["logprobs"].to_torch()
            assert lp16.dtype == torch.float32
            assert_close(lp16, lp32, terms, f"tenant {i} datum {d} logprobs", base_dtype=torch.bfloat16,
                         roundings=ROUNDINGS)
        # a gradient entry goes down the forward's chain of bf16 roundings and back up the backward's
        for name, (ga32, gb32) in grads32[i].items():
            ga16, gb16 = grads16[i][name]
            for got, want, which in ((ga16, ga32, "dA"), (gb16, gb32, "dB")):
                assert_close(got, want, terms, f"tenant {i} {which} {name}", base_dtype=torch.bfloat16,
                             roundings=2 * ROUNDINGS)


def test_sampling_on_a_bf16_base_matches_fp32_within_bf16_rounding(bases):
    fp32, bf16 = bases
    adapters16, adapters32 = _adapters(bf16), _adapters(fp32)
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(6 + 3 * i)] for i in range(len(SPECS))]
    items = [(a, SampleSpec(prompt=p, num_samples=2, max_tokens=10, temperature=1.0, seed=i, top_k=50))
             for i, (a, p) in enumerate(zip(adapters16, prompts))]
    results = run_sample_batch(bf16, items, 4096)
    for i, result in enumerate(results):
        assert not isinstance(result, Exception), result
        for seq in result.sequences:
            assert len(seq.tokens) == 10 and all(isinstance(x, float) for x in seq.logprobs)
            # the fp32 base's log-probabilities of the same tokens, teacher-forced with the same adapter
            full = forward_logits(fp32, adapters32[i], [prompts[i] + seq.tokens])[0]
            logp = torch.log_softmax(full, -1)[len(prompts[i]) - 1:-1]
            expected = logp.gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1)
            terms = model_terms(CONFIG, len(prompts[i]) + 10)
            assert_close(seq.logprobs, expected, terms, f"tenant {i}: bf16 sample vs fp32", base_dtype=torch.bfloat16,
                         roundings=ROUNDINGS)
    # and greedy decoding runs through the same path without a dtype error
    greedy = run_sample_batch(bf16, [(a, SampleSpec(prompt=p, num_samples=1, max_tokens=4, temperature=0.0))
                                     for a, p in zip(adapters16, prompts)], 4096)
    assert all(len(r.sequences[0].tokens) == 4 for r in greedy)
