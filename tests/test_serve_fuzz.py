"""A seeded, time-bounded fuzzer against every route of a served pool (issue 36: no request gets a
500). Each route gets its valid request, then that request with each field replaced by a hostile
or boundary value, dropped, or the whole body replaced by junk; path parameters get the same.
Every answer must be a 2xx, or a 4xx whose JSON names the problem, and a neighbour on another key
keeps training throughout."""

from __future__ import annotations

import copy
import json
import os
import random
import threading
import time
from typing import Any
from urllib.parse import quote

import httpx
from served import served, wait_for

import trio_widgets as trio
from trio_widgets.http import wire

KEY, NEIGHBOUR = "tml-fuzzer-0001", "tml-fuzz-neighbour"
SEED = 20261205
# the whole fuzz, whatever the machine (the cases are shuffled: a slow run still covers routes);
# TRIO_FUZZ_BUDGET_S=600 runs every case (each test's seeded cases, in the same order)
BUDGET_S = float(os.environ.get("TRIO_FUZZ_BUDGET_S", 90.0))
# what a careless or hostile client puts in a field: wrong types, boundaries, huge and odd strings
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, float("nan"), float("inf"),
    "", " ", "x" * 5000, "../../etc/passwd", "tinker://", "tinker://a/weights/..", "tinker://r/weights/x/y",
    "sess-0123456789abcdef:train:0", "req-1", "\u0000", "\ud800", "é" * 300, "%00", "{}", [], [1, 2], [[]],
    {}, {"a": 1}, {"type": "x"}, [{"tokens": [1]}], {"chunks": None}, {"chunks": [{"type": "encoded_text"}]},
]
JUNK_BODIES: list[Any] = [None, [], "string", 7, [None], {"": ""}, {"model_id": {"$gt": ""}},
                          json.loads("[" * 50 + "]" * 50), {"a": {"b": {"c": {"d": list(range(200))}}}}]


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


class Neighbour(threading.Thread):
    """Another key's pipelined loop, counting its updates and anything that went wrong."""

    def __init__(self, url: str):
        super().__init__(name="test-fuzz-neighbour", daemon=True)
        self.service = trio.ServiceClient(base_url=url, api_key=NEIGHBOUR)
        self.tc = self.service.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        self.stop, self.updates, self.errors = threading.Event(), 0, []
        self.datum = trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.tc.forward_backward([self.datum], "cross_entropy")
                self.tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=120)
                self.updates += 1
            except Exception as exc:  # noqa: BLE001 - what the neighbour met is the result
                self.errors.append(repr(exc))
                return


def _settle(http: httpx.Client, answer: dict) -> dict:
    """A submitted request's result, long-polled."""
    for _ in range(200):
        r = http.post("/retrieve_future", json={"request_id": answer["request_id"]})
        if not r.headers.get("content-type", "").startswith("application/json"):
            return {"type": "protobuf result"}  # a forward's output (trio_widgets/http/wire.py)
        got = r.json()
        if got.get("type") != "try_again":
            return got
    raise AssertionError(f"no result for {answer}")


