"""A short asyncio driver: prompts' KV blocks go down the tiers and come back intact.

    python examples/driver.py [--nvme DIR] [--device cpu|cuda]

It builds a device KV cache (CUDA if present, else CPU tensors) of per-layer tensors,
fills the blocks of a few prompts with random values, stores them through the engine
(device -> CPU -> secondary tiers), wipes them on the "device", loads them back — from
the CPU tier, and after evicting them from CPU, from a secondary tier — and checks
every byte. It prints what moved where and exits non-zero if any byte differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import uvloop

from tiering import TieringEngine
from tiering.cli_args import ensure_directory, make_parser, run_main
from tiering.hashing import block_hashes

LAYERS = 4
BLOCK_TOKENS = 16
HEADS, HEAD_DIM = 8, 64
DEVICE_BLOCKS = 64
CPU_BLOCKS = 8
PROMPT_TOKENS = [64, 96, 80]  # three prompts of 4, 6 and 5 blocks


def make_kv_cache(device: torch.device) -> list[torch.Tensor]:
    """Per-layer K and V for every device block: [blocks, 2, tokens, heads, head_dim]."""
    shape = (DEVICE_BLOCKS, 2, BLOCK_TOKENS, HEADS, HEAD_DIM)
    return [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(LAYERS)]


def fill_blocks(kv: list[torch.Tensor], ids: list[int], gen: torch.Generator) -> None:
    for layer in kv:
        values = torch.randn((len(ids), *layer.shape[1:]), generator=gen, dtype=torch.float32)
        layer[ids] = values.to(layer.dtype).to(layer.device)


def snapshot(kv: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [layer[ids].cpu().clone() for layer in kv]


def same(kv: list[torch.Tensor], ids: list[int], expected: list[torch.Tensor]) -> bool:
    pairs = zip(kv, expected, strict=True)
    return all(torch.equal(layer[ids].cpu(), want) for layer, want in pairs)


async def run(device: torch.device, nvme_dir: Path | None) -> bool:
    kv = make_kv_cache(device)
    gen = torch.Generator().manual_seed(0)
    tiers: list[object] = [{"type": "memory", "max_blocks": 64}]
    if nvme_dir is not None:
        tiers.append(
            {
                "type": "nvme",
                "root": str(nvme_dir),
                "namespace": f"driver-example/{LAYERS}x{HEADS}x{HEAD_DIM}/fp16",
                "capacity_bytes": 256 << 20,
            }
        )
    block_kib = sum(t[0].numel() * t.element_size() for t in kv) // 1024
    print(
        f"device: {device}; {LAYERS} layers, {block_kib} KiB per block; "
        f"CPU tier {CPU_BLOCKS} blocks; secondary tiers: " + ", ".join(t["type"] for t in tiers)  # type: ignore[index]
    )
    all_ok = True
    async with TieringEngine(kv, CPU_BLOCKS, secondary_tiers=tiers, enable_events=True) as engine:
        prompts = []
        next_block = 0
        for p, n_tokens in enumerate(PROMPT_TOKENS):
            tokens = torch.randint(0, 32000, (n_tokens,), generator=gen).tolist()
            hashes = block_hashes(tokens, BLOCK_TOKENS, namespace="driver-example")
            ids = list(range(next_block, next_block + len(hashes)))
            next_block += len(hashes)
            fill_blocks(kv, ids, gen)
            prompts.append((hashes, ids, snapshot(kv, ids)))
            start = time.perf_counter()
            job = engine.store(hashes, ids)
            result = await job
            cascaded = await job.cascaded
            ms = (time.perf_counter() - start) * 1e3
            print(
                f"prompt {p}: stored {len(hashes)} blocks device->CPU "
                f"({'ok' if result.success else result.error}); "
                f"cascaded to secondary tiers: {cascaded}; {ms:.1f} ms"
            )
            all_ok &= result.success and cascaded

        for _, ids, _ in prompts:
            for layer in kv:
                layer[ids] = 0  # the serving framework reused these device blocks
        print(f"wiped {next_block} device blocks")

        # Load every prompt back into other device blocks. The CPU tier holds only the
        # most recent 8 blocks, so older blocks come back from a secondary tier.
        target = DEVICE_BLOCKS - next_block
        for p, (hashes, _, expected) in enumerate(prompts):
            hit = engine.lookup(hashes)
            in_cpu = engine.manager.lookup(hashes)
            dst = list(range(target, target + len(hashes)))
            target += len(hashes)
            result = await engine.load(hashes, dst)
            exact = result.success and same(kv, dst, expected)
            source = f"{in_cpu} from CPU, {len(hashes) - in_cpu} promoted from a secondary tier"
            print(
                f"prompt {p}: lookup {hit}/{len(hashes)} blocks; loaded {source} "
                f"-> device blocks {dst[0]}..{dst[-1]}; bytes exact: {exact}"
            )
            all_ok &= exact
        for event in engine.take_events():
            verb = "evicted from" if event.removed else "stored in"
            print(f"event: {len(event.block_hashes)} blocks {verb} {event.medium}")
        print(f"engine: {engine.statistics()!r}")
    return all_ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked command line: an unusable ``--nvme`` directory or ``--device cuda``
    without CUDA exits with status 2 and a message naming the option."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--nvme", type=Path, metavar="DIR", help="also cascade to an NVMe tier under DIR"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="where the KV cache lives (default: cuda if available, else cpu)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: 'cuda' requested but torch sees no CUDA device")
    if args.nvme is not None:
        ensure_directory(parser, "--nvme", str(args.nvme))
    return args


def main() -> None:
    args = parse_args()
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ok = uvloop.run(run(torch.device(name), args.nvme))
    print("all bytes round-tripped exactly" if ok else "MISMATCH: some bytes differ")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    run_main(main)
