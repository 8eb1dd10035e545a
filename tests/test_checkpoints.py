"""Checkpoints: bitwise resume, weights-only vs optimizer loads, PEFT interop both ways,
names, bad paths, and a crash in the middle of a save."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from numerics import assert_fp32_close, model_terms, tiny_config
from transports import checkpoint_dir, differs, inspect, pool_client_id, service

import trio_widgets as trio
from trio_widgets.engine import sampling
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import _build_builtin

TEXT = [3 + b for b in b"It was the best of times, it was the worst of times, it was the age of wisdom, it was"]
ADAM = trio.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)
PROMPT = [3 + b for b in b"Once upon"]


def _datum(i: int) -> trio.Datum:
    chunk = TEXT[(3 * i) % 40:(3 * i) % 40 + 24]
    return trio.Datum(trio.ModelInput.from_ints(chunk[:-1]), {"target_tokens": chunk[1:]})


def _update(tc: trio.TrainingClient, i: int) -> float:
    fb = tc.forward_backward([_datum(i)], "cross_entropy")
    tc.optim_step(ADAM)
    return fb.result().loss


def _step(tc: trio.TrainingClient, i: int) -> trio.OptimStepResponse:
    tc.forward_backward([_datum(i)], "cross_entropy")
    return tc.optim_step(ADAM).result()


def _weights(svc, pool, tc) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return inspect(svc, pool, tc).weights


def _same(w1, w2) -> bool:
    return w1.keys() == w2.keys() and all(torch.equal(w1[n][0], w2[n][0]) and torch.equal(w1[n][1], w2[n][1])
                                          for n in w1)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))) as pool:
        yield pool


@pytest.fixture(scope="module")
def svc(pool, transport):
    """A ServiceClient through each codec to the same pool (conftest.py's transport)."""
    with service(transport, pool) as svc:
        yield svc


@pytest.fixture(scope="module")
def local(pool):
    """An in-process ServiceClient, for what only a local caller can do: name a directory."""
    return trio.ServiceClient(pool)


@pytest.fixture(scope="module")
def saved(svc):
    """A rank-4 client after 3 updates, with its state and sampler checkpoints."""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=2)
    for i in range(3):
        _step(tc, i)
    return tc, tc.save_state("three").result().path, tc.save_weights_for_sampler("three-w").result().path


def test_resume_equivalence_is_bitwise(svc, pool):
    straight = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=11)
    losses_straight = [_update(straight, i) for i in range(20)]
    first = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=11)
    losses = [_update(first, i) for i in range(10)]
    path = first.save_state("half").result().path
    resumed = svc.create_training_client_from_state_with_optimizer(path)
    assert resumed.client_id != first.client_id
    losses += [_update(resumed, i) for i in range(10, 20)]  # each optim_step ran in its forward's cycle
    assert losses == losses_straight  # exact float equality
    assert _same(_weights(svc, pool, resumed), _weights(svc, pool, straight))
    assert inspect(svc, pool, resumed).step == inspect(svc, pool, straight).step == 20
    assert not _same(_weights(svc, pool, first), _weights(svc, pool, straight))  # the first client stopped at 10
    info = resumed.get_info().model_data
    assert (info.base_model, info.lora_rank) == (trio.DEFAULT_MODEL, 8)


