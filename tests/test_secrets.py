"""No secret anywhere visible: a password or an encryption key given to a tier never
shows in logs, errors, ``repr``, statistics, metrics or events, even when everything
fails (issue 14)."""

from __future__ import annotations

import asyncio
import base64
import logging
import urllib.request

import pytest
import torch

from tests._redis_helpers import local_redis_server
from tests._redis_servers import LocalRedisServer
from tiering import TieringEngine, TieringError
from tiering.observe.events import encode_events
from tiering.observe.metrics import serve_engine_metrics

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


async def test_an_nvme_encryption_key_never_shows_anywhere(
    tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    key = bytes(range(100, 132))
    spec = "1:" + base64.b64encode(key).decode()
    forms = [base64.b64encode(key).decode(), key.hex(), repr(key), key.decode("latin-1")]
    monkeypatch.setenv("KV_SECRET_KEYS", spec)
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "nvme", "root": str(tmp_path / "nvme"), "capacity_bytes": 1 << 24}]
    seen: list[str] = []
    for keyring in ("env:KV_SECRET_KEYS", spec, "2:" + base64.b64encode(bytes(32)).decode()):
        spec_tiers = [{**tiers[0], "encryption": keyring}]
        async with TieringEngine(kv, 2, secondary_tiers=spec_tiers, enable_events=True) as engine:
            job = engine.store([b"a", b"b"], [0, 1])
            await job
            await job.cascaded
            engine.store([b"c", b"d"], [2, 3])  # evicts a and b from the CPU tier
            await asyncio.sleep(0.05)
            if engine.lookup([b"a"]):  # the last keyring lacks key 1: a failed load
                seen.append(repr(await engine.load([b"a"], [4])))
            with serve_engine_metrics(engine, 0) as metrics:
                url = f"http://127.0.0.1:{metrics.port}/metrics"
                text = await asyncio.to_thread(_read, url)
            seen += [
                text.decode(),
                repr(engine),
                repr(engine.tiers[0]),
                repr(engine.tiers[0].statistics()),
                encode_events(engine.take_events()).decode(),
                repr(engine.get_finished()),
            ]
    short = base64.b64encode(key[:20]).decode()  # a bad spec names the option, not the key
    forms.append(short)
    with pytest.raises(TieringError, match="encryption: key 1 is 20 bytes") as refused:
        bad = [{**tiers[0], "encryption": f"1:{short}"}]
        async with TieringEngine(kv, 2, secondary_tiers=bad):
            pass
    seen += [str(refused.value), repr(refused.value), caplog.text]
    assert "key id 1, which the keyring lacks" in caplog.text  # the failure was reported
    leaks = [place for place in seen for form in forms if form in place]
    assert not leaks, leaks


def _read(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        return response.read()
