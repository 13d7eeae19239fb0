"""The ``tiering`` command (``python -m tiering`` or the ``tiering`` console script).

Each subcommand is a module of :mod:`tiering.commands` that defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; the command finds them by itself, so
adding one touches no other file.

Exit codes, for every subcommand: 0 done and nothing wrong found, 1 a failure found (a
mismatch, a damaged block, a failed run), 2 a usage error (a bad option, an unreadable
trace or config file). A user error prints one line, ``tiering <subcommand>: error:
<message>``, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

import tiering.commands
from tiering.cli_args import make_parser
from tiering.errors import InvalidArgumentError, TieringError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_DESCRIPTION = """kv-tiering's command: replay traffic through a real engine, sweep the CPU tier's
capacity, and look into NVMe roots. `tiering COMMAND --help` describes each command.

Exit codes: 0 done and nothing wrong found; 1 a failure found (wrong bytes served, a
damaged block, a failed run); 2 a usage error (a bad option, an unreadable trace or
config file)."""


def commands() -> dict[str, ModuleType]:
    """The subcommand modules, by name, in the order they are listed in ``--help``
    (each module's ``ORDER``, then its name)."""
    found = []
    for info in pkgutil.iter_modules(tiering.commands.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"tiering.commands.{info.name}")
        found.append((getattr(module, "ORDER", 100), module.NAME, module))
    return {name: module for _, name, module in sorted(found, key=lambda t: t[:2])}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand with its options."""
    parser = make_parser(_DESCRIPTION, prog="tiering")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in commands().items():
        doc = module.__doc__ or module.HELP
        child = sub.add_parser(
            name,
            help=module.HELP,
            description=doc.strip().partition("\n\n")[0],
            epilog=doc.strip().partition("\n\n")[2] or None,
            formatter_class=parser.formatter_class,
        )
        module.add_arguments(child)
        child.set_defaults(_run=module.run, _parser=child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error
        return int(exc.code or 0)
    try:
        return int(args._run(args))
    except InvalidArgumentError as exc:
        print(f"tiering {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TieringError as exc:
        print(f"tiering {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"tiering {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tiering ... | head`: the reader went away
        return EXIT_OK


def entry_point() -> None:
    """The console script."""
    sys.exit(main())
