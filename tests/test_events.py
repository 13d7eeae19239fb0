"""KV events: the wire format, tier evictions as removal events, and the publishers."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiering import OffloadingEvent, TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.observe.events import (
    EVENT_FORMAT_VERSION,
    CallbackPublisher,
    ZmqPublisher,
    decode_events,
    encode_events,
    run_publisher,
)
from tiering.observe.metrics import register_engine_metrics


def key(i: int) -> bytes:
    return b"events:" + i.to_bytes(4, "big")


def test_the_format_is_pinned_byte_for_byte() -> None:
    events = [
        OffloadingEvent([b"\x01\x02", b"\xff"], 16, "CPU", False),
        OffloadingEvent([b"\xab"], 16, "NVME", True),
    ]
    assert encode_events(events, node="gpu-7", tenant="team-a") == (
        b'{"v":1,"medium":"CPU","removed":false,"block_size":16,'
        b'"block_hashes":["0102","ff"],"node":"gpu-7","tenant":"team-a"}\n'
        b'{"v":1,"medium":"NVME","removed":true,"block_size":16,'
        b'"block_hashes":["ab"],"node":"gpu-7","tenant":"team-a"}\n'
    )
    assert encode_events(events[1:]) == (
        b'{"v":1,"medium":"NVME","removed":true,"block_size":16,"block_hashes":["ab"]}\n'
    )
    assert encode_events([]) == b""


def test_decode_inverts_encode() -> None:
    events = [
        OffloadingEvent([key(i) for i in range(5)], 32, "MEMORY", False),
        OffloadingEvent([], 32, "CPU", True),
        OffloadingEvent([bytes(range(256))], 1, "REDIS", True),
    ]
    for labels in ({}, {"node": "n"}, {"tenant": "ünïcode"}, {"node": "a", "tenant": "b"}):
        decoded = decode_events(encode_events(events, **labels))
        assert decoded == [
            {
                "v": EVENT_FORMAT_VERSION,
                "medium": e.medium,
                "removed": e.removed,
                "block_size": e.block_size,
                "block_hashes": e.block_hashes,
                "node": labels.get("node"),
                "tenant": labels.get("tenant"),
            }
            for e in events
        ]


def test_decode_ignores_unknown_fields_and_blank_lines() -> None:
    line = json.dumps(
        {"v": 1, "medium": "CPU", "removed": False, "block_size": 4, "block_hashes": ["00"]}
        | {"future": [1, 2]}
    )
    assert decode_events(f"\n{line}\n\n".encode())[0]["block_hashes"] == [b"\x00"]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"v":1,"medium":"CPU","removed":false,"block_size":4}', "missing block_hashes"),
        (b'{"v":2,"medium":"CPU","removed":false,"block_size":4,"block_hashes":[]}', "version"),
        (b'{"v":1,"medium":"CPU","removed":0,"block_size":4,"block_hashes":[]}', "bool"),
        (b'{"v":1,"medium":"CPU","removed":false,"block_size":4,"block_hashes":["xyz"]}', "hex"),
        (
            b'{"v":1,"medium":"CPU","removed":false,"block_size":4,"block_hashes":[],"node":3}',
            "node",
        ),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_decode_refuses_what_is_not_the_format(line: bytes, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        decode_events(line)


def test_encode_refuses_bad_labels_and_events() -> None:
    with pytest.raises(InvalidArgumentError, match="node"):
        encode_events([], node=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="event"):
        encode_events([OffloadingEvent(["00"], 16, "CPU", False)])  # type: ignore[list-item]


def replay(events: list[OffloadingEvent], medium: str) -> set[bytes]:
    """What a router that applies ``medium``'s events in order believes it holds."""
    held: set[bytes] = set()
    for event in events:
        if event.medium == medium:
            if event.removed:
                held.difference_update(event.block_hashes)
            else:
                held.update(event.block_hashes)
    return held


async def test_a_tier_eviction_comes_out_of_take_events_as_a_removal() -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "memory", "max_blocks": 2}]
    async with TieringEngine(kv, 8, secondary_tiers=tiers, enable_events=True) as engine:
        registry = CollectorRegistry()
        register_engine_metrics(engine, registry=registry)
        for i in range(3):  # one job each: the third evicts key(0) from the memory tier
            job = engine.store([key(i)], [i])
            assert (await job).success and await job.cascaded
        events = engine.take_events()
        text = generate_latest(registry).decode()
    memory = [(e.block_hashes, e.removed) for e in events if e.medium == "MEMORY"]
    assert memory == [([key(0)], False), ([key(1)], False), ([key(0)], True), ([key(2)], False)]
    assert all(e.block_size == 16 for e in events)
    assert replay(events, "CPU") == {key(0), key(1), key(2)}  # 8 CPU slots: nothing evicted
    evicted = {
        s.labels["tier"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kv_tiering_tier_evicted_blocks_total"
    }
    assert evicted == {"cpu": 0, "memory": 1}


async def test_replaying_the_events_gives_what_each_tier_holds() -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "memory", "max_blocks": 3}]
    events: list[OffloadingEvent] = []
    async with TieringEngine(kv, 4, secondary_tiers=tiers, enable_events=True) as engine:
        jobs = [engine.store([key(i), key(i + 1)], [i % 8, 8 + i % 8]) for i in range(0, 12, 2)]
        for job in jobs:
            assert (await job).success
            await job.cascaded
        for i in (9, 10):
            if engine.lookup([key(i)]):
                assert (await engine.load([key(i)], [15])).success
        events += engine.take_events()
        tier = engine.tiers[0]
        in_memory = {key(i) for i in range(12) if tier.lookup(key(i)) is True}
        in_cpu = {key(i) for i in range(12) if engine.manager.is_ready(key(i))}
    assert any(e.removed and e.medium == "MEMORY" for e in events)
    assert replay(events, "MEMORY") == in_memory
    assert replay(events, "CPU") == in_cpu


