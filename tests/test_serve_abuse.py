"""A served pool that one participant, one browser tab or one crash cannot take down (issue 22):
a fault table, each case against a real server on 127.0.0.1 with a neighbour training beside it.
Each case failed on the server before these limits (see the issue). How long the neighbour's
updates take under each attack, side by side with its quiet time, is measured by
benchmarks/serve_abuse.py (tests check behaviour, not wall-clock time)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest
from served import served, wait_for

import trio_widgets as trio

# `make test` runs it alone, with no test beside it: it compares a neighbour's update times, quiet and under attack
pytestmark = pytest.mark.alone

ALICE, MALLORY = "tml-alice-key-0001", "tml-mallory-key-02"
ADAM = trio.AdamParams(learning_rate=1e-3)
BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.005, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")), name="abuse",
                        max_request_tokens=4096, max_request_data=64) as p:
        yield p


def raw(url: str, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.request(method, f"{url}/api/v1{path}", headers=headers, timeout=30, **kw)


class Neighbour:
    """A keyed trio client training in a thread, every step's future awaited; counts what failed."""

    def __init__(self, url: str, key: str | None):
        self.service = trio.ServiceClient(base_url=url, api_key=key)
        self.tc = self.service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        self.updates, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tc.forward_backward(BATCH)
                self.tc.optim_step(ADAM).result(timeout=60)
                self.updates += 1
            except Exception as exc:  # recorded: the test asserts there is none
                self.errors.append(repr(exc))
                return

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        self.service.close()

    def steps(self, n: int, timeout: float = 120.0) -> None:
        """Wait until `n` more updates went through (the neighbour keeps service)."""
        target = self.updates + n
        wait_for(lambda: self.updates >= target or bool(self.errors), f"{n} more updates", timeout)
        assert not self.errors, self.errors


# -- a web page in the instructor's browser (DNS rebinding, CSRF, foreign-origin telemetry) --------

def test_a_rebound_host_name_is_refused(pool):
    with served(pool) as server:  # the default: keyless, loopback
        port = server.port
        r = raw(server.url, "POST", "/create_session", json={}, headers={"Host": "attacker.example"})
        assert r.status_code == 403 and r.json()["code"] == "forbidden_host"
        assert "attacker.example" in r.json()["detail"] and "--allowed-hosts" in r.json()["detail"]
        r = raw(server.url, "GET", "/trio/telemetry", headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 403
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "10.1.2.3:80"):
            r = raw(server.url, "POST", "/create_session", json={}, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)  # an address cannot be rebound; loopback names are ours
    with served(pool, allowed_hosts=["pool.workshop.example"]) as server:
        r = raw(server.url, "POST", "/create_session", json={}, headers={"Host": "pool.workshop.example:8000"})
        assert r.status_code == 200


def test_a_cross_site_form_cannot_train(pool):
    with served(pool) as server:
        before = len(server.sessions())
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
            r = raw(server.url, "POST", "/create_session", content=b'{"tags": []}', headers={"Content-Type": ctype})
            assert r.status_code == 415, (ctype, r.text)
            assert "application/json" in r.json()["detail"]
        r = raw(server.url, "POST", "/create_session", json={},
                headers={"Origin": "http://attacker.example"})
        assert r.status_code == 403 and r.json()["code"] == "forbidden_origin"
        assert len(server.sessions()) == before  # nothing was made


def test_the_telemetry_stream_refuses_a_foreign_origin(pool):
    with served(pool, allowed_origins=["http://dash.example:5006"]) as server:
        r = raw(server.url, "GET", "/trio/telemetry", headers={"Origin": "http://attacker.example"})
        assert r.status_code == 403 and "Origin" in r.json()["detail"]
        with httpx.stream("GET", f"{server.url}/api/v1/trio/telemetry",
                          headers={"Origin": "http://dash.example:5006"}, timeout=30) as r:
            assert r.status_code == 200  # the page its host allowed


