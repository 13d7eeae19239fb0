"""Replay a trace (or synthetic chat traffic) through a real engine and check every byte.

Drives a real TieringEngine: per request it looks up the prompt's blocks, loads the hit
prefix into a simulated device KV cache, "computes" the rest (fills each block with
bytes derived from its hash), stores it, and checks every loaded block against its
hash. At the end: a summary table, or with --json one JSON object on the last line
(docs/replay.md lists its fields).

Exit codes: 0 done; 1 the run failed: a loaded block held wrong bytes, every store
failed, a tier stored and served nothing while its transfers failed, or (unless
--tolerate-failures) any job failed or a tier failed to store or load a block (each
summed up on stderr, with its causes); 2 a usage error, before anything ran (a bad
option, trace or config, a CPU tier smaller than the longest request, an unusable
root). A block a full tier had no room for is capacity, not a failure: counted apart
(no room), it fails nothing.

Examples:
  tiering replay                                     # synthetic traffic, CPU tier only
  tiering replay trace.jsonl --cpu 10000 --block-bytes 16K --nvme /var/tmp/kv --nvme-size 2GiB
  tiering replay --config cache.toml --set engine.policy=arc --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import sys
from collections import Counter
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from tiering.cli_args import Progress
from tiering.commands._output import add_json_argument, print_json, table
from tiering.commands._workload import (
    DEFAULT_CPU_BLOCKS,
    add_config_arguments,
    cpu_shortcut,
    load_workload,
    resolve_config,
)
from tiering.config import EngineConfig, MetricsConfig, ReplayConfig, TieringConfig, with_overrides
from tiering.core.policies import policy_name, policy_names
from tiering.engine import TieringEngine
from tiering.errors import ConfigError, InvalidArgumentError
from tiering.lab.fleet import SHARED_TIERS, replay_fleet
from tiering.lab.replay import (
    CPU,
    ReplaySummary,
    SegmentLayout,
    TraceClock,
    replay,
    simulate,
    summed,
)
from tiering.lab.workloads import Request
from tiering.observe.loop_lag import LoopLagMonitor
from tiering.observe.statistics import format_bytes


def _field_options() -> list[tuple[str, str, str, dict[str, Any]]]:
    """The options that set one config field (left out: as the defaults and --config give
    it): (group, option, config path, argparse keywords)."""
    return [
        ("tiers", "--policy", "engine.policy",
         {"type": policy_name, "choices": policy_names(),
          "help": "the CPU tier's eviction policy"}),
        ("tiers", "--write-policy", "engine.write_policy",
         {"help": "when stores go down the tiers"}),
        ("run", "--block-bytes", "replay.block_bytes",
         {"metavar": "SIZE", "help": "bytes per KV block"}),
        ("run", "--device-blocks", "replay.device_blocks", {"type": int, "metavar": "N",
         "help": "the simulated device cache's blocks (default: the longest request's)"}),
        ("run", "--pace", "replay.pace", {"metavar": "PACE",
         "help": "'max', or a speed-up of the trace's own timestamps, 1 real time"}),
        ("run", "--settle", "replay.settle", {"action": "store_true", "default": None,
         "help": "let each store reach every tier before the next request (exact bookkeeping)"}),
        ("run", "--tenants", "replay.tenants", {"type": int, "metavar": "N",
         "help": "send every request once per tenant, N tenants the engine keeps apart"}),
        ("run", "--metrics-port", "metrics.port",
         {"type": int, "metavar": "PORT", "help": "serve Prometheus metrics"}),
        ("fleet", "--nodes", "replay.nodes",
         {"type": int, "metavar": "N", "help": "engines behind a router"}),
        ("fleet", "--router", "replay.router", {"help": "how requests pick a node"}),
        ("fleet", "--transport", "replay.transport", {"help": "how KV events reach the router"}),
    ]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    groups = {
        "tiers": parser.add_argument_group("tiers (shortcuts for config fields)"),
        "run": parser.add_argument_group("the replay"),
        "fleet": parser.add_argument_group("a fleet (docs/fleet.md)"),
    }
    groups["tiers"].add_argument(
        "--cpu",
        metavar="SIZE",
        help=f"CPU tier: blocks (4096) or bytes (8GiB) (default: {DEFAULT_CPU_BLOCKS} blocks; "
        "with --config, the file's engine.cpu_blocks or engine.cpu_bytes)",
    )
    sections = {"engine": EngineConfig, "replay": ReplayConfig, "metrics": MetricsConfig}
    for group, option, path, keywords in _field_options():
        section, name = path.split(".")
        field = sections[section].model_fields[name]
        if get_origin(field.annotation) is Literal:
            keywords = {**keywords, "choices": get_args(field.annotation)}
        default = field.default  # what leaving it out means, unless the file sets it
        if default is not None and not isinstance(default, bool):
            shown = format_bytes(default) if name.endswith("_bytes") else default
            said = f"(default: {shown}, unless --config sets {path})"
            keywords = {**keywords, "help": f"{keywords['help']} {said}"}
        groups[group].add_argument(option, dest=path, **keywords)
    tiers = groups["tiers"]
    tiers.add_argument("--memory", metavar="BLOCKS", type=int, help="add a memory tier")
    tiers.add_argument("--nvme", metavar="ROOT", help="add an NVMe tier in this directory")
    tiers.add_argument(
        "--nvme-size", metavar="SIZE", default="4GiB", help="the NVMe tier's capacity"
    )
    tiers.add_argument("--redis", metavar="URL", help="add a Redis tier on this server")
    groups["run"].add_argument(
        "--tolerate-failures",
        action="store_true",
        help="exit 0 although jobs or tier transfers failed (still 1 for wrong bytes, or a "
        "run that failed as a whole)",
    )
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    shortcuts = {path: getattr(args, path) for _, _, path, _ in _field_options()}
    config = resolve_config(args, cpu_shortcut(args.cpu) | shortcuts, _tier_shortcuts(args))
    requests = load_workload(config)
    _check_cpu_room(config, requests)
    if config.replay.nodes > 1:
        if config.replay.tenants > 1:
            raise ConfigError(
                "replay.tenants: a fleet replay (replay.nodes > 1) has one tenant, got "
                f"{config.replay.tenants}",
                field="replay.tenants",
            )
        return _run_fleet(config, requests, args.json, args.tolerate_failures)
    with Progress() as progress:
        summary = asyncio.run(_replay(config, requests, progress))
    figures = summary.to_json() | _bookkeeping(config, requests, summary)
    if summary.warm_blocks or summary.warm_hits:
        held = ", ".join(f"the {label} tier {n} blocks" for label, n in summary.warm_blocks.items())
        before = f"the tiers held blocks before this replay ({held}); " if held else ""
        print(
            f"tiering replay: warning: {before}{summary.warm_hits} hit blocks were stored before "
            "it, so the hit ratio is not a cold start's (replay into an empty NVMe root, or "
            "`tiering clear` it first)",
            file=sys.stderr,
        )
    if args.json:
        print_json(figures)
    else:
        print(format_summary(figures))
    return _status(summary.mismatches, {"": summary}, args.tolerate_failures)


def _status(mismatches: int, runs: dict[str, ReplaySummary], tolerate: bool) -> int:
    """The exit status of a replay that loaded ``mismatches`` wrong blocks, of engines'
    summaries ``runs`` (keyed by the prefix of their lines on stderr): 1 for a wrong byte
    or a run that failed as a whole, and for a failed job or tier transfer unless
    ``tolerate``. Each is said on stderr, and the blocks full tiers had no room for noted."""
    lines = []
    if mismatches:
        lines.append(f"error: {mismatches} loaded blocks held wrong bytes")
    whole = [f"error: {name}{why}" for name, run in runs.items() if (why := _failed_tier(run))]
    lines += whole
    failed = [f"{name}{why}" for name, run in runs.items() if (why := _failures(run))]
    if failed and tolerate:
        lines += [f"warning: {line} (tolerated: --tolerate-failures)" for line in failed]
    elif failed:
        lines += [f"error: {line}" for line in failed]
        lines.append("error: the run failed (--tolerate-failures exits 0 despite failed jobs)")
    refused = summed(run.refused_blocks_by_tier for run in runs.values())
    if any(refused.values()):
        lines.append(f"note: no room for {_refused(refused)} in full tiers: capacity, not failures")
    if evicted := sum(run.evicted_loads for run in runs.values()):
        lines.append(
            f"note: {evicted} loads found a block evicted from every tier after the lookup "
            "that found it: misses under pressure, not failures"
        )
    for line in lines:
        print(f"tiering replay: {line}", file=sys.stderr)
    return 1 if mismatches or whole or (failed and not tolerate) else 0


def _failures(summary: ReplaySummary) -> str | None:
    """What failed in a run (None: nothing), in one line with its causes: its failed jobs,
    and the blocks each tier failed to load or store (not those it had no room for)."""
    parts = []
    if summary.failed_loads or summary.failed_stores:
        loads, stores = len(summary.load_latency_s), len(summary.store_latency_s)
        parts.append(
            f"{summary.failed_loads} of {loads} load jobs and {summary.failed_stores} of "
            f"{stores} store jobs failed"
        )
    for name, failed in summary.failed_blocks_by_tier.items():
        if failed["load"] or failed["store"]:
            parts.append(
                f"the {name} tier failed {failed['load']} block loads and {failed['store']} "
                "block stores"
            )
    return f"{'; '.join(parts)} ({_causes(summary.failure_causes)})" if parts else None


def _refused(refused: dict[str, int]) -> str:
    """The blocks full tiers refused, by tier type: ``memory 56 blocks, nvme 3 blocks``."""
    return ", ".join(f"{name} {n} blocks" for name, n in refused.items() if n)


def _failed_jobs(figures: dict[str, Any]) -> str:
    """A run's failed load / store jobs, then each tier's failed block loads / stores."""
    by_tier = figures["failed_blocks_by_tier"].items()
    blocks = "".join(f"; {tier} {n['load']} / {n['store']} blocks" for tier, n in by_tier)
    return f"{figures['failed_loads']} / {figures['failed_stores']} jobs{blocks}"


def _check_cpu_room(config: TieringConfig, requests: list[Request]) -> None:
    """InvalidArgumentError naming ``--cpu`` for a CPU tier smaller than the longest request."""
    full = config.replay.full_blocks_only
    longest = max(len(r.keys(full_blocks_only=full)) for r in requests)
    size, engine = config.replay.block_bytes, config.engine
    if engine.cpu_blocks is not None:
        blocks, given = engine.cpu_blocks, f"--cpu (engine.cpu_blocks) = {engine.cpu_blocks}"
    else:
        assert engine.cpu_bytes is not None  # EngineConfig sets exactly one
        blocks = engine.cpu_bytes // size
        given = (
            f"--cpu (engine.cpu_bytes) = {format_bytes(engine.cpu_bytes)}, room for {blocks} "
            f"blocks of {format_bytes(size)}"
        )
    if blocks < longest:
        raise InvalidArgumentError(
            f"{given}: the CPU tier must hold the longest request's {longest} blocks at once "
            f"(every block a request loads or stores passes through it); give at least "
            f"--cpu {longest}"
        )


def _failed_tier(summary: ReplaySummary) -> str | None:
    """Why the run failed as a whole, or None: the CPU tier failed every store, or a
    secondary tier stored and served nothing while its stores or loads failed."""
    causes = summary.tier_failures
    stores = len(summary.store_latency_s)
    if stores and summary.failed_stores == stores:
        return f"every one of the {stores} stores failed ({_causes(causes.get(CPU, {}))})"
    for name, failed in summary.failed_blocks_by_tier.items():
        labels = [label for label, t in summary.tier_types.items() if t == name]
        counters = [summary.tier_counters.get(label, {}) for label in labels]
        worked = sum(c.get("stored_blocks", 0) + c.get("loaded_blocks", 0) for c in counters)
        if worked or not (failed["store"] or failed["load"]):
            continue
        own = summed(causes.get(label, {}) for label in labels)
        return (
            f"the {name} tier stored and served nothing: {failed['store']} block stores and "
            f"{failed['load']} block loads failed ({_causes(own)})"
        )
    return None


def _causes(counts: dict[str, int]) -> str:
    if not counts:
        return "no cause recorded"
    return "; ".join(f"{cause}: {count}" for cause, count in Counter(counts).most_common(3))


def _run_fleet(
    config: TieringConfig, requests: list[Request], as_json: bool, tolerate: bool
) -> int:
    """The fleet replay, with its shared tiers (Redis) and, as the baseline, without; its
    exit status as :func:`_status` gives it over every node of both runs."""
    own = tuple(tier for tier in config.tiers if tier.type not in SHARED_TIERS)
    shared = len(own) < len(config.tiers)
    runs = {"shared": config} if shared else {}
    runs["baseline"] = dataclasses.replace(config, tiers=own)
    figures: dict[str, Any] = {}
    nodes: dict[str, ReplaySummary] = {}
    with Progress() as progress:
        for name, run_config in runs.items():
            events_on = with_overrides(run_config, {"engine.enable_events": True})
            summary = asyncio.run(
                replay_fleet(
                    requests,
                    lambda node, kv, c=events_on: TieringEngine.from_config(
                        _node_config(c, node), kv
                    ),
                    nodes=config.replay.nodes,
                    router=config.replay.router,
                    transport=config.replay.transport,
                    device_blocks=config.replay.device_blocks,
                    block_bytes=config.replay.block_bytes,
                    full_blocks_only=config.replay.full_blocks_only,
                    on_request=lambda done, _, name=name: progress.update(
                        f"fleet ({name}): {done}/{len(requests)} requests"
                    ),
                )
            )
            figures[name] = summary.to_json()
            nodes |= {f"{name} run, node {i}: ": node for i, node in enumerate(summary.nodes)}
    if shared:
        baseline = figures["baseline"]["hit_ratio"]
        figures["gain"] = round(figures["shared"]["hit_ratio"] / baseline, 3) if baseline else None
    mismatches = sum(run["mismatches"] for run in figures.values() if isinstance(run, dict))
    if as_json:
        print_json(figures)
    else:
        print(format_fleet(figures))
    return _status(mismatches, nodes, tolerate)


def _node_config(config: TieringConfig, node: int) -> TieringConfig:
    """A node's config: its NVMe tiers under a directory of its own in their root."""
    overrides: dict[str, object] = {}
    for i, tier in enumerate(config.tiers):
        if "root" in tier.options:
            overrides[f"tiers.{i}.root"] = str(Path(str(tier.options["root"])) / f"node-{node}")
    return with_overrides(config, overrides) if overrides else config


