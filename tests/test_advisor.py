"""The advisor's diagnosis of each cause, from the pool's telemetry of loops written by hand.

The loops below are plain user code on the sync API, each in its own thread, all on one
pool at once: nothing is instrumented, the advisor reads RequestRecords only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import statistics
import time

import pytest
from conftest import random_batch
from served import in_threads

import trio_widgets as trio
from trio_widgets.advisor import diagnose_client, diagnose_telemetry
from trio_widgets.metrics import cycles_per_update as period
from trio_widgets.metrics import json_safe
from trio_widgets.telemetry import RequestRecord
from trio_widgets.trace import chrome_trace

# `make test` runs it alone, with no test beside it: it names a loop's cause from the CPU and waits it measures
pytestmark = pytest.mark.alone

CYCLE_S = 0.1
ADAM = trio.AdamParams(learning_rate=1e-3)


def naive(tc, batch, n):
    for _ in range(n):
        tc.forward_backward(batch).result()
        tc.optim_step(ADAM).result()


def together(tc, batch, n):
    for _ in range(n):
        fb, opt = tc.forward_backward(batch), tc.optim_step(ADAM)
        fb.result()
        opt.result()


def pipelined(tc, batch, n, work_s: float = 0.0):
    previous = None
    for _ in range(n):
        current = (tc.forward_backward(batch), tc.optim_step(ADAM))
        if previous is not None:
            previous[0].result()
            previous[1].result()
            # Slow client-side work between results and the next request. (time.sleep, not a
            # busy loop: in-process, Python that holds the GIL also slows the clock thread's
            # torch calls, so the cycles themselves stretch and the stall shows in seconds.)
            time.sleep(work_s)
        previous = current
    previous[1].result()


def test_each_cause_is_diagnosed_with_its_fix():
    batch = random_batch(0, n=1, length=12)
    loops = {"naive": (naive, 6), "together": (together, 8), "pipelined": (pipelined, 12),
             "stalled": (lambda tc, b, n: pipelined(tc, b, n, work_s=0.45), 6)}
    with trio.LocalPool(min_cycle_s=CYCLE_S, name="advisor") as pool:
        sc = trio.ServiceClient(pool)
        clients = {name: sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i,
                                                        user_metadata={"name": name})
                   for i, name in enumerate(loops)}
        in_threads({name: functools.partial(loops[name][0], clients[name], batch, loops[name][1])
                    for name in loops}, timeout=120)
        found = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)

    d = {name: found[tc.client_id] for name, tc in clients.items()}
    assert {name: x.cause for name, x in d.items()} == {
        "naive": "naive", "together": "together", "pipelined": "pipelined", "stalled": "stall"}, d
    assert d["naive"].message == ("optim_step was submitted after awaiting forward_backward: 4 cycles per update "
                                  "instead of 1 — submit optim_step right after forward_backward, before awaiting")
    assert d["together"].cycles_per_update == 2
    assert "2 cycles per update instead of 1" in d["together"].message
    assert "queue the next batch before awaiting the current one (pipeline)" in d["together"].message
    assert d["pipelined"].message == "1 cycle per update: pipelined, nothing wasted"
    assert d["pipelined"].stall_cycles < 1
    stall = d["stalled"]
    assert stall.message.startswith("client-side stall: results were ready but your next request came ")
    assert "your loop was busy elsewhere meanwhile (computing, or waiting for data)" in stall.message
    # 0.45 s of client work is 4.5 nominal cycles; measured cycles stretch on a loaded machine
    assert stall.stall_cycles >= 1.5 and stall.cycles_per_update >= 2, stall
    assert {x.label for x in d.values()} == set(loops)


def _update(rid: int, cycle: int, t: float, cycle_s: float, delay: float = 0.001) -> list[RequestRecord]:
    """A pipelined update: fb + optim queued together at t, run in `cycle`, delivered a cycle later."""
    recs = []
    for i, op in enumerate(("forward_backward", "optim_step")):
        r = RequestRecord(rid + i, "c", op, queued_at=t + i * 1e-4, cycle=cycle, status="ok")
        r.started_at, r.finished_at = cycle * cycle_s, cycle * cycle_s + 0.01
        r.delivered_at = (cycle + 1) * cycle_s + delay
        recs.append(r)
    return recs


def test_a_gap_the_lookahead_hides_is_no_stall():
    """1 cycle per update is nothing wasted, however late each request came after a delivery
    measured in the pool's typical cycle (with min_cycle_s=0 a cycle can be 2 ms, shorter than
    any Python between two awaits)."""
    cycle_s = 0.1
    records, rid = [], 1
    for k in range(20):  # lookahead 1, each update queued just before the boundary it runs at
        records += _update(rid, k, (k - 0.05) * cycle_s if k else 0.0, cycle_s)
        rid += 2
    late = diagnose_client(records, cycle_s / 5)  # the gaps read as ~4.7 typical cycles
    assert late.stall_cycles > 4 and late.cycles_per_update == 1, late
    assert late.cause == "pipelined" and not late.wasted, late


def test_one_long_pause_does_not_read_as_a_stall():
    cycle_s = 0.1
    records, rid, t = [], 1, 0.0
    # a healthy lookahead-1 loop: update k+1 queued right after update k-1 is delivered
    for k in range(20):
        cycle = k + (50 if k >= 10 else 0)  # a 50-cycle pause (the user pressed Pause) after 10 updates
        t = (cycle - 1) * cycle_s + 0.002 if k else 0.0
        records += _update(rid, cycle, t, cycle_s)
        rid += 2
    d = diagnose_client(records, cycle_s)
    assert d.cause == "pipelined" and d.cycles_per_update == 1, d
    assert diagnose_client(records[:4], cycle_s).cause == "warming-up"
    assert period([3, 4, 5, 9, 10, 11]) == 1.0 and period([7]) is None


# -- the interpreter lock (GIL), sleeping, sampling, mode changes --------------------------------
#
# Loops below run as trio.train would in a notebook: an asyncio task on this thread, the pool's
# clock on its own. Thresholds in the advisor are relative (the clock's wait for the GIL against
# the CPU time it worked; a stall in cycles of the measured length), and the tests scale what
# they do by the measured cycle, so a loaded machine changes the numbers, not the causes.

def heavy_batches(batches, cpu_s: float = 0.2):
    """~200 ms of pure Python per batch (CPU time of this thread): it holds the GIL throughout."""
    for batch in batches:
        start = time.thread_time()
        x = 0
        while time.thread_time() - start < cpu_s:
            for i in range(1000):
                x += i * i
        yield batch


def measured_cycle_s(pool) -> float:
    recent = [c.ended_at - c.started_at for c in list(pool.telemetry.cycles)[-16:]]
    return statistics.median(recent) if recent else pool.min_cycle_s


def sleepy_batches(batches, pool, seconds: float = 0.2):
    """The same loop sleeping instead: 0.2 s, or 4 measured cycles when the machine stretches them."""
    for batch in batches:
        time.sleep(max(seconds, 4 * measured_cycle_s(pool)))
        yield batch


def train_and_diagnose(pool, tc, batches, **kwargs):
    async def main():
        run = trio.train(tc, batches, learning_rate=1e-3, **kwargs)
        await run
        return run
    run = asyncio.run(main())
    return diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id], run


def cached_batches(n: int = 8):
    batch = random_batch(0, n=n, length=12)
    while True:
        yield batch


def test_python_holding_the_gil_in_a_pipelined_loop_is_named_gil(tmp_path):
    with trio.LocalPool(min_cycle_s=0.05, name="gil-heavy") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
        d, run = train_and_diagnose(pool, tc, heavy_batches(cached_batches()), mode="pipelined", steps=20,
                                    metrics_path=tmp_path / "heavy.jsonl")
        trace = chrome_trace(pool.telemetry)
    assert d.cause == "gil", d
    assert d.wasted and d.gil_frames and d.gil_frames[0].function == "heavy_batches", d
    assert d.gil_frames[0].file == __file__
    assert d.message.startswith("your Python held the interpreter for ~")
    assert "(in `heavy_batches`, test_advisor.py line " in d.message
    assert "the pool shares this process, so its cycles ran " in d.message
    assert "move that work out of the loop, precompute it, or run it in a subprocess" in d.message
    # the same numbers reach metrics.jsonl and the Perfetto trace
    rows = [json.loads(line) for line in (tmp_path / "heavy.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(isinstance(r["time/gil_wait"], float) for r in rows)
    assert rows == [json_safe({"run": run.name, **r}) for r in run.metrics]
    gil_spans = [e for e in trace["traceEvents"] if e.get("cat") == "gil"]
    assert gil_spans and any(e["name"] == f"GIL held: heavy_batches ({e['args']['where']})" for e in gil_spans)
    assert any(e["ph"] == "C" and e["name"] == "clock GIL wait (ms)" for e in trace["traceEvents"])


def test_the_same_loop_sleeping_is_a_client_stall_not_gil():
    with trio.LocalPool(min_cycle_s=0.05, name="gil-sleep") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
        d, _ = train_and_diagnose(pool, tc, sleepy_batches(cached_batches(), pool), mode="pipelined", steps=12)
    assert d.cause == "stall", d
    assert d.message.startswith("client-side stall: results were ready but your next request came ")


# Loader shapes that hold the GIL in different ways. A loop of short bytecodes hands the GIL over
# at every switch interval (a heartbeat may get it at once: the clock waits again and again, a
# convoy); one long C call holds it throughout; tokenizing is str and dict work in between.
def busy_loop_batches(batches, cpu_s: float):
    for batch in batches:
        start, x = time.perf_counter(), 0
        while time.perf_counter() - start < cpu_s:
            x += 1
        yield batch


def long_c_call_batches(batches, cpu_s: float):
    data = [((i * 7919) % 1000003) / 1000003 for i in range(200_000)]
    for batch in batches:
        start = time.perf_counter()
        while time.perf_counter() - start < cpu_s:
            sorted(data)  # one C call that keeps the GIL for tens of milliseconds
        yield batch


def tokenizing_batches(batches, cpu_s: float):
    vocab = {chr(c): c for c in range(32, 127)}
    text = "the quick brown fox jumps over the lazy dog " * 40
    for batch in batches:
        start = time.perf_counter()
        while time.perf_counter() - start < cpu_s:
            ids = [vocab.get(ch, 0) for word in text.split() for ch in word]
        assert ids
        yield batch


def datum_building_batches(batches, cpu_s: float):
    """Its time goes into trio's own types and validation, called from here: still this function."""
    tokens = list(range(5, 200))
    for batch in batches:
        start = time.perf_counter()
        while time.perf_counter() - start < cpu_s:
            built = [trio.Datum(trio.ModelInput.from_ints(tokens), {"target_tokens": tokens}) for _ in range(20)]
        assert built
        yield batch


