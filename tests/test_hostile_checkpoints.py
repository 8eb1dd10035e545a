"""Hostile and corrupt checkpoints, made for real on disk: manifests naming files outside the
checkpoint (or /dev/zero), symlinks and FIFOs, oversized files, and every value out of range.

Each load must fail at once with a CheckpointError naming the path and what is wrong, and
leave everything as it was. Loads run in a thread with a deadline, so a loader that blocks
(on a FIFO) or reads without end fails its test instead of hanging the suite.

Through every transport (conftest.py's transport): in-process a forged checkpoint is a directory
the caller names; over HTTP it is forged in the key's own run on the server's disk and named by
its tinker:// path (the server's directories are not the caller's to name), and every error names
that path, never the server's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transports import checkpoint_dir, differs, inspect, pool_client_id, service

import trio_widgets as trio
from trio_widgets.engine import checkpoints as ckpt
from trio_widgets.engine.lora import LoRAAdapter
from trio_widgets.engine.models import load_base_model

MANIFEST, CONFIG = "trio_checkpoint.json", "adapter_config.json"
WEIGHTS, OPTIMIZER = "adapter_model.safetensors", "optimizer.safetensors"
TEXT = [3 + b for b in b"It was the best of times, it was the worst of times"]
DEADLINE_S = 30.0  # a real load of these rank-4 checkpoints takes milliseconds


# -- fixtures and helpers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.002, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))) as pool:
        yield pool


@pytest.fixture(scope="module")
def svc(pool, transport):
    with service(transport, pool) as s:
        yield s


@pytest.fixture(scope="module")
def saved(svc, pool):
    """A rank-4 client after 2 updates (so it has AdamW moments), with its state and sampler checkpoints,
    as the directories on disk their tinker:// paths name (this module forges copies of their files),
    and the paths themselves."""
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=2)
    datum = trio.Datum(trio.ModelInput.from_ints(TEXT[:-1]), {"target_tokens": TEXT[1:]})
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=60)
    state = tc.save_state("good").result(timeout=60).path
    weights = tc.save_weights_for_sampler("good-w").result(timeout=60).path
    return tc, str(checkpoint_dir(svc, pool, state)), str(checkpoint_dir(svc, pool, weights)), state, weights


class Place:
    """Where a test forges checkpoint `name`, and how a caller names it: in-process a directory
    under the test's tmp_path; over HTTP a directory in the client's own run on the server's disk,
    named by its tinker:// path (each test's names are its own: over HTTP a name is `<prefix>-<name>`)."""

    def __init__(self, svc: trio.ServiceClient, pool: trio.LocalPool, tc: Any, transport: str, tmp_path: Path,
                 prefix: str = ""):
        self.svc, self.pool, self.tc, self.transport, self.tmp_path = svc, pool, tc, transport, tmp_path
        self.prefix = prefix

    def path(self, name: str, segment: str = "weights") -> str:
        if differs(self.transport, "filesystem-paths"):
            if self.prefix:
                name = f"{self.prefix}-{name}"[:200]
            return f"tinker://{self.tc.model_id}/{segment}/{name}"
        return str(self.tmp_path / name)

    def dir(self, name: str, segment: str = "weights") -> Path:
        return checkpoint_dir(self.svc, self.pool, self.path(name, segment))

    def given(self, directory: Path) -> str:
        """How a caller names the forged checkpoint at `directory` (made by dir())."""
        if differs(self.transport, "filesystem-paths"):
            return f"tinker://{self.tc.model_id}/{directory.parent.name}/{directory.name}"
        return str(directory)


@pytest.fixture
def place(svc, pool, saved, transport, tmp_path, request) -> Place:
    # (over HTTP the run's directory is shared by the module's tests: each test its own names)
    prefix = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return Place(svc, pool, saved[0], transport, tmp_path, prefix=prefix)


