"""The seam between client and engine: what crosses it is plain data, and an op is one row of
the op table plus its prepare/run pair."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from typing import Any

import pytest

import trio_widgets as trio
import trio_widgets.backend as backend
from trio_widgets import ops
from trio_widgets.engine import handlers
from trio_widgets.engine.tenants import Prepared

# Every class a request may contain. Decoding looks names up here only: nothing from the
# wire is evaluated or unpickled.
PLAIN = {cls.__name__: cls for cls in (
    trio.Datum, trio.ModelInput, trio.EncodedTextChunk, trio.TensorData, trio.AdamParams, trio.SamplingParams,
    backend.CreateModelRequest, backend.FromStateRequest, backend.CreateSamplerRequest, backend.ModelHandle,
    backend.ForwardRequest, backend.OptimStepRequest, backend.SaveRequest, backend.LoadRequest,
    backend.InspectRequest, backend.SampleRequest, backend.ComputeLogprobsRequest, backend.SamplerCreated)}


def encode(value: Any) -> Any:
    """JSON-able form of plain data; anything else (a tensor, a callable, an engine object) fails."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value), f"non-string keys in {value!r}"
        return {k: encode(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and type(value).__name__ in PLAIN:
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"__type__": type(value).__name__, **fields}
    raise TypeError(f"not plain data: {type(value).__module__}.{type(value).__name__}")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__type__" in value:
            cls = PLAIN[value["__type__"]]
            return cls(**{k: decode(v) for k, v in value.items() if k != "__type__"})
        return {k: decode(v) for k, v in value.items()}
    return value


def datum(n: int) -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints(list(range(3, 3 + n))),
                      loss_fn_inputs={"target_tokens": list(range(4, 4 + n)), "weights": [0.5] * n})


EXAMPLES = [
    backend.CreateModelRequest(trio.DEFAULT_MODEL, rank=8, seed=3, train_mlp=False, label="run",
                               user_metadata={"team": "a"}),
    backend.FromStateRequest("/tmp/ckpt", with_optimizer=True, label=None),
    backend.FromStateRequest("tinker://run/weights/x", with_optimizer=False, base_model=trio.DEFAULT_MODEL,
                             user_metadata={"name": "resumed"}),
    backend.CreateSamplerRequest(model_path=None, base_model=trio.DEFAULT_MODEL, label="s"),
    backend.ForwardRequest([datum(5), datum(3)], "ppo", {"clip_low_threshold": 0.9}),
    backend.OptimStepRequest(trio.AdamParams(learning_rate=3e-3, weight_decay=0.01)),
    backend.SaveRequest("step-10", make_sampler=True, label="sampler"),
    backend.SaveRequest("step-11", overwrite=False, ttl_seconds=3600, user_metadata={"step": "11"}),
    backend.LoadRequest("/tmp/ckpt"),
    backend.InspectRequest(),
    backend.SampleRequest(trio.ModelInput.from_ints([5, 6, 7]), 3,
                          trio.SamplingParams(max_tokens=4, temperature=0.7, stop=["\n"], seed=1), True),
    backend.SampleRequest(trio.ModelInput.from_ints([5, 6, 7]), 1, None, True, topk_prompt_logprobs=3,
                          topk_sample_logprobs=2, prompt_logprobs_last_n=1,
                          target_prompt_logprobs=trio.TensorData([[6, -1], [7, 8]]), prompt_alt_tokens_k=4),
    backend.ComputeLogprobsRequest(trio.ModelInput.from_ints([5, 6, 7])),
    backend.ComputeLogprobsRequest(trio.ModelInput.from_ints([5, 6, 7]), prompt_logprobs_last_n=2),
    backend.SamplerCreated(backend.ModelHandle("sampler-1", trio.DEFAULT_MODEL, 8, 32.0, 3), path=None),
    backend.ModelHandle("lora-2", trio.DEFAULT_MODEL, 8, 16.0, 3, True, True, False, None, run_id="lora-2-ab12cd34",
                        arch="llama", context_length=512),
]


def test_every_request_type_is_in_the_examples():
    requests = {name for name in backend.__all__ if name.endswith(("Request", "Handle", "Created"))
                and not (isinstance(getattr(backend, name), type) and issubclass(getattr(backend, name), backend.Call))}
    assert requests == {type(e).__name__ for e in EXAMPLES} | {"ModelHandle", "Request"}
    # the union a backend's submit takes: every request type of a client's ops
    assert set(typing.get_args(backend.Request)) == {type(e) for e in EXAMPLES if type(e).__name__ in {
        "ForwardRequest", "OptimStepRequest", "SaveRequest", "LoadRequest", "InspectRequest", "SampleRequest",
        "ComputeLogprobsRequest"}}


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda e: type(e).__name__)
def test_requests_round_trip_through_json(request_):
    text = json.dumps(encode(request_))
    assert decode(json.loads(text)) == request_


