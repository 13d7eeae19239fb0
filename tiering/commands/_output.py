"""What the subcommands print with: ``--json``, the JSON line, aligned columns."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json``: the result as one JSON object on the last line of stdout."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on the last line of stdout",
    )


def print_json(document: dict[str, Any]) -> None:
    """One JSON object on one line (the last line a command prints on stdout)."""
    print(json.dumps(document, sort_keys=True))


def table(rows: list[list[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart (the first row is the heading)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip
