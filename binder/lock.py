"""Write binder/constraints.txt: every package the project needs at run time (the closure of
`trio-widgets[engine,lab,serve]` and the tinker SDK; no dev tools), pinned to the version installed
here. binder/requirements.txt (what Binder installs) and `make setup` both install under these
constraints, so a Binder build months later gets what the tests ran against.

    make binder-lock                            # rewrite binder/constraints.txt from .venv
    .venv/bin/python binder/lock.py --check     # exit 1 if it does not match .venv (a test runs this)

It writes requirements-cookbook.txt as well (Python >= 3.11): tinker-cookbook and what it needs
beyond Binder's closure, pinned; not Binder's (no notebook uses it), tests/test_cookbook.py runs it.
`make setup` installs that file with `pip install --no-deps`, because the cookbook requires
tml-renderers, which PyPI does not have (the cookbook imports it only for Thinking Machines' own
Inkling and Kimi K3 families, which a local pool does not serve): the one requirement left out.
To move the cookbook to a new release: `pip install --no-deps tinker-cookbook==X` and its new
requirements into .venv (`pip check` names what is missing), then `make binder-lock`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
TARGET = HERE / "constraints.txt"
PROJECT, EXTRAS = "trio-widgets", ("engine", "lab", "serve")
SDK = "tinker"  # notebooks 06 and 07 train with the official SDK (Python >= 3.11)
COOKBOOK = "tinker-cookbook"  # tests/test_cookbook.py (Python >= 3.11)
COOKBOOK_TARGET = HERE.parent / "requirements-cookbook.txt"
LEFT_OUT = frozenset({"tml-renderers"})  # the cookbook's requirement PyPI lacks (see above)

HEADER = """\
# The project's run-time packages, pinned: written by `make binder-lock` (binder/lock.py) from
# .venv; binder/requirements.txt and `make setup` install under these constraints, and
# tests/test_make_lab.py checks that .venv matches them. torch is pinned where it is installed
# (binder/requirements.txt, the Makefile's TORCH_SPEC): its build differs per machine.
"""


def _closure(roots: list[tuple[str, frozenset[str]]] | None = None) -> dict[str, str]:
    """Canonical name -> installed version, for the roots' runtime dependencies (transitively);
    the project's (with its extras and the SDK) when no roots are given."""
    env = default_environment()
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    if roots is None:
        roots = [(PROJECT, frozenset(EXTRAS))]
        if sys.version_info >= (3, 11):
            roots.append((SDK, frozenset()))
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen or key in LEFT_OUT:
            continue
        seen.add((key, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"binder/lock.py: {name} is not installed here: run `make setup` first") from None
        found[key] = dist.version
        for raw in dist.requires or ():
            req = Requirement(raw)
            # a requirement counts if its marker holds with no extra or with one of those asked for
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))
    return found


def render() -> str:
    pins = _closure()
    pins.pop("torch")
    pins.pop(canonicalize_name(PROJECT))
    sdk = pins.pop(SDK, None)
    lines = [HEADER]
    if sdk is not None:
        lines.append(f'{SDK}=={sdk}; python_version >= "3.11"\n')
    lines += [f"{name}=={version}\n" for name, version in sorted(pins.items())]
    return "".join(lines)


COOKBOOK_HEADER = """\
# tinker-cookbook (tests/test_cookbook.py, docs/cookbook.md; Python >= 3.11) and what it needs
# beyond binder/constraints.txt, pinned: written by `make binder-lock` (binder/lock.py) from .venv.
# `make setup` installs it with `pip install --no-deps -r requirements-cookbook.txt`, as
# the cookbook requires tml-renderers, which PyPI does not have and which it imports only for
# Thinking Machines' Inkling and Kimi K3 families (not served by a local pool), so that one
# requirement is left out and everything else it needs is listed here. Not part of Binder.
"""


def render_cookbook() -> str | None:
    """requirements-cookbook.txt's text; None where the cookbook cannot be installed (Python < 3.11)."""
    if sys.version_info < (3, 11):
        return None
    pins = _closure([(COOKBOOK, frozenset())])
    for name in (*_closure(), "torch"):
        if name != canonicalize_name(COOKBOOK):
            pins.pop(name, None)
    cookbook = pins.pop(canonicalize_name(COOKBOOK))
    lines = [COOKBOOK_HEADER, f"{COOKBOOK}=={cookbook}\n"]
    lines += [f"{name}=={version}\n" for name, version in sorted(pins.items())]
    return "".join(lines)


def _stale(path: Path, text: str) -> bool:
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == text:
        return False
    name = path.relative_to(HERE.parent).as_posix()
    sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True), name,
                                               "what .venv has"))
    print(f"{name} does not match .venv: run `make binder-lock`", file=sys.stderr)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the files it writes with .venv; exit 1 if stale")
    args = parser.parse_args()
    written = [(TARGET, render())]
    cookbook = render_cookbook()
    if cookbook is not None:
        written.append((COOKBOOK_TARGET, cookbook))
    if args.check:
        stale = [path for path, text in written if _stale(path, text)]
        return 1 if stale else 0
    for path, text in written:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