def test_load_state_resets_adam_and_with_optimizer_continues_it(svc, pool, saved):
    tc, path, _ = saved
    at_save = _weights(svc, pool, tc)
    weights_only = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=77)
    with_opt = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=78)
    assert weights_only.load_state(path).result().path == path
    with_opt.load_state_with_optimizer(path).result()
    assert _same(_weights(svc, pool, weights_only), at_save) and _same(_weights(svc, pool, with_opt), at_save)

    reference = svc.create_training_client_from_state_with_optimizer(path)  # the run continued without a break
    ref_step = _step(reference, 3)
    wo_step = _step(weights_only, 3)
    wi_step = _step(with_opt, 3)
    assert ref_step.metrics["step:max"] == wi_step.metrics["step:max"] == 4
    assert wo_step.metrics["step:max"] == 1
    assert _same(_weights(svc, pool, with_opt), _weights(svc, pool, reference))
    assert not _same(_weights(svc, pool, weights_only), _weights(svc, pool, reference))
    # fresh moments: the first AdamW step moves every weight with a gradient by lr (times sign)
    deltas = torch.cat([(_weights(svc, pool, weights_only)[n][1] - at_save[n][1] * (1 - ADAM.learning_rate *
                                                                       ADAM.weight_decay)).flatten()
                        for n in at_save])
    # Fresh moments: Δ = lr·g/(|g| + eps), lr to within eps/|g| (eps 1e-12) and the rounding of
    # w + Δ (|w| < 1: ulp ≤ 1.2e-7, i.e. 1.2e-5 of lr 1e-2); rtol 1e-3 is ~100 times that.
    # Entries that moved by less than 1e-4 are the ones with no gradient (or clipped to ~0).
    moved = deltas.abs()[deltas.abs() > 1e-4]
    assert moved.numel() > 100 and torch.allclose(moved, torch.full_like(moved, ADAM.learning_rate), rtol=1e-3)
    cont = torch.cat([(_weights(svc, pool, with_opt)[n][1] - at_save[n][1] * (1 - ADAM.learning_rate *
                                                                 ADAM.weight_decay)).flatten() for n in at_save])
    assert not torch.allclose(cont.abs()[cont.abs() > 1e-4], torch.full_like(cont.abs()[cont.abs() > 1e-4],
                                                                             ADAM.learning_rate), rtol=1e-3)


def test_state_ops_run_in_order_after_the_optim_step_before_them(svc, pool):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=9)
    with pool.hold():
        tc.forward_backward([_datum(0)], "cross_entropy")
        opt = tc.optim_step(ADAM)
        save = tc.save_state("ordered")
    path = save.result().path
    assert save.cycle == opt.cycle  # state ops ride along in the client's cycle
    loaded = svc.create_training_client_from_state(path)
    assert _same(_weights(svc, pool, loaded), _weights(svc, pool, tc))
    assert json.loads((checkpoint_dir(svc, pool, path) / "trio_checkpoint.json").read_text())["step"] == 1
    record = next(r for r in pool.telemetry.requests_of(pool_client_id(svc, tc)) if r.op == "save_state")
    assert record.status == "ok" and record.cycle == save.cycle


def test_peft_loads_the_exported_adapter_with_the_same_logits(svc, pool, saved):
    peft = pytest.importorskip("peft")
    tc, _, sampler_path = saved
    assert sampler_path.startswith("tinker://")  # as over HTTP; the pool says which directory it names
    files = sorted(os.listdir(pool.checkpoint_path(sampler_path)))
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    fresh, _ = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    model = peft.PeftModel.from_pretrained(fresh, pool.checkpoint_path(sampler_path)).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        peft_logits = model(input_ids=ids).logits[0]
        with model.disable_adapter():
            bare_logits = model(input_ids=ids).logits[0]
    sc = svc.create_sampling_client(model_path=sampler_path)
    base = pool.get_base_model(trio.DEFAULT_MODEL)
    snap = inspect(svc, pool, sc)
    adapter = LoRAAdapter.from_weights(snap.weights, snap.rank, snap.alpha)
    pool_logits = sampling.forward_logits(base, adapter, [PROMPT])[0]
    terms = model_terms(tiny_config(), len(PROMPT))
    assert (peft_logits - bare_logits).abs().max() > 1e-3  # the adapter is not a no-op
    assert_fp32_close(pool_logits, peft_logits, terms, "logits vs PEFT's")
    lps = sc.compute_logprobs(PROMPT).result()
    ref = torch.log_softmax(peft_logits, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert lps[0] is None
    assert_fp32_close(lps[1:], ref, terms, "compute_logprobs vs PEFT's")
    # the in-memory snapshot samples the very same weights
    snap = tc.save_weights_and_get_sampling_client()
    assert_fp32_close(snap.compute_logprobs(PROMPT).result()[1:], ref, terms, "snapshot vs PEFT's")


def test_an_adapter_written_by_peft_loads_in_the_pool(local, tmp_path):
    peft = pytest.importorskip("peft")
    fresh, _ = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(5)
    model = peft.get_peft_model(fresh, config).eval()
    model.save_pretrained(tmp_path / "from-peft")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0]
    sc = local.create_sampling_client(model_path=str(tmp_path / "from-peft"), base_model=trio.DEFAULT_MODEL)
    snap = sc.inspect_adapter().result()
    assert snap.scale == 16 / 4 and len(snap.weights) == 3 * 4
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert_fp32_close(sc.compute_logprobs(PROMPT).result()[1:], ref, model_terms(tiny_config(), len(PROMPT)),
                      "a PEFT adapter's logprobs in the pool vs in PEFT")