def repeated_runs(loader, runs: int = 20, steps: int = 8):
    """`runs` short pipelined loops, half on 20 ms cycles and half on 50 ms, lookahead 1 and 2
    alternating: one client per run (its diagnosis reads only its own updates' cycles). `steps`
    updates each: the advisor diagnoses from 3 (MIN_UPDATES); at lookahead 2 the last 2 run after the
    loader's last batch, so 8 leave 6 of the loader's (a clear majority for the medians it takes)."""
    outcomes = []
    for min_cycle_s in (0.02, 0.05):
        with trio.LocalPool(min_cycle_s=min_cycle_s, name=f"gil-rep-{min_cycle_s}") as pool:
            for k in range(runs // 2):
                tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=k)
                d, _ = train_and_diagnose(pool, tc, loader(pool, cached_batches()), mode="pipelined",
                                          lookahead=1 + k % 2, steps=steps)
                outcomes.append((d.cause, d.gil_frames[0].function if d.gil_frames else None, d.message,
                                 d.evidence))
                tc.close()
    return outcomes


@pytest.mark.parametrize("loader", [busy_loop_batches, long_c_call_batches, tokenizing_batches,
                                    datum_building_batches], ids=lambda f: f.__name__)
def test_python_holding_the_gil_is_named_gil_every_time(loader):
    outcomes = repeated_runs(lambda pool, batches: loader(batches, cpu_s=0.1))
    named = [(cause, function) for cause, function, _, _ in outcomes]
    assert named == [("gil", loader.__name__)] * len(outcomes), outcomes
    # the evidence, as the dashboard shows it on hover: the measured shares against their thresholds
    assert all(re.match(r"clock's wait for the interpreter: \d+% of its CPU time \(gil from 50%\); other "
                        r"threads' Python held it \d+% of the time \(from 20%\); \d+ updates", evidence)
               for _, _, _, evidence in outcomes), outcomes


