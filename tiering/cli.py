"""The ``tiering`` command (``python -m tiering``, or the console script). Each subcommand
is a module of :mod:`tiering.commands` with a docstring, ``add_arguments(parser)`` and
``run(args) -> int``, imported only when run, so ``--help`` imports no torch. A user error
prints ``tiering <subcommand>: error: <message>``, and Ctrl-C (even while importing)
``tiering <subcommand>: interrupted``, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tiering.cli_args import EXIT_INTERRUPTED, described, make_parser
from tiering.errors import InvalidArgumentError, TieringError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_DESCRIPTION = """kv-tiering's command: replay traffic through a real engine, sweep the CPU tier's
capacity, and look into NVMe roots. `tiering COMMAND --help` describes each command.

Exit codes: 0 done and nothing wrong found; 1 a failure found (wrong bytes served, a
damaged block, a failed run); 2 a usage error (a bad option, an unreadable trace or
config file); 130 interrupted."""

# The subcommands in --help's order; each is the module tiering.commands.NAME ("-" as "_").
COMMANDS = {
    "replay": "replay a trace through a real engine, checking every loaded byte",
    "sweep": "hit ratio by CPU capacity and policy (bookkeeping only), with a plot",
    "bench": "run one of the project's benchmarks (examples/bench_*.py), or list them",
    "vllm-config": "print the --kv-transfer-config that puts the NVMe tier under vLLM's CPU tier",
    "sglang-config": "print the SGLang arguments that make the NVMe tier its HiCache storage",
    "inspect": "what an NVMe root holds: namespaces, blocks, bytes, damaged or orphaned files",
    "verify": "re-check every block of an NVMe root; report, and with --remove remove, bad ones",
    "clear": "remove the blocks of an NVMe root, or of one namespace (needs --yes)",
}


class _VersionAction(argparse.Action):
    """``--version``: print the installed package's version (looked up only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            shown = version("kv-tiering")
        except PackageNotFoundError:
            shown = "(version unknown: the package is not installed)"
        print(f"{parser.prog} {shown}")
        parser.exit()


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """Every subcommand, with the options of ``command`` alone (whose module alone is imported)."""
    parser = make_parser(_DESCRIPTION, prog="tiering")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_ in COMMANDS.items():
        child = sub.add_parser(name, help=help_, formatter_class=parser.formatter_class)
        if name == command:
            module = importlib.import_module(f"tiering.commands.{name.replace('-', '_')}")
            doc = described(module.__doc__)
            child.description, child.epilog = doc["description"], doc["epilog"]
            module.add_arguments(child)
            child.set_defaults(_run=module.run, _parser=child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # The first word not an option names the subcommand (--help and --version take no value).
    command = next((arg for arg in args if not arg.startswith("-")), None)
    try:
        return _run(args, command)
    except KeyboardInterrupt:
        print(f"tiering{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(argv: list[str], command: str | None) -> int:
    parser = build_parser(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or argparse's own usage error
        return int(exc.code or 0)
    try:
        return int(args._run(args))
    except TieringError as exc:
        print(f"tiering {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidArgumentError) else EXIT_FAILURE
    except BrokenPipeError:  # `tiering ... | head`: the reader went away
        return EXIT_OK


def entry_point() -> None:
    """The console script."""
    sys.exit(main())
