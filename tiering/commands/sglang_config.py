"""Print the arguments that run SGLang 0.5.23 with kv-tiering's NVMe tier as its HiCache
storage (the third level, below SGLang's host memory).

Examples:
  tiering sglang-config /mnt/nvme/kv-cache --nvme-capacity 500G
  python -m sglang.launch_server --model-path MODEL \\
      $(tiering sglang-config /mnt/nvme/kv-cache --nvme-capacity 500G)

It prints one line of words for the shell's $(...): SGLang's hierarchical cache on, the
page_first host layout, the `dynamic` storage backend, the prefetch policy, and the
backend's extra config (one JSON word, unquoted and without spaces, naming
NVMeHiCacheStorage in module tiering.integrations.sglang, with the tier's options).
With --extra-config it prints only the JSON, to quote yourself. It needs no SGLang
itself; SGLang must be able to import kv-tiering (install it into SGLang's environment).
Sizes take K, M, G, T (powers of 1024, an optional iB or B).
Exit status: 0 printed, 2 a usage error (a bad size, a relative ROOT, or one with
whitespace, which $(...) would split).
"""

from __future__ import annotations

import argparse
import json

from tiering.cli import EXIT_OK
from tiering.cli_args import add_nvme_tier_arguments, framework_root
from tiering.errors import InvalidArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nvme_tier_arguments(parser)
    parser.add_argument(
        "--prefetch-policy",
        choices=("best_effort", "wait_complete", "timeout"),
        default="timeout",
        help="when SGLang stops waiting for a prefetch from the tier (its own default)",
    )
    parser.add_argument(
        "--extra-config",
        action="store_true",
        help="print only the JSON of --hicache-storage-backend-extra-config",
    )


def run(args: argparse.Namespace) -> int:
    if any(char.isspace() for char in framework_root(args.root)):
        raise InvalidArgumentError(f"root: must hold no whitespace, got {args.root!r}")
    extra = {  # through the zero-copy interface (interface_v1)
        "backend_name": "kv-tiering",
        "module_path": "tiering.integrations.sglang",
        "class_name": "NVMeHiCacheStorage",
        "interface_v1": 1,
        "root": args.root,
        "capacity_bytes": args.nvme_capacity,
        "fsync": args.fsync,
    }
    extra_json = json.dumps(extra, separators=(",", ":"))
    arguments = [
        "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-prefetch-policy", args.prefetch_policy,
        "--hicache-storage-backend-extra-config", extra_json,
    ]  # fmt: skip
    print(extra_json if args.extra_config else " ".join(arguments))
    return EXIT_OK
