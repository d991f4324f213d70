"""KV-block and prefix-cache bookkeeping of one engine: reserve at admission, free on leave.

Inputs: the :class:`~kairos.core.engine_model.request.Req` records that
:class:`~kairos.core.engine_model.queues.PhaseQueues` admits, computes and drops (their ``blocks``,
``hashes`` and ``kind``). Outputs: the free / used block counts that gate admission and feed
``EngineState.free_kv_tokens`` / ``used_kv_tokens``, and on each request its prefix hit
(``Req.hit``, ``Req.computed``) and the cache hashes it pins (``Req.pinned``).

Whole-request reservation (no preemption, see :mod:`kairos.core.engine_model.core`): a request takes all
its blocks when admitted and gives them back when it finishes, is released or aborted. Cached
blocks that no request pins are evictable and are evicted down to the free capacity (vLLM's free
block queue holds cached blocks until they are reused). Block counts are KV blocks of
``config.block_size`` tokens; the cache counts in its own ``config.cache_block_tokens``.
"""

from __future__ import annotations

from kairos.core.engine_model.prefix import PrefixCache
from kairos.core.engine_model.request import REMOTE, Req
from kairos.core.engine_model.types import EngineConfig


class KvBlocks:
    """The paged KV blocks of one node and its prefix cache (None when caching is off).

    Attributes:
        total: KV blocks of the node (``config.total_blocks``).
        free: blocks no admitted request reserves.
        cache: the node's :class:`~kairos.core.engine_model.prefix.PrefixCache`, or None.
    """

    __slots__ = ("block_size", "total", "free", "cache")

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.block_size
        self.total = config.total_blocks
        self.free = self.total
        self.cache: PrefixCache | None = PrefixCache(config.cache_block_tokens) if config.prefix_caching else None

    @property
    def free_tokens(self) -> int:
        """KV tokens of the free blocks."""
        return self.free * self.block_size

    @property
    def used_tokens(self) -> int:
        """KV tokens of the reserved blocks."""
        return (self.total - self.free) * self.block_size

    def reserve(self, r: Req) -> None:
        """Admission: take ``r.blocks`` (the caller checked they fit) and pin ``r``'s prefix hit.

        A prompt computed on this node starts after its cached prefix (``r.computed = r.hit``); a
        remote decode only records the hit, which shortens its KV transfer.
        """
        self.free -= r.blocks
        if r.hashes:
            cache = self.cache
            r.hit = cache.hit_tokens(r.hashes, r.prompt)
            r.pinned = cache.pin(r.hashes[:r.hit // cache.block_tokens])
            if r.kind != REMOTE:
                r.computed = r.hit

    def release(self, r: Req) -> None:
        """``r`` leaves the node: free its blocks, unpin its cached blocks, evict what no longer fits."""
        self.free += r.blocks
        if r.pinned is not None:
            self.cache.unpin(r.pinned)
            r.pinned = None
            self.cache.evict_to(self.free * self.block_size)

    def insert(self, r: Req) -> None:
        """``r``'s prompt is computed (or its KV arrived) here: cache its full blocks."""
        if r.hashes:
            have = r.pinned or []
            r.pinned = have + self.cache.insert(r.hashes[len(have):])

    def evict(self) -> None:
        """Evict unpinned cached blocks down to the free capacity (after admissions took blocks)."""
        if self.cache is not None:
            self.cache.evict_to(self.free * self.block_size)

    def check(self, reqs: list[Req], held_blocks: int) -> None:
        """Assert the block and pin accounting against ``reqs`` (all requests the engine holds)
        and ``held_blocks`` (the blocks of those admitted).

        Raises:
            AssertionError: a count drifted.
        """
        assert 0 <= self.free <= self.total, "free blocks out of range"
        assert held_blocks == self.total - self.free, "block accounting drift"
        if self.cache is not None:
            pins: dict[int, int] = {}
            for r in reqs:
                for h in r.pinned or ():
                    pins[h] = pins.get(h, 0) + 1
            assert pins == self.cache._ref, "prefix-cache pin counts drift from the requests' pins"
            assert self.cache.free_tokens <= self.free * self.block_size, \
                "evictable cached blocks exceed the free KV capacity"
