"""Tenants packed into one pass get what they would get alone.

What holds, precisely: from the same state, a tenant's forward, forward_backward,
optim_step and samples in a shared cycle equal those of a cycle it has to itself, within
fp32 rounding (the packed pass adds the same numbers in another order: BLAS blocks rows
differently for a taller matrix). So each step is compared from identical state: the
solo mirror loads the joint tenant's checkpoint before every step. Whole trajectories are
not compared: AdamW divides each gradient entry by its running RMS, so rounding-level
differences in small entries become full-size steps and runs drift apart chaotically,
packed or not (another thread count does the same).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, write_peft_adapter
from numerics import assert_fp32_close, model_terms, tiny_config
from transports import adapter_of, inspect

import trio_widgets as trio

peft = pytest.importorskip("peft")

# The first three share a rank but not an alpha (the case that used to leak: a group of
# equal-rank segments took the first one's scale); the others mix ranks and alphas.
# "ours": made by create_lora_training_client (alpha 32); the rest are PEFT adapters
# written by the peft library and resumed with create_training_client_from_state.
TENANTS = [
    dict(rank=8, alpha=8.0, lr=3e-3, kinds=("attn", "mlp", "unembed")),
    dict(rank=8, alpha=16.0, lr=1e-3, kinds=("attn", "mlp")),
    dict(rank=8, alpha=32.0, lr=5e-3, kinds=("attn", "mlp", "unembed"), ours=True),
    dict(rank=4, alpha=64.0, lr=2e-3, kinds=("attn", "unembed")),
    dict(rank=16, alpha=4.0, lr=2e-3, kinds=("mlp", "unembed")),
]
STEPS = 3
CONFIG = tiny_config()


def peft_adapter(directory, t: int) -> str:
    """A LoRA adapter written by PEFT itself, with random non-zero B so alpha matters at once."""
    spec = TENANTS[t]
    with trio.LocalPool(min_cycle_s=0.0, name="names") as pool:
        base = pool.get_base_model(trio.DEFAULT_MODEL)
        names = sorted(n for n, (kind, _, _) in base.lora_targets.items() if kind in spec["kinds"])
    return write_peft_adapter(directory / f"peft-{t}", names, spec["rank"], spec["alpha"], seed=t, b_scale=0.05)


def make_client(pool: trio.LocalPool, t: int, adapters: dict[int, str]) -> trio.TrainingClient:
    service = trio.ServiceClient(pool)
    spec = TENANTS[t]
    if spec.get("ours"):
        flags = {f"train_{k}": k in spec["kinds"] for k in ("attn", "mlp", "unembed")}
        return service.create_lora_training_client(trio.DEFAULT_MODEL, rank=spec["rank"], seed=33, **flags)
    return service.create_training_client_from_state(adapters[t])


def batches_for(t: int) -> list[list[trio.Datum]]:
    # Every tenant brings sequences of the same lengths (16, 16, 9: varlen attention), so
    # its segment is as long as its neighbours' and equal-rank tenants share one batched
    # LoRA group in every layer: the case where a group once took one tenant's scale.
    return [random_batch(1000 * t + s, n=2, length=16) + random_batch(500 + 1000 * t + s, n=1, length=9)
            for s in range(STEPS)]


def eval_batch(t: int) -> list[trio.Datum]:
    return random_batch(77 + t, n=2, length=11) + random_batch(88 + t, n=1, length=6)


def run_step(pool: trio.LocalPool, clients: dict[int, trio.TrainingClient], step: int) -> dict[int, dict]:
    """One step for every client, each op of every client in the same cycle:
    forward (evaluation), forward_backward (+ a snapshot holding its gradient), optim_step."""
    out: dict[int, dict] = {t: {} for t in clients}
    with pool.hold():
        fwd = {t: c.forward(eval_batch(t)) for t, c in clients.items()}
    with pool.hold():
        fb = {t: c.forward_backward(batches_for(t)[step]) for t, c in clients.items()}
        before = {t: c.inspect_adapter() for t, c in clients.items()}
    with pool.hold():
        opt = {t: c.optim_step(trio.AdamParams(learning_rate=TENANTS[t]["lr"])) for t, c in clients.items()}
        after = {t: c.inspect_adapter() for t, c in clients.items()}
    for t in clients:
        out[t] = dict(forward=fwd[t].result(timeout=120), fb=fb[t].result(timeout=120),
                      before=before[t].result(timeout=120), after=after[t].result(timeout=120))
        opt[t].result(timeout=120)
    for futures in (fwd, fb, opt):
        assert len({f.cycle for f in futures.values()}) == 1, "not all tenants ran in one cycle"
    return out


def reference_adamw(snap: trio.AdapterSnapshot, lr: float, key: str) -> torch.Tensor:
    """torch.optim.AdamW's update (defaults of AdamParams), in float64, from a snapshot."""
    p = trio.AdamParams(learning_rate=lr)
    name, ab = key.rsplit(".lora_", 1)
    i = "AB".index(ab)
    w = snap.weights[name][i].double()
    g = snap.grad[name][i].double()
    m = snap.exp_avg[name][i].double() if snap.exp_avg else torch.zeros_like(w)
    v = snap.exp_avg_sq[name][i].double() if snap.exp_avg_sq else torch.zeros_like(w)
    t = snap.step + 1
    m = p.beta1 * m + (1 - p.beta1) * g
    v = p.beta2 * v + (1 - p.beta2) * g * g
    m_hat, v_hat = m / (1 - p.beta1 ** t), v / (1 - p.beta2 ** t)
    return w * (1 - lr * p.weight_decay) - lr * m_hat / (v_hat.sqrt() + p.eps)


