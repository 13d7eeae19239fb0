"""Read every block of an NVMe root and check it exactly as a load does; report the bad
ones and, with --remove, remove them.

Checks each block's length, header (magic, version, header checksum, namespace, key,
payload length) and payload checksum; an encrypted block's authentication under the
keyring --encryption names (without it an encrypted block cannot be checked: it is
reported bad, and --remove is refused for its namespace). Each bad block is named by its
file (or segment and record), its key and why it failed; a progress line shows on stderr
when it is a terminal. --remove deletes a bad block file, or marks a bad segment record
removed (its header page overwritten) and drops it from the index checkpoint, so a tier
started later neither indexes nor serves it, and `tiering inspect` counts its slot
removed, not damaged; it refuses a namespace that a running tier holds (its owner lock).
Without --remove nothing changes and it may run next to an engine (a record being
written can then look bad). Exit status: 0 every block verified, 1 a bad block was found
(even if removed) or the root is in use for --remove, 2 a usage error.
"""

from __future__ import annotations

import argparse

from backends.nvme.maintenance import VerifyReport, verify_root
from tiering.cli import EXIT_FAILURE, EXIT_OK
from tiering.cli_args import Progress
from tiering.commands._output import table
from tiering.commands.inspect import add_arguments as add_root_arguments
from tiering.commands.inspect import show


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_arguments(parser)
    parser.add_argument(
        "--remove",
        action="store_true",
        help="remove the bad blocks, as the tier drops them (refused while a tier runs)",
    )
    parser.add_argument(
        "--encryption",
        metavar="SPEC",
        help="the tier's keyring, to check encrypted blocks: 'env:VARIABLE' (or the spec "
        "itself, which then shows in the process list)",
    )


def render(report: VerifyReport) -> list[str]:
    lines = [
        f"root {report.root}: {report.checked} blocks checked, {report.bad} bad"
        + (f", {report.removed} removed" if report.remove else "")
    ]
    rows = [["NAMESPACE", "CHECKED", "BAD", "IN USE"]]
    for ns in report.namespaces:
        in_use = f"yes ({len(ns.live_owners)})" if ns.live_owners else "no"
        rows.append([ns.namespace or ns.directory, str(ns.checked), str(len(ns.bad)), in_use])
    if report.namespaces:
        lines += table(rows)
    if report.bad:
        lines.append("bad blocks:")
        for block in report.bad_blocks:
            where = block.path + (f" record {block.record}" if block.record is not None else "")
            key = block.key if block.key is not None else "unreadable"
            status = " [removed]" if block.removed else ""
            lines.append(f"  {where} key {key}: {block.reason}{status}")
    return lines


def run(args: argparse.Namespace) -> int:
    with Progress() as progress:
        progress.update("verify: reading block headers", force=True)
        report = verify_root(
            args.root,
            remove=args.remove,
            namespace=args.namespace,
            encryption=args.encryption,
            on_progress=lambda done, total: progress.update(
                f"verify: {done}/{total} blocks checked", force=done == total
            ),
        )
    show(report, render, args.json)
    return EXIT_FAILURE if report.bad else EXIT_OK