def format_fleet(figures: dict[str, Any]) -> str:
    """The table of a fleet replay: each run's hit ratio by source and by node."""
    lines = []
    for name, run in [(name, figures[name]) for name in ("shared", "baseline") if name in figures]:
        sources = "  ".join(f"{s} {r:.4f}" for s, r in run["hit_ratio_by_source"].items())
        nodes = " ".join(f"{r:.4f}" for r in run["hit_ratio_by_node"])
        own = run["own_capacity_blocks"]
        share = own / run["footprint_blocks"] if run["footprint_blocks"] else 0.0
        latency = run["job_latency_ms"]
        lines += [
            f"{name} ({run['router']}, {run['nodes']} nodes): hit ratio {run['hit_ratio']:.4f}"
            f"  ({sources})",
            f"  by node {nodes}; requests {run['requests_by_node']}; mismatches "
            f"{run['mismatches']}; {run['requests_per_s']} requests/s",
            f"  the nodes' own tiers hold {own} blocks, {share:.1%} of the footprint "
            f"({run['footprint_blocks']} blocks); job latency p99 store "
            f"{latency['store']['p99']} ms, load {latency['load']['p99']} ms",
        ]
        timeline = " ".join(f"{point['hit_ratio']:.2f}" for point in run["timeline"])
        lines.append(f"  hit ratio over time: {timeline}")
        lines.append(f"  failed loads/stores {_failed_jobs(run)}")
        if any(run["refused_blocks_by_tier"].values()):
            refused = _refused(run["refused_blocks_by_tier"])
            lines.append(f"  no room: {refused} (full tiers refused them: capacity, not failures)")
        for label, counters in run["shared_tier_counters"].items():
            shown = ", ".join(f"{k} {v}" for k, v in counters.items() if v)
            lines.append(f"  {label}: {shown}")
    if figures.get("gain") is not None:
        lines.append(f"gain of the shared tier: {figures['gain']}x")
    return "\n".join(lines)


