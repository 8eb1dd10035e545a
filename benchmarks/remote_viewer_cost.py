"""What a remote dashboard connecting costs a served pool's cycles: a real `python -m trio_widgets
serve` process, a trio client training on it (pipelined), and phases that alternate quiet /
viewers (a viewer opens the telemetry stream, reads its first event, the snapshot, and leaves,
once a second). The pool's own cycle records (read through one long-lived stream) give each
phase's cycle lengths; their medians and 90th percentiles are printed side by side, with the
snapshot's size.

    python benchmarks/remote_viewer_cost.py               # 4 phases of 20 s, about 2 minutes
    python benchmarks/remote_viewer_cost.py --phase-s 10
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx
from serve_abuse import server_process  # a real `serve` process (benchmarks/ is on the path)

import trio_widgets as trio
from trio_widgets.http.remote import RemotePool

BATCH = [trio.Datum(trio.ModelInput.from_ints(list(range(5, 37))), {"target_tokens": list(range(6, 38))})]


def train(url: str, stop: threading.Event) -> None:
    service = trio.ServiceClient(base_url=url)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
    adam = trio.AdamParams(learning_rate=1e-3)
    previous = None
    while not stop.is_set():
        current = (tc.forward_backward(BATCH), tc.optim_step(adam))
        if previous is not None:
            previous[1].result(timeout=120)
        previous = current
    service.close()


def viewers(url: str, stop: threading.Event, sizes: list[int]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        with httpx.stream("GET", f"{url}/api/v1/trio/telemetry", timeout=30) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            sizes.append(len(first))
        stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=20.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with server_process(port, min_cycle_s=0.05, keys=()) as (url, _):
        done = threading.Event()
        trainer = threading.Thread(target=train, args=(url, done), daemon=True)
        trainer.start()
        watch = RemotePool(url)
        time.sleep(5.0)  # warm up: the ring buffers fill, so snapshots are full size
        lengths: dict[str, list[float]] = {"quiet": [], "viewers": []}
        sizes: list[int] = []
        for phase in ("quiet", "viewers", "quiet", "viewers"):
            first = watch.telemetry.total_cycles
            stop = threading.Event()
            viewer = threading.Thread(target=viewers, args=(url, stop, sizes), daemon=True)
            if phase == "viewers":
                viewer.start()
            time.sleep(args.phase_s)
            stop.set()
            if phase == "viewers":
                viewer.join(30)
            cycles = [c for c in list(watch.telemetry.cycles) if c.index >= first and c.n_requests]
            lengths[phase] += [c.ended_at - c.started_at for c in cycles if c.ended_at > c.started_at]
        done.set()
        trainer.join(120)
        watch.close()
    print(f"snapshot sent to a connecting viewer: {statistics.median(sizes) / 1000:.1f} KB (max "
          f"{max(sizes) / 1000:.1f} KB, {len(sizes)} viewers)")
    for phase, values in lengths.items():
        values.sort()
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"{phase:>8}: {len(values)} cycles, median {statistics.median(values) * 1e3:.1f} ms, "
              f"90th percentile {p90 * 1e3:.1f} ms")
    ratio = statistics.median(lengths["viewers"]) / statistics.median(lengths["quiet"])
    print(f"median cycle with a viewer connecting every second / without: {ratio:.3f}")


if __name__ == "__main__":
    main()
