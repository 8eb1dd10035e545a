"""Print the Binder link (and badge) that opens notebooks/01_quickstart.ipynb in JupyterLab.

    make binder-link                 # the link, from where the repository is published
    python binder/link.py --badge    # the Markdown badge, to paste into the README
    python binder/link.py --ref v0.1 --notebook notebooks/02_clock_cycles.ipynb

Binder builds a published git repository, so the link needs its public address. It is taken
from pyproject.toml's [project.urls] ("Repository", or another label that PEP 753 reads as the
source: "Source", "Source Code", "GitHub"), else from `git remote get-url origin` (GitHub's
https and ssh forms; GitLab and any other https git host too). With neither, the repository is
not published yet: it says so and how to get the link after publishing, and exits 1.
The branch is the one checked out here (`--ref` to choose another): push it before opening
the link. Standard library only, so it runs with any Python 3.10+.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
BINDER = "https://mybinder.org"
NOTEBOOK = "notebooks/01_quickstart.ipynb"
DEFAULT_REF = "main"
# PEP 753's labels for "the source repository" (normalized: lower case, no punctuation or spaces)
SOURCE_LABELS = ("repository", "source", "sourcecode", "github")

_GITHUB = re.compile(
    r"^(?:(?:https?|git|ssh)://(?:[^@/]+@)?(?:www\.)?github\.com(?::\d+)?/|(?:[^@/]+@)?github\.com:)"
    r"(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(?:\.git)?/?$",
    re.I,
)
_GITLAB = re.compile(
    r"^(?:(?:https?|ssh)://(?:[^@/]+@)?gitlab\.com(?::\d+)?/|(?:[^@/]+@)?gitlab\.com:)"
    r"(?P<path>[\w.-]+(?:/[\w.-]+?)+)(?:\.git)?/?$",
    re.I,
)
_OTHER_HTTPS = re.compile(r"^https?://(?:[^@/]+@)?(?P<rest>[^/\s]+/\S+?)/?$")


class NotPublished(Exception):
    """Neither pyproject.toml nor git says where the repository is published."""


def _urlpath(notebook: str) -> str:
    return f"lab/tree/{notebook.lstrip('/')}"


def binder_url(repo_url: str, ref: str = DEFAULT_REF, notebook: str = NOTEBOOK) -> str:
    """mybinder.org's launch URL for a repository URL (https or ssh), a ref and a notebook path."""
    url = repo_url.strip()
    query = f"?urlpath={_urlpath(notebook)}"
    if m := _GITHUB.match(url):
        return f"{BINDER}/v2/gh/{m['owner']}/{m['repo']}/{quote(ref, safe='')}{query}"
    if m := _GITLAB.match(url):
        return f"{BINDER}/v2/gl/{quote(m['path'], safe='')}/{quote(ref, safe='')}{query}"
    if m := _OTHER_HTTPS.match(url):  # Binder's generic git provider: the clone URL, encoded
        clone = f"https://{m['rest']}"
        return f"{BINDER}/v2/git/{quote(clone, safe='')}/{quote(ref, safe='')}{query}"
    raise ValueError(f"not a repository URL Binder can build: {repo_url!r} (use an https or GitHub/GitLab ssh URL)")


def badge(url: str) -> str:
    return f"[![Binder]({BINDER}/badge_logo.svg)]({url})"


def _normalize(label: str) -> str:
    return re.sub(r"[^a-z0-9]", "", label.lower())


def _project_urls(pyproject: Path) -> dict[str, str]:
    if not pyproject.is_file():
        return {}
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the one table by hand
        section = re.search(r"^\[project\.urls\][ \t]*\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        if section is None:
            return {}
        pairs = re.findall(r"""^\s*["']?([^"'=\n]+?)["']?\s*=\s*["']([^"']+)["']""", section.group(1), re.M)
        return {key.strip(): value for key, value in pairs}
    urls = tomllib.loads(text).get("project", {}).get("urls", {})
    return {str(k): str(v) for k, v in urls.items()}


def _git(root: Path, *args: str) -> str | None:
    try:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = run.stdout.strip()
    return out if run.returncode == 0 and out else None


def repository_url(root: Path = ROOT) -> tuple[str, str]:
    """(URL, where it came from): pyproject.toml's project.urls first, then git's origin remote."""
    for label, url in _project_urls(root / "pyproject.toml").items():
        if _normalize(label) in SOURCE_LABELS:
            return url, f"pyproject.toml [project.urls] {label}"
    url = _git(root, "remote", "get-url", "origin")
    if url:
        try:
            binder_url(url)
        except ValueError:  # a clone of a local path (a CI checkout): nothing Binder can build
            raise NotPublished from None
        return url, "git remote origin"
    raise NotPublished


def current_ref(root: Path = ROOT) -> str:
    return _git(root, "symbolic-ref", "--quiet", "--short", "HEAD") or DEFAULT_REF


NOT_PUBLISHED = """\
No Binder link yet: this repository is not published. Binder builds a public git repository,
and neither pyproject.toml ([project.urls] Repository) nor git (remote "origin") says where
this one lives. After publishing it, e.g. on GitHub:

    git remote add origin https://github.com/OWNER/REPO.git && git push -u origin {ref}
    make binder-link          # prints https://mybinder.org/v2/gh/OWNER/REPO/{ref}?urlpath={urlpath}

(or add  Repository = "https://github.com/OWNER/REPO"  under [project.urls] in pyproject.toml),
then `python binder/link.py --badge` prints the README badge. The first launch builds the image
from binder/requirements.txt and binder/postBuild (several minutes); later ones start in seconds.
"""


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", help="branch, tag or commit Binder builds (default: the branch checked out here)")
    parser.add_argument("--notebook", default=NOTEBOOK, help=f"notebook JupyterLab opens (default: {NOTEBOOK})")
    parser.add_argument("--badge", action="store_true", help="print the README's Markdown badge instead")
    args = parser.parse_args(argv)
    ref = args.ref or current_ref(root)
    try:
        repo, source = repository_url(root)
    except NotPublished:
        print(NOT_PUBLISHED.format(ref=ref, urlpath=_urlpath(args.notebook)), end="", file=sys.stderr)
        return 1
    try:
        url = binder_url(repo, ref, args.notebook)
    except ValueError as exc:
        print(f"binder/link.py: {exc} (from {source})", file=sys.stderr)
        return 1
    print(badge(url) if args.badge else url)
    print(f"(repository {repo}, from {source}; ref {ref}: push it before opening the link)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