def test_checkpoints_default_to_the_user_cache_dir(monkeypatch, tmp_path):
    import platformdirs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = Path(platformdirs.user_cache_dir("trio-widgets")) / "checkpoints"
    with trio.LocalPool(min_cycle_s=0.002) as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        path = pool.checkpoint_path(tc.save_state("default-dir").result().path)
    assert path.is_relative_to(expected) and path.name == "default-dir"
    assert path.parent.name == "weights"
    if sys.platform.startswith("linux"):
        assert expected.is_relative_to(tmp_path)


def test_saving_a_name_again_replaces_it_and_leaves_nothing_behind(svc, pool):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=4)
    first = tc.save_state("again").result().path
    _step(tc, 0)
    with pytest.raises(trio.CheckpointExistsError):  # as on the hosted services: not without overwrite=True
        tc.save_state("again")
    second = tc.save_state("again", overwrite=True).result().path
    assert first == second
    second = pool.checkpoint_path(second)
    assert json.loads(Path(second, "trio_checkpoint.json").read_text())["step"] == 1
    assert sorted(p.name for p in Path(second).parent.iterdir()) == ["again"]  # no .tmp / .old left


@pytest.mark.parametrize("name", ["a/b", "../up", "..", "a\\b", "", ".hidden", None, "x" * 201, "c:d"])
def test_bad_checkpoint_names_are_rejected(saved, pool, name):
    tc, path, _ = saved
    path = pool.checkpoint_path(path)
    before = sorted(os.listdir(Path(path).parent))
    for method in (tc.save_state, tc.save_weights_for_sampler):
        with pytest.raises(trio.InvalidInputError) as info:
            method(name)
        assert info.value.field == "name"
    assert sorted(os.listdir(Path(path).parent)) == before


def _copy(path: str, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(path, target)
    return target


def _assert_clear(exc: BaseException, path: str) -> None:
    assert isinstance(exc, trio.CheckpointError) and isinstance(exc, trio.InvalidInputError)
    assert str(path) in str(exc)
    # no chained traceback from inside torch / safetensors / json
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)


