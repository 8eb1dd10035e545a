"""The workshop path: README -> `make lab` -> JupyterLab serving notebook 01, and Binder's files.

`make lab` is started from the repository like a user would (with `LAB_PORT` set to a free
port), with HOME and the Jupyter user directories in a temp dir into which
`binder/postBuild` has written its JupyterLab settings, so the server sees what a Binder
user sees. The test reads the server's URL (with its token) from its log, fetches the lab
page of notebook 01 and the notebook over the contents API on 127.0.0.1, checks the pinned
settings and the widget extensions, then shuts the server down and checks that nothing of
it is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/01_quickstart.ipynb"
STARTUP_S = 120  # `make lab` first runs `make setup`, a no-op once .venv is installed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def get(url: str, timeout: float = 15) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


# -- README and binder/ ------------------------------------------------------------------

def test_readme_has_quick_start() -> None:
    # (how the README gets its Binder link, with no guessed repository: tests/test_binder.py)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)
    assert len(quick) == 2, "README: no '## Quick start' section"
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", quick[1], re.S)
    assert block, "README: no code block in Quick start"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert "make lab" in commands and "make test" in commands, f"Quick start commands: {commands}"


def test_binder_requirements_install_the_project_with_cpu_torch() -> None:
    lines = [line.split("#", 1)[0].strip()
             for line in (REPO / "binder" / "requirements.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    torch = [line for line in lines if re.match(r"torch\b", line)]
    assert torch and "+cpu" in torch[0], f"torch must be pinned to a CPU build: {torch}"
    assert any(re.fullmatch(r"(-e\s+)?\.(\[[\w,]*lab[\w,]*\])?", line) for line in lines), (
        "binder/requirements.txt must install the project from the repository root ('-e .[lab]')")


def test_binder_pins_what_make_setup_installed() -> None:
    """binder/constraints.txt (Binder's and make setup's pins) is what .venv holds: a dependency
    changed without `make binder-lock` fails here, not in a Binder build months later."""
    import sys

    run = subprocess.run([sys.executable, str(REPO / "binder" / "lock.py"), "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    requirements = (REPO / "binder" / "requirements.txt").read_text(encoding="utf-8")
    assert "-c constraints.txt" in requirements.splitlines()
    pins = (REPO / "binder" / "constraints.txt").read_text(encoding="utf-8")
    assert "\njupyterlab==" in pins and "\ntransformers==" in pins and "\nbokeh==" in pins


def test_binder_postbuild_is_strict_and_executable() -> None:
    post = REPO / "binder" / "postBuild"
    text = post.read_text()
    assert text.startswith("#!/bin/bash\n"), "postBuild needs a bash shebang"
    assert re.search(r"^set -e", text, re.M), "postBuild must `set -e`"
    assert os.access(post, os.X_OK), "postBuild must be executable (chmod +x)"


def test_make_lab_files_are_in_a_fresh_clone() -> None:
    """Everything `make lab` needs is tracked (or about to be): not ignored by git."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "Makefile", "pyproject.toml",
                             "notebooks", "binder"], cwd=REPO, capture_output=True, text=True, check=True)
    files = set(listed.stdout.split())
    for needed in ("Makefile", "pyproject.toml", NOTEBOOK, "binder/requirements.txt", "binder/postBuild"):
        assert needed in files, f"{needed} would be missing from a fresh clone (ignored or absent)"


# -- make lab ----------------------------------------------------------------------------

def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_", "VIRTUAL_ENV"))}
    env["HOME"] = str(home)
    env.pop("XDG_CONFIG_HOME", None)
    env.pop("XDG_DATA_HOME", None)
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["BROWSER"] = "true"  # belt and braces: open_browser is off below
    return env


