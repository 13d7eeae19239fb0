"""A Hugging Face causal LM whose prefix KV lives in the engine's tiers: the time to first
token of a prompt whose prefix was seen, loaded back (whole, or layer by layer), against
its prefill.

    python examples/hf_prefix_cache.py [--shape tiny|8b] [--layout per-layer|one-tensor]
        [--prefix-tokens N[,N...]] [--nvme DIR] [--device cpu|cuda] [--repeats N]

The model is a Llama built from a config with random weights (nothing is downloaded;
``--shape 8b`` is the shape of an 8B Llama). Its KV is kept in the engine's paged layout
(device blocks of ``--block-tokens`` tokens: per-layer tensors, or one tensor). A first
request prefills a prompt and stores its prefix's blocks through the engine (CPU tier,
and with ``--nvme`` down to NVMe); later requests with the same prefix and another
suffix load the blocks into device blocks and compute only the rest. A layer-by-layer
load lets layer i's attention start once layer i has landed (a LayerProgress). From
NVMe means after a restart of the engine: its CPU tier is empty and the blocks come up
from disk. Every cached answer is checked against a prefill of the same prompt (same
greedy tokens); a block that fails to load means recomputing, never a wrong token.
The last stdout line is one JSON object (units in the key names). Needs transformers
(``pip install .[hf]``).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Literal

import torch
import uvloop
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # imported by the tests too
from bench_nvme import drop_page_cache, files_under

from tiering import LayerProgress, TieringEngine, TransferError
from tiering.cli_args import ensure_directory, make_parser, run_main
from tiering.hashing import block_hashes

Mode = Literal["prefill", "whole", "layers"]

# The model call's keyword for the cache it reads and fills: ``cache`` from transformers
# 5.24 on (there ``past_key_values`` warns, and goes in 5.40); before, only
# ``past_key_values``. The filled cache is the one passed in, so no output field (whose
# name changed too) is read.
_CACHE_KEYWORD = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)

SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    ),
    "8b": dict(  # Llama-3-8B's shape
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
}


def build_model(
    shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> LlamaForCausalLM:
    """A Llama of ``shape`` with random weights (``seed``), on ``device`` in ``dtype``,
    with eager-free SDPA attention, in eval mode."""
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 17)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # initialised where it runs: an 8B model never sits in host memory
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class PagedKV:
    """The model's KV in the engine's paged layout: ``num_blocks`` device blocks of
    ``block_tokens`` tokens; ``"per-layer"``: a tensor per model layer ``[blocks, 2,
    kv heads, block tokens, head dim]``; ``"one-tensor"``: one ``[blocks, layers, 2,
    ...]`` tensor (then a load's LayerProgress has one layer, which every model layer
    waits for)."""

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_tokens: int,
        layout: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block_tokens = block_tokens
        self.num_layers = config.num_hidden_layers
        heads, head_dim = config.num_key_value_heads, config.head_dim
        row = (2, heads, block_tokens, head_dim)
        if layout == "per-layer":
            self.kv_caches: torch.Tensor | list[torch.Tensor] = [
                torch.zeros((num_blocks, *row), dtype=dtype, device=device)
                for _ in range(self.num_layers)
            ]
        elif layout == "one-tensor":
            shape = (num_blocks, self.num_layers, *row)
            self.kv_caches = torch.zeros(shape, dtype=dtype, device=device)
        else:
            raise ValueError(f"layout must be 'per-layer' or 'one-tensor', got {layout!r}")
        self.free = list(range(num_blocks))

    def layer(self, i: int) -> torch.Tensor:
        """Model layer ``i``'s blocks, ``[blocks, 2, kv heads, block tokens, head dim]``."""
        kv = self.kv_caches
        return kv[i] if isinstance(kv, list) else kv[:, i]

    def progress_layer(self, i: int, progress: LayerProgress) -> int:
        """The layer of ``progress`` that holds model layer ``i``."""
        return i * progress.num_layers // self.num_layers

    def take(self, n: int) -> list[int]:
        """``n`` free device blocks (RuntimeError if there are fewer)."""
        if n > len(self.free):
            raise RuntimeError(f"{n} device blocks wanted, {len(self.free)} free")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, ids: Sequence[int]) -> None:
        self.free.extend(ids)

    def write(self, cache: DynamicCache, first_block: int, ids: Sequence[int]) -> None:
        """Blocks ``first_block, first_block + 1, ...`` of ``cache``'s tokens into
        device blocks ``ids``."""
        bs, n = self.block_tokens, len(ids)
        index = torch.tensor(ids, device=self.layer(0).device)
        start = first_block * bs
        for i in range(self.num_layers):
            layer = cache.layers[i]
            for kv, states in enumerate((layer.keys, layer.values)):
                part = states[0, :, start : start + n * bs]  # [heads, n * bs, head dim]
                blocks = part.unflatten(1, (n, bs)).transpose(0, 1)  # [n, heads, bs, dim]
                self.layer(i)[:, kv].index_copy_(0, index, blocks.to(self.layer(i).dtype))

    def read(self, i: int, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``i``'s keys and values of blocks ``ids``, ``[1, heads, tokens,
        head dim]`` each, as the model's cache holds them."""
        index = torch.tensor(ids, device=self.layer(i).device)
        blocks = self.layer(i).index_select(0, index)  # [n, 2, heads, bs, dim]
        keys, values = (blocks[:, kv].transpose(0, 1).flatten(1, 2)[None] for kv in (0, 1))
        return keys, values


