"""Tests of the `tiering` command's own behaviour (tiering.cli): --version, what --help
imports, Ctrl-C at any point. The subcommands have test modules of their own."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from tests._scripts import interrupt_script, run_script, stall_torch_imports
from tiering.cli import EXIT_OK
from tiering.cli_args import EXIT_INTERRUPTED


def test_version_prints_the_installed_package_version() -> None:
    done = run_script("-m", "tiering", "--version")
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout == f"tiering {version('kv-tiering')}\n"


def test_help_and_version_import_no_torch() -> None:
    for option in ("--help", "--version"):
        done = run_script("-X", "importtime", "-m", "tiering", option)
        assert done.returncode == EXIT_OK, done.stderr
        imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines()]
        assert "tiering.cli" in imported  # the import log is there, and complete
        assert [name for name in imported if name.split(".")[0] == "torch"] == []


def test_ctrl_c_while_a_subcommand_imports_prints_one_line_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interruption lands inside the subcommand's imports.
    ready = stall_torch_imports(tmp_path, monkeypatch)
    done = interrupt_script("-m", "tiering", "replay", "--limit", "1", ready=ready)
    assert done.returncode == EXIT_INTERRUPTED
    assert done.stderr == "tiering replay: interrupted\n"
    assert done.stdout == "importing torch\n"  # interrupted in the import: nothing ran
