"""The README is a front page (issue 35): at most 200 lines, every figure it quotes sits in the
headline-figures table beside the benchmark command that measures it, and the site states the
same figure with the same command (a row of one of docs/*.md's tables). Rows may be appended to
the table: each new one is checked the same way."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
SECTION = "## Headline figures"
# a figure: a bold span with a digit in it (**1.81–1.93×**, **0.025 ms**), or any ratio like 1.70×
BOLD = re.compile(r"\*\*([^*]*\d[^*]*)\*\*")
RATIO = re.compile(r"\d+(?:\.\d+)?×")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def _headline_rows() -> list[tuple[str, str, str]]:
    assert SECTION in README, f"README: no '{SECTION}' section"
    table = README.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # past header and rule
    assert rows, "README: the headline-figures table is empty"
    out = []
    for row in rows:
        cells = _cells(row)
        assert len(cells) == 3, f"README headline row is not 'what | measured | command': {row}"
        out.append((cells[0], cells[1], cells[2]))
    return out


def _command(cell: str) -> str:
    m = re.search(r"`((?:\.venv/bin/)?python [^`]+)`", cell)
    return m.group(1) if m else ""


def _site_rows() -> list[tuple[str, str]]:
    """(row text, its command) for every table row of the site's pages; a row whose command cell
    says 'same' has the command of the row above (the pages' convention)."""
    found = []
    for page in sorted((REPO / "docs").rglob("*.md")):
        previous = ""
        for line in page.read_text(encoding="utf-8").splitlines():
            if not line.startswith("|"):
                previous = ""
                continue
            command = next((c for c in map(_command, _cells(line)) if c), "")
            if not command and re.search(r"\|\s*same\b", line):
                command = previous
            previous = command or previous
            if command:
                found.append((line, command))
    return found


def test_the_readme_is_a_front_page() -> None:
    lines = README.count("\n") + 1
    assert lines <= 200, f"README.md has {lines} lines (a front page: at most 200)"
    for section in ("## Quick start", "## Ten lines", SECTION):
        assert section in README, section


def test_every_headline_figure_has_its_benchmark_command_beside_it() -> None:
    for what, measured, command_cell in _headline_rows():
        command = _command(command_cell)
        assert command, f"README figure '{what}' has no command beside it: {command_cell!r}"
        script = next((w for w in command.split() if w.endswith(".py")), "")
        assert script and (REPO / script).is_file(), f"README: the command {command!r} names no script of the repo"
        assert BOLD.search(measured), f"README figure '{what}': no figure in bold: {measured!r}"


def test_no_figure_outside_the_headline_table() -> None:
    rest = README.split(SECTION, 1)[0] + "\n## " + README.split(SECTION, 1)[1].split("\n## ", 1)[-1]
    assert not BOLD.findall(rest) and not RATIO.findall(rest), (
        f"README quotes figures outside '{SECTION}' (put them in its table, beside their command): "
        f"{BOLD.findall(rest) + RATIO.findall(rest)}")


def test_the_site_states_the_same_figures_with_the_same_commands() -> None:
    site = _site_rows()
    for what, measured, command_cell in _headline_rows():
        command = _command(command_cell)
        figures = BOLD.findall(measured)
        rows = [row for row, cmd in site if cmd == command]
        assert rows, f"no table row of docs/*.md has the command {command!r} (README: '{what}')"
        assert any(all(f in row for f in figures) for row in rows), (
            f"README says {figures} for '{what}' ({command}); no row of the site with that command does")


def test_the_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README links to a missing file: {target}"