class PagedPrefixLayer(DynamicLayer):
    """A cache layer whose first ``len(ids) * block_tokens`` tokens are device blocks
    ``ids`` of a :class:`PagedKV`: read when the layer's attention first needs them,
    after waiting for the layer in ``progress`` (a layer-by-layer load), then grown as
    a :class:`DynamicLayer`."""

    def __init__(
        self, paged: PagedKV, index: int, ids: Sequence[int], progress: LayerProgress | None
    ) -> None:
        super().__init__()
        self._paged, self._index, self._ids, self._progress = paged, index, ids, progress
        self._prefix_tokens = len(ids) * paged.block_tokens

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self._prefix_tokens  # known without waiting for the bytes
        return super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            paged, progress = self._paged, self._progress
            if progress is not None:  # raises TransferError if the load failed
                progress.wait(paged.progress_layer(self._index, progress))
            self.keys, self.values = paged.read(self._index, self._ids)
            self.dtype, self.device = self.keys.dtype, self.keys.device
            self.is_initialized = True
        return super().update(key_states, value_states, *args, **kwargs)


def paged_cache(paged: PagedKV, ids: Sequence[int], progress: LayerProgress | None) -> DynamicCache:
    """A model cache whose prefix is device blocks ``ids`` (empty: no prefix)."""
    cache = DynamicCache()
    if ids:
        cache.layers = [PagedPrefixLayer(paged, i, ids, progress) for i in range(paged.num_layers)]
    return cache


