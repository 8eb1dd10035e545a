"""Binder: the build as repo2docker makes it, notebook 01 under Binder's 2 GB, and the link.

``test_binder_build_runs_notebook_01_in_2_gb``: a fresh venv of binder/runtime.txt's Python
(``python3.11 -m venv`` in a temp dir), ``pip install -r binder/requirements.txt`` from the
repository root (as repo2docker does), then binder/postBuild (as Binder runs it after the
install: it writes the JupyterLab settings and fails the build if the dashboard's extensions
are missing), then notebook 01 executed with ``jupyter nbconvert --execute`` of that venv, on
that venv's ``python3`` kernel, inside a cgroup v1 memory cgroup limited to 2 GiB (memory and,
where the kernel accounts swap, memory+swap). nbconvert starts in the cgroup, so its kernel and
everything the kernel starts are in it too. That the limit is real is checked three ways: the
limit reads back as written; a process that allocates past 2 GiB in the cgroup is OOM-killed;
the notebook's kernel itself reports that cgroup and its limit (a cell added before the
notebook's first). The peak (memory.max_usage_in_bytes: RSS plus the page cache charged to the
cgroup) and the phases' times are printed (``pytest -s``); the cgroup is removed afterwards.
Without root or a writable cgroup v1 memory hierarchy it skips, saying why.

requirements.txt is installed unchanged: its ``torch==2.13.0+cpu`` wheel lies in the local wheel
folder pip is configured with. The pytorch.org extra index it names is unreachable here, so pip
runs with ``PIP_RETRIES=0``: each lookup there fails at once instead of after five retries (about
8 s per package, ~20 minutes in all); nothing installed changes. It also runs with
``--no-compile``: byte-compiling every module of torch, transformers, JupyterLab and the rest up
front is some 20-25 s of one core, a large share of the install; the kernel compiles only the
modules notebook 01 imports (~5 s), as it imports them (same packages, same files; the cgroup's
peak counts that). The same for the kernel as in tests/test_notebooks.py: HOME and the caches in a
temp dir, ``HF_HUB_OFFLINE=1``.

The other tests check binder/link.py (``make binder-link``): the Binder URL from pyproject.toml's
project.urls or git's origin remote, and what it says when the repository is not published.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
LIMIT_BYTES = 2 * 2**30  # Binder's memory limit
INSTALL_TIMEOUT_S = 900
NOTEBOOK_TIMEOUT_S = 300
MIB = 2**20

# Added before the notebook's first cell: the kernel says where it runs and under what limit.
PROBE_CELL = """\
import json as _b_json, sys as _b_sys, torch as _b_torch
_b_cg = [l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()
         if "memory" in l.split(":", 2)[1].split(",")]
_b_dirs = [f"/sys/fs/cgroup/memory{_b_cg[0]}", "/sys/fs/cgroup/memory/" + _b_cg[0].rsplit("/", 1)[-1]] if _b_cg else []
_b_limit = next((int(open(d + "/memory.limit_in_bytes").read()) for d in _b_dirs
                 if __import__("os").path.exists(d + "/memory.limit_in_bytes")), None)
print("BINDER-PROBE " + _b_json.dumps({"executable": _b_sys.executable, "cgroup": _b_cg[0] if _b_cg else None,
                                       "limit": _b_limit, "torch": _b_torch.__version__}))
"""

# Run in the cgroup before the notebook: allocates (and touches) up to 3 GiB, 64 MiB at a time.
OVER_LIMIT = """\
import sys
held = []
for i in range(48):
    held.append(b"\\1" * (64 << 20))
    print((i + 1) * 64, flush=True)
sys.exit(3)
"""


def _binder_python() -> str:
    """binder/runtime.txt's interpreter ("python-3.11" -> python3.11)."""
    runtime = (REPO / "binder" / "runtime.txt").read_text().strip()
    m = re.fullmatch(r"python-(\d+\.\d+)", runtime)
    assert m, f"binder/runtime.txt: {runtime!r}"
    return f"python{m.group(1)}"


