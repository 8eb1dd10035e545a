"""GIL, a busy CPU and I/O told apart: each loader shape 10 times, each named right 10 of 10.

A data loader that slows a training loop can hold the interpreter (pure Python: `gil`), fill
every core with BLAS threads while releasing the interpreter (numpy: `cpu`, the waits are for a
core), merely wait (sleep, I/O: a client-side `stall`), or do its Python in another process
(never `gil`). The machine these run on is shared (2 cores, other jobs): that is the point, a
loaded machine must change the numbers, not the causes. Real pools, real threads, real BLAS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import random_batch

import trio_widgets as trio
from trio_widgets import gil
from trio_widgets.advisor import Diagnosis, diagnose_telemetry
from trio_widgets.gil import cpu_count
from trio_widgets.telemetry import CoreSample, RequestRecord
from trio_widgets.watch import diagnose_watched

# `make test` runs it alone, with no test beside it: it names a loop's cause from the CPU and waits it measures
pytestmark = pytest.mark.alone

RUNS = 10
#: updates per run: the advisor diagnoses from 3 (MIN_UPDATES); at lookahead 2 the last 2 run after the
#: loader's last batch, so 8 leave 6 of the loader's (a clear majority for the medians it takes)
STEPS = 8
LOADER_S = 0.1  # per batch
Loader = Callable[[Iterator, trio.LocalPool], Iterator]


def cached_batches(n: int = 8) -> Iterator:
    batch = random_batch(0, n=n, length=12)
    while True:
        yield batch


def python_batches(batches: Iterator, pool: trio.LocalPool) -> Iterator:
    """Pure Python: it holds the GIL throughout."""
    for batch in batches:
        start, x = time.perf_counter(), 0
        while time.perf_counter() - start < LOADER_S:
            x += 1
        yield batch


def numpy_batches(batches: Iterator, pool: trio.LocalPool) -> Iterator:
    """Matrix products: BLAS releases the GIL and runs on every core."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 256)), rng.standard_normal((256, 256))
    for batch in batches:
        start = time.perf_counter()
        while time.perf_counter() - start < LOADER_S:
            a @ b
        yield batch


#: a waiting loader's wait, in the pool's cycles (at least LOADER_S): a round trip takes <= 2 cycles,
#: 3 on a loaded machine, so each next request comes >= 5 cycles after its results
WAIT_CYCLES = 8


def last_cycle(pool: trio.LocalPool) -> int:
    try:
        return pool.telemetry.cycles[-1].index
    except IndexError:
        return -1


def wait_cycles(pool: trio.LocalPool, step: Callable[[], object]) -> None:
    """Call `step` (a short wait) until WAIT_CYCLES of the pool's cycles have ended and LOADER_S has
    passed. Counted in cycles, not seconds: a load spike that stretches the cycles stretches the wait
    with them, so a wait stays a wait of several cycles whatever the machine does (a wait of seconds
    that a spike fits into the time the pool needs anyway wastes nothing: no stall to name)."""
    first, start = last_cycle(pool), time.perf_counter()
    while last_cycle(pool) - first < WAIT_CYCLES or time.perf_counter() - start < LOADER_S:
        step()


def sleeping_batches(batches: Iterator, pool: trio.LocalPool) -> Iterator:
    """Waiting for I/O (a disk, a network): no GIL, no CPU."""
    for batch in batches:
        wait_cycles(pool, lambda: time.sleep(0.005))
        yield batch


def spin(seconds: float) -> int:
    """Pure Python in a worker process: it holds that process's GIL, not this one's."""
    start, x = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        x += 1
    return x


def process_pool_batches(executor: concurrent.futures.Executor) -> Loader:
    def batches(source: Iterator, pool: trio.LocalPool) -> Iterator:
        for batch in source:
            # the worker's Python, 10 ms at a time, for as long as the wait: this thread only waits
            wait_cycles(pool, lambda: executor.submit(spin, 0.01).result())
            yield batch
    return batches