def test_unknown_and_corrupted_checkpoints_give_clear_errors(svc, pool, saved, tmp_path, transport):
    tc, path, sampler_path = saved
    local, sampler_local = pool.checkpoint_path(path), pool.checkpoint_path(sampler_path)
    loaders = [tc.load_state, tc.load_state_with_optimizer, svc.create_training_client_from_state,
               lambda p: svc.create_sampling_client(model_path=p)]
    missing = str(tmp_path / "no-such-checkpoint")
    run = path.split("/")[2]
    for load in loaders:
        for unknown in (f"tinker://{run}/weights/no-such-checkpoint", "tinker://run/weights/x"):
            with pytest.raises(trio.CheckpointNotFoundError) as info:
                load(unknown)
            assert isinstance(info.value, FileNotFoundError)
            _assert_clear(info.value, unknown)
    if differs(transport, "filesystem-paths"):  # a directory of this machine is refused, naming the field
        for load in loaders:
            with pytest.raises(trio.InvalidInputError, match="tinker:// path") as refused:
                load(str(local))
            assert refused.value.field in ("path", "model_path") and not isinstance(refused.value, trio.CheckpointError)
        _check_compatibility(svc, tc, path, sampler_path)
        return
    for load in loaders:
        with pytest.raises(trio.CheckpointNotFoundError) as info:
            load(missing)
        assert isinstance(info.value, FileNotFoundError)
        _assert_clear(info.value, missing)

    truncated = _copy(local, tmp_path, "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    flipped = _copy(local, tmp_path, "flipped")
    data = bytearray((flipped / "optimizer.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (flipped / "optimizer.safetensors").write_bytes(bytes(data))
    bad_json = _copy(local, tmp_path, "bad-json")
    (bad_json / "trio_checkpoint.json").write_text("{not json")
    incomplete = _copy(local, tmp_path, "incomplete")
    (incomplete / "optimizer.safetensors").unlink()
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    peft_only = _copy(sampler_local, tmp_path, "peft-only-truncated")
    (peft_only / "trio_checkpoint.json").unlink()
    (peft_only / "adapter_model.safetensors").write_bytes(b"\x00" * 5)
    cases = {truncated: "checksum", flipped: "checksum", bad_json: "not valid JSON",
             incomplete: "missing", empty: "not a checkpoint", peft_only: "not a valid safetensors"}
    for where, message in cases.items():
        for load in loaders:
            with pytest.raises(trio.CheckpointError, match=message) as info:
                load(str(where))
            _assert_clear(info.value, str(where))
    with pytest.raises(trio.CheckpointError, match="is a file") as info:
        tc.load_state(str(local / "adapter_model.safetensors"))
    _check_compatibility(svc, tc, path, sampler_path)


def _check_compatibility(svc, tc, path: str, sampler_path: str) -> None:
    """Weights-only and made-for-another-client checkpoints are refused, naming the path."""
    with pytest.raises(trio.CheckpointError, match="no optimizer state") as info:
        tc.load_state_with_optimizer(sampler_path)
    _assert_clear(info.value, sampler_path)
    other = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=8, seed=0)
    with pytest.raises(trio.CheckpointError, match="rank 4") as info:
        other.load_state(path)
    _assert_clear(info.value, path)
    attn_only = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0, train_mlp=False)
    with pytest.raises(trio.CheckpointError, match="other layers"):
        attn_only.load_state(path)
    # nothing was queued by the failed calls, and the client still works
    assert tc.load_state(sampler_path).result().path == sampler_path


def test_a_half_finished_replace_still_loads_the_previous_checkpoint(svc, pool):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=6)
    _step(tc, 0)
    saved_as = tc.save_state("swap").result().path
    path = checkpoint_dir(svc, pool, saved_as)
    expected = _weights(svc, pool, tc)
    # the instant between moving the old directory aside and renaming the new one in
    os.rename(path, path.parent / ".swap.old-123456")
    (path.parent / ".swap.tmp-abcdef").mkdir()
    resumed = svc.create_training_client_from_state(saved_as)
    assert _same(_weights(svc, pool, resumed), expected)


def _dead_tag() -> str:
    """A sibling tag (see checkpoints._sibling_tag) of a writer that has exited: a real process's id."""
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)
    return f"{pid:06x}0badc0"


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_overwrite_swaps_the_directories_in_one_step_on_linux(tmp_path):
    from trio_widgets.engine.checkpoints import _exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    if not _exchange(a, b):
        pytest.skip("this OS or filesystem has no atomic exchange (the two-rename fallback runs)")
    assert os.listdir(a) == ["y"] and os.listdir(b) == ["x"]