def test_a_sleeping_loader_is_a_stall_every_time():
    outcomes = repeated_runs(lambda pool, batches: sleepy_batches(batches, pool, seconds=0.1))
    assert [cause for cause, _, _, _ in outcomes] == ["stall"] * len(outcomes), outcomes


def test_a_clean_pipelined_loop_is_never_gil():
    outcomes = repeated_runs(lambda pool, batches: batches)
    assert [cause for cause, _, _, _ in outcomes] == ["pipelined"] * len(outcomes), outcomes


def test_a_clean_pipelined_loop_with_a_live_dashboard_stays_pipelined():
    """No false alarm over more than 200 cycles, while a dashboard ticks on the same thread."""
    causes = []

    async def main(pool, tc):
        dash = trio.Dashboard(pool)
        dash.bokeh_widget.live = True  # serialise every patch, as for a displayed view

        def check(row):
            if row["step"] % 15 == 0:
                causes.append(diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id].cause)

        await trio.train(tc, cached_batches(), mode="pipelined", learning_rate=1e-3, steps=210, on_step=check)
        dash.close()

    with trio.LocalPool(min_cycle_s=0.03, name="gil-clean") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
        asyncio.run(main(pool, tc))
        cycles = pool.cycle_index
        final = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id]
    assert cycles >= 200
    assert "gil" not in causes, causes
    assert final.cause == "pipelined", final
    assert causes.count("pipelined") >= len(causes) - 1, causes


