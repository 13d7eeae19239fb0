"""No secret anywhere visible: a password given to a tier never shows in logs, errors,
``repr``, statistics, metrics or events, even when everything fails (issue 14)."""

from __future__ import annotations

import asyncio
import logging
import urllib.request

import pytest
import torch

from backends.redis_server import LocalRedisServer
from tests._redis_helpers import local_redis_server
from tiering import TieringEngine, TieringError
from tiering.events import encode_events
from tiering.metrics import serve_engine_metrics

SECRET = "s3cr3t-pw-5f1d"


async def test_a_redis_password_never_shows_anywhere(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server: LocalRedisServer = local_redis_server(tmp_path, "--requirepass", SECRET)
    seen: list[str] = []
    try:
        good = server.url.replace("redis://", f"redis://:{SECRET}@")
        bad = server.url.replace("redis://", f"redis://:{SECRET}-wrong@")
        kv = torch.randn(16, 4, 64).half()
        with pytest.raises(TieringError) as refused:  # the wrong password: a clear error
            async with TieringEngine(kv, 4, secondary_tiers=[{"type": "redis", "url": bad}]):
                pass
        seen += [str(refused.value), repr(refused.value)]
        tiers = [{"type": "redis", "url": good, "timeout_s": 0.5, "breaker_failures": 1}]
        async with TieringEngine(kv, 4, secondary_tiers=tiers, enable_events=True) as engine:
            job = engine.store([b"a", b"b"], [0, 1])
            assert (await job).success and await job.cascaded
            server.kill()  # now every call fails: errors and logs of a dead server
            failed = engine.store([b"c"], [2])
            await failed
            await failed.cascaded
            await asyncio.sleep(0.05)
            with serve_engine_metrics(engine, 0) as metrics:
                url = f"http://127.0.0.1:{metrics.port}/metrics"
                text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())
            seen += [
                text.decode(),
                repr(engine),
                repr(engine.tiers[0]),
                repr(engine.statistics()),
                repr(engine.tiers[0].statistics()),
                encode_events(engine.take_events()).decode(),
                repr(engine.get_finished()),
            ]
    finally:
        server.stop()
    seen.append(caplog.text)
    leaks = [place for place in seen if SECRET in place]
    assert not leaks, leaks
    assert any("unreachable" in place for place in seen)  # the failures were reported
