"""Why is a loop slow? Pure functions over telemetry records, one diagnosis per client.

Nothing here instruments the user's loop: everything is read from the pool's
`RequestRecord`s (queued / delivered times, the cycle each request ran in), its
`CycleRecord`s (how long the clock waited for the interpreter) and the GIL watchdog's
`GilStall`s (who held the interpreter, where).

* cycles per update (the *period*, trio_widgets.metrics): the median number of cycles between a
  client's successive forward_backward requests, over its recent updates;
* the loop's structure, from one update to the next: naive (an optim_step was queued after
  its forward_backward had been delivered), together (the next forward_backward was queued
  only after the previous update's results had been delivered), else pipelined. Only the
  current *segment* counts: when the last steps agree with each other and not with most
  steps before (a mode change), the updates before the change are left out, so a new mode
  shows within 3 updates;
* gil: in the cycles that ran this client's updates the clock waited for the interpreter at
  least half as long as it worked, while another thread's Python held it (the watchdog
  names the function and line). The pool shares the process, so that Python stretches
  every cycle; sleeping or waiting on I/O holds no GIL and is never this. On a served pool
  (`served`: its clients' loops run in other processes) only user code in the server's process
  is a client's `gil`; the server's own Python (its request handling, a library's thread)
  stretches every client's cycles alike and is no client's doing: each client gets the
  diagnosis its loop earns without it, the evidence saying what held the interpreter;
* cpu: the loop is slow (more than ~1 cycle per update, or the clock waited in the OS run queue at
  least half as long as it worked: its cycles stretch) while this process's threads wanted about
  every CPU core (BLAS or OpenMP workers on every core: the GIL watchdog's CoreSamples, from
  /proc/self/task/*/schedstat): the waits are for a core, not for the GIL, and moving work to a
  process would not help; fewer math-library threads, fewer processes or more cores would. On a
  served pool the cores are the server's, wanted by its threads: no client's `cpu` (as for `gil`,
  each client gets what its loop earns, the evidence saying how busy the server's cores were);
* gil-or-cpu: the clock waited as for `gil`, on a platform without per-thread run-queue times:
  a held GIL and a busy CPU look the same there, and the advisor says so rather than guess
  (not on a served pool: either way the server's, no client's);
* client-side stall: results were delivered, but the client's next request came more than
  one cycle later (CPU-heavy Python on the event loop, a slow data loader, sleeping, ...);
  reported when the loop is otherwise pipelined and takes more than ~1 cycle per update (a
  gap its lookahead hides wastes nothing), or the stall costs more cycles than the loop's
  structure does. Time in which sampling requests were in the pool (an RL loop
  waiting for its samples) is the pool's work, not a stall;
* sampling: each update waited at least a cycle for samples from the pool (on-policy RL), and
  longer than for the loop's own Python in between;
* otherwise pipelined: one cycle per update, nothing wasted.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .metrics import PERIOD_WINDOW, cycle_duration, cycles_per_update, format_cycles
from .ops import OPS, UPDATE_OPS
from .telemetry import GC_FILE, ClientInfo, CoreSample, CycleRecord, GilStall, RequestRecord, Telemetry, UserFrame

__all__ = ["Diagnosis", "core_demand", "cpu_message", "cycle_seconds", "diagnose", "diagnose_client",
           "diagnose_telemetry", "gil_held", "gil_where",
           "recent_records", "recent_stalls", "segment_start", "step_kinds", "update_pairs"]

Cause = Literal["pipelined", "naive", "together", "stall", "gil", "cpu", "gil-or-cpu", "sampling", "warming-up",
                "slow"]

#: Cycles an update takes for each loop structure, without stalls.
STRUCTURE_PERIOD = {"naive": 4, "together": 2, "pipelined": 1}
MIN_UPDATES = 3
#: gil: in the median cycle the clock waited for the interpreter at least this share of the
#: CPU time it worked (what it asked for): the GIL alone made it take >= 1.5x as long, ...
GIL_SHARE = 0.5
#: ... and other threads' Python held it (the watchdog's stalls) for this share of that time.
GIL_COVERAGE = 0.2
#: cpu: this process's threads wanted at least this share of the cores it may run on
CPU_CORES = 0.9
#: what the cause names count as time lost
WASTED = ("naive", "together", "stall", "slow", "gil", "cpu", "gil-or-cpu")


@dataclass(frozen=True)
class Diagnosis:
    client_id: str
    label: str
    cause: Cause
    message: str
    cycles_per_update: float | None = None
    stall_cycles: float | None = None
    updates: int = 0  # how many recent updates the diagnosis is based on
    #: gil: the clock's median wait for the interpreter per cycle, as a share of its CPU time
    gil_share: float | None = None
    #: gil: where the Python that held the interpreter ran (innermost user frame first)
    gil_frames: tuple[UserFrame, ...] = ()
    #: cycles per update the loop waited for samples from the pool
    sampling_cycles: float | None = None
    #: what was measured against which threshold, in words (the dashboard shows it on hover)
    evidence: str = ""

    @property
    def wasted(self) -> bool:
        return self.cause in WASTED


def _plural(value: float, word: str) -> str:
    text = format_cycles(value)
    return f"{text} {word}" if text == "1" else f"{text} {word}s"


def _is_step(op: str) -> bool:
    spec = OPS.get(op)
    return spec is not None and spec.is_step


def _is_sample(op: str) -> bool:
    spec = OPS.get(op)
    return spec is not None and spec.kind == "sample"


def cycle_seconds(cycles: Iterable[CycleRecord], default: float | None = None) -> float | None:
    """Median measured duration of the recent (finished) cycles, else `default`."""
    return cycle_duration((c.ended_at - c.started_at for c in cycles), default=default)


def _delivered(record: RequestRecord, need_cycle: bool) -> bool:
    return (record.delivered_at is not None and record.status in ("ok", "error")
            and (record.cycle is not None or not need_cycle))


def _delivered_at(record: RequestRecord) -> float:
    """When a record `update_pairs` kept was delivered (always set for those)."""
    return record.delivered_at if record.delivered_at is not None else float("inf")


def update_pairs(records: Sequence[RequestRecord], *, need_cycle: bool = True
                 ) -> list[tuple[RequestRecord, RequestRecord | None]]:
    """(forward_backward, its optim_step or None) in submission order, delivered ones only
    (`need_cycle`: that a pool ran, as a pool's records say; records seen from a client have none)."""
    updates: list[list] = []
    for record in records:
        if record.op in UPDATE_OPS:
            updates.append([record, None])
        elif _is_step(record.op) and updates and updates[-1][1] is None:
            updates[-1][1] = record
    return [(fb, opt) for fb, opt in updates
            if _delivered(fb, need_cycle) and fb.status == "ok" and (opt is None or _delivered(opt, need_cycle))]


def step_kinds(updates: Sequence[tuple[RequestRecord, RequestRecord | None]]) -> list[str]:
    """The loop's structure at each step from one update to the next (the STRUCTURE_PERIOD names):
    naive when optim_step came after forward_backward's result, together when the next batch came
    after both results, else pipelined. From submit and delivery times alone."""
    kinds: list[str] = []
    for (fb, opt), (nxt, _) in zip(updates, updates[1:]):
        fb_done = _delivered_at(fb)
        if opt is not None and opt.queued_at > fb_done:
            kinds.append("naive")
        else:
            last = max(fb_done, _delivered_at(opt) if opt is not None else fb_done)
            kinds.append("together" if nxt.queued_at >= last else "pipelined")
    return kinds


def segment_start(kinds: Sequence[str]) -> int:
    """The first update of the current segment. kinds[i] is the structure of the step from
    update i to i+1; when the last two or more agree and differ from most of those before
    (the loop changed mode), the segment starts at that run's first update."""
    run = 1
    while run < len(kinds) and kinds[-run - 1] == kinds[-1]:
        run += 1
    if run < 2 or run == len(kinds):
        return 0
    before = kinds[:-run]
    majority = max(dict.fromkeys(before), key=before.count)
    return 0 if majority == kinds[-1] else len(kinds) - run


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(union: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Seconds of [a, b] inside the disjoint, sorted `union` (`starts`: their left ends)."""
    total = 0.0
    for lo, hi in union[max(0, bisect.bisect_right(starts, a) - 1):]:
        if lo >= b:
            break
        total += max(0.0, min(hi, b) - max(lo, a))
    return total


def _ratio(value: float) -> str:
    return f"{value:.1f}×" if value < 9.95 else f"{value:.0f}×"


def _gil(updates: Sequence[tuple[RequestRecord, RequestRecord | None]], cycles: Mapping[int, CycleRecord],
         stalls: Sequence[GilStall]) -> tuple[float, float, float, float, float, GilStall] | None:
    """(wait / compute, held share, wait s, compute s, cycle s, the culprit's stall) when the clock waited
    for the interpreter, in the cycles that ran these updates, at least GIL_SHARE of the CPU
    time it worked, and other threads' Python held it (the watchdog's stalls) for at least
    GIL_COVERAGE of that time; else None. Both relative: a slow or busy machine stretches the
    cycles, not these shares (the run-queue wait is not counted as a wait for the GIL)."""
    ran = [cycles.get(fb.cycle) for fb, _ in updates if fb.cycle is not None]
    mine = [c for c in ran if c is not None and c.ended_at > c.started_at]
    if len(mine) < MIN_UPDATES:
        return None
    share = statistics.median(c.gil_wait_s / max(c.cpu_s, 1e-3) for c in mine)
    if share < GIL_SHARE:
        return None
    t0, t1 = min(c.started_at for c in mine), max(c.ended_at for c in mine)
    held = gil_held(stalls, t0, t1)
    if held is None or held[0] < GIL_COVERAGE:
        return None
    coverage, culprit = held
    wait = statistics.median(c.gil_wait_s for c in mine)
    compute = statistics.median(c.cpu_s for c in mine)
    cycle = statistics.median(c.ended_at - c.started_at for c in mine)
    return share, coverage, wait, compute, cycle, culprit


def gil_held(stalls: Sequence[GilStall], t0: float, t1: float) -> tuple[float, GilStall] | None:
    """(the share of [t0, t1] other threads' Python held the interpreter, by the GIL watchdog's
    stalls; the culprit's latest stall), or None without stalls then. The culprit: the function
    whose stalls covered the most of that time; user code first (a library's frame names it only
    when no stall had user code)."""
    inside = [s for s in stalls if s.ended_at > t0 and s.started_at < t1]
    if not inside or t1 <= t0:
        return None
    held = _union((max(s.started_at, t0), min(s.ended_at, t1)) for s in inside)
    coverage = sum(b - a for a, b in held) / (t1 - t0)
    named = [s for s in inside if s.frames and s.frames[0].user] or inside
    weight: dict[tuple[str, str], float] = {}
    latest: dict[tuple[str, str], GilStall] = {}
    for stall in named:
        key = (stall.frames[0].file, stall.frames[0].function) if stall.frames else (stall.thread, "")
        weight[key] = weight.get(key, 0.0) + min(stall.ended_at, t1) - max(stall.started_at, t0)
        latest[key] = stall
    return coverage, latest[max(weight, key=lambda k: weight[k])]


def gil_where(culprit: GilStall) -> str:
    """Where the culprit's Python ran, in words: its function, cell line and caller."""
    frames = culprit.frames
    if not frames:
        return f"in thread {culprit.thread!r}"
    top = frames[0]
    if top.file == GC_FILE:
        return (f"in {top.where}, a pass over every live object (gc.freeze() after loading "
                "keeps what lives on out of its passes)")
    where = top.where if top.function == "<module>" else f"in `{top.function}`, {top.where}"
    caller = next((f for f in frames[1:] if f.function not in (top.function, "<module>")), None)
    if caller is not None:
        where += f", called from `{caller.function}`"
    return where


def _gil_message(wait: float, compute: float, cycle: float, culprit: GilStall) -> str:
    where = gil_where(culprit)
    ratio = (compute + wait) / max(compute, 1e-3)
    return (f"your Python held the interpreter for ~{wait * 1e3:.0f} ms of each {cycle * 1e3:.0f} ms cycle "
            f"({where}); the pool shares this process, so its cycles ran {_ratio(ratio)} longer than their "
            f"compute — move that work out of the loop, precompute it, or run it in a subprocess")


def core_demand(samples: Sequence[CoreSample], t0: float, t1: float) -> tuple[float | None, int] | None:
    """(cores this process's threads wanted on average over [t0, t1], the cores it may use), by
    the GIL watchdog's CoreSamples; demand None where the platform has no per-thread schedstat;
    None without samples then (a remote view, or a pool without a watchdog)."""
    inside = [c for c in samples if c.at > t0 and c.at - c.window_s < t1]
    if not inside:
        return None
    if any(c.demand_s is None for c in inside):
        return None, inside[-1].cpus
    return sum(c.demand_s or 0.0 for c in inside) / max(sum(c.window_s for c in inside), 1e-9), inside[-1].cpus


def cpu_message(demand: float, cpus: int, slow: str) -> str:
    """The `cpu` cause in words: what was measured and what helps. (It never names the GIL: the
    waits were for a core, and moving work to a process would not help.)"""
    return (f"the CPU is busy: this process's threads wanted {demand:.1f} of the {cpus} cores it may use, so "
            f"{slow} waited for a core — its own math-library threads (BLAS / OpenMP, e.g. numpy or torch on "
            f"every core), other processes, or a container too small for the work: limit the libraries' threads "
            f"(OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1 before starting, or threadpoolctl's "
            f"threadpool_limits(1) around the loader), run fewer processes beside it, or give it more cores")


def _undetermined(share: float, what: str) -> str:
    return (f"{what} waited ~{share:.0%} of its CPU time beyond it, for the interpreter lock (GIL) or for a CPU "
            f"core: this platform gives no per-thread run-queue times (/proc/self/task/*/schedstat), so trio "
            f"cannot tell the two apart — check the machine's load (top) before moving work to a subprocess")


def diagnose_client(records: Sequence[RequestRecord], cycle_s: float | None, *, client_id: str = "",
                    label: str = "", window: int = PERIOD_WINDOW, cycles: Mapping[int, CycleRecord] | None = None,
                    stalls: Sequence[GilStall] = (), pool_work: Sequence[RequestRecord] = (),
                    cores: Sequence[CoreSample] = (), served: bool = False) -> Diagnosis:
    """The diagnosis of one client from its own records (any order; all of one client).

    `cycles` (by index) and `stalls` let it tell GIL starvation, `cores` (the watchdog's CoreSamples)
    a busy CPU; `pool_work` are sampling requests (of any client) whose time in the pool is not the
    loop's stall. `served`: the pool is served, its clients' loops run elsewhere (a GIL held by no
    user code there is the server's own, not this client's `gil`).
    """
    records = sorted(records, key=lambda r: r.request_id)
    client_id = client_id or (records[0].client_id if records else "")
    label = label or client_id
    updates = update_pairs(records)[-(window + 1):]
    if len(updates) < MIN_UPDATES:
        return Diagnosis(client_id, label, "warming-up", "measuring: waiting for a few updates",
                         updates=len(updates), evidence=f"{len(updates)} of {MIN_UPDATES} updates measured")

    # Loop structure of each step from one update to the next; then the current segment only.
    kinds = step_kinds(updates)
    start = segment_start(kinds)
    # The GIL is judged over the whole window, not the loop's current segment: a loader's
    # Python stretches cycles whatever the loop's shape, and a heavy loader makes a loop
    # flip between shapes (the last updates, after it yielded its last batch, run clean).
    window_updates = updates
    updates, kinds = updates[start:], kinds[start:]
    structure = max(STRUCTURE_PERIOD, key=lambda k: (kinds.count(k), -STRUCTURE_PERIOD[k]))
    p = cycles_per_update([fb.cycle for fb, _ in updates], window)
    assert p is not None

    # Client-side stall: for each submission that followed a delivery, how long after that
    # delivery it came (the earliest delivery since the client's previous submission), less
    # the time sampling requests were in the pool meanwhile (that wait is the pool's work).
    stall_cycles = sampling_cycles = 0.0
    if cycle_s:
        deliveries = sorted(r.delivered_at for r in records if r.delivered_at is not None)
        submissions = sorted(r.queued_at for r in records)
        first = updates[1][0].queued_at
        sampling = _union((r.queued_at, r.delivered_at) for r in pool_work if r.delivered_at is not None)
        sampling_starts = [a for a, _ in sampling]
        per_update: dict[int, float] = {}
        sampled: dict[int, float] = {}
        starts = [fb.queued_at for fb, _ in updates]
        for prev, sub in zip(submissions, submissions[1:]):
            if sub < first:
                continue
            k = bisect.bisect_right(deliveries, prev)
            if k < len(deliveries) and deliveries[k] <= sub:
                busy = _covered(sampling, sampling_starts, deliveries[k], sub) if sampling else 0.0
                u = bisect.bisect_right(starts, sub) - 1
                per_update[u] = per_update.get(u, 0.0) + (sub - deliveries[k]) - busy
                sampled[u] = sampled.get(u, 0.0) + busy
        gaps = [per_update.get(u, 0.0) / cycle_s for u in range(1, len(updates))]
        stall_cycles = float(statistics.median(gaps)) if gaps else 0.0
        waits = [sampled.get(u, 0.0) / cycle_s for u in range(1, len(updates))]
        sampling_cycles = float(statistics.median(waits)) if waits else 0.0

    n = len(updates)
    excess = STRUCTURE_PERIOD[structure] - 1
    period_text = _plural(p, "cycle")
    gil = _gil(window_updates, cycles, stalls) if cycles else None
    shape = (f"{n} updates, {period_text} per update; steps naive/together/pipelined: "
             + "/".join(str(kinds.count(k)) for k in STRUCTURE_PERIOD))
    if gil is not None and served and not (gil[5].frames and gil[5].frames[0].user):
        # the served pool's own Python held it (request handling, a library's thread): every client's
        # cycles stretched alike, no client's loop did it; the diagnosis its loop earns without it
        share, coverage, _, _, _, culprit = gil
        own = diagnose_client(records, cycle_s, client_id=client_id, label=label, window=window, cycles=cycles,
                              pool_work=pool_work, cores=cores, served=True)
        return replace(own, evidence=f"{own.evidence}; the server's own Python held the interpreter {coverage:.0%} "
                                     f"of the time ({gil_where(culprit)}): its cycles waited {share:.0%} of their "
                                     f"CPU time, every client's alike, not this loop's doing")
    if gil is not None:
        share, coverage, wait, compute, cycle, culprit = gil
        evidence = (f"clock's wait for the interpreter: {share:.0%} of its CPU time (gil from {GIL_SHARE:.0%}); "
                    f"other threads' Python held it {coverage:.0%} of the time (from {GIL_COVERAGE:.0%}); " + shape)
        return Diagnosis(client_id, label, "gil", _gil_message(wait, compute, cycle, culprit), p, stall_cycles, n,
                         gil_share=share, gil_frames=culprit.frames, sampling_cycles=sampling_cycles,
                         evidence=evidence)
    ran = [c for c in (cycles.get(fb.cycle) for fb, _ in window_updates if fb.cycle is not None) if c is not None] \
        if cycles else []
    demand = core_demand(cores, min(c.started_at for c in ran), max(c.ended_at for c in ran)) if ran else None
    undetermined = None
    if demand is not None and demand[0] is None and len(ran) >= MIN_UPDATES and not served:
        share = statistics.median(c.gil_wait_s / max(c.cpu_s, 1e-3) for c in ran)
        if share >= GIL_SHARE:  # the clock's wait counts its run-queue wait here: GIL or CPU, who knows
            undetermined = Diagnosis(client_id, label, "gil-or-cpu", _undetermined(share, "the pool's clock"), p,
                                     stall_cycles, n, gil_share=share,
                                     evidence=f"clock's wait: {share:.0%} of its CPU time (from {GIL_SHARE:.0%}); "
                                              f"no per-thread schedstat on this platform; " + shape)
    # the clock's run-queue wait per cycle, against its CPU time: what is left of its working time
    queued = statistics.median(max(0.0, c.busy_s - c.cpu_s - c.gil_wait_s) / max(c.cpu_s, 1e-3) for c in ran) \
        if ran else 0.0
    if demand is not None and demand[0] is not None and demand[0] >= CPU_CORES * demand[1] and (
            p > 1.25 or queued >= GIL_SHARE):  # the loop misses cycles, or its cycles stretch waiting for a core
        if served:  # the server's threads wanted its cores: every client's cycles alike, no client's loop
            own = diagnose_client(records, cycle_s, client_id=client_id, label=label, window=window, cycles=cycles,
                                  pool_work=pool_work)
            return replace(own, evidence=f"{own.evidence}; the server's threads wanted {demand[0]:.1f} of its "
                                         f"{demand[1]} cores, its clock waited for one {queued:.0%} of its CPU time: "
                                         f"every client's alike, not this loop's doing")
        return Diagnosis(client_id, label, "cpu", cpu_message(demand[0], demand[1], f"the loop ({period_text} per "
                         f"update) and the pool's clock"), p, stall_cycles, n, sampling_cycles=sampling_cycles,
                         evidence=f"this process's threads wanted {demand[0]:.1f} of {demand[1]} cores (cpu from "
                                  f"{CPU_CORES:.0%} of them); clock's run-queue wait: {queued:.0%} of its CPU time "
                                  f"(from {GIL_SHARE:.0%}, or over 1.25 cycles per update); " + shape)
    measured = (f"{shape}; next request {stall_cycles:.1f} cycles after results were ready (stall from "
                f"{max(1.0, sampling_cycles):.1f}), {sampling_cycles:.1f} cycles waiting for samples "
                f"(sampling from 1.0)")
    # The larger of the two waits is named: an RL loop's bit of scoring Python between its
    # samples and its update is not a stall next to the cycles it waits for the samples.
    # A pipelined loop whose lookahead hides the gap (still ~1 cycle per update) wastes nothing:
    # on very short cycles any bit of Python is a cycle late, which is no reason to complain.
    hidden = structure == "pipelined" and p <= 1.25
    if stall_cycles >= max(1.0, sampling_cycles) and not hidden and (structure == "pipelined"
                                                                       or stall_cycles >= excess):
        later = _plural(max(1.0, round(stall_cycles)), "cycle")
        message = (f"client-side stall: results were ready but your next request came {later} later "
                   f"({period_text} per update) — your loop was busy elsewhere meanwhile (computing, or waiting "
                   f"for data): make that cheaper, or overlap it with training (queue the next request first, "
                   f"read ahead in a thread)")
        return Diagnosis(client_id, label, "stall", message, p, stall_cycles, n, sampling_cycles=sampling_cycles,
                         evidence=measured)
    if undetermined is not None:  # (a loop that waited for its data is a stall, whatever the clock did)
        return undetermined
    if sampling_cycles >= 1.0:
        message = (f"{period_text} per update, ~{_plural(sampling_cycles, 'cycle')} of them waiting for samples: "
                   f"the loop samples, then trains on them (on-policy RL), and that time is the pool's work — to "
                   f"overlap them, sample the next batch while this one trains (one step off-policy)")
        return Diagnosis(client_id, label, "sampling", message, p, stall_cycles, n, sampling_cycles=sampling_cycles,
                         evidence=measured)
    if structure == "naive":
        message = (f"optim_step was submitted after awaiting forward_backward: {period_text} per update instead "
                   f"of 1 — submit optim_step right after forward_backward, before awaiting")
        return Diagnosis(client_id, label, "naive", message, p, stall_cycles, n, evidence=measured)
    if structure == "together":
        message = (f"the next batch was submitted only after the previous update finished: {period_text} per "
                   f"update instead of 1 — queue the next batch before awaiting the current one (pipeline)")
        return Diagnosis(client_id, label, "together", message, p, stall_cycles, n, evidence=measured)
    if p > 1.25:
        message = (f"{period_text} per update although the loop is pipelined — requests are not reaching the "
                   f"pool every cycle (failed or cancelled requests, or a loop that waits elsewhere)")
        return Diagnosis(client_id, label, "slow", message, p, stall_cycles, n,
                         evidence=f"{measured}; slow from 1.25 cycles per update")
    return Diagnosis(client_id, label, "pipelined", f"{period_text} per update: pipelined, nothing wasted",
                     p, stall_cycles, n, evidence=measured)


def diagnose(records: Iterable[RequestRecord], cycle_s: float | None,
             clients: dict[str, ClientInfo] | None = None, *, window: int = PERIOD_WINDOW,
             cycles: Iterable[CycleRecord] = (), stalls: Sequence[GilStall] = (),
             cores: Sequence[CoreSample] = (), served: bool = False) -> dict[str, Diagnosis]:
    """One diagnosis per client that sent forward_backward requests (label from `clients`; when
    `clients` is given, only those it names: a client a view has no lane for is not diagnosed,
    e.g. one that left a served pool before a remote view connected); `cycles` and `stalls` (the
    pool's) let it tell GIL starvation, `cores` (the watchdog's CoreSamples) a busy CPU; `served`:
    a served pool's, whose own Python is no client's `gil` (diagnose_client)."""
    by_client: dict[str, list[RequestRecord]] = {}
    pool_work = []
    for record in records:
        by_client.setdefault(record.client_id, []).append(record)
        if _is_sample(record.op):
            pool_work.append(record)
    by_index = {c.index: c for c in cycles}
    out = {}
    for cid, mine in by_client.items():
        if not any(r.op in UPDATE_OPS for r in mine) or (clients is not None and cid not in clients):
            continue
        info = (clients or {}).get(cid)
        out[cid] = diagnose_client(mine, cycle_s, client_id=cid, label=info.label if info else cid, window=window,
                                   cycles=by_index, stalls=stalls, pool_work=pool_work, cores=cores,
                                   served=served)
    return out


def recent_records(telemetry: Telemetry, per_client: int = 96) -> list[RequestRecord]:
    """The last `per_client` records of each client, newest-first scan of the ring buffer."""
    counts: dict[str, int] = {}
    out = []
    for record in reversed(list(telemetry.requests)):
        n = counts.get(record.client_id, 0)
        if n < per_client:
            counts[record.client_id] = n + 1
            out.append(record)
    out.reverse()
    return out


#: How much of the pool's history the advisor reads: cycles, GIL stalls.
RECENT_CYCLES = 1024
RECENT_STALLS = 512


def diagnose_telemetry(telemetry: Telemetry, min_cycle_s: float | None = None, *, window: int = PERIOD_WINDOW,
                       served: bool = False) -> dict[str, Diagnosis]:
    """`diagnose` over a pool's telemetry: recent records, measured cycle duration, the clock's
    waits for the interpreter and the GIL watchdog's stalls (`served`: a served pool's telemetry,
    seen through its stream; see diagnose_client)."""
    cycles = list(telemetry.cycles)[-RECENT_CYCLES:]
    cycle_s = cycle_seconds(cycles, default=min_cycle_s)
    if min_cycle_s:
        cycle_s = max(cycle_s or 0.0, min_cycle_s)
    return diagnose(recent_records(telemetry, per_client=6 * (window + 2)), cycle_s, telemetry.all_clients(),
                    window=window, cycles=cycles, stalls=recent_stalls(telemetry), cores=list(telemetry.cores),
                    served=served)


def recent_stalls(telemetry: Telemetry) -> list[GilStall]:
    """The recent GIL stalls and the one going on now (the latest cycles' evidence)."""
    stalls = list(telemetry.gil)[-RECENT_STALLS:]
    ongoing = telemetry.gil_ongoing
    if ongoing is not None and (not stalls or ongoing.started_at > stalls[-1].started_at):
        stalls.append(ongoing)
    return stalls