def _stop(proc: subprocess.Popen, url: str | None, token: str) -> None:
    if proc.poll() is None and url is not None:
        req = urllib.request.Request(f"{url}api/shutdown", method="POST",
                                     headers={"Authorization": f"token {token}"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _group_alive(pgid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                alive.append(p)
        except (ProcessLookupError, psutil.Error, PermissionError):
            pass
    return alive


def test_make_lab_serves_the_quickstart_notebook(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)

    # `make lab` writes Binder's settings (binder/postBuild) itself, into the checkout, not $HOME
    # The user's own config (no Makefile change needed): no browser, and a token we know.
    token = os.urandom(16).hex()
    config_dir = home / ".jupyter"
    config_dir.mkdir()
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"open_browser": False}, "IdentityProvider": {"token": token}}))

    port = free_port()
    log_path = tmp_path / "make-lab.log"
    args = ["make", "lab", f"LAB_PORT={port}"]
    if not (REPO / ".venv" / ".installed").exists():
        # .venv was built by hand, not by `make setup`: don't let this test reinstall it.
        args += ["-o", ".venv/.installed"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = None
    try:
        deadline = time.monotonic() + STARTUP_S
        # The token is shown as "..." in the log when it was configured (as here).
        pattern = re.compile(rf"(http://127\.0\.0\.1:{port}/)lab\S*\?token=")
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            m = pattern.search(text)
            if m and port_open(port):
                url = m.group(1)
                break
            assert proc.poll() is None, f"make lab exited with {proc.returncode}:\n{text[-3000:]}"
            time.sleep(0.5)
        assert url, f"no JupyterLab URL on port {port} after {STARTUP_S} s:\n{log_path.read_text()[-3000:]}"
        t_ready = time.monotonic() - (deadline - STARTUP_S)
        # `jupyter lab FILE` serves FILE's folder unless the root dir is set: take what it says.
        root = re.search(r"Serving notebooks from local directory: (.+)", text)
        assert root, text[-3000:]
        served = Path(os.path.relpath(REPO / NOTEBOOK, root.group(1).strip())).as_posix()
        assert not served.startswith(".."), f"{NOTEBOOK} is outside the served folder {root.group(1)}"

        status, page = get(f"{url}lab/tree/{served}?token={token}")
        assert status == 200, f"lab page: HTTP {status}"
        config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                      page, re.S).group(1))
        assert config.get("treePath") == served, config.get("treePath")
        extensions = {e["name"] for e in config.get("federated_extensions", [])}
        for needed in ("@jupyter-widgets/jupyterlab-manager", "@bokeh/jupyter_bokeh"):
            assert needed in extensions, f"JupyterLab extension {needed} not served: {sorted(extensions)}"

        status, body = get(f"{url}api/contents/{served}?token={token}")
        assert status == 200, f"contents API: HTTP {status}"
        model = json.loads(body)
        assert model["type"] == "notebook" and model["path"] == served
        assert model["content"]["cells"][0]["source"].startswith("# Quick start")

        status, body = get(f"{url}lab/api/settings/@jupyterlab/apputils-extension:kernels-settings?token={token}")
        assert status == 200, f"settings API: HTTP {status}"
        assert json.loads(body)["settings"]["commsOverSubshells"] == "disabled", "postBuild's settings not applied"
        status, body = get(f"{url}lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}")
        assert status == 200 and json.loads(body)["settings"]["fetchNews"] == "false", "the news pop-up is on"
        assert not (home / ".jupyter" / "lab").exists(), "make lab wrote into the user's own settings"

        status, _ = get(f"{url}lab/tree/{served}")
        assert status in (302, 403) or "login" in _.lower(), "the server must ask for its token"
        print(f"\nmake lab: JupyterLab served {served} (from {root.group(1).strip()}) on 127.0.0.1:{port} "
              f"after {t_ready:.1f} s")
    finally:
        _stop(proc, url, token)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (port_open(port) or _group_alive(proc.pid)):
        time.sleep(0.25)
    assert not port_open(port), f"port {port} still open after stopping make lab"
    assert not _group_alive(proc.pid), f"processes left running: {_group_alive(proc.pid)}"