def compare_step(t: int, joint: dict, solo: dict, step: int) -> None:
    where = f"tenant {t} (rank {TENANTS[t]['rank']}, alpha {TENANTS[t]['alpha']}) step {step}"
    longest = max(d.model_input.length for d in batches_for(t)[step] + eval_batch(t))
    tokens = sum(d.model_input.length for d in batches_for(t)[step])
    # forward: log-probabilities of the evaluation batch
    for d, (a, b) in enumerate(zip(joint["forward"].loss_fn_outputs, solo["forward"].loss_fn_outputs)):
        assert_fp32_close(a["logprobs"].to_torch(), b["logprobs"].to_torch(),
                          model_terms(CONFIG, seq_len=longest), f"{where} forward logprobs[{d}]")
    # forward_backward: loss (a sum over the batch's tokens), logprobs, the gradient
    loss_magnitude = sum(float(o["elementwise_loss"].to_torch().abs().sum()) for o in solo["fb"].loss_fn_outputs)
    assert_fp32_close(joint["fb"].metrics["loss:sum"], solo["fb"].metrics["loss:sum"],
                      model_terms(CONFIG, seq_len=longest) + tokens, f"{where} loss:sum", magnitude=loss_magnitude)
    for d, (a, b) in enumerate(zip(joint["fb"].loss_fn_outputs, solo["fb"].loss_fn_outputs)):
        assert_fp32_close(a["logprobs"].to_torch(), b["logprobs"].to_torch(),
                          model_terms(CONFIG, seq_len=longest), f"{where} forward_backward logprobs[{d}]")
    jg, sg = joint["before"].grad_dict(), solo["before"].grad_dict()
    assert jg.keys() == sg.keys() and jg
    for key in jg:
        if key.endswith("lora_B"):  # (A has none while B is still zero: ours start so)
            assert float(sg[key].abs().max()) > 0, f"{where}: {key} got no gradient"
        assert_fp32_close(jg[key], sg[key], model_terms(CONFIG, seq_len=longest, batch_tokens=tokens),
                          f"{where} gradient {key}")
    # optim_step: the tenant's own AdamW on its own gradient, whatever shared the cycle.
    # An update has ~10 roundings of magnitude max(|w|, lr) (AdamW's elementwise formula).
    after = joint["after"].state_dict()
    for key in after:
        assert_fp32_close(after[key], reference_adamw(joint["before"], TENANTS[t]["lr"], key), 10,
                          f"{where} weights after optim_step {key}")
    assert joint["after"].step == joint["before"].step + 1


def test_mixed_alphas_and_ranks_match_solo_step_by_step(tmp_path):
    adapters = {t: peft_adapter(tmp_path, t) for t, spec in enumerate(TENANTS) if not spec.get("ours")}
    with trio.LocalPool(min_cycle_s=0.0, name="joint", checkpoint_dir=tmp_path / "ckpt") as joint_pool:
        joint = {t: make_client(joint_pool, t, adapters) for t in range(len(TENANTS))}
        alphas = {t: c.inspect_adapter().result(timeout=60).alpha for t, c in joint.items()}
        assert alphas == {t: spec["alpha"] for t, spec in enumerate(TENANTS)}
        solo_pools = {t: trio.LocalPool(min_cycle_s=0.0, name=f"solo-{t}", checkpoint_dir=tmp_path / "ckpt")
                      for t in joint}
        try:
            solo = {t: make_client(solo_pools[t], t, adapters) for t in joint}
            for step in range(STEPS):
                saved = {t: c.save_state(f"step-{step}") for t, c in joint.items()}
                for t, c in solo.items():  # the mirror starts this step from the joint tenant's state
                    c.load_state_with_optimizer(saved[t].result(timeout=60).path).result(timeout=60)
                joint_out = run_step(joint_pool, joint, step)
                for t in joint:
                    solo_out = run_step(solo_pools[t], {t: solo[t]}, step)[t]
                    compare_step(t, joint_out[t], solo_out, step)
            compare_sampling(joint, solo, solo_pools, joint_pool)
        finally:
            for p in solo_pools.values():
                p.close()


