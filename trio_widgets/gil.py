"""Did other Python starve the pool? Measured while it runs, attributed to a line.

The pool runs in the user's process, so Python that holds the interpreter lock (GIL) in
another thread (a CPU-heavy batch builder in a notebook cell) slows the pool's clock
thread: each of its torch calls gives the GIL up and must win it back. Two measurements,
both cheap enough to run all the time:

* :class:`RunMeter` (on the clock thread): per cycle, the time the clock was neither
  running on a CPU nor waiting in the OS run queue: it waited to run beyond what it
  asked for, for the GIL (or for a disk write in a checkpoint op). Plus how late its
  end-of-cycle sleep woke. Reads its own CPU clock and `/proc/thread-self/schedstat`.
* :class:`GilWatchdog` (thread ``trio-gil-<pool>``): the standard heartbeat-lag probe.
  It sleeps ``interval_s``; a wake-up later than ``threshold_s`` (beyond its own run-queue
  wait, so a busy machine is not mistaken for a held GIL) means another thread held the
  interpreter. Then it looks at what the other threads execute (`sys._current_frames`),
  finds the one that ran meanwhile (its `/proc` CPU and run-queue time), and keeps its top user
  frames (file, function, line; a notebook cell's execution count and line) in a
  :class:`~trio_widgets.telemetry.GilStall` of the pool's telemetry (bounded). The watchdog
  looks when the GIL is given up, so it may find that thread stopped at a wait of its own (a
  loop blocked on `.result()` after its loader ran): a moment's probe tells a wait from a
  preemption, and a wait is blamed on the frames the look before found running. A stretch
  goes on through on-time heartbeats while that thread keeps running: a loop of short
  bytecodes hands the GIL over at each switch interval, so a heartbeat may get it at once
  while the clock, wanting it for each torch call, waits again and again (a convoy).

A busy machine is not a held GIL. A thread that holds the GIL and is then preempted (its core
taken by BLAS or OpenMP workers, or by other processes) keeps it while it waits in the run queue:
the heartbeat is late for the GIL, but the wait is one for a core. So the watchdog also reads
every thread's run-queue time (`/proc/self/task/*/schedstat`): a few times a second it records a
:class:`~trio_widgets.telemetry.CoreSample` (how many cores this process's threads wanted), and a
stretch in which this process's threads wanted every core while the holder waited for one at
least as long as it ran is contention, not a GilStall (the advisor's `cpu`).

Sleeping or waiting on I/O releases the GIL: it makes neither measurement move. The run-queue
share and the blame need Linux's /proc; elsewhere the clock's wait includes its run-queue
wait, stalls are not recorded and the core samples say so (demand None): the advisor then says
it cannot tell the GIL from a busy CPU.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from types import CodeType, FrameType

from .telemetry import GC_FILE, CoreSample, GilStall, Telemetry, UserFrame

__all__ = ["GilWatchdog", "RunMeter", "user_frames"]

log = logging.getLogger(__name__)


def _schedstat_fd(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if _runqueue_s(fd) is None:
        os.close(fd)
        return None
    return fd


def _runqueue_s(fd: int) -> float | None:
    """Seconds the thread behind `fd` (its schedstat file) waited in the OS run queue, ever."""
    try:
        fields = os.pread(fd, 96, 0).split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _times_s(fd: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting in the run queue for one) of the thread behind `fd`,
    ever (updated when it is switched out): a thread that runs Python all the time is in one of
    the two, however loaded the machine, except when it hands the GIL over."""
    try:
        fields = os.pread(fd, 96, 0).split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def cpu_count() -> int:
    """The cores this process may run on (its affinity; a container's CPU quota is not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class RunMeter:
    """For the thread that builds it: wall time it spent off a CPU and out of the run queue.

    Without /proc (not Linux) the run-queue share cannot be told apart and counts too.
    """

    def __init__(self) -> None:
        self._fd = _schedstat_fd("/proc/thread-self/schedstat")

    def mark(self) -> tuple[float, float, float]:
        rq = _runqueue_s(self._fd) if self._fd is not None else None
        return time.perf_counter(), time.thread_time(), rq or 0.0

    def waited(self, since: tuple[float, float, float]) -> tuple[float, float]:
        """(waited, cpu): seconds since `since` (a `mark()`) this thread waited for something
        other than a CPU, and the CPU seconds it ran meanwhile."""
        wall, cpu, rq = self.mark()
        return max(0.0, (wall - since[0]) - (cpu - since[1]) - (rq - since[2])), cpu - since[1]

    def overslept(self, asleep: tuple[float, float, float], deadline: float) -> float:
        """How late, past `deadline`, a sleep that began at `asleep` (a `mark()`) woke,
        less the time it then waited in the run queue."""
        wall, _, rq = self.mark()
        return max(0.0, wall - deadline - (rq - asleep[2]))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # the clock thread drops it when it ends
        self.close()


# --------------------------------------------------------------------------- frames

def _library_roots() -> tuple[str, ...]:
    """The standard library, this environment's packages, and trio_widgets itself."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(os.path.dirname(os.path.abspath(__file__)))  # this package
    return tuple(sorted(os.path.join(os.path.abspath(r), "") for r in roots))


