"""Engine speed, measured side by side in one run (ratios, not absolute targets).

(a) 8 tenants x (2 sequences x 64 tokens) in one packed cycle vs the same 8 updates one
    after another                                            target: joint >= 1.5x faster
    (ceiling: the plain base model, 16x64 tokens in one pass vs 8 passes of 2x64)
(b) the joint cycle vs one fused single-adapter batch of all the tokens
                                                             target: joint <= 1.25x slower
(c) clock overhead: what a busy cycle costs beyond its compute (boundary snapshot,
    delivery, telemetry)                                     target: <= 2 ms median and
                                                                     <= 5% of a busy cycle

Each arm is measured at the pool's default torch thread count ("auto": half the usable
CPUs) and with every usable CPU, unless --threads names the counts.

Run: .venv/bin/python benchmarks/engine_throughput.py [--reps 15] [--threads auto,all]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import trio_widgets as trio
from trio_widgets.engine.compute import ForwardJob, make_forward_job, run_forward_jobs
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import (
    DEFAULT_MODEL,
    _build_builtin,
    auto_torch_threads,
    load_base_model,
    resolve_device,
    usable_cpus,
)

TENANTS, SEQS, LENGTH, RANK = 8, 2, 64, 32
ADAM = trio.AdamParams(learning_rate=1e-4)


def batch(seed: int, n: int, length: int = LENGTH, vocab: int = 259) -> list[trio.Datum]:
    """`n` random sequences of `length` tokens (ids 3..vocab-1: past the byte tokenizer's specials)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(3, vocab) for _ in range(length + 1)]
        out.append(trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:]}))
    return out


