"""Per-node prefix index of the cluster view: "how many leading tokens of request r does node n hold".

Where its input comes from: each engine's prefix-cache events (``stored``/``removed`` block hashes,
:meth:`kairos.core.engine_model.Engine.drain_cache_events`; vLLM's ``--kv-events-config`` ``BlockStored`` /
``BlockRemoved`` for a real engine). The simulator applies them at every view refresh; live, the
state aggregator applies those the agents attach to their heartbeats. Where its output goes: the
snapshot's ``cached_prefix_tokens`` per node (kairos/core/cluster/snapshot.py), read by the cache-aware policies.

Data structure: an inverted index hash → the nodes holding it, as a bitmask (the flat form of
Dynamo's ``KvIndexer`` radix tree — a hash chains its whole prefix, so "the node holds hash i"
already means "it holds blocks 0..i"). A query walks the request's hashes while some node still
matches, AND-ing the masks, so it costs O(matched blocks) big-int operations whatever the number
of nodes; bitmasks are plain ints, which the garbage collector never has to walk (sets would be,
at every full collection of a dispatcher holding millions of hashes).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence

#: bytes of prompt text per token in the ingress's token estimate (ceil(bytes / 4)), so a text
#: prompt's block of ``bt`` tokens is ``4·bt`` bytes (kairos/services/ingress/openai_api.py estimate)
TEXT_BYTES_PER_TOKEN = 4


def chain_hashes(data: bytes, block_bytes: int) -> list[int]:
    """Hash chain over the full ``block_bytes`` runs of ``data``: hash i covers bytes
    ``[0, (i+1)·block_bytes)`` (each block's hash digests the previous hash and the block, as vLLM's
    ``hash_block_tokens`` does), so equal hashes mean equal prefixes. 63-bit ints (blake2b-64):
    stable across processes and hosts, unlike Python's ``hash``."""
    out: list[int] = []
    prev = b""
    for i in range(len(data) // block_bytes):
        d = hashlib.blake2b(prev + data[i * block_bytes:(i + 1) * block_bytes], digest_size=8).digest()
        out.append(int.from_bytes(d, "big") >> 1)
        prev = d
    return out


def token_block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Block hashes of a token-id prompt (``block_tokens`` ids per block, full blocks only)."""
    return chain_hashes(array("Q", token_ids).tobytes(), block_tokens * 8)


def request_block_hashes(token_ids: Sequence[int] | None, text: str | None, block_tokens: int) -> list[int]:
    """A request's block hashes: from its token ids when the client sent ids, else from its
    (rendered) prompt text; ``[]`` when ``block_tokens`` is 0 (hashing off) or there is neither."""
    if block_tokens <= 0:
        return []
    if token_ids is not None:
        return token_block_hashes(token_ids, block_tokens)
    return text_block_hashes(text, block_tokens) if text else []


def text_block_hashes(text: str, block_tokens: int) -> list[int]:
    """Block hashes of a text prompt without its token ids: ``TEXT_BYTES_PER_TOKEN·block_tokens``
    UTF-8 bytes per block, matching the ingress's token estimate. Two prompts sharing a text prefix
    share these hashes; with a real tokenizer the block boundaries are approximate (a hit is then a
    routing hint, the engine's own cache decides what is reused)."""
    return chain_hashes(text.encode("utf-8"), block_tokens * TEXT_BYTES_PER_TOKEN)


class PrefixIndex:
    """Which node holds which block hash (see module docstring).

    Args:
        block_tokens: tokens per hashed block (must equal the engines' ``cache_block_tokens``).

    Raises:
        ValueError: ``block_tokens < 1``.
    """

    __slots__ = ("block_tokens", "_nodes", "_by_node", "_seq", "_bit", "_names")

    def __init__(self, block_tokens: int) -> None:
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._nodes: dict[int, int] = {}  # hash -> bitmask of the nodes holding it
        self._bit: dict[str, int] = {}  # node -> its bit (1 << index)
        self._names: list[str] = []  # bit index -> node
        #: node -> hash -> blocks of the node holding it (copies; for resync / node removal)
        self._by_node: dict[str, dict[int, int]] = {}
        self._seq: dict[str, int | None] = {}  # node -> last heartbeat seq applied; None: awaiting a full resync

    def apply(self, node: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Apply one node's cache events: each entry of ``stored`` is one more block holding that
        hash, each entry of ``removed`` one fewer; the node holds a hash while some block does.

        Copies are counted because an engine can cache one hash in several blocks: vLLM's
        ``BlockPool`` keeps every block of two requests that computed the same prefix at once
        (``cached_block_hash_to_block``: hash → {block id: block}) and sends one ``BlockStored`` /
        ``BlockRemoved`` per block (``vllm/v1/core/block_pool.py``), so the removal of one copy
        must not drop the hash (issue 16: a match of 7 blocks fell to 2). The emulated engine holds
        one block per hash and reports each hash's 0↔1 transitions
        (:meth:`kairos.core.engine_model.prefix.PrefixCache.drain_events`). The arithmetic commutes, so the
        order of the events does not matter; a removal of a hash the node does not hold (events
        from before a reset) is ignored. Not idempotent: a heartbeat's events are applied once
        (:meth:`on_heartbeat` checks ``seq``).
        """
        mine = self._by_node.setdefault(node, {})
        bit = self._bit.get(node)
        if bit is None:
            bit = self._bit[node] = 1 << len(self._names)
            self._names.append(node)
        index = self._nodes
        for h in stored:
            n = mine.get(h, 0)
            mine[h] = n + 1
            if n == 0:
                index[h] = index.get(h, 0) | bit
        for h in removed:
            n = mine.get(h, 0)
            if n > 1:
                mine[h] = n - 1
            elif n == 1:
                del mine[h]
                holders = index[h] & ~bit
                if holders:
                    index[h] = holders
                else:
                    del index[h]

    def reset_node(self, node: str, hashes: Iterable[int] = ()) -> None:
        """Replace everything known about ``node`` (a resync after lost events: ``hashes`` is its
        whole cache, one copy each; or a node that left: empty ``hashes``)."""
        for h in self._by_node.pop(node, {}):
            holders = self._nodes[h] & ~self._bit[node]
            if holders:
                self._nodes[h] = holders
            else:
                del self._nodes[h]
        self.apply(node, dict.fromkeys(hashes), ())

    def on_heartbeat(self, node: str, seq: int, block_tokens: int, stored: Sequence[int],
                     removed: Sequence[int], full: bool) -> None:
        """Apply one heartbeat's cache events (``kairos.contracts.wire.NodeState``: ``cache_*`` fields).

        A heartbeat carries the net events since the previous one; every so often (``full``)
        ``stored`` is the node's whole cache instead. Heartbeats travel on core NATS and can be
        lost: after a gap in ``seq`` (or an agent restart) the node's entries are dropped until
        the next full one — the index then under-reports hits (conservative: a cache-aware policy
        sees no cache), never invents them. A node with another block size is ignored.
        """
        if block_tokens != self.block_tokens:
            if node in self._by_node:
                self.reset_node(node)
            return
        last = self._seq.get(node)
        if full:
            self.reset_node(node, stored)
            self._seq[node] = seq
            return
        if last is None or seq != last + 1:
            if node in self._by_node:
                self.reset_node(node)
            self._seq[node] = None
            return
        self.apply(node, stored, removed)
        self._seq[node] = seq

    def node_hashes(self, node: str) -> frozenset[int]:
        """Hashes the index believes ``node`` holds."""
        return frozenset(self._by_node.get(node, {}))

    def match_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """node → number of leading ``hashes`` it holds, for every node holding at least one."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        index, names = self._nodes, self._names
        alive = index.get(hashes[0], 0)
        depth = 1
        if alive:
            for h in hashes[1:]:
                nxt = alive & index.get(h, 0)
                if nxt != alive:
                    gone = alive ^ nxt
                    while gone:  # the nodes whose prefix ends here
                        low = gone & -gone
                        out[names[low.bit_length() - 1]] = depth
                        gone ^= low
                    alive = nxt
                    if not alive:
                        break
                depth += 1
        while alive:
            low = alive & -alive
            out[names[low.bit_length() - 1]] = depth
            alive ^= low
        return out

    def match_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> dict[str, int]:
        """node → leading prompt tokens it would serve from cache (the engines' rule: whole
        blocks, at least one token computed: ``min(blocks·bt, ⌊(prompt − 1)/bt⌋·bt)``)."""
        bt = self.block_tokens
        cap = (prompt_tokens - 1) // bt * bt  # negative for an empty prompt: nothing is reported
        hashes = hashes[:prompt_tokens // bt]
        return {n: t for n, b in self.match_blocks(hashes).items() if (t := min(b * bt, cap)) > 0}
