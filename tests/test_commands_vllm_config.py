"""Tests of `tiering vllm-config`: through tiering.cli.main, and from a real wheel install.

That vLLM accepts the printed config and runs our tier from it is tested with vLLM in
tests/test_integrations_vllm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tiering.cli import EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_the_config_with_the_nvme_tier_under_vllm_s_cpu_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "vllm-config", "/mnt/nvme/kv", "--nvme-capacity", "500G", "--cpu", "64GiB",
        "--fsync", "none", "--events",
    )  # fmt: skip
    assert (code, err) == (EXIT_OK, "")
    assert len(out.splitlines()) == 1  # one line: it goes into a shell's "$(...)"
    config = json.loads(out)
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 64 << 30
    assert extra["secondary_tiers"] == [
        {
            "type": "NVMeTierManager",
            "module_path": "tiering.integrations.vllm",
            "root": "/mnt/nvme/kv",
            "capacity_bytes": 500 << 30,
            "fsync": "none",
            "enable_kv_events": True,
        }
    ]


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "vllm-config", "--help")
    assert code == EXIT_OK
    flat = " ".join(out.split())  # argparse wraps help text at any space
    for default in ("(default: 100G)", "(default: 16G)", "(default: batch)"):
        assert default in flat, (default, out)


def test_a_relative_root_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "vllm-config", "relative/root")
    assert (code, out) == (EXIT_USAGE, "")
    assert err.strip() == (
        "tiering vllm-config: error: root: must be an absolute path, got 'relative/root'"
    )


@pytest.mark.parametrize("option", ["--nvme-capacity", "--cpu"])
def test_a_bad_size_is_a_usage_error_naming_the_option(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "vllm-config", "/kv", option, "lots")
    assert (code, out) == (EXIT_USAGE, "")
    assert f"argument {option}: not a size: 'lots'" in err.strip().splitlines()[-1]


# -- installed from a wheel: what a user without a clone gets -------------------------


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The project built into a wheel (from a copy of its sources, offline, with the
    installed setuptools) and installed by pip into a directory of its own: (the wheel,
    that directory)."""
    pytest.importorskip("setuptools", minversion="64", reason="the build backend is missing")
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("tiering", "backends"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    target = base / "site"

    def pip(*argv: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *argv,
             "--no-deps", "--no-index"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    pip("wheel", "--no-build-isolation", "-w", str(base / "dist"), str(source))
    (wheel,) = (base / "dist").glob("kv_tiering-*.whl")
    pip("install", "--target", str(target), str(wheel))
    return wheel, target


def _installed_tiering(target: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed ``tiering`` console script, run away from the source tree, with
    only the installed package ahead of the environment's own packages."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [str(target / "bin" / "tiering"), *argv],
        cwd=target.parent, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_wheel_install_has_tiering_vllm_config(wheel_install: tuple[Path, Path]) -> None:
    wheel, target = wheel_install
    assert "tiering/commands/vllm_config.py" in zipfile.ZipFile(wheel).namelist()
    assert not any(name.startswith("examples/") for name in zipfile.ZipFile(wheel).namelist())
    help_text = _installed_tiering(target, "vllm-config", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "usage: tiering vllm-config" in help_text.stdout
    done = _installed_tiering(target, "vllm-config", "/mnt/nvme/kv", "--cpu", "1G")
    assert done.returncode == 0, done.stderr
    extra = json.loads(done.stdout)["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 1 << 30
    assert extra["secondary_tiers"][0]["root"] == "/mnt/nvme/kv"


def test_tiering_bench_in_a_wheel_install_says_where_the_benchmarks_are(
    wheel_install: tuple[Path, Path],
) -> None:
    _, target = wheel_install
    done = _installed_tiering(target, "bench")
    assert done.returncode == EXIT_USAGE
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert "they ship with the source tree (examples/bench_*.py)" in done.stderr
    assert "from a clone of the repository" in done.stderr
