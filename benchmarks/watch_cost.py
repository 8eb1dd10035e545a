"""What `trio.watch` costs the loop it watches (issue 26: <= 2 % of its updates/s), measured side
by side in one run.

A LocalPool with short cycles (min_cycle_s=0.01, so that the client side matters) is served over
HTTP by a real `python -m trio_widgets serve` process (as a hosted service is: the pool's clock and
its GIL watchdog are not in the watched process; `--server thread` serves it from this process
instead, `trio.serve` as tests/test_serve_tinker.py does), and the unmodified
official tinker SDK trains one LoRA client on it: the pipelined loop of tests/test_watch.py
(forward_backward + optim_step, one update ahead), a block of N updates at a time, each block a
whole loop (its first submit to its last result). Blocks alternate between the plain SDK
TrainingClient and the same client watched (`watch(tc)`: a new Watcher, its GIL watchdog thread
included, made before the block and closed after it); each round runs plain, watched, watched,
plain, so that a machine slowly speeding up or slowing down weighs on both alike. This machine's
speed wanders by ~10 % from one block to the next (other people's jobs), so many short rounds and
their median say more than a few long ones. Prints updates/s of each arm, the median over rounds
of watched / plain with its quartiles and the ratio of all blocks pooled (target >= 0.98), the
watcher's record count (every request of the watched blocks, none of the plain ones), and two
direct costs the machine's noise hardly touches: the CPU time per update of the loop's own thread
(where the proxy runs) and of the whole process (server, pool, SDK threads, the watchdog).

    python benchmarks/watch_cost.py            # 40 rounds, ~2.5 minutes on 2 shared CPU cores
    python benchmarks/watch_cost.py --quick    # 5 rounds, ~30 s
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")  # as tests/served.py's tinker_env: no telemetry,
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network for tokenizers

from serve_abuse import server_process  # noqa: E402  (the benchmarks' one `serve` process starter)

import trio_widgets as trio  # noqa: E402
from trio_widgets.watch import WatchedRequest, Watcher, watch, watcher_of  # noqa: E402

KEY = "tml-watch-bench"
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]


def batch(i: int, length: int = 16) -> list[Any]:
    """tests/test_serve_tinker.py's datum(i): 16 tokens of TEXT."""
    from tinker import types as tt

    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + length + 1]
    targets: dict[str, Any] = {"target_tokens": chunk[1:]}  # the SDK converts a list to TensorData
    return [tt.Datum(model_input=tt.ModelInput.from_ints(chunk[:-1]), loss_fn_inputs=targets)]


def pipelined(tc: Any, n: int, adam: Any) -> dict[str, float]:
    """tests/test_watch.py's pipelined loop, one update ahead: wall, loop-thread and process CPU."""
    t0, thread0, cpu0 = time.perf_counter(), time.thread_time(), time.process_time()
    previous = None
    for i in range(n):
        current = (tc.forward_backward(batch(i), "cross_entropy"), tc.optim_step(adam))
        if previous is not None:
            previous[0].result(timeout=120)
            previous[1].result(timeout=120)
        previous = current
    assert previous is not None
    previous[0].result(timeout=120)
    previous[1].result(timeout=120)
    return {"wall": time.perf_counter() - t0, "thread": time.thread_time() - thread0,
            "cpu": time.process_time() - cpu0}


@contextlib.contextmanager
def served(cycle_s: float, where: str) -> Iterator[str]:
    """The URL of a served pool: a `serve` process (`where="process"`) or this process's thread."""
    with tempfile.TemporaryDirectory() as ckpt:
        if where == "thread":
            with trio.LocalPool(min_cycle_s=cycle_s, checkpoint_dir=ckpt, name="bench-watch") as pool, \
                    trio.serve(pool, port=0) as server:
                yield server.url
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with server_process(port, min_cycle_s=cycle_s, keys=(KEY,)) as (url, _):
            yield url


