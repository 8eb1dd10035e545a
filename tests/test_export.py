"""Exports (issue 23): a checkpoint's PEFT directory on the caller's machine, through the tinker
SDK (save_weights_external + get_external_weights_urls, fetched with urllib as tinker_cookbook
does), trio's client over HTTP (download_checkpoint, get_checkpoint_archive_url) and in-process,
bitwise the same; and what is refused: another key's checkpoint (404), a forged or expired URL
(403), an export over the limit, a path traversal, a symlink in a checkpoint, a hostile archive."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from served import adapter_file, same_tensors, sdk_client, served, tinker_env

import trio_widgets as trio
from trio_widgets.export import extract_tar

if sys.version_info < (3, 11):
    pytest.skip("the tinker SDK needs Python >= 3.11", allow_module_level=True)

import tinker  # noqa: E402

KEY, OTHER = "tml-export-tests", "tml-export-other"
PEFT = ["adapter_config.json", "adapter_model.safetensors"]
TOKENS = [3 + b for b in b"It was the best of times, it was the worst of times"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.005, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                        name="export") as p:
        yield p


@pytest.fixture(scope="module")
def server(pool):
    with served(pool, api_keys=[KEY, OTHER]) as s:
        yield s


@pytest.fixture
def sdk(server, monkeypatch):
    yield from sdk_client(server, KEY, monkeypatch)


@pytest.fixture(scope="module")
def trained(server):
    """A run of KEY trained one step (LoRA B is no longer zero), saved: (trio HTTP service, its
    training client, the save_state tinker:// path)."""
    service = trio.ServiceClient(base_url=server.url, api_key=KEY)
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=3)
    datum = trio.Datum(trio.ModelInput.from_ints(TOKENS[:-1]), {"target_tokens": TOKENS[1:]})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result(timeout=60)
    path = tc.save_state("exported").result(timeout=60).path
    yield service, tc, path
    service.close()


