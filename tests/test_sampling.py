"""Sampling through the clock: numerics against an independent reference, seeds, stops,
batching across clients, snapshots, bad input, and the RL example."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import time
from pathlib import Path

import pytest
import torch
from numerics import assert_fp32_close, model_terms, tiny_config
from transports import checkpoint_dir, inspect, pool_client_id, service

import trio_widgets as trio
from trio_widgets.engine import sampling
from trio_widgets.engine.models import _build_builtin
from trio_widgets.engine.sampling import _BLOCK, _inverse_cdf, _Row, _stopped
from trio_widgets.tokenizers import byte_tokenizer
from trio_widgets.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    check_sample,
)

PROMPT = [3 + b for b in b"The cat "]  # byte tokenizer: token = byte + 3


def _train(tc: trio.TrainingClient, steps: int = 4) -> None:
    text = [3 + b for b in b"the quick brown fox jumps over the lazy dog"]
    datum = trio.Datum(trio.ModelInput.from_ints(text[:-1]), {"target_tokens": text[1:]})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(trio.AdamParams(learning_rate=2e-2)).result()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))) as pool:
        yield pool


@pytest.fixture(scope="module")
def sampling_service(pool, transport):
    """The clients' ServiceClient: in-process, or over HTTP to the same pool (conftest.py's transport)."""
    with service(transport, pool) as svc:
        yield svc


@pytest.fixture(scope="module")
def trained(sampling_service):
    """A training client with a non-trivial adapter and a sampling snapshot of it."""
    tc = sampling_service.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=3)
    _train(tc)
    return tc, tc.save_weights_and_get_sampling_client().result()


@pytest.fixture(scope="module")
def reference(trained, sampling_service, pool):
    """An independent model: a fresh Hugging Face Llama (no wrappers, no packing) with the
    sampler's LoRA merged into its weights (W + alpha/r * B @ A)."""
    _, sc = trained
    model, _ = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    model.eval()
    adapter = inspect(sampling_service, pool, sc)
    with torch.no_grad():
        for name, (a, b) in adapter.weights.items():
            model.get_submodule(name).weight += adapter.scale * (b @ a)
    return model


def _ref_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)


def test_greedy_equals_independent_argmax_continuation(trained, reference):
    _, sc = trained
    res = sc.sample(trio.ModelInput.from_ints(PROMPT), 2, trio.SamplingParams(max_tokens=12, temperature=0.0)).result()
    tokens = list(PROMPT)
    for _ in range(12):  # recompute the whole sequence each step: no cache, no padding
        tokens.append(int(_ref_logprobs(reference, tokens)[-1].argmax()))
    expected = tokens[len(PROMPT):]
    for seq in res.sequences:
        assert seq.tokens == expected
        assert seq.stop_reason == "length"
    # the adapter matters: the bare base model continues differently
    base_sc = trio.ServiceClient(sc.pool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    base = base_sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=12, temperature=0.0)).result()
    assert base.sequences[0].tokens != expected


def test_same_seed_same_samples(trained):
    _, sc = trained
    params = trio.SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    first = sc.sample(PROMPT, 4, params).result()
    again = sc.sample(PROMPT, 4, params).result()
    other = sc.sample(PROMPT, 4, trio.SamplingParams(max_tokens=10, temperature=1.0, seed=1235)).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.logprobs for s in first.sequences] == [s.logprobs for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1  # the rows of one request differ


def test_stop_token_and_stop_string_end_with_stop(trained):
    _, sc = trained
    tokenizer = sc.get_tokenizer()
    free = trio.SamplingParams(max_tokens=12, temperature=1.0, seed=21)
    full = sc.sample(PROMPT, 1, free).result().sequences[0].tokens
    assert len(full) == 12
    # the first position k >= 2 whose token did not occur before (same seed: same draws up to there)
    k = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i])
    by_id = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=12, temperature=1.0, seed=21,
                                                     stop=[full[k]])).result().sequences[0]
    assert by_id.tokens == full[:k + 1] and by_id.stop_reason == "stop"
    # a stop string: the text of tokens k-1..k; generation ends at the token that completes it
    text = tokenizer.decode(full[k - 1:k + 1])
    assert text
    by_str = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=12, temperature=1.0, seed=21,
                                                      stop=["never-appears", text])).result().sequences[0]
    assert by_str.stop_reason == "stop"
    assert by_str.tokens == full[:len(by_str.tokens)] and len(by_str.tokens) <= k + 1
    assert text in tokenizer.decode(by_str.tokens)
    assert text not in tokenizer.decode(by_str.tokens[:-1])
    # no stop hit: "length"
    assert sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=5, temperature=1.0, seed=21, stop=[258])
                     ).result().sequences[0].stop_reason == ("stop" if 258 in full[:5] else "length")