class _Fifos:
    """FIFOs a test made: a reader blocked on one is let go (EOF) when the test ends."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def make(self, path: Path) -> Path:
        os.mkfifo(path)
        self.paths.append(path)
        return path

    def release(self) -> None:
        for path in self.paths:
            try:  # succeeds only if a reader is blocked in open(): it then reads EOF
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


@pytest.fixture
def fifos():
    made = _Fifos()
    yield made
    made.release()


def _within(call: Callable[[], Any], fifos: _Fifos | None = None) -> BaseException | None:
    """Run `call` in a thread; the exception it raised (None if none), or fail if it is still running."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, name="hostile-load", daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        if fifos is not None:
            fifos.release()
        pytest.fail(f"the load was still running after {DEADLINE_S:.0f} s: it blocked or read without end")
    return box.get("error")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None], metadata: dict | None = None) -> None:
    data = path.read_bytes()
    tensors = st_load(data)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    edit(tensors)
    path.write_bytes(st_save(tensors, metadata={**header.get("__metadata__", {}), **(metadata or {})}))


def _forge(src: str, dst: Path, *, weights: Callable | None = None, moments: Callable | None = None,
           opt_meta: dict | None = None, config: Callable | None = None, manifest: Callable | None = None) -> Path:
    """A copy of checkpoint `src` with edits, its manifest's checksums brought up to date
    (so the checksum passes and what is checked is the forged value itself)."""
    shutil.copytree(src, dst)
    if weights is not None:
        _edit_tensors(dst / WEIGHTS, weights)
    if moments is not None or opt_meta is not None:
        _edit_tensors(dst / OPTIMIZER, moments or (lambda t: None), opt_meta)
    if config is not None:
        cfg = json.loads((dst / CONFIG).read_text())
        config(cfg)
        (dst / CONFIG).write_text(json.dumps(cfg))
    if (dst / MANIFEST).exists():
        meta = json.loads((dst / MANIFEST).read_text())
        for fname in meta["files"]:
            data = (dst / fname).read_bytes()
            meta["files"][fname] = {"sha256": _sha(data), "bytes": len(data)}
        if manifest is not None:
            manifest(meta)
        (dst / MANIFEST).write_text(json.dumps(meta))  # NaN is written as JSON's NaN literal
    return dst


def _peft(sampler_path: str, dst: Path, **edits: Any) -> Path:
    """A PEFT adapter directory (no trio manifest), as another tool writes one."""
    out = _forge(sampler_path, dst, **edits)
    (out / MANIFEST).unlink()
    return out


def _state_of(svc: trio.ServiceClient, pool: trio.LocalPool, tc: trio.TrainingClient) -> tuple:
    snap = inspect(svc, pool, tc)
    flat = lambda table: [t.clone() for name in sorted(table) for t in table[name]]  # noqa: E731
    return snap.step, flat(snap.weights), flat(snap.exp_avg), flat(snap.exp_avg_sq)


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
                                for x, y in zip(a[1:], b[1:]))


def _loaders(svc: trio.ServiceClient, tc: trio.TrainingClient) -> list[tuple[str, Callable[[str], Any]]]:
    return [("load_state", tc.load_state), ("load_state_with_optimizer", tc.load_state_with_optimizer),
            ("create_training_client_from_state", svc.create_training_client_from_state),
            ("create_training_client_from_state_with_optimizer", svc.create_training_client_from_state_with_optimizer),
            ("create_sampling_client", lambda p: svc.create_sampling_client(model_path=p))]


def _assert_rejected(svc, pool, tc, path: Path | str, match: str, fifos: _Fifos | None = None,
                     loaders: list | None = None) -> None:
    """Every loader fails fast with a clear CheckpointError naming the path as the caller gave it,
    and nothing changed anywhere."""
    before, tenants = _state_of(svc, pool, tc), pool.tenant_count
    ops = len(pool.telemetry.requests_of(pool_client_id(svc, tc)))
    for label, load in loaders or _loaders(svc, tc):
        exc = _within(lambda load=load: load(str(path)), fifos)
        assert exc is not None, f"{label} loaded the hostile checkpoint {path}"
        assert isinstance(exc, trio.CheckpointError) and isinstance(exc, trio.InvalidInputError), \
            f"{label}: {type(exc).__name__}: {exc}"
        assert str(path) in str(exc) and exc.path == str(path), f"{label}: the error does not name the path: {exc}"
        assert re.search(match, str(exc)), f"{label}: {exc!s} does not match {match!r}"
        assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
        if str(path).startswith("tinker://"):
            assert str(ckpt.checkpoint_root(pool)) not in str(exc), f"{label}: the error names the server's disk: {exc}"
    assert pool.tenant_count == tenants  # no client was created
    assert len(pool.telemetry.requests_of(pool_client_id(svc, tc))) == ops  # nothing was queued
    assert _same_state(_state_of(svc, pool, tc), before)  # weights, moments and step untouched


