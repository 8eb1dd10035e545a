"""The GPU path: a bf16 base with fp32 LoRA and AdamW, on CUDA.

* isolation: tenants packed into one cycle get what they get in a cycle alone, within the
  rounding a bf16 base allows (and a neighbour's adapter moves the result by more than that);
* gradients equal PEFT's, computed on the same device from the same adapter;
* greedy sampling picks the argmax of the model's next-token logits (PEFT's, teacher-forced);
* checkpoints round-trip: weights and AdamW state exactly, into a pool on the same device
  and into a CPU pool.

Skipped without CUDA. `benchmarks/gpu_check.sh --dry-run` (exercised by tests/test_gpu_check.py)
runs them on CPU, over the fp32 base a CPU pool uses, to prove the plumbing.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import random_batch, write_peft_adapter
from numerics import assert_close, model_roundings, model_terms, tiny_config, tolerance

import trio_widgets as trio
from trio_widgets.engine.models import _build_builtin

peft = pytest.importorskip("peft")

ON_CPU_ENV = "TRIO_CUDA_TESTS_ON_CPU"  # set by gpu_check.sh --dry-run
if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get(ON_CPU_ENV) == "1":
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason=f"no CUDA device (torch.cuda.is_available() is False); {ON_CPU_ENV}=1 runs these on "
                           f"CPU, as `benchmarks/gpu_check.sh --dry-run` does")

CONFIG = tiny_config()
ROUNDINGS = model_roundings(CONFIG)
# Equal ranks with different alphas (one batched group, per-segment scales) next to another
# rank (a separate group: the delta is added per segment).
TENANTS = [dict(rank=8, alpha=8.0), dict(rank=8, alpha=64.0), dict(rank=4, alpha=32.0)]
NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[str]:
    """PEFT-written adapters with random non-zero B (so every A gets a gradient and each
    tenant's delta is large enough that a leak would show)."""
    directory = tmp_path_factory.mktemp("adapters")
    return [write_peft_adapter(directory / f"tenant-{t}", NAMES, spec["rank"], spec["alpha"], seed=t, b_scale=0.2)
            for t, spec in enumerate(TENANTS)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.0, device=DEVICE, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                        name=f"cuda-tests-{DEVICE}") as pool:
        yield pool


@pytest.fixture(scope="module")
def base_dtype(pool) -> torch.dtype:
    dtype = pool.get_base_model(trio.DEFAULT_MODEL).dtype
    assert dtype == (torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    return dtype


def batch_for(t: int) -> list[trio.Datum]:
    return random_batch(100 + t, n=2, length=16) + random_batch(200 + t, n=1, length=9)


def eval_for(t: int) -> list[trio.Datum]:
    return random_batch(300 + t, n=2, length=11) + random_batch(400 + t, n=1, length=6)


def logprobs(output: trio.ForwardBackwardOutput) -> torch.Tensor:
    return torch.cat([o["logprobs"].to_torch() for o in output.loss_fn_outputs])


def test_isolation_joint_vs_solo(pool, adapters, base_dtype):
    """Twins from the same adapter: one set shares a cycle, the other runs a cycle each."""
    service = trio.ServiceClient(pool)
    joint = [service.create_training_client_from_state(p) for p in adapters]
    solo = [service.create_training_client_from_state(p) for p in adapters]
    with pool.hold():
        j_fwd = [c.forward(eval_for(t)) for t, c in enumerate(joint)]
        j_fb = [c.forward_backward(batch_for(t)) for t, c in enumerate(joint)]
        j_snap = [c.inspect_adapter() for c in joint]
    s_fwd, s_fb, s_snap = [], [], []
    for t, c in enumerate(solo):
        s_fwd.append(c.forward(eval_for(t)))
        s_fb.append(c.forward_backward(batch_for(t)))
        s_snap.append(c.inspect_adapter())
        s_snap[-1].result(timeout=300)  # done before the next twin submits: nothing shares its cycles
    assert len({f.cycle for f in j_fwd}) == 1 and len({f.cycle for f in j_fb}) == 1
    assert len({f.cycle for f in s_fwd + s_fb}) == 2 * len(solo)
    for t in range(len(TENANTS)):
        where = f"tenant {t} {TENANTS[t]} on {DEVICE} ({base_dtype} base)"
        seq = max(d.model_input.length for d in batch_for(t) + eval_for(t))
        tokens = sum(d.model_input.length for d in batch_for(t))
        a, b = logprobs(j_fwd[t].result(timeout=300)), logprobs(s_fwd[t].result(timeout=300))
        assert_close(a, b, model_terms(CONFIG, seq), f"{where}: forward logprobs", base_dtype=base_dtype,
                     roundings=ROUNDINGS)
        loss_magnitude = sum(float(o["elementwise_loss"].to_torch().abs().sum())
                             for o in s_fb[t].result().loss_fn_outputs)
        assert_close(j_fb[t].result().metrics["loss:sum"], s_fb[t].result().metrics["loss:sum"],
                     model_terms(CONFIG, seq) + tokens, f"{where}: loss:sum", magnitude=loss_magnitude,
                     base_dtype=base_dtype, roundings=ROUNDINGS)
        jg, sg = j_snap[t].result().grad_dict(), s_snap[t].result().grad_dict()
        assert jg.keys() == sg.keys() and jg
        for key in jg:
            assert float(sg[key].abs().max()) > 0, f"{where}: {key} got no gradient"
            assert_close(jg[key], sg[key], model_terms(CONFIG, seq, batch_tokens=tokens), f"{where}: {key} gradient",
                         base_dtype=base_dtype, roundings=ROUNDINGS)

    # The tolerance can tell tenants apart: a neighbour's adapter moves a tenant's log-probs
    # by more than it allows (else the comparisons above would prove nothing).
    with pool.hold():
        swapped = solo[1].forward(eval_for(0))
    own, other = logprobs(s_fwd[0].result()), logprobs(swapped.result(timeout=300))
    seq = max(d.model_input.length for d in eval_for(0))
    allowed = tolerance(float(own.abs().max()), model_terms(CONFIG, seq), base_dtype, ROUNDINGS)
    assert float((own - other).abs().max()) > allowed, "the tolerance is too loose to see another tenant's adapter"


def peft_reference(adapter_path: str, base_dtype: torch.dtype) -> torch.nn.Module:
    """PEFT's LoRA over the same base weights, in the pool's dtype, on the same device
    (its LoRA weights fp32, as ours)."""
    plain, _ = _build_builtin(trio.DEFAULT_MODEL, base_dtype)
    model = peft.PeftModel.from_pretrained(plain.to(DEVICE), adapter_path, is_trainable=True)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    return model


def test_gradients_match_peft_on_the_same_device(pool, adapters, base_dtype):
    for t in (0, 2):
        tc = trio.ServiceClient(pool).create_training_client_from_state(adapters[t])
        batch = batch_for(t)
        tc.forward_backward(batch).result(timeout=300)
        ours = tc.inspect_adapter().result(timeout=300).grad_dict()
        model = peft_reference(adapters[t], base_dtype)
        for datum in batch:  # one sequence at a time: no packing, no padding
            ids = torch.tensor([datum.model_input.to_ints()], device=DEVICE)
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data, device=DEVICE)
            weights = torch.tensor(datum.loss_fn_inputs["weights"].data, device=DEVICE)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1).gather(1, targets[:, None])[:, 0]
            (-(weights * logp).sum()).backward()
        named = dict(model.named_parameters())
        terms = model_terms(CONFIG, max(d.model_input.length for d in batch),
                            batch_tokens=sum(d.model_input.length for d in batch))
        for key, grad in ours.items():
            name, ab = key.rsplit(".lora_", 1)
            reference = named[f"base_model.model.{name}.lora_{ab}.default.weight"].grad
            assert_close(grad, reference, terms, f"tenant {t}: {key} gradient vs PEFT on {DEVICE}",
                         base_dtype=base_dtype, roundings=ROUNDINGS)