def _first_stop_by_whole_text(tokens: list[int], stops: list[str], tokenizer) -> int | None:
    """The reference: the first k at which a stop string occurs in the text of tokens[:k + 1]."""
    return next((k for k in range(len(tokens)) if any(s in tokenizer.decode(tokens[:k + 1]) for s in stops)), None)


def test_stop_strings_match_as_the_whole_text_would():
    """The clock's incremental matcher (only the characters each token adds, only the stop
    strings ending in them) stops where searching the whole decoded text would: stops inside a
    token, across tokens, across a multi-byte character split over byte tokens, repeated."""
    decoded: list[int] = []  # how many tokens each decode got: the per-token work

    class Recording(type(byte_tokenizer())):  # the real byte tokenizer, counting
        def decode(self, ids, *args, **kwargs):
            decoded.append(len(ids))
            return super().decode(ids, *args, **kwargs)

    tokenizer, reference = Recording(extra_ids=0), byte_tokenizer()
    text = "the cat sät on the mat, ☃ naïve; the end"
    tokens = [3 + b for b in text.encode()]
    rng = torch.Generator().manual_seed(0)
    words = ["the", "at", "t on t", "ät", "ä", "☃", "☃ n", "; ", "end", "nope", "mat, ☃ naïve; the e", "t", "e"]
    cases = [[w] for w in words] + [["nope", "mat"], ["end", "sät"], ["☃", "the cat"], ["t on", "t on"]]
    for _ in range(20):  # random mixtures, including ones that never match
        picks = torch.randperm(len(words), generator=rng)[:3].tolist()
        cases.append([words[i] for i in picks])
    matched = 0
    for stops in cases:
        spec = check_sample(PROMPT, 1, trio.SamplingParams(max_tokens=len(tokens), stop=stops), False)
        row = _Row(0, None, spec, torch.zeros(len(tokens), dtype=torch.float64))
        got = None
        for k, tok in enumerate(tokens):
            if _stopped(row, tok, tokenizer):
                got = k
                break
        assert got == _first_stop_by_whole_text(tokens, stops, reference), stops
        matched += got is not None
    assert matched >= len(words)  # most cases do stop, and where the reference says
    # each token decodes a few tokens (its predecessor, and the bytes of one character, at most
    # 4 in UTF-8), however long the text or the stop strings: not a window as long as the
    # longest stop string
    assert max(decoded) <= 1 + 4


def test_stop_matching_work_per_token_does_not_grow_with_the_text():
    decoded: list[int] = []

    class Recording(type(byte_tokenizer())):
        def decode(self, ids, *args, **kwargs):
            decoded.append(len(ids))
            return super().decode(ids, *args, **kwargs)

    tokenizer = Recording(extra_ids=0)
    stops = ["\u2603" * (MAX_STOP_STRING_CHARS - 1) + c for c in "etaoinshrdlucmfw"]
    spec = check_sample(PROMPT, 1, trio.SamplingParams(max_tokens=400, stop=stops), False)
    row = _Row(0, None, spec, torch.zeros(400, dtype=torch.float64))
    for tok in [3 + b for b in b"the quick brown fox jumps over the lazy dog " * 9][:400]:
        assert not _stopped(row, tok, tokenizer)
    assert len(decoded) <= 2 * 400 and max(decoded) <= 2  # ASCII: each token completes its character


def test_stop_strings_over_the_limits_are_refused_naming_the_field(trained, pool):
    _, sc = trained
    per = MAX_STOP_TOTAL_CHARS // MAX_STOP_STRINGS
    at_limit = [f"{i:0{per}d}" for i in range(MAX_STOP_STRINGS)]
    over = {
        "count": at_limit + ["x"],
        "length": ["y" * (MAX_STOP_STRING_CHARS + 1)],
        "total": ["z" * MAX_STOP_STRING_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS + 1),
        "token ids": list(range(MAX_STOP_TOKEN_IDS + 1)),
        "a flood": ["w"] * 100_000,
    }
    depth = sum(pool.queue_depths().values())
    for what, stop in over.items():
        with pytest.raises(trio.InvalidInputError, match="limit") as info:
            sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=2, stop=stop))
        assert info.value.field == "sampling_params.stop", what
    assert sum(pool.queue_depths().values()) <= depth
    # at the limits: accepted, and it samples
    assert sum(map(len, at_limit)) == MAX_STOP_TOTAL_CHARS
    res = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=3, seed=5, stop=at_limit)).result(timeout=60)
    assert len(res.sequences[0].tokens) <= 3