def _outside_copy_of_weights(path: str, tmp_path: Path) -> Path:
    outside = tmp_path / "outside" / "stolen.safetensors"
    outside.parent.mkdir(exist_ok=True)
    shutil.copyfile(Path(path) / WEIGHTS, outside)
    return outside


# -- manifest file names stay inside the checkpoint directory ---------------------------------------

def _bad_names(ckpt_dir: Path, tmp_path: Path, state_path: str) -> list[tuple[str, bytes | None]]:
    """(name listed in the manifest, the bytes it would read: its real checksum goes in)."""
    outside = _outside_copy_of_weights(state_path, tmp_path)
    names: list[tuple[str, bytes | None]] = [
        ("/dev/zero", None),  # read until MemoryError, before
        (os.path.relpath(outside, ckpt_dir), outside.read_bytes()),
        (str(outside), outside.read_bytes()),
        ("sub/" + WEIGHTS, None), ("..", None), (".", None), ("", None), ("README.md", None),
        (WEIGHTS + "\x00", None), ("~/" + WEIGHTS, None),
    ]
    hostname = Path("/etc/hostname")
    if hostname.is_file():  # the issue's own case, with the file's real checksum
        names.append(("../" * 12 + "etc/hostname", hostname.read_bytes()))
    return names


def test_manifest_file_names_cannot_leave_the_directory(svc, pool, saved, tmp_path, fifos, place):
    tc, path, *_ = saved
    for i, (name, content) in enumerate(_bad_names(place.dir("c"), tmp_path, path)):  # c0, c1...: same depth
        entry = {"sha256": _sha(content) if content is not None else "0" * 64,
                 "bytes": len(content) if content is not None else 0}
        forged = _forge(path, place.dir(f"c{i}"),
                        manifest=lambda m, name=name, entry=entry: m["files"].__setitem__(name, entry))
        _assert_rejected(svc, pool, tc, place.given(forged), rf"lists the file {re.escape(repr(name)[:60])}", fifos)


# -- only regular files, never through a symlink ---------------------------------------------------

def test_symlinks_fifos_and_devices_are_never_read(svc, pool, saved, tmp_path, fifos, place):
    tc, path, sampler_path, *_ = saved
    outside = _outside_copy_of_weights(path, tmp_path)
    cases: list[tuple[Path, str]] = []

    link_out = _forge(path, place.dir("link-out"))  # the same bytes, so the checksum matches
    (link_out / WEIGHTS).unlink()
    (link_out / WEIGHTS).symlink_to(outside)
    cases.append((link_out, f"{WEIGHTS} is a symbolic link"))

    link_in = _forge(path, place.dir("link-in"))  # even to a file inside the directory
    os.rename(link_in / WEIGHTS, link_in / "real.safetensors")
    (link_in / WEIGHTS).symlink_to("real.safetensors")
    cases.append((link_in, f"{WEIGHTS} is a symbolic link"))

    to_fifo = _forge(path, place.dir("link-fifo"))  # the case: blocked the loader
    (to_fifo / WEIGHTS).unlink()
    (to_fifo / WEIGHTS).symlink_to(fifos.make(tmp_path / "pipe"))
    cases.append((to_fifo, f"{WEIGHTS} is a symbolic link"))

    fifo = _forge(path, place.dir("fifo"))
    (fifo / WEIGHTS).unlink()
    fifos.make(fifo / WEIGHTS)
    cases.append((fifo, f"{WEIGHTS} is a FIFO"))

    fifo_manifest = _forge(path, place.dir("fifo-manifest"))
    (fifo_manifest / MANIFEST).unlink()
    fifos.make(fifo_manifest / MANIFEST)
    cases.append((fifo_manifest, f"{MANIFEST} is a FIFO"))

    zero_manifest = _forge(path, place.dir("zero-manifest"))
    (zero_manifest / MANIFEST).unlink()
    (zero_manifest / MANIFEST).symlink_to("/dev/zero")
    cases.append((zero_manifest, f"{MANIFEST} is a symbolic link"))

    folder = _forge(path, place.dir("folder"))
    (folder / OPTIMIZER).unlink()
    (folder / OPTIMIZER).mkdir()
    cases.append((folder, f"{OPTIMIZER} is a directory"))

    # PEFT layout: no manifest to check against
    peft_zero = _peft(sampler_path, place.dir("peft-zero", "sampler_weights"))
    (peft_zero / CONFIG).unlink()
    (peft_zero / CONFIG).symlink_to("/dev/zero")
    cases.append((peft_zero, f"{CONFIG} is a symbolic link"))

    peft_fifo = _peft(sampler_path, place.dir("peft-fifo", "sampler_weights"))
    (peft_fifo / WEIGHTS).unlink()
    fifos.make(peft_fifo / WEIGHTS)
    cases.append((peft_fifo, f"{WEIGHTS} is a FIFO"))

    for where, match in cases:
        _assert_rejected(svc, pool, tc, place.given(where), re.escape(match), fifos)