def test_hostile_pages_cannot_fill_the_telemetry_streams(pool):
    """32 no-cors GETs from pages (a *.localhost name, which browsers resolve here; a cross-site page,
    which sends no Origin on a GET but Sec-Fetch-Site) are refused, and one key or address holds at
    most MAX_STREAMS_PER_KEY streams: the real dashboards still connect (issue 36)."""
    from trio_widgets.http.stream import MAX_STREAMS_PER_KEY

    def stream(url: str, key: str | None = None, **headers: str) -> contextlib.AbstractContextManager:
        return httpx.stream("GET", f"{url}/api/v1/trio/telemetry", timeout=30,
                            headers={**({"X-API-Key": key} if key else {}), **headers})

    with served(pool) as server, contextlib.ExitStack() as open_streams:
        port = server.url.rsplit(":", 1)[1]
        for i in range(32):
            page = raw(server.url, "GET", "/trio/telemetry", headers={"Host": f"evil{i}.localhost:{port}"})
            assert page.status_code == 403 and page.json()["code"] == "forbidden_host", page.text
            cross = raw(server.url, "GET", "/trio/telemetry",
                        headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
            assert cross.status_code == 403 and "another site" in cross.json()["detail"], cross.text
        for _ in range(MAX_STREAMS_PER_KEY):  # one address (no keys): its share, then refused
            assert open_streams.enter_context(stream(server.url)).status_code == 200
        over = open_streams.enter_context(stream(server.url))
        assert over.status_code == 429 and "per key" in over.read().decode()
    keys = ["tml-viewer-a", "tml-viewer-b"]
    with served(pool, api_keys=keys, observer_keys=keys) as server, contextlib.ExitStack() as open_streams:
        for _ in range(MAX_STREAMS_PER_KEY):
            assert open_streams.enter_context(stream(server.url, keys[0])).status_code == 200
        assert open_streams.enter_context(stream(server.url, keys[0])).status_code == 429
        assert open_streams.enter_context(stream(server.url, keys[1])).status_code == 200  # another key connects
    with served(pool) as server:  # the streams closed: their places are free again
        with stream(server.url) as again:
            assert again.status_code == 200


# -- connections: slowloris, stalled bodies ---------------------------------------------------------

def _silent_sockets(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        socks.append(s)
    return socks


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def test_slowloris_without_a_key_does_not_lock_out_keyed_clients(pool):
    with served(pool, api_keys=[ALICE], header_timeout_s=2.0, max_waiting_connections=64) as server, \
            Neighbour(server.url, ALICE) as neighbour:
        neighbour.steps(2)
        socks = _silent_sockets(server.port, 300)  # far more than may wait: the oldest are closed
        try:
            neighbour.steps(5)
            # a new keyed client gets in too (its connection makes room), and answers are never 503
            fresh = trio.ServiceClient(base_url=server.url, api_key=ALICE)
            tc = fresh.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
            tc.forward_backward(BATCH).result(timeout=60)
            fresh.close()
            assert server.stats()["evicted"] >= 300 - 64
            # the silent ones still open are closed once header_timeout_s passes
            wait_for(lambda: all(_closed_by_server(s) for s in socks[-64:]), "silent sockets closed", 30)
            assert server.stats()["timed_out"] >= 1
            neighbour.steps(2)
        finally:
            for s in socks:
                s.close()


def _answer_of(s: socket.socket, timeout: float = 0.05) -> bytes:
    """What the server wrote on `s` before closing it (b"" when it wrote nothing yet)."""
    s.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(4096):
            data += chunk
    return data


def test_one_address_holds_a_bounded_number_of_connections(pool):
    with served(pool, max_connections_per_address=8, header_timeout_s=30.0) as server:
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(12)]
        try:
            wait_for(lambda: server.stats()["refused"] >= 4, "connections over the limit refused", 30)
            answers = [_answer_of(s) for s in socks]
            refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
            assert len(refused) >= 4, answers  # answered, naming the limit, then closed
            assert all(b"max_connections_per_address" in a and b"too_many_connections" in a for a in refused)
        finally:
            for s in socks:
                s.close()
        wait_for(lambda: raw(server.url, "GET", "/healthz").status_code == 200, "service after they left", 30)


def _trickling(port: int, key: str) -> socket.socket:
    """A connection of `key` that sent a request head and the first byte of a 1 MiB body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /api/v1/optim_step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"X-API-Key: " + key.encode() + b"\r\nContent-Length: 1048576\r\n\r\n ")
    return s


def test_one_key_trickling_bodies_on_many_connections_holds_only_its_share(pool):
    # issue 36 point 4: one key trickling request bodies on thousands of connections made every
    # request 503, /healthz included. Now the key holds max_connections_per_key; its extra requests
    # are a 429 naming that limit (and closed); the neighbour, /healthz and new keyed clients answer.
    with served(pool, api_keys=[ALICE, MALLORY], max_connections_per_key=16, max_connections_per_address=32,
                body_timeout_s=60.0) as server, Neighbour(server.url, ALICE) as neighbour:
        neighbour.steps(2)
        connections = server._connections
        socks = []
        try:
            for _ in range(120):  # more than the key's share, and than the address's (of no key) too
                socks.append(_trickling(server.port, MALLORY))
            wait_for(lambda: server.stats()["refused_per_key"] >= 120 - 16, "the key's extra connections refused", 60)
            assert connections.per_key[_owner(MALLORY)] == 16
            answers = [_answer_of(s, 0.5) for s in socks]
            refused = [a for a in answers if a]
            assert len(refused) == 120 - 16
            assert all(a.startswith(b"HTTP/1.1 429") and b"max_connections_per_key" in a
                       and b"too_many_connections" in a for a in refused), refused[:3]
            neighbour.steps(3)
            for _ in range(5):
                assert raw(server.url, "GET", "/healthz").status_code == 200
            fresh = trio.ServiceClient(base_url=server.url, api_key=ALICE)  # the other key's new client
            tc = fresh.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
            tc.forward_backward(BATCH).result(timeout=60)
            fresh.close()
            assert not any(a.startswith(b"HTTP/1.1 503") for a in answers)
        finally:
            for s in socks:
                s.close()
        # the key's share comes back when its connections go
        wait_for(lambda: _owner(MALLORY) not in connections.per_key, "the key's connections counted out", 30)
        assert raw(server.url, "POST", "/create_session", MALLORY,
                   json={"type": "create_session", "tags": [], "user_metadata": {}, "sdk_version": "t"}
                   ).status_code == 200
        neighbour.steps(2)


def test_keyless_sockets_opened_at_speed_wait_their_turn(pool):
    # issue 36 point 5: keyless sockets closed and reopened at speed made a neighbour's update 4.41x
    # slower. A keyed server refuses a request without a configured key in front of its routes (no
    # log line each), and an address opens max_new_connections_per_address_s a second: past that a
    # new connection is read when its turn comes, or refused (429 naming the limit) a second ahead.
    with served(pool, api_keys=[ALICE], max_new_connections_per_address_s=50) as server, \
            Neighbour(server.url, ALICE) as neighbour:
        neighbour.steps(2)
        socks = []
        began = time.monotonic()
        for _ in range(300):  # from another address than the neighbour's, all at once
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0))
            with contextlib.suppress(OSError):
                s.sendall(b"GET /api/v1/get_server_capabilities HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(s)
        took = time.monotonic() - began
        answers = [_answer_of(s, 5.0) for s in socks]
        for s in socks:
            s.close()
        heads = [a.split(b"\r\n", 1)[0] for a in answers]
        assert all(h.startswith((b"HTTP/1.1 401", b"HTTP/1.1 429")) for h in heads), set(heads)
        assert all(b"unauthenticated" in a and b"missing API key" in a
                   for a in answers if a.startswith(b"HTTP/1.1 401"))
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
        assert refused and all(b"max_new_connections_per_address_s" in a for a in refused)
        stats = server.stats()
        assert stats["deferred"] >= 1 and stats["unauthenticated"] >= 1
        # read at the rate allowed: 50 at once, 50 a second since, and a second's worth waiting
        assert len(answers) - len(refused) <= 50 + 50 * took + 50 + 5
        neighbour.steps(3)
        assert raw(server.url, "GET", "/healthz").status_code == 200  # from the neighbour's address


def test_a_request_without_a_configured_key_is_refused_in_front(pool):
    with served(pool, api_keys=[ALICE]) as server:
        for key, message in ((None, "missing API key"), ("tml-not-a-key-0003", "invalid API key")):
            r = raw(server.url, "POST", "/create_session", key, json={})
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated" and message in r.json()["detail"]
            assert r.headers["connection"] == "close"
        assert raw(server.url, "GET", "/healthz").status_code == 200  # keyless by design
        # a signed download URL needs no key: refused by its signature, not for want of a key
        assert raw(server.url, "GET", "/trio/export/m/weights/n/f?expires=1&owner=x&signature=y").status_code == 403
        assert server.stats()["unauthenticated"] == 2


def test_stalled_bodies_hold_bounded_bytes_and_time_out(pool):
    per_key = 4 << 20
    with served(pool, api_keys=[ALICE, MALLORY], max_body_bytes=2 << 20, max_inflight_bytes_per_key=per_key,
                body_timeout_s=1.5) as server, Neighbour(server.url, ALICE) as neighbour:
        neighbour.steps(2)
        budget = server._service.budget
        socks, answers = [], []
        for _ in range(6):  # each declares 2 MiB and sends 1 MiB, then stalls
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"POST /api/v1/optim_step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"X-API-Key: " + MALLORY.encode() + b"\r\nContent-Length: 2097152\r\n\r\n" + b" " * (1 << 20))
            socks.append(s)
        try:
            peak = 0

            def held() -> bool:
                nonlocal peak
                peak = max(peak, budget.held.get(_owner(MALLORY), 0))
                return peak > 0

            wait_for(held, "the stalled bodies counted", 30)
            neighbour.steps(3)
            assert budget.held.get(_owner(MALLORY), 0) <= per_key  # never more than a key's share
            for s in socks:  # each is answered: 429 (over the key's share) or 408 (stalled), then closed
                s.settimeout(30)
                head = s.recv(4096).split(b"\r\n", 1)[0]
                answers.append(head)
            assert {h.split(b" ")[1] for h in answers} <= {b"408", b"429"}, answers
            assert b"429" in {h.split(b" ")[1] for h in answers} and b"408" in {h.split(b" ")[1] for h in answers}
            wait_for(lambda: budget.sum == 0, "every stalled body's bytes given back", 30)
            neighbour.steps(2)
        finally:
            for s in socks:
                s.close()


def _owner(key: str) -> str:
    from trio_widgets.http.auth import owner_of

    return owner_of(key)


# -- memory: caps per key and per pool, released clients freed ---------------------------------------

def test_a_key_cannot_hold_the_pool(pool):
    with served(pool, api_keys=[ALICE, MALLORY], max_clients_per_key=3) as server, \
            Neighbour(server.url, ALICE) as neighbour:
        services = [trio.ServiceClient(base_url=server.url, api_key=MALLORY) for _ in range(3)]
        try:
            held = [s.create_lora_training_client(trio.DEFAULT_MODEL, rank=4) for s in services]  # kept alive
            extra = trio.ServiceClient(base_url=server.url, api_key=MALLORY)
            services.append(extra)
            with pytest.raises(trio.InvalidInputError, match="max_clients_per_key"):
                extra.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
            neighbour.steps(3)  # the other key is not counted against
            held[0].close()  # a closed client gives its place back
            wait_for(lambda: len(server._service.state._key_clients(_owner(MALLORY))) == 2, "the place given back", 30)
            held.append(extra.create_lora_training_client(trio.DEFAULT_MODEL, rank=4))
        finally:
            for s in services:
                s.close()
    size = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=8)
    with served(pool, api_keys=[MALLORY], max_state_bytes_per_key=1000) as server:
        service = trio.ServiceClient(base_url=server.url, api_key=MALLORY)
        tenants = pool.tenant_count
        with pytest.raises(trio.InvalidInputError, match=r"max_state_bytes_per_key.*smaller rank"):
            service.create_lora_training_client(trio.DEFAULT_MODEL, rank=8)
        wait_for(lambda: pool.tenant_count <= tenants, "the refused client's state freed", 30)
        service.close()
    size.close()


def test_the_pool_caps_its_tenants_in_process(tmp_path):
    with trio.LocalPool(min_cycle_s=0.005, checkpoint_dir=str(tmp_path), max_tenants=2, name="capped") as p:
        service = trio.ServiceClient(p)
        a = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
        b = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)  # kept: a dropped client is closed
        with pytest.raises(trio.InvalidInputError, match="max_tenants"):
            service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
        a.forward_backward(BATCH).result(timeout=60)  # the others are untouched
        b.close()
        wait_for(lambda: p.tenant_count < 2, "the closed client's place given back", 30)
        service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
    with pytest.raises(ValueError, match="max_tenants"):
        trio.LocalPool(max_tenants=0)


def test_closed_clients_and_their_results_are_freed(pool):
    big = [trio.Datum(trio.ModelInput.from_ints([(i * 7 + j) % 200 + 3 for j in range(256)]),
                      {"target_tokens": [(i * 7 + j) % 200 + 4 for j in range(256)]}) for i in range(8)]
    with served(pool) as server:
        service = server._service.state
        tenants = pool.tenant_count
        clients = [trio.ServiceClient(base_url=server.url) for _ in range(3)]
        try:
            trainers = [c.create_lora_training_client(trio.DEFAULT_MODEL, rank=4) for c in clients]
            for tc in trainers:
                futures = [tc.forward(big, "cross_entropy") for _ in range(10)]
                assert all(len(f.result(timeout=120).loss_fn_outputs) == 8 for f in futures)
            results = sum(len(e.body) for e in service.entries.values() if isinstance(e.body, bytes))
            assert len(service.trained) == 3 and results > 100_000, (len(service.trained), results)
        finally:
            for c in clients:
                c.close()
        wait_for(lambda: not service.trained and pool.tenant_count <= tenants, "released models freed", 60)
        kept = sum(len(e.body or b"") for e in service.entries.values() if isinstance(e.body, bytes))
        assert kept == 0, f"{kept} bytes of results kept after every client closed"


def test_a_closed_client_is_named_closed_not_unknown(pool):
    with served(pool) as server:
        service = trio.ServiceClient(base_url=server.url)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
        tc.forward_backward(BATCH).result(timeout=60)
        model_id = tc.client_id
        tc.close()
        wait_for(lambda: model_id not in server._service.state.trained, "released", 30)
        r = raw(server.url, "POST", "/optim_step", json={"model_id": model_id, "adam_params": {}})
        assert r.status_code == 410 and "was closed" in r.json()["detail"]
        service.close()


# -- liveness: heartbeats and arriving requests, not held long-polls ------------------------------------

def test_a_killed_clients_open_poll_does_not_keep_its_session(pool):
    with served(pool, session_timeout_s=1.5, long_poll_s=30.0, reorder_wait_s=60.0) as server:
        sid = raw(server.url, "POST", "/create_session", json={}).json()["session_id"]
        rid = raw(server.url, "POST", "/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                              "base_model": trio.DEFAULT_MODEL,
                                                              "lora_config": {"rank": 4}}).json()["request_id"]
        r = raw(server.url, "POST", "/retrieve_future", json={"request_id": rid})
        model_id = r.json()["model_id"]
        # seq_id 5 waits for 1..4 (never sent): its result is long-polled and never comes
        held = raw(server.url, "POST", "/optim_step", json={"model_id": model_id, "seq_id": 5,
                                                             "adam_params": {"learning_rate": 1e-3}}).json()
        started, answer = time.monotonic(), []
        poll = threading.Thread(target=lambda: answer.append(raw(server.url, "POST", "/retrieve_future",
                                                                 json={"request_id": held["request_id"]})))
        poll.start()  # then the "client" is gone: no heartbeat, only the poll it left open
        wait_for(lambda: any(s["session_id"] == sid and s["state"] == "expired" for s in server.sessions()),
                 "the session expired", 25)
        # expired while the poll was held (it would have held it 30 s): the poll hears why
        assert time.monotonic() - started < 25.0
        poll.join(30)
        assert "expired" in answer[0].json()["error"], answer[0].text


# -- malformed fields: 400 naming the field ----------------------------------------------------------

def test_malformed_sequence_ids_are_400_naming_the_field(pool):
    with served(pool) as server:
        service = trio.ServiceClient(base_url=server.url)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4)
        sampler = tc.save_weights_and_get_sampling_client("s")  # kept: a dropped client is closed
        sid = sampler.sampling_run_cuid
        model_id = tc.client_id
        for bad in ("1", [1], {"a": 1}, 1.5, -1, 2**40, True) if sampler else ():
            r = raw(server.url, "POST", "/optim_step", json={"model_id": model_id, "seq_id": bad, "adam_params": {}})
            assert r.status_code == 400 and r.json().get("field") == "seq_id", (bad, r.text)
            r = raw(server.url, "POST", "/save_weights", json={"model_id": model_id, "seq_id": bad, "path": "x"})
            assert r.status_code == 400 and r.json().get("field") == "seq_id", (bad, r.text)
            r = raw(server.url, "POST", "/asample", json={"sampling_session_id": sid, "seq_id": bad,
                                                          "prompt": {"chunks": []}, "sampling_params": {}})
            assert r.status_code == 400 and r.json().get("field") == "seq_id", (bad, r.text)
        tc.forward_backward(BATCH).result(timeout=60)  # the model still works
        service.close()


def test_the_limits_are_checked_when_the_server_is_made(pool):
    for name, bad in (("header_timeout_s", 0), ("max_waiting_connections", 0), ("max_inflight_bytes", -1),
                      ("max_clients_per_key", "many"), ("body_timeout_s", float("nan"))):
        with pytest.raises(ValueError, match=name), contextlib.ExitStack():
            trio.serve(pool, port=0, **{name: bad})


def test_the_server_log_has_a_line_per_refusal_and_never_a_key(pool, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="trio_widgets.http")
    with served(pool, api_keys=[ALICE]) as server:
        raw(server.url, "POST", "/create_session", "tml-wrong-key-99", json={})
        sid = raw(server.url, "POST", "/create_session", ALICE, json={}).json()["session_id"]
        raw(server.url, "POST", "/create_model", ALICE, json={"session_id": sid, "model_seq_id": "x",
                                                              "base_model": trio.DEFAULT_MODEL})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert any("POST /api/v1/create_session: 401" in line for line in lines), lines
    assert any("POST /api/v1/create_model: 400 invalid_input" in line and sid in line for line in lines), lines
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ALICE not in text and "tml-wrong-key-99" not in text


def test_lanes_are_labelled_by_the_names_a_session_gives(pool):
    """A tinker-cookbook run names its session by recipe_name (user_metadata): its lanes say so,
    not sess-…:train:0 (issue 23)."""
    with served(pool) as server:
        for meta, expected in (({"recipe_name": "recipe_sl_basic", "git_rev": "0.6.1"}, "recipe_sl_basic"),
                               ({"name": "ada"}, "ada"), ({}, None)):
            sid = raw(server.url, "POST", "/create_session", json={"user_metadata": meta}).json()["session_id"]
            rid = raw(server.url, "POST", "/create_model", json={
                "session_id": sid, "model_seq_id": 0, "base_model": trio.DEFAULT_MODEL, "lora_config": {"rank": 4},
                "user_metadata": {"renderer_name": "role_colon"}}).json()["request_id"]
            model_id = raw(server.url, "POST", "/retrieve_future", json={"request_id": rid}).json()["model_id"]
            label = pool.telemetry.clients[server.clients()[model_id]].label
            assert label == (expected or f"{sid[:13]}:train:0"), label
            raw(server.url, "POST", f"/sessions/{sid}/finish", json={})
    # a key given with a participant's name (a keys file's "KEY Name" line): its sessions say the name,
    # unless a session names itself; a key without one is as before
    with served(pool, api_keys={"tml-ada-000001": "Ada Lovelace", "tml-anon-000002": ""}) as server:
        for key, meta, expected in (("tml-ada-000001", {}, "Ada Lovelace"), ("tml-ada-000001", {"name": "grace"},
                                                                            "grace"), ("tml-anon-000002", {}, None)):
            sid = raw(server.url, "POST", "/create_session", key, json={"user_metadata": meta}).json()["session_id"]
            rid = raw(server.url, "POST", "/create_model", key, json={
                "session_id": sid, "model_seq_id": 0, "base_model": trio.DEFAULT_MODEL,
                "lora_config": {"rank": 4}}).json()["request_id"]
            model_id = raw(server.url, "POST", "/retrieve_future", key, json={"request_id": rid}).json()["model_id"]
            label = pool.telemetry.clients[server.clients()[model_id]].label
            assert label == (expected or f"{sid[:13]}:train:0"), label
            raw(server.url, "POST", f"/sessions/{sid}/finish", key, json={})
