"""What measuring GIL starvation costs the training it watches, measured side by side in one run.

1. Throughput: the same pipelined training (3 LoRA clients on the addition task, a
   compute-bound pool: min_cycle_s=0, built with gil_watchdog=False) alternates between
   phases without and with a `GilWatchdog` on the pool's telemetry: the very thread
   `LocalPool(gil_watchdog=True)` starts, heartbeat every 20 ms. Each round runs off, on, on,
   off, so that a machine slowly speeding up or slowing down weighs on both alike; many
   short rounds and their median (with quartiles) say more than a few long phases on a
   machine whose speed wanders from one second to the next (other people's jobs). Updates/s
   of a phase: the optim_steps of the cycles it ran, over those cycles' time. Prints the
   median over rounds of on / off and the ratio of all phases pooled (target >= 0.98);
   --verbose, every round.
   The same phases also give two direct costs, which the machine's noise hardly touches:
   the watchdog thread's own CPU time per second, and the clock's wait for the GIL per busy
   cycle with and without it.
2. The clock thread's own meter (always on: two CPU-clock reads and two reads of
   /proc/thread-self/schedstat per cycle): its cost per cycle, next to a busy cycle.
3. After `pool.close()`: no watchdog or clock thread is left.

    python benchmarks/gil_watchdog_overhead.py            # ~3 minutes on 2 shared CPU cores
    python benchmarks/gil_watchdog_overhead.py --quick    # 4 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import trio_widgets as trio
from trio_widgets.data import addition_batches
from trio_widgets.gil import GilWatchdog, RunMeter


async def throughput(phase_s: float, rounds: int, interval_s: float | None
                     ) -> tuple[dict[str, list[float]], float, dict[str, float]]:
    out: dict[str, list[float]] = {"off": [], "on": [], "round ratio": [], "gil_wait off": [], "gil_wait on": []}
    seen: dict[str, float] = {"heartbeats": 0, "late": 0, "stalls": 0, "cpu_s": 0.0, "on_s": 0.0,
            "updates off": 0, "updates on": 0, "seconds off": 0.0, "seconds on": 0.0}
    with trio.LocalPool(min_cycle_s=0.0, name="bench-gil", gil_watchdog=False) as pool:
        sc = trio.ServiceClient(pool)
        runs = []
        for i in range(3):
            tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=i, user_metadata={"name": f"run{i}"})
            runs.append(trio.train(tc, addition_batches(tc.get_tokenizer(), batch_size=8, seed=i),
                                   mode="pipelined", learning_rate=3e-3, history=1000))
        await asyncio.sleep(3.0)  # warm up
        for _ in range(rounds):
            for kind in ("off", "on", "on", "off"):
                kw = {} if interval_s is None else {"interval_s": interval_s}
                watchdog = GilWatchdog(pool.telemetry, pool.name, **kw).start() if kind == "on" else None
                await asyncio.sleep(0.1)
                first, cpu0, t0 = pool.cycle_index, watchdog.cpu_s if watchdog else 0.0, time.perf_counter()
                await asyncio.sleep(phase_s)
                while pool.cycle_index < first + 4:  # whole cycles, at least 3, however slow the machine
                    await asyncio.sleep(0.02)
                cycles = [c for c in list(pool.telemetry.cycles) if c.index >= first]
                out[kind].append(updates_per_s(cycles))
                seen[f"updates {kind}"] += sum(c.ops.get("optim_step", 0) for c in cycles)
                seen[f"seconds {kind}"] += cycles[-1].ended_at - cycles[0].started_at
                out[f"gil_wait {kind}"] += [c.gil_wait_s for c in cycles if c.n_requests]
                if watchdog is not None:
                    seen["cpu_s"] += watchdog.cpu_s - cpu0
                    seen["on_s"] += time.perf_counter() - t0
                    watchdog.stop()
                    seen["heartbeats"] += watchdog.heartbeats
                    seen["late"] += watchdog.late
            out["round ratio"].append(sum(out["on"][-2:]) / sum(out["off"][-2:]))
        seen["stalls"] = len(pool.telemetry.gil)
        busy = [c.busy_s for c in list(pool.telemetry.cycles) if c.n_requests]
        for run in runs:
            run.stop()
        await asyncio.gather(*(run.wait() for run in runs))
    return out, statistics.median(busy), seen


def updates_per_s(cycles: list) -> float:
    """Updates (optim_steps) per second over whole cycles: exact, where counting the updates
    delivered in a 2 s window would be off by a few of ~80."""
    updates = sum(c.ops.get("optim_step", 0) for c in cycles)
    return updates / (cycles[-1].ended_at - cycles[0].started_at)


def meter_cost(n: int = 20_000) -> float:
    """Seconds one cycle's metering takes (mark at the boundary, waited after the work)."""
    meter = RunMeter()
    t0 = time.perf_counter()
    for _ in range(n):
        meter.waited(meter.mark())
    return (time.perf_counter() - t0) / n


def leftovers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(("trio-gil-", "trio-clock-"))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4 rounds")
    parser.add_argument("--phase-s", type=float, default=0.5)
    parser.add_argument("--verbose", action="store_true", help="print every round")
    parser.add_argument("--interval-s", type=float, default=None, help="heartbeat (default: the watchdog's)")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 60)

    load = os.getloadavg()
    tp, busy_s, seen = asyncio.run(throughput(args.phase_s, rounds, args.interval_s))
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print("throughput (3 pipelined LoRA clients, compute-bound pool), updates/s per phase")
    ratios = tp["round ratio"]
    for i, ratio in enumerate(ratios if args.verbose else ()):
        off, on = tp["off"][2 * i:2 * i + 2], tp["on"][2 * i:2 * i + 2]
        print(f"  round {i + 1:2}: off {off[0]:5.1f}, watchdog on {on[0]:5.1f} {on[1]:5.1f}, off {off[1]:5.1f}"
              f"  -> {ratio:.3f}")
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    print(f"  mean off {statistics.mean(tp['off']):.1f}, on {statistics.mean(tp['on']):.1f} updates/s; "
          f"{seen['heartbeats']} heartbeats, {seen['late']} late, {seen['stalls']} stalls blamed on user code")
    pooled = (seen["updates on"] / seen["seconds on"]) / (seen["updates off"] / seen["seconds off"])
    print(f"  ratio on / off: median of {len(ratios)} rounds {statistics.median(ratios):.3f} "
          f"(quartiles {low:.3f}-{high:.3f}); all phases pooled {pooled:.3f}   (target >= 0.98)")
    print(f"  the watchdog thread's CPU: {seen['cpu_s'] / seen['on_s'] * 1e3:.2f} ms per second "
          f"({seen['cpu_s'] / seen['on_s']:.3%} of one core)")
    off_wait, on_wait = (statistics.median(tp[f"gil_wait {k}"]) * 1e3 for k in ("off", "on"))
    print(f"  the clock's wait for the GIL per busy cycle, median: off {off_wait:.2f} ms, on {on_wait:.2f} ms")
    cost = meter_cost()
    print(f"clock meter: {cost * 1e6:.1f} us per cycle, {cost / busy_s:.3%} of a median busy cycle "
          f"({busy_s * 1e3:.1f} ms)")
    left = leftovers()
    print(f"threads left after pool.close(): {left or 'none'}")
    return 0 if not left else 1


if __name__ == "__main__":
    raise SystemExit(main())
