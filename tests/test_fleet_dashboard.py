"""`trio.Dashboard(fleet.url)`: one view of a fleet (trio_widgets/widgets/fleet.py) on a local Ray
instance: the fleet's totals, a selector with one entry per pool, and the selected pool's own
Dashboard, whose lanes are that pool's sessions only. Real pools, real widgets, no browser."""

from __future__ import annotations

import os
import re
import threading
import time

import httpx
import pytest
from served import FLEET_KEY, FLEET_OBSERVER, served, wait_for

import trio_widgets as trio

pytest.importorskip("ray.serve", reason="the cluster extra (Ray Serve) is not installed")

from trio_widgets.http.remote import RemotePool  # noqa: E402
from trio_widgets.widgets.dashboard import Dashboard  # noqa: E402
from trio_widgets.widgets.fleet import FleetDashboard, pool_label  # noqa: E402

# `make test` runs it alone, as every module that uses the shared `fleet` (conftest.py): one fleet,
# started once, in the phase where nothing runs beside it
pytestmark = pytest.mark.alone

# The fleet: conftest.py's `fleet`, shared with tests/test_fleet.py (tests/served.py's SharedFleet).
KEY, OBSERVER = FLEET_KEY, FLEET_OBSERVER
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]
_TAG = re.compile(r"^sess-p(\d)r([0-9a-f]{6})-([0-9a-f]{16})")
UPDATES = 3


def pool_of(model_id: str) -> int:
    found = _TAG.match(model_id)
    assert found, model_id
    return int(found[1])


def lane_label(model_id: str) -> str:
    """The pool's lane label of an unnamed session's first model."""
    found = _TAG.match(model_id)
    assert found, model_id
    return f"sess-{found[3][:8]}:train:0"


def datum(i: int) -> trio.Datum:
    chunk = TEXT[(5 * i) % 40:(5 * i) % 40 + 17]
    return trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})


def fleet_info(fleet) -> dict:
    answer = httpx.get(f"{fleet.url}/api/v1/trio/fleet", headers={"X-API-Key": OBSERVER}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ours(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads of trio's views (dashboards, remote readers, the fleet view's) started since `before`
    and still running."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive()
            and t.name.startswith(("trio-dashboard", "trio-remote"))]


def test_a_pool_is_labelled_by_its_device_and_sessions_and_a_dead_one_is_marked():
    assert pool_label({"index": 0, "name": "pool-0", "alive": True, "device": "cpu", "sessions": 2}) == \
        "pool-0 (cpu, 2 sessions)"
    assert pool_label({"index": 0, "name": "pool-0", "alive": True, "device": "cuda", "sessions": 1}) == \
        "pool-0 (cuda, 1 session)"
    assert pool_label({"index": 1, "name": "pool-1", "alive": False, "path": "/trio/pools/1"}) == "pool-1 (dead)"


def test_a_served_pools_url_gives_the_single_pool_dashboard_as_before(tmp_path):
    """A plain served pool has no /trio/fleet (it answers 404): Dashboard(url) is the pool's Dashboard."""
    with trio.LocalPool(min_cycle_s=0.05, name="plain", checkpoint_dir=str(tmp_path)) as pool, \
            served(pool, api_keys=[KEY], observer_keys=[OBSERVER]) as server:
        answer = httpx.get(f"{server.url}/api/v1/trio/fleet", headers={"X-API-Key": OBSERVER}, timeout=30)
        assert answer.status_code == 404, answer.text
        with pytest.raises(trio.PermissionDeniedError, match="observer"):
            trio.Dashboard(server.url, api_key=KEY)
        dash = trio.Dashboard(server.url, api_key=OBSERVER, export_dir=tmp_path)
        try:
            assert type(dash) is Dashboard and isinstance(dash.pool, RemotePool)
            assert dash.pool.min_cycle_s == 0.05
        finally:
            dash.close()


def test_a_wrong_key_is_refused_naming_what_is_wrong(fleet):
    before = set(threading.enumerate())
    with pytest.raises(trio.AuthenticationError, match="invalid API key"):
        trio.Dashboard(fleet.url, api_key="tml-not-a-key-of-this-fleet")
    with pytest.raises(trio.AuthenticationError, match="missing API key"):
        trio.Dashboard(fleet.url)
    with pytest.raises(trio.PermissionDeniedError, match="observer key"):  # a key that may train, not watch
        trio.Dashboard(fleet.url, api_key=KEY)
    assert not ours(before)


