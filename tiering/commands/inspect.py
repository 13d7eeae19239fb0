"""Show what an NVMe root holds: namespaces, blocks, bytes, damaged and orphaned files.

Reads every block header and segment record header, never a payload (``tiering verify``
reads those) and changes nothing, so it is safe next to a running engine (what it shows
of a namespace in use is then a snapshot of something changing). Blocks are what a tier
started now would serve; damaged is what the tier's start-up drops or cannot use;
orphaned is what nobody reads again (leftovers of writers that are gone, segments with
no live block, record slots `tiering verify --remove` removed, files the tier never
writes). ROOT is checked as the tier checks its root: it must be a directory of this
user that nobody else may write to. Exit status: 0 (1 only for an I/O failure, 2 for a
ROOT that fails that check or is not an NVMe root).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from backends.nvme.maintenance import RootReport, inspect_root
from tiering.cli import EXIT_OK
from tiering.commands._output import add_json_argument, print_json, table
from tiering.observe.statistics import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """ROOT, ``--namespace`` and ``--json``: inspect's, and those verify and clear share."""
    parser.add_argument("root", metavar="ROOT", help="the NVMe tier's root directory")
    parser.add_argument(
        "--namespace",
        metavar="NS",
        help="only this namespace: its string, its directory name, or at least 4 leading "
        "hex digits of its digest (the ID column of `tiering inspect`)",
    )
    add_json_argument(parser)


def render(report: RootReport) -> list[str]:
    lines = [
        f"root {report.root}: {len(report.namespaces)} namespace(s), {report.blocks} blocks, "
        f"{format_bytes(report.payload_bytes)} payload, {format_bytes(report.disk_bytes)} on disk, "
        f"{report.damaged} damaged, {report.orphaned} orphaned"
    ]
    if report.namespaces:
        rows = [["NAMESPACE", "ID", "LAYOUT", "BLOCK", "BLOCKS", "PAYLOAD", "ON DISK",
                 "DAMAGED", "ORPHANED", "IN USE"]]  # fmt: skip
        rows += [
            [
                ns.namespace or ns.directory,
                ns.digest[:12],
                "+".join(ns.layouts) or "-",
                format_bytes(ns.block_bytes) if ns.block_bytes else "?",
                str(ns.blocks),
                format_bytes(ns.payload_bytes),
                format_bytes(ns.disk_bytes),
                str(len(ns.damaged)),
                str(len(ns.orphaned)),
                f"yes ({len(ns.live_owners)})" if ns.live_owners else "no",
            ]
            for ns in report.namespaces
        ]
        lines += table(rows)
    for title in ("damaged", "orphaned"):
        findings = [f for ns in report.namespaces for f in getattr(ns, title)]
        if findings:
            lines.append(f"{title}:")
            lines += [f"  {f.path}: {f.reason}" for f in findings]
    if report.other_entries:
        lines.append("not namespaces (left alone): " + ", ".join(report.other_entries))
    return lines


def show(report: Any, render: Callable[[Any], list[str]], as_json: bool) -> None:
    """Print ``report`` as one JSON line, or as ``render`` makes it."""
    if as_json:
        print_json(asdict(report))
    else:
        print("\n".join(render(report)))


def run(args: argparse.Namespace) -> int:
    show(inspect_root(args.root, namespace=args.namespace), render, args.json)
    return EXIT_OK
