"""Tests of `tiering inspect`, `verify` and `clear` through tiering.cli.main, on real roots."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.nvme_format import HEADER_BYTES, namespace_dirname
from backends.nvme_segment_tier import NVMeSegmentTier
from tests._nvme_helpers import random_pool, store_job
from tests._scripts import run_script
from tiering.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main

BLOCK = 16 << 10
RECORD = HEADER_BYTES + BLOCK
NAMESPACE = "model=tiny;layout=segments"


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, 8) as view:
        yield view


async def make_root(
    pool: memoryview, root: Path, n: int = 6, encryption: str | None = None
) -> list[bytes]:
    names = [f"c-{i}-".encode() + os.urandom(8) for i in range(n)]
    async with NVMeSegmentTier(
        pool,
        BLOCK,
        root=root,
        namespace=NAMESPACE,
        capacity_bytes=32 * RECORD,
        min_free_bytes=0,
        segment_bytes=HEADER_BYTES + 4 * RECORD,
        encryption=encryption,
    ) as tier:
        assert (await store_job(tier, names, range(n))).success
    return names


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict[str, object]:
    return json.loads(out.strip().splitlines()[-1])


def flip_payload_byte(root: Path) -> None:
    [segment, *_] = sorted((root / namespace_dirname(NAMESPACE) / "segments").iterdir())
    with open(segment, "r+b") as file:
        file.seek(2 * HEADER_BYTES + 50)
        byte = file.read(1)
        file.seek(2 * HEADER_BYTES + 50)
        file.write(bytes([byte[0] ^ 0xFF]))


async def test_inspect_prints_a_table_and_json(
    pool: memoryview, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_root(pool, tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == EXIT_OK and err == ""
    assert "6 blocks" in out and NAMESPACE in out and "segments" in out
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--json")
    report = last_json(out)
    assert code == EXIT_OK and report["blocks"] == 6
    assert report["payload_bytes"] == 6 * BLOCK


async def test_verify_exits_1_on_a_bad_block_even_once_removed_then_0(
    pool: memoryview, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_root(pool, tmp_path)
    assert run(capsys, "verify", str(tmp_path))[0] == EXIT_OK
    flip_payload_byte(tmp_path)
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == EXIT_FAILURE and "payload checksum mismatch" in out
    code, out, _ = run(capsys, "verify", str(tmp_path), "--remove", "--json")
    report = last_json(out)
    assert code == EXIT_FAILURE and report["bad"] == 1 and report["removed"] == 1
    code, out, _ = run(capsys, "verify", str(tmp_path), "--json")
    assert code == EXIT_OK and last_json(out)["checked"] == 5


async def test_verify_takes_the_keyring_from_an_environment_variable(
    pool: memoryview,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KV_TEST_KEYS", "3:" + base64.b64encode(os.urandom(32)).decode())
    await make_root(pool, tmp_path, encryption="env:KV_TEST_KEYS")
    assert run(capsys, "verify", str(tmp_path), "--encryption", "env:KV_TEST_KEYS")[0] == EXIT_OK
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == EXIT_FAILURE and "encrypted (key id 3)" in out
    code, _, err = run(capsys, "verify", str(tmp_path), "--remove")
    assert code == EXIT_FAILURE and "holds encrypted blocks" in err
    code, _, err = run(capsys, "verify", str(tmp_path), "--encryption", "env:KV_NOT_SET")
    assert code == EXIT_USAGE and "'KV_NOT_SET' is not set" in err


async def test_clear_needs_yes_or_dry_run_and_then_removes_the_namespace(
    pool: memoryview, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_root(pool, tmp_path)
    digest = namespace_dirname(NAMESPACE).rpartition("-")[2]

    code, out, err = run(capsys, "clear", str(tmp_path), "--namespace", digest[:8])
    assert code == EXIT_USAGE and "would remove" in out and "--yes" in err
    code, out, _ = run(capsys, "clear", str(tmp_path), "--dry-run", "--json")
    assert code == EXIT_OK and last_json(out)["dry_run"] is True
    assert last_json(run(capsys, "inspect", str(tmp_path), "--json")[1])["blocks"] == 6

    code, out, _ = run(capsys, "clear", str(tmp_path), "--namespace", digest[:8], "--yes")
    assert code == EXIT_OK and "removed" in out
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "{missing}"], "does not exist"),
        (["verify", "{other}"], "is not an NVMe root"),
        (["clear", "{other}", "--yes"], "is not an NVMe root"),
        (["inspect", "{file}", "--json"], "is not a directory"),
        (["clear", "{empty}", "--namespace", "nope", "--yes"], "no namespace 'nope'"),
    ],
)
def test_user_errors_exit_2_with_one_line_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.txt").write_text("precious")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    paths = {name: str(tmp_path / name) for name in ("missing", "other", "empty", "file")}
    code, out, err = run(capsys, *(arg.format(**paths) for arg in argv))
    assert code == EXIT_USAGE and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert err.startswith(f"tiering {argv[0]}: error: ")
    assert (tmp_path / "other" / "data.txt").exists()


def test_help_and_bad_options_use_argparse_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("inspect", "verify", "clear"):
        code, out, _ = run(capsys, name, "--help")
        assert code == EXIT_OK and "ROOT" in out and "--json" in out
    assert run(capsys, "clear", "/tmp", "--yes", "--dry-run")[0] == EXIT_USAGE
    assert run(capsys, "verify")[0] == EXIT_USAGE


async def test_python_m_tiering_inspect_json_in_a_subprocess(
    pool: memoryview, tmp_path: Path
) -> None:
    names = await make_root(pool, tmp_path, n=3)
    done = run_script("-m", "tiering", "inspect", str(tmp_path), "--json")
    assert done.returncode == EXIT_OK, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    [ns] = report["namespaces"]
    assert ns["namespace"] == NAMESPACE and ns["blocks"] == len(names)
