"""Sweep the CPU tier's capacity: hit ratio by capacity and policy, as a table and a plot.

Runs the bookkeeping-only replay (no bytes: fast) of a trace, or of synthetic chat
traffic, at every capacity with every policy, prints a table (or with --json one JSON
object on the last line), and with --plot draws a PNG of hit ratio against capacity,
one line per policy (needs matplotlib: pip install 'kv-tiering[plot]'). Capacities are
block counts or percentages of the workload's footprint (its distinct blocks).

With --suite it runs every named workload (generated with synthetic.seed, and TRACE if
given) with and without --full-blocks-only (only with, if given), and prints each
policy's hit ratio as a ratio to the better of LRU and ARC at each capacity (percentages
only), then each one's worst; --plot draws each policy's worst ratio by capacity.
With --suite --admission RULES it runs the admission rules instead: below the CPU tier
(the first of --policies) an LRU tier of --tier-factor times its blocks, written
through what each rule admits; it prints each rule's hit ratio and blocks written as
ratios to admitting everything, then each one's worst hit ratio and total writes;
--budget FRACTION runs each again within a write budget of that fraction of what
admitting everything writes (spread over the trace's time) and prints its worst hit
ratio against the same rule without.

Examples:
  tiering sweep
  tiering sweep trace.jsonl --capacities 1%,2%,5%,10%,25%,50% --plot sweep.png
  tiering sweep --workload agent
  tiering sweep --suite --jobs 2
  tiering sweep --suite --admission all,seen-twice,adaptive --policies lru
  tiering sweep --suite --admission adaptive --budget 0.25 --capacities 1%,10%
"""

from __future__ import annotations

import argparse
import os

from tiering.cli_args import Progress, choice_list, positive_int
from tiering.commands._output import add_json_argument, print_json
from tiering.commands._workload import add_config_arguments, load_workload, resolve_config
from tiering.core.admission import ADMISSIONS
from tiering.core.policies import policy_name, policy_names
from tiering.errors import InvalidArgumentError
from tiering.lab.admission_suite import plot_admission_suite, run_admission_suite
from tiering.lab.sweep import capacities_from, footprint, fractions_from, plot_sweep, sweep
from tiering.lab.workload_suite import WORKLOADS, plot_suite, run_suite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--capacities",
        default="1%,2%,5%,10%,25%,50%",
        help="block counts and percentages of the footprint, comma-separated",
    )
    parser.add_argument(
        "--policies",
        type=choice_list(policy_names(), policy_name),
        default=",".join(policy_names()),
        help="eviction policies, comma-separated",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the hit ratio curves here")
    parser.add_argument(
        "--suite",
        action="store_true",
        help="every named workload (and TRACE), each policy's ratio to the better of LRU and ARC",
    )
    parser.add_argument(
        "--admission",
        type=choice_list(ADMISSIONS),
        help="with --suite: these lower-tier admission rules, comma-separated, against 'all'",
    )
    parser.add_argument(
        "--tier-factor",
        type=positive_int,
        default=4,
        help="with --admission: the lower tier's blocks, in CPU tiers",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="FRACTION",
        help="with --admission: run each rule again within a write budget of this fraction "
        "of what admitting everything writes, over the trace's time",
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="processes for --suite"
    )
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.admission is not None and not args.suite:
        raise InvalidArgumentError("--admission runs the suite: add --suite")
    if args.budget is not None and args.admission is None:
        raise InvalidArgumentError("--budget runs the admission suite: add --admission")
    if args.suite:
        return _run_suite(args)
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
        print_json({**result.to_json(), **({"plot": args.plot} if args.plot is not None else {})})
    else:
        print(result.table())
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0


def _run_suite(args: argparse.Namespace) -> int:
    if args.workload is not None or args.limit is not None:
        raise InvalidArgumentError("--suite runs whole workloads: no --workload or --limit")
    fractions = fractions_from(args.capacities)
    workloads = [*WORKLOADS, *([args.trace] if args.trace is not None else [])]
    modes = (True,) if args.full_blocks_only else (False, True)
    seed = resolve_config(args, {}).synthetic.seed  # --set synthetic.seed=N: other draws
    with Progress() as progress:
        progress.update(f"suite: {len(workloads)} workloads x {len(modes)} modes", force=True)
        if args.admission is not None:
            result = run_admission_suite(
                workloads, args.admission, fractions=fractions, modes=modes,
                policy=args.policies[0], tier_factor=args.tier_factor, seed=seed, jobs=args.jobs,
                budget_fraction=args.budget,
            )  # fmt: skip
        else:
            result = run_suite(
                workloads,
                args.policies,
                fractions=fractions,
                modes=modes,
                seed=seed,
                jobs=args.jobs,
            )
    if args.plot is not None:
        (plot_suite if args.admission is None else plot_admission_suite)(result, args.plot)
    print(result.table())
    if args.json:
        print_json({**result.to_json(), **({"plot": args.plot} if args.plot else {})})
    elif args.plot is not None:
        print(f"plot: {args.plot}")
    return 0
