"""PyTRIO's own SDK (pytrio 0.2.9, the real package, unmodified) against `trio serve` with an
API-key file (issue 32 points 1, 2 and 6 against serve): it trains, samples, saves state and
weights for sampling, lists and downloads checkpoints and resumes; SFT, DPO (-100 targets) and a
GRPO-style loop written in PyTRIO's style learn; meanwhile the tinker SDK, with another key, trains
on the same pool, and neither key sees the other's runs; the same dashboard stream shows both.

The PyTRIO side runs in a process of its own (tests/pytrio_served.py), configured only by
PYTRIO_BASE_URL and PYTRIO_API_KEY, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import msgpack
import pytest
from served import serving_process, tinker_env, wait_for

from trio_widgets.http.remote import RemotePool

pytest.importorskip("pytrio")
if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import tinker  # noqa: E402
from tinker import types as tt  # noqa: E402

PYTRIO_KEY, TINKER_KEY, OBSERVER = "pt-key-ada-0001", "tml-key-bob-0002", "obs-key-0003"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def run(tmp_path_factory, monkeypatch_module):
    """One served pool (a process, keys from a file), the PyTRIO script and a tinker client at once."""
    where = tmp_path_factory.mktemp("pytrio")
    keys = where / "keys.txt"
    keys.write_text(f"{PYTRIO_KEY} Ada\n{TINKER_KEY} Bob\n")
    with serving_process(where, keys="", observers=OBSERVER, min_cycle_s=0.005,
                         args=["--api-keys-file", str(keys)]) as (url, log):
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTRIO_", "TRIO_", "TINKER_"))}
        env = {**base, "PYTRIO_BASE_URL": url, "PYTRIO_API_KEY": PYTRIO_KEY, "HOME": str(where / "home"),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with open(where / "pytrio.log", "w") as plog:
            proc = subprocess.Popen([sys.executable, str(HERE / "pytrio_served.py"), str(where)], env=env,
                                    stdout=plog, stderr=subprocess.STDOUT)
        try:
            tinker_env(monkeypatch_module)
            sc = tinker.ServiceClient(base_url=url, api_key=TINKER_KEY)
            tc = sc.create_lora_training_client(base_model="trio/tiny-llama-byte", rank=4).result()
            tokens = [3 + b for b in b"tinker and pytrio on one pool"]
            data = [tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": tokens[1:]})]
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
            (where / "tinker_run").write_text(tc.model_id)
            wait_for(lambda: (where / "pytrio_run").exists() or proc.poll() is not None, "pytrio's run", 120)
            pytrio_run = (where / "pytrio_run").read_text()
            rest = tinker.RestClient(base_url=url, api_key=TINKER_KEY)
            tinker_sees: dict = {"runs": [r.training_run_id for r in rest.list_training_runs().result().training_runs]}
            try:
                rest.get_training_run(pytrio_run).result()
                tinker_sees["other"] = "yes"
            except tinker.NotFoundError:
                tinker_sees["other"] = 404
            with RemotePool(url, OBSERVER) as watched:  # what a dashboard reads
                wait_for(lambda: len(watched.telemetry.all_clients()) >= 2, "both clients on the dashboard", 60)
                labels = {c.label for c in watched.telemetry.all_clients().values()}
            proc.wait(240)
            sc.close("success").result(timeout=60) if hasattr(sc, "close") else None
        finally:
            if proc.poll() is None:
                proc.kill()
        results_file = where / "results.json"
        assert results_file.exists(), (where / "pytrio.log").read_text()[-4000:] + log.read_text()[-3000:]
        results = json.loads(results_file.read_text())
        yield {"results": results, "tinker": tinker_sees, "pytrio_run": pytrio_run, "tinker_run": tc.model_id,
               "labels": labels, "where": where, "url": url, "log": log}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def part(run: dict, name: str) -> dict:
    results = run["results"]
    assert name not in results.get("errors", {}), results["errors"][name]
    return results


def test_pytrio_trains_saves_samples_lists_downloads_and_resumes(run):
    r = part(run, "basics")
    assert r["models"] == ["trio/tiny-llama-byte"]
    losses = r["losses"]
    assert losses[-1] < 0.8 * losses[0], losses  # loss falls
    assert r["state_path"] == f"tinker://{run['pytrio_run']}/weights/state-1"
    assert r["weights_path"] == f"tinker://{run['pytrio_run']}/sampler_weights/weights-1"
    for tokens, text, n_logprobs in r["samples"]:
        assert len(tokens) == 6 and n_logprobs == 6 and isinstance(text, str)
    assert ["training", r["state_path"]] in r["checkpoints"] and ["sampler", r["weights_path"]] in r["checkpoints"]
    path, size = r["download"]
    with tarfile.open(path) as archive:
        assert sorted(archive.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert size == Path(path).stat().st_size
    # a resumed run reads the saved weights: the same loss as the run that saved them
    assert r["resumed"] == pytest.approx(r["after"], rel=1e-5)
    assert r["loaded"] == pytest.approx(r["after"], rel=1e-5)


def test_each_key_sees_only_its_own_runs_on_one_pool(run):
    r = part(run, "isolation")
    assert r["sees_other"] == 404 and run["tinker"]["other"] == 404
    assert run["tinker_run"] not in r["runs_after"] and run["pytrio_run"] in r["runs_after"]
    assert run["pytrio_run"] not in run["tinker"]["runs"] and run["tinker_run"] in run["tinker"]["runs"]
    assert all(x.startswith(r["session"]) for x in r["runs_after"])


def test_the_same_dashboard_shows_both_protocols(run):
    assert any("Ada" in label for label in run["labels"]) and any("Bob" in label for label in run["labels"])


def test_pytrio_style_loops_learn_against_serve(run):
    r = run["results"]
    for name in ("sft", "dpo", "grpo"):
        assert name not in r.get("errors", {}), r["errors"][name]
    assert r["sft"][-1] < 0.6 * r["sft"][0], r["sft"]
    assert r["dpo"][0] == pytest.approx(0.6931, abs=1e-3) and r["dpo"][-1] < 0.5 * r["dpo"][0], r["dpo"]
    assert sum(r["grpo"][-3:]) / 3 > sum(r["grpo"][:3]) / 3 + 0.15, r["grpo"]


def test_bad_pytrio_requests_are_4xx_naming_the_field(run):
    url, head = run["url"], {"Authorization": f"Bearer {PYTRIO_KEY}"}
    with httpx.Client(base_url=url, headers=head, timeout=30) as http:
        session = http.post("/api/openapi/v1/service-sessions", json={"sdk_version": "0.2.9"}).json()
        sid = session["service_session_cuid"]
        bad = http.post(f"/api/openapi/v1/service-sessions/{sid}/training-runs", json={"base_model": "nope"})
        assert bad.status_code == 400 and bad.json()["field"] == "base_model"
        event = {"event_id": "event_0123456789ab", "type": "trainer.forward", "payload": {},
                 "metadata": {"index": "x", "run_id": "r"}}
        answer = http.post(f"/api/pytrio/{sid}/v1/events", content=msgpack.packb(event),
                           headers={"Content-Type": "application/msgpack"})
        assert answer.status_code == 400 and answer.json()["field"] == "metadata.index"
        garbage = http.post(f"/api/pytrio/{sid}/v1/events", content=b"\xc1\xc1",
                            headers={"Content-Type": "application/msgpack"})
        assert garbage.status_code == 400 and "MessagePack" in garbage.json()["message"]
        other = http.get(f"/api/openapi/v1/training-runs/{run['tinker_run']}")
        assert other.status_code == 404  # another key's run: as unknown
        anonymous = httpx.get(f"{url}/api/openapi/v1/api-key/verify", timeout=30)
        assert anonymous.status_code == 401


HOSTILE: list = [None, True, -1, 2**63, 1e308, float("nan"), "", "x" * 5000, "../../etc/passwd", "tinker://",
                 "tinker://r/weights/x/y", "sess-0123456789abcdef:train:0", "\u0000", [], [[1]], {}, {"a": 1},
                 {"chunks": None}, {"chunks": [{"type": "image"}]}]


def test_hostile_pytrio_requests_never_get_a_500(run):
    """Each field of a valid control body, event envelope and payload replaced by a hostile value,
    dropped, or the body replaced: a 2xx, or a 4xx whose body names the problem."""
    url = run["url"]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {PYTRIO_KEY}"}, timeout=60) as http:
        sid = http.post("/api/openapi/v1/service-sessions", json={"sdk_version": "0.2.9"}).json()
        sid = sid["service_session_cuid"]
        made = http.post(f"/api/openapi/v1/service-sessions/{sid}/training-runs",
                         json={"base_model": "trio/tiny-llama-byte", "lora_rank": 4})
        rid = made.json()["training_run_cuid"]
        answers = []

        def check(answer: httpx.Response, what: str) -> None:
            assert answer.status_code < 500, (what, answer.status_code, answer.text[:300])
            if answer.status_code >= 400:
                assert answer.json().get("message"), (what, answer.text[:300])
            answers.append(answer.status_code)

        control = [("POST", f"/api/openapi/v1/service-sessions/{sid}/training-runs",
                    {"base_model": "trio/tiny-llama-byte", "source_checkpoint_uri": ""}),
                   ("PATCH", f"/api/openapi/v1/service-sessions/{sid}/training-runs/{rid}",
                    {"source_checkpoint_uri": "tinker://x/weights/y", "restore_optimizer": False}),
                   ("POST", f"/api/openapi/v1/service-sessions/{sid}/sampling-runs",
                    {"base_model": "trio/tiny-llama-byte", "source_checkpoint_uri": ""})]
        for method, path, body in control:
            for name in body:
                for value in [*HOSTILE, ...]:
                    mutated = {k: v for k, v in body.items() if k != name or value is not ...}
                    if value is not ...:
                        mutated[name] = value
                    check(http.request(method, path, content=json.dumps(mutated).encode(),
                                       headers={"Content-Type": "application/json"}), f"{path} {name}={value!r:.40}")
        init = {"base_model": "trio/tiny-llama-byte", "lora_config": {"rank": 4, "train_mlp": True,
                                                                      "train_attn": True, "train_unembed": True}}
        fb = {"data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                        "target_ids": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}],
              "loss": {"type": "cross_entropy", "config": {}},
              "gradient_accumulation": {"total_samples": 1, "total_active_tokens": 3, "total_advantage_tokens": 0}}
        index = 0

        def event(kind: str, payload: object, **meta: object) -> httpx.Response:
            nonlocal index
            index += 1
            envelope = {"version": 1, "event_id": f"event_{index:012d}", "type": kind, "payload": payload,
                        "metadata": {"index": index, "step": 0, "timestamp": 0, "sdk": "pytrio", "sdk_version": "0.2.9",
                                     "run_id": rid, **meta}}
            return http.post(f"/api/pytrio/{sid}/v1/events", content=msgpack.packb(envelope),
                             headers={"Content-Type": "application/msgpack"})

        check(event("trainer.init_run", init), "init")
        for kind, payload in (("trainer.forward_backward", fb), ("trainer.optimize_step", {"adam_params": {}}),
                              ("trainer.save_state", {"name": "fuzz"}), ("trainer.unknown", {})):
            for name in payload:
                for value in [*HOSTILE, ...]:
                    if isinstance(value, str) and "\ud800" in value:
                        continue
                    mutated = {k: v for k, v in payload.items() if k != name or value is not ...}
                    if value is not ...:
                        mutated[name] = value
                    check(event(kind, mutated), f"{kind} {name}={value!r:.40}")
        for junk in (b"", b"\x93\x01\x02", msgpack.packb([1, 2]), msgpack.packb({"payload": 1})):
            check(http.post(f"/api/pytrio/{sid}/v1/events", content=junk,
                            headers={"Content-Type": "application/msgpack"}), f"junk {junk!r:.20}")
        check(http.get(f"/api/pytrio/{sid}/v1/events/event_nope"), "unknown event")
        check(http.post(f"/api/pytrio/{sid}/v1/sampling-runs/{sid}:sample:99/sample", json={"prompt": {}}), "sample")
        assert any(a < 300 for a in answers) and any(a >= 400 for a in answers)


def test_sampling_runs_created_at_once_are_distinct(run):
    """PyTRIO numbers no sampling run itself: two created at once in one session are two samplers."""
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(base_url=run["url"], headers={"Authorization": f"Bearer {PYTRIO_KEY}"}, timeout=60) as http:
        sid = http.post("/api/openapi/v1/service-sessions", json={"sdk_version": "0.2.9"}).json()
        path = f"/api/openapi/v1/service-sessions/{sid['service_session_cuid']}/sampling-runs"
        with ThreadPoolExecutor(2) as threads:
            made = list(threads.map(lambda _: http.post(path, json={"base_model": "trio/tiny-llama-byte"}), range(2)))
    assert [m.status_code for m in made] == [200, 200], [m.text[:200] for m in made]
    assert len({m.json()["sampling_run_cuid"] for m in made}) == 2
