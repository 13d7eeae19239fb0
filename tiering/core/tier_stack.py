"""The resources under an engine: the CPU tier's memory, the device gateway, the tiers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial

from tiering.core.job_core import CopyToDevice, CopyToHost, TierLoad, TierStore
from tiering.device.copier import DeviceCopier
from tiering.device.host_pool import HostPool
from tiering.device.kv_layout import KVCaches
from tiering.device.layer_progress import LayerProgress
from tiering.errors import TieringError
from tiering.tiers.client import TierClient, TierOutcome
from tiering.tiers.registry import TierSpec, make_tier
from tiering.tiers.tier_api import SecondaryTierManager


class TierStack:
    """Host pool, copier and one tier client per secondary tier of one engine (``tiers`` and
    ``clients`` follow ``specs``), allocated at :meth:`open`, closed in the one safe order:
    the tiers (they use host-pool slots), the copier (slots and device blocks), the pool.
    Tiers taking a ``namespace`` receive ``namespace`` unless their spec sets one."""

    def __init__(
        self,
        kv_caches: KVCaches,
        num_blocks: int,
        block_bytes: int,
        specs: Sequence[TierSpec],
        *,
        namespace: str,
        tier_timeout: float,
    ) -> None:
        self._kv_caches = kv_caches
        self._num_blocks = num_blocks
        self._block_bytes = block_bytes
        self._specs = list(specs)
        self._namespace = namespace
        self._tier_timeout = tier_timeout
        self.pool: HostPool | None = None
        self.copier: DeviceCopier | None = None
        self.tiers: list[SecondaryTierManager] = []
        self.clients: list[TierClient] = []

    async def open(self, *, report_removals: bool = False) -> None:
        """Allocate the pool, open the copier, build and start every tier (each reporting
        the keys it removes, with ``report_removals``). Raises TieringError if the pool or
        a tier cannot be made; whatever was opened stays for :meth:`close` to release."""
        n, size = self._num_blocks, self._block_bytes
        try:
            # Off the loop: page-locking a pool of many GiB takes seconds.
            self.pool = await asyncio.to_thread(HostPool, n, size)
        except (MemoryError, OSError) as exc:
            raise TieringError(
                f"cannot allocate the host pool for num_cpu_blocks={n} ({n * size} bytes): {exc!r}"
            ) from exc
        self.copier = DeviceCopier(self._kv_caches, self.pool)
        await self.copier.start()
        defaults = {"namespace": self._namespace}
        for spec in self._specs:
            tier = make_tier(spec, self.pool.view, size, defaults=defaults)
            client = TierClient(tier, timeout=self._tier_timeout)
            if report_removals:
                tier.report_removals()
            self.tiers.append(tier)
            self.clients.append(client)
            await client.start()

    def copy(
        self,
        effect: CopyToHost | CopyToDevice,
        on_end: Callable[[int, BaseException | None], None],
        progress: LayerProgress | None = None,
    ) -> None:
        """Start the copy ``effect`` asks for (marking ``progress``'s layers as they land);
        ``on_end(op, error or None)`` follows on the loop."""
        assert self.copier is not None
        to_host = type(effect) is CopyToHost
        try:
            self.copier.submit(
                to_host, effect.device_ids, effect.slots, on_end, effect.op, progress
            )
        except TieringError as exc:  # the copier is closed: the copy never started
            if progress is not None:
                progress.fail(exc)
            asyncio.get_running_loop().call_soon(on_end, effect.op, exc)

    def send(
        self, effect: TierStore | TierLoad, on_done: Callable[[int, TierOutcome], None]
    ) -> None:
        """Send the tier job ``effect`` asks for; ``on_done(op, outcome)`` follows."""
        kind = "store" if type(effect) is TierStore else "load"
        done = partial(on_done, effect.op)
        self.clients[effect.tier].submit(kind, effect.keys, effect.slots, done, checked=True)

    async def aclose(self, deadline: float) -> None:
        """Close in order, the tiers' jobs getting until ``deadline`` (loop time) to end;
        every tier job and copy has reported back on return (if cancelled: :meth:`close`)."""
        loop = asyncio.get_running_loop()
        for client in self.clients:
            await client.aclose(max(0.0, deadline - loop.time()))
        if self.copier is not None:
            await self.copier.aclose()
        self.close()

    def close(self) -> None:
        """Stop everything now, synchronously and idempotently: the tiers, the copier (its
        copies in flight waited for) and the pool (mapped while a tier holds a view)."""
        for client in self.clients:
            client.shutdown()
        if self.copier is not None:
            self.copier.close()
        if self.pool is not None:
            self.pool.close()
