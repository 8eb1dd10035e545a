"""A served pool's boundaries: keys, isolation between keys, bounded bodies and batches, clear
4xx for malformed input, loopback unless keys are configured, observers only see the pool."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from served import assert_no_secret_in_arguments, served, serving_process, wait_for

import trio_widgets as trio
from trio_widgets.http import wire
from trio_widgets.http.server import Server, serve

ALICE, BOB, WATCHER = "tml-alice-key-0001", "tml-bob-key-00002", "tml-instructor-03"
REPO = Path(__file__).resolve().parents[1]
ADAM = trio.AdamParams(learning_rate=1e-3)
BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.005, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")), name="secure",
                        max_request_tokens=512, max_request_data=16) as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with served(pool, api_keys=[ALICE, BOB], observer_keys=[WATCHER], max_body_bytes=1 << 20) as s:
        yield s


@pytest.fixture(scope="module")
def alice(server):
    """Alice's client after one update, with a saved state."""
    service = trio.ServiceClient(base_url=server.url, api_key=ALICE)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    tc.forward_backward(BATCH)
    tc.optim_step(ADAM).result(timeout=60)
    saved = tc.save_state("mine").result(timeout=60).path
    yield tc, saved
    service.close()


def call(server, method: str, path: str, key: str | None, **kw) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.request(method, f"{server.url}/api/v1{path}", headers=headers, timeout=30, **kw)


def session_of(server, key: str) -> str:
    return call(server, "POST", "/create_session", key, json={"tags": []}).json()["session_id"]


def test_a_missing_or_wrong_key_is_401(server):
    for key, why in ((None, "missing API key"), ("tml-not-a-key-at-all", "invalid API key")):
        r = call(server, "POST", "/create_session", key, json={})
        assert r.status_code == 401 and why in r.json()["detail"]
        r = call(server, "GET", "/get_server_capabilities", key)
        assert r.status_code == 401
    assert call(server, "GET", "/healthz", None).status_code == 200  # only the health check is open
    # a key that is not ASCII (sent as raw bytes): still just a wrong key, never a 500
    r = call(server, "GET", "/get_server_capabilities", None, headers=[(b"X-API-Key", "tml-schlüssel-ä".encode())])
    assert r.status_code == 401 and "invalid API key" in r.json()["detail"]
    wrong = trio.ServiceClient(base_url=server.url, api_key="tml-wrong-key-123")  # no I/O until it is used
    with pytest.raises(trio.AuthenticationError, match="invalid API key"):
        wrong.get_server_capabilities()
    wrong.close()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the tinker SDK needs Python >= 3.11")
def test_the_sdk_sees_a_wrong_key_as_its_authentication_error(server, monkeypatch):
    import tinker
    from served import tinker_env

    tinker_env(monkeypatch)
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-wrong-key-123")
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=4).result(timeout=60)


def test_another_keys_models_futures_and_checkpoints_are_404(server, alice):
    tc, saved = alice
    bob_session = session_of(server, BOB)
    fb = wire.encode_forward_request(tc.client_id, 9, BATCH, "cross_entropy", {}, False)
    probes = [
        ("POST", "/forward_backward", {"content": fb, "headers": {"Content-Type": wire.PROTOBUF}}),
        ("POST", "/optim_step", {"json": {"model_id": tc.client_id, "seq_id": 9, "adam_params": {}}}),
        ("POST", "/get_info", {"json": {"model_id": tc.client_id}}),
        ("POST", "/save_weights", {"json": {"model_id": tc.client_id, "path": "stolen", "seq_id": 9}}),
        ("POST", "/retrieve_future", {"json": {"request_id": "req-1"}}),
        ("POST", "/load_weights", {"json": {"session_id": bob_session, "model_seq_id": 0, "path": saved,
                                            "optimizer": True}}),
        ("POST", "/create_sampling_session", {"json": {"session_id": bob_session, "sampling_session_seq_id": 0,
                                                       "model_path": saved}}),
        ("GET", f"/training_runs/{tc.client_id}/checkpoints", {}),
        ("POST", "/session_heartbeat", {"json": {"session_id": tc.client_id.split(":")[0]}}),
        ("POST", "/create_model", {"json": {"session_id": tc.client_id.split(":")[0], "model_seq_id": 5,
                                            "base_model": trio.DEFAULT_MODEL}}),
    ]
    for method, path, kw in probes:
        r = call(server, method, path, BOB, **kw)
        assert r.status_code == 404, (path, r.status_code, r.text)
        assert "not found for this API key" in r.json()["detail"], r.text
        assert "rank" not in r.text and "loss" not in r.text  # nothing of Alice's in the answer
    bob = trio.ServiceClient(base_url=server.url, api_key=BOB)
    with pytest.raises(trio.NotFoundError):
        bob.create_training_client_from_state(saved)
    bob.close()
    # Alice's run went on untouched: her next update is step 2, her checkpoint is hers
    tc.forward_backward(BATCH)
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 2
    assert server.checkpoint_path(saved, ALICE).is_dir() and not server.checkpoint_path(saved, BOB).exists()


