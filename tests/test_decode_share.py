"""A client's sampling takes its share of each cycle, in bounded slices, while another client has
work (issue 36 point 3: 128 prompts x 256 tokens with 8 requests in flight made a neighbour's
update 6.65x slower). What the clock does is checked from the pool's own telemetry; how long the
neighbour's updates take under it, side by side with its quiet time, is measured by
`benchmarks/serve_abuse.py --only big-sample,big-stop-sample` (tests check behaviour, not time)."""

from __future__ import annotations

import threading

import trio_widgets as trio

BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]
ADAM = trio.AdamParams(learning_rate=1e-3)
PARAMS = trio.SamplingParams(max_tokens=24, temperature=1.0, seed=3)


def _samples(pool: trio.LocalPool, neighbour: bool) -> tuple[list, list, int]:
    """4 requests of 16 samples from one client (with a neighbour training beside it, or not):
    their results, the cycles each started in, and the neighbour's updates meanwhile."""
    service = trio.ServiceClient(pool)
    sampler = service.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    stop, updates = threading.Event(), [0]
    if neighbour:
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        tc.forward_backward(BATCH)
        tc.optim_step(ADAM).result(timeout=60)

        def train() -> None:
            while not stop.is_set():
                tc.forward_backward(BATCH)
                tc.optim_step(ADAM).result(timeout=60)
                updates[0] += 1

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
    first = max((r.request_id for r in pool.telemetry.requests), default=0)
    with pool.hold():  # all four in the queue at one boundary
        futures = [sampler.sample(trio.ModelInput.from_ints([5, 6, 7 + i]), 16, PARAMS) for i in range(4)]
    results = [f.result(timeout=300) for f in futures]
    during = updates[0]
    stop.set()
    if neighbour:
        thread.join(60)
    started = sorted(r.cycle for r in pool.telemetry.requests if r.op == "sample" and r.request_id > first)
    return results, started, during


def test_a_neighbour_trains_while_a_client_samples_in_slices(tmp_path):
    with trio.LocalPool(min_cycle_s=0.01, max_num_samples=16, checkpoint_dir=str(tmp_path / "a"),
                        name="share") as pool:
        assert pool.decode_slice_rows == 16
        shared, started, during = _samples(pool, neighbour=True)
    # each request is a slice of its own (16 rows): one starts a cycle, not all four in one
    assert len(set(started)) == 4, started
    assert during >= 3, f"{during} updates of the neighbour while 4 x 16 samples decoded"
    with trio.LocalPool(min_cycle_s=0.01, max_num_samples=16, checkpoint_dir=str(tmp_path / "b"),
                        name="alone") as pool:
        alone, started, _ = _samples(pool, neighbour=False)
    # a client alone starts everything it asked in one cycle (one batch: no throughput lost)
    assert len(set(started)) == 1, started
    # cutting the decode into slices and shares changes no sample
    for a, b in zip(shared, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [len(s.tokens) for s in a.sequences] == [24] * 16