@pytest.mark.parametrize("params", [
    trio.SamplingParams(max_tokens=10, temperature=1.0, seed=7),
    trio.SamplingParams(max_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=8),
])
def test_sampled_logprobs_equal_compute_logprobs(trained, reference, params):
    _, sc = trained
    res = sc.sample(PROMPT, 3, params, include_prompt_logprobs=True).result()
    prompt_lp = sc.compute_logprobs(PROMPT).result()
    assert prompt_lp[0] is None and res.prompt_logprobs[0] is None
    terms = model_terms(tiny_config(), len(PROMPT) + params.max_tokens)
    assert_fp32_close(res.prompt_logprobs[1:], prompt_lp[1:], terms, "prompt logprobs")
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 10
        full = sc.compute_logprobs(trio.ModelInput.from_ints(PROMPT + seq.tokens)).result()
        assert_fp32_close(seq.logprobs, full[len(PROMPT):], terms, "sampled vs computed logprobs")
        # and both equal the independent model's log-probabilities
        ref = _ref_logprobs(reference, PROMPT + seq.tokens)
        expected = ref[len(PROMPT) - 1:-1].gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1)
        assert_fp32_close(seq.logprobs, expected, terms, "sampled logprobs vs the merged reference model")


def test_top_k_and_top_p_filter_the_distribution(trained, reference):
    _, sc = trained
    greedy = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=8, temperature=0.0)).result().sequences[0].tokens
    top1 = sc.sample(PROMPT, 3, trio.SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=1)).result()
    tiny_p = sc.sample(PROMPT, 3, trio.SamplingParams(max_tokens=8, temperature=2.0, top_p=1e-6, seed=1)).result()
    assert all(s.tokens == greedy for s in top1.sequences + tiny_p.sequences)
    hot = sc.sample(PROMPT, 6, trio.SamplingParams(max_tokens=8, temperature=5.0, top_k=3, seed=2)).result()
    assert any(s.tokens != greedy for s in hot.sequences)
    for seq in hot.sequences:
        ref = _ref_logprobs(reference, PROMPT + seq.tokens)[len(PROMPT) - 1:-1]
        top3 = ref.topk(3, dim=-1).indices
        assert all(tok in top3[i].tolist() for i, tok in enumerate(seq.tokens))


def _assert_topk(got: list[tuple[int, float]] | None, ref_row: torch.Tensor, k: int, terms: int, what: str) -> None:
    """`got` is the top k of `ref_row` (log-probabilities over the vocabulary): descending, each
    logprob that of its token, and the k values those of the reference's top k (ties and
    near-ties may order tokens differently, so values are compared, not ids)."""
    assert got is not None and len(got) == k, what
    ids = torch.tensor([t for t, _ in got])
    values = [v for _, v in got]
    assert values == sorted(values, reverse=True) and len(set(ids.tolist())) == k, what
    assert_fp32_close(values, ref_row[ids], terms, f"{what}: logprobs of the returned tokens")
    assert_fp32_close(values, ref_row.topk(k).values, terms, f"{what}: the reference's top {k}")


def test_topk_prompt_and_sample_logprobs_equal_the_reference_top_k(trained, reference):
    _, sc = trained
    k = 5
    res = sc.sample(PROMPT, 2, trio.SamplingParams(max_tokens=6, temperature=1.0, seed=5),
                    include_prompt_logprobs=True, topk_prompt_logprobs=k, topk_sample_logprobs=k).result()
    terms = model_terms(tiny_config(), len(PROMPT) + 6)
    ref = _ref_logprobs(reference, PROMPT)
    assert res.topk_prompt_logprobs[0] is None and len(res.topk_prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):  # position i is predicted by row i - 1
        _assert_topk(res.topk_prompt_logprobs[i], ref[i - 1], k, terms, f"prompt position {i}")
    matrices = res.topk_prompt_logprobs_np  # tinker's (length, k) views, sentinel row at position 0
    assert matrices.token_ids.shape == (len(PROMPT), k) and matrices.logprobs[0].tolist() == [-99999.0] * k
    for seq in res.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        ref = _ref_logprobs(reference, PROMPT + seq.tokens)[len(PROMPT) - 1:-1]
        for j, top in enumerate(seq.topk_logprobs):
            _assert_topk(top, ref[j], k, terms, f"sampled token {j}")
            # the same distribution as `logprobs`: the chosen token's entry, when in the top k, is its logprob
            chosen = dict(top).get(seq.tokens[j])
            assert chosen is None or chosen == seq.logprobs[j]
        assert seq.topk_logprobs_np.token_ids.shape == (len(seq.tokens), k)
    plain = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=2, seed=5)).result()
    assert plain.topk_prompt_logprobs is None and plain.sequences[0].topk_logprobs is None