@dataclass(frozen=True)
class Answer:
    """One request's greedy tokens, the logits of its first one, its time to first token
    and where its prefix came from (``prefill``; ``cpu`` or ``nvme`` with a cached
    prefix of ``cached_tokens``; ``recomputed``: the load failed)."""

    tokens: list[int]
    first_logits: torch.Tensor
    ttft_s: float
    source: str
    cached_tokens: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrefixCacheServer:
    """Answers requests with ``model``, its prefix KV kept by ``engine`` through
    ``paged``'s device blocks (``engine`` was made over ``paged.kv_caches``)."""

    def __init__(
        self, model: LlamaForCausalLM, paged: PagedKV, engine: TieringEngine, namespace: str
    ) -> None:
        self.model, self.paged, self.engine, self.namespace = model, paged, engine, namespace
        self.device = paged.layer(0).device

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """The hashes of the full blocks of ``tokens``."""
        return block_hashes(tokens, self.paged.block_tokens, namespace=self.namespace)

    async def generate(
        self, tokens: Sequence[int], new_tokens: int, mode: Mode, *, store: bool = True
    ) -> Answer:
        """``new_tokens`` greedy tokens after ``tokens``: with ``mode`` ``"prefill"`` from
        scratch, else reusing the longest cached prefix (leaving one token to compute),
        loaded ``"whole"`` or ``"layers"`` by layer. With ``store``, the prompt's full
        blocks the engine lacks are stored afterwards (not timed)."""
        engine, paged = self.engine, self.paged
        started = perf_counter()
        hashes = self.hashes(tokens[:-1])
        hit = engine.lookup(hashes) if mode != "prefill" else 0
        source, ids, job, progress = "prefill", [], None, None
        if hit:
            source = self._source(hashes[:hit])
            ids = paged.take(hit)
            progress = LayerProgress(engine.num_layers) if mode == "layers" else None
            job = engine.load(hashes[:hit], ids, progress=progress)
            if progress is None and not (await job).success:
                paged.give_back(ids)
                ids, source = [], "recomputed"
        cached = len(ids) * paged.block_tokens
        try:
            cache = paged_cache(paged, ids, progress)
            first, logits, cache = await asyncio.to_thread(
                self._first_token, tokens[cached:], cache
            )
        except TransferError:  # a layer never landed: recompute from scratch
            cached, source = 0, "recomputed"
            first, logits, cache = await asyncio.to_thread(self._first_token, tokens, None)
        finally:
            if job is not None:
                await job  # the device blocks are the load's until it ends
        ttft = perf_counter() - started
        rest = await asyncio.to_thread(self._decode, first, cache, new_tokens - 1)
        if ids:
            paged.give_back(ids)
        if store:
            await self._store(hashes, cache)
        return Answer([first, *rest], logits, ttft, source, cached)

    def _source(self, hashes: list[bytes]) -> str:
        """``"cpu"`` if the CPU tier holds every block, else ``"nvme"``."""
        return "cpu" if all(h in self.engine.manager for h in hashes) else "nvme"

    @torch.inference_mode()
    def _first_token(
        self, tokens: Sequence[int], cache: DynamicCache | None
    ) -> tuple[int, torch.Tensor, DynamicCache]:
        ids = torch.tensor([list(tokens)], device=self.device)
        cache = DynamicCache() if cache is None else cache
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{_CACHE_KEYWORD: cache})
        logits = out.logits[0, -1].float()
        first = int(logits.argmax())  # waits for the device: the first token exists now
        return first, logits.cpu(), cache

    @torch.inference_mode()
    def _decode(self, token: int, cache: DynamicCache, steps: int) -> list[int]:
        out: list[int] = []
        for _ in range(steps):
            ids = torch.tensor([[token]], device=self.device)
            result = self.model(input_ids=ids, use_cache=True, **{_CACHE_KEYWORD: cache})
            token = int(result.logits[0, -1].argmax())
            out.append(token)
        return out

    async def _store(self, hashes: list[bytes], cache: DynamicCache) -> None:
        have = self.engine.lookup(hashes)
        if have == len(hashes):
            return
        ids = self.paged.take(len(hashes) - have)
        try:
            await asyncio.to_thread(self._write, cache, have, ids)
            job = self.engine.store(hashes[have:], ids)
            result = await job
            if not result.success:
                print(f"store failed: {result.error}", file=sys.stderr)
            await job.cascaded
        finally:
            self.paged.give_back(ids)

    @torch.inference_mode()
    def _write(self, cache: DynamicCache, first_block: int, ids: list[int]) -> None:
        self.paged.write(cache, first_block, ids)
        _sync(self.device)  # the store copies on its own stream: the blocks must be there


def engine_for(paged: PagedKV, cpu_blocks: int, nvme: Path | None, identity: str) -> TieringEngine:
    """An engine over ``paged``'s device blocks: ``cpu_blocks`` CPU slots, and an NVMe
    tier under ``nvme`` if given (write-through: a stored prefix goes down at once)."""
    tiers = []
    if nvme is not None:
        block_bytes = sum(t[0].numel() * t.element_size() for t in _tensors(paged.kv_caches))
        capacity = (64 << 20) + 2 * cpu_blocks * block_bytes
        tiers.append(
            {"type": "nvme", "root": str(nvme), "capacity_bytes": capacity, "min_free_bytes": 0}
        )
    return TieringEngine(
        paged.kv_caches,
        cpu_blocks,
        secondary_tiers=tiers,
        block_size=paged.block_tokens,
        cache_identity=identity,
    )


