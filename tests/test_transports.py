"""One behaviour, two transports: the same client code and the same assertions, in-process
(`ServiceClient(pool)`) and over HTTP (`ServiceClient(base_url=...)` against the same pool
served on 127.0.0.1). Each rule (overwrite, TTL, run ids, sessions, error classes) lives in one
place; a difference between the transports fails here. What still differs, and why, is the
allow-list DIFFERENCES in tests/transports.py; a test here checks that each listed difference still exists, so the
list cannot go stale."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from served import served
from transports import DIFFERENCES, IN_PROCESS
from transports import service as transport_service

import trio_widgets as trio
from trio_widgets.engine import checkpoints as ckpt
from trio_widgets.errors import ResourceNotFoundError
from trio_widgets.protocol import ERRORS, error_from_wire, names, parse_tinker_path, wire_error

KEY = "tml-transports"
ADAM = trio.AdamParams(learning_rate=1e-2)
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom"]


def datum(i: int = 0, length: int = 12) -> trio.Datum:
    chunk = TEXT[i:i + length + 1]
    return trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[trio.LocalPool]:
    with trio.LocalPool(min_cycle_s=0.005, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                        name="transports") as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with served(pool) as s:
        yield s


@pytest.fixture
def service(transport, pool, server) -> Iterator[trio.ServiceClient]:
    # (the server fixture for every codec: a module's server starts before the first test's thread check)
    svc = trio.ServiceClient(pool) if transport == IN_PROCESS else trio.ServiceClient(base_url=server.url, api_key=KEY)
    yield svc
    svc.close()


def outcome(call: Callable[[], Any]) -> Any:
    """The result, or the exception, whether it is raised at the call or by the future (a
    refusal that waits behind a custom loss's reservation surfaces on the future)."""
    try:
        result = call()
        return result.result(timeout=60) if hasattr(result, "result") else result
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome under test
        return exc


def trained(service: trio.ServiceClient, seed: int = 1) -> trio.TrainingClient:
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=seed)
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(ADAM).result(timeout=60)
    return tc


# -- the divergences the HTTP path had (each failed on the code before this file) ---------------

def test_a_repeated_checkpoint_name_is_refused_unless_overwrite(service):
    tc = trained(service)
    # both queued before either ran: a check when the request arrives passes both
    first, second = tc.save_state("twice"), outcome(lambda: tc.save_state("twice"))
    path = first.result(timeout=60).path
    assert isinstance(second, trio.CheckpointExistsError) and isinstance(second, trio.ConflictError), second
    assert "twice" in str(second) and "overwrite=True" in str(second)
    assert tc.save_state("twice", overwrite=True).result(timeout=60).path == path
    again = outcome(lambda: tc.save_state("twice"))
    assert isinstance(again, trio.CheckpointExistsError), again


def test_both_transports_name_runs_and_checkpoints_alike(service, pool):
    """One naming module (trio_widgets/protocol/names.py): a run is <session>:train:<n>, a save
    returns tinker://<run>/<segment>/<name> on every transport, and that path loads on both."""
    tc = trained(service, seed=12)
    assert names.RUN_ID_RE.match(tc.model_id) and tc.model_id.startswith(service.backend.session_id + ":train:")
    state = tc.save_state("named").result(timeout=60).path
    weights = tc.save_weights_for_sampler("named-w").result(timeout=60).path
    assert (state, weights) == (f"tinker://{tc.model_id}/weights/named", f"tinker://{tc.model_id}/sampler_weights/named-w")
    for path in (state, weights):
        assert parse_tinker_path(path).run_id == tc.model_id
    assert tc.load_state(state).result(timeout=60).path == state
    again = service.create_training_client_from_state(state)
    assert again.model_id != tc.model_id and names.RUN_ID_RE.match(again.model_id)
    sampler = service.create_sampling_client(model_path=weights)
    assert sampler.sample([5, 6], 1, trio.SamplingParams(max_tokens=2, seed=0)).result(timeout=60).sequences
    # the repeated sampler-weights name is refused as the SDKs' servers do (neither SDK offers overwrite there)
    refused = outcome(lambda: tc.save_weights_for_sampler("named-w"))
    assert isinstance(refused, trio.CheckpointExistsError), refused


