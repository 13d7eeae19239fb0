"""The README cannot drift from the code: its Quick start runs as written, its set-up
commands are the ones CI runs, every file it or docs/ points at exists, and the module
map in docs/architecture.md names every module."""

from __future__ import annotations

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


def test_architecture_module_table_is_complete() -> None:
    table = _section((ROOT / "docs" / "architecture.md").read_text(), "Modules")
    named = set(_table_paths(table))
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"docs/architecture.md names missing files: {missing}"
    modules = [
        p
        for package in ("tiering", "backends")
        for p in sorted((ROOT / package).glob("*.py"))
        if p.name != "__init__.py"
    ]
    unnamed = [str(p.relative_to(ROOT)) for p in modules if p not in named]
    assert not unnamed, f"docs/architecture.md's module table lacks {unnamed}"
    assert ROOT / "tiering" / "policies" in named, (
        "docs/architecture.md lacks tiering/core/policies/"
    )
