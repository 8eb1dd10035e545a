"""The many-tenant decode path (engine/sampling.py, packing.RowLoRA), checked against
transformers' own `generate` on independent models with each tenant's adapter merged:
a mixed batch (ranks, alphas, prompt lengths, samples, lengths, a base-only row), on the
built-in model and on a grouped-query-attention Llama saved as a local HF model, that one
also with every linear of the decode step packed for oneDNN (engine/kernels.py: at full size
only a large model's MLP and head are)."""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import pytest
import torch
from numerics import assert_fp32_close, model_terms

from trio_widgets.engine import kernels, sampling
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import DEFAULT_MODEL, _build_builtin, load_base_model
from trio_widgets.engine.sampling import StepBudget, _Decoding, run_sample_batch
from trio_widgets.validation import SampleSpec

# (rank, alpha) per tenant; None: the bare base
TENANTS: list[tuple[int, float] | None] = [(4, 8.0), (8, 32.0), (16, 64.0), None, (8, 4.0)]
PROMPT_LENGTHS = [3, 9, 5, 7, 1]
SAMPLES = [2, 1, 3, 2, 1]
MAX_TOKENS = [12, 8, 10, 6, 9]


@pytest.fixture(scope="module", params=["builtin", "gqa", "gqa-packed"])
def setup(request, tmp_path_factory):
    """(engine base, a plain transformers model of the same weights, adapters by tenant)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "gqa-packed":
            patch.setattr(kernels, "MIN_ELEMENTS", 0)
        yield _setup(request.param, tmp_path_factory)


def _setup(kind: str, tmp_path_factory):
    if kind == "builtin":
        base = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
        plain, _ = _build_builtin(DEFAULT_MODEL, torch.float32)
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("gqa-llama")
        LlamaForCausalLM(config).save_pretrained(path)
        base = load_base_model(str(path), torch.device("cpu"))
        plain = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    adapters: list[LoRAAdapter | None] = []
    generator = torch.Generator().manual_seed(1)
    for i, spec in enumerate(TENANTS):
        if spec is None:
            adapters.append(None)
            continue
        adapter = LoRAAdapter(base.targets_for(True, True, True), spec[0], seed=10 + i, device=base.device,
                              alpha=spec[1])
        with torch.no_grad():  # a non-zero B, large enough that each tenant continues its own way
            for _, b in adapter.weights.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
        adapters.append(adapter)
    plain.eval()
    return base, plain, adapters


def test_the_decode_packs_the_weights_it_is_asked_to(setup, request):
    """Every float32 linear of the decode step once MIN_ELEMENTS allows it (the 'gqa-packed'
    runs of this module's checks go through oneDNN); none of these small models' by default."""
    base = setup[0]
    run_sample_batch(base, _items(setup, temperature=0.0), 4096)
    if "packed" in request.node.callspec.id:
        assert kernels.onednn_works(), "this torch has no working oneDNN linear: the packed path is untested"
        config = base.model.config
        assert base.linears.nbytes >= config.num_hidden_layers * 7 * 4 * 64 * 32  # (o_proj alone is 64 x 64)
        assert kernels.packed_bytes() >= base.linears.nbytes
    else:
        assert base.linears.nbytes == 0


_ONE_ROW = (None, SampleSpec(prompt=[5, 6, 7], num_samples=2, max_tokens=4, seed=1, temperature=0.0))


def test_packed_weights_go_with_their_base_model_and_stay_within_the_budget(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    before = kernels.packed_bytes()
    base = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    item = _ONE_ROW
    alone = run_sample_batch(base, [item], 4096)[0]
    if not kernels.onednn_works():
        pytest.skip("this torch has no working oneDNN linear")
    held = base.linears.nbytes
    assert held > 0 and kernels.packed_bytes() == before + held
    del base
    gc.collect()
    assert kernels.packed_bytes() == before  # released with the model
    # a budget too small for any weight: nothing is packed, and the tokens are the same
    monkeypatch.setattr(kernels, "budget_bytes", lambda: before + 1)
    base = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    again = run_sample_batch(base, [item], 4096)[0]
    assert base.linears.nbytes == 0 and kernels.packed_bytes() == before
    assert [s.tokens for s in again.sequences] == [s.tokens for s in alone.sequences]


def test_the_budget_is_an_eighth_of_memory_and_known_without_sysconf(monkeypatch):
    budget = kernels.budget_bytes()
    assert 0 < budget <= 1 << 30
    monkeypatch.delattr(kernels.os, "sysconf")  # as on Windows
    assert 0 < kernels.budget_bytes() <= 128 << 20


def test_a_weight_onednn_will_not_pack_goes_through_f_linear(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    before = kernels.packed_bytes()
    item = _ONE_ROW
    plain = run_sample_batch(load_base_model(DEFAULT_MODEL, torch.device("cpu")), [item], 4096)[0]

    def refuse(weight):
        raise RuntimeError("a layout oneDNN does not take")

    monkeypatch.setattr(kernels, "pack_weight", refuse)
    base = load_base_model(DEFAULT_MODEL, torch.device("cpu"))
    refused = run_sample_batch(base, [item], 4096)[0]
    gc.collect()  # (the first base, and its packed copies, are gone)
    assert [s.tokens for s in refused.sequences] == [s.tokens for s in plain.sequences]
    assert base.linears.nbytes == 0 and kernels.packed_bytes() == before  # no bytes counted for it


def _merged(plain: torch.nn.Module, adapter: LoRAAdapter | None) -> torch.nn.Module:
    model = copy.deepcopy(plain)
    head = model.get_output_embeddings()
    # a tied head: the head's LoRA changes the head only, not the input embeddings it shares
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    if adapter is not None:
        with torch.no_grad():
            for name, (a, b) in adapter.weights.items():
                model.get_submodule(name).weight += adapter.scale * (b @ a)
    model.generation_config.eos_token_id = None  # the sampler stops only where asked to
    return model


def _prompt(i: int, vocab: int) -> list[int]:
    return [3 + (11 * i + 7 * j) % (vocab - 3) for j in range(PROMPT_LENGTHS[i])]


def _items(setup, **params) -> list[tuple[LoRAAdapter | None, SampleSpec]]:
    base, _, adapters = setup
    return [(adapters[i], SampleSpec(prompt=_prompt(i, base.vocab_size), num_samples=SAMPLES[i],
                                     max_tokens=MAX_TOKENS[i], seed=100 + i, **params))
            for i in range(len(TENANTS))]


def _ref_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)


def test_greedy_equals_hf_generate_with_each_tenants_adapter_merged(setup):
    base, plain, adapters = setup
    results = run_sample_batch(base, _items(setup, temperature=0.0), 4096)
    continuations = set()
    for i, result in enumerate(results):
        prompt = _prompt(i, base.vocab_size)
        with torch.no_grad():
            out = _merged(plain, adapters[i]).generate(input_ids=torch.tensor([prompt]), do_sample=False,
                                                       max_new_tokens=MAX_TOKENS[i], pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert len(result.sequences) == SAMPLES[i]
        for seq in result.sequences:
            assert seq.tokens == expected, f"tenant {i}"
            assert seq.stop_reason == "length"
        continuations.add(tuple(expected[:6]))
    assert len(continuations) == len(TENANTS)  # every tenant's adapter really changes its tokens


def test_logprobs_match_a_full_sequence_forward(setup):
    base, plain, adapters = setup
    items = _items(setup, temperature=1.0)
    items[1] = (items[1][0], replace(items[1][1], top_k=5, top_p=0.8))
    for i, result in enumerate(run_sample_batch(base, items, 4096)):
        model, prompt = _merged(plain, adapters[i]), items[i][1].prompt
        for seq in result.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == MAX_TOKENS[i]
            ref = _ref_logprobs(model, prompt + seq.tokens)[len(prompt) - 1:-1]
            expected = ref.gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1)
            terms = model_terms(plain.config, len(prompt) + len(seq.tokens))
            assert_fp32_close(seq.logprobs, expected, terms, f"tenant {i}: sampled logprobs")
            if i == 1:  # top-k 5: every token among the 5 most likely
                assert all(t in row.topk(5).indices.tolist() for t, row in zip(seq.tokens, ref))


def test_a_seeded_sample_repeats_exactly(setup):
    base = setup[0]
    first = run_sample_batch(base, _items(setup, temperature=1.0), 4096)
    again = run_sample_batch(base, _items(setup, temperature=1.0), 4096)
    for a, b in zip(first, again):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    rows = [s.tokens for r in first for s in r.sequences]
    assert len({tuple(r) for r in rows}) == len(rows)  # rows of one request differ too


def test_weights_floored_below_exp_minus_87_change_no_sample(setup, monkeypatch):
    """The decode floors exp's input at -87 (CPU exp is ~100x slower where its result is
    subnormal): at a low temperature most of the vocabulary lies below it, and every token and
    logprob is as without the floor."""
    base, plain, adapters = setup
    items = _items(setup, temperature=0.05)
    floored = run_sample_batch(base, items, 4096)
    monkeypatch.setattr(sampling, "_EXP_FLOOR", float("-inf"))
    exact = run_sample_batch(base, items, 4096)
    below = 0.0
    for i, (a, b) in enumerate(zip(floored, exact)):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences], f"tenant {i}"
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences], f"tenant {i}"
        seq, prompt = a.sequences[0], items[i][1].prompt
        ref = _ref_logprobs(_merged(plain, adapters[i]), prompt + seq.tokens)[len(prompt) - 1:-1]
        below = max(below, float(((ref - ref.amax(-1, keepdim=True)) / 0.05 < -87).float().mean()))
    assert below > 0.5, below  # (the floor was reached: most of some step's vocabulary was under it)


def test_a_tenants_samples_do_not_change_with_what_others_ask(setup):
    base = setup[0]
    items = _items(setup, temperature=1.0)
    alone = run_sample_batch(base, items[:1], 4096)[0]
    others = [items[0]]
    for k, (adapter, spec) in enumerate(items[1:]):  # the others ask for other things
        changes = [dict(temperature=0.0), dict(top_k=3, top_p=0.7), dict(max_tokens=2),
                   dict(stop_ids=frozenset({5, 9, 12})), dict(num_samples=4, temperature=2.0)][k]
        others.append((adapter, replace(spec, **changes)))
    together = run_sample_batch(base, others, 4096)[0]
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in together.sequences]
    terms = model_terms(setup[1].config, PROMPT_LENGTHS[0] + MAX_TOKENS[0])
    for a, b in zip(alone.sequences, together.sequences):
        assert_fp32_close(a.logprobs, b.logprobs, terms, "alone vs with others")


def test_stop_ids_end_rows_at_their_own_step_and_the_rest_go_on(setup):
    base = setup[0]
    items = _items(setup, temperature=0.0)
    greedy = run_sample_batch(base, items, 4096)
    stop_at = greedy[2].sequences[0].tokens[3]  # tenant 2's fourth greedy token
    items[2] = (items[2][0], replace(items[2][1], stop_ids=frozenset({stop_at})))
    stopped = run_sample_batch(base, items, 4096)
    first = greedy[2].sequences[0].tokens.index(stop_at)
    for seq in stopped[2].sequences:
        assert seq.tokens == greedy[2].sequences[0].tokens[:first + 1] and seq.stop_reason == "stop"
    for i in (0, 1, 3, 4):  # the others are untouched by tenant 2's rows leaving the batch
        assert [s.tokens for s in stopped[i].sequences] == [s.tokens for s in greedy[i].sequences]


class _Steps(StepBudget):
    """Exactly `n` decode steps, whatever the time."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n = n

    def take(self) -> bool:
        self.n -= 1
        return self.n >= 0


