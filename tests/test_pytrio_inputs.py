"""PyTRIO's input rules in the engine (issue 32 point 3), each checked the way pytrio 0.2.9's own
client checks it (pytrio/client/training_batch.py, plan_training_batch):

* a target token of -100 is "ignore this position": it adds nothing to any loss, gradient or
  count, exactly as a weight of 0 would (checked against an independent reference: the PEFT
  model and the Tinker-docs losses of test_losses.py, over the positions that are read);
* any other target outside [0, vocab) is refused, naming the field, the datum and the position;
* input token ids in [0, vocab); target_tokens int64 and one per input token; weights,
  logprobs and advantages one per token and finite; the inputs each loss needs; a batch not
  empty; a sequence within the model's context; loss names folded in case and space.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from numerics import assert_fp32_close, model_terms, tiny_config
from test_gradients import _peft_model
from test_losses import CASES, loss_magnitude, reference_loss, rl_batch
from transports import inspect, service

import trio_widgets as trio
from trio_widgets.engine.compute import make_forward_job, run_forward_jobs
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.losses import resolved_config
from trio_widgets.engine.models import DEFAULT_MODEL, _build_builtin, load_base_model
from trio_widgets.protocol.losses import IGNORE_TARGET, tokens_read

CONFIG = tiny_config()
VOCAB = CONFIG.vocab_size


@pytest.fixture(scope="module")
def models():
    device = torch.device("cpu")
    return load_base_model(DEFAULT_MODEL, device), _build_builtin(DEFAULT_MODEL, torch.float32)[0]


def _adapter(base) -> LoRAAdapter:
    adapter = LoRAAdapter(base.targets_for(True, True, True), rank=4, seed=1, device=base.device)
    with torch.no_grad():
        for _, lora_b in adapter.weights.values():
            lora_b.copy_(torch.randn(lora_b.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    return adapter


def _ignoring(batch: list[trio.Datum], seed: int) -> tuple[list[trio.Datum], list[np.ndarray]]:
    """The batch with about a third of its targets -100 (never all of a gspo mask), and per datum
    which positions are still read."""
    rng = np.random.default_rng(seed)
    out, kept = [], []
    for datum in batch:
        inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
        n = len(inputs["target_tokens"])
        read = rng.random(n) > 0.35
        read[-1] = True  # the last token is always marked in rl_batch's gspo mask
        inputs["target_tokens"] = [t if r else IGNORE_TARGET for t, r in zip(inputs["target_tokens"], read)]
        out.append(trio.Datum(datum.model_input, inputs))
        kept.append(read)
    return out, kept


@pytest.mark.parametrize("loss_fn,config", CASES)
def test_minus_100_targets_read_nothing_against_a_reference(models, loss_fn, config):
    """Loss, logprobs, elementwise loss, token_count and the gradient of a batch with -100
    targets equal the reference computed over the positions that are read only; at an
    ignored position logprob and loss are exactly 0."""
    base, plain = models
    adapter = _adapter(base)
    batch, kept = _ignoring(rl_batch(hash((loss_fn, str(config), "ignore")) % 1000), seed=7)
    job, weight = make_forward_job(base, batch, loss_fn, resolved_config(loss_fn, config), backward=True)
    (out,) = run_forward_jobs(base, [(adapter, job, "t")], token_budget=4096)
    assert isinstance(out, trio.ForwardBackwardOutput), out
    read_total = int(sum(k.sum() for k in kept))
    if loss_fn == "cross_entropy":
        expected_weight = sum(float(np.asarray(d.loss_fn_inputs["weights"].data)[k].sum()) for d, k in zip(batch, kept))
        assert weight == pytest.approx(expected_weight, rel=1e-12)
        assert out.metrics["token_count"] == sum(int((np.asarray(d.loss_fn_inputs["weights"].data)[k] != 0).sum())
                                                 for d, k in zip(batch, kept))
    else:
        assert out.metrics["token_count"] == read_total

    model = _peft_model(plain, adapter)
    model.zero_grad()
    expected_total = total_magnitude = 0.0
    tokens = sum(d.model_input.length for d in batch)
    longest = max(d.model_input.length for d in batch)
    for datum, read, outputs in zip(batch, kept, out.loss_fn_outputs):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)[read]
        logp_all = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        logp = logp_all[torch.from_numpy(np.flatnonzero(read))].gather(1, targets[:, None])[:, 0]
        inputs = {k: torch.tensor(v.data)[read] for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}
        reference_loss(loss_fn, logp, inputs, config or {}).backward()
        np_inputs = {k: np.asarray(v.data, dtype=np.float64)[read] for k, v in datum.loss_fn_inputs.items()}
        np_loss = float(reference_loss(loss_fn, logp.detach().double().numpy(), np_inputs, config or {}))
        expected_total += np_loss
        n = datum.model_input.length
        got_logp = outputs["logprobs"].to_numpy()
        got_loss = outputs["elementwise_loss"].to_numpy()
        assert np.all(got_logp[~read] == 0.0) and np.all(got_loss[~read] == 0.0), (loss_fn, got_logp, got_loss)
        assert_fp32_close(got_logp[read], logp.detach().numpy(), model_terms(CONFIG, n), f"{loss_fn} logprobs")
        magnitude = loss_magnitude(logp.detach().double().numpy(), np_inputs, loss_fn)
        total_magnitude += magnitude
        assert_fp32_close(float(got_loss.sum()), np_loss, model_terms(CONFIG, n) + n, f"{loss_fn} datum loss",
                          magnitude=magnitude)
    assert_fp32_close(out.metrics["loss:sum"], expected_total, model_terms(CONFIG, longest) + tokens,
                      f"{loss_fn} loss:sum", magnitude=total_magnitude)
    named = dict(model.named_parameters())
    terms = model_terms(CONFIG, longest, batch_tokens=tokens)
    for name, (ga, gb) in adapter.grad.items():
        assert_fp32_close(ga, named[f"base_model.model.{name}.lora_A.default.weight"].grad, terms, f"{name}.lora_A")
        assert_fp32_close(gb, named[f"base_model.model.{name}.lora_B.default.weight"].grad, terms, f"{name}.lora_B")


def test_minus_100_is_the_same_as_weight_zero_through_the_client(pool, transport):
    """Through the client, by every codec: a datum with -100 targets gives the same loss,
    token_count and gradient (the adapter's pending gradient) as the datum with real targets there
    and weight 0."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, VOCAB, size=24).tolist()
    targets = tokens[1:] + [5]
    ignore = [i for i in range(len(targets)) if i < 6 or i % 4 == 0]
    masked = trio.Datum(trio.ModelInput.from_ints(tokens),
                        {"target_tokens": [IGNORE_TARGET if i in ignore else t for i, t in enumerate(targets)]})
    weights = [0.0 if i in ignore else 1.0 for i in range(len(targets))]
    weighted = trio.Datum(trio.ModelInput.from_ints(tokens), {"target_tokens": targets, "weights": weights})
    results = []
    with service(transport, pool) as svc:
        for datum in (masked, weighted):
            tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
            out = tc.forward_backward([datum]).result(timeout=60)
            results.append((out, inspect(svc, pool, tc)))
    (a, snap_a), (b, snap_b) = results
    assert a.metrics["token_count"] == b.metrics["token_count"] == len(targets) - len(ignore)
    terms = model_terms(CONFIG, len(tokens), batch_tokens=len(tokens))
    assert_fp32_close(a.metrics["loss:sum"], b.metrics["loss:sum"], terms, "loss:sum")
    assert a.metrics["loss:sum"] > 1.0  # a real loss, so the equality means something
    for name, grads in snap_a.grad.items():
        for got, want in zip(grads, snap_b.grad[name]):
            assert_fp32_close(got, want, terms, name)


# -- what is refused, each naming the field ------------------------------------------------------

def _datum(tokens, **inputs) -> trio.Datum:
    return trio.Datum(trio.ModelInput.from_ints(tokens), inputs)


@pytest.mark.parametrize("bad", [-1, -99, -101, VOCAB, VOCAB + 100])
def test_other_out_of_range_targets_are_refused_naming_the_field(pool, bad):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    data = [_datum([5, 6, 7], target_tokens=[6, 7, 8]), _datum([5, 6, 7], target_tokens=[6, bad, IGNORE_TARGET])]
    with pytest.raises(trio.InvalidInputError) as info:
        tc.forward_backward(data).result(timeout=60)
    message = str(info.value)
    assert message.startswith("data[1].loss_fn_inputs['target_tokens']: ") and info.value.datum_index == 1
    assert f"target token id {bad} at position 1 is " in message and "and not -100 (ignore this position)" in message
    assert (f"outside the vocabulary [0, {VOCAB})" if bad >= 0 else "is negative") in message
    assert tc.pool.queue_depths()[tc.client_id] == 0  # nothing was queued


def test_negative_ids_are_refused_before_anything_is_sent():
    """Without a model (the client's own check, before any request): a negative input id, or
    a negative target other than -100, is refused naming the field."""
    from trio_widgets.validation import check_batch

    with pytest.raises(trio.InvalidInputError, match=r"^data\[0\]\.model_input: token id -100 at position 1 is "
                                                      r"negative"):
        check_batch([_datum([5, -100, 7], target_tokens=[1, 2, 3])], "cross_entropy")
    with pytest.raises(trio.InvalidInputError, match=r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: target token "
                                                      r"id -5 at position 2 is negative and not -100"):
        check_batch([_datum([5, 6, 7], target_tokens=[1, -100, -5])], "cross_entropy")
    checked = check_batch([_datum([5, 6, 7], target_tokens=[-100, 2, -100], weights=[1.0, 0.5, 1.0])],
                          "cross_entropy")
    assert checked[0].read == [False, True, False] and checked[0].weight == 0.5


def test_input_tokens_out_of_the_vocabulary_are_refused(pool):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    with pytest.raises(trio.InvalidInputError, match=rf"^data\[0\]\.model_input: token id {VOCAB} at position 2 is "
                                                      rf"outside the vocabulary \[0, {VOCAB}\)"):
        tc.forward([_datum([5, 6, VOCAB], target_tokens=[6, 7, 8])]).result(timeout=60)


@pytest.mark.parametrize("case,pattern", [
    ("empty batch", r"^data: the batch is empty"),
    ("float targets", r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: target tokens must be integers"),
    ("short targets", r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: has length 2 but model_input has length 3"),
    ("2-D targets", r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: must be one value per token \(1-D\)"),
    ("short weights", r"^data\[0\]\.loss_fn_inputs\['weights'\]: has length 4"),
    ("NaN weight", r"^data\[0\]\.loss_fn_inputs\['weights'\]: value nan at position 1 is not finite"),
    ("inf logprob", r"^data\[0\]\.loss_fn_inputs\['logprobs'\]: value -inf at position 0 is not finite"),
    ("NaN advantage", r"^data\[0\]\.loss_fn_inputs\['advantages'\]: value nan at position 2 is not finite"),
    ("no advantages", r"^data\[0\]\.loss_fn_inputs: loss 'ppo' needs loss_fn_inputs\['advantages'\]"),
    ("no targets", r"^data\[0\]\.loss_fn_inputs: loss 'cross_entropy' needs loss_fn_inputs\['target_tokens'\]"),
    ("empty input", r"^data\[0\]\.model_input: model_input is empty"),
    ("unknown loss", r"^loss_fn: unknown loss_fn 'ppo2'"),
])
def test_pytrios_other_input_rules(pool, case, pattern):
    """Each rule of pytrio's plan_training_batch, refused here too with the field named."""
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    rl = {"target_tokens": [6, 7, 8], "logprobs": [-1.0, -1.0, -1.0], "advantages": [1.0, 0.0, -1.0]}
    calls = {
        "empty batch": ([], "cross_entropy"),
        "float targets": ([_datum([5, 6, 7], target_tokens=[6.5, 7.0, 8.0])], "cross_entropy"),
        "short targets": ([_datum([5, 6, 7], target_tokens=[6, 7])], "cross_entropy"),
        "2-D targets": ([_datum([5, 6, 7], target_tokens=np.array([[6], [7], [8]]))], "cross_entropy"),
        "short weights": ([_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0] * 4)], "cross_entropy"),
        "NaN weight": ([_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0, float("nan"), 1.0])],
                       "cross_entropy"),
        "inf logprob": ([_datum([5, 6, 7], **{**rl, "logprobs": [-float("inf"), -1.0, -1.0]})], "ppo"),
        "NaN advantage": ([_datum([5, 6, 7], **{**rl, "advantages": [1.0, 1.0, float("nan")]})], "importance_sampling"),
        "no advantages": ([_datum([5, 6, 7], target_tokens=[6, 7, 8], logprobs=[-1.0] * 3)], "ppo"),
        "no targets": ([_datum([5, 6, 7], weights=[1.0] * 3)], "cross_entropy"),
        "empty input": ([_datum([], target_tokens=[])], "cross_entropy"),
        "unknown loss": ([_datum([5, 6, 7], target_tokens=[6, 7, 8])], "ppo2"),
    }
    data, loss_fn = calls[case]
    with pytest.raises(trio.InvalidInputError, match=pattern):
        tc.forward_backward(data, loss_fn).result(timeout=60)


