"""`python -m trio_widgets pull-tokenizer`: a served model's tokenizer in a participant's Hugging
Face cache under the model's name, loaded offline by transformers and by the tinker SDK's own
get_tokenizer (issue 23). Real processes: the CLI and the loaders run in fresh interpreters with
a fresh HF_HOME and HF_HUB_OFFLINE=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from served import served

import trio_widgets as trio
from trio_widgets.tokenizers import byte_tokenizer

KEY = "tml-participant-01"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")), name="pull") as pool:
        with served(pool, api_keys=[KEY]) as s:
            yield s


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRIO_"))}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", **extra}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_participant_pulls_the_tokenizer_and_loads_it_offline_by_name(server, tmp_path):
    env = _env(tmp_path, TRIO_BASE_URL=server.url, TRIO_API_KEY=KEY)
    load = ("from transformers import AutoTokenizer; "
            f"t = AutoTokenizer.from_pretrained({trio.DEFAULT_MODEL!r}); "
            "print(t.encode('héllo', add_special_tokens=False))")
    before = _run(["-c", load], env)
    assert before.returncode != 0  # a fresh cache, offline: nothing to load yet
    pulled = _run(["-m", "trio_widgets", "pull-tokenizer"], env)
    assert pulled.returncode == 0, pulled.stderr
    assert trio.DEFAULT_MODEL in pulled.stdout and str(tmp_path / "hf") in pulled.stdout
    after = _run(["-c", load], env)
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip() == str(byte_tokenizer().encode("héllo", add_special_tokens=False))
    # the tinker SDK's own loader, given the name a remote client is told (tokenizer_id)
    assert server._service.state.tokenizer_id(trio.DEFAULT_MODEL, local=False) == trio.DEFAULT_MODEL
    sdk = _run(["-c", "from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info as f; "
                      f"print(f({trio.DEFAULT_MODEL!r}, {trio.DEFAULT_MODEL!r}).decode([107, 108]))"], env)
    assert sdk.returncode == 0 and sdk.stdout.strip() == byte_tokenizer().decode([107, 108]), sdk.stderr
    # pulling again is harmless (the same files: the same snapshot)
    again = _run(["-m", "trio_widgets", "pull-tokenizer", trio.DEFAULT_MODEL], env)
    assert again.returncode == 0 and again.stdout == pulled.stdout


def test_a_client_on_the_servers_machine_is_told_a_directory(server):
    where = server._service.state.tokenizer_id(trio.DEFAULT_MODEL, local=True)
    assert where is not None and os.path.isdir(where)


def test_pulling_says_what_is_wrong(server, tmp_path):
    env = _env(tmp_path)
    no_url = _run(["-m", "trio_widgets", "pull-tokenizer"], env)
    assert no_url.returncode == 2 and "--base-url" in no_url.stderr
    wrong_key = _run(["-m", "trio_widgets", "pull-tokenizer", "--base-url", server.url],
                     {**env, "TRIO_API_KEY": "x" * 9})
    assert wrong_key.returncode == 1 and "401" in wrong_key.stderr
    unknown = _run(["-m", "trio_widgets", "pull-tokenizer", "org/other", "--base-url", server.url],
                   {**env, "TRIO_API_KEY": KEY})
    assert unknown.returncode == 1 and "org/other" in unknown.stderr
    gone = _run(["-m", "trio_widgets", "pull-tokenizer", "--base-url", "http://127.0.0.1:9"], env)
    assert gone.returncode == 1 and "cannot reach" in gone.stderr
    assert not (tmp_path / "hf" / "hub").exists() or not any((tmp_path / "hf" / "hub").iterdir())


def test_a_local_models_tokenizer_endpoint_serves_tokenizer_files_only(tmp_path):
    """A base model served from a local directory: that directory holds its weights too, and the
    tokenizer endpoint sends only files named in TOKENIZER_FILES (issue 36: 71.8 MiB of weights
    were downloadable before), each under the size cap."""
    import httpx
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trio_widgets.tokenizers import TOKENIZER_FILES

    model_dir = tmp_path / "qwen2-tiny"
    config = Qwen2Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    (model_dir / "notes.txt").write_text("not a tokenizer file either")
    on_disk = {p.name for p in model_dir.iterdir()}
    assert {"model.safetensors", "notes.txt"} <= on_disk  # what must not leave
    with trio.LocalPool(min_cycle_s=0.01, checkpoint_dir=str(tmp_path / "ckpt"), name="tokfiles") as pool, \
            served(pool, api_keys=[KEY], models=[str(model_dir)]) as server:
        got = httpx.get(f"{server.url}/api/v1/trio/tokenizer", params={"base_model": str(model_dir)},
                        headers={"X-API-Key": KEY}, timeout=60)
    assert got.status_code == 200, got.text
    sent = set(got.json()["files"])
    assert sent and sent <= TOKENIZER_FILES, sent - TOKENIZER_FILES
    assert "tokenizer_config.json" in sent and not sent & {"model.safetensors", "notes.txt"}
