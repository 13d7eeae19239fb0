import asyncio
import time

import pytest

from tiering import InvalidArgumentError
from tiering.observe.loop_lag import LoopLagMonitor


async def test_a_blocking_call_on_the_loop_shows_up_as_lag() -> None:
    async with LoopLagMonitor() as lag:
        await asyncio.sleep(0.01)
        time.sleep(0.05)  # noqa: ASYNC251 -- holds the loop thread on purpose
        await asyncio.sleep(0.01)
    assert lag.max_ms >= 40


async def test_the_ticker_stops_when_the_block_ends() -> None:
    async with LoopLagMonitor() as lag:
        await asyncio.sleep(0.02)
    count = len(lag.samples)
    await asyncio.sleep(0.02)
    assert count > 0 and len(lag.samples) == count


def test_percentiles_of_no_samples_are_zero() -> None:
    assert LoopLagMonitor().p99_ms == 0.0


@pytest.mark.parametrize("interval", [0, -1, "1ms"])
def test_interval_must_be_positive(interval) -> None:
    with pytest.raises(InvalidArgumentError):
        LoopLagMonitor(interval)
