"""The ``tiering`` command (``python -m tiering`` or the ``tiering`` console script).

Each subcommand is a module of :mod:`tiering.commands` defining a docstring, literal
``NAME``, ``HELP`` and ``ORDER``, ``add_arguments(parser)`` and ``run(args) -> int``;
``tiering --help`` reads their source without importing them (nor torch). Exit codes are
in ``_DESCRIPTION``; a user error prints ``tiering <subcommand>: error: <message>``, and
Ctrl-C (even while importing) ``tiering <subcommand>: interrupted``, never a traceback."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import tiering.commands
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

_DEFAULT_ORDER = 100


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand as ``tiering --help`` lists it, and its module's name."""

    name: str
    help: str
    doc: str
    order: int
    module: str


def commands() -> dict[str, Command]:
    """The subcommands by name, in ``--help``'s order (``ORDER``, then name); read, not imported."""
    found = [
        _describe(f"{tiering.commands.__name__}.{info.name}")
        for info in pkgutil.iter_modules(tiering.commands.__path__)
        if not info.name.startswith("_")
    ]
    return {c.name: c for c in sorted(found, key=lambda c: (c.order, c.name))}


def _describe(module: str) -> Command:
    """The subcommand ``module`` defines, read from its source (imported where the source
    cannot be had or ``NAME`` or ``HELP`` is not a string literal)."""
    spec = importlib.util.find_spec(module)
    get_source = getattr(spec.loader, "get_source", None) if spec is not None else None
    source = get_source(module) if get_source is not None else None
    if source is not None:
        tree = ast.parse(source)
        values = {  # NAME = "literal"
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            if len(node.targets) == 1 and isinstance(target := node.targets[0], ast.Name)
        }
        name, help_, order = values.get("NAME"), values.get("HELP"), values.get("ORDER")
        if isinstance(name, str) and isinstance(help_, str):
            order = order if isinstance(order, int) else _DEFAULT_ORDER
            return Command(name, help_, ast.get_docstring(tree) or help_, order, module)
    loaded = importlib.import_module(module)
    return Command(
        loaded.NAME,
        loaded.HELP,
        loaded.__doc__ or loaded.HELP,
        getattr(loaded, "ORDER", _DEFAULT_ORDER),
        module,
    )


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
    for name, info in commands().items():
        child = sub.add_parser(
            name, help=info.help, formatter_class=parser.formatter_class, **described(info.doc)
        )
        if name == command:
            module = importlib.import_module(info.module)
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
