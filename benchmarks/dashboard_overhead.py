"""What a live dashboard costs the training it watches, measured side by side in one run.

1. Throughput: the same pipelined training (3 LoRA clients on the addition task, a
   compute-bound pool: min_cycle_s=0) alternates between headless phases and phases
   with a `Dashboard` attached and live (ticking at up to 10 Hz, serialising every patch
   and HTML update as it would for a browser; without a kernel the comm drops the bytes).
   Each round runs headless, dashboard, dashboard, headless, so that a machine slowly
   speeding up or slowing down weighs on both alike. This machine's speed wanders by
   about 10% from one 2-second stretch to the next (a bare engine loop shows that too),
   so many short rounds and their median, with the quartiles, say more than a few long
   phases; prints updates/s of every phase and the median over rounds of dashboard /
   headless (target >= 0.95).
2. Memory: with a live dashboard attached, RSS of this process (the kernel stand-in)
   after 1,000 and after 10,000 cycles of training (target: within 50 MB).

    python benchmarks/dashboard_overhead.py            # 5-8 minutes on 2 shared CPU cores
    python benchmarks/dashboard_overhead.py --quick    # shorter phases, 3,000 cycles
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import statistics
import time

import psutil

import trio_widgets as trio
from trio_widgets.data import addition_batches


def rss_mb() -> float:
    gc.collect()
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def attach(pool: trio.LocalPool) -> trio.Dashboard:
    dash = trio.Dashboard(pool)
    dash.bokeh_widget.live = True  # send (serialise) every patch, as for a displayed view
    return dash


async def throughput(phase_s: float, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"headless": [], "dashboard": []}
    with trio.LocalPool(min_cycle_s=0.0, name="bench-throughput") as pool:
        sc = trio.ServiceClient(pool)
        runs = []
        for i in range(3):
            tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=i, user_metadata={"name": f"run{i}"})
            runs.append(trio.train(tc, addition_batches(tc.get_tokenizer(), batch_size=8, seed=i),
                                   mode="pipelined", learning_rate=3e-3, history=1000))
        await asyncio.sleep(3.0)  # warm up
        for _ in range(rounds):
            for kind in ("headless", "dashboard", "dashboard", "headless"):
                dash = attach(pool) if kind == "dashboard" else None
                await asyncio.sleep(0.5)  # let a new dashboard take its backfill first
                u0, t0 = pool.telemetry.total_updates, time.perf_counter()
                await asyncio.sleep(phase_s)
                out[kind].append((pool.telemetry.total_updates - u0) / (time.perf_counter() - t0))
                if dash is not None:
                    ticks, patches = dash.ticks, dash.bokeh_widget.patches_sent
                    dash.close()
                    out.setdefault("ticks/s", []).append(ticks / (phase_s + 0.5))
                    out.setdefault("patches", []).append(patches)
            out.setdefault("round ratio", []).append(sum(out["dashboard"][-2:]) / sum(out["headless"][-2:]))
        for run in runs:
            run.stop()
        await asyncio.gather(*(run.wait() for run in runs))
    return out


async def memory(total_cycles: int) -> dict[str, float]:
    batch = [trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7, 8, 9, 10]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10, 11]})]
    out: dict[str, float] = {}
    with trio.LocalPool(min_cycle_s=0.0, name="bench-memory") as pool:
        sc = trio.ServiceClient(pool)
        dash = attach(pool)
        runs = []
        for i in range(2):
            tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=i, user_metadata={"name": f"m{i}"})
            runs.append(trio.train(tc, itertools.repeat(batch), mode="pipelined", learning_rate=1e-3,
                                   history=1000))
        start = pool.cycle_index
        t0 = time.perf_counter()
        for mark in (1000, total_cycles):
            while pool.cycle_index - start < mark:
                await asyncio.sleep(0.2)
            out[f"rss_mb@{mark}"] = rss_mb()
            out[f"updates@{mark}"] = pool.telemetry.total_updates
        out["seconds"] = time.perf_counter() - t0
        out["ticks"] = dash.ticks
        out["patches"] = dash.bokeh_widget.patches_sent
        figs = dash.figures
        out["rows_in_sources"] = (len(figs.bars.data["left"]) + len(figs.bands.data["left"]) + len(figs.queue.data["t"])
                                  + sum(len(v.loss.data["step"]) for v in figs.clients.values()))
        for run in runs:
            run.stop()
        await asyncio.gather(*(run.wait() for run in runs))
        dash.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter phases and 3,000 cycles")
    parser.add_argument("--phase-s", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--cycles", type=int, default=None)
    args = parser.parse_args()
    phase_s = args.phase_s or 2.0
    rounds = args.rounds or (4 if args.quick else 12)
    cycles = args.cycles or (3000 if args.quick else 10_000)

    tp = asyncio.run(throughput(phase_s, rounds))
    headless, live = statistics.mean(tp["headless"]), statistics.mean(tp["dashboard"])
    print("throughput (3 pipelined LoRA clients, compute-bound pool), updates/s per phase")
    ratios = tp["round ratio"]
    for i, ratio in enumerate(ratios):
        h, d = tp["headless"][2 * i:2 * i + 2], tp["dashboard"][2 * i:2 * i + 2]
        print(f"  round {i + 1:2}: headless {h[0]:5.1f}, dashboard {d[0]:5.1f} {d[1]:5.1f}, headless {h[1]:5.1f}"
              f"  -> {ratio:.3f}")
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    print(f"  mean headless {headless:.1f}, dashboard {live:.1f} ({statistics.mean(tp['ticks/s']):.1f} ticks/s)")
    print(f"  ratio dashboard / headless: median of {len(ratios)} rounds {statistics.median(ratios):.3f} "
          f"(quartiles {low:.3f}-{high:.3f})   (target >= 0.95)")

    mem = asyncio.run(memory(cycles))
    print(f"memory with a live dashboard attached ({mem['seconds']:.0f} s of training, {mem['ticks']} ticks, "
          f"{mem['patches']} patches, {mem['rows_in_sources']} rows in the bokeh sources at the end)")
    print(f"  RSS after  1,000 cycles: {mem['rss_mb@1000']:8.1f} MB   ({mem['updates@1000']} updates)")
    print(f"  RSS after {cycles:>6,} cycles: {mem[f'rss_mb@{cycles}']:8.1f} MB   ({mem[f'updates@{cycles}']} updates)")
    print(f"  growth: {mem[f'rss_mb@{cycles}'] - mem['rss_mb@1000']:+.1f} MB   (target: within 50 MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
