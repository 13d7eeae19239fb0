"""Command-line pieces the `tiering` command and the example scripts share: argument types,
a parser, progress, how a script exits on Ctrl-C.

The argument types raise :class:`argparse.ArgumentTypeError`, so argparse reports a bad
value as ``argument --name: <why>, got '<value>'`` and exits with status 2 before any
work starts. :class:`Progress` draws one self-overwriting status line on stderr, and
only when stderr is a terminal: piped or captured output (and the JSON line a benchmark
prints last on stdout) is never touched by it. :func:`run_main` runs a script's
``main`` so that Ctrl-C ends it with one line and status 130, never a traceback.

This module imports nothing heavy (no torch): a script imports it cheaply.
"""

from __future__ import annotations

import argparse
import math
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import NoReturn, TextIO

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

EXIT_INTERRUPTED = 130
"""The exit status of a command or script stopped by Ctrl-C (128 + SIGINT, as shells
report a process the signal killed)."""


def make_parser(doc: str | None, **kwargs: object) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows every option's default; described by ``doc``'s
    first paragraph (the script's docstring), the rest of it shown as the epilog."""
    first, _, rest = (doc or "").strip().partition("\n\n")
    return argparse.ArgumentParser(
        description=first,
        epilog=rest or None,
        formatter_class=_HelpFormatter,
        **kwargs,  # type: ignore[arg-type]
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help (an absent default, None, is not shown), and the docstring's
    own line breaks kept."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: a decimal integer > 0."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def parse_size(text: str) -> int:
    """Bytes named by ``text``: ``"2M"``, ``"128K"``, ``"1.5G"``, ``"2MiB"``, ``"4096"``.

    Units are powers of 1024 (K, M, G, T; an optional ``iB`` or ``B`` after them).

    Raises:
        ValueError: ``text`` is not a size, or it is not a positive whole number of bytes.
    """
    body = text.strip().upper()
    for suffix in ("IB", "B"):
        if body.endswith(suffix) and len(body) > len(suffix):
            body = body.removesuffix(suffix)
            break
    unit = body[-1:] if body[-1:] in _UNITS else ""
    number = body[: len(body) - len(unit)]
    try:
        amount = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (expected e.g. 2M, 128K, 4096)") from None
    if not math.isfinite(amount) or amount <= 0 or amount != int(amount):
        raise ValueError(f"not a positive whole number of bytes: {text!r}")
    return int(amount)


def size_list(text: str) -> list[int]:
    """An argparse type: comma-separated sizes (``"2M,128K"``), each as :func:`parse_size`."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"must be comma-separated sizes like 2M,128K, got {text!r}"
        )
    try:
        return [parse_size(part) for part in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``choices``, no repeats."""
    allowed = sorted(choices)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown name {unknown[0]!r} in {text!r}; choose from {', '.join(allowed)}"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"names repeat in {text!r}")
        return names

    parse.__name__ = "choice_list"  # argparse names the type in some messages
    return parse


def ensure_directory(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Create ``path`` (and its parents) if missing and check a file can be made in it;
    otherwise exit through ``parser.error`` (status 2) naming ``option`` and the path.

    A real probe rather than ``os.access``, which says yes to root everywhere (/proc).
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        parser.error(f"argument {option}: cannot write in {path!r}: {exc.strerror or exc}")


class Progress:
    """One status line on ``stream`` (stderr by default), redrawn in place.

    Silent unless the stream is a terminal, so a benchmark's captured output is exactly
    what it would be without it. Redraws at most every ``interval`` seconds; ``clear()``
    (or leaving the ``with`` block) erases the line so the next ordinary print starts on
    a clean row. Writing is cheap enough to call from the event loop.
    """

    def __init__(self, stream: TextIO | None = None, *, interval: float = 0.2) -> None:
        self._stream = sys.stderr if stream is None else stream
        try:
            self.enabled = self._stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._interval = interval
        self._last = -math.inf
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        """Show ``text`` as the status (skipped if the last redraw was too recent)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        pad = max(0, self._width - len(text))
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        """Erase the status line, if one is shown."""
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0
            self._last = -math.inf

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.clear()


def run_main(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """Run a script's ``main`` and exit with the status it returns (0 for None).

    Ctrl-C (a KeyboardInterrupt out of ``main``, after its ``finally`` blocks and
    context managers ran) prints one line on stderr, ``<prog>: interrupted`` (``prog``
    defaults to the script's file name), and exits with status 130, never a traceback.
    A ``sys.exit`` inside ``main`` passes through unchanged.
    """
    try:
        status = main()
    except KeyboardInterrupt:
        name = prog or os.path.basename(sys.argv[0]) or "python"
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(status or 0)


def run_path(path: str, argv: Sequence[str]) -> NoReturn:
    """Run the script at ``path`` as ``python3 path argv...`` would (as ``__main__``,
    its directory first on the import path) and exit with its status.

    Ctrl-C at any point, while the script still imports (torch takes seconds) as well as
    later, prints one line on stderr, ``<script's file name>: interrupted``, and exits
    with status 130, never a traceback.
    """
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except KeyboardInterrupt:
        print(f"{os.path.basename(path)}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(0)