def test_oversized_bodies_are_413(server, alice):
    tc, _ = alice
    big = b"\0" * ((1 << 20) + 1)
    r = call(server, "POST", "/forward_backward", ALICE, content=big, headers={"Content-Type": wire.PROTOBUF})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while it streams in
        for _ in range(20):
            yield b"\0" * (64 << 10)

    r = call(server, "POST", "/optim_step", ALICE, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_malformed_bodies_are_400_with_a_message(server, alice):
    tc, _ = alice
    r = call(server, "POST", "/forward_backward", ALICE, content=b"\xff\xfe not protobuf",
             headers={"Content-Type": wire.PROTOBUF})
    assert r.status_code == 400 and "not a valid protobuf ForwardBackwardRequest" in r.json()["detail"]
    r = call(server, "POST", "/optim_step", ALICE, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = call(server, "POST", "/optim_step", ALICE, json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["detail"]
    r = call(server, "POST", "/optim_step", ALICE, json={"model_id": tc.client_id, "seq_id": "x", "adam_params": {}})
    assert r.status_code == 400 and r.json()["field"] == "seq_id"
    r = call(server, "POST", "/optim_step", ALICE, json={"model_id": tc.client_id, "adam_params": {"lr": 1}})
    assert r.status_code == 400 and r.json()["field"] == "adam_params" and "lr" in r.json()["detail"]
    r = call(server, "POST", "/forward_backward", ALICE, json={"model_id": tc.client_id})
    assert r.status_code == 415 and "protobuf" in r.json()["detail"]
    # a tensor whose bytes do not fit its dtype, and a CSR matrix that lies about its size
    msg = wire.PROTO.ForwardBackwardRequest(model_id=tc.client_id, seq_id=50, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = b"\x01\x00\x00"
    r = call(server, "POST", "/forward_backward", ALICE, content=msg.SerializeToString(),
             headers={"Content-Type": wire.PROTOBUF})
    assert r.status_code == 400 and "whole number of 4-byte values" in r.json()["detail"]
    msg = wire.PROTO.ForwardBackwardRequest(model_id=tc.client_id, seq_id=51, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = b"\x05\x00\x00\x00"
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.sparse_csr.values = 2, b""
    t.shape.extend([100_000, 100_000])
    r = call(server, "POST", "/forward_backward", ALICE, content=msg.SerializeToString(),
             headers={"Content-Type": wire.PROTOBUF})
    assert r.status_code == 400 and "more than the" in r.json()["detail"]
    r = call(server, "POST", "/no/such/thing", ALICE, json={})
    assert r.status_code == 404 and "no such endpoint" in r.json()["detail"]


def test_batches_and_names_are_bounded_as_in_process(server, alice):
    tc, _ = alice
    long_ = [trio.Datum(trio.ModelInput.from_ints([5] * 300), {"target_tokens": [6] * 300})] * 2
    with pytest.raises(trio.InvalidInputError, match="max_request_tokens"):
        tc.forward_backward(long_)
    with pytest.raises(trio.InvalidInputError, match="max_request_data"):
        tc.forward_backward(BATCH * 17)
    for bad in ("../escape", ".hidden", "a/b", "x" * 300):
        with pytest.raises(trio.InvalidInputError) as info:
            tc.save_state(bad)
        assert info.value.field == "name"
    for path in ("tinker://../weights/x", f"tinker://{tc.client_id}/weights/..", "/etc/passwd",
                 f"tinker://{tc.client_id}/other/x"):
        r = call(server, "POST", "/create_sampling_session", ALICE,
                 json={"session_id": tc.client_id.split(":")[0], "sampling_session_seq_id": 90, "model_path": path})
        assert r.status_code in (400, 404), (path, r.status_code)
    tc.forward_backward(BATCH)
    tc.optim_step(ADAM).result(timeout=60)  # none of it stuck the model's queue


def test_only_observer_keys_watch_the_whole_pool(server):
    r = call(server, "GET", "/trio/info", ALICE)
    assert r.status_code == 403 and "observer" in r.json()["detail"]
    info = call(server, "GET", "/trio/info", WATCHER).json()
    assert info["name"] == "secure" and trio.DEFAULT_MODEL in info["models"]
    with httpx.stream("GET", f"{server.url}/api/v1/trio/telemetry", headers={"X-API-Key": WATCHER},
                      timeout=30) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in stream.iter_lines() if line.startswith("data: "))
        assert '"backfill"' in first


def test_a_non_loopback_address_needs_keys(pool):
    for host in ("0.0.0.0", "192.0.2.1", "example.org", "::"):
        with pytest.raises(ValueError, match="without API keys"):
            serve(pool, host=host, port=0)
    Server(pool, host="0.0.0.0", port=0, api_keys=[ALICE])  # with keys it may (not started here)
    with pytest.raises(ValueError, match="at least 8"):
        Server(pool, host="127.0.0.1", api_keys=["short"])
    result = subprocess.run([sys.executable, "-m", "trio_widgets", "serve", "--host", "0.0.0.0", "--port", "0"],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO), "TRIO_API_KEYS": ""})
    assert result.returncode == 2 and "refusing to serve on '0.0.0.0' without API keys" in result.stderr


def test_nothing_from_a_request_is_unpickled_or_evaluated():
    source = "\n".join(p.read_text() for p in (REPO / "trio_widgets" / "http").glob("*.py"))
    for word in (r"\bpickle\b", r"\beval\(", r"\bexec\(", r"literal_eval", r"torch\.load", r"\bmarshal\b"):
        assert not re.search(word, source), word


def test_a_served_pool_stops_with_its_pool(tmp_path):
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path), name="short-lived") as pool:
        server = serve(pool, port=0)
        assert call(server, "GET", "/healthz", None).status_code == 200
    wait_for(lambda: not server.running, "the server to stop with its pool")
    with pytest.raises(httpx.ConnectError):
        call(server, "GET", "/healthz", None)
    assert not [t for t in threading.enumerate() if t.name.startswith("trio-serve-short-lived")]