def test_the_engines_save_refuses_a_repeated_name_unless_asked(pool):
    """The engine's own default (SaveRequest.overwrite False), which a server passes through."""
    from trio_widgets.backend import SaveRequest

    tc = trained(trio.ServiceClient(pool), seed=13)
    backend = tc._backend
    assert backend.submit(tc.client_id, "save_state", SaveRequest("once")).result(timeout=60).path.endswith("/once")
    with pytest.raises(trio.CheckpointExistsError):
        backend.submit(tc.client_id, "save_state", SaveRequest("once")).result(timeout=60)
    backend.submit(tc.client_id, "save_state", SaveRequest("once", overwrite=True)).result(timeout=60)


def test_the_pools_listing_names_the_run_by_the_clients_id(service, pool):
    tc = trained(service, seed=2)
    saved = tc.save_state("listed").result(timeout=60).path
    local = trio.RestClient(pool)  # what the pool's own RestClient lists: the same id, either way
    runs = [r.training_run_id for r in local.list_training_runs().result().training_runs]
    assert tc.model_id in runs
    run = local.get_training_run(tc.model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == f"tinker://{tc.model_id}/weights/listed"
    assert f"tinker://{tc.model_id}/weights/listed" in [c.tinker_path for c in
                                                         local.list_checkpoints(tc.model_id).result().checkpoints]
    assert saved.endswith("listed")


def test_ttl_and_metadata_are_kept_and_expiry_is_enforced(service, pool):
    tc = trained(service, seed=3)
    before = time.time()
    tc.save_state("ttl", ttl_seconds=7200, user_metadata={"step": "1"}).result(timeout=60)
    local = trio.RestClient(pool)
    found = {c.checkpoint_id: c for c in local.list_checkpoints(tc.model_id).result().checkpoints}
    kept = found["weights/ttl"]
    assert kept.user_metadata == {"step": "1"}
    assert kept.expires_at is not None
    # the TTL counts from the save: 7200 s from a moment between `before` and now
    assert before + 7200 <= kept.expires_at.timestamp() <= time.time() + 7200
    # once expired, the checkpoint is gone for both transports
    directory = ckpt.checkpoint_dir_of(pool, tc.model_id, "weights/ttl", run_dir=local._backend._run_dir(tc.model_id))
    ckpt.set_expiry(directory, time.time() - 1, pool)
    loaded = outcome(lambda: service.create_training_client_from_state(kept.tinker_path))
    assert isinstance(loaded, trio.CheckpointNotFoundError), loaded


def test_one_session_table(service, pool):
    tc = trained(service, seed=4)
    session_id = service.backend.session_id
    local = trio.RestClient(pool)
    assert session_id in local.list_sessions().result().sessions
    assert tc.model_id in local.get_session(session_id).result().training_run_ids


def test_refusals_raise_the_same_class_naming_the_same_field(service):
    tc = trained(service, seed=5)
    bad = trio.Datum(trio.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [1, 2]})
    refused = outcome(lambda: tc.forward_backward([bad], "cross_entropy"))
    assert type(refused) is trio.InvalidInputError, refused
    assert refused.field is not None and "target_tokens" in refused.field
    missing = outcome(lambda: service.create_training_client_from_state(f"tinker://{tc.model_id}/weights/none"))
    assert isinstance(missing, trio.CheckpointNotFoundError), missing
    tc.close()
    closed = outcome(lambda: tc.forward_backward([datum()], "cross_entropy"))
    assert isinstance(closed, trio.ClientClosedError), closed


# -- the one error table ------------------------------------------------------------------------

def _instance(kind: type[BaseException]) -> BaseException:
    if issubclass(kind, trio.CheckpointError):
        return kind("no good", field="f", path="tinker://run/weights/x")
    if issubclass(kind, trio.InvalidInputError):
        return kind("no good", field="f")
    return kind("no good")


