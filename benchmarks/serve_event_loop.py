"""What a served pool's HTTP thread costs per update, on asyncio's event loop and on uvloop's,
measured side by side in one run.

The server's HTTP thread shares the GIL (and, on a small machine, the cores) with the pool's
clock thread, so its CPU per request is what serving takes from the pool. Each round serves
one pool on each loop in turn (asyncio, uvloop, uvloop, asyncio); 2 tinker SDK and 2 trio
HTTP client processes (benchmarks/serve_load.py's clients, at nice 19) run 40 pipelined
updates each, and the HTTP thread's own CPU time (user + system, from /proc) while they run
is divided by their updates. An update is 2 submits and 2 retrieves, plus a share of the
clients' creating, saving and closing. Prints the median over rounds of each loop and their
ratio (lower is cheaper).

    python benchmarks/serve_event_loop.py             # ~3 minutes on 2 CPU cores
    python benchmarks/serve_event_loop.py --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile

import psutil
from serve_load import client_processes  # its client processes: the same loops, READY/go protocol

import trio_widgets as trio
import trio_widgets.http.server as served

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": served.new_event_loop}


def thread_cpu_s(native_id: int) -> float:
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    raise RuntimeError(f"thread {native_id} is gone")


def arm(pool: trio.LocalPool, loop: str, clients: int, updates: int) -> float:
    """The HTTP thread's CPU milliseconds per client update, serving `pool` on `loop`."""
    kinds = ["sdk", "trio"] * (clients // 2)
    served.new_event_loop = LOOPS[loop]  # the factory Server.start's thread builds its loop with
    try:
        with trio.serve(pool, port=0) as server:
            assert server._thread is not None and server._thread.native_id is not None
            http_thread = server._thread.native_id
            with client_processes(server.url, kinds, updates, nice=19) as run:
                cpu0 = thread_cpu_s(http_thread)
                run()
                used = thread_cpu_s(http_thread) - cpu0
            if type(server._service.state.loop).__module__.split(".")[0] != loop:
                raise RuntimeError(f"the server ran on {type(server._service.state.loop)}, not {loop}")
    finally:
        served.new_event_loop = LOOPS["uvloop"]  # the module's own factory, for whatever serves next
    return used / (len(kinds) * updates) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="an even number: half tinker SDK, half trio")
    parser.add_argument("--updates", type=int, default=40)
    args = parser.parse_args()
    try:
        import uvloop  # noqa: F401
    except ImportError:
        print("uvloop is not installed (pip install 'trio-widgets[serve]'): nothing to compare")
        return 1
    if sys.version_info < (3, 11):
        print("the tinker SDK and the server's uvloop need Python >= 3.11")
        return 1
    ms: dict[str, list[float]] = {"asyncio": [], "uvloop": []}
    with tempfile.TemporaryDirectory() as ckpt, trio.LocalPool(name="served", checkpoint_dir=ckpt) as pool:
        for round_ in range(args.rounds):
            for loop in ("asyncio", "uvloop", "uvloop", "asyncio"):
                ms[loop].append(arm(pool, loop, args.clients, args.updates))
                print(f"round {round_ + 1} {loop:>7}: HTTP thread {ms[loop][-1]:.2f} ms CPU per update", flush=True)
    a, u = statistics.median(ms["asyncio"]), statistics.median(ms["uvloop"])
    print(f"HTTP thread CPU per update, medians of {len(ms['uvloop'])} arms: asyncio {a:.2f} ms, uvloop {u:.2f} ms "
          f"-> uvloop / asyncio {u / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
