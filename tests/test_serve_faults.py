"""Faults of a served pool, with real processes: a client that vanishes (killed: no heartbeat,
no goodbye) is expired and its queue cancelled; a server that stops fails pending futures
clearly on the client side; retried creates and finished sessions leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from served import served, tinker_env, wait_for

import trio_widgets as trio
from trio_widgets.http.client import HttpBackend

KEY = "tml-fault-tests"
REPO = Path(__file__).resolve().parents[1]
ADAM = trio.AdamParams(learning_rate=1e-3)
BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]
SDK = pytest.mark.skipif(sys.version_info < (3, 11), reason="the tinker SDK needs Python >= 3.11")

CLIENTS = {
    "trio": """
        import sys, time
        import trio_widgets as trio
        tc = trio.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2]).create_lora_training_client(
            trio.DEFAULT_MODEL, rank=4, seed=0)
        batch = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]
        futures = [(tc.forward_backward(batch), tc.optim_step(trio.AdamParams(learning_rate=1e-3)))
                   for _ in range(5)]
        print("MODEL", tc.client_id, flush=True)
        time.sleep(600)
    """,
    "tinker": """
        import sys, time
        import tinker
        from tinker import types as tt
        sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
        tc = sc.create_lora_training_client(base_model="trio/tiny-llama-byte", rank=4, seed=0).result()
        batch = [tt.Datum(model_input=tt.ModelInput.from_ints([5, 6, 7, 8]),
                          loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})]
        futures = [(tc.forward_backward(batch, "cross_entropy"), tc.optim_step(tt.AdamParams(learning_rate=1e-3)))
                   for _ in range(5)]
        print("MODEL", tc.model_id, flush=True)
        time.sleep(600)
    """,
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")), name="faults") as p:
        yield p


@pytest.mark.parametrize("kind", ["trio", pytest.param("tinker", marks=SDK)])
def test_a_vanished_client_is_expired_and_its_queue_cancelled(pool, tmp_path, kind):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENTS[kind]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "TRIO_TORCH_THREADS": "1"}
    with served(pool, session_timeout_s=2.0, long_poll_s=1.0) as server:
        with pool.hold():  # nothing it submits can run: it stays queued
            proc = subprocess.Popen([sys.executable, str(script), server.url, KEY], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
            try:
                line = proc.stdout.readline() if proc.stdout else ""
                assert line.startswith("MODEL "), (line, proc.stderr.read() if proc.stderr else "")
                client = server.clients()[line.split()[1]]
                queued = lambda: [r for r in pool.telemetry.requests_of(client) if r.status == "queued"]  # noqa: E731
                wait_for(lambda: len(queued()) == 10, "its 10 requests to be queued")
                proc.send_signal(signal.SIGKILL)  # gone: no heartbeat, no finish
                proc.wait(30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            wait_for(lambda: [s["state"] for s in server.sessions()] == ["expired"], "its session to expire", 60)
            records = pool.telemetry.requests_of(client)
            assert [r.status for r in records] == ["cancelled"] * 10  # cancelled while still queued: none ran
        wait_for(lambda: client not in pool.telemetry.live_clients(), "its tenant to be retired")
        assert server.stats()["sessions_expired"] == 1
        # a late request of that session is told clearly
        r = httpx.post(f"{server.url}/api/v1/session_heartbeat", json={"session_id": line.split()[1].split(":")[0]},
                       headers={"X-API-Key": KEY})
        assert r.status_code == 410 and "expired" in r.json()["detail"]


def test_a_server_shutdown_fails_pending_futures_clearly(pool):
    with served(pool) as server:
        backend = HttpBackend(server.url, KEY, retry_s=1.0)
        tc = trio.ServiceClient(backend=backend).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
        with pool.hold():
            pending = [tc.forward_backward(BATCH), tc.optim_step(ADAM)]
            server.stop()
        for future in pending:
            with pytest.raises(trio.PoolClosedError, match="shut down"):
                future.result(timeout=30)
        with pytest.raises(trio.APIConnectionError, match="cannot reach the trio server"):
            tc.forward_backward(BATCH)
        backend.close()
    assert not backend._link.thread.is_alive() and not backend._link.heartbeat.is_alive()


@SDK
def test_the_sdk_hears_of_a_shutdown_as_a_server_error(pool, monkeypatch):
    import tinker
    from tinker import types as tt

    tinker_env(monkeypatch)
    with served(pool) as server:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=2).result()
        client = server.clients()[tc.model_id]
        with pool.hold():
            future = tc.forward_backward([tt.Datum(model_input=tt.ModelInput.from_ints([5, 6, 7]),
                                                   loss_fn_inputs={"target_tokens": [6, 7, 8]})], "cross_entropy")
            wait_for(lambda: len(pool.telemetry.requests_of(client)) == 1, "the request to be queued")
            server.stop()
        with pytest.raises(tinker.RequestFailedError, match="shutting down") as info:
            future.result(timeout=60)
        assert info.value.category == "server"
    # the server is gone, so the session cannot be finished: its heartbeats are stopped here (the
    # SDK's holder, what ServiceClient.close stops after finishing), not left warning every 10 s
    sc._session_holder.close()


@SDK
def test_a_finished_session_releases_its_clients(pool, monkeypatch):
    import tinker

    tinker_env(monkeypatch)
    with served(pool) as server:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4, seed=3).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        clients = [server.clients()[tc.model_id], server.clients()[sampler._sampling_session_id]]
        assert all(c in pool.telemetry.live_clients() for c in clients)
        sc.close("success").result(timeout=60)
        wait_for(lambda: not any(c in pool.telemetry.live_clients() for c in clients), "its clients to be retired")
        assert [s["state"] for s in server.sessions()] == ["finished"]


def test_a_retried_create_makes_one_model(pool):
    with served(pool) as server:
        headers = {"X-API-Key": KEY}
        session = httpx.post(f"{server.url}/api/v1/create_session", json={}, headers=headers).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": trio.DEFAULT_MODEL,
                "lora_config": {"rank": 4, "seed": 0}}
        first = httpx.post(f"{server.url}/api/v1/create_model", json=body, headers=headers).json()
        again = httpx.post(f"{server.url}/api/v1/create_model", json=body, headers=headers).json()
        assert first["request_id"] == again["request_id"]
        wait_for(lambda: first["model_id"] in server.clients(), "the model")
        assert len(server.clients()) == 1
