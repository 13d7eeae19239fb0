"""The README cannot drift from the code: its Quick start runs as written, its set-up
commands are the ones CI runs, every file it or docs/ points at exists, the module map
in docs/architecture.md names every module, and every import in the tree is one that
page's rooms table allows."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests._scripts import script_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    blocks = _code_blocks(_section(README.read_text(), "Quick start"), "python")
    assert len(blocks) == 1, "the Quick start should hold exactly one python block"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    # A fresh interpreter in an unrelated directory, running this checkout's package
    # (installed or not: no editable install is needed).
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"(\d+) of \1 blocks came back byte-exact", lines[-1]), done.stdout
    assert int(lines[-1].split()[0]) > 0
    # The events it prints: stored in the CPU tier and in both secondary tiers.
    assert {line.rsplit(" ", 1)[-1] for line in lines[:-1] if "stored in" in line} >= {
        "CPU",
        "MEMORY",
        "NVME",
    }


def test_set_up_commands_are_the_ones_ci_runs() -> None:
    commands = _code_blocks(_section(README.read_text(), "Set up"), "bash")[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python3 -m pip install -e ".[test]" -c .ci/torch-cpu.txt' in commands
    assert '-e ".[test]" -c .ci/torch-cpu.txt' in ci
    assert "python3 -m pytest -q" in commands and "python3 -m pytest -q" in ci
    assert "python3 examples/driver.py" in commands
    assert (ROOT / "examples" / "driver.py").is_file()
    assert (ROOT / ".ci" / "torch-cpu.txt").is_file()


def test_the_torch_pin_is_the_cpu_build_and_the_readme_says_where_it_is() -> None:
    lines = (ROOT / ".ci" / "torch-cpu.txt").read_text().splitlines()
    pins = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    # A "+cpu" pin resolves to the CPU build or to nothing: never to PyPI's CUDA build.
    assert len(pins) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+\+cpu", pins[0]), pins
    section = _section(README.read_text(), "Set up")
    first = "python3 -m pip install -r .ci/torch-cpu.txt"
    assert f"{first} --index-url https://download.pytorch.org/whl/cpu" in section
    flat = " ".join(section.split())
    assert f"The user requested (constraint) {pins[0]}" in flat  # pip's words without it


def test_ci_tests_the_newest_versions_and_then_every_lower_bound() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "--upgrade --upgrade-strategy eager" in ci  # a machine's older packages go
    assert ci.rstrip().endswith(".ci/lower-bounds")
    printed = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "lower-bounds"), "--print"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    bounds = {re.split(r"[\[>]", text)[0]: text.split(">=")[1] for text in direct}
    torch = bounds.pop("torch")  # the CPU build .ci/torch-cpu.txt pins
    assert f"torch=={torch}.0+cpu" in (ROOT / ".ci" / "torch-cpu.txt").read_text()
    assert printed == [f"{name}=={low}" for name, low in bounds.items()]


def test_every_figure_row_shows_a_command_the_regeneration_script_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/readme_figures.py runs each row's command as the README shows it."""
    spec = importlib.util.spec_from_file_location("readme_figures", EXAMPLES / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "readme_figures", script)  # its dataclass looks it up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts tests/ first on the path
    spec.loader.exec_module(script)
    table = _section(README.read_text(), "Figures")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    commands = [row.command.format(**script.README_NAMES) for row in script.ROWS]
    for command in commands:
        assert sum(f"`{command}`" in line for line in rows) == 1, command
    assert len(rows) == len(commands), "a figure row without a command the script runs"
    assert "python3 examples/readme_figures.py" in table


