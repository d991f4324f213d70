"""Job acceptance on a node: local checks, then one cluster-wide claim per bus request id.

Why a claim, and why the node makes it (issue 10, "at most one execution per request"): the ingress
sends a request again when its dispatcher died (or stalled past ``KAIROS_ROUTE_STALL_S``), maybe
after a node had already accepted its job, and the new dispatcher may route it to *another* node. A per-node
"duplicate" check cannot see that, so before its engine gets a request every node agent atomically
*creates* ``claim.<digest of the bus request id>`` in a majority of the claim buckets (JetStream KV
``create``: fails if the key exists, file-backed, kept for an hour; one bucket per NATS member,
:mod:`kairos.runtime.claims` says why a quorum and not one replicated bucket):

* it wins → it executes the request (if its engine then refuses, it deletes the claim again with
  compare-and-delete, so another node may take it);
* the key exists with this node and this incarnation → the request is (or was) executed here:
  ``duplicate`` (accepted; nothing runs again);
* the key exists with another node (or an earlier incarnation of this one) → refused ``claimed``
  with that claim; the dispatcher then records the request as routed to the claim's node — it
  does not route it again. If that node is dead, the ingress sees it (liveness) and
  re-submits under a new bus id ``<id>-r<n>``, which has its own claim;
* the key is a tombstone (the ingress answered the attempt with ``enqueue_failed``, its request
  may still reach a dispatcher: :mod:`kairos.runtime.claims`) → ``withdrawn``: refused as ``cancelled``,
  whether or not the ingress's cancel got here first;
* the bus cannot answer → refused ``claim_failed`` (no claim, no execution: at most once wins
  over availability; the dispatcher re-routes or the ingress sends the request again).

The claim is made by the node, not by the dispatcher: claim and acceptance are then one event, so
a dispatcher that dies between them cannot leave a claimed request that nobody runs. The window
in which two nodes could both run a request is closed by the KV's atomic create in a majority of
the buckets (two majorities share a bucket); the cost is one JetStream round trip per accepted job
(the buckets are written at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.claims import ClaimQuorum, Outcome, decide, read_holder, won_revisions
from kairos.contracts.wire import Claim, Job, now_ms


@dataclass(frozen=True)
class ClaimResult:
    """What :meth:`Claims.claim` found.

    Attributes:
        outcome: ``won`` (this node executes it; ``revisions``: per claim bucket, what it stored
            there), ``mine`` (this node and incarnation already hold it), ``claimed`` (another node
            or incarnation: ``claim``), ``withdrawn`` (a tombstone: the ingress refused the attempt;
            ``claim``), ``failed`` (no majority answered, or a concurrent claimant: ``error``).
    """

    outcome: Outcome
    claim: Claim | None = None
    revisions: tuple[int | None, ...] | None = None
    error: str = ""


class Claims:
    """The node's side of the execution claims (one per bus request id), kept by a majority of the
    claim buckets (:class:`kairos.runtime.claims.ClaimQuorum`; one bucket on a single nats-server).

    Args:
        buckets: the claim buckets ``kairos_claims_<i>`` (one KeyValue or a sequence).
        node: this node's id.
        epoch_unix_ms: this agent's incarnation (its start time, wall clock ms): a claim of this node
            made before it (``claimed_unix_ms`` < epoch) belongs to a previous incarnation, which
            died with the request — it is ``claimed``, not ``mine``.
    """

    def __init__(self, buckets: KeyValue | Sequence[KeyValue] | ClaimQuorum, node: str, epoch_unix_ms: float) -> None:
        self.quorum = buckets if isinstance(buckets, ClaimQuorum) else ClaimQuorum(buckets)
        self.node, self.epoch_unix_ms = node, epoch_unix_ms

    def _mine(self, c: Claim) -> bool:
        return not c.withdrawn and c.node == self.node and c.claimed_unix_ms >= self.epoch_unix_ms

    async def claim(self, job: Job) -> ClaimResult:
        """Atomically claim ``job.request.request_id`` for this node in a majority of the claim
        buckets (never raises; what it won without a majority is released before it returns)."""
        rid = job.request.request_id
        value = Claim(node=self.node, kind=job.kind,
                      decode_node=job.decode_candidates[0] if job.decode_candidates else self.node,
                      dispatcher_id=job.dispatcher_id, attempt=job.attempt, claimed_unix_ms=now_ms())
        key = S.claim_key(rid)
        votes = await self.quorum.create(key, value)
        outcome, held, error = decide(votes, self._mine)
        revisions = won_revisions(votes)
        if outcome == "won":
            return ClaimResult("won", value, revisions)
        if outcome == "mine":  # where this node's claim is (to release it if its engine refuses)
            return ClaimResult("mine", held, tuple(v.revision if v.state == "won" or (
                v.claim is not None and self._mine(v.claim)) else None for v in votes))
        self.quorum.release_later(key, revisions)  # no majority: give back what this create took
        return ClaimResult(outcome, held, None, error)

    async def release(self, request_id: str, revisions: Sequence[int | None]) -> None:
        """Give up a claim this node won but could not start (compare-and-delete in each bucket it
        won, ``revisions`` from :attr:`ClaimResult.revisions`; never raises)."""
        await self.quorum.release(S.claim_key(request_id), revisions)

    async def release_mine(self, request_id: str) -> None:
        """Give up this incarnation's claim of ``request_id`` wherever a bucket holds it (read, then
        compare-and-delete): a claim whose answer was lost and that this node will not run now
        (kairos/services/node_agent ``_on_job``: refused for a local reason). Never raises."""
        key = S.claim_key(request_id)
        votes = await self.quorum.read(key)
        await self.quorum.release(key, tuple(v.revision if v.claim is not None and self._mine(v.claim) else None
                                             for v in votes), tries=1)  # bounded: the job's answer waits for it

    async def holder(self, request_id: str) -> Claim | None:
        """The claim of ``request_id`` (who executes it) most claim buckets hold, None when none
        answered with one (never raises). A KV handoff must come from the prefill node holding it."""
        return await read_holder(self.quorum, request_id)