def test_the_kv_cache_is_bounded_and_freed_when_the_decode_ends(setup):
    base, plain, _ = setup
    items = _items(setup, temperature=1.0)
    decoding = _Decoding(base, items)
    decoding.advance(_Steps(3))
    assert not decoding.done and decoding.kv is not None
    config = plain.config
    rows = sum(SAMPLES)
    head_dim = config.hidden_size // config.num_attention_heads
    # one preallocated buffer each for keys and values: rows x (longest prompt + longest sample)
    bound = config.num_hidden_layers * rows * config.num_key_value_heads * head_dim * \
        (max(PROMPT_LENGTHS) + max(MAX_TOKENS)) * 4
    assert decoding.kv[0].nbytes == decoding.kv[1].nbytes == bound
    decoding.advance(StepBudget(None))
    assert decoding.done and decoding.kv is None and decoding.cache is None and decoding.step_logits is None


def test_other_architectures_decode_through_their_own_forward_alike(setup, monkeypatch):
    """The generic path (the model's forward over a DynamicCache, RowLoRA per layer) gives the
    Llama step's greedy tokens and logprobs."""
    from trio_widgets.engine import sampling

    base = setup[0]
    items = _items(setup, temperature=0.0)
    direct = run_sample_batch(base, items, 4096)
    monkeypatch.setattr(sampling, "_is_llama", lambda model: False)
    generic = run_sample_batch(base, items, 4096)
    terms = model_terms(setup[1].config, max(PROMPT_LENGTHS) + max(MAX_TOKENS))
    for a, b in zip(direct, generic):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert_fp32_close(x.logprobs, y.logprobs, terms, "Llama step vs the model's forward")