@pytest.mark.parametrize("row", ERRORS, ids=lambda r: r.code)
def test_each_exception_travels_as_one_code_and_comes_back_as_its_class(row):
    sent = wire_error(_instance(row.kind))
    assert (sent.status, sent.code, sent.category) == (row.status, row.code, row.category)
    body = sent.future_body()
    back = error_from_wire(sent.code, sent.message, field=body.get("field"), path=body.get("path"),
                           category=sent.category)
    assert type(back) is row.kind
    if isinstance(back, trio.InvalidInputError):
        assert back.field == "f" and str(back) == "f: no good"
    if isinstance(back, trio.CheckpointError):  # the checkpoint it is about travels too
        assert back.path == "tinker://run/weights/x"


def test_every_exception_has_one_category():
    assert len({row.code for row in ERRORS}) == len(ERRORS)
    assert {r.category for r in ERRORS if r.kind is trio.PoolClosedError} == {"server"}
    assert wire_error(RuntimeError("a bug")).category == "server"
    assert issubclass(ResourceNotFoundError, trio.NotFoundError)


def test_one_tinker_path_parser():
    p = parse_tinker_path("tinker://sess-1:train:0/sampler_weights/x")
    assert (p.run_id, p.segment, p.name, p.checkpoint_type, str(p)) == \
        ("sess-1:train:0", "sampler_weights", "x", "sampler", "tinker://sess-1:train:0/sampler_weights/x")
    for bad in ("tinker://a/b/c", "tinker://a/weights", "http://a/weights/x", 3):
        with pytest.raises(trio.InvalidInputError):
            parse_tinker_path(bad)
    parsed = trio.types.ParsedCheckpointTinkerPath.from_tinker_path("tinker://r/weights/n")
    assert (parsed.training_run_id, parsed.checkpoint_id) == ("r", "weights/n")


# -- what still differs, and why ----------------------------------------------------------------

def _differs(name: str, service: trio.ServiceClient, pool: trio.LocalPool, transport: str) -> bool:
    """Whether `name`'s difference shows on this transport (True means: behaves the other way)."""
    if name == "filesystem-paths":
        tc = trained(service, seed=6)
        saved = tc.save_state("fs").result(timeout=60).path
        local = trio.RestClient(pool)
        directory = [str(pool.checkpoint_path(c.tinker_path)) for c in local.list_checkpoints(tc.model_id).result()
                     .checkpoints if c.tinker_path.endswith("/fs")]
        assert saved.startswith("tinker://")  # every transport returns tinker:// paths
        assert directory
        return isinstance(outcome(lambda: service.create_training_client_from_state(directory[0])),
                          trio.InvalidInputError)
    if name == "client-ids":
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9)
        return tc.client_id == tc.model_id
    if name == "rest-catalog":
        elsewhere = trio.ServiceClient(pool)  # another session, in-process
        tc = trained(elsewhere, seed=10)
        listed = [r.training_run_id for r in service.create_rest_client().list_training_runs().result().training_runs]
        elsewhere.close()
        return tc.model_id not in listed
    if name == "closed-pool":  # (a pool of its own, closed here)
        with trio.LocalPool(min_cycle_s=0.0, name="closing") as other, transport_service(transport, other) as svc:
            tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=8)
            other.close()
            return isinstance(outcome(lambda: tc.forward_backward([datum()], "cross_entropy")), trio.APIConnectionError)
    if name == "inspect-adapter":
        tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=7)
        return isinstance(outcome(tc.inspect_adapter), trio.InvalidInputError)
    raise AssertionError(f"no check for the listed difference {name!r}")


@pytest.mark.parametrize("name", sorted(DIFFERENCES))
def test_each_listed_difference_still_exists(name, pool, server):
    local = trio.ServiceClient(pool)
    remote = trio.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        assert not _differs(name, local, pool, IN_PROCESS), f"{name}: in-process should be the reference behaviour"
        assert _differs(name, remote, pool, "tinker-http"), f"{name} no longer differs over HTTP: take it off the list"
    finally:
        local.close()
        remote.close()