def test_greedy_sampling_is_the_argmax(pool, adapters, base_dtype):
    tc = trio.ServiceClient(pool).create_training_client_from_state(adapters[1])
    sampler = tc.save_weights_and_get_sampling_client()
    model = peft_reference(adapters[1], base_dtype).eval()
    greedy = trio.SamplingParams(max_tokens=12, temperature=0.0)
    for p, prompt in enumerate(([5, 40, 41, 42, 7], [3 + b for b in b"The cat "])):
        tokens = sampler.sample(trio.ModelInput.from_ints(prompt), 2, greedy).result(timeout=300).sequences
        assert tokens[0].tokens == tokens[1].tokens, "greedy samples of one prompt differ"
        out = tokens[0].tokens
        assert len(out) == 12
        with torch.no_grad():  # teacher-forced on what we sampled: row i predicts token i + 1
            logits = model(input_ids=torch.tensor([prompt + out], device=DEVICE)).logits[0].float()
        terms = model_terms(CONFIG, len(prompt) + len(out))
        for i, token in enumerate(out):
            row = logits[len(prompt) - 1 + i]
            gap = float(row.max() - row[token])
            # only a tie within rounding may pick another token than the reference's argmax
            allowed = tolerance(float(row.abs().max()), terms, base_dtype, ROUNDINGS)
            assert token == int(row.argmax()) or gap <= allowed, (
                f"prompt {p} step {i}: sampled {token}, argmax {int(row.argmax())}, "
                f"logit gap {gap:.3g} > {allowed:.3g}")