def test_engine_objects_are_not_plain_data():
    import torch

    with pytest.raises(TypeError, match="not plain data"):
        encode(backend.ForwardRequest([datum(2)], "cross_entropy", {"x": torch.tensor(1.0)}))


def test_every_op_has_its_prepare_and_run():
    for name, row in ops.OPS.items():
        pair = handlers.HANDLERS[row.handler]
        assert callable(pair.prepare) and callable(pair.run), name
    assert ops.UPDATE_OPS == {"forward_backward", "forward_backward_custom"}
    assert [name for name, row in ops.OPS.items() if row.is_step] == ["optim_step"]


def test_a_new_op_is_a_row_and_its_handlers(monkeypatch):
    """What adding an op takes: a row in trio_widgets/ops.py and its prepare/run pair in the
    HANDLERS registry of trio_widgets/engine/handlers.py (the client method is the only other piece)."""
    row = ops.OpSpec("echo_norm", "state", "echo_norm", "#123456", "echo norm")
    monkeypatch.setitem(ops.OPS, "echo_norm", row)

    def prepare_echo_norm(pool, tenant, op, request):
        return Prepared(request)

    def run_echo_norm(pool, tenant, request):
        return {"asked": request.payload, "rank": tenant.rank}

    monkeypatch.setitem(handlers.HANDLERS, "echo_norm", handlers.OpHandlers(prepare_echo_norm, run_echo_norm))
    with trio.LocalPool(min_cycle_s=0.0, name="new-op") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        future = pool.submit(tc.client_id, "echo_norm", "hello")
        assert future.result(timeout=60) == {"asked": "hello", "rank": 4}
        record = next(r for r in pool.telemetry.requests_of(tc.client_id) if r.op == "echo_norm")
        assert record.status == "ok" and record.cycle == future.cycle
    assert ops.op_color("echo_norm") == "#123456"


def test_an_op_without_handlers_is_refused_when_the_pool_is_built(monkeypatch):
    monkeypatch.setitem(ops.OPS, "orphan", ops.OpSpec("orphan", "state", "orphan", "#000000", "orphan"))
    with pytest.raises(RuntimeError, match="HANDLERS has no entry 'orphan'"):
        trio.LocalPool(min_cycle_s=0.0, name="orphan-op")


# -- the one narrow seam: every transport calls these, and nothing else of the engine --------------------

SEAM = {"name", "session_id", "pool", "open", "submit", "reserve", "release", "call", "run_in_background", "close"}
CALLS = [getattr(backend, n) for n in backend.__all__
         if isinstance(getattr(backend, n), type) and issubclass(getattr(backend, n), backend.Call)
         and getattr(backend, n) is not backend.Call]


def _members(protocol: type) -> set[str]:
    return {n for n in {*vars(protocol), *typing.get_type_hints(protocol)}
            if not n.startswith("_") and n not in ("mro",)}


def test_the_seam_has_ten_members():
    assert _members(backend.Backend) == SEAM  # httpx's transport has 2; ours: make, run, let go, ask, close


@pytest.mark.parametrize("cls", ["trio_widgets.engine.backend:LocalBackend", "trio_widgets.http.client:HttpBackend"])
def test_each_backend_is_the_seam_and_answers_every_call(cls):
    import importlib

    module, name = cls.split(":")
    impl = getattr(importlib.import_module(module), name)
    for member in SEAM - {"name", "session_id", "pool"}:
        assert callable(getattr(impl, member)), member
    # what only the engine answers: the directory on the pool's machine, its session table, a server's state
    engine_only = {backend.CheckpointDir, backend.OpenSession, backend.ServedTables}
    for call in CALLS:
        method = getattr(impl, f"_on_{call.verb}", None)
        if name == "HttpBackend" and call in engine_only:
            assert method is None, call
            continue
        assert callable(method), f"{name} does not answer {call.__name__}"
        # the call's fields are the method's keywords
        params = set(inspect.signature(method).parameters) - {"self"}
        assert {f.name for f in dataclasses.fields(call)} <= params, call
    for request, maker in backend._OPENS.items():
        assert callable(getattr(impl, maker)), (name, request)


