"""A fleet replay (:func:`replay_fleet`): engines behind a :class:`Router` (sans-I/O;
docs/fleet.md compares the rules), maybe sharing a remote tier, each a ``ReplayNode``."""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, get_args

import torch

from tiering.config import ReplayConfig
from tiering.core.scheduler_api import OffloadingEvent
from tiering.engine import TieringEngine
from tiering.errors import InvalidArgumentError, TieringError
from tiering.lab.replay import ReplayNode, ReplaySummary, combined, device_blocks_for, summed
from tiering.lab.workloads import Request
from tiering.observe.events import DEFAULT_TOPIC, ZmqPublisher, decode_events, encode_events
from tiering.observe.statistics import uncount
from tiering.validation import positive_int

ROUTERS: tuple[str, ...] = get_args(ReplayConfig.model_fields["router"].annotation)
"""The routing rules :class:`Router` knows (``replay.router``'s choices)."""
TRANSPORTS: tuple[str, ...] = get_args(ReplayConfig.model_fields["transport"].annotation)
"""How a fleet replay carries KV events to the router (``replay.transport``'s choices)."""
SHARED_TIERS = frozenset({"redis"})
"""Tier types (so labels in the figures, media in KV events) every node of a fleet shares."""


class Router:
    """Picks each request's node by ``rule``, fed back what each node computed and
    published. Raises InvalidArgumentError for a bad rule or node count."""

    def __init__(self, rule: str, nodes: int) -> None:
        if rule not in ROUTERS:
            raise InvalidArgumentError(f"router must be one of {', '.join(ROUTERS)}, got {rule!r}")
        self.rule = rule
        self.nodes = positive_int("nodes", nodes)
        self.computed = [0] * self.nodes  # blocks each node computed (its load)
        # kv-aware: per node, how many of its own media hold each key
        self._held: list[Counter[bytes]] = [Counter() for _ in range(self.nodes)]
        self._next = 0

    def choose(self, keys: Sequence[bytes], down: Collection[int] = ()) -> int:
        """The node for a request with these block keys, never one of ``down``; raises
        InvalidArgumentError if every node is down."""
        up = [n for n in range(self.nodes) if n not in down]
        if not up:
            raise InvalidArgumentError("every node of the fleet is down")
        if self.rule == "round-robin":
            while self._next in down:
                self._next = (self._next + 1) % self.nodes
            node, self._next = self._next, (self._next + 1) % self.nodes
            return node
        if self.rule == "affinity":  # a down node's share moves to the next one up
            home = zlib.crc32(keys[0]) % self.nodes if keys else 0
            ring = [(home + step) % self.nodes for step in range(self.nodes)]
            return next(n for n in ring if n not in down)
        if self.rule == "least-loaded":
            return min(up, key=lambda n: (self.computed[n], n))
        return max(up, key=lambda n: (self._prefix(n, keys), -self.computed[n]))

    def forget(self, node: int) -> None:
        """``node`` restarted: whatever its events said it held is gone."""
        self._held[node].clear()

    def served(self, node: int, blocks: int, hits: int) -> None:
        """``node`` served a request of ``blocks`` blocks, ``hits`` of them loaded."""
        self.computed[node] += blocks - hits

    def observe(self, node: int, payload: bytes) -> None:
        """Events ``node`` published, in :mod:`tiering.observe.events`' wire format
        (InvalidArgumentError otherwise)."""
        held = self._held[node]
        for event in decode_events(payload):
            if event["medium"].lower() in SHARED_TIERS:
                continue
            if event["removed"]:
                uncount(held, event["block_hashes"])
            else:
                held.update(event["block_hashes"])

    def _prefix(self, node: int, keys: Sequence[bytes]) -> int:
        return sum(1 for _ in itertools.takewhile(self._held[node].__contains__, keys))