@pytest.mark.no_numerics
@pytest.mark.parametrize("state", ["between the two renames", "after the exchange", "mid-write", "mid-delete",
                                   "mid-expiry", "a live writer", "our pid, before we started"])
def test_a_pool_start_finishes_what_a_killed_writer_left(local, pool, tmp_path, state):
    """Each on-disk state a save, delete or expiry update killed at that point leaves: at the next
    pool start the name loads (the previous checkpoint where the new one never got its name, the
    new one where it did) and the writer's siblings are gone; a live writer's are left alone."""
    tc = local.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=8)
    _step(tc, 0)
    old_src = pool.checkpoint_path(tc.save_state("v1").result().path)
    old_weights = _weights(local, pool, tc)
    _step(tc, 1)
    new_src = pool.checkpoint_path(tc.save_state("v2").result().path)
    new_weights = _weights(local, pool, tc)
    folder = tmp_path / "root" / "run-1" / "weights"
    folder.mkdir(parents=True)
    final = folder / "ck"
    # our own pid: a live writer's, unless the sibling is older than this process (a restarted
    # container's writer had the same pid)
    tag = f"{os.getpid():06x}a11fe0" if state in ("a live writer", "our pid, before we started") else _dead_tag()
    expected = old_weights
    if state == "between the two renames":  # old set aside, the new one not yet renamed in
        shutil.copytree(old_src, folder / f".ck.old-{tag}")
        shutil.copytree(new_src, folder / f".ck.tmp-{tag}")
    elif state == "after the exchange":  # the new one has the name; the old one half deleted
        shutil.copytree(new_src, final)
        shutil.copytree(old_src, folder / f".ck.tmp-{tag}")
        os.unlink(folder / f".ck.tmp-{tag}" / "optimizer.safetensors")
        expected = new_weights
    elif state == "mid-write":
        shutil.copytree(old_src, final)
        (folder / f".ck.tmp-{tag}").mkdir()
        (folder / f".ck.tmp-{tag}" / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    elif state == "mid-delete":
        shutil.copytree(old_src, final)
        shutil.copytree(new_src, folder / f".gone.del-{tag}")
    elif state == "mid-expiry":
        shutil.copytree(old_src, final)
        (final / f".trio_checkpoint.json.tmp-{tag}").write_text("{")
    else:
        shutil.copytree(old_src, final)
        (folder / f".ck.tmp-{tag}").mkdir()
        if state == "our pid, before we started":
            then = time.time() - 3600
            os.utime(folder / f".ck.tmp-{tag}", (then, then))

    def leftovers() -> list[str]:
        return _siblings(folder) + (_siblings(final) if final.is_dir() else [])

    before = leftovers()
    with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=str(tmp_path / "root")):
        pass
    if state == "a live writer":
        assert leftovers() == before
    else:
        assert before and leftovers() == []
    assert sorted(os.listdir(folder)) == [*_siblings(folder), "ck"]
    resumed = local.create_training_client_from_state_with_optimizer(str(final))
    assert _same(_weights(local, pool, resumed), expected)


@pytest.mark.no_numerics
def test_loading_a_name_a_killed_writer_left_set_aside_gives_it_back(local, pool, tmp_path):
    tc = local.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=9)
    _step(tc, 0)
    src = pool.checkpoint_path(tc.save_state("ck").result().path)
    folder = tmp_path / "run" / "weights"
    folder.mkdir(parents=True)
    tag = _dead_tag()
    shutil.copytree(src, folder / f".ck.old-{tag}")
    (folder / f".ck.tmp-{tag}").mkdir()
    resumed = local.create_training_client_from_state(str(folder / "ck"))
    assert _same(_weights(local, pool, resumed), _weights(local, pool, tc))
    assert os.listdir(folder) == ["ck"]