def test_vllm_docs_show_what_vllm_config_prints() -> None:
    section = _section((ROOT / "docs" / "vllm.md").read_text(), "Set up")
    (command,) = re.findall(r'"\$\(tiering (vllm-config [^)]*)\)"', section)
    printed = subprocess.run(
        [sys.executable, "-m", "tiering", *command.split()],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (shown,) = _code_blocks(section, "json")
    assert json.loads(shown) == json.loads(printed)


def test_relative_links_resolve() -> None:
    assert DOCS, "docs/ holds no markdown files"
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _table_paths(text: str) -> list[Path]:
    """The files and folders named in the first column of a markdown table.

    A cell may name several: "`tiering/device/kv_layout.py`, `copy_cuda.py`" - a bare name lives
    beside the path named before it in the same cell.
    """
    paths = []
    for cell in re.findall(r"^\| ([^|]+) \|", text, re.M):
        base = ""
        for name in re.findall(r"`([\w/.]+)`", cell):
            if "/" in name:
                base = name.rsplit("/", 1)[0] if not name.endswith("/") else name
            paths.append(ROOT / (name if "/" in name else f"{base}/{name}"))
    return paths


def test_module_table_names_real_files() -> None:
    table = _section(README.read_text(), "Architecture at a glance")
    paths = _table_paths(table)
    assert len(paths) > 10, "the README's module table was not found"
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    assert not missing, f"the README's module table names missing files: {missing}"


# Folders whose modules docs/architecture.md names by one row for the folder.
FOLDER_ROWS = ("tiering/core/policies/", "tiering/commands/")


def _modules() -> list[Path]:
    """Every module of tiering/ and backends/, packages' __init__.py left out."""
    return [
        p
        for package in ("tiering", "backends")
        for p in sorted((ROOT / package).rglob("*.py"))
        if p.name != "__init__.py"
    ]


def test_architecture_module_table_is_complete() -> None:
    table = _section((ROOT / "docs" / "architecture.md").read_text(), "Modules")
    named = set(_table_paths(table))
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"docs/architecture.md names missing files: {missing}"
    folders = [ROOT / folder for folder in FOLDER_ROWS]
    assert all(folder in named for folder in folders), f"a row for each of {FOLDER_ROWS}"
    unnamed = [
        str(p.relative_to(ROOT))
        for p in _modules()
        if p not in named and not any(p.is_relative_to(f) for f in folders)
    ]
    assert not unnamed, f"docs/architecture.md's module table lacks {unnamed}"


def _rooms() -> list[tuple[list[str], list[str], list[str]]]:
    """The rooms table of docs/architecture.md: per row, the paths it holds, the paths its
    modules may import at import time, and those they may import only lazily."""
    table = _section((ROOT / "docs" / "architecture.md").read_text(), "Rooms")
    rooms = []
    for row in re.findall(r"^\| (`.+?) \| .+? \| (.+) \|$", table, re.M):
        held = re.findall(r"`([\w/.]+/|[\w/.]+\.py)`", row[0])
        eager, _, lazy = row[1].partition("lazily")
        paths = r"`((?:tiering|backends)/[\w/.]*)`"
        rooms.append((held, re.findall(paths, eager), re.findall(paths, lazy)))
    return rooms


def _import_names(node: ast.AST, at_import: bool) -> list[tuple[str, bool]]:
    """The modules imported under ``node``, each with whether its import runs when the
    module is imported: not inside a function, nor under ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.Import):
        return [(alias.name, at_import) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        return [(name, at_import) for name in names]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        at_import = False
    elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        return [
            *(n for child in node.body for n in _import_names(child, False)),
            *(n for child in node.orelse for n in _import_names(child, at_import)),
        ]
    return [n for child in ast.iter_child_nodes(node) for n in _import_names(child, at_import)]


def _imports(module: Path) -> list[tuple[str, bool]]:
    """The files of tiering/ and backends/ a module imports, each with whether the import
    runs when the module is imported."""
    found = []
    for name, at_import in _import_names(ast.parse(module.read_text()), True):
        if name.split(".")[0] not in ("tiering", "backends"):
            continue
        path = ROOT.joinpath(*name.split("."))
        for target in (path.with_suffix(".py"), path / "__init__.py"):
            if target.is_file():
                found.append((str(target.relative_to(ROOT)), at_import))
    return found


def _within(path: str, allowed: list[str]) -> bool:
    return any(path == a or (a.endswith("/") and path.startswith(a)) for a in allowed)


def test_every_import_is_one_the_rooms_table_allows() -> None:
    """tiering never imports backends (but where the rooms table says), backends only
    tiering's kit: every import statement, lazy ones too, against docs/architecture.md."""
    rooms = _rooms()
    assert len(rooms) >= 12, "docs/architecture.md's rooms table was not found"
    breaches = []
    for module in sorted([*(ROOT / "tiering").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]):
        source = str(module.relative_to(ROOT))
        # The room that holds the module: the row naming the longest path around it.
        owners = [(len(p), room) for room in rooms for p in room[0] if _within(source, [p])]
        held, eager, lazy = max(owners, key=lambda owner: owner[0], default=(0, ([], [], [])))[1]
        for target, at_import in _imports(module):
            if _within(target, held) or _within(target, eager):
                continue
            if not at_import and _within(target, lazy):
                continue
            breaches.append(f"{source} imports {target}" + ("" if at_import else " (lazily)"))
    assert not breaches, f"imports docs/architecture.md's rooms table does not allow: {breaches}"
