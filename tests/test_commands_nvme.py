"""Tests of `tiering inspect`, `verify` and `clear` through tiering.cli.main, on real roots."""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.nvme.segment_format import namespace_dirname
from backends.nvme.tier import NVMeTier
from tests._nvme_helpers import random_pool, store_job
from tests._scripts import ROOT, run_script, script_env
from tiering.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from tiering.tiers.block_record import HEADER_BYTES

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
    async with NVMeTier(
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


async def test_inspect_verify_and_clear_run_without_importing_torch(
    pool: memoryview, tmp_path: Path
) -> None:
    await make_root(pool, tmp_path, n=3)
    for argv in (["inspect"], ["verify"], ["clear", "--dry-run"]):
        done = run_script("-X", "importtime", "-m", "tiering", *argv, str(tmp_path), "--json")
        assert done.returncode == EXIT_OK, done.stderr
        imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines()]
        assert "backends.nvme.maintenance" in imported  # the command's imports are logged
        assert [name for name in imported if name.split(".")[0] == "torch"] == [], argv
        assert last_json(done.stdout)["root"] == str(tmp_path)


@pytest.mark.parametrize("kind", ["world-writable", "a-file", "missing"])
@pytest.mark.parametrize(
    "argv", [["inspect"], ["verify"], ["clear", "--dry-run"], ["replay", "--limit", "1", "--nvme"]]
)
def test_every_command_refuses_a_root_the_tier_refuses_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], kind: str
) -> None:
    root = tmp_path / "root"
    if kind == "world-writable":
        root.mkdir()
        os.chmod(root, 0o777)
        why = "has mode 777: others can write to it"
    elif kind == "a-file":
        root.write_bytes(b"precious")
        why = "is not a directory"
    elif argv[0] == "replay":
        pytest.skip("the tier makes a missing root, as documented")
    else:
        why = "does not exist"
    code, out, err = run(capsys, *argv, str(root))
    assert code == EXIT_USAGE and out == ""
    option = "root" if argv[0] == "replay" else "ROOT"
    assert err.startswith(f"tiering {argv[0]}: error: {option}: {str(root)!r} {why}")
    assert err.count("\n") == 1 and "Traceback" not in err
    if kind == "world-writable":
        assert os.listdir(root) == []  # nothing made in it
    elif kind == "a-file":
        assert root.read_bytes() == b"precious"


@pytest.mark.parametrize("kind", ["a-file", "unwritable"])
def test_replay_refuses_a_root_that_is_a_file_or_unwritable_alike_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    if kind == "a-file":
        root, why = tmp_path / "root", "is not a directory"
        root.write_bytes(b"precious")
    else:  # a directory of this user that takes no new entry, even from root
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs Linux's /proc")
        root, why = Path("/proc/self"), "is not writable: "
    code, out, err = run(capsys, "replay", "--limit", "1", "--nvme", str(root))
    assert code == EXIT_USAGE and out == ""
    assert err.startswith(f"tiering replay: error: root: {str(root)!r} {why}")
    assert err.count("\n") == 1 and "Traceback" not in err


async def test_verify_names_each_bad_block_by_segment_record_and_key(
    pool: memoryview, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = await make_root(pool, tmp_path)
    flip_payload_byte(tmp_path)  # in record 0 of the first segment
    [ns] = last_json(run(capsys, "verify", str(tmp_path), "--json")[1])["namespaces"]
    [bad] = ns["bad"]
    assert bad["key"] in {name.hex() for name in names}
    assert bad["path"].endswith("-00000000.seg") and bad["record"] == 0
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == EXIT_FAILURE
    [line] = [row for row in out.splitlines() if "payload checksum mismatch" in row]
    assert line == f"  {bad['path']} record 0 key {bad['key']}: {bad['reason']}"


async def test_verify_shows_progress_on_a_terminal_only(pool: memoryview, tmp_path: Path) -> None:
    await make_root(pool, tmp_path)
    code, out, terminal = run_on_a_terminal("verify", str(tmp_path))
    assert code == EXIT_OK
    assert b"\rverify: reading block headers" in terminal
    assert b"\rverify: 6/6 blocks checked" in terminal
    assert out.startswith(f"root {tmp_path}: 6 blocks checked, 0 bad\n")
    assert "\r" not in out  # the progress line never reaches stdout


def run_on_a_terminal(*argv: str) -> tuple[int, str, bytes]:
    """``tiering <argv>`` with stderr on a pseudo-terminal: its exit status, stdout, and
    everything the terminal showed."""
    primary, secondary = os.openpty()
    try:
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "tiering", *argv],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=secondary, env=script_env(),
            )  # fmt: skip
        finally:
            os.close(secondary)  # the child holds its own copy
        shown = b""
        # Until the child closes the terminal (EIO or EOF), or it stays silent for long.
        while select.select([primary], [], [], 120)[0]:
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
        out, _ = process.communicate(timeout=120)
    finally:
        os.close(primary)
    return process.returncode, out.decode(), shown


async def test_inspect_counts_a_record_verify_removed_as_removed_not_damaged(
    pool: memoryview, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_root(pool, tmp_path)
    flip_payload_byte(tmp_path)
    assert run(capsys, "verify", str(tmp_path), "--remove")[0] == EXIT_FAILURE
    code, out, _ = run(capsys, "inspect", str(tmp_path))
    assert code == EXIT_OK
    first = out.splitlines()[0]
    assert ": 1 namespace(s), 5 blocks," in first and first.endswith(" 0 damaged, 1 orphaned")
    assert "1 of 4 record slots removed by `tiering verify --remove`" in out