def _openblas() -> ctypes.CDLL:
    """numpy's bundled OpenBLAS, as threadpoolctl finds it: by the library this process mapped."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.split()[-1]}
    if not paths:
        pytest.skip("numpy here is not built on a bundled OpenBLAS")
    return ctypes.CDLL(sorted(paths)[0])


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """numpy's BLAS on `n` threads meanwhile (threadpoolctl's threadpool_limits, by hand)."""
    np.ones((64, 64)) @ np.ones((64, 64))  # loaded and initialised
    lib = _openblas()
    get, set_ = lib.scipy_openblas_get_num_threads64_, lib.scipy_openblas_set_num_threads64_
    set_.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    before = get()
    set_(n)
    try:
        assert get() == n
        yield
    finally:
        set_(before)


def runs(loader: Loader, n: int = RUNS, steps: int = STEPS) -> list[Diagnosis]:
    """`n` short pipelined trio.train loops (an asyncio task on this thread, as in a notebook), half
    on 20 ms cycles and half on 50 ms, lookahead 1 and 2 alternating; one client per run."""
    out = []
    for min_cycle_s in (0.02, 0.05):
        with trio.LocalPool(min_cycle_s=min_cycle_s, name=f"causes-{min_cycle_s}") as pool:
            for k in range(n // 2):
                tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=k)

                async def main(tc=tc, k=k) -> None:
                    await trio.train(tc, loader(cached_batches(), pool), mode="pipelined", learning_rate=1e-3,
                                     lookahead=1 + k % 2, steps=steps)

                asyncio.run(main())
                out.append(diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id])
                tc.close()
    return out


def named(diagnoses: list[Diagnosis]) -> list[str]:
    return [d.cause for d in diagnoses]


def shown(diagnoses: list[Diagnosis]) -> list[str]:
    """What a failure prints: each run's cause and evidence."""
    return [f"{d.cause}: {d.evidence}" for d in diagnoses]


def test_pure_python_in_the_loader_is_gil_10_of_10():
    diagnoses = runs(python_batches)
    assert named(diagnoses) == ["gil"] * RUNS, (named(diagnoses), shown(diagnoses))
    where = [[(f.function, f.line) for f in d.gil_frames] for d in diagnoses]
    assert all(d.gil_frames[0].function == "python_batches" for d in diagnoses), where


def test_numpy_on_every_core_is_cpu_never_gil_10_of_10():
    cpus = cpu_count()
    with blas_threads(cpus):
        diagnoses = runs(numpy_batches)
    assert named(diagnoses) == ["cpu"] * RUNS, (named(diagnoses), shown(diagnoses))
    for d in diagnoses:
        # its own words: the cores, the libraries' threads and how to limit them; never the GIL
        assert d.message.startswith("the CPU is busy: this process's threads wanted "), d.message
        assert f" of the {cpus} cores it may use" in d.message
        assert "OMP_NUM_THREADS=1" in d.message and "threadpool_limits(1)" in d.message
        assert "fewer processes" in d.message and "more cores" in d.message
        assert "GIL" not in d.message and "interpreter" not in d.message
        assert d.wasted and not d.gil_frames
        assert d.evidence.startswith("this process's threads wanted ")


def test_a_sleeping_loader_is_never_gil_nor_cpu_10_of_10():
    diagnoses = runs(sleeping_batches)
    causes = named(diagnoses)
    # waiting holds neither the GIL nor a core: a client-side stall, 10 of 10
    assert causes == ["stall"] * RUNS, (causes, shown(diagnoses))


def test_a_loader_in_a_process_pool_is_never_gil_nor_cpu_10_of_10():
    # spawn: a forked copy of a process running torch threads may hang
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as executor:
        executor.submit(spin, 0.0).result()  # started before the runs
        diagnoses = runs(process_pool_batches(executor))
    causes = named(diagnoses)
    # its Python holds another interpreter's lock, and its core is not one this process's threads want:
    # neither gil nor cpu; the loop waits for the worker's result, as for I/O: a stall, 10 of 10
    assert causes == ["stall"] * RUNS, (causes, shown(diagnoses))


