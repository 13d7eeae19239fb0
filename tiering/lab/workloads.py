"""Serving workloads to replay: :class:`Request` lists, by arrival, naming blocks by
prefix-chained ids as the Mooncake traces do (equal ids mean equal prefixes): read from such
a trace (:func:`read_mooncake`), or seeded chat traffic (:func:`synthetic_requests`)."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from tiering.errors import TraceError
from tiering.validation import positive_int

TOKENS_PER_BLOCK = 512
"""Tokens per block in the Mooncake traces (and in :func:`synthetic_requests`)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its arrival (seconds from the start), its prompt's blocks (the last
    one partial unless ``input_tokens`` is a multiple of :data:`TOKENS_PER_BLOCK`), the
    prompt's and answer's lengths, and its conversation where known."""

    arrival_s: float
    block_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    session: int | None = None

    @property
    def full_blocks(self) -> int:
        """How many of ``block_ids`` are full blocks (a partial last one is not)."""
        return min(len(self.block_ids), self.input_tokens // TOKENS_PER_BLOCK)

    def keys(self, *, full_blocks_only: bool = False) -> list[bytes]:
        """The blocks' cache keys, each id as 8 big-endian bytes; ``full_blocks_only``
        leaves out a partial last block (vLLM never offloads one)."""
        ids = self.block_ids[: self.full_blocks] if full_blocks_only else self.block_ids
        return [i.to_bytes(8, "big") for i in ids]


def read_mooncake(path: str | Path, *, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of a Mooncake-format JSON-lines trace (docs/replay.md),
    in file order. Raises TraceError, naming file and line, if the file cannot be read,
    holds no request or has a bad line; InvalidArgumentError for a bad limit."""
    if limit is not None:
        limit = positive_int("limit", limit)
    path = Path(path)
    requests: list[Request] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    requests.append(_parse_line(line))
                except ValueError as exc:
                    raise TraceError(f"{path}:{number}: not a Mooncake trace line: {exc}") from None
                if limit is not None and len(requests) >= limit:
                    break
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace {str(path)!r}: {exc}") from None
    if not requests:
        raise TraceError(f"the trace {str(path)!r} holds no requests")
    return requests


class _TraceLine(BaseModel):
    """The fields of a trace line that a replay reads (others are ignored)."""

    model_config = ConfigDict(strict=True)
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]  # milliseconds
    input_length: Annotated[int, Field(ge=0)]
    output_length: Annotated[int, Field(ge=0)]
    hash_ids: list[Annotated[int, Field(ge=0, le=(1 << 64) - 1)]]


def _parse_line(line: str) -> Request:
    """One trace line as a request; ValueError says why it is not one."""
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:  # its own "line 1" would mix with the file's line
        raise ValueError(f"not JSON: {exc.msg} at column {exc.pos + 1}") from None
    try:
        fields = _TraceLine.model_validate(record)
    except ValidationError as exc:
        raise ValueError("; ".join(map(_problem, exc.errors()))) from None
    ids = tuple(fields.hash_ids)
    return Request(fields.timestamp / 1000.0, ids, fields.input_length, fields.output_length)


def _problem(error: ErrorDetails) -> str:
    """One of pydantic's errors as ``field[index]: reason, got value``."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    if error["type"] == "missing":
        return f"{path[1:]}: missing"
    return f"{path[1:] or 'the line'}: {error['msg']}, got {error['input']!r:.60}"


def synthetic_requests(
    *,
    sessions: int = 200,
    turns_per_session: int = 4,
    system_prompts: int = 8,
    system_prompt_blocks: int = 6,
    user_blocks_per_turn: int = 2,
    reply_blocks_per_turn: int = 1,
    rate_per_s: float = 20.0,
    think_time_s: float = 20.0,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn chat traffic, ordered by arrival; the same arguments give the same list.
    Sessions start as a Poisson process of ``rate_per_s``, each on one of
    ``system_prompts`` system prompts (Zipf-like popularity). A turn sends the system
    prompt, the conversation so far, ``user_blocks_per_turn`` new blocks and a partial
    block; the next follows an exponential think time of mean ``think_time_s``. Raises
    InvalidArgumentError (the ConfigError of ``[synthetic]``) naming a bad argument."""
    arguments = dict(locals())  # exactly the parameters: this is the first statement
    from tiering.config import SyntheticConfig  # the one check of these arguments

    SyntheticConfig(**arguments)
    rng = random.Random(seed)
    counter = itertools.count()

    def new_ids(count: int) -> list[int]:
        return list(itertools.islice(counter, count))

    prompts = [new_ids(system_prompt_blocks) for _ in range(system_prompts)]
    popularity = [1.0 / (rank + 1) for rank in range(system_prompts)]
    requests: list[Request] = []
    start = 0.0
    for session in range(sessions):
        start += rng.expovariate(rate_per_s)
        history = list(rng.choices(prompts, weights=popularity)[0])
        arrival = start
        for _turn in range(turns_per_session):
            user = new_ids(user_blocks_per_turn)
            partial_tokens = rng.randrange(1, TOKENS_PER_BLOCK)
            ids = (*history, *user, *new_ids(1))
            tokens = (len(history) + len(user)) * TOKENS_PER_BLOCK + partial_tokens
            output = reply_blocks_per_turn * TOKENS_PER_BLOCK + rng.randrange(0, TOKENS_PER_BLOCK)
            requests.append(Request(arrival, ids, tokens, output, session))
            history += user + new_ids(reply_blocks_per_turn)
            arrival += rng.expovariate(1.0 / think_time_s)
    requests.sort(key=lambda r: r.arrival_s)
    return requests
