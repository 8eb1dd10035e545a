"""One served pool under load: 16 client processes (8 with the official tinker SDK, 8 with
trio's HTTP client) x 50 pipelined updates, side by side with the same 16 loops in-process.

What it prints:

1. Lost or duplicated updates, per client (must be 0): the pool's own record of the
   client's optim_steps (read through the server's telemetry stream) against the 50 the
   client made, and the step count its last optim_step returned.
2. Isolation: each client's final LoRA weights against the same loop run alone (in-process,
   in cycles of its own). Whole runs are not bit-identical (a packed pass adds the same
   numbers in another order, and AdamW lets rounding differences grow), so, as notebook 03
   does, the first update is held to the fp32 rounding bound of tests/numerics.py and the
   final drift must stay far below a real difference: the same loop with another LoRA seed.
3. The server process's RSS before the clients and after they all finished.
4. Per-update time over HTTP vs the same 16 loops in-process (threads in one process, one
   pool): median over clients of (loop wall time / updates); the ratio targets <= 1.15 at
   the default cycle length (0.05 s). Arms alternate (HTTP, in-process, in-process, HTTP).
   It also prints the pool's clock thread per cycle: its CPU, and its wait to run beyond
   the run queue (for the GIL, which the server's HTTP thread shares with it).

   The clients run at nice 19 by default. In a workshop they run on the participants' own
   machines; on one box, nice 19 stands for that: they get only the CPU the server leaves
   idle, so the ratio measures what serving costs the pool (HTTP, protobuf, JSON and the
   GIL shared with the server's HTTP thread), not 16 SDK processes competing for its
   cores. `--client-nice 0` measures that case too: on 2 cores the clients' own CPU
   (~15 ms per update for the tinker SDK, ~10 ms for trio's client) slows every cycle.

    python benchmarks/serve_load.py                   # about 10 minutes on 2 CPU cores
    python benchmarks/serve_load.py --rounds 1        # one round of each arm
    python benchmarks/serve_load.py --client-nice 0   # the clients compete for the server's CPU

Every server and client it starts is stopped by the end (and on Ctrl-C); every loop is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # numerics.py: the tolerance rules of the tests

KEY_PREFIX = "tml-serve-load-"
SEQ = 32
BATCH = 4
LR = 1e-3
RANK = 8


def batches(seed: int, updates: int) -> list[list[tuple[list[int], list[int]]]]:
    """(input tokens, target tokens) per datum, per update: the same for every arm of a client."""
    rng = random.Random(seed)
    out = []
    for _ in range(updates):
        batch = []
        for _ in range(BATCH):
            tokens = [rng.randrange(3, 259) for _ in range(SEQ + 1)]
            batch.append((tokens[:-1], tokens[1:]))
        out.append(batch)
    return out


# -- one client process -----------------------------------------------------------------------

def run_client(kind: str, index: int, url: str, go: str, updates: int, nice: int) -> None:
    """Create the model, say READY, wait for `go` (bounded), run the pipelined loop, save, report."""
    os.nice(nice)
    key = f"{KEY_PREFIX}{index:04d}"
    name = f"{kind}-{index}"
    data = batches(index, updates)
    if kind == "sdk":
        import tinker
        from tinker import types as tt

        sc = tinker.ServiceClient(base_url=url, api_key=key, user_metadata={"name": name})
        tc = sc.create_lora_training_client(base_model="trio/tiny-llama-byte", rank=RANK, seed=index).result()
        made = [[tt.Datum(model_input=tt.ModelInput.from_ints(x), loss_fn_inputs={"target_tokens": y})
                 for x, y in batch] for batch in data]
        adam = tt.AdamParams(learning_rate=LR)
        fb = lambda b: tc.forward_backward(b, "cross_entropy")  # noqa: E731
        step = lambda: tc.optim_step(adam)  # noqa: E731
        model_id = tc.model_id
    else:
        import trio_widgets as trio

        service = trio.ServiceClient(base_url=url, api_key=key)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=RANK, seed=index,
                                                 user_metadata={"name": name})
        made = [[trio.Datum(trio.ModelInput.from_ints(x), {"target_tokens": y}) for x, y in batch] for batch in data]
        adam = trio.AdamParams(learning_rate=LR)
        fb = lambda b: tc.forward_backward(b)  # noqa: E731
        step = lambda: tc.optim_step(adam)  # noqa: E731
        model_id = tc.client_id
    print(json.dumps({"ready": name}), flush=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no go signal within 600 s")
        time.sleep(0.005)
    losses, steps = [], []
    t0, cpu0 = time.perf_counter(), time.process_time()
    previous = None
    for batch in made:  # pipelined: queue update N+1 before awaiting N
        current = (fb(batch), step())
        if previous is not None:
            losses.append(previous[0].result().metrics["loss:sum"])
            steps.append(previous[1].result().metrics["step:max"])
        previous = current
    assert previous is not None
    losses.append(previous[0].result().metrics["loss:sum"])
    steps.append(previous[1].result().metrics["step:max"])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    path = tc.save_state("final").result().path
    if kind == "sdk":
        sc.close("success").result()
    else:
        service.backend.close()
    print(json.dumps({"name": name, "model_id": model_id, "key": key, "path": path, "losses": losses,
                      "steps": steps, "seconds": seconds, "cpu": cpu}), flush=True)


# -- the HTTP arm ---------------------------------------------------------------------------------

def clock_figures(telemetry: Any, client_ids: list[str]) -> tuple[float, float, float, float]:
    """While the clients ran: (median cycles per update over the clients, mean cycle duration,
    the clock thread's mean CPU per cycle, its mean wait to run per cycle), times in ms."""
    periods, first, last = [], None, None
    for cid in client_ids:
        cycles = sorted(r.cycle for r in telemetry.requests_of(cid)
                        if r.op == "forward_backward" and r.cycle is not None)
        if len(cycles) > 2:
            periods.append((cycles[-1] - cycles[0]) / (len(cycles) - 1))
            first = cycles[0] if first is None else min(first, cycles[0])
            last = cycles[-1] if last is None else max(last, cycles[-1])
    ran = [c for c in list(telemetry.cycles) if first is not None and last is not None and first <= c.index <= last]

    def mean_ms(values: list[float]) -> float:
        return statistics.fmean(values) * 1e3 if values else float("nan")

    return (statistics.median(periods) if periods else float("nan"), mean_ms([c.ended_at - c.started_at for c in ran]),
            mean_ms([c.cpu_s for c in ran]), mean_ms([c.gil_wait_s for c in ran]))


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@contextlib.contextmanager
def server_process(port: int, ckpt: str, min_cycle_s: float, clients: int):
    keys = ",".join(f"{KEY_PREFIX}{i:04d}" for i in range(clients))  # one key per client: isolated
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRIO_API_KEYS": keys, "TRIO_OBSERVER_KEYS": "tml-serve-load-watch"}
    proc = subprocess.Popen([sys.executable, "-m", "trio_widgets", "serve", "--port", str(port), "--checkpoint-dir",
                             ckpt, "--min-cycle-s", str(min_cycle_s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


@contextlib.contextmanager
def client_processes(url: str, kinds: list[str], updates: int, nice: int) -> Iterator[Callable[[], list[dict]]]:
    """One client process per kind against `url`, each READY (its model made) and waiting.
    Yields `run()`: it gives the go, waits for every client and returns what each reported.
    Every process is gone when the block ends."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        go = os.path.join(tmp, "go")
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client", kind, "--index", str(i),
                                   "--url", url, "--go", go, "--updates", str(updates), "--nice", str(nice)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, kind in enumerate(kinds)]

        def run() -> list[dict]:
            Path(go).touch()
            results = []
            for p in procs:
                out, err = p.communicate(timeout=900)
                if p.returncode != 0:
                    raise RuntimeError(f"a client failed: {err[-3000:]}")
                results.append(json.loads(out.strip().splitlines()[-1]))
            return results

        try:
            for p in procs:  # each says READY once its model exists
                line = p.stdout.readline() if p.stdout else ""
                if not line.startswith('{"ready"'):
                    raise RuntimeError(f"a client failed to start: {line}{p.stderr.read() if p.stderr else ''}")
            yield run
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(30)


def http_arm(args: argparse.Namespace, url: str, server_pid: int, watch: Any) -> dict[str, Any]:
    """The 16 clients, each in its own process, against the served pool at `url`."""
    kinds = ["sdk"] * args.sdk_clients + ["trio"] * args.trio_clients
    known = set(watch.telemetry.all_clients())
    with client_processes(url, kinds, args.updates, args.client_nice) as run:
        server = psutil.Process(server_pid)
        cpu0 = sum(server.cpu_times()[:2])
        results = run()
        server_cpu = sum(server.cpu_times()[:2]) - cpu0
    time.sleep(2.0)  # the sessions are finished; their clients retire at the next boundaries
    mine = {cid: info for cid, info in watch.telemetry.all_clients().items()
            if cid not in known and info.kind == "training"}
    ran = {info.label.split(" · ")[-1].split(":")[0]: sum(
        1 for r in watch.telemetry.requests_of(cid) if r.op == "optim_step" and r.status == "ok")
        for cid, info in mine.items()}
    for r in results:
        r["ran"] = ran.get(r["name"], 0)
    return {"results": results, "rss": rss_mb(server_pid), "server_cpu": server_cpu,
            "clock": clock_figures(watch.telemetry, list(mine))}


# -- the in-process arm and the solo runs -------------------------------------------------------------

def in_process_arm(args: argparse.Namespace) -> tuple[list[float], tuple[float, float], float]:
    import trio_widgets as trio

    n = args.sdk_clients + args.trio_clients
    with tempfile.TemporaryDirectory() as ckpt, \
            trio.LocalPool(min_cycle_s=args.min_cycle_s, name="in-process", checkpoint_dir=ckpt) as pool:
        service = trio.ServiceClient(pool)
        clients = [service.create_lora_training_client(trio.DEFAULT_MODEL, rank=RANK, seed=i) for i in range(n)]
        made = [[[trio.Datum(trio.ModelInput.from_ints(x), {"target_tokens": y}) for x, y in b]
                 for b in batches(i, args.updates)] for i in range(n)]
        adam = trio.AdamParams(learning_rate=LR)
        start = threading.Barrier(n)
        seconds = [0.0] * n

        def loop(i: int) -> None:
            tc = clients[i]
            start.wait(600)
            t0 = time.perf_counter()
            previous = None
            for batch in made[i]:
                current = (tc.forward_backward(batch), tc.optim_step(adam))
                if previous is not None:
                    previous[0].result()
                    previous[1].result()
                previous = current
            assert previous is not None
            previous[0].result()
            previous[1].result()
            seconds[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=loop, args=(i,), name=f"client-{i}") for i in range(n)]
        cpu0 = time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        used = time.process_time() - cpu0
        clock = clock_figures(pool.telemetry, [tc.client_id for tc in clients])
        for tc in clients:
            tc.close()
    return [s / args.updates for s in seconds], clock, used


def solo(index: int, seed: int, updates: int, pool: Any) -> tuple[dict[str, torch.Tensor], float]:
    """The loop alone (every cycle its own): final weights and the first update's loss."""
    import trio_widgets as trio

    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=RANK, seed=seed)
    adam = trio.AdamParams(learning_rate=LR)
    first = None
    for batch in batches(index, updates):
        fb = tc.forward_backward([trio.Datum(trio.ModelInput.from_ints(x), {"target_tokens": y}) for x, y in batch])
        tc.optim_step(adam).result()
        first = fb.result().loss if first is None else first
    weights = tc.inspect_adapter().result().state_dict()
    tc.close()
    assert first is not None
    return weights, first


def served_weights(ckpt: str, result: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from trio_widgets.http.auth import owner_of as _owner_of
    from trio_widgets.protocol import parse_tinker_path

    parsed = parse_tinker_path(result["path"])
    run, kind, name = parsed.run_id, parsed.segment, parsed.name
    path = Path(ckpt) / "served" / _owner_of(result["key"]) / run.replace(":", "_") / kind / name
    peft = load_file(str(path / "adapter_model.safetensors"))
    prefix = "base_model.model."
    return {k[len(prefix):].replace(".weight", ""): v for k, v in peft.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdk-clients", type=int, default=8)
    parser.add_argument("--trio-clients", type=int, default=8)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--min-cycle-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (HTTP, in-process, in-process, HTTP)")
    parser.add_argument("--client-nice", type=int, default=19, choices=range(0, 20), metavar="0-19",
                        help="the client processes' niceness (default 19: they stand for participants' own "
                             "machines, so they get only CPU the server leaves idle; 0: they compete for it)")
    parser.add_argument("--client", choices=["sdk", "trio"], help=argparse.SUPPRESS)
    parser.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        run_client(args.client, args.index, args.url, args.go, args.updates, args.nice)
        return 0
    if sys.version_info < (3, 11) and args.sdk_clients:
        print("the tinker SDK needs Python >= 3.11: running trio HTTP clients only")
        args.trio_clients += args.sdk_clients
        args.sdk_clients = 0

    from numerics import fp32_tolerance, model_terms, tiny_config

    import trio_widgets as trio

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"{args.sdk_clients} tinker SDK + {args.trio_clients} trio HTTP clients x {args.updates} pipelined updates, "
          f"min_cycle_s {args.min_cycle_s}; client processes at nice {args.client_nice}", flush=True)
    http_times: list[float] = []
    local_times: list[float] = []
    arms: list[dict[str, Any]] = []
    ckpt = tempfile.mkdtemp(prefix="serve-load-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from trio_widgets.http.remote import RemotePool

    # one server for every HTTP round: its RSS before, and after each, shows what stays
    with server_process(port, ckpt, args.min_cycle_s, args.sdk_clients + args.trio_clients) as (server, url):
        watch = RemotePool(url, api_key="tml-serve-load-watch")
        time.sleep(1.0)
        rss_before = rss_mb(server.pid)
        try:
            for round_ in range(args.rounds):
                for kind in ("http", "local", "local", "http"):
                    cpu = ""
                    if kind == "http":
                        arm = http_arm(args, url, server.pid, watch)
                        arms.append(arm)
                        per = [r["seconds"] / args.updates for r in arm["results"]]
                        clock = arm["clock"]
                        http_times.append(statistics.median(per))
                        by_kind = {k: [r["cpu"] / args.updates * 1e3 for r in arm["results"]
                                       if r["name"].startswith(k)] for k in ("sdk", "trio")}
                        cpu = (f"; CPU per update: server {arm['server_cpu'] / args.updates * 1e3:.0f} ms, clients "
                               f"{sum(r['cpu'] for r in arm['results']) / args.updates * 1e3:.0f} ms ("
                               + ", ".join(f"{k} {statistics.median(v):.1f} ms each" for k, v in by_kind.items() if v)
                               + ")")
                    else:
                        per, clock, used = in_process_arm(args)
                        local_times.append(statistics.median(per))
                        cpu = f"; CPU per update: {used / args.updates * 1e3:.0f} ms"
                    print(f"round {round_ + 1} {kind:>5}: median per-update time {statistics.median(per) * 1e3:7.1f} ms"
                          f" (clients {min(per) * 1e3:.1f}-{max(per) * 1e3:.1f}); {clock[0]:.2f} cycles/update, "
                          f"cycles of {clock[1]:.1f} ms (clock thread: {clock[2]:.1f} ms CPU, "
                          f"{clock[3]:.1f} ms waiting to run){cpu}", flush=True)
        finally:
            watch.close()
        stats = httpx.get(f"{url}/api/v1/trio/info", headers={"X-API-Key": "tml-serve-load-watch"}).json()["stats"]

    # 1. lost or duplicated updates
    bad = 0
    print("\nupdates per client (the pool's record / the client's):")
    for arm in arms:
        for r in arm["results"]:
            lost = max(0, args.updates - r["ran"])
            dup = max(0, r["ran"] - args.updates)
            ok = r["steps"] == list(range(1, args.updates + 1))
            bad += lost + dup + (not ok)
        print("  " + ", ".join(f"{r['name']} {r['ran']}/{len(r['steps'])}" for r in arm["results"]))
    print(f"  server: {stats}")
    print(f"lost or duplicated updates: {bad}")

    # 2. isolation, from the first HTTP arm
    config = tiny_config()
    terms = model_terms(config, SEQ, batch_tokens=SEQ * BATCH)
    worst_first, worst_ratio = 0.0, 0.0
    with tempfile.TemporaryDirectory() as solo_dir, \
            trio.LocalPool(min_cycle_s=0.0, name="solo", checkpoint_dir=solo_dir) as pool:
        # a real difference, for scale: client 0's loop with another LoRA seed
        seed_gap = max_diff(solo(0, 0, args.updates, pool)[0], solo(0, 1, args.updates, pool)[0])
        print(f"\nisolation (final weights, served vs the same loop alone; another seed differs by {seed_gap:.2e}):")
        for r in arms[0]["results"]:
            index = int(r["name"].split("-")[1])
            alone, first = solo(index, index, args.updates, pool)
            drift = max_diff(served_weights(ckpt, r), alone)
            tol = fp32_tolerance(abs(first), terms)
            first_diff = abs(r["losses"][0] - first)
            worst_first = max(worst_first, first_diff / tol)
            worst_ratio = max(worst_ratio, drift / seed_gap)
            print(f"  {r['name']:>7}: first update's loss differs by {first_diff:.2e} (fp32 bound {tol:.2e}); "
                  f"final weights by {drift:.2e} ({drift / seed_gap:.1e} of another seed's)")
    isolated = worst_first <= 1.0 and worst_ratio < 0.01
    print(f"isolation: {'OK' if isolated else 'FAILED'} (first update within the fp32 bound: worst "
          f"{worst_first:.2f} of it; final drift at most {worst_ratio:.1e} of a seed's difference, limit 1e-2)")

    # 3. memory, 4. speed
    print(f"server RSS: {rss_before:.0f} MB before the clients, then after each HTTP round of "
          f"{args.sdk_clients + args.trio_clients} clients: " + ", ".join(f"{a['rss']:.0f} MB" for a in arms))
    ratio = statistics.median(http_times) / statistics.median(local_times)
    print(f"per-update time: HTTP {statistics.median(http_times) * 1e3:.1f} ms, in-process "
          f"{statistics.median(local_times) * 1e3:.1f} ms -> ratio {ratio:.3f} (target <= 1.15)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(ckpt, ignore_errors=True)
    return 0 if bad == 0 and isolated else 1


if __name__ == "__main__":
    raise SystemExit(main())