def _tensors(kv: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [kv] if isinstance(kv, torch.Tensor) else kv


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements the module docstring describes; returns the JSON figures."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.shape == "8b" else torch.float32
    model = build_model(args.shape, device, dtype)
    bs, longest = args.block_tokens, max(args.prefix_tokens)
    prefix_blocks = -(-longest // bs)
    paged = PagedKV(model.config, 2 * prefix_blocks + 2, bs, args.layout, device, model.dtype)
    identity = f"hf-llama-{args.shape}-random-seed0"
    cpu_blocks = sum(-(-n // bs) for n in args.prefix_tokens) + 2
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    figures: dict[str, Any] = {"shape": args.shape, "layout": args.layout, "device": str(device)}
    same = True
    engine = engine_for(paged, cpu_blocks, args.nvme, identity)
    await engine.start()
    try:
        server = PrefixCacheServer(model, paged, engine, engine.namespace)
        warm = torch.randint(0, vocab, (2 * bs,), generator=gen).tolist()
        # Kernels, allocator and both load paths warm: every timed answer is a steady one.
        await server.generate(warm, 1, "prefill")
        for mode in ("whole", "layers"):
            await _measure(server, warm, 1, mode, "cpu", {})
        for n in args.prefix_tokens:
            prefix = torch.randint(0, vocab, (n,), generator=gen).tolist()

            def prompt(prefix: list[int] = prefix) -> list[int]:
                suffix = torch.randint(0, vocab, (args.suffix_tokens,), generator=gen)
                return prefix + suffix.tolist()

            first = await server.generate(prompt(), args.new_tokens, "prefill")  # stores
            times: dict[str, list[float]] = {"prefill": [first.ttft_s]}
            for _ in range(args.repeats):
                for mode in ("whole", "layers"):
                    if args.nvme is not None:  # a restart: the CPU tier starts empty
                        engine = await restart_engine(
                            engine, paged, cpu_blocks, args.nvme, identity
                        )
                        server.engine = engine
                        same &= await _measure(
                            server, prompt(), args.new_tokens, mode, "nvme", times
                        )
                    same &= await _measure(server, prompt(), args.new_tokens, mode, "cpu", times)
            for name, values in sorted(times.items()):
                ms = 1000 * statistics.median(values)
                figures[f"ttft_{name}_{n}tok_ms"] = round(ms, 2)
                print(
                    f"prefix {n:>6} tokens  {name:<14} ttft {ms:9.2f} ms  (median of {len(values)})"
                )
    finally:
        await engine.aclose()
    if args.nvme is not None:
        figures["nvme_o_direct"] = engine.tiers[0].o_direct
    figures["same_greedy_tokens"] = same
    return figures


async def _measure(
    server: PrefixCacheServer,
    request: list[int],
    new_tokens: int,
    mode: Mode,
    tier: str,
    times: dict[str, list[float]],
) -> bool:
    """Answer ``request`` loading its prefix ``mode`` (expected from ``tier``) and by a
    prefill; record both times to first token; True if their greedy tokens agree."""
    answer = await server.generate(request, new_tokens, mode, store=False)
    reference = await server.generate(request, new_tokens, "prefill", store=False)
    times.setdefault("prefill", []).append(reference.ttft_s)
    if answer.source != tier:  # timed under where it came from, never mislabelled
        print(f"a {mode} load expected from {tier} came from {answer.source}", file=sys.stderr)
    times.setdefault(f"{answer.source}_{mode}", []).append(answer.ttft_s)
    ok = answer.tokens == reference.tokens
    if not ok:
        print(f"MISMATCH ({tier}, {mode}): {answer.tokens} != {reference.tokens}", file=sys.stderr)
    return ok


async def restart_engine(
    engine: TieringEngine, paged: PagedKV, cpu_blocks: int, nvme: Path, identity: str
) -> TieringEngine:
    """Close ``engine`` and open its successor over the same NVMe tier: an empty CPU
    tier, every stored block still on disk (and not in the page cache, where the tier
    runs without O_DIRECT)."""
    await engine.aclose()
    await asyncio.to_thread(drop_page_cache, list(files_under(str(nvme))))
    engine = engine_for(paged, cpu_blocks, nvme, identity)
    await engine.start()
    return engine


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints"
        ) from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: each count must be at least 2")
    return counts


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked command line (a bad value exits 2 naming the option)."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="tiny", help="the Llama's shape (8b: bf16)"
    )
    parser.add_argument(
        "--layout",
        choices=("per-layer", "one-tensor"),
        default="per-layer",
        help="the paged KV cache: a tensor per layer, or one tensor",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=_token_counts,
        default="64",
        help="the shared prefixes' lengths in tokens, comma-separated (one run each)",
    )
    parser.add_argument(
        "--suffix-tokens", type=_positive, default=8, help="tokens after the prefix"
    )
    parser.add_argument("--new-tokens", type=_positive, default=4, help="greedy tokens per answer")
    parser.add_argument("--block-tokens", type=_positive, default=16, help="tokens per block")
    parser.add_argument(
        "--repeats", type=_positive, default=1, help="cached answers per tier and load kind"
    )
    parser.add_argument("--nvme", type=Path, metavar="DIR", help="an NVMe tier under DIR")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the model runs (default: cuda if any)"
    )
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: 'cuda' requested but torch sees no CUDA device")
    if args.nvme is not None:
        ensure_directory(parser, "--nvme", str(args.nvme))
    return args


def main() -> int:
    args = parse_args()
    figures = uvloop.run(run(args))
    print(json.dumps(figures))
    return 0 if figures["same_greedy_tokens"] else 1


if __name__ == "__main__":
    run_main(main)