def test_an_rl_loop_waiting_for_its_samples_is_not_a_client_stall():
    """Notebook 05's loop: supervised warm-up (pipelined), then per update: snapshot the weights,
    sample a group per problem, score, importance-sampling forward_backward + optim_step."""
    prompts = [[3 + (i * 7 + j) % 200 for j in range(6)] for i in range(8)]

    def reward(tokens):
        return sum(t % 2 for t in tokens) / max(1, len(tokens))

    async def rl(tc, updates):
        for update in range(updates):
            sampler = await tc.save_weights_and_get_sampling_client_async()
            futures = [sampler.sample(trio.ModelInput.from_ints(p), 8,
                                      trio.SamplingParams(max_tokens=4, temperature=1.0, seed=100 * update + i))
                       for i, p in enumerate(prompts)]
            data = []
            for prompt, future in zip(prompts, futures):
                seqs = (await future).sequences
                scores = [reward(s.tokens) for s in seqs]
                mean = sum(scores) / len(scores)
                for seq, score in zip(seqs, scores):
                    if score != mean and seq.tokens:
                        tokens = prompt + seq.tokens
                        n = len(prompt) - 1
                        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                            "target_tokens": tokens[1:], "logprobs": [0.0] * n + list(seq.logprobs),
                            "advantages": [0.0] * n + [score - mean] * len(seq.tokens)}))
            assert data
            fb = await tc.forward_backward_async(data, "importance_sampling")
            opt = await tc.optim_step_async(ADAM)
            await fb
            await opt

    async def main(tc):
        await trio.train(tc, cached_batches(), mode="pipelined", learning_rate=1e-3, steps=12)
        await rl(tc, 7)

    with trio.LocalPool(min_cycle_s=0.05, name="rl") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
        asyncio.run(main(tc))
        d = diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id]
    assert d.cause == "sampling", d
    assert not d.wasted and d.sampling_cycles >= 1 and d.updates <= 8, d  # the RL updates (and the last SFT one)
    assert "waiting for samples" in d.message and "the pool's work" in d.message