def test_prompt_options_of_requests_batched_in_one_cycle(pool, trained, reference):
    """Each request of a shared prefill (left-padded, other prompts beside it) gets its own rows."""
    _, sc = trained
    prompts = [PROMPT, [3 + b for b in b"A longer prompt here"], [3 + b for b in b"Hi"]]
    with pool.hold():
        futures = [sc.sample(p, 1, trio.SamplingParams(max_tokens=2, seed=i), include_prompt_logprobs=True,
                             topk_prompt_logprobs=2) for i, p in enumerate(prompts)]
        scored = sc.compute_logprobs(prompts[1], prompt_logprobs_last_n=4)
    assert len({f.cycle for f in futures} | {scored.cycle}) == 1
    for prompt, future in zip(prompts, futures):
        res = future.result()
        ref = _ref_logprobs(reference, prompt)
        terms = model_terms(tiny_config(), len(prompt))
        expected = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert_fp32_close(res.prompt_logprobs[1:], expected, terms, f"prompt logprobs of {len(prompt)} tokens")
        for i in range(1, len(prompt)):
            _assert_topk(res.topk_prompt_logprobs[i], ref[i - 1], 2, terms, f"position {i} of {len(prompt)}")
    last4 = scored.result()
    ref = _ref_logprobs(reference, prompts[1])
    assert last4[:-4] == [None] * (len(prompts[1]) - 4)
    assert_fp32_close(last4[-4:], ref[-5:-1].gather(1, torch.tensor(prompts[1][-4:])[:, None]).squeeze(1),
                      model_terms(tiny_config(), len(prompts[1])), "last 4 in a shared prefill")


def test_topk_with_prompt_logprobs_last_n(trained, reference):
    _, sc = trained
    res = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                    topk_prompt_logprobs=3, prompt_logprobs_last_n=2).result()
    n = len(PROMPT)
    assert res.prompt_logprobs[:n - 2] == [None] * (n - 2) and res.topk_prompt_logprobs[:n - 2] == [None] * (n - 2)
    ref = _ref_logprobs(reference, PROMPT)
    terms = model_terms(tiny_config(), n)
    for i in (n - 2, n - 1):
        _assert_topk(res.topk_prompt_logprobs[i], ref[i - 1], 3, terms, f"prompt position {i}")
        assert_fp32_close(res.prompt_logprobs[i], ref[i - 1, PROMPT[i]], terms, f"prompt logprob {i}")


def test_target_prompt_logprobs_and_alternative_tokens(trained, reference):
    _, sc = trained
    n = len(PROMPT)
    targets = [[PROMPT[i + 1], -1, 3 + i] for i in range(n - 1)]
    params = trio.SamplingParams(max_tokens=1, temperature=0.8, seed=11)
    res = sc.sample(PROMPT, 1, params, target_prompt_logprobs=trio.TensorData(targets), prompt_alt_tokens_k=4).result()
    ref = _ref_logprobs(reference, PROMPT)
    terms = model_terms(tiny_config(), n)
    got = res.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [n - 1, 3]
    values = got.to_torch()
    assert values[:, 1].tolist() == [0.0] * (n - 1)  # -1: no token asked for
    for col in (0, 2):
        ids = torch.tensor([row[col] for row in targets])
        assert_fp32_close(values[:, col], ref[:n - 1].gather(1, ids[:, None]).squeeze(1), terms, f"column {col}")
    alt = res.prompt_alt_tokens
    assert alt.tokens.dtype == "int64" and alt.tokens.shape == alt.logprobs.shape == [n - 1, 4]
    assert_fp32_close(alt.logprobs.to_torch(), ref[:n - 1].gather(1, alt.tokens.to_torch()), terms, "alt logprobs")
    again = sc.sample(PROMPT, 1, params, prompt_alt_tokens_k=4).result().prompt_alt_tokens
    assert again.tokens.data == alt.tokens.data  # the request's seed fixes the draws
    greedy = sc.sample(PROMPT, 1, trio.SamplingParams(max_tokens=1, temperature=0.0),
                       prompt_alt_tokens_k=2).result().prompt_alt_tokens.tokens.to_torch()
    assert torch.equal(greedy[:, 0], greedy[:, 1])  # temperature 0: the most likely token, every time
    best = ref[:n - 1].gather(1, greedy[:, :1]).squeeze(1)
    assert_fp32_close(best, ref[:n - 1].max(-1).values, terms, "greedy alternatives are the argmax")


