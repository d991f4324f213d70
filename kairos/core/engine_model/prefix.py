"""Prefix cache of an engine: KV blocks keyed by a hash chain, LRU eviction, incremental events.

Where it is used: every :class:`kairos.core.engine_model.Engine` (simulator and emulated node agent alike)
owns one :class:`PrefixCache`; requests carry their block hashes (``block_hashes``: one per
``block_tokens``-token run of the prompt, each hash covering the whole prefix up to its block, so
a hash equal on two nodes means the same leading tokens — vLLM ``hash_block_tokens`` /
``BlockHash``; the Mooncake trace's ``hash_ids``). Where its output goes: the events
(:meth:`PrefixCache.drain_events`, stored and removed hashes, like vLLM's ``BlockStored`` /
``BlockRemoved`` KV events from ``--kv-events-config``) feed a :class:`kairos.core.cluster.prefix_index.PrefixIndex`
in the state view (the simulator's dispatcher; live: the aggregator).

Semantics (vLLM V1 ``KVCacheManager`` / ``BlockPool``, ``vllm/v1/core/block_pool.py``):

* only **computed full blocks** are cached: a request's blocks are inserted once its prompt is
  computed on the node (prefill done, deflected prefill done, remote KV arrived); a partial last
  block is never cached;
* a request **pins** (``ref_cnt``) the cached blocks it uses, from its admission (hits) or from
  insertion until it leaves the node; pinned blocks are never evicted;
* unpinned cached blocks sit in the **free pool** in LRU order (vLLM's ``FreeKVCacheBlockQueue``;
  a request's blocks are freed tail first, so a prompt's head outlives its tail) and are evicted,
  oldest first, when the node's free KV capacity can no longer hold them;
* a **hit** is the longest run of leading hashes present, capped so that at least one prompt token
  is computed (vLLM recomputes the last token to get logits): ``min(hits·block_tokens,
  ⌊(prompt − 1) / block_tokens⌋·block_tokens)``.

Simplification (documented in docs/policies.md): the engine model still reserves KV for the whole
prompt of every request (no block sharing in the memory accounting), so caching saves compute
and KV transfer, never capacity — conservative.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Sequence


class PrefixCache:
    """Block-hash prefix cache of one node (see module docstring).

    Args:
        block_tokens: tokens per hashed block (vLLM ``--block-size``; 512 for the Mooncake trace).

    Raises:
        ValueError: ``block_tokens < 1``.
    """

    __slots__ = ("block_tokens", "_ref", "_free", "_stored", "_removed", "_was_cached")

    def __init__(self, block_tokens: int) -> None:
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._ref: dict[int, int] = {}  # pinned hash -> number of requests using it
        self._free: OrderedDict[int, None] = OrderedDict()  # unpinned cached hashes, LRU first
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._was_cached: dict[int, bool] = {}  # hash with events since the last drain -> cached at that drain

    def __len__(self) -> int:
        """Cached blocks (pinned + free)."""
        return len(self._ref) + len(self._free)

    def __contains__(self, h: int) -> bool:
        return h in self._ref or h in self._free

    @property
    def free_tokens(self) -> int:
        """Tokens held by unpinned (evictable) cached blocks."""
        return len(self._free) * self.block_tokens

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` cached here (pinned or free)."""
        n = 0
        for h in hashes:
            if h in self._ref or h in self._free:
                n += 1
            else:
                break
        return n

    def hit_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Leading prompt tokens served from the cache for a ``prompt_tokens`` prompt with these
        block hashes: ``min(hit_blocks·block_tokens, ⌊(prompt − 1)/block_tokens⌋·block_tokens)``
        (at least one token is computed, as in vLLM)."""
        bt = self.block_tokens
        return min(self.hit_blocks(hashes) * bt, (prompt_tokens - 1) // bt * bt) if prompt_tokens > 0 else 0

    def pin(self, hashes: Sequence[int]) -> list[int]:
        """Pin the cached ``hashes`` (a request uses them); returns those pinned, in order.

        Hashes not in the cache are ignored (the caller pins its hits only).
        """
        out = []
        ref, free = self._ref, self._free
        for h in hashes:
            if h in ref:
                ref[h] += 1
            elif h in free:
                del free[h]
                ref[h] = 1
            else:
                continue
            out.append(h)
        return out

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """A request computed these full blocks: cache (and pin) every hash; returns all of them.

        New hashes are reported as stored by :meth:`drain_events`; hashes already cached are just
        pinned (once more).
        """
        ref, free = self._ref, self._free
        for h in hashes:
            if h in ref:
                ref[h] += 1
            else:
                if h in free:
                    del free[h]
                else:
                    self._stored.append(h)
                    self._was_cached.setdefault(h, False)
                ref[h] = 1
        return list(hashes)

    def unpin(self, hashes: Sequence[int]) -> None:
        """The request using ``hashes`` (returned by :meth:`pin`/:meth:`insert`) left the node.

        Blocks whose last user left join the free pool, tail first (most recent = the prompt's
        head), as vLLM frees a request's blocks in reverse order.
        """
        ref, free = self._ref, self._free
        for h in reversed(hashes):
            n = ref.get(h)
            if n is None:
                continue
            if n > 1:
                ref[h] = n - 1
            else:
                del ref[h]
                free[h] = None

    def evict_to(self, free_capacity_tokens: int) -> None:
        """Evict unpinned blocks, least recently used first, until they fit in
        ``free_capacity_tokens`` (the node's free KV capacity)."""
        free, bt = self._free, self.block_tokens
        while free and len(free) * bt > free_capacity_tokens:
            h, _ = free.popitem(last=False)
            self._removed.append(h)
            self._was_cached.setdefault(h, True)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)`` hashes since the last call (vLLM ``BlockStored``/``BlockRemoved``).

        Net changes against the previous drain: a hash is in ``stored`` if it is cached now and was
        not at the previous drain (evicted and stored again in between: not reported), in
        ``removed`` if it was removed since and is not cached now (stored and evicted in between:
        reported as removed, which a consumer ignores). This cache holds one block per hash, so
        ``stored`` is exactly the hashes whose copy count rose from 0 to 1, which is what a
        :class:`kairos.core.cluster.prefix_index.PrefixIndex` counts (a hash reported stored twice would count as
        two blocks). The order a consumer applies them in does not matter.
        """
        if not self._stored and not self._removed:  # nothing since the last drain (most heartbeats)
            return [], []
        ref, free, was = self._ref, self._free, self._was_cached
        stored = [h for h in dict.fromkeys(self._stored) if not was[h] and (h in ref or h in free)]
        removed = list(dict.fromkeys(h for h in self._removed if h not in ref and h not in free))
        self._stored, self._removed, self._was_cached = [], [], {}
        return stored, removed

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to ``limit`` cached hashes, those a request is likeliest to hit: every pinned one (in
        use), then the free pool from the most recently used (a request's blocks are freed tail
        first, so a cut keeps the heads of chains — what prefix matching needs — before their tails).
        """
        out = list(itertools.islice(self._ref, limit))
        if len(out) < limit:
            out.extend(itertools.islice(reversed(self._free), limit - len(out)))
        return out

    def hashes(self) -> set[int]:
        """Every cached hash (tests, a full resync of an index)."""
        return set(self._ref) | set(self._free)
