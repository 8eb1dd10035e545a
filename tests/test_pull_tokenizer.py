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
    assert server._service.tokenizer_id(trio.DEFAULT_MODEL, local=False) == trio.DEFAULT_MODEL
    sdk = _run(["-c", "from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info as f; "
                      f"print(f({trio.DEFAULT_MODEL!r}, {trio.DEFAULT_MODEL!r}).decode([107, 108]))"], env)
    assert sdk.returncode == 0 and sdk.stdout.strip() == byte_tokenizer().decode([107, 108]), sdk.stderr
    # pulling again is harmless (the same files: the same snapshot)
    again = _run(["-m", "trio_widgets", "pull-tokenizer", trio.DEFAULT_MODEL], env)
    assert again.returncode == 0 and again.stdout == pulled.stdout


def test_a_client_on_the_servers_machine_is_told_a_directory(server):
    where = server._service.tokenizer_id(trio.DEFAULT_MODEL, local=True)
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