_LIBRARY = _library_roots()
# asyncio's loop running a callback or a task's step (a task's coroutine frames sit above these)
_EVENT_LOOP = (os.path.join("asyncio", "events.py"), os.path.join("asyncio", "base_events.py"))
_ANONYMOUS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>", "<locals>")


def is_user_file(filename: str) -> bool:
    """Code the user wrote: not the standard library, not installed packages, not trio."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARY) and "site-packages" not in path and "dist-packages" not in path


def _function(code) -> str:
    """The name a person wrote: `heavy_batches` for `heavy_batches.<locals>.<genexpr>` and for
    `main.<locals>.heavy_batches`; `Loader.next_batch` for a method."""
    parts = getattr(code, "co_qualname", code.co_name).split(".")
    while len(parts) > 1 and parts[-1] in _ANONYMOUS:
        parts.pop()
    if "<locals>" in parts[:-1]:
        parts = parts[len(parts) - parts[::-1].index("<locals>"):]
    return ".".join(p for p in parts if p != "<locals>") or code.co_name


def _cells() -> dict[str, int]:
    """IPython's map from a cell's code file (ipykernel: /tmp/ipykernel_<pid>/<hash>.py) to the
    cell's execution count, the n of In[n] (the map IPython's tracebacks read); {} outside IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return {}
    try:
        shell = ipython.get_ipython()
        cells = shell.compile._filename_map if shell is not None else None
    except Exception:  # another IPython: no cell numbers, file names still say where
        return {}
    return cells if isinstance(cells, dict) else {}


def user_frames(frame: FrameType | None, limit: int = 3) -> tuple[UserFrame, ...]:
    """The innermost `limit` frames of user code on `frame`'s stack (innermost first; a
    comprehension counts as the function it is written in); if there is none, the innermost
    frame itself (library code the user called)."""
    return _user_frames(_read_stack(frame), limit)


#: Frames read of a stack at most (a recursion deep in library code is cut there).
_MAX_DEPTH = 256


def _read_stack(frame: FrameType | None) -> list[tuple[CodeType, int]]:
    """(code, line) of `frame` and its callers, innermost first: attribute reads only, nothing
    that could run other Python code or give the GIL up meanwhile (see `_stack_of`)."""
    out: list[tuple[CodeType, int]] = []
    while frame is not None and len(out) < _MAX_DEPTH:
        out.append((frame.f_code, frame.f_lineno or 0))
        frame = frame.f_back
    return out