_WRITER = textwrap.dedent("""
    import hashlib, sys
    import trio_widgets as trio

    def digest(adapter):
        h = hashlib.sha256()
        for name in sorted(adapter.weights):
            for t in adapter.weights[name]:
                h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    text = [3 + b for b in b"checkpoint me, checkpoint me again and again"]
    datum = trio.Datum(trio.ModelInput.from_ints(text[:-1]), {"target_tokens": text[1:]})
    with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=sys.argv[1]) as pool:
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=128, seed=1)
        for k in range(1000):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
            print("ready", k, digest(tc.inspect_adapter().result()), flush=True)
            sys.stdin.readline()  # the parent says when to save
            path = pool.checkpoint_path(tc.save_state("latest", overwrite=True).result().path)
            print("saved", k, path, flush=True)
""")


def _digest(weights) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        for t in weights[name]:
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _files(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for folder, _dirs, names in os.walk(root):
        for name in names:
            try:
                st = os.stat(os.path.join(folder, name))
            except FileNotFoundError:  # renamed meanwhile
                continue
            out[os.path.join(folder, name)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.no_numerics
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(local, pool, tmp_path):
    """The writer saves rank-128 state (~17 MB) under one name; it is SIGKILLed as soon as the
    second save touches any file, wherever the implementation writes. The next pool's start
    leaves only the name."""
    for attempt in range(3):
        ckdir = tmp_path / f"attempt-{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(ckdir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            ready0 = proc.stdout.readline().split()
            assert ready0[:2] == ["ready", "0"], "the writer died before its first save"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            saved0 = proc.stdout.readline().split()
            path = Path(saved0[2])
            ready1 = proc.stdout.readline().split()
            assert ready1[:2] == ["ready", "1"] and ready1[2] != ready0[2]
            before = _files(ckdir)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 30
            while _files(ckdir) == before and time.monotonic() < deadline:
                pass
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
            rest = proc.stdout.read()
            proc.stdout.close()
            proc.stdin.close()
        interrupted = "saved 1" not in rest and any(p.name.startswith(".latest.tmp-") for p in path.parent.iterdir())
        with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=str(ckdir)):  # its start cleans up after the kill
            pass
        assert os.listdir(path.parent) == ["latest"]
        resumed = local.create_training_client_from_state_with_optimizer(str(path))  # must load, whatever the moment
        got = _digest(_weights(local, pool, resumed))
        assert got in (ready0[2], ready1[2])
        if not interrupted:
            continue  # the save finished before the kill: try again
        assert got == ready0[2]  # the previous checkpoint, intact
        assert resumed.inspect_adapter().result().step == 1
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors",
                                            "optimizer.safetensors", "trio_checkpoint.json"]
        return
    pytest.fail("the kill never landed in the middle of a save")


def test_a_listing_shows_each_change_on_disk_at_once(svc, pool):
    """Listings keep what they read of each checkpoint while it is unchanged (engine/checkpoints.py
    `_listed`): a replace, a TTL, a manifest broken on disk and a deletion each show in the next
    listing, through every codec."""
    rest = svc.create_rest_client()
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=5)
    path = tc.save_state("listed").result().path
    tc.save_state("kept").result()

    def listed() -> dict[str, trio.types.Checkpoint]:
        return {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    first = listed()["weights/listed"]
    assert first.expires_at is None and set(listed()) == {"weights/listed", "weights/kept"}
    _step(tc, 0)
    tc.save_state("listed", overwrite=True).result()  # a new directory: its own time
    assert listed()["weights/listed"].time >= first.time
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()  # the manifest rewritten in place
    assert listed()["weights/listed"].expires_at is not None
    directory = checkpoint_dir(svc, pool, path)
    manifest = directory / "trio_checkpoint.json"
    manifest.write_text(manifest.read_text()[:-5])  # a lie on disk: not listed (loading it names it)
    assert set(listed()) == {"weights/kept"}
    shutil.rmtree(directory)
    assert set(listed()) == {"weights/kept"}
    rest.delete_checkpoint(tc.model_id, "weights/kept").result()
    assert listed() == {}
    tc.close()