def _fetch(url: str, destination: Path) -> None:
    """What tinker_cookbook's weights.download does with each URL (no key, plain urllib)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    urllib.request.urlretrieve(url, str(destination))


def _http_status(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _files(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


# -- the three paths give the same directory -----------------------------------------------------

def test_tinker_sdk_trio_http_and_in_process_give_the_same_peft_directory(sdk, server, pool, trained, tmp_path):
    peft = pytest.importorskip("peft")
    _service, tc, path = trained
    original = server.checkpoint_path(path, KEY)

    # the tinker SDK: an export of the same weights, then one signed URL per file (tinker's route)
    sdk_tc = sdk.create_training_client_from_state(path).result(timeout=60)
    export = sdk_tc.save_weights_external("for-download", ttl_seconds=3600).result(timeout=60)
    assert export.path == f"tinker://{sdk_tc.model_id}/external_weights/for-download"
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    urls = rest.get_external_weights_urls(export.path).result(timeout=60)
    assert sorted(urls.urls) == PEFT and urls.expires.timestamp() > time.time() + 3000
    assert all(KEY not in u and "api_key" not in u for u in urls.urls.values())  # the signature is the credential
    for name, url in urls.urls.items():
        _fetch(url, tmp_path / "sdk" / name)
    listed = [c.checkpoint_id for c in rest.list_checkpoints(sdk_tc.model_id).result(timeout=60).checkpoints]
    assert "external_weights/for-download" in listed  # a checkpoint like others: listed, given a TTL, deleted
    rest.set_checkpoint_ttl_from_tinker_path(export.path, 7200).result(timeout=60)
    entry = next(c for c in rest.list_checkpoints(sdk_tc.model_id).result(timeout=60).checkpoints
                 if c.checkpoint_id == "external_weights/for-download")
    assert entry.expires_at is not None and entry.expires_at.timestamp() > time.time() + 7000
    rest.delete_checkpoint_from_tinker_path(export.path).result(timeout=60)
    assert _http_status(urls.urls["adapter_config.json"])[0] == 404

    # trio's client over HTTP: the archive, streamed into a directory
    trio_rest = trio.RestClient(base_url=server.url, api_key=KEY)
    archive = trio_rest.get_checkpoint_archive_url(path).result()
    assert archive.url.startswith(server.url) and "checkpoint.tar" in archive.url
    done = trio_rest.download_checkpoint(path, tmp_path / "http").result()
    assert done.path == str(tmp_path / "http") and done.file_size_bytes == sum(
        (original / n).stat().st_size for n in PEFT)
    with urllib.request.urlopen(archive.url, timeout=30) as response:  # a plain tar, as the hosted one
        names = tarfile.open(fileobj=io.BytesIO(response.read())).getnames()
    assert names == PEFT
    trio_rest.close()

    # in-process: the same checkpoint directory, read by a RestClient of the pool (file:// URLs)
    local = trio.RestClient(pool)
    assert local.get_checkpoint_archive_url(str(original)).result().url == original.as_uri()
    file_urls = local.get_external_weights_urls(str(original)).result().urls
    assert file_urls == {n: (original / n).as_uri() for n in PEFT}
    local.download_checkpoint(str(original), tmp_path / "local").result()

    # bitwise the same, and the checkpoint's own PEFT files
    for where in ("sdk", "http", "local"):
        assert sorted(os.listdir(tmp_path / where)) == PEFT, where
        assert same_tensors(adapter_file(tmp_path / where), adapter_file(original)), where
        assert (tmp_path / where / PEFT[0]).read_bytes() == (original / PEFT[0]).read_bytes(), where
    assert _files(tmp_path / "http") == _files(tmp_path / "local")

    # PEFT loads it on the base model, and the adapter changes the logits
    from trio_widgets.engine.models import _build_builtin

    fresh, _ = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    model = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "http")).eval()
    ids = torch.tensor([TOKENS[:12]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            bare = model(input_ids=ids).logits
    assert not torch.equal(adapted, bare)


def test_tinker_cookbook_weights_download(server, trained, tmp_path, monkeypatch):
    """tinker_cookbook's own download, unchanged: a save_state path goes through a temporary
    age-encrypted export (created, fetched, decrypted, deleted); an external_weights path directly."""
    weights = pytest.importorskip("tinker_cookbook.weights")
    tinker_env(monkeypatch)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    _service, tc, path = trained
    out = weights.download(tinker_path=path, output_dir=str(tmp_path / "cb"), base_url=server.url)
    assert sorted(os.listdir(out)) == PEFT
    assert same_tensors(adapter_file(Path(out)), adapter_file(server.checkpoint_path(path, KEY)))
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    left = [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=60).checkpoints]
    assert not any("/external_weights/download" in p for p in left), left  # its temporary export is gone


def test_an_encrypted_export_leaves_encrypted_and_decrypts_to_the_same_files(sdk, server, trained, tmp_path):
    pyrage = pytest.importorskip("pyrage")
    _service, _tc, path = trained
    identity = pyrage.x25519.Identity.generate()
    tc = sdk.create_training_client_from_state(path).result(timeout=60)
    export = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result(60)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    urls = rest.get_external_weights_urls(export.path).result(timeout=60).urls
    assert sorted(urls) == [n + ".age" for n in PEFT]
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=30) as response:
            sealed = response.read()
        assert sealed.startswith(b"age-encryption.org/v1")
        plain = pyrage.decrypt(sealed, [identity])
        assert plain == (server.checkpoint_path(path, KEY) / name.removesuffix(".age")).read_bytes()
    # the plain archive of an encrypted export is not offered: it would leave unencrypted
    with trio.RestClient(base_url=server.url, api_key=KEY) as ours, \
            pytest.raises(trio.InvalidInputError, match="file by file"):
        ours.download_checkpoint(export.path, tmp_path / "x").result()
    assert not (tmp_path / "x").exists()


def test_in_process_encryption_is_not_offered(pool):
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    with pytest.raises(trio.NotSupportedError, match="in-process"):
        tc.save_weights_external("sealed", age_encryption_recipients=["age1" + "q" * 58])
    saved = tc.save_weights_external("plain").result(timeout=60)
    assert saved.path == f"tinker://{tc.model_id}/external_weights/plain"
    local = pool.checkpoint_path(saved.path)
    assert local.parent.name == "external_weights" and sorted(
        n for n in os.listdir(local) if not n.startswith("trio_")) == PEFT


# -- what is refused ------------------------------------------------------------------------------

def test_another_key_cannot_see_or_download_a_checkpoint(server, trained, tmp_path, monkeypatch):
    tinker_env(monkeypatch)
    _service, tc, path = trained
    run, _, name = path.removeprefix("tinker://").partition("/weights/")
    other = trio.RestClient(base_url=server.url, api_key=OTHER)
    for call in (lambda: other.get_checkpoint_archive_url(path).result(),
                 lambda: other.get_external_weights_urls(path).result(),
                 lambda: other.download_checkpoint(path, tmp_path / "stolen").result()):
        with pytest.raises(trio.NotFoundError) as info:
            call()
        assert info.value.status_code == 404 and "not found for this API key" in str(info.value)
    assert not (tmp_path / "stolen").exists()
    sdk_rest = tinker.RestClient(base_url=server.url, api_key=OTHER)
    with pytest.raises(tinker.NotFoundError):
        sdk_rest.get_external_weights_urls(f"tinker://{run}/external_weights/{name}").result(timeout=60)
    other.close()


def test_a_forged_foreign_or_expired_url_is_refused(server, pool, trained):
    _service, _tc, path = trained
    rest = trio.RestClient(base_url=server.url, api_key=KEY)
    good = rest.get_external_weights_urls(path).result().urls
    url = good["adapter_config.json"]
    assert _http_status(url)[0] == 200
    forged = url[:-4] + ("0000" if not url.endswith("0000") else "1111")
    status, body = _http_status(forged)
    assert status == 403 and "not valid" in body["detail"]
    # a signature is for one file: another file's URL with it is refused
    other_file = good["adapter_model.safetensors"].split("?")[0] + "?" + url.split("?")[1]
    assert _http_status(other_file)[0] == 403
    # a later expiry than was signed is refused (the expiry is signed)
    assert _http_status(url.replace("expires=", "expires=9"))[0] == 403
    # no signature at all
    assert _http_status(url.split("?")[0])[0] == 403
    # another server (or this one restarted) has another secret
    with served(pool, api_keys=[KEY], export_url_ttl_s=2) as short:
        assert _http_status(url.replace(server.url, short.url))[0] == 403
        fresh = trio.RestClient(base_url=short.url, api_key=KEY)
        soon = fresh.get_external_weights_urls(path).result().urls["adapter_config.json"]
        assert _http_status(soon)[0] == 200
        time.sleep(3.1)
        status, body = _http_status(soon)
        assert status == 403 and "expired" in body["detail"]
        fresh.close()
    rest.close()


def test_an_export_over_the_limit_is_refused_clearly(server, pool, trained, tmp_path, monkeypatch):
    def pool_path(p: str) -> Path:
        return server.checkpoint_path(p, KEY)

    tinker_env(monkeypatch)
    _service, tc, path = trained
    export = tc.save_weights_external("over-the-limit").result(timeout=60).path
    with served(pool, api_keys=[KEY], max_export_bytes=1000) as small:
        rest = trio.RestClient(base_url=small.url, api_key=KEY)
        with pytest.raises(trio.InvalidInputError, match=r"more than the 1000 bytes .*\(max_export_bytes\)"):
            rest.get_checkpoint_archive_url(path).result()
        with pytest.raises(tinker.BadRequestError, match="max_export_bytes"):
            tinker.RestClient(base_url=small.url, api_key=KEY).get_external_weights_urls(export).result(timeout=60)
        rest.close()
    # the caller's own bound, and nothing is written
    local = trio.RestClient(pool)
    with pytest.raises(trio.InvalidInputError, match=r"more than the 1000 bytes .*\(max_bytes\)"):
        local.download_checkpoint(str(pool_path(path)), tmp_path / "capped", max_bytes=1000).result()
    assert not (tmp_path / "capped").exists() and not [p for p in tmp_path.iterdir() if ".download-" in p.name]


def test_a_download_that_stalls_is_cut_off_at_export_timeout_s(pool, trained):
    """A client that stops reading holds the connection and the files only until
    export_timeout_s: the server then drops it, mid-body."""
    _service, tc, _path = trained
    path = tc.save_weights_for_sampler("large").result(timeout=60).path
    with served(pool, api_keys=[KEY], export_timeout_s=1) as short:
        directory = short.checkpoint_path(path, KEY)
        (directory / "trio_checkpoint.json").unlink()  # a PEFT directory from elsewhere: no checksums to match
        size = 48 << 20  # more than the sockets' buffers hold
        with open(directory / "adapter_model.safetensors", "wb") as f:
            f.truncate(size)
        with trio.RestClient(base_url=short.url, api_key=KEY) as rest:
            url = rest.get_checkpoint_archive_url(path).result().url
        host_port, _, rest_of_url = url.split("://", 1)[1].partition("/")
        host, port = host_port.split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"GET /{rest_of_url} HTTP/1.1\r\nHost: {host_port}\r\n\r\n".encode())
            received = len(s.recv(65536))
            time.sleep(2.5)  # not reading
            started = time.monotonic()
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        assert received < size and time.monotonic() - started < 20


def test_path_traversal_is_refused(server, trained, tmp_path):
    _service, _tc, path = trained
    rest = trio.RestClient(base_url=server.url, api_key=KEY)
    run = path.removeprefix("tinker://").split("/")[0]
    for bad in (f"tinker://{run}/weights/..", f"tinker://{run}/weights/../../etc", "tinker://../weights/x",
                f"tinker://{run}/weights/.hidden"):
        with pytest.raises(trio.InvalidInputError):
            rest.get_checkpoint_archive_url(bad).result()
    # the download endpoint: a traversal in the URL is not a signed resource
    signed = rest.get_checkpoint_archive_url(path).result().url
    query = signed.split("?")[1]
    for hop in ("..%2F..%2F..%2Fetc", "..", "%2E%2E"):
        url = f"{server.url}/api/v1/trio/export/{run}/weights/{hop}/checkpoint.tar?{query}"
        assert _http_status(url)[0] in (403, 404)
    rest.close()


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def _member(name: str, data: bytes = b"{}", kind: bytes = tarfile.REGTYPE, target: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = (len(data) if kind == tarfile.REGTYPE else 0), kind, target
    return info, data


@pytest.mark.parametrize("members, why", [
    ([_member("../adapter_config.json"), _member("adapter_model.safetensors")], "holds '../adapter_config.json'"),
    ([_member("adapter_config.json", kind=tarfile.SYMTYPE, target="/etc/passwd")], "not a file"),
    ([_member("adapter_config.json", kind=tarfile.LNKTYPE, target="/etc/passwd")], "not a file"),
    ([_member("sub/adapter_model.safetensors")], "holds 'sub/adapter_model.safetensors'"),
    ([_member("adapter_config.json"), _member("adapter_config.json")], "twice"),
    ([_member("adapter_config.json")], "adapter_model.safetensors is missing"),
])
def test_a_hostile_archive_writes_nothing(tmp_path, members, why):
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "adapter_config.json").write_text("kept")
    with pytest.raises(trio.CheckpointError, match="archive is invalid") as info:
        extract_tar([_tar(members)], destination)
    assert why in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["out"] and _files(destination) == {"adapter_config.json": b"kept"}
    truncated = _tar([_member("adapter_config.json", b"x" * 4000), _member("adapter_model.safetensors")])[:2048]
    with pytest.raises(trio.CheckpointError):
        extract_tar([truncated], destination)
    assert _files(destination) == {"adapter_config.json": b"kept"}


def test_a_symlink_in_a_checkpoint_is_not_followed(server, pool, trained, tmp_path):
    """Files on disk may lie: a checkpoint whose adapter_config.json became a link to a file
    elsewhere is refused, in-process and over HTTP, and the file's content never leaves."""
    _service, tc, _path = trained
    path = tc.save_weights_for_sampler("linked").result(timeout=60).path
    directory = server.checkpoint_path(path, KEY)
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": "do not leak"}')
    (directory / "adapter_config.json").unlink()
    (directory / "adapter_config.json").symlink_to(secret)
    rest = trio.RestClient(base_url=server.url, api_key=KEY)
    with pytest.raises(trio.CheckpointError, match="adapter_config.json cannot be read"):
        rest.get_external_weights_urls(path).result()
    with pytest.raises(trio.CheckpointError, match="regular files"):
        trio.RestClient(pool).download_checkpoint(str(directory), tmp_path / "out").result()
    assert not (tmp_path / "out").exists()
    # a checkpoint directory that is itself a link
    (directory.parent / "alias").symlink_to(directory)
    with pytest.raises((trio.CheckpointError, trio.NotFoundError)):
        rest.get_checkpoint_archive_url(path.replace("/linked", "/alias")).result()
    rest.close()


def test_bad_arguments_name_what_is_wrong(server, pool, trained, tmp_path):
    _service, _tc, path = trained
    local = trio.RestClient(pool)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(trio.InvalidInputError, match="destination_path.*not a directory"):
        local.download_checkpoint(str(server.checkpoint_path(path, KEY)), tmp_path / "a-file").result()
    with pytest.raises(trio.InvalidInputError, match="max_bytes"):
        local.download_checkpoint(path, tmp_path / "d", max_bytes=0).result()
    with pytest.raises(trio.InvalidInputError, match="resume"):
        local.download_checkpoint(path, tmp_path / "d", resume="yes").result()
    with pytest.raises(trio.InvalidInputError, match="age_encryption_recipients"):
        tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
        tc.save_weights_external("x", age_encryption_recipients="age1abc")
    assert not (tmp_path / "d").exists()
