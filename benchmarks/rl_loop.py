"""An RL-shaped loop for 8 LoRA tenants: the pool vs PEFT + `generate` + AdamW, side by side.

One iteration, per tenant: snapshot the policy, sample 4 continuations of its prompt
(temperature 1, `--new` tokens), score them (a toy reward: the share of tokens in the lower
half of the vocabulary; advantage = reward - the group's mean), then one importance-sampling
update (forward_backward + optim_step) on the 4 sequences.

  pool  every tenant's step through one `LocalPool` (public API): the 8 sample requests in one
        cycle, then the 8 updates in one cycle
  PEFT  the same loop as one writes it with PEFT: per tenant, `set_adapter`, `generate`
        (logprobs from its logits), the same loss, backward, its own torch AdamW

Target (issue 33): the pool >= 1.5x faster per iteration. Medians of interleaved iterations.

Run: .venv/bin/python benchmarks/rl_loop.py [--shapes builtin,llama] [--reps 3] [--new 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import side_by_side  # noqa: E402
from sampling import LLAMA, RANK, SAMPLES, TENANTS, left_padded, peft_model, prompts  # noqa: E402
from vs_peft import plain_model, save_random_llama  # noqa: E402

import trio_widgets as trio  # noqa: E402
from trio_widgets.engine.models import DEFAULT_MODEL, auto_torch_threads, resolve_device, usable_cpus  # noqa: E402

ADAM = trio.AdamParams(learning_rate=1e-4)


def reward(tokens: list[int], vocab: int) -> float:
    return sum(t < vocab // 2 for t in tokens) / max(1, len(tokens))


def advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def measure(name: str, device: torch.device, args) -> dict[str, float]:
    new = args.new
    pool = trio.LocalPool(min_cycle_s=0.0, device=device, name="rl-loop")
    try:
        service = trio.ServiceClient(pool)
        base = pool.get_base_model(name)
        vocab = base.vocab_size
        clients = [service.create_lora_training_client(name, rank=RANK, seed=i) for i in range(TENANTS)]
        tenant_prompts = prompts(vocab)
        model = peft_model(plain_model(name, base.dtype, device))
        optimizers = {}
        for i in range(TENANTS):
            params = [p for n, p in model.named_parameters() if f".t{i}." in n and "lora_" in n]
            for p in params:
                p.requires_grad_(True)
            optimizers[i] = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                                              eps=ADAM.eps, weight_decay=ADAM.weight_decay)
        iteration = [0]

        def ours() -> None:
            iteration[0] += 1
            samplers = [tc.save_weights_and_get_sampling_client().result() for tc in clients]
            params = trio.SamplingParams(max_tokens=new, temperature=1.0, seed=iteration[0])
            with pool.hold():
                futures = [s.sample(trio.ModelInput.from_ints(p), SAMPLES, params)
                           for s, p in zip(samplers, tenant_prompts)]
            batches = []
            for prompt, future in zip(tenant_prompts, futures):
                seqs = future.result().sequences
                advs = advantages([reward(s.tokens, vocab) for s in seqs])
                data = []
                for seq, adv in zip(seqs, advs):
                    pad = [0.0] * (len(prompt) - 1)
                    data.append(trio.Datum(
                        model_input=trio.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={"target_tokens": prompt[1:] + seq.tokens, "logprobs": pad + seq.logprobs,
                                        "advantages": pad + [adv] * len(seq.tokens)}))
                batches.append(data)
            with pool.hold():
                updates = [(tc.forward_backward(d, "importance_sampling"), tc.optim_step(ADAM))
                           for tc, d in zip(clients, batches)]
            for fb, opt in updates:
                fb.result()
                opt.result()

        per_tenant = [left_padded([p] * SAMPLES, device) for p in tenant_prompts]

        def peft() -> None:
            with pool.hold():  # our clock parked: a PEFT user has no pool running
                for i, (ids, mask) in enumerate(per_tenant):
                    model.set_adapter(f"t{i}")
                    with torch.no_grad():
                        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                             temperature=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                             return_dict_in_generate=True, output_logits=True)
                    seqs = out.sequences
                    generated = seqs[:, ids.shape[1]:]
                    old_logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
                    old = old_logp.gather(2, generated[..., None])[..., 0]
                    advs = torch.tensor(advantages([reward(row, vocab) for row in generated.tolist()]), device=device)
                    full_mask = torch.cat([mask, torch.ones_like(generated)], 1)
                    logits = model(input_ids=seqs, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1]
                    logp = torch.log_softmax(logits.float(), -1).gather(2, generated[..., None])[..., 0]
                    loss = -(torch.exp(logp - old) * advs[:, None]).sum()
                    loss.backward()
                    optimizers[i].step()
                    optimizers[i].zero_grad(set_to_none=True)

        return side_by_side({"pool": ours, "peft": peft}, args.reps)
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="builtin,llama", help="comma-separated: builtin, llama")
    parser.add_argument("--reps", type=int, default=3, help="interleaved iterations per arm (medians)")
    parser.add_argument("--new", type=int, default=16, help="new tokens per sample")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args(argv)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{usable_cpus()} usable CPU(s), {auto_torch_threads()} torch thread(s)")
    print(f"device {device} ({where}); {TENANTS} tenants x {SAMPLES} samples x {args.new} tokens, rank {RANK}, "
          f"importance-sampling update + AdamW; medians of {args.reps} interleaved iterations")
    with tempfile.TemporaryDirectory(prefix="trio-rl-") as tmp:
        for shape in args.shapes.split(","):
            if shape == "builtin":
                name = DEFAULT_MODEL
            elif shape == "llama":
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                name = save_random_llama(Path(tmp) / "llama", LLAMA, dtype, device)
            else:
                parser.error(f"--shapes: unknown {shape!r} (builtin, llama)")
            started = time.perf_counter()
            s = measure(name, device, args)
            ratio = s["peft"] / s["pool"]
            print(f"== {shape}: pool {s['pool'] * 1e3:,.0f} ms/iteration | PEFT + generate + AdamW "
                  f"{s['peft'] * 1e3:,.0f} ms | pool {ratio:.2f}x faster (target >= 1.5x) "
                  f"{'met' if ratio >= 1.5 else 'MISSED'} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