# -- bounded sizes, checked before reading ---------------------------------------------------------------

def test_file_sizes_are_bounded_before_anything_is_read(svc, pool, saved, tmp_path, fifos, place):
    tc, path, sampler_path, *_ = saved
    limits = ckpt.file_limits(pool)
    # sparse files: no disk used, but the old loader would have read all of it
    huge = _forge(path, place.dir("huge-weights"))
    os.truncate(huge / WEIGHTS, 64 << 30)
    meta = json.loads((huge / MANIFEST).read_text())
    meta["files"][WEIGHTS]["bytes"] = 64 << 30
    (huge / MANIFEST).write_text(json.dumps(meta))
    _assert_rejected(svc, pool, tc, place.given(huge),
                     rf"{WEIGHTS} is {64 << 30} bytes, more than the {limits[WEIGHTS]} bytes", fifos)

    huge_opt = _forge(path, place.dir("huge-optimizer"))
    os.truncate(huge_opt / OPTIMIZER, 64 << 30)
    _assert_rejected(svc, pool, tc, place.given(huge_opt), rf"{OPTIMIZER} is {64 << 30} bytes, more than", fifos)

    big_manifest = _forge(path, place.dir("big-manifest"))
    text = (big_manifest / MANIFEST).read_text()
    (big_manifest / MANIFEST).write_text(text + " " * ckpt.MAX_JSON_BYTES)  # valid JSON, just too big
    _assert_rejected(svc, pool, tc, place.given(big_manifest),
                     rf"{MANIFEST} is \d+ bytes, more than the {ckpt.MAX_JSON_BYTES}", fifos)

    peft_big = _peft(sampler_path, place.dir("peft-big-config", "sampler_weights"))
    os.truncate(peft_big / CONFIG, 1 << 40)
    _assert_rejected(svc, pool, tc, place.given(peft_big), rf"{CONFIG} is {1 << 40} bytes, more than", fifos)


def test_the_size_limit_follows_the_pools_max_rank_and_can_be_set(pool, tmp_path):
    """(In-process: pools of their own, checkpoints named by their directories.)"""
    svc = trio.ServiceClient(pool)
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=2)
    path = str(pool.checkpoint_path(tc.save_state("size-limit").result(timeout=60).path))
    with trio.LocalPool(min_cycle_s=0.002, max_rank=4) as small:
        small_limit = ckpt.file_limits(small)[WEIGHTS]
        # rank x features x 4 bytes (+ the header): the largest adapter this pool could have written
        assert small_limit == 4 * ckpt.MAX_LORA_FEATURES * 4 + ckpt._HEADER_BYTES
        assert small_limit < ckpt.file_limits(svc.pool)[WEIGHTS]
        mid = _forge(path, tmp_path / "mid")  # over the rank-4 pool's bound, under the default pool's
        os.truncate(mid / WEIGHTS, small_limit + 1)
        meta = json.loads((mid / MANIFEST).read_text())
        meta["files"][WEIGHTS]["bytes"] = small_limit + 1
        (mid / MANIFEST).write_text(json.dumps(meta))
        small_svc = trio.ServiceClient(small)
        exc = _within(lambda: small_svc.create_sampling_client(model_path=str(mid)))
        assert isinstance(exc, trio.CheckpointError) and f"more than the {small_limit} bytes" in str(exc)
        exc = _within(lambda: svc.create_sampling_client(model_path=str(mid)))  # read, then refused by checksum
        assert isinstance(exc, trio.CheckpointError) and "checksum" in str(exc)
        # the good checkpoint loads in the small pool; a pool-wide byte cap below its size refuses it
        assert small_svc.create_sampling_client(model_path=path).get_tokenizer() is not None
        small.max_checkpoint_bytes = 1000
        exc = _within(lambda: small_svc.create_sampling_client(model_path=path))
        assert isinstance(exc, trio.CheckpointError) and f"{WEIGHTS} is " in str(exc) \
            and "more than the 1000 bytes" in str(exc)


