"""The tutorial notebooks as site pages, with their outputs (used by hooks.py).

The committed notebooks carry no outputs (tests/test_notebooks.py checks that). Their outputs
come from an executed copy in build/notebooks/: tests/test_notebooks.py writes one after each
notebook passed its run (so `make test` executes every notebook once, not twice); a copy
whose recorded source hash is not the notebook's, or none, is made here by executing the
notebook as that test does (a fresh kernel in a temporary directory, no network).
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
import tempfile
from pathlib import Path

import nbformat

TIMEOUT_S = 180  # per cell; tests/test_notebooks.py allows 180 s per notebook
HASH_KEY = "trio_source_sha256"
# Outputs with nothing to show on a static page: BokehJS itself (the page loads it once),
# live widget views (their last picture is the snapshot the dashboard leaves when closed).
SKIP_MIME = ("application/vnd.bokehjs_load.v0+json", "application/vnd.jupyter.widget-view+json")


def source_hash(notebook: Path) -> str:
    return hashlib.sha256(notebook.read_bytes()).hexdigest()


def executed_copy(notebook: Path, cache: Path) -> nbformat.NotebookNode:
    """The notebook with its outputs: the cached copy if it is of this source, else a fresh run."""
    cached = cache / notebook.name
    digest = source_hash(notebook)
    if cached.exists():
        nb = nbformat.read(cached, as_version=4)
        if nb.metadata.get(HASH_KEY) == digest:
            return nb
    nb = nbformat.read(notebook, as_version=4)
    if os.environ.get("TRIO_DOCS_EXECUTE") == "0":  # a quick look at the site: pages without outputs
        return nb
    execute(nb)
    nb.metadata[HASH_KEY] = digest
    cache.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, cached)
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="trio-docs-nb-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "JUPYTER_"))}
        for key, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data"),
                         ("XDG_CONFIG_HOME", "config"), ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "mpl"),
                         ("PWD", "work")):
            Path(tmp, sub).mkdir()
            env[key] = str(Path(tmp, sub))
        env["HF_HUB_OFFLINE"] = "1"
        env.pop("TINKER_API_KEY", None)  # the hosted cell of notebook 07 skips without a key
        client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=False,
                                resources={"metadata": {"path": env["PWD"]}})
        client.execute(env=env)


def _output_html(out: nbformat.NotebookNode) -> str | None:
    kind = out.output_type
    if kind == "stream":
        cls = "trio-nb-stderr" if out.name == "stderr" else "trio-nb-stdout"
        return f'<pre class="{cls}">{html.escape(out.text)}</pre>'
    if kind == "error":
        return f'<pre class="trio-nb-stderr">{html.escape(out.ename)}: {html.escape(out.evalue)}</pre>'
    data = out.get("data", {})
    if any(m in data for m in SKIP_MIME):
        return None
    if "text/html" in data:
        return f'<div class="trio-nb-html">{data["text/html"]}</div>'
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            payload = data[mime] if isinstance(data[mime], str) else base64.b64encode(data[mime]).decode()
            return f'<img class="trio-nb-image" alt="output" src="data:{mime};base64,{payload.strip()}">'
    if "image/svg+xml" in data:
        return f'<div class="trio-nb-html">{data["image/svg+xml"]}</div>'
    if "text/plain" in data:
        return f'<pre class="trio-nb-stdout">{html.escape(data["text/plain"])}</pre>'
    return None


def to_markdown(nb: nbformat.NotebookNode, name: str) -> tuple[str, dict[str, str]]:
    """The page's Markdown (markdown cells as they are, code cells fenced) and its outputs' HTML,
    which the page holds as placeholders (`<!-- trio-output ID -->`) until hooks.py puts it in:
    raw HTML with scripts must not pass through the Markdown parser."""
    parts: list[str] = []
    outputs: dict[str, str] = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(cell.source)
        elif cell.cell_type == "code":
            parts.append(f"```python\n{cell.source}\n```")
            for out in cell.get("outputs", []):
                rendered = _output_html(out)
                if rendered is not None:
                    key = f"o{len(outputs)}"
                    outputs[key] = rendered
                    parts.append(f"<!-- trio-output {key} -->")
    binder = f"notebooks/{name}"
    head = (f'!!! note "Run it yourself"\n    This page is `{binder}` run top to bottom. Open it with '
            f"`make lab` (or `trio notebooks DIR` after `pip install trio-widgets[engine,lab]`).\n")
    text = "\n\n".join(parts)
    # the notebook's first heading is the page title: the note goes after it
    first, sep, rest = text.partition("\n")
    if first.startswith("# "):
        return f"{first}\n\n{head}\n{rest}", outputs
    return f"{head}\n{text}", outputs
