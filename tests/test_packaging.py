"""The package as users get it (issue 35): the wheel and sdist `python -m build` makes, checked by
`twine check`, installed into a fresh venv with no checkout on its path (the core, then
`[engine]`), and used there: import, `trio --version`, `trio doctor`, `trio notebooks`, and a short
in-process training run. The notebooks ship in the wheel, and the sdist builds the same wheel as
the tree. `make package-check` runs this file alone; `make test` runs it with the suite.

Installs go through binder/constraints.txt, as `make setup` does (the versions the suite ran on),
torch first at the Makefile's TORCH_SPEC so pip does not pull another build of it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import trio_widgets

REPO = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"  # = the Makefile's TORCH_SPEC (the CPU wheel here)
CONSTRAINTS = REPO / "binder" / "constraints.txt"


def _run(cmd: list[str], cwd: Path, timeout: float = 900, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _clean_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no virtualenv of ours, no checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["TRIO_TORCH_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel built from it (python -m build's own order), and a wheel built
    straight from a copy of the tree (what git tracks or would track: no build leftovers)."""
    root = tmp_path_factory.mktemp("package")
    tree = root / "tree"
    files = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], REPO).split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    _run([sys.executable, "-m", "build", "--outdir", str(root / "dist"), str(tree)], root)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(root / "direct"), str(tree)], root)
    (sdist,) = (root / "dist").glob("*.tar.gz")
    (wheel,) = (root / "dist").glob("*.whl")
    (direct,) = (root / "direct").glob("*.whl")
    return {"root": root, "sdist": sdist, "wheel": wheel, "direct": direct}


def test_twine_check_passes(dist) -> None:
    out = _run([sys.executable, "-m", "twine", "check", "--strict", str(dist["sdist"]), str(dist["wheel"])],
               dist["root"])
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_the_package_the_notebooks_and_the_license(dist) -> None:
    version = trio_widgets.__version__
    assert dist["wheel"].name == f"trio_widgets-{version}-py3-none-any.whl"
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    modules = {str(p.relative_to(REPO)) for p in (REPO / "trio_widgets").rglob("*.py")}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    data = f"trio_widgets-{version}.data/data/share/trio-widgets/notebooks/"
    shipped = sorted(n.removeprefix(data) for n in names if n.startswith(data))
    assert shipped == sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")), shipped
    assert f"trio_widgets-{version}.dist-info/licenses/LICENSE" in names
    meta = zipfile.ZipFile(dist["wheel"]).read(f"trio_widgets-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and f"Version: {version}" in meta
    entry = zipfile.ZipFile(dist["wheel"]).read(f"trio_widgets-{version}.dist-info/entry_points.txt").decode()
    assert re.search(r"^trio = trio_widgets\.__main__:main$", entry, re.M), entry
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "docs/"))]


def test_the_sdist_builds_the_same_wheel(dist) -> None:
    def contents(wheel: Path) -> dict[str, str]:
        with zipfile.ZipFile(wheel) as z:  # RECORD lists the hashes of the rest: compared through them
            return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist() if not n.endswith("RECORD")}

    from_sdist, from_tree = contents(dist["wheel"]), contents(dist["direct"])
    assert from_sdist.keys() == from_tree.keys(), sorted(from_sdist.keys() ^ from_tree.keys())
    differ = sorted(n for n in from_sdist if from_sdist[n] != from_tree[n])
    assert not differ, f"the sdist's wheel differs from the tree's in {differ}"


TRAIN = """
import math, trio_widgets as trio
pool = trio.LocalPool(min_cycle_s=0)
try:
    tc = trio.ServiceClient(pool).create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0)
    batches = trio.data.addition_batches(tc.get_tokenizer(), batch_size=4, seed=0)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(next(batches), "cross_entropy")
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert all(math.isfinite(x) for x in losses), losses
    print("trained", len(losses), "updates; cycles", fb.cycle)
finally:
    pool.close()
"""


def test_the_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py, trio = venv / "bin" / "python", venv / "bin" / "trio"
    env, work = _clean_env(), tmp_path / "work"
    work.mkdir()
    # (--no-compile: byte-compiling torch and transformers would be most of this test's time)
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", "-c", str(CONSTRAINTS)]

    # the core: the client API over HTTP and the dashboard, no torch
    _run([*pip, str(dist["wheel"])], work, env=env)
    where = _run([str(py), "-c", "import trio_widgets, sys; print(trio_widgets.__file__); "
                                 "print('torch' in sys.modules)"], work, env=env).split()
    assert where[0].startswith(str(venv)) and where[1] == "False", where
    assert _run([str(trio), "--version"], work, env=env).strip() == f"trio-widgets {trio_widgets.__version__}"
    doctor = subprocess.run([str(trio), "doctor"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert "trio doctor" in doctor.stdout and "Traceback" not in doctor.stderr, doctor.stdout + doctor.stderr
    _run([str(trio), "notebooks", "nb"], work, env=env)
    assert sorted(p.name for p in (work / "nb").glob("*.ipynb")) == sorted(
        p.name for p in (REPO / "notebooks").glob("*.ipynb"))

    # [engine]: torch first, at the Makefile's spec, then the extra; a short run in-process
    _run([*pip, TORCH_SPEC], work, env=env)
    _run([*pip, f"{dist['wheel']}[engine]"], work, env=env)
    doctor = _run([str(trio), "doctor"], work, env=env)
    assert "torch" in doctor, doctor
    out = _run([str(py), "-c", TRAIN], work, env=env, timeout=600)
    assert "trained 4 updates" in out, out


# -- the command in this checkout (fast: no build) ---------------------------------------------

def test_version_has_one_source(capsys) -> None:
    from trio_widgets.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"trio-widgets {trio_widgets.__version__}"
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "trio_widgets.__version__"}' in pyproject
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{trio_widgets.__version__}]" in changelog, "CHANGELOG.md has no section for this version"


def test_trio_notebooks_copies_and_never_overwrites(tmp_path: Path, capsys) -> None:
    from trio_widgets.__main__ import main

    names = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert main(["notebooks", str(tmp_path / "nb")]) == 0
    assert sorted(p.name for p in (tmp_path / "nb").iterdir()) == names
    (tmp_path / "nb" / names[0]).write_text("mine")
    assert main(["notebooks", str(tmp_path / "nb")]) == 1
    assert "already has" in capsys.readouterr().err and (tmp_path / "nb" / names[0]).read_text() == "mine"
