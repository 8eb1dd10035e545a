"""engine/llama.py's direct pass against transformers' own forward of the same model (the one the
packed pass ran through before, checked against PEFT in test_gradients): the same logits and the
same LoRA gradients, for one tenant's row (its fused matmuls) and for a row of several tenants."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_fp32_close, model_terms

from trio_widgets.engine.llama import is_llama, packed_logits
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import DEFAULT_MODEL, load_base_model
from trio_widgets.engine.packing import PackPlan, Segment, active_plan

LENGTHS = [7, 12, 7, 3]


@pytest.fixture(scope="module", params=["builtin", "gqa-bias-llama3"])
def base(request, tmp_path_factory):
    if request.param == "builtin":
        return load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    from transformers import LlamaConfig, LlamaForCausalLM

    # what the built-in model lacks: grouped kv heads, biases, a scaled rotary embedding, a tied head
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-zero biases, so that a pass that drops one shows it
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return load_base_model(str(path), torch.device("cpu"))


def _adapter(base, rank: int, alpha: float, seed: int, mlp: bool = True) -> LoRAAdapter:
    adapter = LoRAAdapter(base.targets_for(True, mlp, True), rank, seed=seed, device=base.device, alpha=alpha)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a non-zero B, so that every A gets a gradient
        for _, b in adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
    return adapter


def _pass(base, adapters: list[LoRAAdapter | None], lengths: list[int], direct: bool
          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of one packed row (sequence i of lengths[i] tokens through adapters[i]) and each
    adapter's gradient of a fixed random weighting of them."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, base.vocab_size, (sum(lengths),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    segments, start = [], 0
    for adapter, n in zip(adapters, lengths):
        if segments and segments[-1].adapter is adapter:
            segments[-1].end += n
        else:
            segments.append(Segment(start, start + n, adapter))
        start += n
    plan = PackPlan(segments=segments, seq_lens=lengths)
    distinct = list({id(a): a for a in adapters if a is not None}.values())
    for adapter in distinct:
        adapter.begin_pass()
    with active_plan(plan):
        if direct:
            logits = packed_logits(base, ids, positions, plan)
        else:
            logits = base.model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    weights = torch.randn(logits.shape, generator=generator)
    (logits * weights).sum().backward()
    plan.flush_grads()
    return logits.detach(), [adapter.end_pass() for adapter in distinct]


# per row: each tenant's (rank, alpha, trains the MLP); each sequence's tenant (None: no adapter); lengths
ROWS = {
    "one tenant": ([(8, 16.0, True)], [0, 0, 0, 0], LENGTHS),
    "one tenant, attention and head only": ([(8, 16.0, False)], [0, 0, 0, 0], LENGTHS),
    # tenants of one rank with batches of one length (MultiLoRALinear's one batched product per layer)
    "tenants' equal batches": ([(8, 16.0, True)] * 3, [0, 0, 1, 1, 2], [5, 7, 6, 6, 12]),
    "tenants' equal batches, alphas differ": ([(8, 16.0, True), (8, 64.0, True), (8, 4.0, True)], [0, 0, 1, 1, 2],
                                              [5, 7, 6, 6, 12]),
    # the modules' grouping: ranks, lengths and trained layers differ; a sequence without an adapter,
    # and one tenant's two sequences apart
    "several tenants": ([(4, 8.0, True), (8, 32.0, False)], [0, 1, None, 0], LENGTHS),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_the_direct_pass_gives_transformers_logits_and_gradients(base, row):
    assert is_llama(base.model)
    specs, owners, lengths = ROWS[row]
    tenants = [_adapter(base, rank, alpha, seed=1 + i, mlp=mlp) for i, (rank, alpha, mlp) in enumerate(specs)]
    adapters = [None if owner is None else tenants[owner] for owner in owners]
    direct, direct_grads = _pass(base, adapters, lengths, direct=True)
    reference, reference_grads = _pass(base, adapters, lengths, direct=False)
    terms = model_terms(base.model.config, max(lengths), batch_tokens=sum(lengths))
    assert_fp32_close(direct, reference, terms, "logits, direct vs transformers' forward")
    assert len(direct_grads) == len(tenants)
    for got, want in zip(direct_grads, reference_grads, strict=True):
        assert float(want.abs().max()) > 0
        assert_fp32_close(got, want, terms, "LoRA gradient, direct vs transformers' forward")


def test_a_model_that_is_not_transformers_llama_goes_through_its_own_forward():
    class LlamaForCausalLM(torch.nn.Module):  # the name alone does not make it transformers' Llama
        pass

    assert not is_llama(LlamaForCausalLM())
