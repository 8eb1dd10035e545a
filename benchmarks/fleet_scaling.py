"""A fleet's aggregate throughput: 2 pools behind one URL against 1, the same clients, one run.

Each side is a fleet on a local Ray instance (trio_widgets.http.ray_fleet.serve_fleet: pools of
one torch thread and one CPU each, min_cycle_s=0 so cycles run back to back, DEFAULT_MODEL),
trained by the same --clients HTTP clients (trio.ServiceClient(base_url=fleet.url), one thread
each) running the pipelined loop (--lookahead 2: two more updates queued before the oldest one's
result is read, so that no pool waits for a client's round trip between its back-to-back cycles)
on --batch sequences of --tokens tokens per update. Sessions are placed by the fleet (by
headroom: 2 pools take half each). After --warmup updates of every client, each counts the
updates whose results arrive in a window of --seconds; the figure is their sum per second. The
1-pool fleet runs first, then the 2-pool one, in this one process; the ratio is printed last.

On this project's 2-core machine the target is >= 1.6x: a pool's pass is one thread's work, so
two pools use both cores (the clients, Serve's proxy and the ingress share them too).

    .venv/bin/python benchmarks/fleet_scaling.py              # about 3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/fleet_scaling.py --seconds 10 --clients 2
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import threading
import time
from collections import deque

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import trio_widgets as trio  # noqa: E402
from trio_widgets.http.ray_fleet import serve_fleet  # noqa: E402

KEY = "tml-fleet-benchmark"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed: int, n: int, tokens: int) -> list[trio.Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 250) for _ in range(tokens + 1)]
        out.append(trio.Datum(trio.ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:]}))
    return out


def measure(pools: int, args: argparse.Namespace) -> tuple[float, list[int]]:
    """(updates per second in the window, sessions per pool) of a fleet of `pools` pools."""
    with serve_fleet(pools, port=free_port(), api_keys=[KEY], min_cycle_s=0.0, cpus_per_pool=1,
                     session_timeout_s=600) as fleet:
        clients = [trio.ServiceClient(base_url=fleet.url, api_key=KEY) for _ in range(args.clients)]
        tcs = [sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=k) for k, sc in enumerate(clients)]
        placed = [0] * pools
        for tc in tcs:
            placed[int(tc.model_id.split("-")[1][1:].split("r")[0])] += 1
        adam = trio.AdamParams(learning_rate=1e-3)
        start, stop = threading.Event(), threading.Event()
        counts = [0] * len(tcs)
        ready = threading.Barrier(len(tcs) + 1)
        errors: list[BaseException] = []

        def loop(k: int, tc: trio.TrainingClient) -> None:
            try:
                data = batch(k, args.batch, args.tokens)
                in_flight: deque[tuple[trio.APIFuture, trio.APIFuture]] = deque()
                done = 0
                while not stop.is_set():
                    in_flight.append((tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)))
                    if len(in_flight) > args.lookahead:
                        fb, opt = in_flight.popleft()
                        fb.result(timeout=600)
                        opt.result(timeout=600)
                        done += 1
                        if done == args.warmup:
                            ready.wait(timeout=600)
                            start.wait()
                        elif start.is_set():
                            counts[k] += 1
                for fb, opt in in_flight:
                    fb.result(timeout=600)
                    opt.result(timeout=600)
            except BaseException as exc:  # reported on the main thread
                errors.append(exc)
                ready.abort()

        threads = [threading.Thread(target=loop, args=(k, tc), name=f"client-{k}") for k, tc in enumerate(tcs)]
        for t in threads:
            t.start()
        ready.wait(timeout=600)
        began = time.perf_counter()
        start.set()
        time.sleep(args.seconds)
        total = sum(counts)
        elapsed = time.perf_counter() - began
        stop.set()
        for t in threads:
            t.join(600)
        for sc in clients:
            sc.close()
        if errors:
            raise errors[0]
        return total / elapsed, placed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per update")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lookahead", type=int, default=2,
                        help="updates queued beyond the one awaited (2: the pool never waits for a round trip)")
    parser.add_argument("--warmup", type=int, default=3, help="updates of each client before the window")
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    args = parser.parse_args()
    print(f"{args.clients} clients, pipelined (lookahead {args.lookahead}), {args.batch} x {args.tokens} tokens "
          f"per update, "
          f"{args.seconds:g} s window; pools of 1 torch thread, min_cycle_s=0", flush=True)
    one, placed_one = measure(1, args)
    print(f"1 pool : {one:6.2f} updates/s (sessions per pool {placed_one})", flush=True)
    two, placed_two = measure(2, args)
    print(f"2 pools: {two:6.2f} updates/s (sessions per pool {placed_two})", flush=True)
    print(f"ratio 2 pools / 1 pool: {two / one:.2f}x (target on 2 cores: >= 1.6x)")


if __name__ == "__main__":
    main()
