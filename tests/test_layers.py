"""The code's shape: one direction of imports (the import-linter contracts in pyproject.toml,
which `make lint` runs too), no import cycle, no module reading another module's private names,
and a client that needs no torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from conftest import HIDE_TORCH
from served import served

import trio_widgets as trio

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trio_widgets"


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_import_cycle():
    """No two modules import each other, directly or through others. Function-level imports and
    imports under TYPE_CHECKING count too: they only hide a cycle (a back-reference is a Protocol,
    e.g. engine/tenants.py's PoolLike)."""
    graph = grimp.build_graph("trio_widgets", exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if not graph.find_children(m))  # modules, not packages
    cycles = []
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported == module or graph.find_children(imported):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append((module, *back))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level:
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))
    return name or ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reads_another_modules_private_names():
    """`from .x import _name` and `x._name` on an imported module of ours: a private name is its
    module's business (a package's own modules may share theirs through the package)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}  # local name -> module of ours it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, path.name == "__init__.py", node.level, node.module)
                if not source.startswith("trio_widgets"):
                    continue
                for alias in node.names:
                    if _private(alias.name) and not (PACKAGE / Path(*source.split(".")[1:], alias.name)).exists():
                        found.append(f"{module}: from {source} import {alias.name}")
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("trio_widgets"):
                        aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target is not None and target != module:
                    found.append(f"{module}: {node.value.id}.{node.attr}")
    assert not found, "private names read across modules:\n" + "\n".join(found)




def test_the_client_and_the_dashboard_import_without_torch():
    code = HIDE_TORCH + """
import trio_widgets as trio
import trio_widgets.widgets.dashboard, trio_widgets.rest, trio_widgets.http.client
assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
assert not [m for m in sys.modules if m.startswith("trio_widgets.engine")]
try:
    trio.ServiceClient()
except trio.InvalidInputError as exc:
    assert "engine" in str(exc) and "base_url" in str(exc), exc
else:
    raise AssertionError("an in-process pool without the engine must say what to install")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@pytest.mark.parametrize("module", ["trio_widgets.protocol", "trio_widgets.connect", "trio_widgets.pools",
                                    "trio_widgets.tokenizers"])
def test_the_seam_modules_import_nothing_heavy(module):
    done = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in sys.modules "
                           f"if m.split('.')[0] in ('torch', 'transformers', 'bokeh', 'ipywidgets')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_core_install_trains_samples_and_watches_a_served_pool(tmp_path):
    """A participant's machine without torch: the client trains and samples on a served pool,
    and `Dashboard(url)` shows the updates (the pool runs here, in the test's process)."""
    with trio.LocalPool(min_cycle_s=0.01, name="core", checkpoint_dir=str(tmp_path)) as pool, \
            served(pool) as server:
        code = HIDE_TORCH + f"""
import asyncio
import trio_widgets as trio

async def main():
    dash = trio.Dashboard({server.url!r})
    with trio.ServiceClient(base_url={server.url!r}, api_key="tml-core") as svc:
        tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=4, seed=0, user_metadata={{"name": "core"}})
        tokens = [3 + b for b in b"the core install trains"]
        datum = trio.Datum(trio.ModelInput.from_ints(tokens[:-1]), {{"target_tokens": tokens[1:]}})
        losses = []
        for _ in range(4):
            fb = await tc.forward_backward_async([datum], "cross_entropy")
            opt = await tc.optim_step_async(trio.AdamParams(learning_rate=1e-2))
            losses.append((await fb).metrics["loss:sum"])
            await opt
        assert losses[-1] < losses[0], losses
        sampler = tc.save_weights_and_get_sampling_client("core")
        out = sampler.sample(trio.ModelInput.from_ints(tokens[:4]), 2, trio.SamplingParams(max_tokens=4, seed=1))
        sequences = out.result(timeout=60).sequences
        assert len(sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in sequences), sequences
        for _ in range(600):
            if dash.pool.telemetry.total_updates >= 4:
                break
            await asyncio.sleep(0.05)
        assert dash.pool.telemetry.total_updates >= 4, dash.pool.telemetry.total_updates
    dash.close()
    assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
    print("ok")

asyncio.run(main())
"""
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