def test_sample_requests_batch_across_clients_in_one_cycle(pool, trained, sampling_service, monkeypatch):
    tc, sc = trained
    base_sc = trio.ServiceClient(pool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=99)
    solo = [c.sample(PROMPT, 2, params).result() for c in (sc, base_sc)]
    model = pool.get_base_model(trio.DEFAULT_MODEL).model
    calls = []
    # one pass of the model per prefill (its forward) and per decode step (the decode's own Llama step)
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    step = sampling._llama_step
    monkeypatch.setattr(sampling, "_llama_step", lambda *a: calls.append(1) or step(*a))
    try:
        with pool.hold():  # no boundary while both are submitted
            futures = [c.sample(PROMPT, 2, params) for c in (sc, base_sc)]
        together = [f.result() for f in futures]
    finally:
        hook.remove()
    assert futures[0].cycle == futures[1].cycle
    assert len(calls) == 6  # one prefill + 5 decode steps for all 4 rows: one batch, not two
    for a, b in zip(solo, together):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert_fp32_close([s.logprobs for s in a.sequences], [s.logprobs for s in b.sequences],
                          model_terms(tiny_config(), len(PROMPT) + 6), "batched vs alone")
    assert solo[0].sequences[0].tokens != solo[1].sequences[0].tokens  # different adapters really differ
    cycle = next(c for c in pool.telemetry.cycles if c.index == futures[0].cycle)
    assert cycle.ops == {"sample": 2}
    records = [r for r in pool.telemetry.requests_of(pool_client_id(sampling_service, sc))
               if r.op == "sample" and r.cycle == futures[0].cycle]
    assert records[0].op == "sample" and records[0].status == "ok" and records[0].cycle == futures[0].cycle
    assert records[0].metrics["sampled_tokens:sum"] == 12
    assert pool.telemetry.clients[pool_client_id(sampling_service, sc)].kind == "sampling"


def test_sampling_client_is_an_immutable_snapshot(sampling_service):
    tc = sampling_service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=5)
    _train(tc, 1)
    sc = tc.save_weights_and_get_sampling_client()
    before = sc.compute_logprobs(PROMPT).result()
    _train(tc, 2)
    assert sc.compute_logprobs(PROMPT).result() == before
    later = tc.save_weights_and_get_sampling_client().compute_logprobs(PROMPT).result()
    assert max(abs(a - b) for a, b in zip(later[1:], before[1:])) > 1e-3


def test_dropped_sampling_client_is_forgotten_by_the_pool(pool, sampling_service):
    sc = sampling_service.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    cid = pool_client_id(sampling_service, sc)
    fut = sc.compute_logprobs(PROMPT)
    del sc
    gc.collect()
    assert fut.result()[0] is None  # a request in flight still finishes
    deadline = time.monotonic() + 5
    while cid in pool.telemetry.live_clients() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cid not in pool.telemetry.live_clients()