# -- every value is validated -----------------------------------------------------------------------------

def _first(suffix: str) -> Callable[[dict[str, torch.Tensor]], str]:
    return lambda tensors: sorted(k for k in tensors if k.endswith(suffix))[0]


def _set_value(suffix: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[_first(suffix)(tensors)].view(-1)[3] = value
    return edit


def _retype(suffix: str, dtype: torch.dtype, value: float | None = None) -> Callable:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        key = _first(suffix)(tensors)
        tensors[key] = tensors[key].to(dtype)
        if value is not None:
            tensors[key].view(-1)[0] = value
    return edit


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda meta: meta.__setitem__(key, value)


def _shrink_b(tensors: dict[str, torch.Tensor]) -> None:
    key = _first("lora_B.weight")(tensors)
    tensors[key] = tensors[key][:, :3].contiguous()


def _shrink_moment(tensors: dict[str, torch.Tensor]) -> None:
    key = _first(".lora_A")(tensors)
    tensors[key] = tensors[key][:, :5].contiguous()


def _duplicate_a(tensors: dict[str, torch.Tensor]) -> None:
    key = _first("lora_A.weight")(tensors)
    tensors[key.replace(".lora_A.weight", ".lora_A.default.weight")] = tensors[key].clone()


STATE_CASES = {
    # weights and moments: finite floats
    "weights-nan": (dict(weights=_set_value("lora_A.weight", float("nan"))),
                    rf"{WEIGHTS} tensor '[^']+lora_A\.weight' holds NaN or infinite values"),
    "weights-inf": (dict(weights=_set_value("lora_B.weight", float("inf"))),
                    rf"{WEIGHTS} tensor '[^']+lora_B\.weight' holds NaN or infinite"),
    "weights-f64-beyond-f32": (dict(weights=_retype("lora_A.weight", torch.float64, 1e300)),
                               rf"{WEIGHTS} tensor '[^']+lora_A\.weight' holds NaN or infinite values \(as float32\)"),
    "weights-int": (dict(weights=_retype("lora_A.weight", torch.int32)), r"has dtype int32"),
    "exp-avg-inf": (dict(moments=_set_value("lora_A", float("-inf"))),
                    rf"{OPTIMIZER} tensor 'exp_avg\.[^']+' holds NaN or infinite"),
    "exp-avg-sq-nan": (dict(moments=lambda t: t[sorted(k for k in t if k.startswith("exp_avg_sq."))[0]]
                            .view(-1).__setitem__(0, float("nan"))),
                       rf"{OPTIMIZER} tensor 'exp_avg_sq\.[^']+' holds NaN"),
    "exp-avg-sq-negative": (dict(moments=lambda t: t[sorted(k for k in t if k.startswith("exp_avg_sq."))[0]]
                                 .view(-1).__setitem__(0, -1.0)),
                            rf"{OPTIMIZER} tensor 'exp_avg_sq\.[^']+' holds negative values"),
    # shapes
    "lora-pair-mismatch": (dict(weights=_shrink_b), r"do not make a LoRA pair"),
    "moment-shape": (dict(moments=_shrink_moment), r"optimizer state of .* has the wrong shape"),
    "extra-moment": (dict(moments=lambda t: t.__setitem__("exp_avg.evil.lora_A", torch.zeros(2))),
                     rf"{OPTIMIZER} holds 'exp_avg\.evil\.lora_A', which is not a moment"),
    "duplicate-lora-a": (dict(weights=_duplicate_a), r"holds two lora_A weights"),
    # alpha
    "alpha-nan": (dict(manifest=_set("alpha", float("nan"))), rf"{MANIFEST} 'alpha' must be a finite number.*got nan"),
    "alpha-huge": (dict(manifest=_set("alpha", 1e308)), r"'alpha' must be a finite number above 0 and at most"),
    "alpha-zero": (dict(manifest=_set("alpha", 0)), r"'alpha' must be .*got 0"),
    "alpha-negative": (dict(manifest=_set("alpha", -32.0)), r"'alpha' must be .*got -32\.0"),
    "alpha-string": (dict(manifest=_set("alpha", "32")), r"'alpha' must be .*got '32'"),
    "alpha-bool": (dict(manifest=_set("alpha", True)), r"'alpha' must be .*got True"),
    # rank
    "rank-zero": (dict(manifest=_set("rank", 0)), rf"{MANIFEST} 'rank' must be an integer from 1 to the pool's "
                                                  rf"max_rank 128, got 0"),
    "rank-negative": (dict(manifest=_set("rank", -4)), r"'rank' must be an integer from 1 .*got -4"),
    "rank-over-max": (dict(manifest=_set("rank", 129)), r"'rank' must be an integer from 1 .*got 129"),
    "rank-float": (dict(manifest=_set("rank", 4.5)), r"'rank' must be an integer .*got 4\.5"),
    "rank-string": (dict(manifest=_set("rank", "4")), r"'rank' must be an integer .*got '4'"),
    "rank-enormous": (dict(manifest=_set("rank", 10 ** 400)), r"'rank' must be an integer .*got 1000"),
    # optimizer step, in the optimizer file and in the manifest
    "step-negative": (dict(opt_meta={"step": "-1"}), rf"{OPTIMIZER} 'step' must be a whole number from 0 .*got '-1'"),
    "step-huge": (dict(opt_meta={"step": str(2 ** 60)}), rf"{OPTIMIZER} 'step' must be a whole number"),
    "step-float": (dict(opt_meta={"step": "1e3"}), rf"{OPTIMIZER} 'step' must be a whole number .*got '1e3'"),
    "manifest-step-negative": (dict(manifest=_set("step", -1)), rf"{MANIFEST} 'step' must be an integer from 0"),
    "manifest-step-differs": (dict(manifest=_set("step", 7)), rf"{MANIFEST} says step 7, {OPTIMIZER} says 2"),
    # seed
    "seed-huge": (dict(manifest=_set("seed", 2 ** 70)), rf"{MANIFEST} 'seed' must be an integer from -\d+ to \d+"),
    "seed-float": (dict(manifest=_set("seed", 1.5)), r"'seed' must be an integer"),
    # the rest of the manifest
    "targets-not-a-list": (dict(manifest=_set("targets", "model.layers.0.self_attn.q_proj")),
                           r"'targets' must be a list of distinct module names"),
    "targets-mixed-types": (dict(manifest=_set("targets", [1, "a"])), r"'targets' must be a list"),
    "train-flag-string": (dict(manifest=_set("train_mlp", "false")), r"'train_mlp' must be true or false"),
    "kind-unknown": (dict(manifest=_set("kind", "root")), r"'kind' must be 'state' or 'sampler'"),
    "base-model-not-text": (dict(manifest=_set("base_model", 5)), r"'base_model' must be a model name"),
    "version-bool": (dict(manifest=_set("version", True)), r"'version' must be a format version"),
    "sha-not-hex": (dict(manifest=lambda m: m["files"][WEIGHTS].__setitem__("sha256", None)),
                    rf"'files\.{re.escape(WEIGHTS)}\.sha256' must be a sha256 hex digest"),
    "bytes-negative": (dict(manifest=lambda m: m["files"][WEIGHTS].__setitem__("bytes", -1)),
                       rf"'files\.{re.escape(WEIGHTS)}\.bytes' must be a size in bytes"),
    "peft-config-disagrees": (dict(config=_set("r", 8)), rf"{CONFIG} has r=8, lora_alpha=32\.0; {MANIFEST} has rank 4"),
}


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_every_value_in_a_checkpoint_is_validated(svc, pool, saved, tmp_path, case, place):
    tc, path, *_ = saved
    edits, match = STATE_CASES[case]
    forged = _forge(path, place.dir(case), **edits)
    _assert_rejected(svc, pool, tc, place.given(forged), match)


PEFT_CASES = {
    "r-zero": (dict(config=_set("r", 0)), rf"{CONFIG} 'r' must be an integer from 1 to the pool's max_rank 128, got 0"),
    "r-huge": (dict(config=_set("r", 2 ** 70)), rf"{CONFIG} 'r' must be an integer"),
    "alpha-nan": (dict(config=_set("lora_alpha", float("nan"))), rf"{CONFIG} 'lora_alpha' must be a finite number"),
    "alpha-huge": (dict(config=_set("lora_alpha", 1e308)), rf"{CONFIG} 'lora_alpha' must be a finite number"),
    "alpha-negative": (dict(config=_set("lora_alpha", -8)), rf"{CONFIG} 'lora_alpha' must be .*got -8"),
    "base-not-text": (dict(config=_set("base_model_name_or_path", ["x"])),
                      rf"{CONFIG} 'base_model_name_or_path' must be a model name or null"),
    "weights-nan": (dict(weights=_set_value("lora_B.weight", float("nan"))),
                    rf"{WEIGHTS} tensor '[^']+lora_B\.weight' holds NaN"),
    # json's recursion limit: a bare RecursionError, before
    "nested-json": (dict(raw_config="[" * 100_000 + "]" * 100_000), rf"{CONFIG} is not valid JSON \(RecursionError"),
}


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_peft_adapters_from_other_tools_are_validated_too(svc, pool, saved, tmp_path, case, place):
    tc, _, sampler_path, *_ = saved
    edits, match = PEFT_CASES[case]
    edits = dict(edits)
    raw = edits.pop("raw_config", None)
    forged = _peft(sampler_path, place.dir(case, "sampler_weights"), **edits)
    if raw is not None:
        (forged / CONFIG).write_text(raw)
    _assert_rejected(svc, pool, tc, place.given(forged), match)


def test_the_adapter_itself_rejects_bad_arguments():
    """Rank 0 was a ZeroDivisionError and seed 2**70 a bare overflow, deep inside."""
    targets = {"layer": (4, 4)}
    cpu = torch.device("cpu")
    for kwargs, message in ((dict(rank=0, seed=0), "rank must be an integer of at least 1, got 0"),
                            (dict(rank=2, seed=2 ** 70), "seed must be an integer from -2\\*\\*63"),
                            (dict(rank=2, seed=0, alpha=float("nan")), "alpha must be a finite number above 0"),
                            (dict(rank=2, seed=0, alpha=0.0), "alpha must be a finite number above 0")):
        with pytest.raises(ValueError, match=message):
            LoRAAdapter(targets, device=cpu, **kwargs)
    weights = {"layer": (torch.zeros(0, 4), torch.zeros(4, 0))}
    with pytest.raises(ValueError, match="rank must be an integer of at least 1, got 0"):
        LoRAAdapter.from_weights(weights, rank=0)


def test_a_good_checkpoint_still_loads_everywhere(svc, pool, saved):
    """The checks above refuse nothing a real save writes (and a load still changes the client)."""
    tc, _, _, path, sampler_path = saved
    resumed = svc.create_training_client_from_state_with_optimizer(path)
    assert _same_state(_state_of(svc, pool, resumed), _state_of(svc, pool, tc))
    assert svc.create_sampling_client(model_path=sampler_path) is not None
    other = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=99)
    other.load_state_with_optimizer(path).result(timeout=60)
    assert _same_state(_state_of(svc, pool, other), _state_of(svc, pool, tc))


