"""The client side of issue 16: code written for tinker 0.38 or pytrio 0.2.9 runs here, against
a real pool, and every new argument does what it says (checked for behaviour, not acceptance).

tests/test_sdk_styles.py runs whole scripts in each SDK's documented style; the parity test
(test_sdk_parity.py) compares signatures with the installed SDKs."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import make_datum, random_batch
from numerics import assert_fp32_close, model_terms, tiny_config
from served import drop_while_held, wait_for
from transports import IN_PROCESS, KEY, checkpoint_dir, differs, inspect, queued, service

import trio_widgets as trio
from trio_widgets.engine import checkpoints as ckpt

ADAM = trio.AdamParams(learning_rate=1e-2)
PROMPT = [3 + b for b in b"The cat "]  # byte tokenizer: token = byte + 3


@pytest.fixture
def ckpool(tmp_path):
    with trio.LocalPool(min_cycle_s=0.0, name="sdk", checkpoint_dir=str(tmp_path / "ckpt")) as pool:
        yield pool


@pytest.fixture
def sc(ckpool, transport):
    with service(transport, ckpool) as svc:
        yield svc


@pytest.fixture
def look(sc, ckpool):
    """`look(client)`: its adapter as the pool holds it, whichever transport the client uses."""
    return lambda client: inspect(sc, ckpool, client)


def _trained(sc: trio.ServiceClient, seed: int = 0, steps: int = 2, rank: int = 4) -> trio.TrainingClient:
    """A client after `steps` updates (all of them run when this returns)."""
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=rank, seed=seed)
    for step in range(steps):
        tc.forward_backward(random_batch(100 + step, n=2, length=12))
        last = tc.optim_step(ADAM)
    last.result(timeout=60)
    return tc


def _equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- client creation: the client and a future of it (tinker 0.38) -----------------------------

def test_creation_returns_the_client_and_a_future_of_it(sc):
    made = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    assert isinstance(made, trio.TrainingClient) and isinstance(made, trio.APIFuture)
    assert isinstance(made, trio.BackcompatTrainingClientFuture)
    # what it gives is the TrainingClient as the SDKs' `.result()` gives it: not a future, not awaitable
    client = made.result()
    assert made.done() and made.result(timeout=0) is client and type(client) is not type(made)
    assert isinstance(client, trio.TrainingClient) and not isinstance(client, trio.APIFuture)
    assert not hasattr(client, "__await__") and not hasattr(client, "result") and client.model_id == made.model_id
    assert made.future().result(timeout=5) is client and made.map(lambda c: c.model_id).result() == made.model_id
    assert asyncio.run(made.result_async()) is client

    async def awaited():
        return await sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=1)

    tc = asyncio.run(awaited())
    assert isinstance(tc, trio.TrainingClient)
    # pytrio's style (and tinker's older one): use it directly
    out = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=2).forward(random_batch(0, n=1, length=8))
    assert math.isfinite(out.result(timeout=60).metrics["loss:sum"])
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    assert isinstance(sampler, trio.SamplingClient) and isinstance(sampler, trio.BackcompatSamplingClientFuture)
    plain = sampler.result()
    assert isinstance(plain, trio.SamplingClient) and not hasattr(plain, "__await__")
    assert asyncio.run(sampler.result_async()) is plain and plain.client_id == sampler.client_id


def test_a_snapshot_sampler_is_a_pending_future_that_is_also_the_client(sc, ckpool, look):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    with ckpool.hold():  # the snapshot lands in the optim_step's cycle, after it
        tc.forward_backward(random_batch(1, n=1, length=8))
        opt = tc.optim_step(ADAM)
        snap = tc.save_weights_and_get_sampling_client()
        assert isinstance(snap, trio.APIFuture) and not snap.done() and "pending" in repr(snap)
    made = snap.result(timeout=60)
    assert isinstance(made, trio.SamplingClient) and not hasattr(made, "__await__") and made.client_id == snap.client_id
    assert snap.cycle == opt.cycle is not None
    after_step = look(tc).state_dict()
    assert _equal_weights(look(snap).state_dict(), after_step)
    # used directly (pytrio), it waits for its snapshot
    direct = tc.save_weights_and_get_sampling_client()
    response = direct.sample(trio.ModelInput.from_ints(PROMPT), 2, trio.SamplingParams(max_tokens=3, seed=1))
    assert len(response.result(timeout=60).sequences) == 2
    # awaited (tinker 0.38), and the _async twin gives the client after one await
    async def both():
        return await tc.save_weights_and_get_sampling_client(), await tc.save_weights_and_get_sampling_client_async()

    first, second = asyncio.run(both())
    assert isinstance(first, trio.SamplingClient) and isinstance(second, trio.SamplingClient)
    assert first.client_id != second.client_id


def test_a_cancelled_snapshot_never_makes_a_client(sc, ckpool):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    with ckpool.hold():
        snap = tc.save_weights_and_get_sampling_client()
        assert snap.cancel() and snap.cancelled()
    import concurrent.futures

    with pytest.raises(concurrent.futures.CancelledError):
        snap.sample(PROMPT)


def test_a_dropped_pending_snapshot_is_released(sc, ckpool, look):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    before = ckpool.tenant_count
    with ckpool.hold():
        tc.save_weights_and_get_sampling_client()  # dropped at once, before its cycle
    tc.optim_step(ADAM).result(timeout=60)  # the snapshot's cycle, and the one after, have run
    look(tc)
    # a dropped client's release is queued, not sent by its finalizer (see the next test)
    wait_for(lambda: ckpool.tenant_count == before, "the pool to let go of the dropped snapshot")


def test_a_dropped_client_is_let_go_of_without_waiting_for_a_lock(sc, ckpool, transport):
    """A garbage-collected client's finalizer runs on whatever thread the collector interrupted,
    maybe inside a lock that its release takes: over HTTP, httpcore's connection-pool lock, held by
    a request of the same link that allocated (that thread then waited for itself forever: seen
    under pytest-xdist); in-process, the clock's lock. With that lock held elsewhere, dropping a
    client returns at once, and the pool lets go of it once the lock is free."""
    holder = [_trained(sc, steps=1)]
    before = ckpool.tenant_count
    lock = (ckpool._clock.cond if transport == IN_PROCESS
            else holder[0]._backend._link.http._transport._pool._optional_thread_lock._lock)
    drop_while_held(holder, lock, "a client")
    wait_for(lambda: ckpool.tenant_count == before - 1, "the pool to let go of the dropped client")


def test_a_dropped_service_lets_go_of_its_clients_without_waiting_for_a_lock(sc, ckpool, transport):
    """The same for a garbage-collected ServiceClient. Over HTTP its backend's finalizer ends the
    session, which a close on the collector's thread did with a request of its own: inside
    httpcore's pool lock (a heartbeat's request of the same link) it waited forever. With that lock
    (in-process, the clock's) held elsewhere, dropping a service and its client returns at once;
    then the pool lets go of the client, and over HTTP the session is finished and its threads stop."""
    server = getattr(sc, "_server", None)
    service = trio.ServiceClient(ckpool) if server is None else trio.ServiceClient(base_url=server.url, api_key=KEY)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=10)
    assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1
    before = ckpool.tenant_count
    link = getattr(service.backend, "_link", None)
    lock = ckpool._clock.cond if link is None else link.http._transport._pool._optional_thread_lock._lock
    session_id = service.backend.session_id
    holder = [service]
    del service, tc
    drop_while_held(holder, lock, "a service")
    wait_for(lambda: ckpool.tenant_count == before - 1, "the pool to let go of the dropped service's client")
    if server is not None:
        wait_for(lambda: next(s["state"] for s in server.sessions() if s["session_id"] == session_id) == "finished",
                 "the dropped service's session to finish")
        wait_for(lambda: link.closed and not link.thread.is_alive() and not link.heartbeat.is_alive(),
                 "the dropped service's threads to stop")


def test_from_state_loads_weights_only_and_with_optimizer_both(sc, look):
    tc = _trained(sc)
    path = tc.save_state("s").result(timeout=60).path
    saved = look(tc)
    weights_only = sc.create_training_client_from_state(path).result()
    state = look(weights_only)
    assert state.exp_avg == {} and state.step == 0 and _equal_weights(state.state_dict(), saved.state_dict())
    both = sc.create_training_client_from_state_with_optimizer(path, trio.DEFAULT_MODEL, None, "token").result()
    resumed = look(both)
    assert resumed.step == saved.step > 0 and resumed.exp_avg.keys() == saved.exp_avg.keys()
    # tinker's base_model (second positional): checked against the checkpoint
    with pytest.raises(trio.CheckpointError) as wrong:
        sc.create_training_client_from_state(path, "someone/other-model")
    assert wrong.value.field == "base_model"
    assert sc.create_training_client_from_state(path, trio.DEFAULT_MODEL, weights_access_token="x",
                                                optimizer=trio.AdamOptimizerConfig()).model_id


def test_optimizer_config_is_adamw_only(sc):
    assert sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, optimizer=trio.AdamOptimizerConfig())
    with pytest.raises(trio.InvalidInputError) as info:
        sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, optimizer=object())
    assert info.value.field == "optimizer" and "AdamW only" in str(info.value)


# -- create_sampling_client: both SDKs' argument orders ------------------------------------------

def test_sampling_client_in_both_argument_orders(sc, tmp_path, transport):
    tc = _trained(sc)
    path = tc.save_weights_for_sampler("w").result(timeout=60).path
    params = trio.SamplingParams(max_tokens=6, temperature=0.0)

    def greedy(sampler):
        return sampler.sample(trio.ModelInput.from_ints(PROMPT), 1, params).result(timeout=60).sequences[0].tokens

    adapted = greedy(sc.create_sampling_client(model_path=path))
    assert greedy(sc.create_sampling_client(path)) == adapted  # tinker: (model_path)
    assert greedy(sc.create_sampling_client(trio.DEFAULT_MODEL, path)) == adapted  # pytrio: (base_model, model_path)
    assert greedy(sc.create_sampling_client(path, trio.DEFAULT_MODEL)) == adapted  # tinker: (model_path, base_model)
    base = sc.create_sampling_client(trio.DEFAULT_MODEL)  # pytrio: (base_model)
    assert base.model_path is None and greedy(base) != adapted
    assert greedy(sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)) == greedy(base)
    if differs(transport, "filesystem-paths"):
        return
    # a directory that is both a model and a checkpoint: which one was meant cannot be told
    both = tmp_path / "both"
    shutil.copytree(sc.pool.checkpoint_path(path), both)
    (both / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(trio.InvalidInputError) as info:
        sc.create_sampling_client(str(both))
    assert info.value.field == "model_path" and "by keyword" in str(info.value)


def test_sampler_options_of_tinker(sc):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    assert sc.create_sampling_client(base_model=trio.DEFAULT_MODEL, retry_config=object()).get_base_model()
    for make in (lambda: sc.create_sampling_client(None, trio.DEFAULT_MODEL, None, True),
                 lambda: tc.save_weights_and_get_sampling_client(record_stability_info=True)):
        with pytest.raises(trio.InvalidInputError) as info:
            make()
        assert info.value.field == "record_stability_info" and "stable_reinforce" in str(info.value)
    with pytest.raises(trio.InvalidInputError, match="kind: only 'snapshot'"):
        tc.save_weights_and_get_sampling_client(kind="inflight")
    with pytest.raises(ValueError):  # tinker: "Either model_path or base_model must be provided"
        sc.create_sampling_client()


# -- who a run is, and what results carry ---------------------------------------------------------

def test_ids_and_info_of_both_sdks(sc, transport):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=3, seed=4, train_mlp=False)
    info = tc.get_info()
    assert (info.model_id, info.model_data.model_name, info.lora_rank, info.is_lora) == (
        tc.model_id, trio.DEFAULT_MODEL, 3, True)
    assert info.model_data.arch == "llama" and info.optimizer_config == trio.AdamOptimizerConfig()
    assert asyncio.run(tc.get_info_async()) == info
    assert tc.training_run_cuid == tc.model_id and tc.model_alias == trio.DEFAULT_MODEL
    assert (tc.model_id == tc.client_id) == differs(transport, "client-ids")
    assert (tc.lora.rank, tc.lora.seed, tc.lora.train_mlp, tc.lora.train_attn) == (3, 4, False, True)
    path = tc.save_state("named").result(timeout=60).path
    assert trio.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id == tc.model_id
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    assert sampler.model_id == trio.DEFAULT_MODEL and sampler.sampling_run_cuid == sampler.client_id
    assert asyncio.run(sampler.get_base_model_async()) == trio.DEFAULT_MODEL


def test_pytrio_metric_keys(sc):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    tokens = list(range(10, 22))
    weights = [0.0, 1.0, 0.0, 2.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    out = tc.forward_backward([make_datum(tokens, weights)]).result(timeout=60)
    m = out.metrics
    assert m["token_count"] == sum(w != 0 for w in weights) == 6 and isinstance(m["token_count"], int)
    assert m["loss_sum"] == m["loss:sum"] and m["loss_mean"] == m["loss:sum"] / 6
    no_weights = tc.forward([make_datum(tokens)]).result(timeout=60).metrics
    assert no_weights["token_count"] == len(tokens) - 1
    zero = tc.forward([make_datum(tokens, [0.0] * 11)]).result(timeout=60).metrics
    assert (zero["token_count"], zero["loss_mean"]) == (0, 0.0)
    datum = trio.Datum(trio.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "logprobs": [-1.0] * 11,
                                                                "advantages": [0.0] * 5 + [1.0] * 6})
    assert tc.forward([datum], "importance_sampling").result(timeout=60).metrics["token_count"] == 11


def test_save_responses_and_load_response(sc, ckpool):
    tc = _trained(sc)
    saved = tc.save_state("a").result(timeout=60)
    on_disk = sum(f.stat().st_size for f in checkpoint_dir(sc, ckpool, saved).iterdir())
    assert (saved.model, saved.size) == (trio.DEFAULT_MODEL, on_disk)
    sampler_weights = tc.save_weights_for_sampler("b").result(timeout=60)
    assert sampler_weights.size == sum(f.stat().st_size for f in checkpoint_dir(sc, ckpool, sampler_weights).iterdir())
    assert tc.load_state(saved.path, weights_access_token="x").result(timeout=60).model_id == tc.model_id


def test_capabilities(sc, ckpool):
    caps = sc.get_server_capabilities()
    model = next(m for m in caps.supported_models if m.model_name == trio.DEFAULT_MODEL)
    assert model.max_context_length == 512 and model.trainable and model.sampleable
    assert model.training.max_tokens_per_request == ckpool.max_tokens_per_pass and model.sampling.available
    assert trio.DEFAULT_MODEL in sc.get_supported_models()
    assert trio.RestClient(ckpool).get_server_capabilities().result() == caps


# -- ServiceClient: constructor forms, close, context manager -------------------------------------

def test_service_client_constructor_forms(ckpool):
    assert trio.ServiceClient(ckpool).pool is ckpool and trio.ServiceClient(pool=ckpool).pool is ckpool
    by_key = trio.ServiceClient("an-api-key")  # pytrio's first positional: api_key
    by_metadata = trio.ServiceClient({"team": "x"}, "project")  # tinker's: user_metadata, project_id
    assert by_key.pool is by_metadata.pool is trio.default_pool()
    assert by_metadata.user_metadata == {"team": "x"} and by_key.username == by_key.display_name
    with pytest.warns(FutureWarning, match="ignores unsupported arguments: colour"):
        trio.ServiceClient(ckpool, colour="red")
    with pytest.raises(trio.InvalidInputError):
        trio.ServiceClient(3)


def test_close_and_context_manager(ckpool, transport):
    with service(transport, ckpool) as sc:
        tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        with ckpool.hold():
            fb = tc.forward_backward(random_batch(2, n=1, length=8))
            opt = tc.optim_step(ADAM)
            queued(ckpool, 2)
        sc.close()  # (over HTTP it waits for what it sent, as in-process it runs on)
    assert tc.closed and sc.closed
    assert opt.result(timeout=60).metrics["step:max"] == 1 and fb.done()  # queued work still ran
    with pytest.raises(trio.ClientClosedError):
        tc.forward(random_batch(2, n=1, length=8))
    with pytest.raises(trio.ClientClosedError):
        sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2)
    again = sc.close("success")  # idempotent: a done future
    assert again.done() and again.result() is None
    with service(transport, ckpool) as other, pytest.raises(trio.InvalidInputError):
        other.close("finished")

    async def tinker_style():
        with service(transport, ckpool) as svc:
            client = await svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2)
            await svc.close("success")
            return client

    assert asyncio.run(tinker_style()).closed


# -- TrainingClient arguments ---------------------------------------------------------------------

def test_optim_step_forms_give_the_same_weights(sc, look):
    batch = random_batch(3, n=2, length=10)
    clients = [sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=7) for _ in range(3)]
    for tc in clients:  # each alone in its cycle, over any transport: a pass of one tenant and a pass of
        tc.forward_backward(batch).result()  # several agree to fp32 rounding, not to the bit (architecture.md)
    clients[0].optim_step(ADAM)
    clients[1].optim_step(optim_params=ADAM)
    clients[2].optim_step(adam_params=ADAM)
    weights = [look(tc).state_dict() for tc in clients]
    assert _equal_weights(weights[0], weights[1]) and _equal_weights(weights[0], weights[2])
    with pytest.raises(ValueError, match="Specify optim_params or legacy adam_params, not both"):
        clients[0].optim_step(ADAM, adam_params=ADAM)
    for wrong in ((), (trio.AdamOptimizerConfig(),)):
        with pytest.raises(TypeError) as info:
            clients[0].optim_step(*wrong)
        assert isinstance(info.value, trio.InvalidInputError) and info.value.field == "adam_params"


def test_save_state_overwrite_metadata_and_ttl(sc, ckpool, look):
    tc = _trained(sc, steps=1)
    first = tc.save_state("ckpt", user_metadata={"step": "1"}).result(timeout=60)
    before = look(tc).state_dict()
    tc.forward_backward(random_batch(4, n=1, length=10))
    tc.optim_step(ADAM)
    after = look(tc).state_dict()
    with pytest.raises(trio.CheckpointExistsError) as taken:
        tc.save_state("ckpt")
    assert isinstance(taken.value, trio.ConflictError) and taken.value.status_code == 409
    assert taken.value.field == "name"
    loaded = look(sc.create_training_client_from_state(first.path))
    assert _equal_weights(loaded.state_dict(), before)  # the refused save changed nothing
    second = tc.save_state("ckpt", ttl_seconds=7200, overwrite=True, user_metadata={"step": "2"}).result(timeout=60)
    assert second.path == first.path
    loaded = look(sc.create_training_client_from_state(second.path))
    assert _equal_weights(loaded.state_dict(), after)
    listed = trio.RestClient(ckpool).list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.user_metadata) for c in listed] == [("weights/ckpt", {"step": "2"})]
    assert 7100 < (listed[0].expires_at - listed[0].time).total_seconds() < 7300
    # two saves of one name queued together: the second is refused when it runs
    with ckpool.hold():
        a, b = tc.save_state("pair"), tc.save_state("pair")
    assert a.result(timeout=60).path and isinstance(b.exception(timeout=60), trio.CheckpointExistsError)
    for bad in ({"ttl_seconds": 60}, {"ttl_seconds": 1.5}, {"user_metadata": {"step": 1}},
                {"overwrite": "yes"}):
        with pytest.raises(trio.InvalidInputError) as info:
            tc.save_state("other", **bad)
        assert info.value.field == next(iter(bad))


def test_auto_shift_equals_the_shifted_datum(sc, look):
    tokens = [3 + b for b in b"auto shift: labels aligned with the input"]
    weights = [0.5 + (i % 3) / 2 for i in range(len(tokens))]
    aligned = trio.Datum(trio.ModelInput.from_ints(tokens), {"target_tokens": tokens, "weights": weights})
    shifted = make_datum(tokens, weights[1:])
    a = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=5)
    b = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=5)
    out_a = a.forward_backward([aligned], "cross_entropy", None, True).result(timeout=60)
    out_b = b.forward_backward([shifted]).result(timeout=60)
    assert out_a.metrics == out_b.metrics
    assert torch.equal(out_a.loss_fn_outputs[0]["logprobs"].to_torch(), out_b.loss_fn_outputs[0]["logprobs"].to_torch())
    grads = [look(tc).grad_dict() for tc in (a, b)]
    assert _equal_weights(*grads)
    misaligned = trio.Datum(trio.ModelInput.from_ints(tokens), {"target_tokens": tokens[1:]})  # shifted already
    with pytest.raises(trio.InvalidInputError) as info:
        a.forward([misaligned], auto_shift=True)
    assert info.value.field == "data[0].loss_fn_inputs['target_tokens']" and info.value.datum_index == 0


def test_loss_names_ignore_case(sc):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    batch = random_batch(5, n=1, length=8)
    assert tc.forward(batch, " CROSS_Entropy ").result(timeout=60).metrics == tc.forward(batch).result().metrics
    with pytest.raises(trio.InvalidInputError, match="stable_reinforce is not available"):
        tc.forward_backward(batch, "Stable_Reinforce")


def test_loss_input_checks_and_failure_categories(sc):
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    tokens = list(range(10, 19))
    inputs = {"target_tokens": tokens[1:], "logprobs": [-1.0] * 8, "advantages": [1.0] * 8}
    unmarked = trio.Datum(trio.ModelInput.from_ints(tokens[:-1]), {**inputs, "sequence_ratio_mask": [0] * 8})
    with pytest.raises(trio.InvalidInputError, match="sequence_ratio_mask'\\] marks no token") as info:
        tc.forward_backward([unmarked], "gspo")  # refused at submit, not NaN inside the cycle
    assert info.value.datum_index == 0
    # a loss that overflows is the tenant's own failure: tinker's category User
    overflowing = trio.Datum(trio.ModelInput.from_ints(tokens[:-1]), {**inputs, "logprobs": [-1e30] * 8})
    failed = tc.forward_backward([overflowing], "importance_sampling").exception(timeout=60)
    assert isinstance(failed, trio.RequestFailedError) and "not finite" in str(failed)
    assert failed.category == trio.errors.RequestErrorCategory.User


def test_custom_loss_config_and_handles(sc, look):
    batch = random_batch(6, n=2, length=9)
    seen = {}

    def three(data, logprobs, config):
        seen["config"] = config
        return -config["scale"] * sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                                      for d, lp in zip(data, logprobs)), {}

    def two(data, logprobs):
        return -2.0 * sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs)), {}

    def neg_ll(logprobs, weights):
        loss = -2.0 * (logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss, "custom/n:mean": torch.tensor(float(len(weights)))}

    handle = sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert isinstance(handle, trio.LossHandle) and handle.input_names == ("weights",)
    clients = [sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9) for _ in range(4)]
    with pytest.warns(DeprecationWarning, match="'loss_type_input' parameter of forward_backward_custom"):
        outs = [clients[0].forward_backward_custom(batch, three, {"scale": 2.0}),
                clients[1].forward_backward_custom(batch, two, loss_type_input="logprobs"),
                clients[2].forward_backward_custom(batch, handle),
                clients[3].forward_backward(batch, "cross_entropy")]
    results = [o.result(timeout=60) for o in outs]
    assert seen["config"] == {"scale": 2.0}
    # the same loss three ways; each client's pass may be packed with the others (fp32 rounding)
    terms = model_terms(tiny_config(), 9, batch_tokens=18)
    losses = [r.metrics["loss:sum"] for r in results[:3]]
    assert_fp32_close(losses[1:], losses[:1] * 2, terms, "custom loss:sum")
    assert_fp32_close(losses[0], 2 * results[3].metrics["loss:sum"], terms, "2 x the weighted cross-entropy")
    assert results[2].metrics["custom/n:mean"] == 9.0  # a mean over the data
    # a metric is summed over the data in float64, the loss in float32: two terms of rounding
    assert_fp32_close(results[2].metrics["custom/neg_ll:sum"], results[2].metrics["loss:sum"], 2, "neg_ll:sum")
    assert results[0].metrics["loss_sum"] == results[0].metrics["loss:sum"] and results[0].metrics["token_count"] == 18
    grads = [look(tc).grad_dict() for tc in clients]
    for name in grads[3]:  # each is 2 x the weighted cross-entropy's gradient
        for g in grads[:3]:
            assert_fp32_close(g[name], 2 * grads[3][name], terms, f"gradient of {name}")
    with pytest.raises(trio.InvalidInputError, match="logprobs as its first parameter"):
        sc.create_custom_loss(lambda weights: weights, {"weights": 1})
    with pytest.raises(trio.InvalidInputError) as info:
        sc.create_custom_loss(neg_ll, {"logprobs": 1})
    assert info.value.field == "input_ranks"
    with pytest.raises(trio.InvalidInputError) as info:
        clients[2].forward_backward_custom([make_datum(list(range(5, 12)))], handle)  # no weights
    assert info.value.field == "data[0].loss_fn_inputs['weights']"


# -- SamplingClient arguments ---------------------------------------------------------------------

def test_sample_text_and_pytrio_fields(sc):
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    tok = sampler.get_tokenizer()
    params = trio.SamplingParams(max_tokens=5, seed=3)
    response = sampler.sample(trio.ModelInput.from_ints(PROMPT), 2, params).result(timeout=60)
    assert response.input_tokens == len(PROMPT) and response.output_tokens == sum(len(s.tokens)
                                                                                  for s in response.sequences)
    assert all(s.text == tok.decode(s.tokens) for s in response.sequences)
    plain = sampler.sample(trio.ModelInput.from_ints(PROMPT), 2, params, return_text=False).result(timeout=60)
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in response.sequences]
    assert all(s.text is None for s in plain.sequences)
    with pytest.raises(trio.InvalidInputError, match="return_text"):
        sampler.sample(trio.ModelInput.from_ints(PROMPT), 1, params, False, 0, True)  # pytrio's positional order
    assert asyncio.run(sampler.sample_async(PROMPT, 1, params)).sequences[0].text is not None


def test_image_prompts_are_refused_naming_the_base_model(sc):
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    prompt = trio.ModelInput.from_ints(PROMPT).append(trio.ImageChunk(data=b"\x89PNG", format="png",
                                                                      expected_tokens=4))
    for call in (lambda: sampler.sample(prompt, 1), lambda: sampler.compute_logprobs(prompt)):
        with pytest.raises(trio.InvalidInputError) as info:
            call()
        assert info.value.field == "prompt.chunks[1]" and trio.DEFAULT_MODEL in str(info.value)


def test_logprob_options_are_checked(sc, transport):
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    prompt = trio.ModelInput.from_ints(PROMPT)
    cases = [({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n", "set include_prompt_logprobs"),
             ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n", ">= 1"),
             ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "prompt_logprobs_last_n",
              "at most 7"),
             ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs", ">= 0"),
             ({"topk_sample_logprobs": 10_000}, "topk_sample_logprobs", "at most 259"),
             ({"target_prompt_logprobs": trio.TensorData([[1, 2]] * 3)}, "target_prompt_logprobs", "[7, K]"),
             ({"target_prompt_logprobs": trio.TensorData([[300]] * 7)}, "target_prompt_logprobs", "300"),
             ({"prompt_alt_tokens_k": 1.5}, "prompt_alt_tokens_k", ">= 0")]
    for kwargs, field, text in cases:
        with pytest.raises(trio.InvalidInputError) as info:
            sampler.sample(prompt, 1, **kwargs)
        assert info.value.field == field and text in str(info.value), (kwargs, str(info.value))
    with pytest.raises(trio.InvalidInputError) as info:
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=8)
    assert info.value.field == "prompt_logprobs_last_n"


def test_compute_logprobs_last_n(sc, ckpool):
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    prompt = trio.ModelInput.from_ints(PROMPT)
    with ckpool.hold():  # one cycle, one batch: the last n are the full computation's own numbers
        full = sampler.compute_logprobs(prompt)
        last3 = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3)
        sampled = sampler.sample(prompt, 1, trio.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                                 prompt_logprobs_last_n=3)
    full, last3 = full.result(timeout=60), last3.result(timeout=60)
    assert len(last3) == len(full) == len(PROMPT) and full[0] is None
    assert last3[:-3] == [None] * (len(PROMPT) - 3)
    # rows of one batch (and of another cycle) may round differently: fp32 tolerance
    terms = model_terms(tiny_config(), len(PROMPT))
    assert_fp32_close(last3[-3:], full[-3:], terms, "last 3 vs the full computation")
    sampled_lps = sampled.result(timeout=60).prompt_logprobs
    assert sampled_lps[:-3] == [None] * (len(PROMPT) - 3)
    assert_fp32_close(sampled_lps[-3:], full[-3:], terms, "sample's prompt logprobs")
    again = asyncio.run(sampler.compute_logprobs_async(prompt, 3))
    assert again[:-3] == last3[:-3]
    assert_fp32_close(again[-3:], full[-3:], terms, "compute_logprobs_async")


# -- the two tinker styles: the same cycles -----------------------------------------------------

def test_tinker_038_style_has_the_cycles_of_the_two_await_style(transport):
    """tinker 0.38: `fb = tc.forward_backward(...); opt = tc.optim_step(...); await fb; await opt`
    pipelined gives one update per cycle, as the seeds' `*_async` two-await style does."""
    # long enough to react within a cycle (over HTTP: a round trip too, as in test_serve_client.py)
    cycle_s = 0.1 if transport == IN_PROCESS else 0.4
    with trio.LocalPool(min_cycle_s=cycle_s, name="styles") as pool, service(transport, pool) as svc:
        tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
        batch = random_batch(7, n=1, length=16)

        async def loop(today: bool) -> list[tuple[trio.APIFuture, trio.APIFuture]]:
            pairs, previous = [], None
            for _ in range(6):
                if today:
                    current = (tc.forward_backward(batch), tc.optim_step(ADAM))
                else:
                    current = (await tc.forward_backward_async(batch), await tc.optim_step_async(ADAM))
                if previous is not None:
                    await previous[0]
                    await previous[1]
                pairs.append(current)
                previous = current
            await previous[1]
            return pairs

        async def together() -> list[tuple[trio.APIFuture, trio.APIFuture]]:
            pairs = []
            for _ in range(5):
                fb, opt = tc.forward_backward(batch), tc.optim_step(ADAM)
                await fb
                await opt
                pairs.append((fb, opt))
            return pairs

        for pairs, expected in ((asyncio.run(loop(True)), ({1}, {1})), (asyncio.run(loop(False)), ({1}, {1})),
                                (asyncio.run(together()), ({1}, {2}))):
            spans = {opt.cycle - fb.cycle + 1 for fb, opt in pairs}
            starts = [fb.cycle for fb, _ in pairs]
            assert (spans, {b - a for a, b in zip(starts[1:], starts[2:])}) == expected
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(_no_warning())
    # the *_async twins are not deprecated here (tinker 0.38 warns, pytrio 0.2.9 does not)
    assert not [w for w in caught if "_async" in str(w.message)]


async def _no_warning() -> None:
    with trio.LocalPool(min_cycle_s=0.0, name="nowarn") as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        await (await tc.forward_backward_async(random_batch(8, n=1, length=8)))
        await (await tc.optim_step_async(ADAM))


# -- RestClient ------------------------------------------------------------------------------

def test_rest_client_lists_deletes_and_expires_checkpoints(sc, ckpool, look, transport):
    tc = _trained(sc, steps=1)
    state = tc.save_state("first", user_metadata={"kind": "state"}).result(timeout=60)
    sampler = tc.save_weights_for_sampler("second", ttl_seconds=3600).result(timeout=60)
    rest = sc.create_rest_client()
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [("weights/first", "training"),
                                                                     ("sampler_weights/second", "sampler")]
    first, second = listed
    assert (first.path, second.path) == (state.path, sampler.path)  # pytrio's field: what the save returned
    assert first.tinker_path == f"tinker://{tc.model_id}/weights/first"  # tinker's, which loads too
    assert first.user_metadata == {"kind": "state"} and first.expires_at is None and second.expires_at is not None
    assert first.size_bytes == state.size and not first.public
    resumed = sc.create_training_client_from_state_with_optimizer(first.tinker_path)
    assert look(resumed).step == 1
    info = rest.get_weights_info_by_tinker_path(first.tinker_path).result()
    assert (info.base_model, info.lora_rank, info.is_lora, info.train_mlp) == (trio.DEFAULT_MODEL, 4, True, True)
    run = rest.get_training_run(tc.model_id).result()
    assert (run.base_model, run.lora_rank, run.last_checkpoint.checkpoint_id,
            run.last_sampler_checkpoint.checkpoint_id) == (trio.DEFAULT_MODEL, 4, "weights/first",
                                                           "sampler_weights/second")
    assert rest.get_training_run_by_tinker_path(first.tinker_path).result().training_run_id == tc.model_id
    runs = rest.list_training_runs(limit=10).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count >= 2
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert len(page.checkpoints) == 1 and page.cursor.total_count == 2 and page.cursor.offset == 1
    # a time to live: once it is over, the checkpoint is gone when listed (or opened)
    rest.set_checkpoint_ttl_from_tinker_path(second.tinker_path, 7200).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[1].expires_at > second.expires_at
    ckpt.set_expiry(checkpoint_dir(sc, ckpool, second.path), 0.0)  # the time the TTL set has passed
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["weights/first"]
    assert not checkpoint_dir(sc, ckpool, second.path).exists()
    with pytest.raises(trio.InvalidInputError):
        rest.set_checkpoint_ttl_from_tinker_path(first.tinker_path, 5).result()
    # deleting
    rest.delete_checkpoint(tc.model_id, "weights/first").result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    with pytest.raises(trio.NotFoundError) as gone:
        sc.create_training_client_from_state(state.path)
    assert isinstance(gone.value, trio.CheckpointNotFoundError)
    missing = rest.delete_checkpoint_from_tinker_path(first.tinker_path)  # failures are in the future
    assert isinstance(missing.exception(), trio.NotFoundError)
    with pytest.raises(trio.InvalidInputError):
        rest.delete_checkpoint(tc.model_id, "../../elsewhere").result()


def test_rest_client_samplers_sessions_and_unknown_ids(sc, ckpool):
    """The pool's own RestClient lists every session's samplers and runs by their public ids."""
    tc = sc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    sampler = sc.create_sampling_client(base_model=trio.DEFAULT_MODEL)
    snap = tc.save_weights_and_get_sampling_client().result(timeout=60)
    rest = trio.RestClient(pool=ckpool)
    got = rest.get_sampler(sampler.sampling_run_cuid).result()
    assert (got.sampler_id, got.base_model, got.model_path) == (sampler.client_id, trio.DEFAULT_MODEL, None)
    session = rest.get_session(sc.service_session_cuid).result()
    assert session.training_run_ids == [tc.model_id]
    assert session.sampler_ids == [sampler.client_id, snap.client_id]
    assert sc.service_session_cuid in rest.list_sessions().result().sessions
    for future in (rest.get_training_run("no-such-run"), rest.get_sampler("no-such"), rest.get_session("no-such")):
        assert isinstance(future.exception(), trio.NotFoundError)
    assert asyncio.run(rest.list_checkpoints_async(tc.model_id)).checkpoints == []


# -- pytrio's configure ---------------------------------------------------------------------------

def test_configure_accepts_pytrio_options_and_warns_on_unknown_ones():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trio.configure(api_key="x", base_url="https://example", log_level="INFO", retry_max_attempts=3)
        trio.configure_observability(enabled=False)
        trio.shutdown_observability()
    with pytest.warns(UserWarning, match="Unknown configuration option 'colour' was ignored."):
        trio.configure(colour="red")


# -- the README's Ten lines, in today's style and in the two-await style ------------------------

def test_the_readme_ten_lines_run_in_both_styles():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Ten lines", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    # the section opens with the dashboard cell; then the loop and the two-await fragment
    (loop,) = [b for b in blocks if "for step in range(200)" in b]
    (two_await,) = [b for b in blocks if "forward_backward_async(" in b]
    assert "tc.forward_backward(" in loop and "_async" not in loop and "_async" in two_await
    older = loop.replace("\n".join(line for line in loop.splitlines() if "tc.forward_backward(" in line
                                   or "tc.optim_step(" in line), two_await.rstrip("\n"))
    for code in (loop, older):
        code = code.replace("range(200)", "range(6)")
        source = "async def _main():\n" + "".join(f"    {line}\n" for line in code.splitlines()) + \
            "    return pool, in_flight\n"
        namespace: dict = {}
        exec(compile(source, "README.md", "exec"), namespace)
        pool, in_flight = asyncio.run(namespace["_main"]())
        try:
            fb, opt = in_flight
            asyncio.run(_both(fb, opt))
            assert fb.cycle == opt.cycle and opt.result().metrics["step:max"] == 6
        finally:
            pool.close()


async def _both(fb: trio.APIFuture, opt: trio.APIFuture) -> None:
    await fb
    await opt