class _ZmqLink:
    """Events from the nodes to the router over ZeroMQ, a loopback publisher per node, each
    batch waited for up to ``wait_s`` (else counted in ``lost``)."""

    def __init__(self, router: Router, wait_s: float = 2.0) -> None:
        import zmq
        import zmq.asyncio

        self.router = router
        self.wait_s = wait_s
        self.lost = 0
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC)
        self._publishers: list[ZmqPublisher] = []

    async def open(self, nodes: int) -> None:
        """Bind and connect a publisher per node; wait until each is heard (a SUB socket
        misses what comes before its subscription reaches the publisher)."""
        for node in range(nodes):
            publisher = ZmqPublisher("tcp://127.0.0.1:*", node=str(node))
            self._publishers.append(publisher)
            self._sub.connect(publisher.endpoint)
        for node in range(nodes):
            deadline = time.monotonic() + 10 * self.wait_s
            while not await self._heard(node, [_PROBE], self.wait_s / 20):
                if time.monotonic() > deadline:
                    raise TieringError(f"the ZeroMQ link to node {node} did not come up")

    async def send(self, node: int, events: Sequence[OffloadingEvent]) -> None:
        if not await self._heard(node, events, self.wait_s):
            self.lost += 1

    async def _heard(self, node: int, events: Sequence[OffloadingEvent], wait_s: float) -> bool:
        """Publish ``events`` from ``node``, feeding the router what arrives: True once this
        batch has, False after ``wait_s``."""
        publisher = self._publishers[node]
        expected = publisher.sequence
        publisher.publish(events)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                _, sequence, payload = await asyncio.wait_for(self._sub.recv_multipart(), left)
            except TimeoutError:
                return False
            decoded = decode_events(payload)
            sender = int(decoded[0]["node"]) if decoded and decoded[0]["node"] else None
            if sender is None:
                continue
            self.router.observe(sender, payload)
            if sender == node and int.from_bytes(sequence, "big") == expected:
                return True
        return False

    def close(self) -> None:
        for publisher in self._publishers:
            publisher.close()
        self._sub.close(linger=0)
        self._context.term()


_PROBE = OffloadingEvent([], 0, "PROBE", False)  # an empty batch: tells the router nothing


@dataclass(frozen=True, slots=True)
class NodeOutage:
    """Node ``node`` crashes before request ``at`` (from 0; its jobs fail, its CPU tier is
    lost) and restarts ``requests`` requests later, a fresh engine on the same tiers."""

    node: int
    at: int
    requests: int


@dataclass
class FleetSummary:
    """What a fleet replay did: per node summaries, the router's load, and the hit ratio
    over time (one point per ``window`` requests)."""

    router: str
    nodes: list[ReplaySummary] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    window: int = 1
    timeline: list[tuple[int, int]] = field(default_factory=list)  # (hit, requested) blocks
    restarts: int = 0
    lost_event_batches: int = 0
    footprint_blocks: int = 0

    @property
    def blocks(self) -> int:
        return sum(n.blocks for n in self.nodes)

    @property
    def hit_ratio(self) -> float:
        return sum(n.hit_blocks for n in self.nodes) / self.blocks if self.blocks else 0.0

    def _shared_counters(self, label: str) -> dict[str, int]:
        """A shared tier's counters summed over its clients, but for the server's own."""
        counters = summed(n.tier_counters.get(label, {}) for n in self.nodes)
        if "server_keys" in counters:
            counters["server_keys"] = max(
                n.tier_counters.get(label, {}).get("server_keys", 0) for n in self.nodes
            )
        return counters

    def to_json(self) -> dict[str, Any]:
        """The summary as plain JSON values: the nodes' figures added up, then the fleet's."""
        whole = combined(self.nodes, self.seconds).to_json()
        return {name: whole[name] for name in _COMBINED_FIELDS} | {
            "router": self.router,
            "nodes": len(self.nodes),
            "hit_ratio_by_source": whole["hit_ratio_by_tier"],
            "hit_ratio_by_node": [round(n.hit_ratio, 4) for n in self.nodes],
            "requests_by_node": list(self.routed),
            "restarts": self.restarts,
            "lost_event_batches": self.lost_event_batches,
            "shared_tier_counters": {
                label: self._shared_counters(label)
                for label in sorted({k for n in self.nodes for k in n.tier_counters})
                if label in SHARED_TIERS
            },
            "footprint_blocks": self.footprint_blocks,
            "own_capacity_blocks": sum(
                blocks
                for n in self.nodes
                for label, blocks in n.capacity_blocks.items()
                if label not in SHARED_TIERS
            ),
            "timeline": [
                {
                    "requests": min((i + 1) * self.window, whole["requests"]),
                    "hit_ratio": round(hit / blocks, 4) if blocks else 0.0,
                }
                for i, (hit, blocks) in enumerate(self.timeline)
            ],
        }