@pytest.mark.parametrize("prompt, num_samples, params, field", [
    ([], 1, trio.SamplingParams(), "prompt"),
    (trio.ModelInput.empty(), 1, trio.SamplingParams(), "prompt"),
    ([5, 999], 1, trio.SamplingParams(), "prompt"),
    ("text", 1, trio.SamplingParams(), "prompt"),
    (PROMPT, 0, trio.SamplingParams(), "num_samples"),
    (PROMPT, 1, trio.SamplingParams(max_tokens=0), "sampling_params.max_tokens"),
    (PROMPT, 1, trio.SamplingParams(max_tokens=600), "sampling_params.max_tokens"),
    (PROMPT, 1, trio.SamplingParams(temperature=-0.1), "sampling_params.temperature"),
    (PROMPT, 1, trio.SamplingParams(temperature=float("nan")), "sampling_params.temperature"),
    (PROMPT, 1, trio.SamplingParams(top_p=0.0), "sampling_params.top_p"),
    (PROMPT, 1, trio.SamplingParams(top_p=1.5), "sampling_params.top_p"),
    (PROMPT, 1, trio.SamplingParams(top_k=-2), "sampling_params.top_k"),
    (PROMPT, 1, trio.SamplingParams(stop=[""]), "sampling_params.stop"),
    (PROMPT, 1, trio.SamplingParams(stop=[100000]), "sampling_params.stop"),
    (PROMPT, 1, trio.SamplingParams(seed="x"), "sampling_params.seed"),
    (PROMPT, 1, {"max_tokens": 3}, "sampling_params"),
])
def test_bad_sampling_input_is_rejected_at_submit(trained, pool, prompt, num_samples, params, field):
    _, sc = trained
    depth = sum(pool.queue_depths().values())
    with pytest.raises(trio.InvalidInputError) as info:
        sc.sample(prompt, num_samples, params)
    assert info.value.field == field
    assert sum(pool.queue_depths().values()) <= depth


def test_bad_logprobs_input_and_missing_model(trained, pool):
    _, sc = trained
    with pytest.raises(trio.InvalidInputError, match="empty") as info:
        sc.compute_logprobs([])
    assert info.value.field == "prompt"
    with pytest.raises(trio.InvalidInputError) as info:
        trio.ServiceClient(pool).create_sampling_client()
    assert info.value.field == "model_path"


def test_async_sampling_api(trained, sampling_service, pool):
    tc, sc = trained

    async def go():
        res = await sc.sample_async(PROMPT, 2, trio.SamplingParams(max_tokens=3, seed=4))
        lps = await sc.compute_logprobs_async(PROMPT)
        sc2 = await tc.save_weights_and_get_sampling_client_async()
        fut = await tc.save_weights_for_sampler_async("async-weights")
        return res, lps, sc2, await fut

    res, lps, sc2, saved = asyncio.run(go())
    assert isinstance(res, trio.SampleResponse) and len(res.sequences) == 2
    assert lps == sc.compute_logprobs(PROMPT).result()
    assert isinstance(sc2, trio.SamplingClient)
    assert (checkpoint_dir(sampling_service, pool, saved) / "adapter_model.safetensors").is_file()


