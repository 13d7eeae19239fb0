"""A real model through the engine (examples/hf_prefix_cache.py): a tiny random-weight
Llama (2 layers, float32) whose prefix KV goes through the engine's tiers and comes back
gives the continuation a prefill gives, loaded whole or layer by layer, in both KV
layouts, from the CPU tier and after a restart from NVMe; a damaged NVMe block means
recomputing, never a wrong token. It uses no API that transformers deprecates: a
deprecation warning is an error here, and a deprecation transformers logs fails the
test too."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests._engine_helpers import corrupt_block
from tests._scripts import run_script

pytest.importorskip("transformers")

# transformers warns (FutureWarning) before it removes an API, attributed to the caller
# of the deprecated call: torch's module call, for a model's forward.
DEPRECATIONS_ARE_ERRORS = ("-W", "error::FutureWarning", "-W", "error::DeprecationWarning")
pytestmark = pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 16
PREFIX_TOKENS = 3 * BLOCK_TOKENS
NEW_TOKENS = 4
CPU_BLOCKS = 16


def _example() -> ModuleType:
    name = "_example_hf_prefix_cache"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples/hf_prefix_cache.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules[name]


hf = _example()


class _Deprecations(logging.Handler):
    """The deprecations a logger reports (transformers logs some instead of warning:
    an output's old cache field, read)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "deprecat" in record.getMessage().lower():
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_deprecation_logged_by_transformers() -> Iterator[None]:
    deprecations = _Deprecations()
    logger = logging.getLogger("transformers")
    logger.addHandler(deprecations)
    try:
        yield
    finally:
        logger.removeHandler(deprecations)
    assert deprecations.messages == []


@pytest.fixture(scope="module")
def model():  # read-only: every test shares one
    return hf.build_model("tiny", torch.device("cpu"), torch.float32, seed=3)


@asynccontextmanager
async def serving(model, layout: str, nvme: Path | None = None) -> AsyncIterator:
    paged = hf.PagedKV(model.config, 12, BLOCK_TOKENS, layout, torch.device("cpu"), torch.float32)
    engine = hf.engine_for(paged, CPU_BLOCKS, nvme, "test-tiny")
    await engine.start()
    server = hf.PrefixCacheServer(model, paged, engine, engine.namespace)
    try:
        yield server
    finally:
        await server.engine.aclose()


def prompts(seed: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a prefix of PREFIX_TOKENS, with different suffixes."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (PREFIX_TOKENS,), generator=gen).tolist()
    return (
        prefix + torch.randint(0, vocab, (5,), generator=gen).tolist(),
        prefix + torch.randint(0, vocab, (7,), generator=gen).tolist(),
    )


async def assert_same_as_prefill(server, request: list[int], answer) -> None:
    reference = await server.generate(request, NEW_TOKENS, "prefill", store=False)
    assert reference.source == "prefill" and reference.cached_tokens == 0
    assert answer.tokens == reference.tokens
    torch.testing.assert_close(answer.first_logits, reference.first_logits, atol=1e-4, rtol=1e-4)


@asynccontextmanager
async def stored_on_nvme(model, layout: str, nvme: Path, seed: int) -> AsyncIterator:
    """A server whose first prompt's prefix was stored, then restarted: its CPU tier is
    empty and the blocks are on NVMe; yields ``(server, first prompt, second prompt)``."""
    first, second = prompts(seed, model.config.vocab_size)
    async with serving(model, layout, nvme) as server:
        await server.generate(first, NEW_TOKENS, "prefill")
        server.engine = await hf.restart_engine(
            server.engine, server.paged, CPU_BLOCKS, nvme, "test-tiny"
        )
        yield server, first, second


MODES = ["whole", "layers"]
LAYOUTS = ["per-layer", "one-tensor"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_prefix_cached_in_the_cpu_tier_continues_as_a_prefill_does(
    model, layout: str, mode: str
) -> None:
    first, second = prompts(1, model.config.vocab_size)
    async with serving(model, layout) as server:
        stored = await server.generate(first, NEW_TOKENS, "prefill")
        assert stored.source == "prefill"
        assert server.engine.lookup(server.hashes(first)) == PREFIX_TOKENS // BLOCK_TOKENS
        answer = await server.generate(second, NEW_TOKENS, mode, store=False)
        assert answer.source == "cpu" and answer.cached_tokens == PREFIX_TOKENS
        assert len(answer.tokens) == NEW_TOKENS
        await assert_same_as_prefill(server, second, answer)
        assert server.engine.statistics().counters["loaded_blocks"] == 3
        assert len(server.paged.free) == 12  # every device block handed back


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_prefix_that_went_down_to_nvme_and_came_back_continues_as_a_prefill_does(
    model, layout: str, mode: str, tmp_path: Path
) -> None:
    async with stored_on_nvme(model, layout, tmp_path, seed=2) as (server, _, second):
        answer = await server.generate(second, NEW_TOKENS, mode, store=False)
        assert answer.source == "nvme" and answer.cached_tokens == PREFIX_TOKENS
        assert server.engine.statistics().counters["promoted_blocks"] == 3
        await assert_same_as_prefill(server, second, answer)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_damaged_nvme_block_means_recomputing_never_a_wrong_token(
    model, layout: str, mode: str, tmp_path: Path
) -> None:
    async with stored_on_nvme(model, layout, tmp_path, seed=3) as (server, first, second):
        corrupt_block(tmp_path, server.hashes(first)[1])
        answer = await server.generate(second, NEW_TOKENS, mode, store=False)
        assert answer.source == "recomputed" and answer.cached_tokens == 0
        await assert_same_as_prefill(server, second, answer)
        assert server.engine.statistics().failures  # the damaged record was seen
        assert len(server.paged.free) == 12


def test_the_example_checks_every_answer_and_ends_with_one_json_line(tmp_path: Path) -> None:
    done = run_script(
        *DEPRECATIONS_ARE_ERRORS,
        "examples/hf_prefix_cache.py",
        *("--prefix-tokens", "32,20", "--nvme", str(tmp_path), "--device", "cpu"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "deprecat" not in done.stderr.lower()  # nor logged as transformers logs some
    assert "expected from" not in done.stderr  # every cached answer came from its tier
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["same_greedy_tokens"] is True
    for tokens in (32, 20):
        for name in ("prefill", "cpu_whole", "cpu_layers", "nvme_whole", "nvme_layers"):
            assert figures[f"ttft_{name}_{tokens}tok_ms"] > 0


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--prefix-tokens", "1"], "--prefix-tokens"), (["--repeats", "0"], "--repeats")],
)
def test_a_bad_argument_exits_2_naming_it(args: list[str], named: str) -> None:
    done = run_script("examples/hf_prefix_cache.py", *args)
    assert done.returncode == 2, done.stderr
    assert f"argument {named}:" in done.stderr.strip().splitlines()[-1]
    assert done.stdout == ""