def test_context_and_loss_name_rules(pool, models):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    too_long = models[0].limits.context_length + 1
    with pytest.raises(trio.InvalidInputError, match=r"^data\[0\]\.model_input: model_input has \d+ tokens, more "
                                                      r"than the context"):
        tc.forward([_datum([5] * too_long, target_tokens=[5] * too_long)]).result(timeout=60)
    # pytrio folds case and surrounding spaces; -100 works with every loss name spelling
    out = tc.forward([_datum([5, 6, 7], target_tokens=[IGNORE_TARGET, 7, 8])], "  Cross_Entropy ").result(timeout=60)
    assert out.metrics["token_count"] == 2 and out.loss_fn_outputs[0]["logprobs"].data[0] == 0.0


def test_gspo_mask_of_only_ignored_tokens_is_refused(pool):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    datum = _datum([5, 6, 7], target_tokens=[6, IGNORE_TARGET, IGNORE_TARGET], logprobs=[-1.0] * 3,
                   advantages=[1.0] * 3, sequence_ratio_mask=[0, 1, 1])
    with pytest.raises(trio.InvalidInputError, match=r"sequence_ratio_mask'\] marks no token other than those whose "
                                                      r"target_tokens is -100"):
        tc.forward_backward([datum], "gspo").result(timeout=60)


