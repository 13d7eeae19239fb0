"""Tests of `tiering sglang-config` through tiering.cli.main, without SGLang.

That SGLang's own argument parser takes the printed words and that its storage factory
builds our tier from them is tested with SGLang in tests/test_integrations_sglang.py.
"""

from __future__ import annotations

import json

import pytest

from tiering.cli import EXIT_OK, EXIT_USAGE, main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_sglang_s_arguments_with_the_nvme_tier_as_its_storage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "sglang-config", "/mnt/nvme/kv", "--nvme-capacity", "500G", "--fsync", "none",
        "--prefetch-policy", "best_effort",
    )  # fmt: skip
    assert (code, err) == (EXIT_OK, "")
    assert len(out.splitlines()) == 1
    words = out.split()  # as the shell splits "$(tiering sglang-config ...)"
    assert words[:-1] == [
        "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-prefetch-policy", "best_effort",
        "--hicache-storage-backend-extra-config",
    ]  # fmt: skip
    assert json.loads(words[-1]) == {
        "backend_name": "kv-tiering",
        "module_path": "tiering.integrations.sglang",
        "class_name": "NVMeHiCacheStorage",
        "interface_v1": 1,
        "root": "/mnt/nvme/kv",
        "capacity_bytes": 500 << 30,
        "fsync": "none",
    }


def test_extra_config_prints_only_the_backend_s_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "sglang-config", "/kv", "--extra-config")
    assert code == EXIT_OK
    config = json.loads(out)
    assert (config["class_name"], config["capacity_bytes"]) == ("NVMeHiCacheStorage", 100 << 30)


@pytest.mark.parametrize(
    ("root", "reason"),
    [("relative/root", "must be an absolute path"), ("/mnt/my kv", "must hold no whitespace")],
)
def test_a_root_the_shell_would_misplace_is_a_usage_error_naming_it(
    root: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "sglang-config", root)
    assert (code, out) == (EXIT_USAGE, "")
    assert err.strip() == f"tiering sglang-config: error: root: {reason}, got {root!r}"


def test_a_bad_size_is_a_usage_error_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "sglang-config", "/kv", "--nvme-capacity", "lots")
    assert (code, out) == (EXIT_USAGE, "")
    assert "argument --nvme-capacity: not a size: 'lots'" in err.strip().splitlines()[-1]