def _templates(http: httpx.Client) -> dict[tuple[str, str], dict]:
    """A valid body for each JSON route, naming a real session, model and sampler of KEY."""
    session = http.post("/create_session", json={"type": "create_session", "tags": [], "user_metadata": {},
                                                 "sdk_version": "fuzz"}).json()["session_id"]
    made = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                            "base_model": trio.DEFAULT_MODEL, "lora_config": {"rank": 2}}).json()
    model = _settle(http, made)["model_id"]
    sampler = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 1,
                                                          "base_model": trio.DEFAULT_MODEL}).json()
    sampler_id = sampler["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    return {
        ("POST", "/create_session"): {"type": "create_session", "tags": [], "user_metadata": {}, "sdk_version": "f"},
        ("POST", "/session_heartbeat"): {"session_id": session, "type": "session_heartbeat"},
        ("POST", "/create_model"): {"session_id": session, "model_seq_id": 7, "base_model": trio.DEFAULT_MODEL,
                                    "lora_config": {"rank": 2}},
        ("POST", "/get_info"): {"model_id": model},
        ("POST", "/optim_step"): {"model_id": model, "seq_id": 1,
                                  "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}},
        ("POST", "/save_weights"): {"model_id": model, "path": "fuzzed", "seq_id": 2},
        ("POST", "/save_weights_for_sampler"): {"model_id": model, "path": "fuzzed-w", "seq_id": 3,
                                                "sampling_session_seq_id": 9},
        ("POST", "/load_weights"): {"model_id": model, "path": f"tinker://{model}/weights/fuzzed", "seq_id": 4,
                                    "optimizer": False},
        ("POST", "/create_sampling_session"): {"session_id": session, "sampling_session_seq_id": 2,
                                               "base_model": trio.DEFAULT_MODEL},
        ("POST", "/asample"): {"sampling_session_id": sampler_id, "seq_id": 0, "prompt": prompt, "num_samples": 1,
                               "sampling_params": {"max_tokens": 2, "temperature": 1.0}},
        ("POST", "/retrieve_future"): {"request_id": made["request_id"]},
        ("POST", "/cancel_future"): {"request_id": made["request_id"]},
        ("POST", "/weights_info"): {"tinker_path": f"tinker://{model}/weights/fuzzed"},
        ("POST", "/save_weights_external"): {"model_id": model, "path": "fuzzed-x", "seq_id": 5},
        ("POST", "/trio/export_urls"): {"tinker_path": f"tinker://{model}/weights/fuzzed"},
        ("POST", "/trio/release"): {"model_id": model},
        ("POST", "/telemetry"): {"events": [], "session_id": session},
        ("POST", "/client/config"): {},
        ("POST", "/client/dynamic_config"): {},
        ("POST", "/create_custom_loss"): {"model_id": model},
        ("POST", "/auth/token"): {},
        ("POST", f"/sessions/{session}/finish"): {},
        ("PUT", f"/training_runs/{model}/checkpoints/weights/fuzzed/ttl"): {"ttl_seconds": 7200},
    } | {("GET", path): {} for path in [
        f"/samplers/{sampler_id}", "/get_server_capabilities", "/healthz", f"/training_runs/{model}/checkpoints",
        "/training_runs?limit=5&offset=0", f"/training_runs/{model}", "/checkpoints?limit=3",
        f"/training_runs/{model}/checkpoints/weights/fuzzed/external_weights_urls", "/trio/info",
        f"/trio/tokenizer?base_model={trio.DEFAULT_MODEL}", f"/trio/export/{model}/weights/fuzzed/adapter",
        f"/trio/export/{model}/weights/fuzzed/adapter?expires=abc&sig=zz",
        f"/trio/export/{model}/weights/fuzzed/adapter_model.safetensors?expires=99999999999999999999&sig=" + "0" * 64,
        ]} \
        | {("DELETE", f"/training_runs/{model}/checkpoints/weights/nothing"): {}}


def _path_variants(path: str, rng: random.Random) -> list[str]:
    """The path with each segment after the route's name replaced by odd text (URL-encoded)."""
    base, _, query = path.partition("?")
    parts = base.split("/")
    out = []
    for i in range(2, len(parts)):
        for value in rng.sample(["", "..", "%2e%2e", "x" * 3000, "%00", "%ff", "sess-zz:train:-1", "é", "a b"], 3):
            out.append("/".join(parts[:i] + [value] + parts[i + 1:]) + (f"?{query}" if query else ""))
    if query:
        for value in ["limit=-1", "limit=99999999999999999999", "offset=x", "base_model=%00", "limit=1e3"]:
            out.append(f"{base}?{value}")
    return out


def _places(value: Any, where: tuple = ()) -> list[tuple]:
    """The path (keys and indexes) of every value inside a JSON body, containers included."""
    out = [where] if where else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        out += _places(inner, (*where, key))
    return out


def _replaced(value: Any, where: tuple, new: Any) -> Any:
    if not where:
        return new
    head, rest = where[0], where[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    return [_replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]


def _forward_shapes(model: str, ids: list[str]) -> list[bytes]:
    """forward_backward bodies that parse as protobuf but say odd things, field by field."""
    import numpy as np

    def request(**edit: Any) -> bytes:
        msg = wire.PROTO.ForwardBackwardRequest(model_id=edit.get("model_id", model), seq_id=edit.get("seq_id", 6),
                                                loss_fn=edit.get("loss_fn", "cross_entropy"),
                                                forward_only=edit.get("forward_only", False))
        for key, value in edit.get("config", {}).items():
            msg.loss_fn_config[key] = value
        for tokens, inputs in edit.get("data", [([5, 6, 7], {"target_tokens": (2, [6, 7, 8])})]):
            out = msg.data.add()
            out.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
            for key, (dtype, values) in inputs.items():
                t = out.loss_fn_inputs[key]
                t.dtype = dtype
                t.dense = np.asarray(values, dtype={1: "<f4", 2: "<i8", 3: "<i4"}.get(dtype, "<f4")).tobytes()
                t.shape.extend(edit.get("shape", [len(values)]))
        return msg.SerializeToString()

    nan, inf = float("nan"), float("inf")
    shapes = [request(model_id=i) for i in ids] + [
        request(seq_id=-1), request(seq_id=2**31 - 1), request(loss_fn=""), request(loss_fn="ppo"),
        request(loss_fn="x" * 5000), request(forward_only=True), request(data=[]),
        request(config={"clip_low_threshold": nan, "clip_high_threshold": inf, "beta": -1e308}),
        request(data=[([], {"target_tokens": (2, [])})]), request(data=[([5, 6], {})]),
        request(data=[([5, 6], {"target_tokens": (2, [6])})]),
        request(data=[([-5, 2**31 - 1], {"target_tokens": (2, [6, 7])})]),
        request(data=[([5, 6], {"target_tokens": (2, [-100, 2**40])})]),
        request(data=[([5, 6], {"target_tokens": (1, [nan, inf])})]),
        request(data=[([5, 6], {"target_tokens": (2, [6, 7]), "weights": (1, [nan, -inf])})]),
        request(data=[([5, 6], {"target_tokens": (2, [6, 7]), "weights": (2, [1, 1])})]),
        request(data=[([5, 6], {"target_tokens": (9, [6, 7])})]), request(shape=[2, 2]), request(shape=[0]),
        request(shape=[-1]), request(shape=[2**40]),
        request(data=[([5, 6], {"target_tokens": (2, [6, 7]), "logprobs": (1, [0.0]), "advantages": (1, [1, 2])})]),
        request(loss_fn="importance_sampling", data=[([5, 6], {"target_tokens": (2, [6, 7])})]),
        request(data=[([5] * 20000, {"target_tokens": (2, [6] * 20000)})]),
        request(data=[([5, 6], {"target_tokens": (2, [6, 7])})] * 5000),
    ]
    return shapes


def _cases(templates: dict[tuple[str, str], dict], rng: random.Random) -> list[tuple[str, str, bytes, str]]:
    cases: list[tuple[str, str, bytes, str]] = []
    # the real ids, each put where another kind is expected (a sampler's id as a model's, ...)
    ids = sorted({v for body in templates.values() for k, v in body.items()
                  if isinstance(v, str) and (k.endswith("_id") or v.startswith("tinker://"))})
    values = VALUES + ids
    for (method, path), body in templates.items():
        for variant in _path_variants(path, rng):
            cases.append((method, variant, _json(body), "application/json"))
        if method not in ("POST", "PUT"):
            continue
        for key in body:
            cases.append((method, path, _json({k: v for k, v in body.items() if k != key}), "application/json"))
        for where in _places(body):  # every value at any depth, replaced by each hostile one
            for value in (values if len(where) == 1 else rng.sample(values, 16)):
                cases.append((method, path, _json(_replaced(body, where, value)), "application/json"))
        for junk in JUNK_BODIES:
            cases.append((method, path, _json(junk), "application/json"))
        cases.append((method, path, b"{not json", "application/json"))
        cases.append((method, path, b"\xff\xfe" * 10, "application/json"))
        cases.append((method, path, _json(body), "application/x-protobuf"))  # a JSON body said to be protobuf
        cases.append((method, path, _json(body), "application/json; charset=latin-1"))
        cases.append(("PATCH", path, _json(body), "application/json"))
    for junk in [*JUNK_BODIES, {"model_id": ids[0]}]:  # forward_backward as JSON: tinker's SDK sends protobuf
        cases.append(("POST", "/forward_backward", _json(junk), "application/json"))
    # forward_backward's protobuf body: random bytes, truncations and a valid one's mutations
    model = next(b["model_id"] for (_m, p), b in templates.items() if p == "/get_info")
    valid = wire.encode_forward_request(model, 6, [trio.Datum(trio.ModelInput.from_ints([5, 6]),
                                                              {"target_tokens": [6, 7]})], "cross_entropy", None,
                                       False)
    for i in range(60):
        blob = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        cases.append(("POST", "/forward_backward", bytes(blob[: rng.randint(0, len(blob))] if i % 3 == 0 else blob),
                      "application/x-protobuf"))
    cases.append(("POST", "/forward_backward", b"", "application/x-protobuf"))
    for blob in _forward_shapes(model, ids):
        cases.append(("POST", "/forward_backward", blob, "application/x-protobuf"))
    rng.shuffle(cases)
    # what ends the session or its model runs last: before, every other case names live ids
    ending = ("/trio/release", "/finish", "DELETE")
    return sorted(cases, key=lambda c: any(e in c[1] or e == c[0] for e in ending))


def test_no_request_gets_a_500_and_a_neighbour_keeps_training(tmp_path):
    rng = random.Random(SEED)
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path / "ckpt"), name="fuzz") as pool, \
            served(pool, api_keys=[KEY, NEIGHBOUR], observer_keys=[KEY], long_poll_s=0.2,
                   reorder_wait_s=0.2) as server, \
            httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        cases = _cases(_templates(http), rng)
        neighbour = Neighbour(server.url)
        neighbour.start()
        answered: dict[int, int] = {}
        bad: list[str] = []
        deadline = time.monotonic() + BUDGET_S
        sent = 0
        futures: list[tuple[str, str]] = []
        try:
            for method, path, body, ctype in cases:
                if time.monotonic() > deadline:
                    break
                r = http.request(method, path, content=body if method in ("POST", "PUT") else None,
                                 headers={"Content-Type": ctype})
                sent += 1
                answered[r.status_code] = answered.get(r.status_code, 0) + 1
                if r.status_code >= 500 or (r.status_code >= 400 and "detail" not in r.text):
                    bad.append(f"{r.status_code} {method} {path[:120]} {body[:200]!r}: {r.text[:300]}")
                elif r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json") \
                        and path != "/retrieve_future" and isinstance(r.json(), dict) and "request_id" in r.json():
                    futures.append((r.json()["request_id"], f"{method} {path[:120]} {body[:200]!r}"))
            # what a request accepted at submit came to: a failure is the user's (4xx-like), never a server error
            for request_id, what in futures:
                if time.monotonic() > deadline + 60:
                    break
                got = _settle(http, {"request_id": request_id})
                if got.get("category") == "server" or (got.get("error") and not got.get("category")):
                    bad.append(f"future of {what}: {json.dumps(got)[:300]}")
            before = neighbour.updates
            wait_for(lambda: neighbour.updates > before or bool(neighbour.errors), "the neighbour's next update", 120)
        finally:
            neighbour.stop.set()
            neighbour.join(120)
            neighbour.service.close()
        assert not bad, f"{len(bad)} of {sent} answers were a 5xx or a 4xx without a detail:\n" + "\n".join(bad[:15])
        assert sent >= min(len(cases), 300), f"only {sent} of {len(cases)} cases ran in {BUDGET_S} s"
        assert not neighbour.errors and neighbour.updates > 0, (neighbour.errors, neighbour.updates)
        assert answered.get(200, 0) > 0 and sum(v for k, v in answered.items() if 400 <= k < 500) > 0, answered
        assert http.get("/healthz").status_code == 200


