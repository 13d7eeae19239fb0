"""Sweep the CPU tier's capacity: hit ratio by capacity and policy, as a table and a plot.

Runs the bookkeeping-only replay (no bytes: fast) of a trace, or of synthetic chat
traffic, at every capacity with every policy, prints a table (or with --json one JSON
object on the last line), and with --plot draws a PNG of hit ratio against capacity,
one line per policy (needs matplotlib: pip install 'kv-tiering[plot]'). Capacities are
block counts or percentages of the workload's footprint (its distinct blocks).

Examples:
  tiering sweep
  tiering sweep trace.jsonl --capacities 1%,2%,5%,10%,25%,50% --plot sweep.png
"""

from __future__ import annotations

import argparse

from tiering.cli_args import Progress, choice_list
from tiering.commands._output import add_json_argument, print_json
from tiering.commands._workload import (
    add_config_arguments,
    load_workload,
    resolve_config,
)
from tiering.policies import policy_names
from tiering.sweep import capacities_from, footprint, plot_sweep, sweep

NAME = "sweep"
HELP = "hit ratio by CPU capacity and policy (bookkeeping only), with a plot"
ORDER = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--capacities",
        default="1%,2%,5%,10%,25%,50%",
        help="block counts and percentages of the footprint, comma-separated",
    )
    parser.add_argument(
        "--policies",
        type=choice_list(policy_names()),
        default=",".join(policy_names()),
        help="eviction policies, comma-separated",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the hit ratio curves here")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args, {})
    requests = load_workload(config)
    full = config.replay.full_blocks_only
    capacities = capacities_from(args.capacities, footprint(requests, full_blocks_only=full))
    with Progress() as progress:
        progress.update(
            f"sweep: {len(capacities)} capacities x {len(args.policies)} policies", force=True
        )
        result = sweep(requests, capacities, args.policies, full_blocks_only=full)
    if args.plot is not None:
        plot_sweep(result, args.plot)
    if args.json:
        figures = result.to_json()
        if args.plot is not None:
            figures["plot"] = args.plot
        print_json(figures)
    else:
        print(result.table())
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0