def test_checkpoints_round_trip(pool, adapters, base_dtype):
    service = trio.ServiceClient(pool)
    tc = service.create_training_client_from_state(adapters[2])
    for step in range(2):
        tc.forward_backward(batch_for(step))
        tc.optim_step(trio.AdamParams(learning_rate=1e-3, weight_decay=0.01)).result(timeout=300)
    state = tc.save_state("round-trip").result(timeout=300).path
    sampler_path = tc.save_weights_for_sampler("round-trip-w").result(timeout=300).path
    before = tc.inspect_adapter().result(timeout=300)

    resumed = service.create_training_client_from_state_with_optimizer(state)
    with trio.LocalPool(min_cycle_s=0.0, device="cpu", name="cuda-tests-cpu-side") as cpu_pool:
        # another pool, another checkpoint_dir: the checkpoint by its directory (tinker:// paths name a pool's own)
        on_cpu = trio.ServiceClient(cpu_pool).create_training_client_from_state_with_optimizer(
            str(pool.checkpoint_path(state)))
        for where, client in ((DEVICE, resumed), ("a CPU pool", on_cpu)):
            after = client.inspect_adapter().result(timeout=300)
            assert after.step == before.step == 2 and after.alpha == before.alpha and after.rank == before.rank
            for table in ("weights", "exp_avg", "exp_avg_sq"):
                mine, theirs = getattr(before, table), getattr(after, table)
                assert mine.keys() == theirs.keys() and mine
                for name in mine:
                    for x, y in zip(mine[name], theirs[name]):
                        assert torch.equal(x, y), f"{table}[{name}] changed on the round trip to {where}"

    # The next update from the resumed state is the original's.
    fb = [c.forward_backward(batch_for(5)) for c in (tc, resumed)]
    losses = [f.result(timeout=300).metrics["loss:sum"] for f in fb]
    seq, tokens = 16, sum(d.model_input.length for d in batch_for(5))
    assert_close(losses[1], losses[0], model_terms(CONFIG, seq) + tokens, "loss after resuming",
                 magnitude=abs(losses[0]), base_dtype=base_dtype, roundings=ROUNDINGS)

    # A sampler from the saved weights scores a sequence as the original's sampler does.
    original = tc.save_weights_and_get_sampling_client()  # (the same weights: no optim_step since the save)
    loaded = service.create_sampling_client(model_path=sampler_path)
    text = trio.ModelInput.from_ints([3 + b for b in b"It was the best of times"])
    a, b = (torch.tensor(s.compute_logprobs(text).result(timeout=300)[1:]) for s in (original, loaded))
    assert_close(b, a, model_terms(CONFIG, text.length), "sampler logprobs after the round trip",
                 base_dtype=base_dtype, roundings=ROUNDINGS)