class MemoryCgroup:
    """A cgroup v1 memory cgroup with a hard limit (memory, and memory+swap where accounted);
    ``command(argv)`` wraps argv so that it starts inside it. Removed on exit, after killing
    whatever is left in it (only processes this test started)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.path = CGROUP_ROOT / f"trio-binder-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _write(self, name: str, value: int | str) -> None:
        (self.path / name).write_text(f"{value}\n")

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def oom_kills(self) -> int | None:
        text = (self.path / "memory.oom_control").read_text()
        m = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(m.group(1)) if m else None

    def __enter__(self) -> MemoryCgroup:
        self.path.mkdir()
        try:
            self._write("memory.limit_in_bytes", self.limit)
            if (self.path / "memory.memsw.limit_in_bytes").exists():  # swap counts too (if the kernel has swap)
                self._write("memory.memsw.limit_in_bytes", self.limit)
        except BaseException:
            self.path.rmdir()
            raise
        return self

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", 0)
        if (self.path / "memory.memsw.max_usage_in_bytes").exists():
            self._write("memory.memsw.max_usage_in_bytes", 0)
        self._write("memory.failcnt", 0)

    def command(self, argv: list[str]) -> list[str]:
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" || exit 97; exec "$@"', "sh", *argv]

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = self.pids()
            if not left:
                break
            for pid in left:  # a kernel nbconvert left behind: ours, started in this cgroup
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:  # EBUSY while the last task exits
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _cgroup_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux cgroups"
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory hierarchy at {CGROUP_ROOT} (e.g. a cgroup v2-only host)"
    probe = CGROUP_ROOT / f"trio-binder-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a memory cgroup under {CGROUP_ROOT} (needs root and a writable mount): {exc}"
    probe.rmdir()
    return None


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER", "JPY_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA"))}
    for key, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data"),
                     ("XDG_CONFIG_HOME", "config"), ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "mpl")):
        path = home / sub
        path.mkdir(parents=True, exist_ok=True)
        env[key] = str(path)
    return env


@pytest.mark.notebooks
def test_binder_build_runs_notebook_01_in_2_gb(tmp_path: Path) -> None:
    reason = _cgroup_unavailable()
    if reason:
        pytest.skip(reason)
    python = shutil.which(_binder_python())
    if python is None:
        pytest.skip(f"{_binder_python()} (binder/runtime.txt) is not installed")
    # the notebook suite's own checks of notebook 01's output, and how it reads a cell's stdout
    from test_notebooks import _text, check_01

    t_start = time.perf_counter()
    venv = tmp_path / "binder-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    env = _clean_env(tmp_path)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"

    # -- the build: repo2docker's `pip install -r binder/requirements.txt` from the root, then postBuild
    pip_env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    pip_env["PIP_RETRIES"] = "0"  # the unreachable pytorch.org index fails at once (see the module docstring)
    pip_env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    t0 = time.perf_counter()
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-compile",
                              "-r", "binder/requirements.txt"],
                             cwd=REPO, env=pip_env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    t_install = time.perf_counter() - t0
    assert install.returncode == 0, (install.stdout + install.stderr)[-5000:]

    t0 = time.perf_counter()
    settings = tmp_path / "lab-settings"
    post = subprocess.run(["bash", "binder/postBuild"], cwd=REPO, env={**env, "JUPYTERLAB_SETTINGS_DIR": str(settings)},
                          capture_output=True, text=True, timeout=300)
    t_post = time.perf_counter() - t0
    assert post.returncode == 0, (post.stdout + post.stderr)[-5000:]
    assert (settings / "@jupyterlab" / "apputils-extension" / "kernels-settings.jupyterlab-settings").is_file()

    # -- notebook 01 under 2 GiB
    work = tmp_path / "work"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE_CELL))
    nbformat.write(nb, work / "01_quickstart.ipynb")
    kernel_env = {**env, "HF_HUB_OFFLINE": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}

    with MemoryCgroup(LIMIT_BYTES) as cgroup:
        assert cgroup.read("memory.limit_in_bytes") == LIMIT_BYTES, "the memory limit did not take"
        # The limit is enforced: allocating past it in the cgroup gets the process OOM-killed.
        over = subprocess.run(cgroup.command([str(bin_dir / "python"), "-c", OVER_LIMIT]), env=env,
                              capture_output=True, text=True, timeout=120)
        reached = int(over.stdout.split()[-1]) if over.stdout.split() else 0
        assert over.returncode == -signal.SIGKILL, (
            f"a process allocating 3 GiB in the cgroup was not killed (rc {over.returncode}, "
            f"reached {reached} MiB): the limit is not enforced\n{over.stderr[-2000:]}")
        assert cgroup.read("memory.max_usage_in_bytes") <= LIMIT_BYTES
        assert reached < LIMIT_BYTES // MIB
        oom_kills = cgroup.oom_kills()
        assert oom_kills is None or oom_kills >= 1
        cgroup.reset_peak()

        argv = [str(bin_dir / "jupyter"), "nbconvert", "--to", "notebook", "--execute",
                f"--ExecutePreprocessor.timeout={NOTEBOOK_TIMEOUT_S}", "--ExecutePreprocessor.kernel_name=python3",
                "--output", "executed.ipynb", "01_quickstart.ipynb"]
        t0 = time.perf_counter()
        run = subprocess.run(cgroup.command(argv), cwd=work, env=kernel_env, capture_output=True, text=True,
                             timeout=NOTEBOOK_TIMEOUT_S + 120)
        t_notebook = time.perf_counter() - t0
        peak = cgroup.read("memory.max_usage_in_bytes")
        failcnt = cgroup.read("memory.failcnt")
        oom_after = cgroup.oom_kills()
        cgroup_name = "/" + cgroup.path.name

    assert run.returncode == 0, f"notebook 01 failed under the 2 GiB limit:\n{(run.stdout + run.stderr)[-5000:]}"
    assert oom_after in (None, oom_kills), "the OOM killer ran during notebook 01"
    done = nbformat.read(work / "executed.ipynb", as_version=4)
    probe = re.search(r"BINDER-PROBE (.*)", _text(done.cells[0]))
    assert probe, _text(done.cells[0])
    seen = json.loads(probe.group(1))
    assert Path(seen["executable"]).parent == bin_dir, f"the kernel is not the Binder venv's: {seen['executable']}"
    in_it = (seen["cgroup"] or "").endswith(cgroup_name) and seen["limit"] == LIMIT_BYTES
    assert in_it, f"the kernel runs outside the limit: {seen}"
    assert seen["torch"].endswith("+cpu"), f"Binder's torch is the CPU build: {seen['torch']}"
    check_01("".join(_text(c) for c in done.cells[1:] if c.cell_type == "code"))

    total = time.perf_counter() - t_start
    print(f"\nbinder: pip install {t_install:.0f} s, postBuild {t_post:.0f} s, notebook 01 {t_notebook:.0f} s "
          f"(test {total:.0f} s); under a {LIMIT_BYTES // MIB} MiB cgroup: peak {peak / MIB:.0f} MiB "
          f"(max_usage_in_bytes: RSS and the page cache charged to it), "
          f"failcnt {failcnt}; a 3 GiB allocation was OOM-killed at {reached} MiB")
    assert peak < LIMIT_BYTES


# -- binder/link.py (make binder-link) --------------------------------------------------------

def _link() -> ModuleType:
    spec = importlib.util.spec_from_file_location("binder_link", REPO / "binder" / "link.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAB = "?urlpath=lab/tree/notebooks/01_quickstart.ipynb"


@pytest.mark.parametrize(("remote", "expected"), [
    ("https://github.com/ada/trio-widgets", "gh/ada/trio-widgets/main"),
    ("https://github.com/ada/trio-widgets.git", "gh/ada/trio-widgets/main"),
    ("https://github.com/ada/trio-widgets/", "gh/ada/trio-widgets/main"),
    ("https://token@github.com/ada/trio.widgets.git", "gh/ada/trio.widgets/main"),
    ("git@github.com:ada/trio-widgets.git", "gh/ada/trio-widgets/main"),
    ("git@github.com:ada/trio-widgets", "gh/ada/trio-widgets/main"),
    ("ssh://git@github.com/ada/trio-widgets.git", "gh/ada/trio-widgets/main"),
    ("ssh://git@github.com:22/ada/trio-widgets.git", "gh/ada/trio-widgets/main"),
    ("git://github.com/ada/trio-widgets.git", "gh/ada/trio-widgets/main"),
    ("https://gitlab.com/group/sub/trio-widgets.git", "gl/group%2Fsub%2Ftrio-widgets/main"),
    ("git@gitlab.com:group/trio-widgets.git", "gl/group%2Ftrio-widgets/main"),
    ("https://git.example.org/ada/trio-widgets.git",
     "git/https%3A%2F%2Fgit.example.org%2Fada%2Ftrio-widgets.git/main"),
])
def test_binder_url_from_repository_urls(remote: str, expected: str) -> None:
    assert _link().binder_url(remote, "main") == f"https://mybinder.org/v2/{expected}{LAB}"


def test_binder_url_ref_notebook_and_bad_url() -> None:
    link = _link()
    url = link.binder_url("git@github.com:ada/tw.git", "feature/x", "notebooks/02_clock_cycles.ipynb")
    assert url == "https://mybinder.org/v2/gh/ada/tw/feature%2Fx?urlpath=lab/tree/notebooks/02_clock_cycles.ipynb"
    with pytest.raises(ValueError, match="not a repository URL"):
        link.binder_url("/srv/git/trio-widgets.git", "main")


def _git_repo(path: Path, remote: str | None = None, branch: str = "main") -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path.mkdir()
    subprocess.run(["git", "init", "-q", "-b", branch, str(path)], check=True)
    if remote:
        subprocess.run(["git", "-C", str(path), "remote", "add", "origin", remote], check=True)
    return path


def test_binder_link_from_git_remote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _git_repo(tmp_path / "repo", "git@github.com:ada/trio-widgets.git", branch="workshop")
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert _link().main([], root=root) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"https://mybinder.org/v2/gh/ada/trio-widgets/workshop{LAB}"
    assert "git remote origin" in err
    assert _link().main(["--badge", "--ref", "main"], root=root) == 0
    out, _ = capsys.readouterr()
    assert out.strip() == (f"[![Binder](https://mybinder.org/badge_logo.svg)]"
                           f"(https://mybinder.org/v2/gh/ada/trio-widgets/main{LAB})")


def test_binder_link_prefers_project_urls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _git_repo(tmp_path / "repo", "https://github.com/fork/elsewhere.git")
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n\n[project.urls]\n'
                                         'Documentation = "https://docs.example.org"\n'
                                         '"Source Code" = "https://github.com/ada/trio-widgets"\n')
    assert _link().main([], root=root) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"https://mybinder.org/v2/gh/ada/trio-widgets/main{LAB}"
    assert "pyproject.toml" in err


def test_binder_link_says_how_when_not_published(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _git_repo(tmp_path / "repo")  # no remote, no project.urls: not published
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert _link().main([], root=root) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "not published" in err and "make binder-link" in err and "git remote add origin" in err
    assert "[project.urls]" in err
    # and outside any git checkout (a downloaded archive)
    bare = tmp_path / "archive"
    bare.mkdir()
    assert _link().main([], root=bare) == 1
    assert "not published" in capsys.readouterr().err


def test_make_binder_link_target() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    run = subprocess.run(["make", "-s", "binder-link"], cwd=REPO, capture_output=True, text=True, timeout=60)
    link = _link()
    try:
        repo, _ = link.repository_url(REPO)
    except link.NotPublished:  # this checkout: no remote, no project.urls
        assert run.returncode != 0 and "not published" in run.stderr, run.stdout + run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == link.binder_url(repo, link.current_ref(REPO))


def test_readme_says_how_to_get_the_binder_link() -> None:
    """No guessed repository slug: the README links Binder only once the repository is published."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "make binder-link" in readme
    slugs = re.findall(r"https://mybinder\.org/v2/gh/([^/\s)]+/[^/\s)]+)/", readme)
    link = _link()
    try:
        repo, _ = link.repository_url(REPO)
    except link.NotPublished:
        assert all(s == "OWNER/REPO" for s in slugs), f"README links Binder to a guessed repository: {slugs}"
    else:
        known = link.binder_url(repo).split("/v2/gh/", 1)[-1].split("/")[:2]
        assert all(s == "/".join(known) or s == "OWNER/REPO" for s in slugs), (slugs, repo)