def test_without_schedstat_the_advisor_says_it_cannot_tell_gil_from_a_busy_cpu(monkeypatch):
    """Where /proc gives no per-thread schedstat (not Linux), the run-queue wait cannot be split off
    the clock's wait: the advisor says so instead of guessing. Through gil.py's own reader."""
    monkeypatch.setattr(gil, "_schedstat_fd", lambda path: None)
    # (12 updates a run, as before: without schedstat the stall check decides first, and a GIL-heavy
    # loop's median gap lies near its 1-cycle threshold)
    diagnoses = runs(python_batches, n=2, steps=12)
    assert named(diagnoses) == ["gil-or-cpu"] * 2, shown(diagnoses)
    for d in diagnoses:
        assert "cannot tell the two apart" in d.message and "schedstat" in d.message, d.message
        assert "no per-thread schedstat on this platform" in d.evidence and d.wasted
    # a loop that waits for its data is still a stall (whatever the clock did meanwhile)
    assert named(runs(sleeping_batches, n=2)) == ["stall"] * 2


def test_the_watchdog_reads_every_threads_run_queue_time():
    """CoreSamples a few times a second: this process's threads' demand for cores (BLAS workers,
    which are no Python threads, included), within what the cores could give."""
    with trio.LocalPool(min_cycle_s=0.02, name="causes-cores") as pool, blas_threads(cpu_count()):
        time.sleep(0.3)
        idle = list(pool.telemetry.cores)
        t0 = time.perf_counter()
        rng = np.random.default_rng(0)
        a = rng.standard_normal((256, 256))
        while time.perf_counter() - t0 < 1.0:
            a @ a
        time.sleep(0.15)
        busy = [c for c in pool.telemetry.cores if c.at - c.window_s >= t0 and c.at <= t0 + 1.0]
    assert idle and busy
    assert all(c.cpus == cpu_count() and c.demand_s is not None and c.runqueue_s is not None for c in idle + busy)
    assert all(0 <= (c.runqueue_s or 0) <= (c.demand_s or 0) for c in busy)
    # every core wanted while the products ran (each worker runs or waits for a core: demand counts both)
    mean = sum(c.demand_s or 0 for c in busy) / sum(c.window_s for c in busy)
    assert mean >= 0.9 * cpu_count(), (mean, busy)


def _stalled_loop(updates: int = 8) -> list[RequestRecord]:
    """A watched loop's records: each update 0.1 s in flight, the next one 0.2 s after its results."""
    records, t = [], 0.0
    for k in range(updates):
        for j, op in enumerate(("forward_backward", "optim_step")):
            records.append(RequestRecord(2 * k + j, "c", op, queued_at=t + 0.001 * j, delivered_at=t + 0.1,
                                         status="ok"))
        t += 0.3
    return records


def test_the_watched_loop_names_cpu_and_says_when_it_cannot_tell():
    """trio.watch's diagnosis from the same CoreSamples: a stall while this process's threads wanted
    every core is cpu; where the platform gives no schedstat, it says it cannot tell; without samples
    (no watchdog) it stays a stall. From records alone: the rules, not the machine."""
    records = _stalled_loop()
    end = records[-1].delivered_at or 0.0

    def samples(demand: float | None) -> list[CoreSample]:
        return [CoreSample(at=t, window_s=0.1, cpus=2, demand_s=demand, runqueue_s=None if demand is None else 0.05)
                for t in (0.1 * i for i in range(1, int(end * 10) + 2))]

    assert diagnose_watched(records)["c"].cause == "stall"
    busy = diagnose_watched(records, cores=samples(0.2))["c"]  # 2.0 cores of 2
    assert busy.cause == "cpu" and busy.wasted, busy
    assert busy.message.startswith("the CPU is busy: this process's threads wanted 2.0 of the 2 cores it may use")
    assert "GIL" not in busy.message and "OMP_NUM_THREADS=1" in busy.message
    assert diagnose_watched(records, cores=samples(0.1))["c"].cause == "stall"  # 1 core of 2: not every core
    unknown = diagnose_watched(records, cores=samples(None))["c"]
    assert unknown.cause == "gil-or-cpu" and "trio cannot tell whether" in unknown.message, unknown
