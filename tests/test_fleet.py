"""A fleet on a local Ray instance (issue 25): two CPU pools (one torch thread each) behind one
URL on Ray Serve. The unmodified tinker SDK and trio's HTTP client train sessions against that
URL; placement, routing, the clock rules, shared checkpoints and a replica killed mid-run are
read from each pool's own telemetry and files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from served import (
    FLEET_KEY,
    FLEET_OBSERVER,
    FLEET_SESSION_TIMEOUT_S,
    assert_no_secret_in_arguments,
    check_three_loops,
    in_threads,
    same_tensors,
    three_loops,
    wait_for,
)

import trio_widgets as trio

pytest.importorskip("ray.serve", reason="the cluster extra (Ray Serve) is not installed")
if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import tinker  # noqa: E402
from tinker import types as tt  # noqa: E402

from trio_widgets.errors import PoolClosedError  # noqa: E402
from trio_widgets.http.remote import RemotePool  # noqa: E402

# The fleet: conftest.py's `fleet`, shared with tests/test_fleet_dashboard.py (tests/served.py's
# SharedFleet: two pools of FLEET_CYCLE_S, a round trip through the front door, Serve and the ingress
# in a cycle), stopped with SIGINT after the last test that uses it.
KEY, OBSERVER, SESSION_TIMEOUT_S = FLEET_KEY, FLEET_OBSERVER, FLEET_SESSION_TIMEOUT_S
# `make test` runs it alone, with no test beside it: it reads the cycles each loop took, and a
# client's round trip through Ray on a CPU another test keeps busy can miss a cycle's boundary
pytestmark = pytest.mark.alone
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]
_TAG = re.compile(r"^sess-p(\d)r([0-9a-f]{6})-([0-9a-f]{16})")


def pool_of(model_id: str) -> int:
    found = _TAG.match(model_id)
    assert found, model_id
    return int(found[1])


def lane_label(model_id: str) -> str:
    """The pool's lane label of an unnamed session's first model."""
    found = _TAG.match(model_id)
    assert found, model_id
    return f"sess-{found[3][:8]}:train:0"


def sdk_datum(i: int) -> tt.Datum:
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + 17]
    return tt.Datum(model_input=tt.ModelInput.from_ints(chunk[:-1]), loss_fn_inputs={"target_tokens": chunk[1:]})


def trio_datum(i: int) -> trio.Datum:
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + 17]
    return trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})


def fleet_info(fleet) -> dict:
    answer = httpx.get(f"{fleet.url}/api/v1/trio/fleet", headers={"X-API-Key": OBSERVER}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def pool_view(fleet, k: int) -> RemotePool:
    return RemotePool(f"{fleet.url}/trio/pools/{k}", OBSERVER)


def client_of(view, label: str) -> str | None:
    return next((cid for cid, info in view.telemetry.clients.items() if info.label == label), None)


def test_the_cli_refuses_a_fleet_open_to_all_without_keys():
    refused = subprocess.run([sys.executable, "-m", "trio_widgets", "serve", "--ray", "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "refusing to serve on '0.0.0.0' without API keys" in refused.stderr


def test_sessions_are_spread_and_each_runs_on_its_pool_as_on_one(fleet, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = fleet_info(fleet)
    assert info["totals"]["alive"] == 2 and info["totals"]["sessions"] == 0, info
    placed = info["placements"]  # (0, 0 when this test is the fleet's first)
    sdk = [tinker.ServiceClient(base_url=fleet.url, api_key=KEY) for _ in range(2)]
    ours = [trio.ServiceClient(base_url=fleet.url, api_key=KEY) for _ in range(2)]
    try:
        sdk_tcs = [sc.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=i).result()
                   for i, sc in enumerate(sdk)]
        our_tcs = [sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=2 + i) for i, sc in enumerate(ours)]
        ids = [tc.model_id for tc in [*sdk_tcs, *our_tcs]]
        assert sorted(pool_of(m) for m in ids) == [0, 0, 1, 1], ids  # 2/2, by headroom at creation (none live before)
        adam_sdk, adam = tt.AdamParams(learning_rate=1e-2), trio.AdamParams(learning_rate=1e-2)
        n = 3
        loops = {}
        for k, tc in enumerate(sdk_tcs):
            loops[f"sdk{k}"] = (lambda tc=tc: three_loops(
                lambda: tc.forward_backward([sdk_datum(1)], "cross_entropy"),
                lambda: tc.optim_step(adam_sdk), lambda f: f.result(), n))
        for k, tc in enumerate(our_tcs):
            loops[f"trio{k}"] = (lambda tc=tc: three_loops(
                lambda: tc.forward_backward([trio_datum(2)], "cross_entropy"),
                lambda: tc.optim_step(adam), lambda f: f.result(), n))
        in_threads(loops, timeout=600)
        views = [pool_view(fleet, k) for k in range(2)]
        try:
            for model_id in ids:
                home, label = pool_of(model_id), lane_label(model_id)
                view = views[home]
                wait_for(lambda view=view, label=label: (cid := client_of(view, label)) is not None and
                         sum(r.op == "optim_step" for r in view.telemetry.requests_of(cid)) >= 3 * n + 1,
                         f"{label}'s requests in pool-{home}'s telemetry", timeout=60)
                # every request of the session ran on its pool, in the cycles a single pool gives
                check_three_loops(view, client_of(view, label), since=0, n=n)
                assert client_of(views[1 - home], label) is None
        finally:
            for view in views:
                view.close()
        info = fleet_info(fleet)
        assert [n - before for n, before in zip(info["placements"], placed)] == [2, 2], info
        assert [p["alive"] for p in info["pools"]] == [True, True], info
    finally:  # (a failure here must not leave sessions that the next test's placement would count)
        for sc in sdk:
            sc.close("success").result(timeout=60)
        for sc in ours:
            sc.close()


def _on_pool(fleet, k: int) -> tuple[trio.ServiceClient, trio.TrainingClient, list[trio.ServiceClient]]:
    """A new session placed on pool k (sessions are placed by headroom: make more until one lands there)."""
    spare = []
    for _ in range(4):
        sc = trio.ServiceClient(base_url=fleet.url, api_key=KEY)
        tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=7)
        if pool_of(tc.model_id) == k:
            return sc, tc, spare
        spare.append(sc)
    raise AssertionError(f"no session was placed on pool-{k}")


def test_a_checkpoint_saved_on_one_pool_resumes_bitwise_on_the_other(fleet):
    sc_a, a, spare_a = _on_pool(fleet, 0)
    sc_b, _, spare_b = _on_pool(fleet, 1)
    try:
        adam = trio.AdamParams(learning_rate=1e-2)
        for i in range(3):
            a.forward_backward([trio_datum(i)], "cross_entropy")
            a.optim_step(adam)
        saved = a.save_state("fleet-a").result(timeout=120).path
        b = sc_b.create_training_client_from_state_with_optimizer(saved)
        assert pool_of(b.model_id) == 1
        copied = b.save_state("fleet-b").result(timeout=120).path
        root = Path(fleet.checkpoint_dir)
        (dir_a,) = [p for p in root.rglob("fleet-a") if p.is_dir()]
        (dir_b,) = [p for p in root.rglob("fleet-b") if p.is_dir()]
        from safetensors.torch import load_file

        tensors = sorted(p.name for p in dir_a.glob("*.safetensors"))
        assert tensors and tensors == sorted(p.name for p in dir_b.glob("*.safetensors"))
        for name in tensors:  # the adapter and the optimizer state, bit for bit
            assert same_tensors(load_file(str(dir_a / name)), load_file(str(dir_b / name))), name
        # and training goes on from there on pool 1: the same next loss as pool 0 computes
        loss_a = a.forward([trio_datum(5)], "cross_entropy").result(timeout=120).metrics["loss:sum"]
        loss_b = b.forward([trio_datum(5)], "cross_entropy").result(timeout=120).metrics["loss:sum"]
        assert loss_a == loss_b and copied != saved
    finally:
        for sc in [sc_a, sc_b, *spare_a, *spare_b]:
            sc.close()


def test_samplers_listings_and_unknown_pools_across_the_fleet(fleet):
    """A sampler made on pool 1 from weights saved on pool 0 samples there; the REST listings
    show both pools' runs once each; an id naming a pool the fleet does not have is refused
    naming it."""
    sc_a, a, spare_a = _on_pool(fleet, 0)
    sc_b, b, spare_b = _on_pool(fleet, 1)
    try:
        saved = a.save_weights_for_sampler("fleet-sampler").result(timeout=120).path
        sampler = sc_b.create_sampling_client(model_path=saved)
        out = sampler.sample(trio.ModelInput.from_ints(TEXT[:8]), num_samples=2,
                             sampling_params=trio.SamplingParams(max_tokens=4, seed=0)).result(timeout=120)
        assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
        b.forward_backward([trio_datum(0)], "cross_entropy").result(timeout=120)
        rest = sc_a.create_rest_client()
        runs = [r.training_run_id for r in rest.list_training_runs(limit=1000).result(timeout=60).training_runs]
        assert a.model_id in runs and b.model_id in runs and len(runs) == len(set(runs)), runs
        saved_b = b.save_weights_for_sampler("fleet-sampler-b").result(timeout=120).path
        # a key's checkpoints, listed by one pool in turn (the directory is shared): both pools' saves,
        # once each, whichever pool answers
        listings = [[c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result(timeout=60).checkpoints]
                    for _ in range(2)]
        assert listings[0] == listings[1], listings
        paths = listings[0]
        assert saved in paths and saved_b in paths and len(paths) == len(set(paths)), paths
    finally:
        for sc in [sc_a, sc_b, *spare_a, *spare_b]:
            sc.close()
    # ids no pool of this fleet made: not found, saying why; a pool restarted since: gone, naming it
    answer = httpx.post(f"{fleet.url}/api/v1/retrieve_future", headers={"X-API-Key": KEY},
                        json={"request_id": "req-p7r0a0b0c-1"}, timeout=60)
    assert answer.status_code == 404 and "names pool-7, and this fleet has pools 0 to 1" in answer.text, answer.text
    epoch = fleet_info(fleet)["pools"][1]["epoch"]
    stale = "000000" if epoch != "000000" else "000001"
    answer = httpx.post(f"{fleet.url}/api/v1/retrieve_future", headers={"X-API-Key": KEY},
                        json={"request_id": f"req-p1r{stale}-1"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["category"] == "server", answer.text
    assert answer.json()["error"].startswith("pool-1 of this fleet restarted (its replica died)"), answer.text
    answer = httpx.post(f"{fleet.url}/api/v1/optim_step", headers={"X-API-Key": KEY},
                        json={"model_id": f"sess-p1r{stale}-0123456789abcdef:train:0", "seq_id": 0}, timeout=60)
    assert answer.status_code == 410 and answer.json()["code"] == "pool_failed", answer.text
    assert httpx.get(f"{fleet.url}/trio/pools/5/api/v1/healthz", timeout=60).status_code == 404
    # no key in any process the fleet started (its driver, Ray's workers, each pool's replica): `ps` shows them
    assert assert_no_secret_in_arguments([KEY, OBSERVER]) >= 3


def test_each_pool_and_the_door_keep_their_startup_heap_out_of_the_collectors_passes(fleet):
    """A replica's process serves its pool alone, the door's process the door: once started, what
    each holds for good (torch, the models, Ray, the app) is frozen, as `trio serve`'s is, so no full
    collection there walks it with the GIL held while its event loop waits (issue 36)."""
    info = fleet_info(fleet)
    pools = info["pools"]
    assert len(pools) == 2 and all(p["alive"] and p["frozen_objects"] > 100_000 for p in pools), pools
    # and the front door's process (Ray's heap: a full pass there held every request through the door)
    assert info["door"]["frozen_objects"] > 100_000, info["door"]


def test_a_killed_pool_fails_its_sessions_futures_naming_it_and_the_other_loses_nothing(fleet):
    """It kills pool 0's replica (Ray starts a new one, which the tests after it use)."""
    sc_a, a, spare_a = _on_pool(fleet, 0)
    sc_b, b, spare_b = _on_pool(fleet, 1)
    adam = trio.AdamParams(learning_rate=1e-2)
    before = {p["index"]: p for p in fleet_info(fleet)["pools"]}
    try:
        pending = []
        for i in range(6):  # queued on pool 0, most not run yet when it dies
            pending += [a.forward_backward([trio_datum(i)], "cross_entropy"), a.optim_step(adam)]
        pending[0].result(timeout=120)
        os.kill(before[0]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        failed = []
        for future in pending[1:]:
            try:
                future.result(timeout=SESSION_TIMEOUT_S + 60)
            except PoolClosedError as exc:
                failed.append(str(exc))
        assert failed and all("pool-0 of this fleet" in m for m in failed), failed
        assert time.monotonic() - killed < SESSION_TIMEOUT_S
        # pool 1's session lost nothing: every update runs, in order
        results = []
        for i in range(4):
            fb, opt = b.forward_backward([trio_datum(i)], "cross_entropy"), b.optim_step(adam)
            results.append((fb.result(timeout=120), opt.result(timeout=120)))
        assert len(results) == 4 and all(r[0].metrics["loss:sum"] > 0 for r in results)
        # Ray starts a new replica of pool 0 (a new epoch); a new session is served
        wait_for(lambda: any(p["index"] == 0 and p["alive"] and p["epoch"] != before[0]["epoch"]
                             for p in fleet_info(fleet)["pools"]), "pool-0 restarted", timeout=180)
        sc_c, c, spare_c = _on_pool(fleet, 0)
        c.forward_backward([trio_datum(0)], "cross_entropy").result(timeout=120)
        c.optim_step(adam).result(timeout=120)
        for sc in [sc_c, *spare_c]:
            sc.close()
    finally:
        for sc in [sc_a, sc_b, *spare_a, *spare_b]:
            sc.close()


def test_the_cli_serves_a_fleet_until_interrupted(fleet):
    """`python -m trio_widgets serve --ray`: the fleet of these tests is one (tests/served.py's
    fleet_process, its keys in $TRIO_API_KEYS): one URL, sessions tagged by their pool (the tests
    above), and the line it printed once the fleet answered. SIGINT stops it, with exit status 0 and
    "trio: stopped" last: checked when the fleet is stopped, after the last test that uses it
    (SharedFleet.stop; a fleet of this test's own would cost another local Ray instance's start)."""
    printed = [line for line in fleet.log.read_text().splitlines() if line.startswith("trio: ")]
    assert printed and printed[0].startswith(
        f"trio: serving a fleet of 2 pools on http://127.0.0.1:{fleet.port} (Ray Serve)"), printed
    assert fleet.proc.poll() is None
