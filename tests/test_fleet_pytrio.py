"""pytrio 0.2.9's own SDK, unmodified, against a two-pool fleet behind one URL (issue 32 point 2):
two PyTRIO users at once land on different pools (the session's tag names its pool), and each
trains, samples, saves, lists, downloads and resumes through the fleet's one URL (the actor the
control plane names is the pool itself, reached through the fleet's /trio/pools/<k> prefix)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from served import FLEET_USER_KEYS

pytest.importorskip("pytrio")
pytest.importorskip("ray.serve", reason="the cluster extra (Ray Serve) is not installed")

# `make test` runs it alone, as every module that uses the shared `fleet` (conftest.py): one fleet,
# started once, in the phase where nothing runs beside it
pytestmark = pytest.mark.alone

KEYS = FLEET_USER_KEYS  # two users of conftest.py's `fleet`, shared with tests/test_fleet*.py (served.py)
HERE = Path(__file__).parent
MODEL = "trio/tiny-llama-byte"


def test_pytrio_users_on_a_two_pool_fleet(fleet, tmp_path):
    procs = []
    for k, key in enumerate(KEYS):
        where = tmp_path / f"user{k}"
        where.mkdir()
        # a user elsewhere than the pools gets the built-in model's tokenizer from the server (the pools
        # name the model, not a directory of theirs); pytrio's get_tokenizer() loads it by that name
        files = httpx.get(f"{fleet.url}/api/v1/trio/tokenizer", params={"base_model": MODEL},
                          headers={"X-API-Key": key}, timeout=60).json()["files"]
        (where / MODEL).mkdir(parents=True)
        for name, data in files.items():
            (where / MODEL / name).write_bytes(base64.b64decode(data))
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTRIO_", "TRIO_", "TINKER_", "RAY_"))}
        env = {**base, "PYTRIO_BASE_URL": fleet.url, "PYTRIO_API_KEY": key, "HOME": str(where / "home"),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        log = open(where / "pytrio.log", "w")  # noqa: SIM115 - closed below
        procs.append((where, log, subprocess.Popen([sys.executable, str(HERE / "pytrio_served.py"), str(where),
                                                    "basics"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    cwd=where)))
    results = []
    for where, log, proc in procs:
        try:
            proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        found = where / "results.json"
        assert found.exists(), (where / "pytrio.log").read_text()[-4000:]
        results.append(json.loads(found.read_text()))
    for r in results:
        assert "basics" not in r.get("errors", {}), r["errors"]
        assert r["losses"][-1] < 0.8 * r["losses"][0], r["losses"]
        assert r["resumed"] == pytest.approx(r["after"], rel=1e-5)
        assert r["runs"] and all(run.startswith(r["session"]) for run in r["runs"])
    tags = {r["session"].split("-")[1] for r in results}  # sess-p<k>r<epoch>-<hex>
    assert len(tags) == 2, tags  # one user per pool