def _stack_of(ident: int) -> tuple[list[tuple[CodeType, int]], tuple[int, int] | None]:
    """Another thread's stack (`_read_stack`), and where it is (`_at`), read while no other thread
    runs Python. CPython 3.11 can crash reading the frames of a thread that moves on during the
    walk (python/cpython#111363; a segfault in this walk, while the main thread ran a coroutine,
    ended one of this project's test runs): a zero sleep first gives this thread a whole switch
    interval before a waiting thread may ask for the GIL back, and with the collector off no
    finalizer runs other code (which could give the GIL up) during the walk of microseconds."""
    time.sleep(0)
    collecting = gc.isenabled()
    gc.disable()
    try:
        frames = sys._current_frames()
        try:
            top = frames.get(ident)
            stack, at = _read_stack(top), _at(frames, ident)
            top = None
        finally:
            # The map holds every thread's frame, this one's too: a reference cycle that would keep
            # their locals (a pool the user just dropped) alive until the next garbage collection.
            frames.clear()
    finally:
        if collecting:
            gc.enable()
    return stack, at


def _user_frames(stack: list[tuple[CodeType, int]], limit: int = 3) -> tuple[UserFrame, ...]:
    cells = _cells()
    out: list[UserFrame] = []
    for code, line in stack:
        if len(out) >= limit:
            break
        if not out and code.co_filename.endswith(_EVENT_LOOP):
            # an event loop's callback or its own work: the function that started the loop (the
            # caller of asyncio.run) is not what runs (a coroutine's own frames come before this)
            break
        cell = cells.get(code.co_filename)
        if cell is not None or is_user_file(code.co_filename):
            function = _function(code)
            if not out or (out[-1].function, out[-1].file) != (function, code.co_filename):
                out.append(UserFrame(code.co_filename, function, line, cell if isinstance(cell, int) else None))
    return tuple(out) or _library_frame(stack)


# --------------------------------------------------------------------------- watchdog

def default_threshold_s() -> float:
    """A heartbeat this late (beyond its run-queue wait) found the GIL held: an idle
    interpreter wakes a sleeper within ~0.1 ms, a thread running Python makes it wait up to
    its switch interval (5 ms by default) or, inside a long C call, until the call returns."""
    return max(0.001, 0.2 * sys.getswitchinterval())


#: On-time heartbeats in a row that end a stretch.
ON_TIME_GRACE = 1
_OWN_THREADS = ("trio-clock-", "trio-gil-")
#: The thread blamed for a late heartbeat ran on a CPU for at least this share of the time.
HOLDER_SHARE = 0.1
#: An on-time heartbeat inside a stretch does not end it while the stretch's holder ran on a
#: CPU for at least this share of the time since the last look: a loop of short bytecodes
#: hands the GIL over at every switch interval, so a heartbeat may get it at once, and yet
#: the clock waits for it again and again (a convoy) as long as that thread runs.
CONVOY_SHARE = 0.5
#: Seconds between the watchdog's looks at every thread's run-queue time (a CoreSample).
CORE_EVERY_S = 0.1
#: A stretch is contention, not the GIL, when this process's native threads (BLAS, OpenMP workers:
#: no Python thread) wanted at least this share of the cores the holder leaves meanwhile, and the
#: holder waited for a core at least as long as it ran: it held the GIL while they preempted it.
CONTENDED_SHARE = 0.75
#: How long the watchdog gives the GIL up to see whether the thread it blames takes it back (one
#: waiting for it is woken by the release; on a busy machine it may wait for a core longer: then the
#: look counts its frames from the look before, or none).
PROBE_S = 0.001


