"""The simulated KV-transfer links: one FIFO link per (prefill node, decode node), one transfer at a time.

Inputs: the profile's :class:`~kairos.core.model.latency.LinkModel` (``setup + tokens·bytes /
bandwidth``, ms) and KV bytes per token; requests queued by the simulator once their decode node
allocated KV blocks (``SimRequest.transfer_tokens``: the prompt tokens the decode node lacks, plus
under TaiChi the tokens decoded on the source). Outputs: the next transfer of a free link and its
duration (ms), which the simulator turns into a transfer-end event, and the queued work per prefill
node (``kv_backlog_ms``, a kairos+ input of the dispatcher's snapshot).
"""

from __future__ import annotations

from kairos.core.model.latency import LinkModel
from kairos.sim.results import SimRequest

#: a link: (prefill node index, decode node index)
LinkKey = tuple[int, int]


class KvLinks:
    """The transfer queues and busy flags of every link of one run."""

    def __init__(self, link: LinkModel, kv_bytes_per_token: float) -> None:
        self.link = link
        self.kv_bytes = kv_bytes_per_token
        self.queues: dict[LinkKey, list[SimRequest]] = {}  # waiting transfers, FIFO, per link
        self.busy: set[LinkKey] = set()
        #: prefill node → its links that ever queued, in the order they first did (what backlog_ms sums)
        self.links_of: dict[int, list[LinkKey]] = {}
        #: prefill node → its backlog_ms since its queues last changed (a snapshot per request reads
        #: every prefill node's; most of them did not change since the last request)
        self._backlog: dict[int, float] = {}

    def transfer_ms(self, r: SimRequest) -> float:
        """How long ``r``'s KV transfer takes on its link, ms."""
        return self.link.transfer_ms(r.transfer_tokens, self.kv_bytes)

    def enqueue(self, key: LinkKey, r: SimRequest) -> None:
        """Queue ``r``'s transfer at the tail of link ``key``."""
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = []
            self.links_of.setdefault(key[0], []).append(key)
        q.append(r)
        self._backlog.pop(key[0], None)

    def start(self, key: LinkKey) -> SimRequest | None:
        """Start the head transfer of link ``key`` if the link is free (it becomes busy); None when
        it is busy or has nothing queued."""
        q = self.queues.get(key)
        if key in self.busy or not q:
            return None
        self.busy.add(key)
        self._backlog.pop(key[0], None)
        return q.pop(0)

    def finish(self, key: LinkKey) -> None:
        """The running transfer of link ``key`` ended: the link is free."""
        self.busy.discard(key)

    def unqueue(self, key: LinkKey, r: SimRequest) -> bool:
        """Drop ``r``'s transfer from link ``key`` if it has not started; True if it was queued."""
        q = self.queues.get(key)
        if q and r in q:
            q.remove(r)
            self._backlog.pop(key[0], None)
            return True
        return False

    def backlog_ms(self, p: int) -> float:
        """Queued (not started) KV-transfer work on prefill node ``p``'s links, ms (kairos+ input);
        summed again only after one of its queues changed (the same sum, in the same order)."""
        total = self._backlog.get(p)
        if total is None:
            total = 0.0
            for key in self.links_of.get(p, ()):  # its own links only: O(decode nodes), not O(links)
                q = self.queues[key]
                if q:
                    total += sum(self.transfer_ms(r) for r in q)
            self._backlog[p] = total
        return total