# -- checkpoint names ------------------------------------------------------------------------------------

def test_names_are_bounded_by_their_encoded_length(saved, pool):
    tc, path, *_ = saved
    parent = Path(path).parent
    before = sorted(os.listdir(parent))
    for name, message in (("é" * 200, f"must be at most {ckpt.MAX_NAME_BYTES} bytes encoded"),
                          ("é" * 118 + "ab", f"at most {ckpt.MAX_NAME_BYTES} bytes encoded .*got 238 bytes"),
                          ("\ud800", "must be text the filesystem can store")):
        for method in (tc.save_state, tc.save_weights_for_sampler,
                       tc.save_weights_and_get_sampling_client):
            with pytest.raises(trio.InvalidInputError, match=message) as info:
                method(name)
            assert info.value.field == "name"
    assert sorted(os.listdir(parent)) == before  # nothing written

    # the longest name allowed really saves, and saves again (the `.old-` sibling fits too)
    longest = "é" * 118 + "a"
    assert len(longest.encode()) == ckpt.MAX_NAME_BYTES
    first = tc.save_state(longest).result(timeout=60).path
    assert tc.save_state(longest, overwrite=True).result(timeout=60).path == first
    first = pool.checkpoint_path(first)
    assert first.name == longest and sorted(os.listdir(first)) == sorted([MANIFEST, CONFIG, WEIGHTS, OPTIMIZER])