def _load_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "rl_importance_sampling.py"
    spec = importlib.util.spec_from_file_location("rl_importance_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_example_mean_reward_rises():
    example = _load_example()
    with trio.LocalPool(min_cycle_s=0.002) as pool:
        means = example.train(trio.ServiceClient(pool), updates=9, group_size=16, seed=0)
    assert len(means) == 9
    assert max(means[:3]) < 0.3  # the untrained policy rarely writes a-z
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.3


@pytest.mark.no_numerics
def test_threads_loading_the_tokenizer_together_all_get_it():
    """The first load in a fresh process, from 8 threads at once (a sampler's threads sampling with
    stop strings): transformers' lazy import raised ImportError in some of them before the lock."""
    import subprocess
    import sys

    code = ("import threading\nfrom trio_widgets.tokenizers import byte_tokenizer\nerrors, ok = [], []\n"
            "def load():\n    try:\n        ok.append(byte_tokenizer().encode('ab'))\n"
            "    except Exception as exc:\n        errors.append(repr(exc))\n"
            "ts = [threading.Thread(target=load) for _ in range(8)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "assert not errors and len(ok) == 8, errors\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


# -- long samples go on over several cycles (issue 22: one tenant cannot hold the clock) ----------

def _sample_tokens(min_decode_steps, tmp_path, max_tokens=40):
    with trio.LocalPool(min_cycle_s=0.0, min_decode_steps=min_decode_steps, checkpoint_dir=str(tmp_path),
                        name=f"decode-{min_decode_steps}") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        sampler = tc.save_weights_and_get_sampling_client("s")
        first = pool.cycle_index
        result = sampler.sample(trio.ModelInput.from_ints([5, 6, 7, 8]), 3,
                                trio.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7)).result(timeout=120)
        record = next(r for r in pool.telemetry.requests if r.op == "sample")
        return result, pool.cycle_index - first, record


def test_a_long_sample_goes_on_over_cycles_and_gives_the_same_samples(tmp_path):
    whole, _, _ = _sample_tokens(None, tmp_path / "a")  # decoded to its end in its cycle
    split, cycles, record = _sample_tokens(4, tmp_path / "b")  # 4 decode steps a cycle (min_cycle_s=0)
    assert cycles >= 40 // 4, f"40 tokens at 4 steps a cycle took {cycles} cycles"
    assert record.status == "ok" and record.tokens == 4 + 3 * 40
    # a row's choices depend on its own uniforms and step: cutting the decode changes nothing
    assert [s.tokens for s in split.sequences] == [s.tokens for s in whole.sequences]
    assert [s.logprobs for s in split.sequences] == [s.logprobs for s in whole.sequences]


@pytest.mark.no_numerics
def test_a_long_sample_does_not_hold_a_neighbours_cycles(tmp_path, transport):
    with trio.LocalPool(min_cycle_s=0.0, min_decode_steps=2, checkpoint_dir=str(tmp_path), name="neighbours") as pool, \
            service(transport, pool) as svc:
        neighbour = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        sampler = svc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
        batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]
        long = sampler.sample(trio.ModelInput.from_ints([5, 6, 7]), 2, trio.SamplingParams(max_tokens=200))
        while not long.done():  # the neighbour trains meanwhile, awaiting every update
            neighbour.forward_backward(batch)
            neighbour.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert [len(s.tokens) for s in long.result().sequences] == [200, 200]
        sample = next(r for r in pool.telemetry.requests if r.op == "sample")
        during = [r for r in pool.telemetry.requests if r.op == "optim_step" and r.cycle > sample.cycle
                  and r.delivered_at < sample.delivered_at]
        # the sample took >= 100 cycles of 2 steps; the neighbour's updates ran in them (in one
        # cycle holding all 200 steps, none could)
        assert len(during) >= 3, f"{len(during)} updates of the neighbour while the sample decoded"


def test_closing_the_pool_fails_a_sample_still_decoding(tmp_path, transport):
    pool = trio.LocalPool(min_cycle_s=0.05, min_decode_steps=1, checkpoint_dir=str(tmp_path), name="closing")
    with service(transport, pool) as svc:
        sampler = svc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
        future = sampler.sample(trio.ModelInput.from_ints([5, 6, 7]), 1, trio.SamplingParams(max_tokens=400))
        deadline = time.monotonic() + 60
        while not any(r.op == "sample" and r.cycle is not None for r in pool.telemetry.requests):
            assert time.monotonic() < deadline, "the sample did not start within 60 s"
            time.sleep(0.01)
        start = pool.cycle_index
        while pool.cycle_index < start + 3:
            time.sleep(0.01)
        pool.close()
        with pytest.raises(trio.PoolClosedError, match="closed while it was sampling"):
            future.result(timeout=30)
    with pytest.raises(ValueError, match="min_decode_steps"):
        trio.LocalPool(min_decode_steps=0)


@pytest.mark.parametrize("vocab", [1, 259, 256, 1000, 1500, 32000])
def test_inverse_cdf_picks_the_token_whose_interval_holds_the_draw(vocab):
    """The CDF (one level up to 4 x _BLOCK ids; beyond, two: float32 weights, block sums
    cumulated in float64) against the float64
    CDF over the whole vocabulary: the picked token's interval holds the draw, up to the float32
    rounding of the weights (a few ulp each) and of a block's sum (at most _BLOCK - 1 additions),
    relative to the total; and a token of zero weight is never picked."""
    gen = torch.Generator().manual_seed(vocab)
    z = torch.randn(64, vocab, generator=gen) * 4
    z[:8, : vocab // 2] = -200.0  # weights that underflow to exactly 0
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1e-12, 0.5, 1 - 1e-12], dtype=torch.float64)
    weights = (z - z.amax(dim=-1, keepdim=True)).exp()
    picked = _inverse_cdf(weights, u)
    p = torch.softmax(z.double(), dim=-1)
    hi = p.cumsum(dim=-1).gather(1, picked[:, None]).squeeze(1)
    lo = hi - p.gather(1, picked[:, None]).squeeze(1)
    slack = (_BLOCK + 4) * torch.finfo(torch.float32).eps
    assert bool(((u >= lo - slack) & (u <= hi + slack)).all())
    assert bool((weights.gather(1, picked[:, None]) > 0).all())
