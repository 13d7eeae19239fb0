"""``tiering replay`` and ``tiering sweep`` through the command's entry point."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._engine_helpers import block_copies, flip_byte
from tests._redis_servers import LocalRedisServer
from tests._scripts import TRACE, last_json, run_script
from tiering.cli import main
from tiering.lab.replay import simulate
from tiering.lab.workload_suite import generate
from tiering.lab.workloads import Request, synthetic_requests

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--limit", "120", "--block-bytes", "4K"]


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _write_trace(path: Path, requests: list[Request]) -> Path:
    """``requests`` as a Mooncake-format trace at ``path``."""
    lines = [
        json.dumps(
            {
                "timestamp": round(r.arrival_s * 1000, 3),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
        )
        for r in requests
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _evicting_nvme(tmp_path: Path) -> list[str]:
    """A generated trace of 240 requests (948 distinct blocks of 4 KiB, 1,950 stored)
    through 40 CPU blocks and an NVMe tier of 128 records in segments of 15: the NVMe
    tier evicts, and serves hits."""
    trace = _write_trace(tmp_path / "t.jsonl", synthetic_requests(sessions=60, seed=7))
    config = tmp_path / "cache.toml"
    config.write_text(
        "[engine]\ncpu_blocks = 40\n\n[[tiers]]\ntype = 'nvme'\n"
        f"root = '{tmp_path / 'nvme'}'\ncapacity_bytes = '1MiB'\nsegment_bytes = '128KiB'\n"
        "min_free_bytes = 0\n\n[replay]\nblock_bytes = '4K'\n"
    )
    return ["replay", str(trace), "--config", str(config), "--json"]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: every connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


REPLAY_DOC = ROOT / "docs" / "replay.md"
SWEEP_DOC = ROOT / "docs" / "sweep.md"


def _documented_command(name: str) -> list[str]:
    """The ``$ tiering NAME ...`` command line of docs/replay.md or docs/sweep.md, its
    words after ``tiering``."""
    page = REPLAY_DOC.read_text() + SWEEP_DOC.read_text()
    line = next(m for m in re.findall(r"^\$ tiering (.+)$", page, re.M) if m.startswith(name))
    return shlex.split(line)


def test_replay_of_synthetic_traffic_hits_what_the_bookkeeping_promised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", *SMALL, "--cpu", "300", "--json"]) == 0
    figures = _json(capsys)
    model = simulate(synthetic_requests()[:120], cpu_blocks=300)
    assert figures["requests"] == 120 and figures["mismatches"] == 0
    assert figures["hit_ratio"] == round(model.hit_ratio, 4) > 0
    assert figures["bookkeeping_hit_ratio"] == figures["hit_ratio"]
    for key in ("hit_ratio_by_tier", "bytes_by_path", "job_latency_ms", "loop_lag_p99_ms"):
        assert key in figures


def test_replay_through_cpu_and_nvme_prints_a_summary_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", *SMALL, "--cpu", "100", "--nvme", str(tmp_path), "--nvme-size", "64MiB"]
    argv.append("--settle")  # the cascades end in order: the bookkeeping is exact
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefix hit ratio" in out and "nvme" in out and "mismatches           0" in out
    hit = next(line for line in out.splitlines() if line.startswith("prefix hit ratio"))
    promised = next(line for line in out.splitlines() if line.startswith("bookkeeping model"))
    assert hit.split()[3] == promised.split()[2]  # nothing evicted from NVMe: equal


def test_replay_reads_a_config_file_and_set_overrides_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cache.toml"
    config.write_text(
        '[engine]\ncpu_blocks = 50\npolicy = "arc"\n\n[replay]\nlimit = 40\nblock_bytes = "2K"\n'
    )
    assert (
        main(["replay", "--config", str(config), "--set", "engine.cpu_blocks=400", "--json"]) == 0
    )
    figures = _json(capsys)
    model = simulate(synthetic_requests()[:40], cpu_blocks=400, policy="arc")
    assert figures["requests"] == 40 and figures["hit_ratio"] == round(model.hit_ratio, 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "--set", "engine.policy=fifo"], "engine.policy = 'fifo'"),
        (["replay", "--set", "engine.nope=1"], "engine.nope"),
        (["replay", "--set", "noequals"], "SECTION.FIELD=VALUE"),
        (["replay", "/no/such/trace.jsonl"], "cannot read the trace"),
        (["replay", "--config", "/no/such.toml"], "cannot read the config file"),
        (["replay", "--cpu", "lots"], "engine.cpu_bytes"),
        (["sweep", "--capacities", "5%,0"], "capacities"),
        (["sweep", "--policies", "fifo"], "fifo"),
        (["sweep", "--workload", "fifo"], "--workload"),
        (["sweep", "--suite", "--capacities", "500"], "percentages"),
        (["sweep", "--suite", "--capacities", "x%"], "'x%' is neither"),
        (["sweep", "--suite", "--limit", "5"], "--limit"),
        (["sweep", "--admission", "seen-twice"], "--suite"),
        (["sweep", "--suite", "--admission", "seen-thrice"], "seen-thrice"),
        (["sweep", "--suite", "--admission", "all", "--tier-factor", "0"], "--tier-factor"),
        (["sweep", "--suite", "--budget", "0.25"], "--admission"),
        (["sweep", "--suite", "--admission", "all", "--budget", "2"], "budget_fraction"),
    ],
)
def test_a_usage_error_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_malformed_trace_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{')
    assert main(["replay", str(trace)]) == 2
    assert "t.jsonl:2:" in capsys.readouterr().err


def test_a_line_that_is_not_json_names_the_files_line_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('\n\n{"timestamp": 0,\n')
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:3: not a Mooncake trace line: not JSON: " in err
    assert "line 1" not in err and "at column 17" in err  # the decoder's own line is not shown


def test_replay_help_shows_every_default_and_the_policies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--policy {adaptive,arc,lru,s3fifo}" in text
    for default in (
        "bytes per KV block (default: 64.0 KiB, unless --config sets replay.block_bytes)",
        "cache's blocks (default: the longest request's)",
        "(default: max, unless --config sets replay.pace)",
        "eviction policy (default: lru, unless --config sets engine.policy)",
    ):
        assert default in text
    assert "(default: [])" not in text


def test_replay_help_says_the_config_files_cpu_size_applies_over_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert (
        "(default: 10000 blocks; with --config, the file's engine.cpu_blocks or "
        "engine.cpu_bytes)" in text
    )
    config = tmp_path / "cache.toml"
    config.write_text('[engine]\ncpu_bytes = "512KiB"\n')
    assert main(["replay", *SMALL, "--config", str(config), "--json"]) == 0
    model = simulate(synthetic_requests()[:120], cpu_blocks=128)  # 512 KiB of 4 KiB blocks
    assert _json(capsys)["hit_ratio"] == round(model.hit_ratio, 4) < 0.99


def test_a_cpu_tier_smaller_than_the_longest_request_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nvme = tmp_path / "nvme"
    assert main(["replay", *SMALL, "--cpu", "8", "--nvme", str(nvme)]) == 2
    err = capsys.readouterr().err
    assert "--cpu (engine.cpu_blocks) = 8: the CPU tier must hold the longest request's" in err
    longest = max(len(r.block_ids) for r in synthetic_requests()[:120])
    assert f"longest request's {longest} blocks" in err and f"at least --cpu {longest}" in err
    assert not nvme.exists()  # refused before anything ran


def test_a_cpu_size_in_bytes_below_the_longest_request_names_its_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", *SMALL, "--cpu", "48K"]) == 2
    err = capsys.readouterr().err
    assert "--cpu (engine.cpu_bytes) = 48.0 KiB, room for 12 blocks of 4.0 KiB" in err


def test_a_tier_that_never_worked_fails_the_run_with_its_reason(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
    argv = ["replay", "--limit", "40", "--block-bytes", "4K", "--cpu", "100", "--json"]
    assert main([*argv, "--redis", f"redis://127.0.0.1:{closed_port}"]) == 1
    out, err = capsys.readouterr()
    figures = json.loads(out.strip().splitlines()[-1])
    failed = figures["failed_blocks_by_tier"]["redis"]
    assert failed["store"] > 0 and figures["hit_ratio_by_tier"]["redis"] == 0
    reason = next(line for line in err.splitlines() if line.startswith("tiering replay: error:"))
    assert f"the redis tier stored and served nothing: {failed['store']} block stores" in reason
    assert "redis unreachable" in reason


def test_a_fleet_whose_shared_tier_never_worked_fails_the_run(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
    argv = ["replay", "--nodes", "2", "--limit", "40", "--block-bytes", "4K", "--cpu", "100"]
    assert main([*argv, "--redis", f"redis://127.0.0.1:{closed_port}"]) == 1
    err = capsys.readouterr().err
    assert (
        "tiering replay: error: shared run, node 0: the redis tier stored and served nothing" in err
    )


@pytest.mark.filterwarnings("error")
def test_setting_a_secret_tier_option_warns_of_nothing(
    closed_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KV_TIERING_TEST_UNSET", raising=False)
    argv = ["replay", "--limit", "1", "--set", "tiers.0.type=redis"]
    argv += ["--set", f"tiers.0.url=redis://127.0.0.1:{closed_port}"]
    argv += ["--set", "tiers.0.encryption=env:KV_TIERING_TEST_UNSET"]
    assert main(argv) == 2  # both options read; the keyring's variable is not set
    err = capsys.readouterr().err
    assert err == (
        "tiering replay: error: tier 'redis': encryption: environment variable "
        "'KV_TIERING_TEST_UNSET' is not set\n"
    )


def test_set_overrides_the_tier_shortcuts_as_documented(
    redis_server: LocalRedisServer, closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/config.md: the shortcut options, --memory and --redis included, then each --set.
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
    argv = ["replay", *SMALL, "--cpu", "100", "--settle", "--json", "--policy", "arc"]
    argv += ["--memory", "400", "--redis", f"redis://127.0.0.1:{closed_port}"]
    argv += ["--set", "tiers.0.max_blocks=150", "--set", f"tiers.1.url={redis_server.url}"]
    assert main([*argv, "--set", "engine.policy=lru"]) == 0  # the server --set names
    figures = _json(capsys)
    assert figures["failed_blocks_by_tier"]["redis"] == {"load": 0, "store": 0}
    assert figures["bytes_by_path"]["cpu->redis"] > 0

    # The memory tier's share of the hits is the bookkeeping's for 150 blocks, not 400.
    def memory_share(blocks: int) -> float:
        model = simulate(synthetic_requests()[:120], cpu_blocks=100, tier_blocks=[blocks, None])
        return round(model.hits["tier0"] / model.blocks, 4)

    assert figures["hit_ratio_by_tier"]["memory"] == memory_share(150) != memory_share(400)


def test_the_summary_counts_each_tiers_failed_blocks(
    closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
    argv = ["replay", "--limit", "40", "--block-bytes", "4K", "--cpu", "100", "--memory", "50"]
    assert main([*argv, "--redis", f"redis://127.0.0.1:{closed_port}"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if "failed loads" in line)
    assert re.fullmatch(
        r"failed loads/stores\s+0 / 0 jobs; memory 0 / 0 blocks; redis 0 / [1-9]\d* blocks", row
    )


def _corrupted_root(tmp_path: Path, argv: list[str]) -> None:
    """Run ``argv`` once into an empty NVMe root under ``tmp_path``, then flip the last
    payload byte of every other block it stored: loading one of those fails."""
    assert main(argv) == 0
    copies = block_copies(tmp_path)
    assert copies
    for key in sorted(copies)[::2]:
        for path, offset, length in copies[key]:
            flip_byte(path, offset + length - 1)


@pytest.mark.parametrize("nodes", ["1", "2"], ids=["replay", "fleet"])
def test_a_run_whose_jobs_failed_exits_1_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nodes: str
) -> None:
    argv = ["replay", *SMALL, "--cpu", "100", "--nvme", str(tmp_path), "--nodes", nodes]
    _corrupted_root(tmp_path, argv)
    capsys.readouterr()
    assert main([*argv, "--json"]) == 1  # the same run again: it loads corrupt blocks
    out, err = capsys.readouterr()
    figures = json.loads(out.strip().splitlines()[-1])
    run = figures if nodes == "1" else figures["baseline"]
    assert run["failed_loads"] > 0 and run["mismatches"] == 0
    assert run["requests"] == 120 and run["failure_causes"]["corrupt block"] > 0
    errors = [line for line in err.splitlines() if line.startswith("tiering replay: error: ")]
    assert re.search(r"error: (baseline run, node \d: )?\d+ of \d+ load jobs and 0 of \d+ "
                     r"store jobs failed; the nvme tier failed \d+ block loads and 0 block "
                     r"stores \(corrupt block: \d+\)$", errors[0])  # fmt: skip
    assert errors[-1].endswith("the run failed (--tolerate-failures exits 0 despite failed jobs)")


@pytest.mark.parametrize("nodes", ["1", "2"], ids=["replay", "fleet"])
def test_tolerate_failures_exits_0_for_failed_jobs_and_still_says_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nodes: str
) -> None:
    argv = ["replay", *SMALL, "--cpu", "100", "--nvme", str(tmp_path), "--nodes", nodes]
    _corrupted_root(tmp_path, argv)
    capsys.readouterr()
    assert main([*argv, "--tolerate-failures"]) == 0
    err = capsys.readouterr().err
    assert "tiering replay: error" not in err
    warning = next(line for line in err.splitlines() if "load jobs" in line)
    assert warning.startswith("tiering replay: warning: ") and "(corrupt block: " in warning
    assert warning.endswith("(tolerated: --tolerate-failures)")


@pytest.mark.parametrize("nodes", ["1", "2"], ids=["replay", "fleet"])
def test_blocks_a_full_tier_had_no_room_for_are_capacity_not_failures(
    capsys: pytest.CaptureFixture[str], nodes: str
) -> None:
    # Write-back: the close hands the CPU tier's blocks to the memory tier in jobs of 64
    # new blocks, more than its 50 hold: it stores what fits and refuses the rest.
    argv = ["replay", *SMALL, "--cpu", "300", "--write-policy", "write_back", "--json"]
    assert main([*argv, "--memory", "50", "--nodes", nodes]) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out.strip().splitlines()[-1])
    run = figures if nodes == "1" else figures["baseline"]
    refused = run["refused_blocks_by_tier"]["memory"]
    assert refused >= 64 - 50
    assert run["failed_blocks_by_tier"]["memory"] == {"load": 0, "store": 0}
    assert run["failed_loads"] == run["failed_stores"] == 0 and run["failure_causes"] == {}
    assert "tiering replay: error" not in err and "tiering replay: warning" not in err
    assert (
        f"tiering replay: note: no room for memory {refused} blocks in full tiers: capacity, "
        "not failures" in err
    )


def test_the_summary_table_shows_the_blocks_full_tiers_had_no_room_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", *SMALL, "--cpu", "300", "--write-policy", "write_back", "--memory", "50"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    assert next(row for row in rows if row.startswith("failed loads/stores")).endswith(
        "0 / 0 jobs; memory 0 / 0 blocks"
    )
    room = next(row for row in rows if row.startswith("no room"))
    assert re.fullmatch(
        r"no room\s+memory \d+ blocks \(full tiers refused them: capacity, not failures\)", room
    )


def test_the_bookkeeping_equals_the_engine_under_settle_while_the_nvme_tier_evicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_evicting_nvme(tmp_path), "--settle"]) == 0
    figures = _json(capsys)
    stored = figures["bytes_by_path"]["cpu->nvme"] // 4096
    assert stored > (1 << 20) // 4096  # more blocks went down than 1 MiB holds: it evicted
    assert figures["hit_ratio_by_tier"]["nvme"] > 0
    assert figures["bookkeeping_notes"] == []  # the model claims to be exact...
    assert figures["bookkeeping_hit_ratio"] == figures["hit_ratio"]  # ...and it is


def test_without_settle_an_evicting_tier_is_named_as_why_the_bookkeeping_may_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_evicting_nvme(tmp_path)) == 0
    notes = _json(capsys)["bookkeeping_notes"]
    assert any("the nvme tier evicted" in note and "--settle" in note for note in notes)


def test_a_reused_nvme_root_is_reported_and_the_bookkeeping_not_called_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", *SMALL, "--cpu", "100", "--nvme", str(tmp_path), "--json"]
    assert main(argv) == 0
    cold = _json(capsys)
    assert cold["warm_hits"] == 0 and cold["warm_blocks"] == {} and cold["bookkeeping_notes"] == []
    assert main(argv) == 0  # the same root again: it holds the first run's blocks
    out, err = capsys.readouterr()
    warm = json.loads(out.strip().splitlines()[-1])
    held = warm["warm_blocks"]["nvme"]
    assert held > 0 and warm["warm_hits"] > 0 and warm["hit_ratio"] > cold["hit_ratio"]
    assert f"warning: the tiers held blocks before this replay (the nvme tier {held} blocks)" in err
    assert any("were in the tiers before the replay" in note for note in warm["bookkeeping_notes"])


def test_a_relative_trace_in_a_config_file_is_found_beside_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    _write_trace(configs / "t.jsonl", synthetic_requests(sessions=5))
    (configs / "cache.toml").write_text(
        "[engine]\ncpu_blocks = 50\n\n[replay]\ntrace = 't.jsonl'\n"
    )
    monkeypatch.chdir(tmp_path)  # not the file's directory
    assert main(["replay", "--config", "configs/cache.toml", "--block-bytes", "4K", "--json"]) == 0
    assert _json(capsys)["requests"] == 20


def test_sweep_prints_a_table_and_draws_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'kv-tiering[plot]'")
    plot = tmp_path / "sweep.png"
    argv = ["sweep", "--limit", "200", "--capacities", "5%,50%", "--policies", "lru,arc"]
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "arc" in out and plot.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--json"]) == 0
    points = _json(capsys)["points"]
    assert [(p["policy"], p["capacity_fraction"] > 0.4) for p in points] == [
        ("lru", False),
        ("arc", False),
        ("lru", True),
        ("arc", True),
    ]


def test_sweep_runs_the_adaptive_policy_for_the_retired_prefix_lfu_and_says_so() -> None:
    argv = ["sweep", "--limit", "40", "--capacities", "10%", "--policies", "lru,prefix-lfu"]
    done = run_script("-m", "tiering", *argv, "--json")
    assert [p["policy"] for p in last_json(done)["points"]] == ["lru", "adaptive"]
    assert done.stderr.splitlines() == [
        "eviction policy 'prefix-lfu' is retired and now means 'adaptive'; ask for 'adaptive'"
    ]


def test_sweep_replays_a_named_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["sweep", "--workload", "agent", "--capacities", "2%", "--policies", "lru", "--json"])
        == 0
    )
    (point,) = _json(capsys)["points"]
    requests = generate("agent")
    model = simulate(requests, cpu_blocks=point["capacity_blocks"], policy="lru")
    assert point["hit_ratio"] == round(model.hit_ratio, 4)


def test_sweep_suite_prints_each_policy_against_the_better_of_lru_and_arc(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sweep", "--suite", "--full-blocks-only", "--capacities", "5%", "--policies", "lru"]
    assert main([*argv, "--jobs", "2", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    workloads = [p["workload"] for p in result["points"]]
    assert workloads == ["synthetic", "chat", "agent", "rag", "scan", "shift"]
    assert all(p["full_blocks_only"] for p in result["points"])
    assert "worst" in out and set(result["worst_ratio"]) == {"lru", "arc"}


def test_sweep_suite_draws_each_policys_worst_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'kv-tiering[plot]'")
    plot = tmp_path / "suite.png"
    argv = ["sweep", "--suite", "--full-blocks-only", "--capacities", "2%,5%", "--policies", "lru"]
    assert main([*argv, "--plot", str(plot), "--json"]) == 0
    assert _json(capsys)["plot"] == str(plot) and plot.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--plot", str(tmp_path / "no" / "dir.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_the_documented_sweep_command_draws_the_documented_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'kv-tiering[plot]'")
    from matplotlib.image import imread

    argv = _documented_command("sweep")
    assert ROOT / argv[1] == TRACE and argv[-2] == "--plot"  # the trace the repository holds
    drawn = tmp_path / "sweep.png"
    assert main([argv[0], str(TRACE), *argv[2:-1], str(drawn)]) == 0
    assert (imread(drawn) == imread(ROOT / "docs" / "sweep-mooncake.png")).all()


def test_the_documented_replay_command_prints_the_documented_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _documented_command("replay traces/")
    root = argv.index("--nvme") + 1
    assert ROOT / argv[1] == TRACE
    argv[1], argv[root] = str(TRACE), str(tmp_path / "kv")
    assert main(argv) == 0
    out = capsys.readouterr().out
    page = REPLAY_DOC.read_text()
    for row in ("prefix hit ratio", "bookkeeping model", "mismatches"):
        printed = next(line for line in out.splitlines() if line.startswith(row))
        assert printed in page, printed


def test_sweep_of_the_shared_trace_gives_lru_0_4239_at_10000_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sweep", str(TRACE), "--capacities", "10000", "--policies", "lru", "--json"]) == 0
    assert _json(capsys)["points"][0]["hit_ratio"] == 0.4239


def test_python_m_tiering_runs_the_command() -> None:
    done = run_script("-m", "tiering", "replay", *SMALL, "--json")
    assert done.returncode == 0, done.stderr
    assert last_json(done)["mismatches"] == 0
    usage = run_script("-m", "tiering", "replay", "--pace", "never")
    assert usage.returncode == 2 and "replay.pace" in usage.stderr
    assert "Traceback" not in usage.stderr


def test_bench_lists_the_benchmarks_and_runs_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 0
    listed = capsys.readouterr().out
    assert "manager" in listed and "redis" in listed
    assert main(["bench", "nope"]) == 2
    assert "choose one of" in capsys.readouterr().err
    done = run_script("-m", "tiering", "bench", "manager", "--", "--help")
    assert done.returncode == 0 and "bench_manager.py" in done.stdout


def test_replay_serves_prometheus_metrics_while_it_runs() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    argv = ["-m", "tiering", "replay", "--limit", "40", "--pace", "1", "--metrics-port", "0"]
    with subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    ) as replaying:  # fmt: skip
        assert replaying.stderr is not None
        line = replaying.stderr.readline()  # printed before the first request
        assert line.startswith("metrics: http://127.0.0.1:"), line
        with urllib.request.urlopen(line.split()[1], timeout=30) as response:
            text = response.read().decode()
        out, err = replaying.communicate(timeout=120)
    assert replaying.returncode == 0, err
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"kv_tiering_lookups", "kv_tiering_tier_used_blocks"} <= names
    assert "mismatches           0" in out
