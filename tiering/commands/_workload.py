"""What ``tiering replay`` and ``tiering sweep`` share: a config (defaults, then the
``--config`` file, the shortcut options, then each ``--set`` in order: docs/config.md)
and the workload it names (without a trace, the ``[synthetic]`` chat traffic).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from tiering.config import TieringConfig, config_from_toml, load_config, parse_override
from tiering.errors import ConfigError
from tiering.lab.workload_suite import WORKLOADS, generate
from tiering.lab.workloads import Request, read_mooncake, synthetic_requests

DEFAULT_CPU_BLOCKS = 10_000  # the CPU tier's size when neither the config nor --cpu gives one


def _override(text: str) -> tuple[str, str]:
    try:
        return parse_override(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace (optional: the synthetic workload without one), ``--limit``,
    ``--full-blocks-only``, ``--config FILE`` and repeatable ``--set SECTION.FIELD=VALUE``."""
    parser.add_argument(
        "trace", nargs="?", help="a Mooncake-format JSONL trace (default: synthetic chat traffic)"
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="a named workload to generate when no trace is given (default: synthetic)",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="replay the first N requests")
    parser.add_argument(
        "--full-blocks-only",
        action="store_true",
        default=None,
        help="leave out each prompt's partial last block",
    )
    parser.add_argument("--config", metavar="FILE", help="a TOML config (docs/config.md)")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.FIELD=VALUE",
        type=_override,
        action="append",
        help="override one config field (repeatable), e.g. engine.policy=arc",
    )


def resolve_config(
    args: argparse.Namespace, shortcuts: dict[str, Any], tiers: Sequence[Mapping[str, object]] = ()
) -> TieringConfig:
    """The config the command line describes: ``shortcuts`` maps config paths to the
    command's own options (None: not given), ``tiers`` are the tier specs its options
    add. Raises ConfigError naming the field of a bad file, override or shortcut."""
    given = {
        "replay.trace": args.trace,
        "replay.workload": args.workload,
        "replay.limit": args.limit,
        "replay.full_blocks_only": args.full_blocks_only or None,
        **shortcuts,
    }
    overrides = {path: value for path, value in given.items() if value is not None}
    overrides.update(dict(args.overrides or ()))
    if args.config is not None:
        return load_config(args.config, overrides, add_tiers=tiers)
    if "engine.cpu_blocks" not in overrides and "engine.cpu_bytes" not in overrides:
        overrides["engine.cpu_blocks"] = DEFAULT_CPU_BLOCKS
    return config_from_toml("", overrides=overrides, add_tiers=tiers)


def load_workload(config: TieringConfig) -> list[Request]:
    """The requests ``config.replay`` names: its trace's (up to ``limit``), or its
    generated workload (``synthetic``: the traffic ``config.synthetic`` describes; the
    others with its seed). Raises TraceError for a bad trace."""
    replay = config.replay
    if replay.trace is not None:
        return read_mooncake(replay.trace, limit=replay.limit)
    if replay.workload == "synthetic":
        requests = synthetic_requests(**config.synthetic.model_dump())
    else:
        requests = generate(replay.workload, config.synthetic.seed)
    return requests[: replay.limit] if replay.limit is not None else requests


def cpu_shortcut(text: str | None) -> dict[str, object]:
    """``--cpu``: a plain integer is blocks, anything else a size in bytes (``64GiB``)."""
    if text is None:
        return {}
    if text.strip().isdigit():
        return {"engine.cpu_blocks": int(text), "engine.cpu_bytes": "none"}
    return {"engine.cpu_bytes": text, "engine.cpu_blocks": "none"}
