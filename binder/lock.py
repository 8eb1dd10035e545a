"""Write binder/constraints.txt: every package the project needs at run time (the closure of
`trio-widgets[engine,lab,serve]` and the tinker SDK; no dev tools), pinned to the version installed
here. binder/requirements.txt (what Binder installs) and `make setup` both install under these
constraints, so a Binder build months later gets what the tests ran against.

    make binder-lock                            # rewrite binder/constraints.txt from .venv
    .venv/bin/python binder/lock.py --check     # exit 1 if it does not match .venv (a test runs this)
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
SDK = "tinker"  # notebook 06 trains with the official SDK (Python >= 3.11)

HEADER = """\
# The project's run-time packages, pinned: written by `make binder-lock` (binder/lock.py) from
# .venv; binder/requirements.txt and `make setup` install under these constraints, and
# tests/test_make_lab.py checks that .venv matches them. torch is pinned where it is installed
# (binder/requirements.txt, the Makefile's TORCH_SPEC): its build differs per machine.
"""


def _closure() -> dict[str, str]:
    """Canonical name -> installed version, for the project's runtime dependencies (transitively)."""
    env = default_environment()
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(PROJECT, frozenset(EXTRAS))]
    if sys.version_info >= (3, 11):
        todo.append((SDK, frozenset()))
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with binder/requirements.txt; exit 1 if stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = TARGET.read_text(encoding="utf-8")
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       "binder/constraints.txt", "what .venv has"))
            print("binder/constraints.txt does not match .venv: run `make binder-lock`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
