"""A workshop room for browser tests and benchmarks/browser_cost.py: a served pool in its own
process (`python -m trio_widgets serve`, keyless on 127.0.0.1) and N participants training on it
from another process, one session each, named "participant NN" (their `user_metadata`), each a
pipelined loop until the room closes. Both run at a lower CPU priority (nice 10): in a workshop
they run on other machines than the instructor's browser, whose main-thread time is what the test
and benchmarks/browser_cost.py measure (a task's wall time: on 2 shared cores the room's own work
made the page wait for a core). Not a test module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from lab import REPO, free_port, process

PARTICIPANTS = """
    import os, sys, threading, time
    import trio_widgets as trio
    url, n, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]
    errors = []

    def participant(i):
        try:
            service = trio.ServiceClient(base_url=url)
            tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i,
                                                     user_metadata={"name": f"participant {i:02d}"})
            adam, previous, step = trio.AdamParams(learning_rate=1e-2 * (1 + i % 4)), None, 0
            deadline = time.monotonic() + 900
            while not os.path.exists(stop) and time.monotonic() < deadline:
                chunk = TEXT[(5 * step + i) % 40:(5 * step + i) % 40 + 17]
                batch = [trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})]
                current = (tc.forward_backward(batch), tc.optim_step(adam))
                if previous is not None:
                    previous[0].result(timeout=300)
                    previous[1].result(timeout=300)
                previous, step = current, step + 1
            service.close()
        except BaseException as exc:
            errors.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=participant, args=(i,), name=f"participant-{i}") for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # they arrive one after another, as a room does
    for t in threads:
        t.join()
    print("ERRORS", errors, flush=True)
"""


#: the room's processes, behind the page (see the module doc)
NICE = ["nice", "-n", "10"] if shutil.which("nice") else []


@contextlib.contextmanager
def room(n: int, *, min_cycle_s: float = 0.1) -> Iterator[str]:
    """A served pool with `n` participants training on it; yields its URL. On exit the
    participants stop (a stop file, then SIGTERM), then the server."""
    with tempfile.TemporaryDirectory(prefix="trio-room-") as tmp:
        where = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_", "TINKER_"))}
        env.update(PYTHONPATH=str(REPO), TRIO_TORCH_THREADS="1", HF_HUB_OFFLINE="1")
        serve = [*NICE, sys.executable, "-m", "trio_widgets", "serve", "--port", str(port),
                 "--min-cycle-s", str(min_cycle_s), "--checkpoint-dir", str(where / "ckpt")]
        with process(serve, where / "server.log", env, 0) as server:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                        break
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{(where / 'server.log').read_text()[-3000:]}")
                time.sleep(0.2)
            script = where / "participants.py"
            script.write_text(textwrap.dedent(PARTICIPANTS))
            stop = where / "stop"
            try:
                with process([*NICE, sys.executable, str(script), url, str(n), str(stop)], where / "participants.log",
                              env, 60):
                    try:
                        yield url
                    finally:
                        stop.write_text("stop")
            finally:
                log = (where / "participants.log").read_text()
                if "ERRORS []" not in log:
                    print(f"participants' log:\n{log[-3000:]}", file=sys.stderr)