def _tier_shortcuts(args: argparse.Namespace) -> list[dict[str, object]]:
    """Tiers the shortcut options add after the config's own, fastest first."""
    specs = [
        (args.memory, {"type": "memory", "max_blocks": args.memory}),
        (args.nvme, {"type": "nvme", "root": args.nvme, "capacity_bytes": args.nvme_size}),
        (args.redis, {"type": "redis", "url": args.redis}),
    ]
    return [spec for given, spec in specs if given is not None]


def _bookkeeping(
    config: TieringConfig, requests: list[Request], summary: ReplaySummary
) -> dict[str, Any]:
    """The hit ratio the bookkeeping replay of this configuration promises (None under
    write-back, not modelled), with the tiers' real capacities and layouts, and why the
    engine's may differ from it (``bookkeeping_notes``; none: the two must be equal)."""
    notes = []
    write_through = config.engine.write_policy == "write_through"
    if not write_through:
        notes.append("write-back is not modelled")
    if summary.warm_blocks or summary.warm_hits:
        notes.append(f"{summary.warm_hits} hit blocks were in the tiers before the replay")
    failed = sum(n for counts in summary.failed_blocks_by_tier.values() for n in counts.values())
    if summary.failed_loads or summary.failed_stores or failed:
        notes.append(
            f"{summary.failed_loads} loads, {summary.failed_stores} stores and {failed} tier "
            "block transfers failed"
        )
    if refused := sum(summary.refused_blocks_by_tier.values()):
        notes.append(f"full tiers had no room for {refused} blocks (the model evicts instead)")
    evicting = [label for label, c in summary.tier_counters.items() if c.get("evicted_blocks")]
    if evicting and not config.replay.settle:
        notes.append(
            f"the {', '.join(evicting)} tier evicted while cascades ran behind the requests "
            "(--settle lets each end first: the model is then exact)"
        )
    # The engine's tiers are the config's, in its order.
    for (label, layout), tier in zip(summary.tier_layouts.items(), config.tiers, strict=True):
        exact = (
            layout is None
            or isinstance(layout, SegmentLayout)
            or (tier.type == "memory" and tier.options.get("policy", "lru") == "lru")
        )
        if not exact:
            notes.append(
                f"the {label} tier is modelled as least recently used over {layout} blocks, "
                "which it need not be"
            )
    if not write_through:
        return {"bookkeeping_hit_ratio": None, "bookkeeping_notes": notes}
    model = simulate(
        requests,
        cpu_blocks=summary.capacity_blocks[CPU],
        policy=config.engine.policy,
        tier_blocks=list(summary.tier_layouts.values()),
        full_blocks_only=config.replay.full_blocks_only,
        tenants=config.replay.tenants,
        tier_admission=[a["rule"] for a in summary.admission_by_tier.values()],
        tier_budget=[
            None if (b := a["write_budget_bytes_per_s"]) is None else b / config.replay.block_bytes
            for a in summary.admission_by_tier.values()
        ],
    )
    ratio = round(model.hit_ratio, 4)
    if not notes and ratio != round(summary.hit_ratio, 4):
        notes.append("no known cause: the model or the engine is wrong (please report it)")
    return {"bookkeeping_hit_ratio": ratio, "bookkeeping_notes": notes}