# -- tokenizer classes named by a local model --------------------------------------------------------------

def _save_tiny_qwen2(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trio_widgets.engine.models import byte_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def _set_json(path: Path, key: str, value: Any) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))


def test_only_tokenizer_classes_are_loaded_as_tokenizers(tmp_path):
    model_dir = tmp_path / "qwen2"
    _save_tiny_qwen2(model_dir)
    cpu = torch.device("cpu")
    base = load_base_model(str(model_dir), cpu)
    assert type(base.tokenizer).__name__ == "ByT5Tokenizer"  # a real tokenizer class still loads

    not_a_tokenizer = "transformers.AutoModelForCausalLM is not a tokenizer"
    cases = [("tokenizer_config.json", "AutoModelForCausalLM", not_a_tokenizer),
             # AutoTokenizer strips "Fast" and tries again: the same class by another name
             ("tokenizer_config.json", "AutoModelForCausalLMFast", not_a_tokenizer),
             ("tokenizer_config.json", "AutoTokenizer", "transformers.AutoTokenizer is not a tokenizer"),
             ("tokenizer_config.json", "os.system", "which is not a class name"),
             ("tokenizer_config.json", 123, "which is not a class name"),
             ("config.json", "AutoModelForCausalLM", not_a_tokenizer)]  # AutoTokenizer reads this one too
    for fname, named, message in cases:
        forged = tmp_path / f"forged-{fname}-{named}"
        shutil.copytree(model_dir, forged)
        _set_json(forged / fname, "tokenizer_class", named)
        with pytest.raises(trio.UnknownModelError, match=re.escape(message)) as info:
            load_base_model(str(forged), cpu)
        assert str(forged / fname) in str(info.value) and info.value.field == "base_model"


