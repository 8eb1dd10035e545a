"""Code in each hosted SDK's documented style runs here with only the import changed (issue 16).

tests/sdk_style/ holds scripts in the style of tinker 0.38.0's and pytrio 0.2.9's own
documentation (quickstart SFT, async RL, custom losses, checkpoints; each names its source).
The only change is the import line (`import trio_widgets as tinker  # was: import tinker`);
each runs in a fresh interpreter against the process-wide pool `ServiceClient()` gives, with
`BASE_MODEL` set to the built-in model and the checkpoint directory in a temporary directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from served import last_request_id, served
from transports import IN_PROCESS, TRANSPORTS

import trio_widgets as trio

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((Path(__file__).parent / "sdk_style").glob("*.py"))
IMPORTS = re.compile(r"^\s*(?:import|from)\s+(tinker|pytrio)\b", re.M)

# What each script's output must show (beyond running to the end).
EXPECTED = {
    "tinker_quickstart_sft.py": [r"step 9: loss:sum=\d"],
    "tinker_async_rl.py": [r"step 4: mean reward"],
    "tinker_custom_loss.py": [r"callable custom loss metrics: .*'surrogate_loss:sum'",
                              r"LossHandle metrics: .*custom/neg_ll"],
    "tinker_checkpoint.py": [r"Model ID: sess-\w+:train:\d+, base model: trio/tiny-llama-byte, LoRA rank: 16",
                             r"completion logprob: -\d", r"training: weights/checkpoint-001 -> tinker://"],
    "pytrio_quickstart_sft.py": [r"step 9: loss_mean=\d+\.\d+ tokens=\d+"],
    "pytrio_async_rl.py": [r"step 4: loss_sum=-?\d+\.\d+ token_count=\d+"],
    "pytrio_custom_loss.py": [r"'custom_nll': .*'loss_mean'"],
    "pytrio_checkpoint.py": [r"\(model=trio/tiny-llama-byte, size=\d+ bytes\)", r"prompt logprobs: \[None, -\d",
                             r"training: weights/checkpoint-001 -> tinker://", r"sample response type: sample",
                             r"downloaded (sampler_)?weights/\S+-001: [1-9]\d* bytes"],
}


def test_every_script_is_checked_and_imports_no_sdk():
    assert sorted(p.name for p in SCRIPTS) == sorted(EXPECTED)
    for script in SCRIPTS:
        text = script.read_text(encoding="utf-8")
        assert not IMPORTS.search(text), f"{script.name} imports a hosted SDK"
        assert "import trio_widgets as " in text and "# was: " in text, script.name


@pytest.fixture(scope="module")
def served_pool(tmp_path_factory):
    """A pool served on 127.0.0.1 for the scripts' `ServiceClient()` ($TRIO_BASE_URL): (pool, its URL)."""
    with trio.LocalPool(min_cycle_s=0.0, name="styles", checkpoint_dir=str(tmp_path_factory.mktemp("ckpt"))) as pool, \
            served(pool) as server:
        yield pool, server.url


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_sdk_style_script_runs_with_only_the_import_changed(script, transport, tmp_path, served_pool):
    pool, served_url = served_pool
    env = dict(os.environ, BASE_MODEL="trio/tiny-llama-byte", XDG_CACHE_HOME=str(tmp_path / "cache"),
               HOME=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRIO_BASE_URL", None)
    if transport != IN_PROCESS:  # the same script, its ServiceClient() on a served pool
        env.update(TRIO_BASE_URL=served_url, TRIO_API_KEY=f"tml-{script.stem}")
    before = last_request_id(pool)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, f"{script.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    # over HTTP the served pool ran its requests; in-process the script's own pool did
    assert (last_request_id(pool) > before) == (transport != IN_PROCESS), (transport, before, last_request_id(pool))
    for pattern in EXPECTED[script.name]:  # the same ids and tinker:// paths on both transports
        assert re.search(pattern, out.stdout), f"{script.name}: no {pattern!r} in its output:\n{out.stdout}"
    # no deprecation or other warning from trio_widgets itself: the SDKs' styles are not deprecated here
    assert "trio_widgets" not in out.stderr, out.stderr[-3000:]