def timed(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def side_by_side(fns: dict[str, callable], reps: int) -> dict[str, float]:
    """Medians of interleaved repetitions, so drift on a shared machine hits every arm alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def arms(threads: int, reps: int) -> dict[str, float]:
    """Median seconds per arm for (a) and (b), at `threads` torch threads."""
    # Idle pool: only here to apply the pool's CPU thread setting to the direct runs.
    pool = trio.LocalPool(min_cycle_s=1.0, torch_threads=threads)
    base = load_base_model(DEFAULT_MODEL, pool.device)
    targets = base.targets_for(True, True, True)
    adapters = [LoRAAdapter(targets, RANK, seed=i, device=base.device) for i in range(TENANTS)]
    data = [make_forward_job(base, batch(i, SEQS), "cross_entropy", {}, backward=True)[0].data
            for i in range(TENANTS)]
    fused_data = [d for tenant in data for d in tenant]

    def job(adapter, tenant_data):
        return adapter, ForwardJob(data=tenant_data, loss_fn="cross_entropy", config={}, backward=True), "bench"

    def joint():
        run_forward_jobs(base, [job(a, d) for a, d in zip(adapters, data)], pool.max_tokens_per_pass)
        for a in adapters:
            a.adamw_step(ADAM)

    def sequential():
        for a, d in zip(adapters, data):
            run_forward_jobs(base, [job(a, d)], pool.max_tokens_per_pass)
            a.adamw_step(ADAM)

    def fused():
        run_forward_jobs(base, [job(adapters[0], fused_data)], pool.max_tokens_per_pass)
        adapters[0].adamw_step(ADAM)

    plain, _ = _build_builtin(DEFAULT_MODEL, torch.float32)
    plain.requires_grad_(False)
    plain.get_input_embeddings().weight.requires_grad_(True)  # a backward through every layer
    ids = torch.tensor([[d.input_ids.tolist() for d in fused_data]])[0]

    def plain_joint():
        plain(input_ids=ids).logits.float().logsumexp(-1).sum().backward()

    def plain_sequential():
        for i in range(TENANTS):
            plain(input_ids=ids[i * SEQS:(i + 1) * SEQS]).logits.float().logsumexp(-1).sum().backward()

    t = side_by_side({"joint": joint, "sequential": sequential, "fused": fused,
                      "plain_joint": plain_joint, "plain_sequential": plain_sequential}, reps)
    pool.close()
    return t


def clock_overhead(threads: int | str) -> tuple[float, float, float]:
    """(c): (idle cycle s, busy-cycle overhead s, overhead share of the busy cycle), medians.
    Empty cycles are pure overhead; busy cycles pay overhead beyond busy_s."""
    pool = trio.LocalPool(min_cycle_s=0.0, torch_threads=threads)
    cycles: list = []
    pool.telemetry.subscribe(lambda e: cycles.append(e.record) if e.kind == "cycle" else None)
    time.sleep(0.2)
    empty = [c.ended_at - c.started_at for c in cycles[-200:] if c.n_requests == 0]
    tc = trio.ServiceClient(pool).create_lora_training_client(DEFAULT_MODEL, rank=RANK, seed=0)
    in_flight = []
    for step in range(40):
        in_flight.append((tc.forward_backward(batch(step, SEQS * 4), "cross_entropy"), tc.optim_step(ADAM)))
        if len(in_flight) > 2:
            for f in in_flight.pop(0):
                f.result()
    for pair in in_flight:
        for f in pair:
            f.result()
    time.sleep(0.05)
    busy = [c for c in cycles if c.n_requests > 0][5:]
    overhead = [(c.ended_at - c.started_at) - c.busy_s for c in busy]
    share = [o / (c.ended_at - c.started_at) for o, c in zip(overhead, busy)]
    pool.close()
    return statistics.median(empty), statistics.median(overhead), statistics.median(share)


THREADS_HELP = ("comma-separated torch CPU thread counts: numbers, 'auto' (the pool's default) "
                "or 'all' (every usable CPU)")


def thread_settings(spec: str) -> list[int]:
    """`--threads` resolved to distinct counts, in order: "auto" and "all" coincide on a 1-2 CPU machine."""
    named = {"auto": auto_torch_threads(), "all": usable_cpus()}
    settings: list[int] = []
    for item in spec.split(","):
        value = named[item] if item in named else int(item)
        if value not in settings:
            settings.append(value)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", default="auto,all", help=THREADS_HELP)
    args = parser.parse_args()
    named = {"auto": auto_torch_threads()}
    settings = thread_settings(args.threads)

    device = resolve_device("auto")
    print(f"torch {torch.__version__}, device {device}, {usable_cpus()} usable CPU(s); {TENANTS} tenants x "
          f"{SEQS}x{LENGTH} tokens, rank {RANK}; medians of {args.reps} interleaved reps")
    for threads in settings:
        t = arms(threads, args.reps)
        label = f"{threads} torch thread(s){' (pool default)' if threads == named['auto'] else ''}"
        speedup, ceiling = t["sequential"] / t["joint"], t["plain_sequential"] / t["plain_joint"]
        print(f"[{label}]")
        print(f"(a) joint cycle {t['joint'] * 1e3:7.1f} ms | sequential {t['sequential'] * 1e3:7.1f} ms | "
              f"speed-up {speedup:.2f}x (target >= 1.5x) | plain-base ceiling {ceiling:.2f}x, "
              f"{speedup / ceiling:.0%} of it reached")
        print(f"(b) joint cycle {t['joint'] * 1e3:7.1f} ms | fused single adapter {t['fused'] * 1e3:7.1f} ms | "
              f"ratio {t['joint'] / t['fused']:.2f}x (target <= 1.25x)")
    idle, overhead, share = clock_overhead("auto")
    print(f"(c) idle cycle {idle * 1e3:.3f} ms (a 1 ms idle wait by design at min_cycle_s=0) | busy cycle "
          f"overhead {overhead * 1e3:.3f} ms median = {share * 100:.2f}% of the cycle (targets <= 2 ms, <= 5%)")


if __name__ == "__main__":
    main()
