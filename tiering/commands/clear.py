"""Remove every block of an NVMe root, or of one namespace (--namespace), with its
namespace directory.

Removes only what the tier writes inside namespace directories (block files, segments,
the checkpoint, NAMESPACE, temporary and lock files) and the directories left empty;
other files are listed and left. Never touches anything else in ROOT or outside it, and
refuses a namespace a running tier holds. Asks nothing: it deletes only with --yes.
Without it, it prints what it would remove and exits with status 2, so a script that
forgot --yes never mistakes it for done; --dry-run prints the same and exits 0.
Exit status: 0 done (or --dry-run), 1 the namespace is in use or a file could not be
removed, 2 a usage error (no --yes, a bad ROOT or --namespace; ROOT is checked as the
tier checks its root: a directory of this user that nobody else may write to).
"""

from __future__ import annotations

import argparse

from backends.nvme.maintenance import ClearReport, clear_root
from tiering.cli import EXIT_OK
from tiering.commands.inspect import add_arguments as add_root_arguments
from tiering.commands.inspect import show
from tiering.errors import InvalidArgumentError
from tiering.observe.statistics import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_arguments(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--yes", action="store_true", help="really remove them")
    group.add_argument(
        "--dry-run", action="store_true", help="only print what would be removed (exit 0)"
    )


def render(report: ClearReport) -> list[str]:
    verb = "would remove" if report.dry_run else "removed"
    lines = [
        f"root {report.root}: {verb} {report.files} files ({format_bytes(report.bytes)}) "
        f"of {len(report.namespaces)} namespace(s)"
    ]
    lines += [f"  {name}" for name in report.namespaces]
    if report.left:
        lines.append("left (not written by the tier):")
        lines += [f"  {path}" for path in report.left]
    return lines


def run(args: argparse.Namespace) -> int:
    report = clear_root(args.root, namespace=args.namespace, dry_run=not args.yes)
    show(report, render, args.json)
    if not args.yes and not args.dry_run:
        raise InvalidArgumentError(
            f"nothing removed: add --yes to remove these {report.files} files "
            "(or --dry-run to only list them)"
        )
    return EXIT_OK