def test_a_mode_change_shows_within_3_updates():
    """trio.train switched between modes while it runs: 3 updates in the new mode are enough."""
    plan = [("together", 8), ("pipelined", 8), ("naive", 5), ("together", 5), ("pipelined", 5)]
    seen: dict[int, tuple[str, str]] = {}

    async def main(pool, tc):
        counts = {i: 0 for i in range(len(plan))}
        phase = [0]

        def on_step(row):
            i = phase[0]
            if row["mode"] != plan[i][0]:
                return  # an update of the previous mode, still in flight at the switch
            counts[i] += 1
            if counts[i] == 3:
                seen[i] = (plan[i][0], diagnose_telemetry(pool.telemetry, pool.min_cycle_s)[tc.client_id].cause)
            if counts[i] == plan[i][1] and i + 1 < len(plan):
                phase[0] = i + 1
                run.mode = plan[i + 1][0]

        run = trio.train(tc, cached_batches(2), mode=plan[0][0], learning_rate=1e-3,
                         steps=sum(n for _, n in plan), on_step=on_step)
        await run

    with trio.LocalPool(min_cycle_s=0.04, name="modes") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        asyncio.run(main(pool, tc))
    assert sorted(seen) == list(range(len(plan))), seen
    assert all(mode == cause for mode, cause in seen.values()), seen


def test_segments_from_records_alone():
    """The same on hand-made records: 10 together updates, then pipelined ones."""
    cycle_s = 0.1
    records, rid = [], 1
    cycle = 0
    for k in range(10):  # together: queued after the previous update was delivered, 2 cycles apart
        t = (cycle - 1) * cycle_s + 0.05 if k else 0.0
        records += _update(rid, cycle, t, cycle_s)
        rid += 2
        cycle += 2
    for _ in range(3):  # pipelined: queued before the previous update's results came back
        t = (cycle - 1) * cycle_s + 0.002
        records += _update(rid, cycle, t, cycle_s)
        rid += 2
        cycle += 1
    assert diagnose_client(records[:20], cycle_s).cause == "together"
    d = diagnose_client(records, cycle_s)
    assert d.cause == "pipelined" and d.updates == 3 and d.cycles_per_update == 1, d
    assert diagnose_client(records[:24], cycle_s).cause == "together"  # 2 updates in: not yet


def test_a_view_without_a_lane_for_a_client_does_not_diagnose_it():
    """A remote view that connected after a client left has its records but no lane: the advisor
    lists only clients the view knows (issue 24: "lora-1" appeared in no lane)."""
    from trio_widgets.advisor import diagnose

    batch = random_batch(0, n=1, length=12)
    with trio.LocalPool(min_cycle_s=0.01, name="lanes") as pool:
        service = trio.ServiceClient(pool)
        gone, kept = (service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4) for _ in range(2))
        together(gone, batch, 4)
        together(kept, batch, 4)
        records = list(pool.telemetry.requests)
        everyone = pool.telemetry.all_clients()
        assert set(diagnose(records, 0.01, everyone)) == {gone.client_id, kept.client_id}
        lanes = {cid: info for cid, info in everyone.items() if cid == kept.client_id}
        assert set(diagnose(records, 0.01, lanes)) == {kept.client_id}
        assert set(diagnose(records, 0.01)) == {gone.client_id, kept.client_id}  # no view: every client


