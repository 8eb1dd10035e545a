"""`trio.doctor()`: check this environment for what makes training or the dashboard fail.

One row per check, each OK, WARN or FAIL, and for every non-OK row the fix in one
sentence. The version rules are a pure function (`check_versions`) so each known-bad
release can be tested with a faked version string; everything else reads the live
process: torch's device and threads, the checkpoint directory, a short GIL-lag probe and,
inside a Jupyter kernel, the frontend extensions, BokehJS and kernel subshells.

Nothing here imports ipywidgets or bokeh: versions come from package metadata and the
frontend extensions from the files JupyterLab itself reads.
"""

from __future__ import annotations

import dataclasses
import enum
import html
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from packaging.version import Version

    from .engine import LocalPool

__all__ = ["Check", "DoctorReport", "Status", "check_versions", "doctor", "installed_versions"]


class Status(str, enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the report. `fix` is one sentence, empty when the status is OK."""

    name: str
    status: Status
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------- versions

@dataclasses.dataclass(frozen=True)
class _Package:
    minimum: str | None
    #: "core": training needs it; "widgets": the Dashboard needs it; "optional": neither
    role: str
    missing_note: str = ""


#: Minimums are pyproject's (tests/test_doctor.py keeps the two in step).
PACKAGES: dict[str, _Package] = {
    "python": _Package("3.10", "core"),
    "torch": _Package("2.4", "core"),
    "transformers": _Package("4.56", "core"),
    "numpy": _Package("1.24", "core"),
    "pydantic": _Package(None, "optional", "not installed (optional: trio does not use it)"),
    "ipykernel": _Package("7.0", "optional",
                          "not installed (needed only to run notebooks: pip install 'trio-widgets[lab]')"),
    "ipywidgets": _Package("8.1", "widgets"),
    "bokeh": _Package("3.4", "widgets"),
    "jupyter_bokeh": _Package("4.0", "widgets"),
    "jupyterlab": _Package("4.4", "optional",
                           "not in this environment (fine in a script, or when JupyterLab runs from another one)"),
}


@dataclasses.dataclass(frozen=True)
class _KnownBad:
    package: str
    #: PEP 440 specifier the bad releases match (pre-releases included)
    specifier: str
    #: only pre-releases in that range are bad
    pre_releases_only: bool
    status: Status
    problem: str
    fix: str

    def matches(self, version: Version) -> bool:
        from packaging.specifiers import SpecifierSet

        in_range = SpecifierSet(self.specifier).contains(version, prereleases=True)
        return in_range and (version.is_prerelease or not self.pre_releases_only)


KNOWN_BAD: tuple[_KnownBad, ...] = (
    _KnownBad("transformers", "==5.3.0", False, Status.FAIL,
              "transformers 5.3.0 loads the wrong tokenizer class for saved models (ignores tokenizer_class)",
              "pip install 'transformers>=5,!=5.3.0'"),
    _KnownBad("transformers", "<5.0", False, Status.WARN,
              "transformers {version} (< 5.0) has the vision-language image-token bug",
              "pip install -U 'transformers>=5,!=5.3.0'"),
    # Stable 2.13+ is fine: only the betas, from 2.13.0b1 on, serialise slowly.
    _KnownBad("pydantic", ">=2.13.0b1", True, Status.WARN,
              "pydantic {version} is a beta whose serialisation is slow (2.13 betas and later pre-releases)",
              "install a final release: pip install 'pydantic!={version}'"),
)


def _version(text: str) -> Version:
    from packaging.version import Version

    return Version(text)


def installed_versions() -> dict[str, str | None]:
    """The installed version of Python and of each package `check_versions` knows; None if absent."""
    info = sys.version_info
    level = {"alpha": "a", "beta": "b", "candidate": "rc"}.get(info.releaselevel)
    versions: dict[str, str | None] = {
        "python": f"{info.major}.{info.minor}.{info.micro}" + (f"{level}{info.serial}" if level else "")}
    for name in PACKAGES:
        if name == "python":
            continue
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_versions(versions: Mapping[str, str | None]) -> list[Check]:
    """One Check per known package, from version strings alone (None: not installed).

    The first rule that applies decides: missing, below pyproject's minimum, a known-bad
    release, a pre-release build, else OK. Names not in `versions` are skipped.
    """
    from packaging.version import InvalidVersion

    checks = []
    for name, package in PACKAGES.items():
        if name not in versions:
            continue
        text = versions[name]
        if text is None:
            checks.append(_missing(name, package))
            continue
        try:
            version = _version(text)
        except InvalidVersion:
            checks.append(Check(name, Status.WARN, f"{name} {text}: not a version string trio can compare",
                                f"reinstall a released {name}: pip install --force-reinstall {name}"))
            continue
        checks.append(_check_version(name, package, text, version))
    return checks


def _missing(name: str, package: _Package) -> Check:
    if package.role == "optional":
        return Check(name, Status.OK, package.missing_note)
    if package.role == "widgets":
        return Check(name, Status.WARN, f"{name} is not installed: trio.Dashboard needs it (headless training works)",
                     f"pip install '{name}>={package.minimum}'")
    fix = ("install the torch build for your machine (CPU or CUDA) from pytorch.org, then "
           "pip install 'trio-widgets[engine]'" if name == "torch" else f"pip install '{name}>={package.minimum}'")
    return Check(name, Status.FAIL, f"{name} is not installed: the pool cannot run without it", fix)


def _check_version(name: str, package: _Package, text: str, version: Version) -> Check:
    if package.minimum is not None and version < _version(package.minimum):
        if name == "python":
            return Check(name, Status.FAIL, f"Python {text} is older than {package.minimum}, which trio needs",
                         f"use Python {package.minimum} or newer")
        status = Status.FAIL if package.role == "core" else Status.WARN
        need = {"core": "trio needs", "widgets": "the Dashboard needs",
                "optional": "notebooks need (kernel subshells, JupyterLab 4.4 comms)"}[package.role]
        return Check(name, status, f"{name} {text} is older than {package.minimum}, which {need}",
                     f"pip install -U '{name}>={package.minimum}'")
    for rule in KNOWN_BAD:
        if rule.package == name and rule.matches(version):
            return Check(name, rule.status, rule.problem.format(version=text), rule.fix.format(version=text))
    if version.is_prerelease:
        if name == "python":
            return Check(name, Status.WARN, f"Python {text} is a pre-release: its wheels and behaviour are untested",
                         "use a final Python release")
        return Check(name, Status.WARN, f"{name} {text} is a pre-release build: untested with trio",
                     f"install a final release: pip install '{name}!={text}'")
    return Check(name, Status.OK, text)


# --------------------------------------------------------------------------- torch

def _device(pool: LocalPool | None) -> Any:
    """The pool's torch device, or the one a new pool would pick."""
    from .engine.models import resolve_device

    return pool.device if pool is not None else resolve_device("auto")


def _device_name(pool: LocalPool | None) -> str:
    return _device(pool).type.upper()


def check_torch_device(pool: LocalPool | None) -> Check:
    import torch

    device = _device(pool)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return Check("device", Status.OK, f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name(index)}")
    note = " (a CUDA build, but no GPU is visible)" if torch.version.cuda and not torch.cuda.is_available() else ""
    return Check("device", Status.OK, f"{device.type.upper()}{note}")


def check_torch_threads(pool: LocalPool | None) -> Check:
    import torch

    from .engine.models import TORCH_THREADS_ENV, auto_torch_threads, cgroup_cpu_quota, usable_cpus

    usable = usable_cpus()
    quota = cgroup_cpu_quota(Path("/sys/fs/cgroup"))
    limits = f"{usable} usable CPU{'s' if usable != 1 else ''} ({os.cpu_count()} on the machine"
    limits += f", cgroup quota {quota:g})" if quota is not None else ")"
    try:
        auto = auto_torch_threads()
    except ValueError as exc:
        return Check("torch threads", Status.FAIL, str(exc),
                     f"set {TORCH_THREADS_ENV} to a whole number from 1 to {usable}")
    current = torch.get_num_threads()
    if auto > usable:
        return Check("torch threads", Status.WARN,
                     f"{TORCH_THREADS_ENV}={auto} asks for more threads than the {limits}: they fight for the CPUs",
                     f"set {TORCH_THREADS_ENV} to at most {usable}, or unset it")
    if current > usable and pool is not None and pool.device.type == "cpu":
        return Check("torch threads", Status.WARN,
                     f"torch runs {current} threads on {limits}: OpenMP threads fight for the CPUs",
                     f"create the pool with torch_threads='auto' (or call torch.set_num_threads({auto}))")
    detail = f"{current} of {limits}"
    if current != auto:
        detail += f"; a LocalPool on CPU sets {auto}"
    return Check("torch threads", Status.OK, detail)


# --------------------------------------------------------------------------- disk

CHECKPOINT_FREE_WARN_BYTES = 1 << 30
CHECKPOINT_FREE_FAIL_BYTES = 100 << 20


def check_checkpoint_dir(directory: Path) -> list[Check]:
    """Writable (by writing a file, when it exists) and the free space on its disk."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    writable = _writable(directory, existing)
    if writable is not None:
        rows = [Check("checkpoint dir", Status.FAIL, f"{directory} is not writable: {writable}",
                      "pass a writable LocalPool(checkpoint_dir=...) or fix the directory's permissions")]
    else:
        note = "" if directory.exists() else " (created on the first save)"
        rows = [Check("checkpoint dir", Status.OK, f"{directory} is writable{note}")]
    free = shutil.disk_usage(existing).free
    text = f"{_size(free)} free on the disk of {existing}"
    if free < CHECKPOINT_FREE_FAIL_BYTES:
        rows.append(Check("disk space", Status.FAIL, text + ": checkpoint saves will fail",
                          "free disk space or pass LocalPool(checkpoint_dir=...) on another disk"))
    elif free < CHECKPOINT_FREE_WARN_BYTES:
        rows.append(Check("disk space", Status.WARN, text + ": a few checkpoints may fill it",
                          "free disk space or pass LocalPool(checkpoint_dir=...) on another disk"))
    else:
        rows.append(Check("disk space", Status.OK, text))
    return rows


def _writable(directory: Path, existing: Path) -> str | None:
    """None if trio can write checkpoints under `directory`, else why not."""
    if existing.exists() and not existing.is_dir():
        return f"{existing} is a file"
    if existing != directory:
        # The pool creates the missing part on its first save: that needs the ancestor writable.
        return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot create it under {existing}"
    try:
        # A hidden name: checkpoint readers skip dot-entries.
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".trio-doctor-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# --------------------------------------------------------------------------- GIL

#: An idle interpreter wakes a sleeping thread within ~0.1 ms; a thread running pure
#: Python delays every wake-up by up to the switch interval (5 ms by default).
GIL_LAG_WARN_S = 0.002
GIL_PROBE_SLEEPS = 20
GIL_PROBE_SLEEP_S = 0.005


def measure_wakeup_lag(sleeps: int = GIL_PROBE_SLEEPS, sleep_s: float = GIL_PROBE_SLEEP_S) -> tuple[list[float], float]:
    """A helper thread sleeps `sleeps` times; returns how late each wake-up was (seconds)
    and the CPU time this process spent meanwhile as a share of the wall time."""
    lags: list[float] = []

    def probe() -> None:
        for _ in range(sleeps):
            start = time.perf_counter()
            time.sleep(sleep_s)
            lags.append(time.perf_counter() - start - sleep_s)

    thread = threading.Thread(target=probe, name="trio-doctor-gil-probe", daemon=True)
    wall, cpu = time.perf_counter(), time.process_time()
    thread.start()
    thread.join()  # bounded: the probe ends after its sleeps, however late each one wakes
    busy = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
    return lags, busy


def check_gil_lag() -> Check:
    lags, busy = measure_wakeup_lag()
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()
              and t.name != "trio-doctor-gil-probe"]
    return explain_gil_lag(lags, busy, others)


def explain_gil_lag(lags: list[float], busy: float, others: list[str]) -> Check:
    """The check from what the probe measured: wake-up lags (s), this process's CPU share during
    the probe (1.0 = one full CPU), and the names of its other threads."""
    median, worst = statistics.median(lags), max(lags)
    detail = (f"a thread asked to sleep {GIL_PROBE_SLEEP_S * 1e3:g} ms woke {median * 1e3:.1f} ms late "
              f"(median of {len(lags)}; max {worst * 1e3:.1f} ms)")
    if median < GIL_LAG_WARN_S:
        return Check("GIL lag", Status.OK, detail)
    if busy >= 0.5:
        why = ("Python code running in this process holds the interpreter (GIL), so the pool's clock thread "
               f"waits the same way and its cycles stretch (threads: {', '.join(others[:6]) or 'none named'})")
        fix = "move CPU-heavy Python out of threads that run beside the pool: precompute it or run it in a subprocess"
    else:
        why = f"this process was mostly idle ({busy:.0%} CPU), so other processes keep the CPUs busy"
        fix = "stop other CPU-heavy processes, or lower TRIO_TORCH_THREADS so the pool needs fewer CPUs"
    return Check("GIL lag", Status.WARN, f"{detail}: {why}", fix)


# --------------------------------------------------------------------------- kernel

#: (row name, lab extension, Python package that ships it, what it is for)
FRONTEND_EXTENSIONS = (
    ("widgets extension", "@jupyter-widgets/jupyterlab-manager", "jupyterlab_widgets", "widgets"),
    ("bokeh extension", "@bokeh/jupyter_bokeh", "jupyter_bokeh", "BokehModel plots"),
)


def labextension_dirs() -> list[str]:
    """Where JupyterLab looks for prebuilt (federated) extensions, first match wins."""
    from jupyter_core.paths import jupyter_path

    return jupyter_path("labextensions")


def find_labextension(name: str, dirs: list[str]) -> Path | None:
    """The package.json JupyterLab would load for `name` (same search as jupyterlab_server)."""
    for directory in dirs:
        candidate = Path(directory, *name.split("/"), "package.json")
        if candidate.is_file():
            return candidate
    return None


def shipped_labextension(name: str, distribution: str) -> Path | None:
    """The package.json of `name` as installed by `distribution` (from its RECORD)."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    suffix = f"labextensions/{name}/package.json"
    for file in files:
        if str(file).replace("\\", "/").endswith(suffix):
            return Path(file.locate()).resolve()
    # Some packages also keep a copy inside the package (what `jupyter labextension develop` links).
    spec = importlib.util.find_spec(distribution)  # locates without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        inside = Path(location, "labextension", "package.json")
        if inside.is_file() and json.loads(inside.read_text(encoding="utf-8")).get("name") == name:
            return inside.resolve()
    return None


def disabled_labextensions() -> set[str]:
    """Extensions and plugins (`ext:plugin`) turned off in JupyterLab's page config.

    Read as jupyterlab_server merges it (importing that costs ~2 s): the app's
    settings/page_config.json, then labconfig/page_config.json from the lowest-priority
    Jupyter config dir to the user's, later ones overriding earlier ones.
    """
    from jupyter_core.paths import jupyter_config_path

    app_dir = Path(os.environ.get("JUPYTERLAB_DIR") or Path(sys.prefix, "share", "jupyter", "lab"))
    paths = [app_dir / "settings" / "page_config.json"]
    paths += [Path(d, "labconfig", "page_config.json") for d in reversed(jupyter_config_path())]
    state: dict[str, bool] = {}
    for path in paths:
        try:
            entries = json.loads(path.read_text(encoding="utf-8")).get("disabledExtensions", {})
        except (OSError, ValueError, AttributeError):
            continue
        # Older configs list the disabled names; newer ones map name -> bool.
        state.update(entries if isinstance(entries, dict) else dict.fromkeys(entries, True))
    return {name for name, off in state.items() if off}


def check_frontend_extensions(in_kernel: bool, lab_here: bool = True) -> list[Check]:
    """Installed where JupyterLab looks (this environment's Jupyter paths), not stale, not disabled.

    Outside a kernel a problem is a WARN: it matters only once a notebook shows widgets.
    Without JupyterLab in this environment the server runs from another one, which has
    its own paths: problems found here are then only a WARN, and every row says so.
    """
    bad = Status.FAIL if in_kernel and lab_here else Status.WARN
    try:
        dirs, disabled = labextension_dirs(), disabled_labextensions()
    except ImportError:  # no jupyter_core: the core install without [lab] (tests/test_packaging.py)
        return [Check(row, Status.WARN, "Jupyter is not installed in this environment",
                      "pip install 'trio-widgets[lab]' where the notebooks run") for row, *_ in FRONTEND_EXTENSIONS]
    rows = [_frontend_extension(row, name, distribution, purpose, dirs, disabled, bad)
            for row, name, distribution, purpose in FRONTEND_EXTENSIONS]
    if not lab_here:
        elsewhere = " (as seen from this environment: JupyterLab is not installed here, so check the one that runs it)"
        rows = [dataclasses.replace(r, detail=r.detail + elsewhere) for r in rows]
    return rows


def _frontend_extension(row: str, name: str, distribution: str, purpose: str, dirs: list[str],
                        disabled: set[str], bad: Status) -> Check:
    found = find_labextension(name, dirs)
    shipped = shipped_labextension(name, distribution)
    if found is None and shipped is not None:
        return Check(row, bad, f"{name} is installed in {shipped.parent}, where JupyterLab does not look",
                     f"install {distribution} into the environment that runs JupyterLab "
                     f"(or: jupyter labextension develop --overwrite {distribution})")
    if found is None:
        return Check(row, bad, f"{name} is not installed: {purpose} show nothing in JupyterLab",
                     f"pip install {distribution} (then reload the browser tab)")
    version = _json_version(found)
    off = sorted(d for d in disabled if d == name or d.startswith(name + ":"))
    if off:
        return Check(row, bad, f"{name} {version}: {', '.join(off)} disabled, so {purpose} show nothing",
                     f"jupyter labextension enable {off[0]} (then reload the browser tab)")
    if shipped is not None and shipped.parent != found.parent.resolve():
        # The first directory on the path wins: an old copy there hides the installed package's.
        expected = _json_version(shipped)
        if expected != version:
            return Check(row, Status.WARN, f"JupyterLab loads {name} {version} from {found.parent}, which shadows "
                                           f"{distribution}'s own {expected}",
                         f"delete {found.parent} (a stale copy), then reload the browser tab")
    return Check(row, Status.OK, f"{name} {version} in {found.parents[len(name.split('/'))]}")


def _json_version(package_json: Path) -> str:
    try:
        return str(json.loads(package_json.read_text(encoding="utf-8")).get("version", "?"))
    except (OSError, ValueError):
        return "?"


def check_bokehjs() -> Check:
    """Whether trio has sent BokehJS to this kernel's page (a flag kept in the kernel)."""
    from .widgets._bokeh_setup import bokehjs_loaded

    if bokehjs_loaded():
        # The flag lives in the kernel: a reloaded tab has lost BokehJS without the kernel knowing.
        return Check("BokehJS", Status.OK, "sent inline to the page by trio; after reloading the browser tab, restart "
                                           "the kernel (or call widgets._bokeh_setup.ensure_bokehjs(force=True))")
    return Check("BokehJS", Status.OK, "not yet loaded: trio sends it inline with the first dashboard (no CDN needed)")


def check_subshells(kernel: Any) -> Check:
    """Whether the kernel offers subshells and how many the frontend opened (ipykernel >= 7).

    JupyterLab >= 4.4 opens one per comm target once a widget talks (its commsOverSubshells
    setting, on by default), and widget callbacks may then run off the main thread.
    """
    features = getattr(kernel, "kernel_info", {}).get("supported_features", [])
    if "kernel subshells" not in features:
        return Check("subshells", Status.OK, "this kernel has no subshells: widget messages are handled on the main "
                                             "shell, after the running cell")
    # The same calls as ipykernel's own %subshell magic.
    manager = kernel.shell_channel_thread.manager
    open_ids = manager.list_subshell()
    try:
        here = manager.subshell_id_from_thread_id(threading.get_ident())
    except RuntimeError:
        here = None
    where = f"this cell runs on subshell {here}" if here else "this cell runs on the main shell"
    if open_ids:
        detail = (f"kernel subshells supported, {len(open_ids)} open: widget comms from JupyterLab run over "
                  f"subshells; {where}")
    else:
        detail = (f"kernel subshells supported, none open yet (JupyterLab opens one when a widget first talks, "
                  f"if its commsOverSubshells setting is on); {where}")
    return Check("subshells", Status.OK, detail)


def _kernel() -> Any | None:
    from .widgets._bokeh_setup import kernel_shell

    shell = kernel_shell()
    return None if shell is None else shell.kernel


# --------------------------------------------------------------------------- report

@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """What `doctor()` found: `records` for code, a table for people."""

    records: list[Check]
    #: a few facts for the one-line summary when everything is OK
    highlights: tuple[str, ...] = ()

    @property
    def worst(self) -> Status:
        return max((r.status for r in self.records), key=lambda s: s.severity, default=Status.OK)

    @property
    def ok(self) -> bool:
        """No check FAILed (warnings allowed); `worst` tells whether any warned."""
        return self.worst is not Status.FAIL

    def summary(self) -> str:
        if self.worst is Status.OK:
            facts = f" ({', '.join(self.highlights)})" if self.highlights else ""
            return f"trio doctor: all {len(self.records)} checks OK{facts}"
        counts = {s: sum(r.status is s for r in self.records) for s in Status}
        return (f"trio doctor: {counts[Status.FAIL]} FAIL, {counts[Status.WARN]} WARN, "
                f"{counts[Status.OK]} OK of {len(self.records)} checks")

    def __str__(self) -> str:
        width = max((len(r.name) for r in self.records), default=0)
        lines = [self.summary()]
        for r in self.records:
            lines.append(f"  {r.status.value:<4}  {r.name:<{width}}  {r.detail}")
            if r.fix:
                lines.append(f"  {'':<4}  {'':<{width}}  fix: {r.fix}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.summary() if self.worst is Status.OK else str(self))

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'>{html.escape(r.name)}</td>"
            f"<td style='text-align:left;font-weight:bold;color:{_COLORS[r.status]}'>{r.status.value}</td>"
            f"<td style='text-align:left'>{html.escape(r.detail)}</td>"
            f"<td style='text-align:left'>{html.escape(r.fix)}</td></tr>"
            for r in self.records)
        table = ("<table class='trio-doctor' style='font-size:12px'><thead><tr><th style='text-align:left'>check</th>"
                 "<th style='text-align:left'>status</th><th style='text-align:left'>detail</th>"
                 f"<th style='text-align:left'>fix</th></tr></thead><tbody>{rows}</tbody></table>")
        summary = html.escape(self.summary())
        if self.worst is Status.OK:
            # One friendly line; the table stays one click away.
            return f"<details class='trio-doctor'><summary>{summary}</summary>{table}</details>"
        return f"<div class='trio-doctor'><b>{summary}</b>{table}</div>"


_COLORS = {Status.OK: "#2e7d32", Status.WARN: "#b26a00", Status.FAIL: "#c62828"}


def doctor(pool: LocalPool | None = None) -> DoctorReport:
    """Check this environment: versions, torch, checkpoints, GIL lag and, in a kernel, the frontend.

    Pass a pool to check its device and `checkpoint_dir` instead of the defaults.
    Display the result in a notebook, print it, or read `.records`.

    Example: `trio.doctor()` in a notebook cell (one line when all is well, else a table of
    fixes); `trio doctor` in a shell (exit status 1 if a check FAILed).
    """
    versions = installed_versions()
    # the pool needs torch; the client, HTTP and the dashboard do not (the core install): without
    # an importable torch the doctor still reports, with a FAIL row that says how to get the pool
    engine = importlib.util.find_spec("torch") is not None
    if not engine:
        versions = {**versions, "torch": None}  # installed metadata but not importable counts as absent
    kernel = _kernel()
    records = check_versions(versions)
    if engine:
        from .engine.checkpoints import checkpoint_root

        records.append(check_torch_device(pool))
        records.append(check_torch_threads(pool))
        records.extend(check_checkpoint_dir(checkpoint_root(pool)))
    records.append(check_gil_lag())
    records.extend(check_frontend_extensions(in_kernel=kernel is not None,
                                             lab_here=versions["jupyterlab"] is not None))
    if kernel is not None:
        records.append(check_bokehjs())
        records.append(check_subshells(kernel))
    else:
        records.append(Check("kernel", Status.OK, "not in a Jupyter kernel: BokehJS and subshell checks skipped"))
    if not engine:
        highlights: tuple[str, ...] = (f"Python {versions['python']}", "no torch: the client and the dashboard work, "
                                       "a local pool does not", f"transformers {versions['transformers']}")
        return DoctorReport(records, highlights)
    import torch

    from .engine.models import usable_cpus

    highlights = (f"Python {versions['python']}", f"torch {torch.__version__.split('+')[0]} {_device_name(pool)}",
                  f"{torch.get_num_threads()} torch threads on {usable_cpus()} CPUs",
                  f"transformers {versions['transformers']}")
    return DoctorReport(records, highlights)