def compare_sampling(joint: dict, solo: dict, solo_pools: dict, joint_pool: trio.LocalPool) -> None:
    """All tenants' samplers in one cycle vs each alone, from the same weights."""
    for t, c in solo.items():
        path = joint[t].save_state("final").result(timeout=60).path
        c.load_state_with_optimizer(path).result(timeout=60)
    # .result(): a snapshot's sampler exists after its cycle, and no cycle runs inside hold()
    joint_samplers = {t: c.save_weights_and_get_sampling_client().result() for t, c in joint.items()}
    solo_samplers = {t: c.save_weights_and_get_sampling_client().result() for t, c in solo.items()}
    prompts = {t: trio.ModelInput.from_ints([5 + t, 40, 41, 42 + t, 7]) for t in joint}
    greedy = trio.SamplingParams(max_tokens=6, temperature=0.0)
    seeded = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    with joint_pool.hold():
        futures = {t: (s.sample(prompts[t], 2, greedy), s.sample(prompts[t], 2, seeded),
                       s.compute_logprobs(prompts[t])) for t, s in joint_samplers.items()}
    assert len({f.cycle for fs in futures.values() for f in fs}) == 1
    terms = model_terms(CONFIG, seq_len=5 + 6)
    for t, (fg, fs, fl) in futures.items():
        where = f"tenant {t} sampling"
        mine = solo_samplers[t]
        assert_fp32_close(torch.tensor(fl.result()[1:]), torch.tensor(mine.compute_logprobs(prompts[t]).result()[1:]),
                          terms, f"{where} compute_logprobs")
        for seq in fg.result().sequences + fs.result().sequences:
            # what the joint cycle sampled has, alone, the log-probabilities the joint cycle reported
            full = prompts[t].to_ints() + seq.tokens
            alone = mine.compute_logprobs(trio.ModelInput.from_ints(full)).result()[len(prompts[t].to_ints()):]
            assert_fp32_close(torch.tensor(seq.logprobs), torch.tensor(alone), terms, f"{where} sampled logprobs")
        solo_greedy = mine.sample(prompts[t], 1, greedy).result().sequences[0]
        for i, (a, b) in enumerate(zip(fg.result().sequences[0].tokens, solo_greedy.tokens)):
            if a != b:  # only a tie within rounding may pick another argmax
                assert_fp32_close(fg.result().sequences[0].logprobs[i], solo_greedy.logprobs[i], terms,
                                  f"{where} greedy token {i}: {a} vs {b}")
                break


def test_flags_choose_the_wrapped_layers(pool, svc):
    only_attn = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0, train_mlp=False,
                                                train_unembed=False)
    names = inspect(svc, pool, only_attn).weights.keys()
    assert names and all("self_attn" in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    every = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    every_names = inspect(svc, pool, every).weights
    assert "lm_head" in every_names
    assert any(n.endswith("mlp.down_proj") for n in every_names)


def test_same_seed_same_init_different_seed_different(pool, svc):
    wa, wb, wc = (adapter_of(svc, pool, svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=s))
                  for s in (5, 5, 6))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.lora_A"], wc["lm_head.lora_A"])
    assert all(float(v.abs().sum()) == 0 for k, v in wa.items() if k.endswith(".lora_B"))


@pytest.mark.parametrize("budget", [7, 40])
def test_micro_batches_give_the_same_gradient(budget, tmp_path):
    """A cycle cut into micro-batches by the token budget accumulates the same gradient
    (the same per-token terms, summed in another order)."""
    batch = random_batch(77, n=5, length=12, vary=True)
    adapter = peft_adapter(tmp_path, 0)  # non-zero B, so that A gets a gradient too
    grads = {}
    for b in (budget, 100_000):
        with trio.LocalPool(min_cycle_s=0.0, max_tokens_per_pass=b, name=f"mb-{b}") as pool:
            tc = trio.ServiceClient(pool).create_training_client_from_state(adapter)
            tc.forward_backward(batch).result(timeout=60)
            grads[b] = tc.inspect_adapter().result(timeout=60).grad_dict()
    tokens = sum(d.model_input.length for d in batch)
    longest = max(d.model_input.length for d in batch)
    for key, g in grads[budget].items():
        assert float(g.abs().max()) > 0
        assert_fp32_close(g, grads[100_000][key], model_terms(CONFIG, seq_len=longest, batch_tokens=tokens),
                          f"gradient {key} with a budget of {budget} tokens")