def test_a_served_pools_own_python_is_no_participants_gil():
    """A room on a served pool (issue 34): the server's own request handling held its interpreter and
    stretched every cycle. The participants' loops run in other processes: a pipelined one is pipelined,
    the evidence saying what held the interpreter. User code in the server's process (a notebook that
    serves its pool and trains beside it) is still `gil`, as it is on a pool that is not served. The
    server's cores wanted by its own threads are no participant's `cpu` either."""
    from trio_widgets.telemetry import CycleRecord, GilStall, UserFrame

    cycle_s = 0.1
    records, cycles = [], {}
    for k in range(12):  # pipelined: queued before the previous update's results came back
        records += _update(1 + 2 * k, k, (k - 1) * cycle_s + 0.002 if k else 0.0, cycle_s)
        cycles[k] = CycleRecord(k, k * cycle_s, (k + 1) * cycle_s, 0.09, 2, 24, cpu_s=0.04, gil_wait_s=0.05)
    server = UserFrame("/venv/lib/python3.11/site-packages/uvicorn/protocols/http/h11_impl.py", "data_received",
                       300, user=False)
    loader = UserFrame("/home/me/loop.py", "heavy_batches", 7)

    def stalls(frame: UserFrame) -> list[GilStall]:
        return [GilStall(k * cycle_s, k * cycle_s + 0.05, 0.05, 10, "MainThread", (frame,)) for k in range(12)]

    for served in (False, True):
        d = diagnose_client(records, cycle_s, cycles=cycles, stalls=stalls(loader), served=served)
        assert d.cause == "gil" and d.gil_frames[0].function == "heavy_batches", d
    assert diagnose_client(records, cycle_s, cycles=cycles, stalls=stalls(server)).cause == "gil"  # in-process
    d = diagnose_client(records, cycle_s, cycles=cycles, stalls=stalls(server), served=True)
    assert d.cause == "pipelined" and not d.wasted and not d.gil_frames, d
    assert "the server's own Python held the interpreter 50% of the time (in `data_received`, h11_impl.py " \
           "line 300): its cycles waited 125% of their CPU time, every client's alike" in d.evidence, d.evidence
    # the server's cores busy (its threads wanted both, its clock waited for one): no participant's cpu either
    from trio_widgets.telemetry import CoreSample

    queued = {k: CycleRecord(k, c.started_at, c.ended_at, 0.09, 2, 24, cpu_s=0.04) for k, c in cycles.items()}
    cores = [CoreSample(at=0.1 * i, window_s=0.1, cpus=2, demand_s=0.2, runqueue_s=0.05) for i in range(1, 15)]
    assert diagnose_client(records, cycle_s, cycles=queued, cores=cores).cause == "cpu"  # in-process
    d = diagnose_client(records, cycle_s, cycles=queued, cores=cores, served=True)
    assert d.cause == "pipelined" and "the server's threads wanted 2.0 of its 2 cores, its clock waited for one " \
        "125% of its CPU time" in d.evidence, d
    # both: the server's own Python and its busy cores, each said
    both = {k: CycleRecord(k, c.started_at, c.ended_at, 0.15, 2, 24, cpu_s=0.04, gil_wait_s=0.05)
            for k, c in cycles.items()}
    assert diagnose_client(records, cycle_s, cycles=both, stalls=stalls(server), cores=cores).cause == "gil"
    d = diagnose_client(records, cycle_s, cycles=both, stalls=stalls(server), cores=cores, served=True)
    assert d.cause == "pipelined" and "the server's own Python held" in d.evidence, d
    assert "the server's threads wanted 2.0 of its 2 cores" in d.evidence, d
