"""Per-node prefix index of the cluster view: "how many leading tokens of request r does node n hold".

Where its input comes from: each engine's prefix-cache events (``stored``/``removed`` block hashes,
:meth:`shared.engine.Engine.drain_cache_events`; vLLM's ``--kv-events-config`` ``BlockStored`` /
``BlockRemoved`` for a real engine). The simulator applies them at every view refresh; live, the
state aggregator applies those the agents attach to their heartbeats. Where its output goes: the
snapshot's ``cached_prefix_tokens`` per node (shared/snapshot.py), read by the cache-aware policies.

Data structure: an inverted index hash → set of nodes holding it (the flat form of Dynamo's
``KvIndexer`` radix tree — a hash chains its whole prefix, so "the node holds hash i" already means
"it holds blocks 0..i"). A query walks the request's hashes while some node still matches,
intersecting, so it costs O(matched blocks × matching nodes), a few µs for a typical request.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class PrefixIndex:
    """Which node holds which block hash (see module docstring).

    Args:
        block_tokens: tokens per hashed block (must equal the engines' ``cache_block_tokens``).

    Raises:
        ValueError: ``block_tokens < 1``.
    """

    __slots__ = ("block_tokens", "_nodes", "_by_node")

    def __init__(self, block_tokens: int) -> None:
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._nodes: dict[int, set[str]] = {}  # hash -> nodes holding it
        self._by_node: dict[str, set[int]] = {}  # node -> hashes (for resync / node removal)

    def apply(self, node: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Apply one node's net cache events (order-independent; idempotent)."""
        mine = self._by_node.setdefault(node, set())
        index = self._nodes
        for h in stored:
            if h not in mine:
                mine.add(h)
                index.setdefault(h, set()).add(node)
        for h in removed:
            if h in mine:
                mine.discard(h)
                holders = index[h]
                holders.discard(node)
                if not holders:
                    del index[h]

    def reset_node(self, node: str, hashes: Iterable[int] = ()) -> None:
        """Replace everything known about ``node`` (a resync after lost events, or a node that
        left: empty ``hashes``)."""
        self.apply(node, (), list(self._by_node.get(node, ())))
        self._by_node.pop(node, None)
        self.apply(node, hashes, ())

    def node_hashes(self, node: str) -> frozenset[int]:
        """Hashes the index believes ``node`` holds."""
        return frozenset(self._by_node.get(node, ()))

    def match_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """node → number of leading ``hashes`` it holds, for every node holding at least one."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        index = self._nodes
        alive = index.get(hashes[0])
        if not alive:
            return out
        alive = set(alive)
        depth = 1
        for h in hashes[1:]:
            holders = index.get(h)
            nxt = alive & holders if holders else set()
            for n in alive - nxt:
                out[n] = depth
            alive = nxt
            if not alive:
                break
            depth += 1
        for n in alive:
            out[n] = depth
        return out

    def match_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> dict[str, int]:
        """node → leading prompt tokens it would serve from cache (the engines' rule: whole
        blocks, at least one token computed: ``min(blocks·bt, ⌊(prompt − 1)/bt⌋·bt)``)."""
        bt = self.block_tokens
        cap = (prompt_tokens - 1) // bt * bt if prompt_tokens > 0 else 0
        hashes = hashes[:prompt_tokens // bt]
        return {n: min(b * bt, cap) for n, b in self.match_blocks(hashes).items() if min(b * bt, cap) > 0}