def test_save_and_load_accept_the_same_metadata_and_names(svc, pool, place):
    """What a save accepts, a load accepts (issue 36: 5 MiB of metadata saved, then never loadable):
    metadata at its limits (entries, then bytes) and the longest name save and load back; one past
    a limit is refused at save, naming the field, and nothing is written; a manifest someone else
    wrote past the limit is refused at load, naming the key."""
    from trio_widgets.validation import MAX_USER_METADATA_BYTES, MAX_USER_METADATA_ENTRIES

    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=3)
    most_entries = {f"k{i}": "v" for i in range(MAX_USER_METADATA_ENTRIES)}
    overhead = len(json.dumps({"k": ""}).encode())
    most_bytes = {"k": "x" * (MAX_USER_METADATA_BYTES - overhead)}
    longest = "n" * min(ckpt.MAX_NAME_BYTES, 200)  # (names are at most 200 characters too)
    for name, meta in [("entries", most_entries), ("bytes", most_bytes), (longest, {"a": "b"})]:
        path = tc.save_state(name, user_metadata=meta).result(timeout=60).path
        resumed = svc.create_training_client_from_state_with_optimizer(path)
        assert _same_state(_state_of(svc, pool, resumed), _state_of(svc, pool, tc))
        listed = {c.checkpoint_id: c for c in trio.RestClient(pool).list_checkpoints(tc.model_id).result().checkpoints}
        assert listed[f"weights/{name}"].user_metadata == meta
    run_dir = checkpoint_dir(svc, pool, path).parent
    before = sorted(os.listdir(run_dir))
    for meta in [{**most_entries, "one-more": "v"}, {"k": "x" * (MAX_USER_METADATA_BYTES - overhead + 1)}]:
        with pytest.raises(trio.InvalidInputError) as info:
            tc.save_state("over", user_metadata=meta)
        assert info.value.field == "user_metadata"
    assert sorted(os.listdir(run_dir)) == before
    forged = _forge(checkpoint_dir(svc, pool, path), place.dir("forged"),
                    manifest=lambda m: m.__setitem__("user_metadata", {f"k{i}": "v" for i in range(65)}))
    with pytest.raises(trio.CheckpointError, match="user_metadata"):
        svc.create_training_client_from_state(place.given(forged))
