"""A neighbour's update time on a served pool, quiet and under each attack of issue 22, side by
side in one run (the server is a real `python -m trio_widgets serve` process; the neighbour is
a keyed trio client pipelining small updates; the attacker uses another key, or none).

Attacks, each held while the neighbour makes `--updates` updates:
  stop-strings  another key samples continuously with the most stop strings a request may carry
                (64 of 64 characters), 4 requests in flight
  plain-samples the same samples without stop strings: what the stop strings add is the difference
  slowloris     1,100 sockets without a key that never finish their request head
  body-stall    24 connections of another key each send 15 MiB of a 16 MiB body, then stall
  64-sessions   another key opens 64 sessions with a training client each, then idles
  long-sample   another key samples 480 tokens per request (decoded over many cycles, a few steps
                a cycle: engine/sampling.py)
  trickle       another key opens 4,200 connections, each sending a request head and then its body
                a byte every 5 s (issue 36 point 4: every request, /healthz included, was a 503);
                the key holds max_connections_per_key of them, the rest are a 429 naming that limit
  churn         4 processes open keyless sockets as fast as they can, send a request without a key
                (or nothing), and close them (issue 36 point 5); from 127.0.0.2, another address than
                the neighbour's (the server bounds new connections per address: max_new_connections_
                per_address_s; from the neighbour's own address they would delay its new connections)
  big-sample    another key samples at the most one request may ask (128 samples x 256 tokens,
                max_num_samples x max_tokens = max_sampled_tokens), 8 requests in flight (issue 36
                point 3: 6.65x)
  big-stop-sample  the same with the most stop strings (64 of 64 characters)
  listing       another key, with 2,000 checkpoints saved, lists them (runs, checkpoints, its
                user checkpoints) in a loop from 4 threads; besides the ratio, the round trips of
                the neighbour's session heartbeats (p50, p99, max; every 50 ms for at least 12 s,
                from a process of their own) while it goes on (issue 36: max <= 100 ms; listings
                run off the server's event loop, and `trio serve` freezes its startup heap out of
                the collector's full passes)

Prints, per attack: the neighbour's median seconds per update quiet (measured just before) and
under attack, their ratio (target <= 2), and what the attacker was answered; then, over 3 rounds
of 3 clients x 60 forwards of 8 x 500 tokens and close(), the server's memory (RSS) after each
round against its one start (target: within 50 MB).

    python benchmarks/serve_abuse.py                 # about 3 minutes on 2 CPU cores
    python benchmarks/serve_abuse.py --updates 10    # shorter
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx

import trio_widgets as trio

ALICE, MALLORY = "tml-alice-neighbour-1", "tml-mallory-attacker-2"
BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12]),
                    {"target_tokens": [6, 7, 8, 9, 10, 11, 12, 13]})]


@contextlib.contextmanager
def server_process(port: int, *, min_cycle_s: float = 0.02, keys: tuple[str, ...] = (ALICE, MALLORY),
                   fleet: bool = False) -> Iterator[tuple[str, int]]:
    """A real `python -m trio_widgets serve` on 127.0.0.1:`port` (keys from $TRIO_API_KEYS; none:
    keyless loopback), or a two-pool fleet (`serve --ray --pools 2`: its pid is the front door's);
    yields its URL and pid, and stops it."""
    env = {**os.environ, "TRIO_API_KEYS": ",".join(keys), "TRIO_TORCH_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    with tempfile.TemporaryDirectory() as ckpt:
        proc = subprocess.Popen([sys.executable, "-m", "trio_widgets", "serve", "--port", str(port),
                                 "--checkpoint-dir", ckpt, "--min-cycle-s", str(min_cycle_s),
                                 *(["--ray", "--pools", "2"] if fleet else [])],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            seen = ""
            for line in proc.stdout:  # (Ray may log first)
                seen += line
                if "serving" in line or not fleet:
                    break
            if "serving" not in line:
                raise RuntimeError(f"the server did not start: {seen[-3000:]}{proc.stdout.read()}")
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain its log
            yield f"http://127.0.0.1:{port}", proc.pid
        finally:
            proc.terminate()
            proc.wait(60)


def seconds_per_update(tc: trio.TrainingClient, n: int) -> float:
    """Median wall time per update of a pipelined loop (submit the next before awaiting the last)."""
    times, previous = [], None
    adam = trio.AdamParams(learning_rate=1e-3)
    for _ in range(n + 1):
        start = time.perf_counter()
        current = (tc.forward_backward(BATCH), tc.optim_step(adam))
        if previous is not None:
            previous[1].result(timeout=300)
            times.append(time.perf_counter() - start)
        previous = current
    assert previous is not None
    previous[1].result(timeout=300)
    return statistics.median(times)


class Attack:
    def __init__(self, name: str, start: Callable[[Attack], None]):
        self.name, self._start = name, start
        self.stop = threading.Event()
        self.answers: Counter[str] = Counter()
        self.cleanup: list[Callable[[], None]] = []
        self.threads: list[threading.Thread] = []
        self.latencies: list[float] = []  # the neighbour's heartbeat round trips, where a row times them
        self.hold_s = 0.0  # the least time the attack is held (a row that times heartbeats)

    def background(self, work: Callable[[], None], n: int = 1) -> None:
        for _ in range(n):
            t = threading.Thread(target=work, daemon=True)
            t.start()
            self.threads.append(t)

    def __enter__(self) -> Attack:
        self._start(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        for c in reversed(self.cleanup):
            with contextlib.suppress(Exception):
                c()


def stop_strings(url: str, max_tokens: int, label: str, n_stops: int = 64, num_samples: int = 1,
                 in_flight: int = 4) -> Callable[[Attack], None]:
    def start(a: Attack) -> None:
        service = trio.ServiceClient(base_url=url, api_key=MALLORY)
        a.cleanup.append(service.close)
        sampler = service.create_sampling_client(base_model=trio.DEFAULT_MODEL)
        a.cleanup.append(sampler.close)
        stops = [f"{i:02d}" + "z" * 62 for i in range(n_stops)]
        params = trio.SamplingParams(max_tokens=max_tokens, stop=stops or None, temperature=1.0)

        def run() -> None:
            while not a.stop.is_set():
                try:
                    sampler.sample(trio.ModelInput.from_ints([5, 6, 7]), num_samples, params).result(timeout=600)
                    a.answers[label] += 1
                except Exception as exc:
                    a.answers[type(exc).__name__] += 1

        a.background(run, in_flight)
    return start


_HEARTBEATS = r"""
import json, select, sys, time
import httpx
url, key, out = sys.argv[1], sys.argv[2], []
with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=30) as http:
    session = http.post("/create_session", json={"type": "create_session", "tags": [], "user_metadata": {},
                                                 "sdk_version": "bench"}).json()["session_id"]
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until stdin closes
        start = time.perf_counter()
        http.post("/session_heartbeat", json={"session_id": session, "type": "session_heartbeat"})
        out.append(time.perf_counter() - start)
        time.sleep(0.05)
