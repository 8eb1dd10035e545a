"""MkDocs hooks for the trio-widgets site (mkdocs.yml: `hooks:`). Every page they make is
generated at build time from the code, so the site cannot drift from it:

* the API reference: a `:::` block for every name in `trio_widgets.__all__` (and a warning, which
  `mkdocs build --strict` turns into a failure, for a public name or method without a docstring);
* the CLI reference: `trio --help` and each command's help, as argparse prints them;
* the tutorials: each notebook in notebooks/ with its outputs (the dashboard's closing snapshot
  draws its figures with BokehJS, copied into the site), from an executed copy in
  build/notebooks/ that tests/test_notebooks.py leaves (so `make test` runs each notebook once),
  executed here when that copy is missing or older than the notebook;
* the changelog, from CHANGELOG.md.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import shutil
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import notebooks as nbpages  # noqa: E402  (beside this file)

log = logging.getLogger("mkdocs.plugins.trio")
REPO = Path(__file__).resolve().parents[2]
_OUTPUTS: dict[str, dict[str, str]] = {}  # page src_uri -> placeholder id -> output HTML
_PICTURES: dict[str, str] = {}  # notebook stem -> its dashboard's closing snapshot (HTML)
_BOKEH_JS: list[str] = []  # the BokehJS files the notebook pages load (names under assets/bokeh/)


# -- the API reference ---------------------------------------------------------------------------

def _public_names() -> dict[str, object]:
    import trio_widgets

    return {name: getattr(trio_widgets, name) for name in trio_widgets.__all__}


def _target(name: str, obj: object) -> str:
    """Where the reference documents a public name: lazily imported ones (LocalPool, Dashboard,
    serve) by the module that defines them, the others as `trio_widgets.<name>`."""
    if name in ("LocalPool", "Dashboard", "serve"):
        return f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]
    return f"trio_widgets.{name}"


def _undocumented(names: dict[str, object]) -> list[str]:
    import griffe

    package = griffe.load("trio_widgets", search_paths=[str(REPO)])
    missing = []
    for name, obj in names.items():
        ours = getattr(obj, "__module__", "").startswith("trio_widgets")
        if not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)) or (
                inspect.isclass(obj) and not ours):  # `ModelID = str`: an alias, documented where it is made
            # a constant or a type alias: its docstring is the string literal after it
            doc = package[name].docstring if name in package.members else None
            if doc is None or not doc.value.strip():
                missing.append(name)
        elif not (inspect.getdoc(obj) or "").strip() or (inspect.isclass(obj) and (obj.__doc__ or "").startswith(
                f"{obj.__name__}(")):  # a dataclass's generated signature is not a docstring
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                if not (member.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    return missing


def _reference_pages() -> dict[str, str]:
    import trio_widgets

    names = _public_names()
    errors = sorted(n for n, o in names.items() if inspect.isclass(o) and issubclass(o, BaseException)
                    or o is trio_widgets.ExperimentalWarning)
    types = sorted(n for n, o in names.items() if n not in errors and getattr(o, "__module__", "") ==
                   "trio_widgets.types" and n not in ("types",))
    modules = ["data", "types"]
    api = [n for n in names if n not in errors and n not in types and n not in modules]
    order = ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "APIFuture", "LocalPool",
             "Dashboard", "train", "run_sync", "TrainingRun", "watch", "unwatch", "serve", "doctor"]
    api.sort(key=lambda n: (order.index(n) if n in order else len(order), n.lower()))

    def blocks(group: list[str]) -> str:
        return "\n".join(f"::: {_target(n, names[n])}\n" for n in group)

    return {
        "reference/api.md": "# API reference\n\n`import trio_widgets as trio`: every name in "
        "`trio_widgets.__all__`, generated from its docstring. Data types are on [Types](types.md), "
        "exceptions on [Errors](errors.md), the command line on [CLI](cli.md).\n\n" + blocks(api)
        + "\n## Modules\n\n::: trio_widgets.data\n    options:\n      show_root_heading: true\n"
        "      members: true\n",
        "reference/types.md": "# Types\n\nThe request and response types (`trio_widgets.types`, "
        "also importable from `trio_widgets`), as in tinker and pytrio.\n\n" + blocks(types),
        "reference/errors.md": "# Errors\n\nEvery error trio raises, and the hosted SDKs' exception "
        "names (each one catches the errors of ours it names).\n\n" + blocks(errors),
    }


def _cli_page() -> str:
    from trio_widgets.__main__ import main

    def help_of(argv: list[str]) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
        return out.getvalue().replace("python -m trio_widgets", "trio")

    parts = ["# Command line\n\n`trio` (installed with the package; also `python -m trio_widgets`). "
             "Generated from its `--help`.\n\n```text\n" + help_of([]) + "```\n"]
    for command in ("demo", "doctor", "serve", "pull-tokenizer", "notebooks"):
        parts.append(f"## trio {command}\n\n```text\n{help_of([command])}```\n")
    return "\n".join(parts)


# -- hooks -------------------------------------------------------------------------------------

def _listed(nav) -> set[str]:
    found: set[str] = set()
    for item in nav if isinstance(nav, list) else [nav]:
        if isinstance(item, str):
            found.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                found |= _listed(value)
    return found


def on_config(config):
    # A guide added to docs/ (e.g. docs/sampling.md) joins the Guides section under its own title,
    # instead of failing the strict build as a page missing from the nav.
    listed = _listed(config["nav"])
    guides = next(item["Guides"] for item in config["nav"] if isinstance(item, dict) and "Guides" in item)
    for page in sorted(Path(config["docs_dir"]).glob("*.md")):
        if page.name not in listed:
            title = next((line[2:].strip() for line in page.read_text(encoding="utf-8").splitlines()
                          if line.startswith("# ")), page.stem)
            guides.append({title: page.name})
            log.info("added %s to the Guides section as %r", page.name, title)
    missing = _undocumented(_public_names())
    for name in missing:
        log.warning("public name without a docstring: trio_widgets.%s", name)
    return config


def on_files(files: Files, config) -> Files:
    pages = _reference_pages()
    pages["reference/cli.md"] = _cli_page()
    pages["changelog.md"] = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    _OUTPUTS.clear()
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        executed = nbpages.executed_copy(notebook, REPO / "build" / "notebooks")
        uri = f"tutorials/{notebook.stem}.md"
        text, outputs = nbpages.to_markdown(executed, notebook.name)
        _OUTPUTS[uri] = outputs
        snapshot = next((html for html in outputs.values() if "trio-snapshot" in html), None)
        if snapshot is not None:
            _PICTURES[notebook.stem] = snapshot
        files.append(File.generated(config, uri, content=text))
    return files


def on_page_content(content: str, page, config, files) -> str:
    """Put the notebooks' outputs in their placeholders: `<!-- trio-output ID -->` on a tutorial
    page, `<!-- trio-picture NOTEBOOK -->` (a notebook's dashboard snapshot) on any page."""
    outputs = dict(_OUTPUTS.get(page.file.src_uri, {}))
    for stem in re.findall(r"<!-- trio-picture (\w+) -->", content):
        if stem not in _PICTURES:
            log.warning("%s: notebook %s left no dashboard snapshot to show", page.file.src_uri, stem)
            continue
        outputs[stem] = _PICTURES[stem]
    if not outputs:
        return content
    up = "../" * page.url.count("/")
    scripts = "".join(f'<script src="{up}assets/bokeh/{name}"></script>' for name in _BOKEH_JS)

    def put(m: re.Match) -> str:
        return outputs.get(m.group(2), m.group(0))

    return scripts + re.sub(r"<!-- trio-(output|picture) (\w+) -->", put, content)


def on_pre_build(config) -> None:
    import bokeh

    static = Path(bokeh.__file__).parent / "server" / "static" / "js"
    _BOKEH_JS[:] = [f"bokeh{part}-{bokeh.__version__}.min.js" for part in ("", "-widgets", "-tables")]
    _BOKEH_SOURCES.clear()
    for part, name in zip(("", "-widgets", "-tables"), _BOKEH_JS):
        _BOKEH_SOURCES[name] = static / f"bokeh{part}.min.js"


_BOKEH_SOURCES: dict[str, Path] = {}


def on_post_build(config) -> None:
    target = Path(config["site_dir"]) / "assets" / "bokeh"
    target.mkdir(parents=True, exist_ok=True)
    for name, source in _BOKEH_SOURCES.items():
        shutil.copyfile(source, target / name)