class _Stretch:
    """Late heartbeats in a row: becomes one GilStall."""

    __slots__ = ("started_at", "ended_at", "lag_s", "heartbeats", "on_time", "samples", "frames", "cpu",
                 "times", "tasks0")

    def __init__(self, started_at: float, tasks0: dict[int, tuple[float, float]] | None = None) -> None:
        self.started_at = self.ended_at = started_at
        self.lag_s = 0.0
        self.heartbeats = 0
        self.on_time = 0  # on-time heartbeats since the last late one
        # Samples per (thread, innermost function) and the latest frames of each: the stretch is
        # blamed on the most sampled one (a sample taken just as the holder moved on is outvoted).
        self.samples: Counter[tuple[str, str, str]] = Counter()
        self.frames: dict[tuple[str, str, str], tuple[UserFrame, ...]] = {}
        self.cpu: dict[int, float] = {}  # native thread id -> its CPU + run-queue s at the last sample
        # native thread id -> [on a CPU, in the run queue] seconds at its first sample, then at its last
        self.times: dict[int, list[float]] = {}
        self.tasks0 = tasks0  # every thread's (CPU s, run-queue s) at its start


class GilWatchdog:
    """Thread ``trio-gil-<name>``: heartbeat lag, and who held the GIL meanwhile.

    Started by `start()`, stopped (and joined) by `stop()`; LocalPool does both with its clock.
    Pools' clock threads and other watchdogs are never blamed: their Python is the pools' own
    work (a clock runs Python between its torch calls).
    """

    def __init__(self, telemetry: Telemetry, name: str, *, interval_s: float = 0.02,
                 threshold_s: float | None = None, max_stretch_s: float = 0.25) -> None:
        self.telemetry = telemetry
        self.name = f"trio-gil-{name}"
        self.interval_s = float(interval_s)
        self.threshold_s = default_threshold_s() if threshold_s is None else float(threshold_s)
        self.max_stretch_s = max_stretch_s
        self.heartbeats = 0
        self.late = 0
        self.cpu_s = 0.0  # CPU seconds this thread used so far (what it costs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stretch: _Stretch | None = None
        self._task_fds: dict[int, int] = {}
        self._all_fds: dict[int, int] = {}  # every thread's schedstat, native ones (BLAS) too
        self._last_sample = 0.0
        self.cpus = cpu_count()
        #: stretches that were contention (the holder preempted while every core was wanted), not the GIL
        self.contended = 0
        # Full collections seen at the last look. One holds the GIL from start to end, so a look can
        # only come after it, at whatever the collecting thread runs next, a random allocator. (Not
        # gc.callbacks: a Ctrl-C landing in a callback's Python is swallowed by the collector.)
        self._full_collections = _full_collections()
        # native thread id -> its frames at the latest look that found it running (not stopped at a wait
        # of its own), in this hold: kept across a stretch closed only for its length
        self._running: dict[int, tuple[UserFrame, ...]] = {}

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> GilWatchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; wait up to `timeout` seconds for it to end (0: do not wait)."""
        self._stop.set()
        thread = self._thread
        if timeout > 0 and thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        own = _schedstat_fd("/proc/thread-self/schedstat")
        cpu0 = time.thread_time()
        try:
            rq = _runqueue_s(own) if own is not None else 0.0
            looked = (time.perf_counter(), _total(self._tasks()) if own is not None else None)
            lags = 0.0
            while not self._stop.is_set():
                asked = time.perf_counter()
                time.sleep(self.interval_s)  # one C call: cheaper than Event.wait (stop() waits <= 20 ms)
                woke = time.perf_counter()
                rq_now = (_runqueue_s(own) or 0.0) if own is not None else 0.0
                lag = (woke - asked - self.interval_s) - (rq_now - (rq or 0.0))
                rq = rq_now
                lags += max(0.0, woke - asked - self.interval_s)
                if woke - looked[0] >= CORE_EVERY_S:
                    looked = self._look(looked, woke, lags, own is not None)
                    lags = 0.0
                self.heartbeats += 1
                self.cpu_s = time.thread_time() - cpu0
                if self._stop.is_set():
                    break
                if lag > self.threshold_s:
                    self.late += 1
                    self._late(asked + self.interval_s, woke, lag)
                elif self._stretch is not None and not self._convoy(self._stretch, woke):
                    # A holder that gives the GIL up now and then (to the clock's torch calls)
                    # lets a heartbeat through on time: one such does not end the stretch.
                    self._stretch.on_time += 1
                    if self._stretch.on_time > ON_TIME_GRACE:
                        self._close_stretch()
            if self._stretch is not None:
                self._close_stretch()
        except Exception:  # a probe must never take the process down
            log.exception("%s stopped", self.name)
        finally:
            if own is not None:
                os.close(own)
            for fds in (self._task_fds, self._all_fds):
                for fd in fds.values():
                    os.close(fd)
                fds.clear()

    def _tasks(self) -> dict[int, tuple[float, float]] | None:
        """native thread id -> (CPU s, run-queue s) ever, for every thread of this process alive now."""
        try:
            natives = [int(n) for n in os.listdir("/proc/self/task")]
        except (OSError, ValueError):
            return None
        alive = set(natives)
        for gone in [n for n in self._all_fds if n not in alive]:
            os.close(self._all_fds.pop(gone))
        out = {}
        for native in natives:
            fd = self._all_fds.get(native)
            if fd is None:
                fd = _schedstat_fd(f"/proc/self/task/{native}/schedstat")
                if fd is None:
                    continue  # ended meanwhile
                self._all_fds[native] = fd
            times = _times_s(fd)
            if times is not None:
                out[native] = times
        return out

    def _look(self, looked: tuple[float, tuple[float, float] | None], now: float, lags: float,
              schedstat: bool) -> tuple[float, tuple[float, float] | None]:
        """Record a CoreSample for the window since `looked` (time, _tasks()); returns the next
        baseline. A thread that ended in the window takes its time along: demand is a lower bound."""
        tasks = _total(self._tasks()) if schedstat else None
        before = looked[1]
        demand = rq = None
        if tasks is not None and before is not None:
            demand = max(0.0, tasks[0] + tasks[1] - before[0] - before[1])
            rq = max(0.0, tasks[1] - before[1])
        self.telemetry.add_core_sample(CoreSample(at=now, window_s=now - looked[0], cpus=self.cpus,
                                                  demand_s=demand, runqueue_s=rq, lag_s=lags))
        return now, tasks

    def _late(self, due: float, woke: float, lag: float) -> None:
        stretch = self._stretch
        if stretch is not None and woke - stretch.started_at > self.max_stretch_s:
            self._close_stretch(goes_on=True)  # bounded stretches: the views and the advisor see them soon
            stretch = None
        if stretch is None:
            stretch = self._stretch = _Stretch(due, self._tasks())
            self._last_sample = woke
        stretch.ended_at = woke
        stretch.on_time = 0
        stretch.lag_s += lag
        stretch.heartbeats += 1
        holder = self._holder(stretch, woke - self._last_sample)
        self._last_sample = woke
        if holder is not None:
            self._sample(stretch, *holder)
            self.telemetry.gil_ongoing = _as_stall(stretch)

    def _convoy(self, stretch: _Stretch, woke: float) -> bool:
        """An on-time heartbeat while the stretch's holder still runs: the stretch goes on.

        A stretch's first late heartbeat only takes the threads' CPU baseline; in a convoy the
        next ones are often on time, so this look is the first that can name the holder (else
        isolated late heartbeats, each followed by on-time ones, would never be recorded)."""
        if not stretch.cpu:
            return False
        holder = self._holder(stretch, woke - self._last_sample, CONVOY_SHARE)
        self._last_sample = woke
        if holder is None or (stretch.samples and holder[0] != _leading_thread(stretch)):
            return False
        stretch.ended_at = woke
        stretch.on_time = 0
        self._sample(stretch, *holder)
        self.telemetry.gil_ongoing = _as_stall(stretch)
        if woke - stretch.started_at > self.max_stretch_s:
            self._close_stretch(goes_on=True)  # bounded, as in _late: the next late heartbeat starts the next one
        return True

    @staticmethod
    def _sample(stretch: _Stretch, thread: str, frames: tuple[UserFrame, ...]) -> None:
        key = (thread, frames[0].file, frames[0].function) if frames else (thread, "", "")
        stretch.samples[key] += 1
        stretch.frames[key] = frames

    def _holder(self, stretch: _Stretch, window_s: float,
                share: float = HOLDER_SHARE) -> tuple[str, tuple[UserFrame, ...]] | None:
        """The thread, other than pools' own, that ran (on a CPU, or waiting in the run queue for
        one) for most of the time since the previous look (the one that kept the GIL), with its
        top user frames now.

        None when no such thread ran for at least `share` of that time: then the GIL was the
        pools' own (a clock runs Python between its torch calls), or nobody's.
        """
        me = threading.get_ident()
        cpu: dict[int, float] = {}
        best: tuple[float, threading.Thread] | None = None
        for thread in threading.enumerate():
            native = thread.native_id
            if thread.ident == me or native is None or thread.name.startswith(_OWN_THREADS):
                continue
            times = self._times_of(native)
            if times is None:
                continue
            used = times[0] + times[1]
            cpu[native] = used
            seen = stretch.times.get(native)
            if seen is None:
                stretch.times[native] = [*times, *times]
            else:
                seen[2], seen[3] = times
            before = stretch.cpu.get(native)
            if before is not None and (best is None or used - before > best[0]):
                best = (used - before, thread)
        first = not stretch.cpu
        stretch.cpu = cpu
        # read at every look, so a pass counts only in the window it ran in
        full, self._full_collections = self._full_collections, _full_collections()
        if first or best is None or best[0] < share * window_s:
            return None
        thread = best[1]
        if self._full_collections != full:  # a full pass since the last look: the collector's time
            return thread.name, (UserFrame(GC_FILE, "gc", 0, None, user=False),)
        ident, native = thread.ident, thread.native_id
        assert ident is not None and native is not None  # (a started thread's: enumerate() lists no other)
        stack, at = _stack_of(ident)
        now, waits = _user_frames(stack), _library_frame(stack)
        if not self._ran_on(native, ident, at):
            # It gave the GIL up itself (a lock, a result, I/O) after running: where it waits now is
            # not what ran (a loop blocked on `.result()` after its loader's Python). The window is
            # its frames' at the look before, that found it running; without one, the wait itself,
            # as library code: the hold counts, no user code is blamed for it.
            return thread.name, self._running.get(native, waits)
        self._running[native] = now
        return thread.name, now

    def _ran_on(self, native_id: int, ident: int, at: tuple[int, int] | None) -> bool:
        """Whether a thread the watchdog found stopped at `at` (its innermost frame, instruction) had
        been preempted, not stopped on its own: given the GIL for a moment, it runs on.

        The switch interval makes a thread running Python drop the GIL and wait for it: it takes it
        back as soon as it is released, and its frame moves on (or a C call that keeps the GIL, a
        sort, runs: CPU time). One blocked on a lock, a result or I/O stays where it was, the CPU
        it used since only what it took to reach its wait. Without /proc, the frame alone says."""
        fd = self._task_fds.get(native_id)
        before = _times_s(fd) if fd is not None else None
        time.sleep(PROBE_S)
        frames = sys._current_frames()
        try:
            if _at(frames, ident) != at:
                return True  # it ran Python (or ended)
        finally:
            frames.clear()
        after = _times_s(fd) if fd is not None else None
        return before is not None and after is not None and after[0] - before[0] >= PROBE_S / 2

    def _times_of(self, native_id: int) -> tuple[float, float] | None:
        fd = self._task_fds.get(native_id)
        if fd is None:
            if len(self._task_fds) > 256:  # threads come and go: forget the ones seen long ago
                for old in list(self._task_fds)[:128]:
                    os.close(self._task_fds.pop(old))
            fd = _schedstat_fd(f"/proc/self/task/{native_id}/schedstat")
            if fd is None:
                return None
            self._task_fds[native_id] = fd
        value = _times_s(fd)
        if value is None:  # that thread ended
            os.close(self._task_fds.pop(native_id))
        return value

    def _close_stretch(self, goes_on: bool = False) -> None:
        stretch, self._stretch = self._stretch, None
        self.telemetry.gil_ongoing = None
        if not goes_on:
            self._running.clear()
        if stretch is None or not stretch.samples:
            return  # a single late heartbeat: too short to say who held the GIL
        if self._contended(stretch):
            self.contended += 1
            return
        self.telemetry.add_gil_stall(_as_stall(stretch))

    def _contended(self, stretch: _Stretch) -> bool:
        """This process's native threads (BLAS workers) wanted the cores the holder left during the
        stretch, and the holder waited in the run queue at least as long as it ran: it held the GIL
        while they preempted it. A wait for a core, which moving work to another process does not
        cure (fewer BLAS threads do); Python threads preempted by other processes stay GIL."""
        before, after = stretch.tasks0, self._tasks()
        window = stretch.ended_at - stretch.started_at
        if before is None or after is None or window <= 0:
            return False
        python = {t.native_id for t in threading.enumerate()}
        native = sum(sum(after[n]) - sum(before[n]) for n in after if n in before and n not in python)
        if native < CONTENDED_SHARE * max(1, self.cpus - 1) * window:
            return False
        holder = _leading_thread(stretch)
        natives = {t.name: t.native_id for t in threading.enumerate()}
        seen = stretch.times.get(natives.get(holder) or -1)
        if seen is None:
            return False
        ran, queued = seen[2] - seen[0], seen[3] - seen[1]
        return queued >= ran


def _library_frame(stack: list[tuple[CodeType, int]]) -> tuple[UserFrame, ...]:
    """A stack's innermost frame, never user code (where a thread waits is not what it ran)."""
    if not stack:
        return ()
    code, line = stack[0]
    return (UserFrame(code.co_filename, _function(code), line, None, user=False),)