def test_no_key_is_in_a_served_pools_arguments(tmp_path):
    """`python -m trio_widgets serve` takes keys from the environment or a file, never its command line
    (which `ps` shows every user of the machine); a key given there still works, and is warned about."""
    keys, observer = "tml-argv-a,tml-argv-b", "tml-argv-watch"
    with serving_process(tmp_path, keys=keys, observers=observer, min_cycle_s=0.05) as (url, log):
        assert assert_no_secret_in_arguments(["tml-argv-a", "tml-argv-b", observer]) >= 1
        assert httpx.get(f"{url}/api/v1/healthz", timeout=30).status_code == 200
        listed = httpx.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": "tml-argv-b"}, timeout=30)
        assert listed.status_code == 200, listed.text
    assert "shows in `ps`" not in log.read_text()
    (tmp_path / "flag").mkdir()
    keys_file = tmp_path / "observers.txt"
    keys_file.write_text("# one a line\ntml-argv-file\n")
    named = tmp_path / "keys.txt"
    named.write_text("# KEY, then the participant's name\ntml-argv-named Ada Lovelace\n")
    with serving_process(tmp_path / "flag", keys="", min_cycle_s=0.05,
                         args=["--observer-keys-file", str(keys_file), "--api-key", "tml-argv-flag",
                               "--api-keys-file", str(named)]) as (url, log):
        session = httpx.post(f"{url}/api/v1/create_session", headers={"X-API-Key": "tml-argv-named"},
                             json={"user_metadata": {}}, timeout=30).json()["session_id"]
        made = httpx.post(f"{url}/api/v1/create_model", headers={"X-API-Key": "tml-argv-named"}, timeout=30,
                          json={"session_id": session, "model_seq_id": 0, "base_model": trio.DEFAULT_MODEL,
                                "lora_config": {"rank": 2}}).json()
        httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": "tml-argv-named"}, timeout=60,
                   json={"request_id": made["request_id"]})
        with httpx.stream("GET", f"{url}/api/v1/trio/telemetry", headers={"X-API-Key": "tml-argv-file"},
                          timeout=30) as stream:
            first = next(line for line in stream.iter_lines() if line.startswith("data: "))
        labels = [c["label"] for c in json.loads(first[6:])["backfill"]["clients"]]
        assert labels == ["Ada Lovelace"], labels  # the name on the key's line, not its session's id
        assert httpx.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": "tml-argv-flag"},
                         timeout=30).status_code == 200
        stream = httpx.get(f"{url}/api/v1/trio/info", headers={"X-API-Key": "tml-argv-file"}, timeout=30)
        assert stream.status_code == 200, stream.text
        assert httpx.get(f"{url}/api/v1/trio/info", headers={"X-API-Key": "tml-nope"}, timeout=30).status_code == 401
        with pytest.raises(AssertionError, match="has a key in its arguments"):  # the check sees a flag's key
            assert_no_secret_in_arguments(["tml-argv-flag"])
    assert "shows in `ps` to every user of this machine" in log.read_text()
