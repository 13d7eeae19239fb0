"""Tests of the `tiering` command's own behaviour (tiering.cli): --version, what --help
imports, Ctrl-C at any point. The subcommands have test modules of their own."""

from __future__ import annotations

from importlib.metadata import version

from tests._scripts import interrupt_script, run_script
from tiering.cli import EXIT_OK
from tiering.cli_args import EXIT_INTERRUPTED

# A `python -m tiering` whose import of torch stalls: it says so on stdout, then waits
# (for the test's SIGINT), so the interruption lands inside the subcommand's imports.
_STALLED_TORCH = """
import importlib.abc, runpy, sys, time

class StallTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.stdout.write("importing torch\\n")  # one write: the test waits for the line
            sys.stdout.flush()
            time.sleep(600)
        return None

sys.meta_path.insert(0, StallTorch())
runpy.run_module("tiering", run_name="__main__", alter_sys=True)
"""


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


def test_ctrl_c_while_a_subcommand_imports_prints_one_line_and_exits_130() -> None:
    done = interrupt_script(
        "-c", _STALLED_TORCH, "replay", "--limit", "1", ready="importing torch\n"
    )
    assert done.returncode == EXIT_INTERRUPTED
    assert done.stderr == "tiering replay: interrupted\n"
    assert done.stdout == "importing torch\n"  # interrupted in the import: nothing ran
