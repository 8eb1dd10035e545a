"""The dashboard's Start button: a learning-rate sweep of training runs on the built-in task.

Everything here runs on the dashboard's event loop (its own thread) except building the
clients (loading a base model takes seconds): that happens on one named, tracked thread that
`close()` joins. Runs are named run1, run2, ... (run1 #2 after a second Start); the
dashboard labels them with their current learning rate (:meth:`SweepLauncher.label`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..client import ServiceClient, TrainingClient
from ..data import addition_batches
from ..loop import TrainingRun

__all__ = ["SweepLauncher", "lr_multipliers"]

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..engine import LocalPool


def lr_multipliers(runs: int) -> list[float]:
    """A learning-rate sweep of `runs` values around 1, a factor 2 apart: 3 -> 0.5, 1, 2."""
    low = -(runs // 2)
    return [2.0 ** k for k in range(low, low + runs)]


class SweepLauncher:
    """Starts, steers and stops the runs of one Start press; `settings` is read at each batch."""

    def __init__(self, pool: LocalPool, base_model: str, rank: int, settings: dict[str, Any]):
        self.pool = pool
        self.base_model = base_model
        self.rank = rank
        self.settings = settings  # shared with the dashboard: batch size changes apply at once
        self.runs: list[TrainingRun] = []
        self.multipliers: list[float] = []
        self.starting = False
        self.error: str | None = None
        self._starts = 0
        self._after_start: list[str] = []
        self._builder: threading.Thread | None = None
        self._closed = False

    # -- state ----------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.starting:
            return "starting"
        if not self.runs:
            return "idle"
        states = {r.state for r in self.runs}
        if "running" in states or "created" in states:
            return "running" if not all(r.pause_requested for r in self.runs) else "pausing"
        if "paused" in states:
            return "paused"
        return "error" if "error" in states else "stopped"

    @property
    def busy(self) -> bool:
        return self.starting or any(not r.done() for r in self.runs)

    # -- commands (the dashboard's loop) ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.busy or self._closed:
            return
        self.starting = True
        self._after_start = []
        loop.create_task(self._start(), name="trio-dashboard-start")

    def control(self, command: str) -> None:
        """pause / resume / stop every run (remembered if the runs are still being built)."""
        if self.starting:
            self._after_start.append(command)
        for run in self.runs:
            getattr(run, command)()

    def apply(self, key: str, value: Any) -> None:
        """A setting changed: lr, mode and lookahead apply to the running runs at their next update."""
        if key == "lr":
            for run, mult in zip(self.runs, self.multipliers):
                if value and value > 0:
                    run.learning_rate = float(value) * mult
        elif key == "mode":
            for run in self.runs:
                run.mode = value
        elif key == "lookahead":
            for run in self.runs:
                run.lookahead = int(value)

    # -- building runs ---------------------------------------------------------------------------
    @staticmethod
    def label(run: TrainingRun) -> str:
        """What the dashboard calls a run: its name and its current learning rate."""
        return f"{run.name} lr={run.learning_rate:.2g}"

    def _make_clients(self, n: int) -> list[TrainingClient]:
        service = ServiceClient(self.pool)
        self._starts += 1
        clients: list[TrainingClient] = []
        for i in range(n):
            name = f"run{i + 1}" if n > 1 else "run"
            if self._starts > 1:
                name = f"{name} #{self._starts}"
            clients.append(service.create_lora_training_client(
                self.base_model, rank=self.rank, seed=1000 * self._starts + i, user_metadata={"name": name}))
        return clients

    def _batches(self, tokenizer: Any, seed: int):
        """The built-in addition task, batch size read at every batch (changes apply at once)."""
        singles = addition_batches(tokenizer, batch_size=1, seed=seed)
        while True:
            n = max(1, int(self.settings["batch_size"] or 1))
            yield [next(singles)[0] for _ in range(n)]

    async def _start(self) -> None:
        s = dict(self.settings)
        n = int(s["runs"])
        multipliers = lr_multipliers(n)
        for run in self.runs:  # they have ended: their clients' adapters and lanes are freed
            run.client.close()
        try:
            clients = await self._in_thread(self._make_clients, n)
            if self._closed or self.pool.closed:
                for tc in clients:
                    tc.close()
                return
            runs = []
            for i, (tc, mult) in enumerate(zip(clients, multipliers)):
                label = self.pool.telemetry.live_clients()[tc.client_id].label
                batches = self._batches(tc.get_tokenizer(), seed=100 * self._starts + i)
                run = TrainingRun(tc, batches, mode=s["mode"], lookahead=int(s["lookahead"]),
                                  learning_rate=float(s["lr"]) * mult, name=label)
                runs.append(run.start())
            self.runs, self.multipliers = runs, multipliers
            for command in self._after_start:
                self.control(command)
        except Exception as exc:
            log.exception("dashboard start failed")
            self.error = f"start: {exc}"
        finally:
            self.starting = False

    async def _in_thread(self, fn: Callable, *args: Any) -> Any:
        """Run `fn` on the launcher's builder thread and await it (no executor: its worker
        threads would outlive the dashboard)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def work() -> None:
            try:
                value, ok = fn(*args), True
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                value, ok = exc, False
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop closed meanwhile
                pass

        self._builder = threading.Thread(target=work, name="trio-dashboard-start", daemon=True)
        self._builder.start()
        return await done

    # -- lifecycle ----------------------------------------------------------------------------------
    async def close(self, timeout: float = 30.0) -> None:
        """Stop the runs (on the dashboard's loop), wait until what they submitted is recorded,
        release their clients, and wait for a start in progress."""
        self._closed = True
        for run in self.runs:
            run.stop()
        tasks = [run.task for run in self.runs if run.task is not None and not run.task.done()]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:  # a wedged pool: cancel (the run withdraws what is queued)
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for run in self.runs:
            if run.done():
                run.client.close()
        builder = self._builder
        if builder is not None and builder is not threading.current_thread():
            builder.join(timeout)  # it only loads a base model: seconds at most

    def retarget(self, pool: LocalPool) -> None:
        """The dashboard follows another pool: later Starts train there (the old runs ended with it)."""
        self.pool = pool
        self.runs, self.multipliers = [], []