def test_the_fleet_view_shows_each_pool_and_the_fleets_totals(fleet, tmp_path):
    before = set(threading.enumerate())
    services = [trio.ServiceClient(base_url=fleet.url, api_key=KEY) for _ in range(4)]
    view = None
    try:
        clients = [sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=i) for i, sc in enumerate(services)]
        on = {k: [tc for tc in clients if pool_of(tc.model_id) == k] for k in (0, 1)}
        assert [len(on[0]), len(on[1])] == [2, 2], [tc.model_id for tc in clients]  # placed by headroom
        adam = trio.AdamParams(learning_rate=1e-2)
        for i in range(UPDATES):
            futures = [(tc.forward_backward([datum(i)], "cross_entropy"), tc.optim_step(adam)) for tc in clients]
            for fb, opt in futures:
                fb.result(timeout=120)
                opt.result(timeout=120)

        view = trio.Dashboard(fleet.url, api_key=OBSERVER, export_dir=tmp_path)
        assert isinstance(view, FleetDashboard)
        # one selector entry per pool, labelled by device and live sessions; pool 0 shown first
        assert [value for _, value in view.selector.options] == [0, 1]
        assert [label for label, _ in view.selector.options] == ["pool-0 (cpu, 2 sessions)",
                                                                 "pool-1 (cpu, 2 sessions)"]
        assert view.index == 0 and view.selector.value == 0
        first = view.dashboard
        assert type(first) is Dashboard and first.pool.base_url == f"{fleet.url}/trio/pools/0"

        # the totals are the fleet's (nothing trains now: they stand still)
        totals = view.refresh()
        info = fleet_info(fleet)
        assert totals == info["totals"], (totals, info["totals"])
        assert totals["alive"] == totals["pools"] == 2 and totals["sessions"] == 4 and totals["clients"] == 4
        assert totals["total_updates"] == sum(p["total_updates"] for p in info["pools"]) >= 4 * UPDATES
        text = view.header_text
        for shown in ("pools <b>2</b>/<b>2</b> alive", "sessions <b>4</b>", "clients <b>4</b>",
                      f"updates <b>{totals['total_updates']}</b>"):
            assert shown in text, text

        # pool 0's lanes are pool 0's sessions
        expected = {k: sorted(lane_label(tc.model_id) for tc in on[k]) for k in (0, 1)}

        def lanes(dash) -> list[str]:
            return sorted(v.label for v in dash.figures.clients.values() if not v.retired)

        wait_for(lambda: lanes(first) == expected[0], "pool-0's lanes", timeout=60)

        # selecting pool 1 closes pool 0's dashboard (its reader too) and shows pool 1's sessions only
        reader = first.pool._thread
        second = view.select(1)
        assert view.index == 1 and view.selector.value == 1 and view.dashboard is second
        assert first.closed and not first.running and not reader.is_alive()
        assert type(second) is Dashboard and second.pool.base_url == f"{fleet.url}/trio/pools/1"
        wait_for(lambda: lanes(second) == expected[1], "pool-1's lanes", timeout=60)
        assert not set(lanes(second)) & set(expected[0])
        wait_for(lambda: second.pool.telemetry.total_updates == info["pools"][1]["total_updates"],
                 "pool-1's updates in its dashboard", timeout=60)

        # the selector's button does the same (its callback hands the switch to the view's thread)
        view.selector.value = 0
        wait_for(lambda: view.index == 0 and view.dashboard is not None and view.dashboard is not second,
                 "pool-0 shown again from its button", timeout=60)
        assert second.closed
        wait_for(lambda: lanes(view.dashboard) == expected[0], "pool-0's lanes again", timeout=60)

        # new sessions: the totals follow on the view's own timer
        extra = trio.ServiceClient(base_url=fleet.url, api_key=KEY)
        services.append(extra)
        extra.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=9)
        wait_for(lambda: view.totals.get("sessions") == 5 and "sessions <b>5</b>" in view.header_text,
                 "the header's totals to follow", timeout=30)

        shown, thread = view.dashboard, view._thread
        view.close()
        view.close()  # (again: nothing)
        assert view.closed and shown.closed and not thread.is_alive()
        deadline = time.monotonic() + 10
        while ours(before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ours(before), ours(before)
    finally:
        if view is not None:
            view.close()
        for sc in services:
            sc.close()


def test_a_dead_pool_is_marked_and_its_restarted_process_is_shown_again(fleet):
    """It kills pool 1's replica (Ray starts a new one)."""
    import signal

    before = set(threading.enumerate())
    view = trio.Dashboard(fleet.url, api_key=OBSERVER)
    assert isinstance(view, FleetDashboard)
    labels: list[str] = []
    view.selector.observe(lambda change: labels.extend(label for label, _ in change["new"]), names="options")
    try:
        old = view.select(1)
        view.refresh_s = 0.2  # (read at each wait of its thread)
        pid, epoch = next((p["pid"], p["epoch"]) for p in fleet_info(fleet)["pools"] if p["index"] == 1)
        os.kill(pid, signal.SIGKILL)
        # Ray may bring pool 1 back before the view next asks (the ingress waits up to 10 s for a
        # replica, and a restart can take less): "dead" shows only if the view asks in between, so
        # it is not required here (test_a_pool_is_labelled_... covers the label); the reopening is.
        wait_for(lambda: any(p["index"] == 1 and p.get("alive") and p["epoch"] != epoch
                             for p in fleet_info(fleet)["pools"]), "pool-1 restarted", timeout=180)
        # the view opens the new process's dashboard by itself
        wait_for(lambda: view.index == 1 and view.dashboard is not None and view.dashboard is not old
                 and not view.dashboard.pool.closed, "pool-1's new dashboard", timeout=60)
        assert old.closed and view.selector.value == 1
    finally:
        view.close()
    deadline = time.monotonic() + 10
    while ours(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours(before), ours(before)