def test_a_call_nobody_answers_is_refused_by_name():
    with trio.LocalPool(min_cycle_s=0.0, name="seam-calls") as pool:
        local = pool.connect(session=False)
        with pytest.raises(TypeError, match="Call types, got str"):
            local.call("capabilities")
        with pytest.raises(TypeError, match="open\\(\\) takes a CreateModelRequest"):
            local.open(backend.SupportedModels())
        assert trio.DEFAULT_MODEL in local.call(backend.SupportedModels())
        assert local.call(backend.IsBaseModel(trio.DEFAULT_MODEL)) is True
        assert local.call(backend.IsCheckpoint("/nonexistent/x")) is False


_CODECS = ["trio_widgets/http/service.py", "trio_widgets/http/routes.py", "trio_widgets/http/pytrio_wire.py"]


@pytest.mark.parametrize("path", _CODECS)
def test_a_codec_reaches_the_engine_only_through_the_seam(path):
    """The Tinker wire codec imports nothing of the engine, and the only methods it calls on a
    backend (`self.backend`, `s.backend`, the key's `self.of(owner)`) are the seam's."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent.parent / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert "engine" not in (node.module or ""), f"{path} imports {node.module}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            is_backend = (isinstance(target, ast.Attribute) and target.attr == "backend") or \
                (isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "of")
            if is_backend:
                assert node.func.attr in SEAM, f"{path}:{node.lineno} calls backend.{node.func.attr}"


def test_the_tinker_binding_is_a_codec_over_the_engines_served_state():
    """Issue 31: the Tinker server binding (routes plus codec; the guard, auth and the event stream
    apart) is at most 600 lines, and keeps no table of sessions, runs, samplers or futures: those
    are the engine's served state (engine/served.py), which it asks through the seam (ServedTables)."""
    import ast
    from pathlib import Path

    http = Path(__file__).parent.parent / "trio_widgets" / "http"
    lines = {name: len((http / name).read_text().splitlines()) for name in ("service.py", "routes.py")}
    assert sum(lines.values()) <= 600, lines
    tables = {"sessions", "trained", "samplers", "entries", "unretrieved", "lanes", "aliases", "seen"}
    for name in _CODECS:
        tree = ast.parse((http.parent.parent / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        assert target.attr not in tables, f"{name}:{node.lineno} keeps a table: self.{target.attr}"


@pytest.mark.parametrize("path", [p for p in _CODECS if not p.endswith("service.py")])
def test_a_codecs_catalog_work_is_paced_per_key(path):
    """Issue 36: a key's listings, deletes, exports and tokenizer files go to the catalog's thread
    through Service.catalog (one guard.Pace per key for both codecs), never straight to
    state.off_loop: a key cannot double its share of that thread, and its GIL, by using both wires."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent.parent / path).read_text())
    direct = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "off_loop"]
    assert direct == [], f"{path} reaches the catalog's thread unpaced at lines {direct}"
    paced = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "catalog"
             and isinstance(node.value, ast.Attribute | ast.Name)]
    assert paced, f"{path} names no catalog work at all: this test no longer reads it"


def test_one_keys_catalog_jobs_run_one_at_a_time_and_rest_another_keys_do_not_wait():
    """guard.Pace: a key's next job starts no sooner than the last one took after it ended, and
    never beside it; another key's job starts at once (lower bounds and orders only: a loaded
    machine can only make the rests longer)."""
    import asyncio
    import time

    from trio_widgets.http.guard import Pace

    events: list[tuple[str, str, float]] = []

    async def job(name: str, seconds: float) -> str:
        events.append(("start", name, time.monotonic()))
        await asyncio.sleep(seconds)
        events.append(("end", name, time.monotonic()))
        return name

    async def main() -> list[str]:
        pace = Pace()
        a = [pace.run("ada", lambda i=i: job(f"ada{i}", 0.2)) for i in range(3)]
        b = pace.run("bob", lambda: job("bob", 0.01))
        return await asyncio.gather(*a, b)

    assert asyncio.run(main()) == ["ada0", "ada1", "ada2", "bob"]  # each job's own answer
    at = {(kind, name): t for kind, name, t in events}
    for i in (1, 2):
        took = at[("end", f"ada{i - 1}")] - at[("start", f"ada{i - 1}")]
        assert at[("start", f"ada{i}")] >= at[("end", f"ada{i - 1}")] + took, events
    assert at[("start", "bob")] < at[("end", "ada0")], events  # bob did not queue behind ada
    order = [(kind, name) for kind, name, _ in events if name.startswith("ada")]
    assert order == [(k, f"ada{i}") for i in range(3) for k in ("start", "end")], events
