"""Print the ``--kv-transfer-config`` that runs vLLM 0.33 with kv-tiering's NVMe tier
under vLLM's own CPU tier.

Usage::

    python examples/vllm_config.py /mnt/nvme/kv-cache --nvme-capacity 500G --cpu 64G
    vllm serve MODEL --kv-transfer-config "$(python examples/vllm_config.py ROOT)"

The JSON names vLLM's ``OffloadingConnector`` with its ``TieringOffloadingSpec``: a CPU
tier of ``--cpu`` bytes, and below it our ``NVMeTierManager`` (module
``tiering.integrations.vllm``) holding at most ``--nvme-capacity`` bytes under ROOT.
vLLM must be able to import kv-tiering (install it into vLLM's environment).
"""

from __future__ import annotations

import argparse
import json
import os

from tiering.cli_args import make_parser, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}") from None


def kv_transfer_config(
    root: str, nvme_capacity: int, cpu_bytes: int, fsync: str, events: bool
) -> dict[str, object]:
    """vLLM's KV transfer config with our NVMe tier below its CPU tier."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [
                {
                    "type": "NVMeTierManager",
                    "module_path": "tiering.integrations.vllm",
                    "root": root,
                    "capacity_bytes": nvme_capacity,
                    "fsync": fsync,
                    "enable_kv_events": events,
                }
            ],
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 naming it."""
    parser = make_parser(__doc__)
    parser.add_argument("root", help="directory of the NVMe cache (made by the tier if absent)")
    parser.add_argument(
        "--nvme-capacity", type=_size, default="100G", help="bytes the NVMe tier may hold"
    )
    parser.add_argument("--cpu", type=_size, default="16G", help="bytes of vLLM's CPU tier")
    parser.add_argument(
        "--fsync",
        choices=("none", "batch", "always"),
        default="batch",
        help="the NVMe tier's durability (see docs/nvme.md)",
    )
    parser.add_argument(
        "--events", action="store_true", help="report stored blocks as vLLM KV events"
    )
    args = parser.parse_args(argv)
    if not os.path.isabs(args.root):
        parser.error(f"argument root: must be an absolute path, got {args.root!r}")
    return args


def main() -> None:
    args = parse_args()
    config = kv_transfer_config(args.root, args.nvme_capacity, args.cpu, args.fsync, args.events)
    print(json.dumps(config))


if __name__ == "__main__":
    main()