# -- PyTRIO's wire (trio_widgets/http/pytrio_wire.py): its control plane and its actor ---------

PYTRIO_BUDGET_S = float(os.environ.get("TRIO_FUZZ_BUDGET_S", 20.0))
CONTROL, ACTOR = "/api/openapi/v1", "/api/pytrio"
MSGPACK = "application/msgpack"


def _msgpack_values() -> list[Any]:
    """What only MessagePack carries: bytes, an ext type, integers at its ends, keys that are not text."""
    import msgpack

    return [b"", b"\x00\xff" * 8, 2**64 - 1, -(2**63), msgpack.ExtType(5, b"x"), {b"k": 1}, {"": {b"": b""}},
            [[[[[[[[[[[]]]]]]]]]]], list(range(300))]


class _Event:
    """An event envelope, numbered when sent: each one gets the next free `metadata.index` and a fresh
    `event_id` (so a valid one runs) unless the case fuzzed that very field; an init_run event gets a
    training run made for it on the control plane (its reserved slot), unless it fuzzed the run id."""

    def __init__(self, envelope: dict, where: tuple = ()):
        self.envelope, self.where = envelope, where

    def body(self, fuzz: PyTrioFuzz) -> bytes | None:
        import msgpack

        envelope = copy.deepcopy(self.envelope)
        if isinstance(envelope, dict) and isinstance(envelope.get("metadata"), dict):
            meta = dict(envelope["metadata"])
            fuzzed = self.where[:2]
            if fuzzed != ("metadata", "index") and self.where != ("metadata",):
                fuzz.index += 1
                meta["index"] = fuzz.index
            if fuzzed != ("metadata", "run_id") and envelope.get("type") == "trainer.init_run":
                meta["run_id"] = fuzz.fresh_run()
            envelope["metadata"] = meta
        if isinstance(envelope, dict) and self.where[:1] != ("event_id",):
            fuzz.events += 1
            envelope["event_id"] = f"event_{fuzz.events:012d}"
        try:  # (\ud800 goes as invalid UTF-8)
            return msgpack.packb(envelope, use_bin_type=True, unicode_errors="surrogatepass")
        except OverflowError:  # an integer MessagePack cannot carry (10**30): no such request exists
            return None


