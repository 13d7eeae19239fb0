"""The DeviceCopier's device <-> host copies on CUDA against one large pinned copy:
``device_copy_ratio`` for the one-tensor and per-layer (32 tensors) layouts, blocks of
256 KiB .. 2 MiB, both directions (bench_engine.py's measurement 3, on its own); then
the same loads layer by layer (a LayerProgress: kernels read the mapped host pool layer
after layer), ``device_copy_ratio_layerwise`` against the pinned host-to-device copy,
and how soon the first layer is readable (``first_layer_ms`` against ``load_ms``).

    python examples/bench_device_copy.py [--gib 1]

The last stdout line is one JSON object. Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
import uvloop
from bench_engine import device_copy_run, device_kv, pinned_copy_speed  # sys.path[0]

from tiering import LayerProgress
from tiering.cli_args import Progress, make_parser, positive_float, run_main
from tiering.device.copier import DeviceCopier
from tiering.device.host_pool import HostPool


def _first_layer(marks: LayerProgress) -> None:
    """Return once layer 0 has landed: this thread's stream waits for it, then the host."""
    marks.wait(0)
    torch.cuda.current_stream().synchronize()


async def layerwise_run(total_bytes: int, progress: Progress) -> dict[str, object]:
    """Loads of ``total_bytes`` with a LayerProgress: GB/s (best of 3) against one large
    pinned host-to-device copy, and when layer 0 could be read; bytes checked."""
    _, h2d = pinned_copy_speed(total_bytes)
    rows = []
    for block in (256 << 10, 512 << 10, 1 << 20, 2 << 20):
        n = total_bytes // block
        for layout, layers in (("one-tensor", 1), ("per-layer", 32)):
            progress.update(f"layer-by-layer loads: {block >> 10} KiB {layout}", force=True)
            kv = [device_kv(n, block // layers, "cuda") for _ in range(layers)]
            want = [t.clone() for t in kv]
            ids = list(range(n))
            with HostPool(n, block) as pool:
                async with DeviceCopier(kv if layers > 1 else kv[0], pool) as copier:
                    await copier.to_host(ids, ids)
                    best, first = float("inf"), float("inf")
                    for _ in range(4):  # the first is a warm-up
                        for t in kv:
                            t.zero_()
                        torch.cuda.synchronize()  # not timed: the copy would wait for it
                        marks = LayerProgress(copier.num_layers)
                        t0 = time.perf_counter()
                        handle = copier.to_device(ids, ids, progress=marks)
                        await asyncio.to_thread(_first_layer, marks)  # never wait on the loop
                        t1 = time.perf_counter()
                        await handle
                        t2 = time.perf_counter()
                        if t2 - t0 < best:
                            best, first = t2 - t0, t1 - t0
                    same = (
                        torch.equal(t.view(torch.int16), w.view(torch.int16))  # NaNs included
                        for t, w in zip(kv, want, strict=True)
                    )
                    if not all(same):
                        raise SystemExit(f"a layer-by-layer load changed the bytes ({layout})")
            rows.append(
                {
                    "block_bytes": block,
                    "layout": layout,
                    "to_device_GBps": round(total_bytes / best / 1e9, 2),
                    "ratio": round(total_bytes / best / h2d, 3),
                    "load_ms": round(best * 1e3, 2),
                    "first_layer_ms": round(first * 1e3, 2),
                }
            )
            progress.clear()
            print(f"  layer by layer {block >> 10:5d} KiB {layout:10s} {rows[-1]}")
            del kv, want
    return {
        "device_copy_ratio_layerwise": min(r["ratio"] for r in rows),
        "layerwise_loads": rows,
    }


async def run(total_bytes: int, progress: Progress) -> dict[str, object]:
    print("device copies (CUDA):")
    figures = await device_copy_run(total_bytes, progress)
    figures.update(await layerwise_run(total_bytes, progress))
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked command line: a bad value, or no CUDA device, exits 2."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--gib", type=positive_float, default=1.0, help="GiB moved per layout, size and way"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False)")
    return args


def main() -> int:
    args = parse_args()
    with Progress() as progress:
        figures = uvloop.run(run(int(args.gib * (1 << 30)), progress))
    figures["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    run_main(main)
