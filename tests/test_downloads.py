"""Hugging Face Hub models: downloaded only when the user opts in; otherwise, or when the Hub
cannot be reached, an error that says which of the two it is and what to do.

There is no network here, so these run offline, for real: a fresh process with an empty HF
cache and the hub client configured by its own environment variables (HF_HUB_OFFLINE, or an
HF_ENDPOINT on a closed localhost port), read when huggingface_hub is imported. A real
download runs only when TRIO_TEST_NETWORK=1 is set.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import trio_widgets as trio
from trio_widgets.engine.models import ALLOW_DOWNLOAD_ENV, download_allowed

MODEL = "Qwen/Qwen3-0.6B"

# Prints the error's class and message, so the parent can check both.
TRY_CREATE = """
import sys
import trio_widgets as trio
allow = {"yes": True, "no": False, "unset": None}[sys.argv[2]]
with trio.LocalPool(min_cycle_s=0, allow_download=allow) as pool:
    try:
        trio.ServiceClient(pool).create_lora_training_client(sys.argv[1], rank=2)
    except trio.ModelDownloadError as exc:
        print(type(exc).__name__, exc)
    else:
        print("loaded")
"""


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated(tmp_path, allow: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in (ALLOW_DOWNLOAD_ENV, "HF_HUB_OFFLINE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE")}
    full = {**base, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    out = subprocess.run([sys.executable, "-c", TRY_CREATE, MODEL, allow], env=full, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_without_opt_in_the_error_says_how_to_allow_it(tmp_path):
    # The Hub is unreachable too: not being allowed is what must be reported, and nothing is tried.
    text = run_isolated(tmp_path, "unset", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert text.startswith("DownloadNotAllowedError"), text
    assert f"unknown model '{MODEL}'" in text and "not in the local Hugging Face cache" in text
    assert f"pass allow_download=True to trio.LocalPool(...) or set {ALLOW_DOWNLOAD_ENV}=1" in text
    assert not (tmp_path / "hf" / "hub").exists() or not any((tmp_path / "hf" / "hub").iterdir())


def test_explicit_false_overrides_the_environment(tmp_path):
    text = run_isolated(tmp_path, "no", **{ALLOW_DOWNLOAD_ENV: "1", "HF_HUB_OFFLINE": "1"})
    assert text.startswith("DownloadNotAllowedError"), text


@pytest.mark.parametrize("allow, env", [
    ("yes", {"HF_HUB_OFFLINE": "1"}),                   # opted in by argument; the hub client is offline
    ("unset", {ALLOW_DOWNLOAD_ENV: "1", "HF_HUB_OFFLINE": "1"}),  # opted in by the environment
    ("yes", {"HF_ENDPOINT": "closed-port"}),            # opted in; the endpoint refuses connections
], ids=["argument-offline", "env-offline", "refused"])
def test_opted_in_but_unreachable_says_could_not_download(tmp_path, allow, env):
    if env.get("HF_ENDPOINT") == "closed-port":
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    text = run_isolated(tmp_path, allow, **env)
    assert text.startswith("DownloadFailedError"), text
    assert f"could not download '{MODEL}' from the Hugging Face Hub" in text and "(offline?)" in text
    assert "not allowed" not in text
    if "HF_ENDPOINT" in env:
        assert env["HF_ENDPOINT"] in text and "Connect" in text  # where it tried, and what went wrong
    else:
        assert "HF_HUB_OFFLINE is set" in text


def test_a_path_that_is_no_hub_id_is_plainly_unknown(tmp_path):
    with trio.LocalPool(min_cycle_s=0, allow_download=True) as pool:
        with pytest.raises(trio.UnknownModelError, match="not a Hugging Face Hub id") as info:
            trio.ServiceClient(pool).create_lora_training_client(str(tmp_path / "no" / "such" / "dir"), rank=2)
    assert not isinstance(info.value, trio.ModelDownloadError)


@pytest.mark.parametrize("value, allowed", [("1", True), ("true", True), ("YES", True), ("0", False),
                                            ("", False), ("off", False)])
def test_the_environment_switch(monkeypatch, value, allowed):
    monkeypatch.setenv(ALLOW_DOWNLOAD_ENV, value)
    assert download_allowed(None) is allowed
    assert download_allowed(True) is True and download_allowed(False) is False


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(ALLOW_DOWNLOAD_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{ALLOW_DOWNLOAD_ENV} must be 1 or 0 .*got 'maybe'"):
        download_allowed(None)


@pytest.mark.skipif(os.environ.get("TRIO_TEST_NETWORK") != "1",
                    reason="needs the Hugging Face Hub: set TRIO_TEST_NETWORK=1 to download a real (tiny) model")
def test_a_real_download_trains(tmp_path):
    code = """
import trio_widgets as trio
with trio.LocalPool(min_cycle_s=0, allow_download=True) as pool:
    tc = trio.ServiceClient(pool).create_lora_training_client(
        "hf-internal-testing/tiny-random-LlamaForCausalLM", rank=2)
    datum = trio.Datum(trio.ModelInput.from_ints([5, 6, 7, 8]), {"target_tokens": [6, 7, 8, 9]})
    losses = []
    for _ in range(5):
        fb = tc.forward_backward([datum])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().loss)
    print(losses[0] > losses[-1])
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"