class PyTrioFuzz:
    def __init__(self, http: httpx.Client, model: str):
        self.http, self.model, self.index, self.events = http, model, 0, 0
        s = self.session = http.post(f"{CONTROL}/service-sessions", json={"sdk_version": "fuzz"}).json()
        sid = self.sid = s["service_session_cuid"]
        # a second session for runs made per init_run case (the first one's clients stay few)
        self.spare = http.post(f"{CONTROL}/service-sessions", json={}).json()["service_session_cuid"]
        made = http.post(f"{CONTROL}/service-sessions/{sid}/training-runs", json={"base_model": model}).json()
        self.run = made["training_run_cuid"]
        init = self.envelope("trainer.init_run", {"base_model": model, "lora_config": {"rank": 2, "seed": 0}})
        init["metadata"]["index"] = 0
        self.wait(self.send(init, self.run))
        self.index = 0
        first = self.send(self.envelope("trainer.save_state", {"name": "fuzzed"}))
        self.wait(first)
        second = self.send(self.envelope("trainer.save_weights", {"name": "fuzzed-w"}))
        self.wait(second)
        self.event = first
        self.checkpoint = f"tinker://{self.run}/weights/fuzzed"
        self.sampler = http.post(f"{CONTROL}/service-sessions/{sid}/sampling-runs",
                                 json={"base_model": model}).json()["sampling_run_cuid"]

    def envelope(self, kind: str, payload: Any) -> dict:
        return {"version": 1, "event_id": "", "type": kind, "payload": payload,
                "metadata": {"index": 0, "step": 0, "timestamp": 0, "sdk": "pytrio", "sdk_version": "0.2.9",
                             "run_id": self.run}}

    def send(self, envelope: dict, run: str | None = None) -> str:
        import msgpack

        self.events += 1
        envelope = {**envelope, "event_id": f"event_{self.events:012d}",
                    "metadata": {**envelope["metadata"], "run_id": run or self.run}}
        if envelope["type"] != "trainer.init_run":
            self.index += 1
            envelope["metadata"]["index"] = self.index
        r = self.http.post(f"{ACTOR}/{self.sid}/v1/events", content=msgpack.packb(envelope),
                           headers={"Content-Type": MSGPACK})
        assert r.status_code == 200, r.text
        return envelope["event_id"]

    def wait(self, event_id: str) -> dict:
        import msgpack

        for _ in range(100):
            got = msgpack.unpackb(self.http.get(f"{ACTOR}/{self.sid}/v1/events/{event_id}",
                                                headers={"Prefer": "wait=1"}).content)
            if got["status"] != "accepted":
                assert got["status"] == "succeeded", got
                return got
        raise AssertionError(f"event {event_id} never ended")

    def fresh_run(self) -> str:
        try:
            r = self.http.post(f"{CONTROL}/service-sessions/{self.spare}/training-runs",
                               json={"base_model": self.model})
        except httpx.TransportError as exc:
            return f"no-run ({exc!r})"
        return r.json().get("training_run_cuid", "no-run") if r.status_code == 200 else "no-run"

    def templates(self) -> dict[tuple[str, str], Any]:
        """A valid request for each PyTRIO route (a JSON body, or an event envelope for the actor)."""
        c, a, sid, run, ckpt = CONTROL, f"{ACTOR}/{self.sid}/v1", self.sid, self.run, self.checkpoint
        cuid = f"{run}~weights~fuzzed"
        datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}, "target_ids": [6, 7, 8],
                 "weights": [1.0, 1.0, 1.0]}
        forward = {"data": [datum], "loss": {"type": "cross_entropy", "config": {}}, "auto_shift": False}
        events = {
            "trainer.init_run": {"base_model": self.model, "lora_config": {"rank": 2, "seed": 1, "train_mlp": True},
                                 "user_metadata": {"a": "b"}, "checkpoint_uri": None},
            "trainer.forward": forward,
            "trainer.forward_backward": forward,
            "trainer.optimize_step": {"adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95,
                                                      "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}},
            "trainer.save_state": {"name": "fuzzed-s", "overwrite": True, "ttl_seconds": 3600, "metadata": {"a": 1}},
            "trainer.save_weights": {"name": "fuzzed-ws", "overwrite": True},
        }
        out: dict[tuple[str, str], Any] = {
            ("GET", f"{c}/api-key/verify"): None, ("GET", "/api/sdk/bootstrap?sdk_version=0.2.9"): None,
            ("GET", "/api/models"): None,
            ("POST", f"{c}/service-sessions"): {"sdk_version": "0.2.9", "user_metadata": {"a": "b"}},
            ("GET", f"{c}/service-sessions?limit=5&offset=0"): None, ("GET", f"{c}/service-sessions/{sid}"): None,
            ("POST", f"{c}/service-sessions/{sid}/renew"): {},
            ("POST", f"{c}/service-sessions/{sid}/training-runs"): {"base_model": self.model, "lora_rank": 2,
                                                                    "source_checkpoint_uri": ""},
            ("PATCH", f"{c}/service-sessions/{sid}/training-runs/{run}"): {"source_checkpoint_uri": ckpt,
                                                                          "restore_optimizer": False},
            ("POST", f"{c}/service-sessions/{sid}/sampling-runs"): {"base_model": self.model,
                                                                    "source_checkpoint_uri": ""},
            ("GET", f"{c}/training-runs/by-checkpoint-uri?checkpoint_uri={ckpt}"): None,
            ("GET", f"{c}/training-runs?limit=5&offset=0"): None, ("GET", f"{c}/training-runs/{run}"): None,
            ("POST", f"{c}/training-runs/{run}/renew"): {}, ("GET", f"{c}/training-runs/{run}/checkpoints"): None,
            ("GET", f"{c}/sampling-runs/{self.sampler}"): None, ("POST", f"{c}/sampling-runs/{self.sampler}/renew"): {},
            ("GET", f"{c}/checkpoints?limit=3&offset=0"): None, ("GET", f"{c}/checkpoints/{cuid}/download-url"): None,
            ("GET", f"{a}/events/{self.event}"): None,
            ("POST", f"{a}/sampling-runs/{self.sampler}/sample"): {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}, "num_samples": 1,
                "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 3, "stop": None},
                "return_text": True, "return_token_logprobs": True, "topk_prompt_logprobs": 0, "request_id": "r"},
            ("POST", f"{a}/client/heartbeat"): {},
            # no such endpoint: another method on a known path, a path under the prefixes that is none
            ("PUT", f"{c}/service-sessions"): {}, ("GET", f"{a}/events"): None, ("GET", f"{c}/no/such/{sid}"): None,
            # what ends things runs last (see _cases)
            ("POST", f"{c}/service-sessions/{sid}/close"): {},
            ("DELETE", f"{c}/checkpoints/{run}~sampler_weights~fuzzed-w"): None,
        }
        for kind, payload in events.items():
            out[("POST", f"{a}/events#{kind}")] = _Event(self.envelope(kind, payload))
        return out

    def cases(self, rng: random.Random) -> tuple[list[tuple[str, str, Any, str]], list[tuple[str, str, Any, str]]]:
        cases: list[tuple[str, str, Any, str]] = []
        ids = [self.sid, self.run, self.sampler, self.checkpoint, self.event, f"{self.run}~weights~fuzzed"]
        values = VALUES + ids
        mvalues = values + _msgpack_values()
        for (method, path), body in self.templates().items():
            path, _, kind = path.partition("#")
            json_ctype = "application/json"
            first = kind in ("", "trainer.forward_backward")  # the envelope's own fields: fully for one type
            for variant in _path_variants(path, rng) if first else ():
                content = body if isinstance(body, _Event) else None if body is None else _json(body)
                cases.append((method, variant, content, MSGPACK if isinstance(body, _Event) else json_ctype))
            if isinstance(body, _Event):
                for where in _places(body.envelope):
                    full = len(where) <= 2 if where[0] == "payload" else first and len(where) <= 2
                    for value in mvalues if full else rng.sample(mvalues, 6 if where[0] == "payload" else 3):
                        cases.append((method, path, _Event(_replaced(body.envelope, where, value), where), MSGPACK))
                for key in body.envelope:
                    cases.append((method, path, _Event({k: v for k, v in body.envelope.items() if k != key},
                                                       (key,)), MSGPACK))
                import msgpack

                for junk in [*JUNK_BODIES, *_msgpack_values()]:
                    cases.append((method, path, msgpack.packb(junk, use_bin_type=True), MSGPACK))
                for raw in (b"", b"\xc1", b"\x93\x01\x02", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff" + b"a" * 9,
                            b"\x91" * 2000 + b"\xc0", _json(body.envelope)):
                    cases.append((method, path, raw, MSGPACK))
                cases.append((method, path, _Event(body.envelope), json_ctype))  # msgpack said to be JSON
                cases.append((method, path, _Event(body.envelope), "application/msgpack; charset=x"))
                continue
            if body is None:  # a GET or DELETE: a body it does not expect, and the wrong method
                cases.append((method, path, b"\xff" * 10, json_ctype))
                cases.append(("PUT", path, b"{}", json_ctype))
                continue
            for key in body:
                cases.append((method, path, _json({k: v for k, v in body.items() if k != key}), json_ctype))
            for where in _places(body):
                for value in (values if len(where) == 1 else rng.sample(values, 12)):
                    cases.append((method, path, _json(_replaced(body, where, value)), json_ctype))
            for junk in JUNK_BODIES:
                cases.append((method, path, _json(junk), json_ctype))
            cases.append((method, path, b"{not json", json_ctype))
            cases.append((method, path, b"\xff\xfe" * 10, json_ctype))
            cases.append((method, path, _json(body), MSGPACK))  # a JSON body said to be MessagePack
            cases.append(("DELETE", path, None, json_ctype))
        rng.shuffle(cases)
        ends = [c for c in cases if "/close" in c[1] or c[0] == "DELETE"]
        return [c for c in cases if c not in ends], ends


