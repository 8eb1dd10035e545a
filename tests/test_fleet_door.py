"""The fleet's front door (issue 36 point 12) holds what `serve` holds: Host/Origin checks,
header timeouts, connections per key, request bodies bounded per key and in time. Tested
without Ray: `FrontDoor` in front of two served pools on 127.0.0.1, asked for their states as
Ray's handles would be (tests/test_fleet.py runs the whole fleet on Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter

import httpx
import pytest
from served import wait_for

import trio_widgets as trio
from trio_widgets.http.fleet import STATE_TTL_S, FrontDoor, Members, PoolState, describe, pool_tag

ALICE, MALLORY = "tml-door-alice-01", "tml-door-mallory-2"
BATCH = [trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})]


class _Local(Members):
    def __init__(self, servers: list, epochs: list[str]):
        self.servers, self.epochs, self.size = servers, epochs, len(servers)

    async def ask(self, index: int) -> PoolState | None:
        return describe(index, self.epochs[index], self.servers[index], "local")


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    where = tmp_path_factory.mktemp("door")
    epochs = ["a00001", "b00002"]
    made, servers = [], []
    for k, epoch in enumerate(epochs):
        pool = trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(where), name=f"door-{k}")
        made.append(pool)
        servers.append(trio.serve(pool, port=0, api_keys=[ALICE, MALLORY], id_tag=pool_tag(k, epoch)))
    yield _Local(servers, epochs)
    for server in servers:
        server.stop()
    for pool in made:
        pool.close()


@contextlib.contextmanager
def door(pools, **settings):
    front = FrontDoor(pools, port=0, api_keys=[ALICE, MALLORY], **settings).start()
    try:
        yield front
    finally:
        front.stop()


def _answer_of(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(4096):
            data += chunk
    return data


def test_training_goes_through_the_door_and_foreign_pages_do_not(pools):
    with door(pools) as front:
        service = trio.ServiceClient(base_url=front.url, api_key=ALICE)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        tc.forward_backward(BATCH)
        tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=60)
        service.close()
        url = f"{front.url}/api/v1"
        r = httpx.get(f"{url}/get_server_capabilities", headers={"X-API-Key": ALICE, "Host": "attacker.example"})
        assert r.status_code == 403 and r.json()["code"] == "forbidden_host"
        r = httpx.get(f"{url}/get_server_capabilities", headers={"X-API-Key": ALICE, "Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["code"] == "forbidden_origin"
        r = httpx.post(f"{url}/create_session", headers={"X-API-Key": ALICE, "Content-Type": "text/plain"},
                       content=b"{}")
        assert r.status_code == 415
        r = httpx.get(f"{url}/get_server_capabilities")
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        assert httpx.get(f"{url}/healthz").status_code == 200


def test_silent_sockets_at_the_door_are_closed(pools):
    with door(pools, header_timeout_s=1.0, max_waiting_connections=16) as front:
        socks = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(40)]
        try:
            wait_for(lambda: front.stats()["evicted"] >= 40 - 16, "the oldest silent sockets closed", 30)
            wait_for(lambda: front.stats()["timed_out"] >= 1, "the rest closed after header_timeout_s", 30)
            assert httpx.get(f"{front.url}/api/v1/healthz", timeout=30).status_code == 200
        finally:
            for s in socks:
                s.close()


def test_one_key_holds_its_share_of_the_doors_connections_and_bytes(pools):
    with door(pools, max_connections_per_key=8, max_body_bytes=2 << 20, max_inflight_bytes_per_key=4 << 20,
              body_timeout_s=2.0) as front:
        head = (b"POST /api/v1/optim_step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"X-API-Key: " + MALLORY.encode() + b"\r\nContent-Length: 2097152\r\n\r\n")
        socks = []
        # every head before any body: a body refused on bytes closes its connection, so with bodies sent
        # between heads a slow door could refuse bytes before the key ever held 9 connections at once
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
            s.sendall(head)
            socks.append(s)
        try:
            # past 8 connections the key's requests are refused (429 naming max_connections_per_key); past
            # 4 MiB of bodies being read, too (429 naming max_inflight_bytes_per_key)
            wait_for(lambda: front.stats()["refused_per_key"] >= 1, "the key's extra connections refused", 30)
            for s in socks:  # half a body each, then silence (a refused connection may be closed already)
                with contextlib.suppress(OSError):
                    s.sendall(b" " * (1 << 20))
            assert front.connections.per_key[_owner(MALLORY)] <= 8
            assert front.ingress.budget.held.get(_owner(MALLORY), 0) <= 4 << 20
            # the other key trains through the door meanwhile, and /healthz answers
            service = trio.ServiceClient(base_url=front.url, api_key=ALICE)
            tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)
            tc.forward_backward(BATCH).result(timeout=60)
            service.close()
            assert httpx.get(f"{front.url}/api/v1/healthz", timeout=30).status_code == 200
            answers = [_answer_of(s, 10.0).split(b"\r\n", 1)[0] for s in socks]
            codes = {a.split(b" ")[1] for a in answers if a}
            assert codes <= {b"408", b"429"} and b"429" in codes, answers  # over the key's share, or stalled
            wait_for(lambda: front.ingress.budget.sum == 0, "every stalled body's bytes given back", 30)
        finally:
            for s in socks:
                s.close()


def test_the_doors_limits_are_checked(pools):
    with pytest.raises(ValueError, match="max_connections_per_key"):
        FrontDoor(pools, max_connections_per_key=0)
    with pytest.raises(ValueError, match="without API keys"):
        FrontDoor(pools, host="0.0.0.0")


def _owner(key: str) -> str:
    from trio_widgets.http.auth import owner_of

    return owner_of(key)


def test_a_door_request_reaches_the_pool_it_names(pools):
    with door(pools) as front:
        service = trio.ServiceClient(base_url=front.url, api_key=ALICE)
        tcs = [service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=i) for i in range(2)]
        for tc in tcs:
            tc.forward_backward(BATCH).result(timeout=60)
        service.close()
        time.sleep(0.1)


class _Stalled(_Local):
    """Asked as a busy Ray cluster may answer: once `stalled`, an ask does not come back for a minute."""

    def __init__(self, servers: list, epochs: list[str]):
        super().__init__(servers, epochs)
        self.stalled, self.asked_while_stalled = False, Counter[int]()

    async def ask(self, index: int) -> PoolState | None:
        if self.stalled:
            self.asked_while_stalled[index] += 1
            await asyncio.sleep(60.0)
        return await super().ask(index)


def test_a_pools_stale_state_is_asked_again_behind_the_requests_not_before_them(pools):
    """Each request once a pool's state was STATE_TTL_S old waited for the ask (a Ray round trip,
    120-220 ms on a busy machine: a neighbour's heartbeat every 2 s, issue 36). Now the live pool's
    last state answers, one ask per pool goes on behind, and stopping the door ends it."""
    members = _Stalled(pools.servers, pools.epochs)
    with door(members) as front:
        service = trio.ServiceClient(base_url=front.url, api_key=ALICE)
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        tc.forward_backward(BATCH).result(timeout=60)
        session = httpx.post(f"{front.url}/api/v1/create_session", headers={"X-API-Key": ALICE}, timeout=60,
                             json={"type": "create_session", "tags": [], "user_metadata": {},
                                   "sdk_version": "test"}).json()["session_id"]
        members.stalled = True
        time.sleep(STATE_TTL_S + 0.2)
        for _ in range(5):  # each would wait the minute for the stalled ask (the read timeout: 10 s)
            answer = httpx.post(f"{front.url}/api/v1/session_heartbeat", timeout=10,
                                headers={"X-API-Key": ALICE},
                                json={"session_id": session, "type": "session_heartbeat"})
            assert answer.status_code == 200, answer.text
        tc.forward_backward(BATCH).result(timeout=10)
        # each pool asked once, however many requests (the heartbeats' pool, and the trainer's)
        assert set(members.asked_while_stalled.values()) == {1}, members.asked_while_stalled
        service.close()
        stopped = time.monotonic()
    assert time.monotonic() - stopped < 30  # the stalled ask was cancelled with the door