async def _replay(
    config: TieringConfig, requests: list[Request], progress: Progress
) -> ReplaySummary:
    metrics = config.metrics

    def serve(engine: TieringEngine, lag: LoopLagMonitor) -> AbstractContextManager[object]:
        from tiering.observe.metrics import serve_engine_metrics

        server = serve_engine_metrics(engine, metrics.port, prefix=metrics.prefix, loop_lag=lag)
        print(f"metrics: http://127.0.0.1:{server.port}/metrics", file=sys.stderr, flush=True)
        return server

    clock = TraceClock()
    return await replay(
        requests,
        functools.partial(TieringEngine.from_config, config, clock=clock),
        clock=clock,
        on_open=None if metrics.port is None else serve,
        device_blocks=config.replay.device_blocks,
        block_bytes=config.replay.block_bytes,
        pace=None if config.replay.pace == "max" else float(config.replay.pace),
        full_blocks_only=config.replay.full_blocks_only,
        verify=config.replay.verify,
        settle=config.replay.settle,
        tenants=config.replay.tenants,
        on_request=lambda done, summary: progress.update(
            f"replay: {done}/{len(requests)} requests, hit ratio {summary.hit_ratio:.4f}"
        ),
    )


def format_summary(figures: dict[str, Any]) -> str:
    """The summary table of a replay's :meth:`~tiering.lab.replay.ReplaySummary.to_json`."""
    by_tier = "  ".join(f"{t} {r:.4f}" for t, r in figures["hit_ratio_by_tier"].items())
    paths = "  ".join(f"{p} {format_bytes(n)}" for p, n in figures["bytes_by_path"].items() if n)
    latency = figures["job_latency_ms"]
    rows = [
        ("requests", f"{figures['requests']} ({figures['requests_per_s']} requests/s, "
                     f"{figures['seconds']} s)"),
        ("blocks", str(figures["blocks"])),
        ("prefix hit ratio", f"{figures['hit_ratio']:.4f}  ({by_tier})"),
        ("bookkeeping model", _bookkeeping_row(figures)),
        ("mismatches", str(figures["mismatches"])),
        *([("cross-tenant hits", f"{figures['cross_tenant_hits']} "
                                 f"({figures['tenants']} tenants)")]
          if figures.get("tenants", 1) > 1 else []),
        ("failed loads/stores", _failed_jobs(figures)),
        *([("no room", f"{_refused(figures['refused_blocks_by_tier'])} (full tiers refused "
                       "them: capacity, not failures)")]
          if any(figures["refused_blocks_by_tier"].values()) else []),
        *([("warm start", f"{figures['warm_hits']} hit blocks were in the tiers before "
                          "the replay" + "".join(f"; {tier} held {n} blocks"
                                                 for tier, n in figures["warm_blocks"].items()))]
          if figures["warm_hits"] or figures["warm_blocks"] else []),
        *([("admission", _admission(figures["admission_by_tier"]))]
          if figures["admission_by_tier"] else []),
        ("bytes moved", paths or "none"),
        ("job latency", f"store p50 {latency['store']['p50']} ms, p99 "
                        f"{latency['store']['p99']} ms; load p50 {latency['load']['p50']} ms, "
                        f"p99 {latency['load']['p99']} ms"),
        ("loop lag p99", f"{figures['loop_lag_p99_ms']} ms"),
    ]  # fmt: skip
    return "\n".join(table([list(row) for row in rows]))


def _admission(by_tier: dict[str, dict[str, Any]]) -> str:
    """Per secondary tier: its rule and budget, and what it admitted and refused."""
    parts = []
    for tier, a in by_tier.items():
        budget = a["write_budget_bytes_per_s"]
        within = f" within {format_bytes(int(budget))}/s" if budget is not None else ""
        parts.append(
            f"{tier} {a['rule']}{within}: admitted {a['admitted_blocks']} ({a['late_blocks']} "
            f"late), refused {a['refused_blocks']}, over budget {a['over_budget_blocks']}"
        )
    return "; ".join(parts)


def _bookkeeping_row(figures: dict[str, Any]) -> str:
    """The model's hit ratio, and whether the engine's must equal it or why not."""
    ratio, notes = figures.get("bookkeeping_hit_ratio"), figures.get("bookkeeping_notes", [])
    if ratio is None:
        return f"none ({'; '.join(notes)})"
    gap = figures["hit_ratio"] - ratio
    if not notes:
        return f"{ratio:.4f}  (exact: equal)"
    said = f"engine {gap:+.4f}" if gap else "equal"
    return f"{ratio:.4f}  ({said}; may differ: {'; '.join(notes)})"
