"""The DeviceCopier's device <-> host copies on CUDA against one large pinned copy:
``device_copy_ratio`` for the one-tensor and per-layer (32 tensors) layouts, blocks of
256 KiB .. 2 MiB, both directions (bench_engine.py's measurement 3, on its own).

    python examples/bench_device_copy.py [--gib 1]

The last stdout line is one JSON object. Exits 2 without CUDA.
"""

from __future__ import annotations

import json

import torch
import uvloop
from bench_engine import device_copy_run  # this directory is on sys.path[0]

from tiering.cli_args import Progress, make_parser, positive_float, run_main


def main() -> int:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--gib", type=positive_float, default=1.0, help="GiB moved per layout, size and way"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False)")
    with Progress() as progress:
        figures = uvloop.run(device_copy_run(int(args.gib * (1 << 30)), progress))
    figures["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    run_main(main)