def run(updates: int, rounds: int, cycle_s: float, verbose: bool, where: str = "process"
        ) -> tuple[dict[str, list[dict[str, float]]], list[float], list[WatchedRequest]]:
    import tinker

    blocks: dict[str, list[dict[str, float]]] = {"plain": [], "watched": []}
    ratios: list[float] = []
    records: list[WatchedRequest] = []
    adam = tinker.types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
    with served(cycle_s, where) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=0).result(timeout=120)

        def block(kind: str) -> dict[str, float]:
            if kind == "plain":
                return pipelined(tc, updates, adam)
            watched = watch(tc)
            watcher: Watcher = watcher_of(watched)
            try:
                out = pipelined(watched, updates, adam)
            finally:
                watcher.close()
            out["watchdog"] = watcher.watchdog.cpu_s if watcher.watchdog is not None else 0.0
            records.extend(watcher.records())
            return out

        for kind in ("plain", "watched"):  # warm up both paths (not counted)
            block(kind)
        records.clear()
        for i in range(rounds):
            for kind in ("plain", "watched", "watched", "plain"):
                blocks[kind].append(block(kind))
            p, w = (sum(updates / b["wall"] for b in blocks[k][-2:]) for k in ("plain", "watched"))
            ratios.append(w / p)
            if verbose:
                print(f"  round {i + 1:2}: plain {p / 2:5.1f}, watched {w / 2:5.1f} updates/s -> {w / p:.3f}",
                      flush=True)
        sc.close("success").result(timeout=60)
    return blocks, ratios, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of plain, watched, watched, plain (40)")
    parser.add_argument("--updates", type=int, default=30, help="updates per block")
    parser.add_argument("--cycle-s", type=float, default=0.01, help="the pool's min_cycle_s")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    parser.add_argument("--server", choices=("process", "thread"), default="process",
                        help="serve the pool from a `serve` process (as hosted) or from this process")
    args = parser.parse_args()
    if sys.version_info < (3, 11):
        print("the tinker SDK needs Python >= 3.11")
        return 1
    rounds = args.rounds or (5 if args.quick else 40)

    load = os.getloadavg()
    started = time.perf_counter()
    blocks, ratios, records = run(args.updates, rounds, args.cycle_s, args.verbose, args.server)
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
          f"{time.perf_counter() - started:.0f} s")
    print(f"pipelined tinker SDK loop on a pool served from a {args.server} (min_cycle_s={args.cycle_s:g}), "
          f"{args.updates} updates "
          f"per block, {rounds} rounds of plain, watched, watched, plain")
    rate = {k: [args.updates / b["wall"] for b in v] for k, v in blocks.items()}
    pooled = {k: len(v) * args.updates / sum(b["wall"] for b in v) for k, v in blocks.items()}
    for kind in ("plain", "watched"):
        print(f"  {kind:>7}: {pooled[kind]:5.1f} updates/s (median block {statistics.median(rate[kind]):5.1f}, "
              f"min {min(rate[kind]):5.1f}, max {max(rate[kind]):5.1f})")
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    median = statistics.median(ratios)
    print(f"  ratio watched / plain: median of {len(ratios)} rounds {median:.3f} (quartiles {low:.3f}-{high:.3f}); "
          f"all blocks pooled {pooled['watched'] / pooled['plain']:.3f}, median block / median block "
          f"{statistics.median(rate['watched']) / statistics.median(rate['plain']):.3f}   (target >= 0.98): "
          f"{'PASS' if median >= 0.98 else 'FAIL'}")
    cpu: dict[str, float] = {}
    for what, key in (("the loop's thread (the proxy's submit side)", "thread"),
                      ("the whole process (torch's compute dominates: noisy)", "cpu")):
        plain, watched = (statistics.median(b[key] / args.updates * 1e3 for b in blocks[k])
                          for k in ("plain", "watched"))
        cpu[key] = watched - plain
        cpu[f"plain {key}"] = plain
        print(f"  CPU per update, {what}, median: plain {plain:.3f} ms, watched {watched:.3f} ms "
              f"({watched - plain:+.3f} ms)")
    dog = sum(b["watchdog"] for b in blocks["watched"]) / sum(b["wall"] for b in blocks["watched"])
    print(f"  the watcher's GIL watchdog thread: {dog * 1e3:.2f} ms CPU per second ({dog:.2%} of one core)")
    own = max(0.0, cpu["thread"]) + dog * 1e3 / pooled["watched"]
    print(f"  watching's own CPU per update (loop thread + watchdog; the SDK thread's ~5 us of result callbacks "
          f"aside): {own:.3f} ms, {own / cpu['plain cpu']:.2%} of a plain update's process CPU")
    sent = len(blocks["watched"]) * args.updates * 2
    ok = sum(r.status == "ok" and r.delivered_at is not None for r in records)
    print(f"  the watchers recorded {len(records)} requests ({ok} ok, with their result time) of the {sent} "
          f"the watched blocks sent; ops: {sorted({r.op for r in records})}")
    return 0 if ok == len(records) == sent else 1


if __name__ == "__main__":
    raise SystemExit(main())
