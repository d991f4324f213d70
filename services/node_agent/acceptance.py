"""Job acceptance on a node: local checks, then one cluster-wide claim per bus request id.

Why a claim, and why the node makes it (issue 10, "at most one execution per request"): the work
queue redelivers a request whose dispatcher died (or stalled past ``ack_wait``) after a node had
already accepted its job, and the new dispatcher may route it to *another* node. A per-node
"duplicate" check cannot see that, so before its engine gets a request every node agent atomically
*creates* ``claim.<digest of the bus request id>`` in the ``kairos_requests`` bucket (JetStream KV ``create``:
fails if the key exists, file-backed, kept with the records for an hour):

* it wins → it executes the request (if its engine then refuses, it deletes the claim again with
  compare-and-delete, so another node may take it);
* the key exists with this node and this incarnation → the request is (or was) executed here:
  ``duplicate`` (accepted; nothing runs again);
* the key exists with another node (or an earlier incarnation of this one) → refused ``claimed``
  with that claim; the dispatcher then records the request as routed to the claim's node and
  acks — it does not route it again. If that node is dead, the ingress sees it (liveness) and
  re-submits under a new bus id ``<id>-r<n>``, which has its own claim;
* the key is a tombstone (the ingress answered the attempt with ``enqueue_failed``, its publish
  may still have been stored: :mod:`shared.claims`) → ``withdrawn``: refused as ``cancelled``,
  whether or not the ingress's cancel got here first;
* the bus cannot answer → refused ``claim_failed`` (no claim, no execution: at most once wins
  over availability; the dispatcher re-routes or the request is redelivered).

The claim is made by the node, not by the dispatcher: claim and acceptance are then one event, so
a dispatcher that dies between them cannot leave a claimed request that nobody runs. The window
in which two nodes could both run a request is closed by the KV's atomic create; the cost is one
JetStream round trip per accepted job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import nats.js.errors
from nats.js.kv import KeyValue

from shared import subjects as S
from shared.wire import Claim, Job, WireError, decode, encode, now_ms

Outcome = Literal["won", "mine", "claimed", "withdrawn", "failed"]


@dataclass(frozen=True)
class ClaimResult:
    """What :meth:`Claims.claim` found.

    Attributes:
        outcome: ``won`` (this node executes it; ``revision`` is the key's), ``mine`` (this node and
            incarnation already hold it), ``claimed`` (another node or incarnation: ``claim``),
            ``withdrawn`` (a tombstone: the ingress refused the attempt; ``claim``), ``failed`` (bus
            error: ``error``).
    """

    outcome: Outcome
    claim: Claim | None = None
    revision: int | None = None
    error: str = ""


class Claims:
    """The node's side of the execution claims (one per bus request id).

    Args:
        kv: the ``kairos_requests`` bucket.
        node: this node's id.
        epoch_unix_ms: this agent's incarnation (its start time, wall clock ms): a claim of this node
            made before it (``claimed_unix_ms`` < epoch) belongs to a previous incarnation, which
            died with the request — it is ``claimed``, not ``mine``.
    """

    def __init__(self, kv: KeyValue, node: str, epoch_unix_ms: float) -> None:
        self.kv, self.node, self.epoch_unix_ms = kv, node, epoch_unix_ms

    async def claim(self, job: Job) -> ClaimResult:
        """Atomically claim ``job.request.request_id`` for this node (never raises)."""
        rid = job.request.request_id
        value = Claim(node=self.node, kind=job.kind,
                      decode_node=job.decode_candidates[0] if job.decode_candidates else self.node,
                      dispatcher_id=job.dispatcher_id, attempt=job.attempt, claimed_unix_ms=now_ms())
        try:
            rev = await self.kv.create(S.claim_key(rid), encode(value))
            return ClaimResult("won", value, rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except Exception as exc:  # bus down / timeout: do not execute what may run elsewhere
            return ClaimResult("failed", error=repr(exc))
        try:
            e = await self.kv.get(S.claim_key(rid))
            held = decode(e.value, Claim) if e.value else None
        except (nats.js.errors.KeyNotFoundError, WireError) as exc:  # deleted meanwhile: let the dispatcher retry
            return ClaimResult("failed", error=repr(exc))
        except Exception as exc:
            return ClaimResult("failed", error=repr(exc))
        if held is None:
            return ClaimResult("failed", error="empty claim")
        if held.withdrawn:
            return ClaimResult("withdrawn", held, e.revision)
        if held.node == self.node and held.claimed_unix_ms >= self.epoch_unix_ms:
            return ClaimResult("mine", held, e.revision)
        return ClaimResult("claimed", held, e.revision)

    async def release(self, request_id: str, revision: int) -> None:
        """Give up a claim this node won but could not start (compare-and-delete; never raises)."""
        try:
            await self.kv.delete(S.claim_key(request_id), last=revision)
        except Exception:
            pass

    async def holder(self, request_id: str) -> Claim | None:
        """The claim of ``request_id`` (who executes it), None when there is none or it cannot be
        read (never raises). A KV handoff must come from the prefill node holding it."""
        try:
            e = await self.kv.get(S.claim_key(request_id))
            return decode(e.value, Claim)
        except Exception:  # no such key, no answer, or not a claim (an empty value too: WireError)
            return None
