"""Print the --kv-transfer-config that runs vLLM 0.33 with kv-tiering's NVMe tier under
vLLM's own CPU tier.

Examples:
  tiering vllm-config /mnt/nvme/kv-cache --nvme-capacity 500G --cpu 64G
  vllm serve MODEL --kv-transfer-config "$(tiering vllm-config /mnt/nvme/kv-cache)"

It prints one line of JSON naming vLLM's OffloadingConnector with its
TieringOffloadingSpec: a CPU tier of --cpu bytes, and below it kv-tiering's
NVMeTierManager (module tiering.integrations.vllm) holding at most --nvme-capacity bytes
under ROOT. It needs no vLLM itself; vLLM must be able to import kv-tiering (install it
into vLLM's environment). Sizes take K, M, G, T (powers of 1024, an optional iB or B).
Exit status: 0 printed, 2 a usage error (a bad size, a relative ROOT).
"""

from __future__ import annotations

import argparse
import json

from tiering.cli import EXIT_OK
from tiering.cli_args import add_nvme_tier_arguments, framework_root, size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nvme_tier_arguments(parser)
    parser.add_argument(
        "--cpu", type=size, default="16G", metavar="SIZE", help="bytes of vLLM's CPU tier"
    )
    parser.add_argument(
        "--events", action="store_true", help="report stored blocks as vLLM KV events"
    )


def run(args: argparse.Namespace) -> int:
    tier = {
        "type": "NVMeTierManager",
        "module_path": "tiering.integrations.vllm",
        "root": framework_root(args.root),
        "capacity_bytes": args.nvme_capacity,
        "fsync": args.fsync,
        "enable_kv_events": args.events,
    }
    config = {  # vLLM 0.33's KVTransferConfig fields
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": args.cpu,
            "secondary_tiers": [tier],
        },
    }
    print(json.dumps(config))
    return EXIT_OK
