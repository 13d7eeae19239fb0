"""``tiering replay`` and ``tiering sweep`` through the command's entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests._scripts import last_json, run_script
from tiering.cli import main
from tiering.replay import simulate
from tiering.workloads import synthetic_requests

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
SMALL = ["--limit", "120", "--block-bytes", "4K"]


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


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


@pytest.mark.skipif(not TRACE.exists(), reason="the shared trace is not beside the project")
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
