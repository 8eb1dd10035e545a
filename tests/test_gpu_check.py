"""benchmarks/gpu_check.sh --dry-run: the GPU check's steps run end to end on CPU, so the
script a GPU machine will run is known to work (its figures are not checked: a dry run's
tiny shapes mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_completes_every_step():
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for section in ("== environment ==", "== CUDA tests (on CPU: dry run) ==", "== vs_peft.py (on CPU: dry run) ==",
                    "== gpu_check done in"):
        assert section in text, f"no {section!r} in:\n{text[-4000:]}"
    assert "4 passed" in text and "skipped" not in text, text[-4000:]  # the CUDA tests ran, not skipped
    for model in ("trio/tiny-llama-byte", "random-init Llama"):
        assert f"== {model}" in text, text[-4000:]
    for arm in ("(a) one tenant", "(b) 3 tenants", "(c) packed cycle"):
        assert text.count(arm) == 2, f"{arm!r} not reported for both models:\n{text[-4000:]}"
    assert "0 step(s) failed" in text