# The figures of :meth:`FleetSummary.to_json` that are its nodes' added up.
_COMBINED_FIELDS = (
    "requests", "blocks", "hit_ratio", "mismatches", "failed_loads", "failed_stores",
    "evicted_loads", "failed_blocks_by_tier", "refused_blocks_by_tier", "failure_causes",
    "seconds", "requests_per_s", "bytes_by_path", "job_latency_ms",
)  # fmt: skip


async def replay_fleet(
    requests: Sequence[Request],
    make_engine: Callable[[int, torch.Tensor], TieringEngine],
    *,
    nodes: int,
    router: str,
    device_blocks: int | None = None,
    block_bytes: int,
    full_blocks_only: bool = False,
    outages: Sequence[NodeOutage] = (),
    window: int | None = None,
    transport: str = "direct",
    on_request: Callable[[int, FleetSummary], None] | None = None,
) -> FleetSummary:
    """Replay ``requests`` through ``nodes`` engines behind a :class:`Router`, as
    :func:`~tiering.lab.replay.replay` with ``settle``. ``outages`` stop and restart nodes;
    ``window`` (default: a twentieth of the requests) is the timeline's step; ``transport``
    carries KV events ``"direct"`` or over ``"zmq"``. Raises InvalidArgumentError (nothing
    ran) for a bad argument, or ``kv-aware`` without engines with ``enable_events``."""
    nodes = positive_int("nodes", nodes)
    routing = Router(router, nodes)
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(
            f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
        )
    keyed = [r.keys(full_blocks_only=full_blocks_only) for r in requests]
    device_blocks = device_blocks_for(keyed, device_blocks)
    fleet = [
        ReplayNode(lambda kv, n=n: make_engine(n, kv), device_blocks, block_bytes, settle=True)
        for n in range(nodes)
    ]
    if router == "kv-aware" and not all(node.engine.enable_events for node in fleet):
        raise InvalidArgumentError("router 'kv-aware' needs engines with enable_events=True")
    for outage in outages:
        if not 0 <= outage.node < nodes:
            raise InvalidArgumentError(f"outages: no node {outage.node} in {nodes}")
    step = positive_int("window", window if window is not None else max(1, len(keyed) // 20))
    summary = FleetSummary(router, [node.summary for node in fleet], [0] * nodes, window=step)
    summary.footprint_blocks = len({k for keys in keyed for k in keys})
    stops = {o.at: o for o in outages}
    starts = {o.at + o.requests: o for o in outages}
    down: set[int] = set()
    link = _ZmqLink(routing) if transport == "zmq" else None  # None: in-process
    async with AsyncExitStack() as engines:
        if link is not None:
            engines.callback(link.close)
            await link.open(nodes)
        for node in fleet:
            await engines.enter_async_context(node.engine)
        start = time.perf_counter()
        for number, keys in enumerate(keyed):
            if number in starts and starts[number].node in down:
                n = starts[number].node
                fleet[n] = fleet[n].restarted()
                await engines.enter_async_context(fleet[n].engine)
                down.discard(n)
                summary.restarts += 1
            if number in stops:
                n = stops[number].node
                fleet[n].engine.close()  # a crash: in-flight work fails, the CPU tier is gone
                routing.forget(n)
                down.add(n)
            n = routing.choose(keys, down)
            hits = await fleet[n].request(keys)
            routing.served(n, len(keys), hits)
            summary.routed[n] += 1
            if number // step == len(summary.timeline):
                summary.timeline.append((0, 0))
            hit, blocks = summary.timeline[-1]
            summary.timeline[-1] = (hit + hits, blocks + len(keys))
            if events := fleet[n].engine.take_events():
                if link is not None:
                    await link.send(n, events)
                else:  # in-process, in the wire format all the same
                    routing.observe(n, encode_events(events, node=str(n)))
            if on_request is not None:
                on_request(number + 1, summary)
        summary.seconds = time.perf_counter() - start
        summary.lost_event_batches = link.lost if link is not None else 0
    for node in fleet:
        node.closed()
    return summary