def _at(frames: dict[int, FrameType], ident: int) -> tuple[int, int] | None:
    """Where a thread is: its innermost frame and instruction (None: it ended)."""
    top = frames.get(ident)
    return (id(top), top.f_lasti) if top is not None else None


def _full_collections() -> int:
    """Full (oldest-generation) collections so far: young ones are short, bounded by their size."""
    return int(gc.get_stats()[-1]["collections"])


def _total(tasks: dict[int, tuple[float, float]] | None) -> tuple[float, float] | None:
    """(CPU s, run-queue s) summed over the threads of a `_tasks()` answer."""
    if tasks is None:
        return None
    return sum(t[0] for t in tasks.values()), sum(t[1] for t in tasks.values())


def _leading_thread(stretch: _Stretch) -> str:
    """The thread sampled most often in the stretch (a sample taken as it moved on is outvoted)."""
    per_thread: Counter[str] = Counter()
    for (name, _, _), n in stretch.samples.items():
        per_thread[name] += n
    return per_thread.most_common(1)[0][0]


def _as_stall(stretch: _Stretch) -> GilStall:
    """The stretch so far (it has samples) as a GilStall, blamed on its leading thread's code."""
    thread = _leading_thread(stretch)
    # Its user code, when any was on its stack: a loader that hands each batch to trio's
    # validation is named, not the validation (library frames are kept only for want of any)
    key = max((k for k in stretch.samples if k[0] == thread),
              key=lambda k: (_is_user(stretch.frames[k]), stretch.samples[k]))
    return GilStall(started_at=stretch.started_at, ended_at=stretch.ended_at, lag_s=stretch.lag_s,
                    heartbeats=stretch.heartbeats, thread=thread, frames=stretch.frames[key])


def _is_user(frames: tuple[UserFrame, ...]) -> bool:
    return bool(frames) and frames[0].user
