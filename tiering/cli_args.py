"""Command-line pieces the `tiering` command and the example scripts share: argument types
(a bad value is argparse's usage error, status 2, before any work starts), a parser, a
progress line, and how a script exits on Ctrl-C. It imports nothing heavy (no torch)."""

from __future__ import annotations

import argparse
import math
import os
import runpy
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import NoReturn, TextIO, TypeVar

from tiering.errors import InvalidArgumentError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_N = TypeVar("_N", int, float)
EXIT_INTERRUPTED = 130  # a command or script stopped by Ctrl-C: 128 + SIGINT, as shells say


def make_parser(doc: str | None, **kwargs: object) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows every option's default, described by ``doc``."""
    return argparse.ArgumentParser(
        formatter_class=_HelpFormatter,
        **described(doc),
        **kwargs,  # type: ignore[arg-type]
    )


def described(doc: str | None) -> dict[str, str | None]:
    """A parser's ``description`` (``doc``'s first paragraph) and ``epilog`` (the rest, or None)."""
    first, _, rest = (doc or "").strip().partition("\n\n")
    return {"description": first, "epilog": rest or None}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help (None is not shown), the docstring's line breaks kept."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: a decimal integer > 0."""
    return _positive(text, lambda t: int(t, 10), "integer")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _positive(text, float, "number")


def _positive(text: str, convert: Callable[[str], _N], what: str) -> _N:
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text!r}")
    return value


def parse_size(text: str) -> int:
    """Bytes named by ``text``: ``"2M"``, ``"128K"``, ``"1.5G"``, ``"2MiB"``, ``"4096"``
    (units are powers of 1024: K, M, G, T, an optional ``iB`` or ``B`` after them). Raises
    ValueError if ``text`` is not a size, or not a positive whole number of bytes."""
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


def size(text: str) -> int:
    """An argparse type: a size in bytes, as :func:`parse_size` reads it."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list(text: str) -> list[int]:
    """An argparse type: comma-separated sizes (``"2M,128K"``), each as :func:`size`."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"must be comma-separated sizes like 2M,128K, got {text!r}"
        )
    return [size(part) for part in parts]


def choice_list(
    choices: Iterable[str], resolve: Callable[[str], str] | None = None
) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, no repeats, each one of ``choices`` once
    passed through ``resolve`` (an alias to its name; the two given together count once)."""
    allowed = sorted(choices)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"names repeat in {text!r}")
        if resolve is not None:
            names = list(dict.fromkeys(resolve(name) for name in names))
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown name {unknown[0]!r} in {text!r}; choose from {', '.join(allowed)}"
            )
        return names

    parse.__name__ = "choice_list"  # argparse names the type in some messages
    return parse


def add_nvme_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """ROOT (check it with :func:`framework_root`), ``--nvme-capacity`` and ``--fsync``: the
    NVMe tier a framework's config names (``tiering vllm-config``, ``sglang-config``)."""
    parser.add_argument(
        "root", metavar="ROOT", help="absolute path of the NVMe cache (made by the tier if absent)"
    )
    parser.add_argument(
        "--nvme-capacity", type=size, default="100G", metavar="SIZE",
        help="bytes the NVMe tier may hold",
    )  # fmt: skip
    parser.add_argument(
        "--fsync", choices=("none", "batch", "always"), default="batch",
        help="the NVMe tier's durability (docs/nvme.md)",
    )  # fmt: skip


def framework_root(root: str) -> str:
    """``root`` if it is absolute (a framework's processes have another working directory),
    else InvalidArgumentError naming ``root``."""
    if not os.path.isabs(root):
        raise InvalidArgumentError(f"root: must be an absolute path, got {root!r}")
    return root


def ensure_directory(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Create ``path`` (and parents) if missing and probe that a file can be made in it
    (``os.access`` says yes to root); else ``parser.error`` naming ``option`` and the path."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        parser.error(f"argument {option}: cannot write in {path!r}: {exc.strerror or exc}")


class Progress(AbstractContextManager["Progress"]):
    """One status line on ``stream`` (stderr by default), redrawn in place at most every
    ``interval`` seconds, only on a terminal; :meth:`clear` (or leaving ``with``) erases it."""

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
        """Show ``text`` (unless ``force``, skipped if the last redraw was too recent)."""
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
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0
            self._last = -math.inf

    def __exit__(self, *exc_info: object) -> None:
        self.clear()


def run_main(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """Run a script's ``main`` and exit with the status it returns (0 for None); Ctrl-C
    prints ``<prog>: interrupted`` (default: the script's file name) and exits 130; a
    Ctrl-C while it exits is ignored (no traceback from its exit handlers)."""
    try:
        status = main()
    except KeyboardInterrupt:
        # `tiering bench` passes Ctrl-C on once more when a benchmark is slow to end;
        # by now it is ending, and an exit handler must not be cut short by it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        name = prog or os.path.basename(sys.argv[0]) or "python"
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(status or 0)


def run_path(path: str, argv: Sequence[str]) -> NoReturn:
    """Run the script at ``path`` as ``python3 path argv...`` would, under :func:`run_main`."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))

    def main() -> None:
        runpy.run_path(path, run_name="__main__")

    run_main(main, os.path.basename(path))
