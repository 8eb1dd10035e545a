"""Kernel → Interrupt while a notebook waits for a request, in both loop styles: one line naming
what stopped, not a traceback through asyncio or threading (issue 24). A real kernel
(jupyter_client + ipykernel) runs the cells and is interrupted as JupyterLab interrupts it."""

from __future__ import annotations

import queue
import time

import pytest
from transports import service

jupyter_client = pytest.importorskip("jupyter_client")

SETUP = """
import trio_widgets as trio
pool = trio.LocalPool(min_cycle_s=8.0, name="interrupted")  # a cycle every 8 s: the wait is long
tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})]
fb = tc.forward_backward(batch)
from trio_widgets.futures import on_wait_interrupted
heard = []
on_wait_interrupted(heard.append)  # as a Dashboard listens, to say so
print("ready")
"""


@pytest.fixture(scope="module")
def kernel():
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kc, code: str, interrupt_after: float | None = None, km=None, timeout: float = 120.0) -> dict:
    """Execute `code`; optionally interrupt the kernel after a while. Returns its error, if any."""
    msg_id = kc.execute(code)
    interrupted = False
    started = time.monotonic()
    error: dict = {}
    while True:
        if interrupt_after is not None and not interrupted and time.monotonic() - started > interrupt_after:
            km.interrupt_kernel()
            interrupted = True
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            assert time.monotonic() - started < timeout, f"no answer to {code!r} in {timeout} s"
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = msg["content"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return error


@pytest.mark.parametrize("wait", ["await fb", "fb.result()"])
def test_interrupting_a_wait_is_one_line_naming_the_request(kernel, wait):
    km, kc = kernel
    assert not _run(kc, SETUP)
    error = _run(kc, wait, interrupt_after=2.0, km=km)
    assert error, "the interrupt did not end the wait"
    assert error["ename"] == "WaitInterrupted", error["ename"]
    assert len(error["traceback"]) == 1, error["traceback"]  # one line, no trip through the libraries
    line = error["traceback"][0]
    assert "interrupted while waiting for forward_backward (request #" in line and "futures.py" not in line
    # the pool and the client are fine: the request ran (the wait stopped, not the pool), the next too
    # (the cycles after the one under way are short: no second 8 s wait)
    assert not _run(kc, "pool.min_cycle_s = 0.05\nassert fb.result(timeout=60).metrics\n"
                        "assert tc.forward_backward(batch).result(timeout=60)\npool.close()")
    # whoever listens (a Dashboard) heard which wait stopped, once
    assert not _run(kc, "assert [(e.op, e.client_id) for e in heard] == [('forward_backward', tc.client_id)], heard\n"
                        "assert heard[0].state in str(heard[0]), heard[0].state")


def test_a_training_run_reports_its_own_stop_not_each_wait(transport):
    """trio.train says "stopped at step N" itself: its waits (which never cancel a request) are not
    announced again; a wait of the user's own is."""
    import asyncio

    import trio_widgets as trio
    from trio_widgets.futures import on_wait_interrupted

    heard: list = []
    stop_listening = on_wait_interrupted(heard.append)

    async def main(tc):
        batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})]
        run = trio.train(tc, iter(lambda: batch, None), learning_rate=1e-3, steps=1000)
        while run.step < 2:
            await asyncio.sleep(0.05)
        run.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.task
        # a wait of the user's own, cancelled, is announced
        waiter = asyncio.ensure_future(tc.forward_backward(batch).result_async())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return run

    try:
        with trio.LocalPool(min_cycle_s=0.02, name="run-stops") as pool, service(transport, pool) as svc:
            tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
            run = asyncio.run(main(tc))
    finally:
        stop_listening()
    assert run.state == "stopped"
    assert [(e.op, e.client_id) for e in heard] == [("forward_backward", tc.client_id)], heard