print(json.dumps(out), flush=True)
"""


_LISTINGS = r"""
import collections, json, select, sys, threading
import trio_widgets as trio
url, key, run_id = sys.argv[1:4]
answers, stop = collections.Counter(), threading.Event()
service = trio.ServiceClient(base_url=url, api_key=key)
rest = service.create_rest_client()

def run():
    while not stop.is_set():
        try:
            found = rest.list_user_checkpoints(limit=1000).result(timeout=300).cursor.total_count
            rest.list_checkpoints(run_id).result(timeout=300)
            rest.list_training_runs().result(timeout=300)
            answers[f"listings of {found}"] += 1
        except Exception as exc:
            answers[type(exc).__name__] += 1

threads = [threading.Thread(target=run) for _ in range(4)]
for t in threads:
    t.start()
print("ready", flush=True)
select.select([sys.stdin], [], [])  # until stdin closes
stop.set()
for t in threads:
    t.join(300)
print(json.dumps(answers), flush=True)
service.close()
"""


def listing(url: str, n_checkpoints: int = 2000) -> Callable[[Attack], None]:
    """Another key lists 2,000 checkpoints in a loop; the neighbour's heartbeats are timed meanwhile."""
    service = trio.ServiceClient(base_url=url, api_key=MALLORY)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=1, seed=0)
    for first in range(0, n_checkpoints, 50):  # made before the row, 50 in flight (2,000 long-polls at once crawl)
        saves = [tc.save_weights_for_sampler(f"c{i:04d}") for i in range(first, min(first + 50, n_checkpoints))]
        for f in saves:
            f.result(timeout=600)

    def start(a: Attack) -> None:
        a.cleanup.append(service.close)
        # the attacker in a process of its own, as the heartbeats: decoding listings in this one would
        # hold the GIL that the neighbour's client needs (a client's Python, not the server)
        lister = subprocess.Popen([sys.executable, "-c", _LISTINGS, url, MALLORY, tc.model_id], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert lister.stdout is not None
        if lister.stdout.readline().strip() != "ready":
            raise RuntimeError("the listing process did not start")

        def listed() -> None:
            assert lister.stdin is not None and lister.stdout is not None
            lister.stdin.close()
            a.answers.update(json.loads(lister.stdout.readline()))
            lister.wait(300)

        a.cleanup.append(listed)
        # the neighbour's heartbeats, timed in a process of their own: in this one they would wait for
        # the GIL of the 4 threads decoding listings (a client's Python, not the server's loop)
        beats = subprocess.Popen([sys.executable, "-c", _HEARTBEATS, url, ALICE], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert beats.stdin is not None and beats.stdout is not None
        if beats.stdout.readline().strip() != "ready":
            raise RuntimeError("the heartbeat process did not start")

        def timed() -> None:
            assert beats.stdin is not None and beats.stdout is not None
            beats.stdin.close()  # its signal to stop and say what it measured
            a.latencies.extend(json.loads(beats.stdout.readline()))
            beats.wait(60)

        a.cleanup.append(timed)
        a.hold_s = 12.0  # heartbeats every 50 ms: ~200 of them
    return start


def slowloris(port: int) -> Callable[[Attack], None]:
    def start(a: Attack) -> None:
        socks = []
        for _ in range(1100):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            except OSError as exc:
                a.answers[f"connect {type(exc).__name__}"] += 1
        a.answers["sockets opened"] = len(socks)

        def close() -> None:
            closed = sum(1 for s in socks if _closed(s))
            a.answers["closed by the server"] = closed
            for s in socks:
                s.close()

        a.cleanup.append(close)
    return start


def body_stall(port: int) -> Callable[[Attack], None]:
    def start(a: Attack) -> None:
        socks = []
        chunk = b" " * (1 << 20)
        for _ in range(24):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /api/v1/optim_step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"X-API-Key: " + MALLORY.encode() + b"\r\nContent-Length: 16777216\r\n\r\n")
            s.settimeout(0.5)
            with contextlib.suppress(OSError):
                for _ in range(15):
                    s.sendall(chunk)
            socks.append(s)

        def close() -> None:
            for s in socks:
                s.settimeout(0.2)
                with contextlib.suppress(OSError):
                    head = s.recv(64).split(b"\r\n", 1)[0]
                    a.answers[head.decode(errors="replace") or "closed"] += 1
                s.close()

        a.cleanup.append(close)
    return start


def trickle(port: int, n: int = 4200) -> Callable[[Attack], None]:
    """One key trickles request bodies on `n` connections (a byte every 5 s each)."""
    def start(a: Attack) -> None:
        held: list[socket.socket] = []
        head = (b"POST /api/v1/optim_step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"X-API-Key: " + MALLORY.encode() + b"\r\nContent-Length: 1048576\r\n\r\n ")
        for _ in range(n):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(head)
                held.append(s)
            except OSError as exc:
                a.answers[f"connect {type(exc).__name__}"] += 1
        time.sleep(0.5)
        for s in held:  # which were refused (answered, then closed)
            s.settimeout(0.001)
            try:
                answer = s.recv(1024)
            except OSError:
                continue
            if answer:
                line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
                code = b"too_many_connections" if b"too_many_connections" in answer else b""
                a.answers[f"{line} {code.decode()}".strip()] += 1
        a.answers["connections made"] = len(held)

        def dribble() -> None:
            while not a.stop.wait(5.0):
                for s in held:
                    with contextlib.suppress(OSError):
                        s.send(b" ")

        def close() -> None:
            for s in held:
                s.close()

        a.background(dribble)
        a.cleanup.append(close)
    return start


_CHURN = """
import signal, socket, sys, time
port, until, began = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]), time.monotonic()
source = sys.argv[3]
n = 0
signal.signal(signal.SIGTERM, lambda *_: (print(n, time.monotonic() - began, flush=True), sys.exit(0)))
request = b"GET /api/v1/get_server_capabilities HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n"
while time.monotonic() < until:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        if n % 2:
            s.sendall(request)
            s.recv(256)
        s.close()
        n += 1
    except OSError:
        n += 1
print(n)
"""


def churn(port: int, processes: int = 4) -> Callable[[Attack], None]:
    """Keyless sockets opened and closed as fast as `processes` other processes can (every other one
    sends a request without a key, answered 401 and closed)."""
    def start(a: Attack) -> None:
        procs = [subprocess.Popen([sys.executable, "-c", _CHURN, str(port), "600", "127.0.0.2"], stdout=subprocess.PIPE,
                                  text=True) for _ in range(processes)]

        def stop() -> None:
            for proc in procs:
                proc.terminate()
            rates = []
            for proc in procs:
                out, _ = proc.communicate(timeout=30)
                with contextlib.suppress(ValueError):
                    count, seconds = out.split()
                    rates.append(int(count) / float(seconds))
            a.answers["sockets/s"] = round(sum(rates))

        a.cleanup.append(stop)
    return start


def many_sessions(url: str) -> Callable[[Attack], None]:
    def start(a: Attack) -> None:
        for _ in range(64):
            service = trio.ServiceClient(base_url=url, api_key=MALLORY)
            a.cleanup.append(service.close)
            try:
                tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=8)
                a.cleanup.append(tc.close)
                a.answers["clients made"] += 1
            except Exception as exc:
                a.answers[type(exc).__name__] += 1
    return start


def _closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (or answered it a refusal, then closed it)."""
    s.settimeout(0.01)
    try:
        return s.recv(1) in (b"", b"H")
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated rows to run (default: all)")
    parser.add_argument("--fleet", action="store_true", help="against a two-pool fleet (serve --ray --pools 2)")
    args = parser.parse_args()
    only = {name for name in args.only.split(",") if name}
    port = args.port or _free_port()
    with server_process(port, fleet=args.fleet) as (url, pid):
        neighbour = trio.ServiceClient(base_url=url, api_key=ALICE)
        tc = neighbour.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        seconds_per_update(tc, 3)  # warm up
        rows: dict[str, Callable[[], Callable[[Attack], None]]] = {
            "stop-strings": lambda: stop_strings(url, 16, "samples"),
            "plain-samples": lambda: stop_strings(url, 16, "samples", n_stops=0),
            "slowloris": lambda: slowloris(port), "body-stall": lambda: body_stall(port),
            "64-sessions": lambda: many_sessions(url), "trickle": lambda: trickle(port),
            "churn": lambda: churn(port),
            "long-sample": lambda: stop_strings(url, 480, "samples of 480 tokens"),
            "big-sample": lambda: stop_strings(url, 256, "requests of 128 x 256 tokens", n_stops=0, num_samples=128,
                                               in_flight=8),
            "big-stop-sample": lambda: stop_strings(url, 256, "requests of 128 x 256 tokens, 64 stops",
                                                    num_samples=128, in_flight=8),
            "listing": lambda: listing(url)}
        if only - set(rows) - {"memory"}:
            parser.error(f"--only: no rows {sorted(only - set(rows) - {'memory'})}; the rows are "
                         f"{', '.join(rows)}, memory")
        attacks = [Attack(name, make()) for name, make in rows.items() if not only or name in only]
        print(f"{'attack':<14} {'quiet s/update':>15} {'attacked':>10} {'ratio':>7}  target <= 2   attacker's answers")
        for attack in attacks:
            quiet = seconds_per_update(tc, args.updates)
            with attack:
                begun = time.monotonic()
                time.sleep(1.0)
                attacked = seconds_per_update(tc, args.updates)
                time.sleep(max(0.0, begun + attack.hold_s - time.monotonic()))
                healthy = httpx.get(f"{url}/api/v1/healthz", timeout=30).status_code
            ratio = attacked / quiet
            verdict = "ok" if ratio <= 2 else "OVER"
            answers = ", ".join(f"{k}: {v}" for k, v in attack.answers.items())
            print(f"{attack.name:<14} {quiet:>15.3f} {attacked:>10.3f} {ratio:>7.2f}  {verdict:<12} {answers}; "
                  f"healthz {healthy}", flush=True)
            if attack.latencies:
                ms = sorted(x * 1000 for x in attack.latencies)
                p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
                print(f"{'':<14} heartbeat round trips meanwhile: p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} "
                      f"ms, max {ms[-1]:.1f} ms over {len(ms)} (target max <= 100 ms) "
                      f"{'ok' if ms[-1] <= 100 else 'OVER'}", flush=True)
        neighbour.close()
        if not only or "memory" in only:
            time.sleep(2.0)
            start = _rss_mb(pid)
            for round_ in range(1, 4):  # 3 rounds, each against the one start: what rounds leave must not add up
                memory(url, pid, start, round_)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def memory(url: str, pid: int, start: float, round_: int) -> None:
    """The server's RSS against its `start` after 3 clients x 60 forwards of 8 x 500 tokens, then close()."""
    big = [trio.Datum(trio.ModelInput.from_ints([(i * 7 + j) % 200 + 3 for j in range(500)]),
                      {"target_tokens": [(i * 7 + j) % 200 + 4 for j in range(500)]}) for i in range(8)]
    services = [trio.ServiceClient(base_url=url, api_key=MALLORY) for _ in range(3)]
    clients = [s.create_lora_training_client(trio.DEFAULT_MODEL, rank=8) for s in services]
    for tc in clients:
        futures = [tc.forward(big, "cross_entropy") for _ in range(60)]
        for f in futures:
            f.result(timeout=600)
    during = _rss_mb(pid)
    for s in services:
        s.close()
    time.sleep(5.0)
    after = _rss_mb(pid)
    verdict = "ok" if after - start <= 50 else "OVER"
    print(f"memory, round {round_}: server RSS {start:.0f} MB at the start, {during:.0f} MB with 3 clients x 60 "
          f"forwards of 8 x 500 tokens, {after:.0f} MB 5 s after close(): {after - start:+.0f} MB (target <= +50 MB) "
          f"{verdict}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
