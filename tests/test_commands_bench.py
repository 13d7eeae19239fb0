"""Tests of `tiering bench`: the list of benchmarks, and Ctrl-C while one runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests._scripts import ROOT, interrupt_script, stall_torch_imports
from tiering.cli import EXIT_OK, main
from tiering.cli_args import EXIT_INTERRUPTED
from tiering.commands.bench import benchmarks

# Long enough that it is still running when the signal comes, on a busy machine too; the
# signal comes once it printed its first line (a figure: past its imports and start-up).
_LONG_ENGINE_RUN = ["bench", "engine", "--", "--gib", "0.01", "--repeats", "5000"]


def test_the_list_shows_each_benchmark_first_paragraph_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench"]) == EXIT_OK
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    listed = " ".join(out.split())
    found = benchmarks()
    assert len(found) == len(list(ROOT.glob("examples/bench_*.py"))) > 0
    for name, path in found.items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc is not None
        first = " ".join(doc.partition("\n\n")[0].split())
        assert f"{name} {first}" in listed


def test_ctrl_c_stops_the_benchmark_with_one_line_and_exit_130() -> None:
    # As a terminal does: SIGINT to the whole process group, tiering and the benchmark.
    done = interrupt_script("-m", "tiering", *_LONG_ENGINE_RUN, ready="\n")
    assert done.returncode == EXIT_INTERRUPTED
    assert done.stderr == "bench_engine.py: interrupted\n"


def test_ctrl_c_while_the_benchmark_imports_torch_prints_one_line_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tiering bench` imports no torch: the stall is the benchmark's.
    ready = stall_torch_imports(tmp_path, monkeypatch)
    done = interrupt_script("-m", "tiering", *_LONG_ENGINE_RUN, ready=ready)
    assert done.returncode == EXIT_INTERRUPTED
    assert done.stderr == "bench_engine.py: interrupted\n"
    assert done.stdout == "importing torch\n"  # interrupted in the import: nothing ran


def test_a_sigint_to_tiering_alone_is_passed_on_to_the_benchmark() -> None:
    done = interrupt_script("-m", "tiering", *_LONG_ENGINE_RUN, ready="\n", to_group=False)
    assert done.returncode == EXIT_INTERRUPTED
    # The benchmark stopped by itself (its own line), not killed by tiering.
    assert done.stderr == "bench_engine.py: interrupted\n"