async def test_events_stay_off_without_enable_events() -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "memory", "max_blocks": 1}]
    async with TieringEngine(kv, 8, secondary_tiers=tiers) as engine:
        for i in range(3):
            job = engine.store([key(i)], [i])
            assert (await job).success and await job.cascaded
        assert engine.take_events() == []
        assert engine.tiers[0].take_removed() == []  # removals not even kept


async def test_run_publisher_hands_every_event_to_the_callback() -> None:
    kv = torch.randn(16, 4, 64).half()
    payloads: list[bytes] = []
    publisher = CallbackPublisher(payloads.append, node="node-1")
    tiers = [{"type": "memory", "max_blocks": 1}]
    async with TieringEngine(kv, 8, secondary_tiers=tiers, enable_events=True) as engine:
        task = asyncio.create_task(run_publisher(engine, publisher, interval=0.001))
        for i in range(2):
            job = engine.store([key(i)], [i])
            assert (await job).success and await job.cascaded
        task.cancel()  # the last drain happens on the way out
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.take_events() == []
    decoded = [record for payload in payloads for record in decode_events(payload)]
    assert all(record["node"] == "node-1" and record["tenant"] is None for record in decoded)
    by_medium = {
        medium: [(r["block_hashes"], r["removed"]) for r in decoded if r["medium"] == medium]
        for medium in ("CPU", "MEMORY")
    }
    assert by_medium == {
        "CPU": [([key(0)], False), ([key(1)], False)],
        "MEMORY": [([key(0)], False), ([key(0)], True), ([key(1)], False)],
    }


async def test_a_failing_publisher_does_not_stop_run_publisher() -> None:
    calls: list[int] = []

    def fail(payload: bytes) -> None:
        calls.append(len(payload))
        raise ConnectionError("router gone")

    class Source:
        def __init__(self) -> None:
            self.batches = [[OffloadingEvent([key(i)], 16, "CPU", False)] for i in range(3)]

        def take_events(self) -> list[OffloadingEvent]:
            return self.batches.pop() if self.batches else []

    source = Source()
    task = asyncio.create_task(run_publisher(source, CallbackPublisher(fail), interval=0.001))
    for _ in range(10_000):
        if not source.batches:
            break
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(calls) == 3  # every batch was tried, the failures only logged


def test_the_zeromq_publisher_delivers_to_a_real_subscriber() -> None:
    events = [
        OffloadingEvent([key(1), key(2)], 16, "NVME", False),
        OffloadingEvent([key(1)], 16, "NVME", True),
    ]
    with ZmqPublisher("tcp://127.0.0.1:*", topic=b"kv", tenant="t1") as publisher:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        subscriber = zmq.Context.instance().socket(zmq.SUB)
        try:
            subscriber.setsockopt(zmq.LINGER, 0)
            subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
            subscriber.connect(publisher.endpoint)
            # A subscriber misses what is sent before its subscription reaches the
            # publisher (ZeroMQ's "slow joiner"): publish until one batch arrives.
            frames = None
            for _ in range(300):
                assert publisher.publish(events) == 2
                if subscriber.poll(100):
                    frames = subscriber.recv_multipart()
                    break
            assert frames is not None, "no batch reached the subscriber"
        finally:
            subscriber.close(linger=0)
    topic, sequence, payload = frames
    assert topic == b"kv"
    assert 0 <= int.from_bytes(sequence, "big") < publisher.sequence
    assert payload == encode_events(events, tenant="t1")
    assert decode_events(payload)[1]["removed"] is True


def test_a_closed_zeromq_publisher_refuses_to_publish() -> None:
    publisher = ZmqPublisher("tcp://127.0.0.1:*")
    assert publisher.publish([]) == 0  # nothing to send, nothing sent
    publisher.close()
    publisher.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        publisher.publish([OffloadingEvent([key(1)], 16, "CPU", False)])


def test_publishers_refuse_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="callback"):
        CallbackPublisher("not callable")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="tenant"):
        CallbackPublisher(print, tenant=b"t")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="topic"):
        ZmqPublisher("tcp://127.0.0.1:*", topic="kv")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="send_hwm"):
        ZmqPublisher("tcp://127.0.0.1:*", send_hwm=0)
