"""The example scripts behave like tools: bad arguments stop them before any work with
exit status 2 and a message naming the argument; ``--help`` shows the defaults; the
progress line never reaches a pipe; the benchmark's last stdout line stays JSON."""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import json
import mmap
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._scripts import TRACE, guard_page_cache, interrupt_script, last_json, run_script
from tiering.cli_args import EXIT_INTERRUPTED, Progress

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _script(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` under a private module name (main() is not run)."""
    module_name = f"_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


# -- each script, in a subprocess -----------------------------------------------------


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("bench_nvme.py", ["--block-sizes", "2X"], "--block-sizes"),
        ("bench_engine.py", ["--repeats", "0"], "--repeats"),
        ("bench_manager.py", ["missing-trace.jsonl", "64", "--policies", "lru,nope"], "--policies"),
        ("driver.py", ["--device", "tpu"], "--device"),
        ("bench_vllm_tiers.py", ["--block-sizes", "1000"], "--block-sizes"),
        ("bench_redis.py", ["http://localhost:6379"], "url"),
        ("bench_redis.py", ["--job-blocks", "0"], "--job-blocks"),
    ],
)
def test_bad_argument_exits_2_naming_it(script: str, args: list[str], named: str) -> None:
    done = run_script(f"examples/{script}", *args)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"argument {named}:" in last
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # nothing was measured or printed before the check


@pytest.mark.parametrize(
    ("script", "defaults"),
    [
        (
            "bench_nvme.py",
            [
                "(default: 2M,128K)",
                "(default: 1.0)",
                "(default: 3)",
                "(default: quick)",
                "(default: fadvise)",
            ],
        ),
        ("bench_nvme_scale.py", ["(default: 16K)", "(default: none)", "(default: fadvise)"]),
        (
            "bench_engine.py",
            ["(default: 200)", "(default: uvloop)", "(default: 1.0)", "(default: lru)"],
        ),
        ("bench_manager.py", ["(default: adaptive,arc,lru,s3fifo)"]),
        ("driver.py", ["default: cuda if available"]),
        ("bench_vllm_tiers.py", ["(default: 2M,128K)", "(default: none)", "(default: 5.0)"]),
        ("bench_redis.py", ["(default: 2M)", "(default: 256)", "(default: 4)"]),
    ],
)
def test_help_shows_defaults(script: str, defaults: list[str]) -> None:
    done = run_script(f"examples/{script}", "--help")
    assert done.returncode == 0, done.stderr
    flat = " ".join(done.stdout.split())  # argparse wraps help text at any space
    for default in defaults:
        assert default in flat, (default, done.stdout)


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_help_shows_defaults_as_they_are_typed(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # some import their neighbours
    with pytest.raises(SystemExit) as exit_info:
        _script(name).parse_args(["--help"])
    assert exit_info.value.code == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "(default: " in flat
    assert "(default: [" not in flat and "(default: (" not in flat, flat


def test_bench_nvme_scale_defaults_to_a_laptop_sized_fill(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = _script("bench_nvme_scale")
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "(default: 100000)" in flat and "about 2 GiB on disk" in flat
    assert "--blocks 1000000" in flat  # how to get the docs' size is said


def test_bench_manager_replays_the_trace_and_ends_with_json() -> None:
    argv = [str(TRACE), "256,1%", "--policies", "lru,adaptive", "--full-blocks-only"]
    done = run_script("examples/bench_manager.py", *argv)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress line on a pipe
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["requests"] > 0 and summary["footprint_blocks"] == 40_148
    runs = summary["runs"]
    assert [(r["capacity"], r["policy"]) for r in runs] == [
        (256, "lru"), (256, "adaptive"), (401, "lru"), (401, "adaptive"),
    ]  # fmt: skip
    for run in runs:
        assert 0.0 < run["hit_ratio"] <= 1.0 and run["block_ops_per_s"] > 0
        assert run["vs_lru"] == pytest.approx(
            run["hit_ratio"] / runs[0 if run["capacity"] == 256 else 2]["hit_ratio"], abs=1e-3
        )


def test_ctrl_c_stops_an_example_with_one_line_and_exit_130(tmp_path: Path) -> None:
    # Long enough that it is still replaying when the signal comes (after its first line of
    # figures), on a busy machine too: 4 policies at 99 capacities, 2,000 requests.
    trace = tmp_path / "trace.jsonl"
    line = '{{"timestamp": {}, "input_length": 4096, "output_length": 1, "hash_ids": {}}}\n'
    trace.write_text(
        "".join(line.format(i, list(range(i % 50, i % 50 + 256))) for i in range(2000))
    )
    capacities = ",".join(f"{p}%" for p in range(1, 100))
    done = interrupt_script("examples/bench_manager.py", str(trace), capacities, ready="\n")
    assert done.returncode == EXIT_INTERRUPTED
    assert done.stderr == "bench_manager.py: interrupted\n"


# -- every checked value, in this process (same parser, no interpreter start-up) ------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--repeat", "0"], "--repeat"),
        (["--repeat", "two"], "--repeat"),
        (["--size-gib", "-1"], "--size-gib"),
        (["--size-gib", "inf"], "--size-gib"),
        (["--size-gib", "0.0001"], "--size-gib"),  # less than one 2 MiB block
        (["--block-sizes", "2M,,128K"], "--block-sizes"),
        (["--block-sizes", "1000"], "--block-sizes"),  # not O_DIRECT-aligned
        (["--block-sizes", "128K,128K"], "--block-sizes"),
        (["--job-mib", "0"], "--job-mib"),
        (["--io-threads", "-2"], "--io-threads"),
        (["--max-inflight", "1.5"], "--max-inflight"),
        (["--fsync", "sometimes"], "--fsync"),
        (["--loop", "trio"], "--loop"),
        (["--baseline-grid", "4"], "--baseline-grid"),
        (["--baseline-grid", "1,2x0"], "--baseline-grid"),
        (["--baseline-grid", "1,1x8"], "--baseline-grid"),
        (["--baseline-grid", "fast"], "--baseline-grid"),
        # 1 MiB holds one 1 MiB block: no stream for each of 2 fio jobs
        (
            ["--size-gib", "0.0009765625", "--block-sizes", "1M", "--baseline-grid", "2x1"],
            "--baseline-grid",
        ),
        (["--vllm-fs", "on"], "--vllm-fs"),
        (["--vllm-fs-threads", "0"], "--vllm-fs-threads"),
    ],
)
def test_bench_nvme_rejects(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parse_args = _script("bench_nvme").parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {named}:" in capsys.readouterr().err


def test_bench_nvme_directory_must_be_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    parse_args = _script("bench_nvme").parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args([str(blocker / "sub")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument directory:" in err
    assert str(blocker) in err
    # A directory that can be made is made, and accepted.
    args = parse_args([str(tmp_path / "new" / "dir"), "--block-sizes", "4K,1M"])
    assert (tmp_path / "new" / "dir").is_dir()
    assert args.block_sizes == [4096, 1 << 20]


def test_bench_nvme_baseline_grid() -> None:
    bench = _script("bench_nvme")
    grid = bench.baseline_grid("full")
    assert (grid.numjobs, grid.iodepths) == ((1, 2, 4), (1, 8, 32))
    grid = bench.baseline_grid("1,4x2,64")
    assert (grid.numjobs, grid.iodepths) == ((1, 4), (2, 64))
    # A point needs a whole block per stream; a synchronous engine has depth 1 only.
    labels = [p.label for p in bench.fio_points(grid, "io_uring", 4096, 2 * 4096)]
    assert labels == ["numjobs=1,iodepth=2,io_uring", "numjobs=1,iodepth=64,io_uring"]
    labels = [p.label for p in bench.fio_points(grid, "psync", 4096, 8 * 4096)]
    assert labels == ["numjobs=1,iodepth=1,psync", "numjobs=4,iodepth=1,psync"]


def test_bench_nvme_best_point_is_the_best_median() -> None:
    rounds = [
        {"a": (1.0, 5.0), "b": (3.0, 1.0)},
        {"a": (9.0, 5.0), "b": (2.0, 1.0)},  # a's one lucky write does not make it best
        {"a": (1.0, 5.0), "b": (2.5, 2.0)},
    ]
    best_point = _script("bench_nvme").best_point
    assert best_point(rounds, 0) == ("b", 2.5, [3.0, 2.0, 2.5])
    assert best_point(rounds, 1) == ("a", 5.0, [5.0, 5.0, 5.0])


class _Neighbour:
    """A file of another program's, beside what a benchmark writes."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, os.urandom(1 << 16)
        path.write_bytes(self.data)
        self.stat = path.stat()

    def assert_untouched(self) -> None:
        assert self.path.read_bytes() == self.data
        after = self.path.stat()
        assert (after.st_ino, after.st_mtime_ns) == (self.stat.st_ino, self.stat.st_mtime_ns)


def _neighbour(directory: Path) -> _Neighbour:
    return _Neighbour(directory / "neighbour.bin")


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``), as ``mincore`` says."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        start = ctypes.c_char.from_buffer(mapped)  # maps the file; touches no page of it
        try:
            if libc.mincore(ctypes.addressof(start), size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del start
    return sum(byte & 1 for byte in vector), pages


def test_bench_nvme_drops_the_files_it_names_from_the_page_cache_and_no_other(
    tmp_path: Path,
) -> None:
    ours, theirs = tmp_path / "ours.bin", tmp_path / "theirs.bin"
    for path in (ours, theirs):
        path.write_bytes(os.urandom(1 << 20))  # in the page cache, dirty
        path.read_bytes()
    assert _resident_pages(ours)[0] > 0
    assert _script("bench_nvme").drop_page_cache([str(ours)]) is True
    assert _resident_pages(ours)[0] == 0  # the next read of ours comes from the disk
    resident, pages = _resident_pages(theirs)
    assert resident == pages  # another file's cached pages stay


def test_bench_nvme_makes_loads_cold_without_dropping_the_machines_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where O_DIRECT is refused, every side's reads are made cold file by file: the
    machine's page cache is never dropped, and a file beside the benchmark's directory
    is untouched."""
    attempts = guard_page_cache(tmp_path / "site", monkeypatch, refuse_o_direct=True)
    neighbour = _neighbour(tmp_path)
    directory = tmp_path / "bench"
    directory.mkdir()
    done = run_script(
        "examples/bench_nvme.py", str(directory), "--size-gib", "0.0005",
        "--block-sizes", "128K", "--repeat", "1", "--baseline-grid", "1,2x2", "--vllm-fs", "off",
    )  # fmt: skip
    (run,) = last_json(done)["runs"]
    assert "128 KiB, tier: buffered" in done.stdout  # so its loads needed the cache dropped
    assert run["cold_load"] is True
    assert not attempts.exists(), attempts.read_text()
    neighbour.assert_untouched()
    assert os.listdir(directory) == []


def test_bench_nvme_runs_and_ends_with_json(tmp_path: Path) -> None:
    """A tiny run, without vLLM's tier whether or not vLLM is installed."""
    done = run_script(
        "examples/bench_nvme.py",
        str(tmp_path),
        "--size-gib",
        "0.0005",  # four 128 KiB blocks
        "--block-sizes",
        "128K",
        "--repeat",
        "1",
        "--baseline-grid",
        "1,2x2",
        "--vllm-fs",
        "off",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress line on a pipe
    lines = done.stdout.strip().splitlines()
    assert "vLLM fs comparison skipped: --vllm-fs off" in lines[0]
    (run,) = json.loads(lines[-1])["runs"]
    assert run["block_bytes"] == 128 << 10
    for key in ("store_GBps", "load_GBps", "baseline_store_GBps", "baseline_load_GBps"):
        assert run[key] > 0, key
    engines = r"(io_uring|libaio|psync|python)"
    for key in ("baseline_store_point", "baseline_load_point"):
        assert re.fullmatch(rf"numjobs=[12],iodepth=[12],{engines}", run[key]), run[key]
    for key in ("vllm_fs_store_GBps", "vllm_fs_load_GBps", "store_vs_vllm_fs"):
        assert run[key] is None, key
    assert sorted(os.listdir(tmp_path)) == []  # every file it made is gone


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--gib", "0"], "--gib"),
        (["--gib", "0.0001"], "--gib"),  # less than one 2 MiB block
        (["--repeats", "-5"], "--repeats"),
        (["--loop", "tokio"], "--loop"),
        (["--policy", "fifo"], "--policy"),
        (["--hot-tier-steps", "0"], "--hot-tier-steps"),
    ],
)
def test_bench_engine_rejects(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _script("bench_engine").parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {named}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--size-mib", "32", "--repeat", "1"], "--repeat"),  # once printed a cost of -100.8 %
        (["--repeat", "2"], "--repeat"),  # three sides: baseline, tier, encrypted tier
        (["--no-encryption", "--repeat", "1"], "--repeat"),
        (["--size-mib", "32"], "--size-mib"),  # 2 jobs of 8 blocks, 4 at once: one wave
        (["--block-sizes", "128K,2M", "--size-mib", "64"], "--size-mib"),  # short at 2M
    ],
)
def test_bench_redis_refuses_settings_that_cannot_give_a_figure(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _script("bench_redis").parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {named}:" in capsys.readouterr().err


def test_bench_redis_accepts_a_small_run_with_enough_jobs_and_rounds() -> None:
    parse_args = _script("bench_redis").parse_args
    args = parse_args(["--size-mib", "32", "--job-blocks", "2", "--repeat", "3"])
    assert (args.size_mib, args.job_blocks, args.repeat) == (32, 2, 3)
    assert parse_args(["--no-encryption", "--repeat", "2"]).repeat == 2
    assert parse_args([]).size_mib == 256  # the defaults pass their own checks


# -- the Redis benchmarks on a server others use --------------------------------------


def _others_keys(server: Any) -> dict[int, dict[bytes, bytes]]:
    """Keys of other programs on ``server``, by database: in the one the benchmarks use
    (0), named as their keys once were and as another engine's blocks are, and in
    another database (1). Stored now."""
    import redis

    others = {
        0: {
            b"bench:0": b"the name bench_redis's baseline once used",
            b"glide-0": b"the name bench_redis_glide once used",
            b"kvt:2:" + b"ab" * 16 + b"::" + b"k" * 32: os.urandom(4096),
            b"user:42": os.urandom(1 << 16),
        },
        1: {b"session:7": os.urandom(64)},
    }
    for db, keys in others.items():
        with redis.Redis(host="127.0.0.1", port=server.port, db=db) as client:
            client.mset(keys)
    return others


def _assert_only_theirs_left(server: Any, others: dict[int, dict[bytes, bytes]]) -> None:
    """Every key of ``others`` is on ``server`` with its value, and no other key (what
    the benchmark wrote is gone); it deleted key by key, never flushing a database."""
    import redis

    for db, keys in others.items():
        with redis.Redis(host="127.0.0.1", port=server.port, db=db) as client:
            assert client.mget(list(keys)) == list(keys.values())
            assert client.dbsize() == len(keys)
            commands = client.info("commandstats")
    assert "cmdstat_unlink" in commands  # it did write, and delete, keys of its own
    assert "cmdstat_flushdb" not in commands and "cmdstat_flushall" not in commands


def test_bench_redis_deletes_the_keys_it_wrote_and_no_other(redis_server: Any) -> None:
    others = _others_keys(redis_server)
    done = run_script(
        "examples/bench_redis.py", redis_server.url, "--block-sizes", "4K", "--size-mib", "1",
        "--concurrency", "2", "--repeat", "2", "--no-encryption", "--lmcache", "off",
    )  # fmt: skip
    figures = last_json(done)
    assert figures["store_GBps"] > 0 and figures["baseline_load_GBps"] > 0
    _assert_only_theirs_left(redis_server, others)


def test_bench_redis_glide_deletes_the_keys_it_wrote_and_no_other(redis_server: Any) -> None:
    pytest.importorskip("glide", reason="valkey-glide goes in a venv of its own (see its --help)")
    others = _others_keys(redis_server)
    bench = _script("bench_redis_glide")
    args = bench.parse_args(["--block-sizes", "4K", "--size-mib", "1", "--repeat", "2"])
    figures = asyncio.run(bench.run(redis_server.port, args))
    assert figures["4K"]["glide_store_GBps"] > 0
    _assert_only_theirs_left(redis_server, others)


def test_bench_fleet_deletes_the_keys_it_wrote_and_no_other(redis_server: Any) -> None:
    others = _others_keys(redis_server)
    done = run_script(
        "examples/bench_fleet.py", "--url", redis_server.url, "--nodes", "2", "--limit", "30"
    )
    result = last_json(done)
    assert all(row["redis_hit_ratio"] > 0 for row in result["runs"])  # the tier was used
    assert all(row["mismatches"] == 0 for row in result["runs"])
    _assert_only_theirs_left(redis_server, others)


async def test_bench_engine_says_it_streams_what_gib_asks_for() -> None:
    """``--gib 0.25`` streams 0.25 GiB; the line says so, and what all hops moved."""
    bench = _script("bench_engine")
    args = bench.parse_args(["--gib", "0.25"])
    lag = await bench.loop_lag_run(int(args.gib * (1 << 30)), args.policy, Progress())
    assert lag["streamed_bytes"] == 1 << 28
    assert lag["bytes_moved"] == 5 * (1 << 28) // 2  # to CPU, to the tier, a quarter back
    line = bench.loop_lag_summary(lag)
    assert line.startswith("loop lag while streaming 0.25 GiB of 2 MiB blocks"), line
    assert "(0.62 GiB over all hops" in line


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
async def test_bench_engine_hot_path_loads_every_block_from_a_full_tier(policy: str) -> None:
    """Two steps' room: each step's stores evict the step before last, and every store and
    load still succeeds, the last step's loads bringing back its bytes (else it exits)."""
    figures = await _script("bench_engine").hot_path_run(1, False, policy, 2)
    assert figures["jobs_per_s"] > 0 and figures["store_call_us_p50"] > 0


def test_bench_manager_rejects_a_bad_trace_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
    trace.write_text(good + "\n" + '{"hash_ids": [1]}' + "\n")
    with pytest.raises(SystemExit) as exit_info:
        _script("bench_manager").parse_args([str(trace), "16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument trace:" in err and "trace.jsonl:2: not a Mooncake trace line" in err


def test_bench_manager_reads_a_valid_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    line = '{{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": {}}}\n'
    trace.write_text(line.format([0, 1, 2]) + "\n" + line.format([0, 1, 7]))
    args, requests = _script("bench_manager").parse_args([str(trace), "8", "--policies", "lru"])
    assert args.capacities == [8]
    assert args.policies == ["lru"]
    assert requests == [
        [i.to_bytes(8, "big") for i in (0, 1, 2)],
        [i.to_bytes(8, "big") for i in (0, 1, 7)],
    ]


@pytest.mark.parametrize("with_nvme", [False, True])
def test_the_main_example_round_trips_every_byte(with_nvme: bool, tmp_path: Path) -> None:
    """The README's first command: the driver runs to the end and checks the bytes."""
    args = ["--nvme", str(tmp_path)] if with_nvme else []
    done = run_script(str(EXAMPLES / "driver.py"), *args)
    assert done.returncode == 0, done.stderr
    assert "all bytes round-tripped exactly" in done.stdout
    if with_nvme:
        assert "stored in NVME" in done.stdout


def test_driver_rejects_an_unusable_nvme_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(SystemExit) as exit_info:
        _script("driver").parse_args(["--nvme", str(blocker)])
    assert exit_info.value.code == 2
    assert "argument --nvme:" in capsys.readouterr().err


# -- bench_nvme_scale -----------------------------------------------------------------


def test_bench_nvme_scale_fills_restarts_and_ends_with_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default the cold restart drops the root's files from the page cache, and
    nothing else: the machine's cache is never dropped, a file beside is untouched."""
    attempts = guard_page_cache(tmp_path / "site", monkeypatch)
    neighbour = _neighbour(tmp_path)
    root = tmp_path / "root"
    done = run_script(
        "examples/bench_nvme_scale.py", "--blocks", "300", "--block-size", "4K", "--root", str(root)
    )
    summary = last_json(done)
    assert not attempts.exists(), attempts.read_text()
    assert summary["page_cache_drop"] == "fadvise"
    neighbour.assert_untouched()
    assert summary["blocks"] == 300
    assert summary["block_bytes"] == 4096
    assert summary["recovered_blocks"] == 300
    assert summary["verified_loads"] > 0
    assert summary["restart_s"] > 0
    assert summary["index_bytes_per_block"] > 0
    assert summary["fill_GBps"] > 0
    assert summary["cold_restart"] is False  # fadvise leaves the inodes cached
    assert os.listdir(root) == []  # without --keep, what it wrote is gone
    bad = run_script("examples/bench_nvme_scale.py", "--block-size", "1000", "--root", str(root))
    assert bad.returncode == 2, bad.stderr
    assert "argument --block-size:" in bad.stderr.strip().splitlines()[-1]
    assert bad.stdout == ""


def test_bench_nvme_scale_drops_the_machines_caches_only_when_asked_and_says_if_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = guard_page_cache(tmp_path / "site", monkeypatch)  # refuses, as for a user
    root = tmp_path / "root"
    argv = ["--blocks", "300", "--block-size", "4K", "--root", str(root)]
    done = run_script("examples/bench_nvme_scale.py", *argv, "--drop-cache", "system")
    assert done.returncode == 1, done.stderr
    assert attempts.read_text().count("\n") == 1  # tried once, where it was asked to
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("--drop-cache system: cannot write /proc/sys/vm/drop_caches"), last
    assert "Traceback" not in done.stderr


def test_bench_ab_compares_two_checkouts_figure_by_figure() -> None:
    argv = [str(ROOT), str(ROOT), "bench_manager.py", "--rounds", "2", "--"]
    argv += [str(TRACE), "256", "--policies", "lru", "--full-blocks-only"]
    done = run_script("examples/bench_ab.py", *argv)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rounds"] == 2
    assert summary["figures"]["runs.0.hit_ratio"]["ratio"] == 1.0  # the same code, twice
    assert summary["figures"]["requests"] == {"base": 3993.0, "subject": 3993.0, "ratio": 1.0}


def test_bench_ab_exits_1_when_a_side_fails() -> None:
    done = run_script("examples/bench_ab.py", str(ROOT), str(ROOT), "no_such_bench.py")
    assert done.returncode == 1
    assert "no_such_bench.py failed in" in done.stderr