def test_no_pytrio_request_gets_a_500_and_a_neighbour_keeps_training(tmp_path):
    """PyTRIO's codec under the same fuzz: every control-plane route and every actor route, event
    envelopes (MessagePack) with each field, at any depth, replaced, dropped or the whole body junk.
    Every answer is a 2xx or a 4xx whose JSON says what is wrong (`message`), an event accepted
    fails as the user's (never `internal`), and a Tinker neighbour on another key trains throughout."""
    import msgpack

    rng = random.Random(SEED + 1)
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path / "ckpt"), name="fuzz-pytrio") as pool, \
            served(pool, api_keys=[KEY, NEIGHBOUR], long_poll_s=0.2, reorder_wait_s=0.2) as server, \
            httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        fuzz = PyTrioFuzz(http, trio.DEFAULT_MODEL)
        cases, ending = fuzz.cases(rng)
        neighbour = Neighbour(server.url)
        neighbour.start()
        answered: dict[int, int] = {}
        bad: list[str] = []
        accepted: list[tuple[str, str]] = []

        def send(method: str, path: str, body: Any, ctype: str) -> None:
            content = body.body(fuzz) if isinstance(body, _Event) else body
            if isinstance(body, _Event) and content is None:
                return
            what = f"{method} {path[:120]} {content[:200]!r}" if content else f"{method} {path[:120]}"
            try:
                r = http.request(method, path, content=content, headers={"Content-Type": ctype})
            except httpx.TransportError as exc:  # no answer at all
                bad.append(f"{what}: {exc!r}")
                return
            answered[r.status_code] = answered.get(r.status_code, 0) + 1
            what = f"{r.status_code} {what}"
            # under PyTRIO's prefixes, in PyTRIO's shape (its SDK reads code and message), odd paths too
            sent_to = r.request.url.path  # (httpx resolves a '..' segment before sending)
            ours = sent_to in (CONTROL, ACTOR) or sent_to.startswith((CONTROL + "/", ACTOR + "/"))
            if r.status_code >= 500 or r.status_code >= 400 and not (
                    r.headers.get("content-type", "").startswith("application/json")
                    and isinstance(r.json(), dict)
                    and ((r.json().get("message") and r.json().get("code")) if ours
                         else (r.json().get("message") or r.json().get("detail")))):
                bad.append(f"{what}: {r.text[:300]}")
            elif r.status_code == 200 and r.headers.get("content-type", "").startswith(MSGPACK):
                got = msgpack.unpackb(r.content)
                if got.get("status") == "accepted":
                    accepted.append((got["event_id"], what))
                elif got.get("status") == "failed" and got["error"]["code"] == "internal":
                    bad.append(f"{what}: {got}")

        deadline = time.monotonic() + PYTRIO_BUDGET_S
        try:
            for case in cases:
                if time.monotonic() > deadline:
                    break
                send(*case)
            # what accepted events came to (a seeded sample): a failure is the user's, never the server's
            for event_id, what in rng.sample(accepted, min(len(accepted), 100)):
                if time.monotonic() > deadline + 4:
                    break
                r = http.get(f"{ACTOR}/{fuzz.sid}/v1/events/{quote(event_id, safe='')}", headers={"Prefer": "wait=1"})
                got = msgpack.unpackb(r.content) if r.status_code == 200 else r.json()
                if r.status_code >= 500 or got.get("status") == "failed" and got["error"]["code"] == "internal":
                    bad.append(f"event of {what}: {got}")
            # then what ends the session or deletes a checkpoint (before, every case named live ids)
            for case in ending:
                if time.monotonic() > deadline + 10:
                    break
                send(*case)
            before = neighbour.updates
            wait_for(lambda: neighbour.updates > before or bool(neighbour.errors), "the neighbour's next update", 120)
        finally:
            neighbour.stop.set()
            neighbour.join(120)
            neighbour.service.close()
        sent = sum(answered.values())
        print(f"PyTRIO fuzz: {sent} of {len(cases) + len(ending)} cases answered, {answered}; "
              f"{len(accepted)} events accepted; the neighbour made {neighbour.updates} updates")
        assert not bad, f"{len(bad)} of {sent} answers were a 5xx or a 4xx without a message:\n" + "\n".join(bad[:15])
        assert sent >= min(len(cases), 300), f"only {sent} of {len(cases) + len(ending)} cases in {PYTRIO_BUDGET_S} s"
        assert not neighbour.errors and neighbour.updates > 0, (neighbour.errors, neighbour.updates)
        assert answered.get(200, 0) > 0 and sum(v for k, v in answered.items() if 400 <= k < 500) > 0, answered
        assert http.get("/api/v1/healthz").status_code == 200