def test_token_count_rule_matches_pytrios():
    """tokens_read is pytrio's total_active_tokens (plan_training_batch), on the same data."""
    hook = sys.excepthook
    import pytrio.types as pt
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits

    sys.excepthook = hook  # importing pytrio installs its own hook; leave the test process as it was
    rng = np.random.default_rng(11)
    for loss_fn in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro"):
        data, ours = [], 0
        for _ in range(4):
            n = int(rng.integers(3, 12))
            targets = [IGNORE_TARGET if rng.random() < 0.3 else int(rng.integers(0, VOCAB)) for _ in range(n)]
            weights = [float(rng.choice([0.0, 0.5, 1.0])) for _ in range(n)]
            inputs = {"target_tokens": pt.TensorData(data=targets, dtype="int64", shape=[n]),
                      "weights": pt.TensorData(data=weights, dtype="float32", shape=[n]),
                      "logprobs": pt.TensorData(data=[-1.0] * n, dtype="float32", shape=[n]),
                      "advantages": pt.TensorData(data=[1.0] * n, dtype="float32", shape=[n])}
            data.append(pt.Datum(model_input=pt.ModelInput.from_ints([3] * n), loss_fn_inputs=inputs))
            ours += tokens_read(loss_fn, n, weights, targets)
        plan = plan_training_batch(data, loss_fn=loss_fn, auto_shift=False, limits=TrainingLimits(None, None, None),
                                   tokenizer_vocab_size=VOCAB)
        assert plan.totals.total_active_tokens == ours, loss_fn


@pytest.mark.parametrize("args,pattern", [
    (([], 1, trio.SamplingParams(max_tokens=2)), r"^prompt: the prompt is empty"),
    (([5, 6], 1, trio.SamplingParams(max_tokens=0)), r"^sampling_params\.max_tokens: must be an integer >= 1, got 0"),
    (([5, 6], 1, trio.SamplingParams(max_tokens=None)),  # pytrio's default, which pytrio refuses at sample time
     r"^sampling_params\.max_tokens: must be an integer >= 1, got None"),
    (([5, 6], 0, trio.SamplingParams(max_tokens=2)), r"^num_samples: must be an integer >= 1, got 0"),
], ids=["empty-prompt", "max-tokens-0", "max-tokens-None", "no-samples"])
def test_pytrios_sampling_rules(pool, args, pattern):
    """pytrio's SamplingClient refuses an empty prompt and max_tokens that is None or <= 0."""
    sampler = trio.ServiceClient(pool).create_sampling_client(base_model=trio.DEFAULT_MODEL)
    with pytest.raises(trio.InvalidInputError, match=pattern):
        sampler.sample(*args).result(timeout=60)
