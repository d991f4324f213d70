"""Execution claims kept by a majority of single-replica buckets, and the ingress's tombstones.

**Why a quorum of buckets (issue 17, part 2).** Every node agent claims a request before its
engine gets it (kairos/services/node_agent/acceptance.py). A claim kept in one replicated JetStream bucket
stalls whenever that bucket's raft leader dies: its followers campaign only 4–9 s after the leader
went silent (nats-server ``server/raft.go``, ``minElectionTimeoutDefault``..
``maxElectionTimeoutDefault``, not configurable), so every claim — and every request's first token
— waited that long after a member was killed (``tests/faults/test_nats_cluster.py``: 82 of 969
requests failed ``claim_failed`` → ``no_available_node``, p99 TTFT 12.8 s). Here a claim lives in
N single-replica buckets ``kairos_claims_<i>``, bucket ``i`` placed on cluster member ``i``
(``kairos.runtime.lanes.ensure_claim_buckets``, server tag ``kairos-lane:<i>``). A single-replica stream has
no raft group at all, so a bucket answers as long as its member lives. A node *holds* a claim when
its KV ``create`` (atomic: refused if the key exists) won in a majority ``N // 2 + 1`` of the
buckets; two majorities always share a bucket, so two nodes can never both hold one. Like a
3-replica bucket, 3 buckets survive the loss of any one member; unlike it, nothing waits for an
election. One bucket (a single nats-server) behaves exactly like the one claim bucket before.

A claimant that wins fewer than a majority releases what it won (compare-and-delete) and fails
(``failed``: the dispatcher retries, kairos/services/dispatcher/busretry.py), so concurrent claimants of
one request — a re-delivered or re-enqueued duplicate — settle by retrying. Another claim seen
in fewer than a majority of the buckets but old enough that it cannot be a loser in the middle of
its release (:data:`SETTLED_AFTER_MS`), with the unreachable buckets able to complete its
majority, is taken as held: its owner won while the now-dead member still answered.

**Tombstones.** When no dispatcher took a request in time the ingress answers 503 ``enqueue_failed``
("retry"), but the request may still reach one (a frozen server resumes; tests/faults/test_nats_restart.py:
in the release of JetStream request lanes, a node accepted
a request whose client had been told to retry, because nats-py runs each subscription's callbacks
in a task of its own and the cancel came too late). So the ingress also stores a *tombstone*
(:class:`~kairos.contracts.wire.Claim` with ``withdrawn`` set and no node) under the attempt's claim key
(:func:`withdraw`); a node that finds one refuses the job as ``cancelled`` whatever order the
request, the cancel and the job reach it in. If a node's claim holds the majority first (the
request was routed before the ingress gave up), the ingress logs ``withdrawn_attempt_ran``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.contracts.wire import Claim, WireError, decode, encode, now_ms

Withdrawal = Literal["withdrawn", "ran", "expired"]
Outcome = Literal["won", "mine", "claimed", "withdrawn", "failed"]

#: a claim seen in fewer than a majority of the buckets is taken as held (its owner's majority
#: includes an unreachable member) once it is this old (claimant's wall clock ms → reader's): a
#: claimant that lost releases its buckets within its claim's wait (0.75 s at most) plus one round
#: trip. Assumes clocks within a few hundred ms (NTP); a larger skew costs liveness, not safety.
SETTLED_AFTER_MS = 1000.0
#: each bucket's create / get / delete waits this long (s) for its member before it counts as down
BUCKET_TIMEOUT_S = 0.25
#: nats-server's "wrong last sequence" (a compare-and-delete of a key that moved on)
WRONG_LAST_SEQUENCE = 10071


@dataclass(frozen=True)
class Vote:
    """One bucket's answer about one claim key.

    Attributes:
        state: ``won`` (this create stored it: ``revision``), ``held`` (the key holds ``claim`` at
            ``revision``), ``absent`` (a read found no claim), ``down`` (no usable answer: ``error``).
            Only ``held`` votes carry a claim.
    """

    state: Literal["won", "held", "absent", "down"]
    revision: int | None = None
    claim: Claim | None = None
    error: str = ""


def quorum_of(n: int) -> int:
    """A majority of ``n`` buckets (``n // 2 + 1``). Raises ValueError for ``n`` < 1."""
    if n < 1:
        raise ValueError("a claim needs at least one bucket")
    return n // 2 + 1


class ClaimQuorum:
    """The claim buckets of one deployment (one per NATS member, or the one bucket of a single server).

    Args:
        buckets: ``kairos_claims_<i>`` for i in 0..N-1 (``kairos.runtime.lanes.ensure_claim_buckets``); a list order
            every process shares is not needed (a majority is a count).
        timeout_s: how long each bucket's operation waits (:data:`BUCKET_TIMEOUT_S`).
    """

    def __init__(self, buckets: KeyValue | Sequence[KeyValue], timeout_s: float = BUCKET_TIMEOUT_S) -> None:
        self.buckets = [buckets] if not isinstance(buckets, Sequence) else list(buckets)
        quorum_of(len(self.buckets))  # at least one
        self.timeout_s = timeout_s
        self._releasing: set[asyncio.Future] = set()  #: releases in flight (:meth:`release_later`)

    async def _read_one(self, kv: KeyValue, key: str) -> Vote:
        try:
            e = await asyncio.wait_for(kv.get(key), self.timeout_s)
        except nats.js.errors.KeyNotFoundError:  # never written, or released (deleted)
            return Vote("absent")
        except Exception as exc:  # timeout, no responders (member down), disconnected
            return Vote("down", error=repr(exc))
        if not e.value:
            return Vote("down", error="empty claim")
        try:
            return Vote("held", e.revision, decode(e.value, Claim))
        except WireError as exc:
            return Vote("down", error=repr(exc))

    async def _create_one(self, kv: KeyValue, key: str, data: bytes, value: Claim) -> Vote:
        try:
            return Vote("won", await asyncio.wait_for(kv.create(key, data), self.timeout_s))
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            # no answer: the create may be stored all the same; a read tells (a stored claim whose
            # revision nobody knows could never be released: an orphan other claimants would honour)
            v = await self._read_one(kv, key)
            if v.claim is not None and v.claim == value:
                return Vote("won", v.revision)
            return v if v.claim is not None else Vote("down", error=repr(exc))
        except Exception as exc:
            return Vote("down", error=repr(exc))
        v = await self._read_one(kv, key)  # held by someone: whom
        return Vote("down", error=repr(nats.js.errors.KeyNotFoundError())) if v.state == "absent" else v

    async def create(self, key: str, value: Claim) -> list[Vote]:
        """Atomically create ``key`` = ``value`` in every bucket at once; one :class:`Vote` per
        bucket, in bucket order. Never raises."""
        data = encode(value)
        return list(await asyncio.gather(*(self._create_one(kv, key, data, value) for kv in self.buckets)))

    async def read(self, key: str) -> list[Vote]:
        """``key`` in every bucket (``held``, ``absent`` or ``down`` per bucket). Never raises."""
        return list(await asyncio.gather(*(self._read_one(kv, key) for kv in self.buckets)))

    async def release(self, key: str, revisions: Sequence[int | None], tries: int = 3, retry_s: float = 0.2) -> None:
        """Compare-and-delete ``key`` in each bucket where ``revisions[i]`` is set (what a create won),
        each tried up to ``tries`` times ``retry_s`` apart while its bucket does not answer. A bucket
        whose key moved on is left alone. Never raises."""
        async def one(kv: KeyValue, rev: int) -> None:
            for i in range(tries):
                try:
                    await asyncio.wait_for(kv.delete(key, last=rev), self.timeout_s)
                    return
                except nats.js.errors.APIError as exc:
                    if getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE:
                        return  # no longer this revision: someone else's now
                except (nats.errors.Error, asyncio.TimeoutError):
                    pass  # the bucket's member does not answer (down, disconnected): tried again below
                if i < tries - 1:
                    await asyncio.sleep(retry_s)
        await asyncio.gather(*(one(kv, r) for kv, r in zip(self.buckets, revisions) if r is not None))

    async def settled(self) -> None:
        """Wait for every :meth:`release_later` in flight (a service stopping; tests; a release
        never raises)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing))

    def release_later(self, key: str, revisions: Sequence[int | None]) -> None:
        """:meth:`release` in a task of its own: what a claimant without a majority gives back must
        not be cut short when the claimant's own wait ends (kairos/services/node_agent ``CLAIM_TIMEOUT_S``)."""
        if any(r is not None for r in revisions):
            task = asyncio.ensure_future(self.release(key, revisions))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)


def won_revisions(votes: Sequence[Vote]) -> tuple[int | None, ...]:
    """Per bucket, the revision a create won there (None elsewhere): what :meth:`ClaimQuorum.release` takes."""
    return tuple(v.revision if v.state == "won" else None for v in votes)


def _most(claims: Sequence[Claim]) -> tuple[str, int]:
    """The node most of ``claims`` name and how many name it (ties: the first named)."""
    counts = Counter(c.node for c in claims)
    node = max(counts, key=counts.__getitem__)
    return node, counts[node]


def decide(votes: Sequence[Vote], mine: Callable[[Claim], bool]) -> tuple[Outcome, Claim | None, str]:
    """What a claimant's create over all buckets (``votes``, one per bucket) decided.

    ``mine(claim)``: a claim found in a bucket that belongs to this claimant (its node and
    incarnation; for the ingress, any tombstone).

    Returns:
        ``(outcome, claim, error)``: ``won`` (this create holds a majority: ``claim`` None — the
        caller's value), ``mine`` (this claimant held it already: the held claim), ``withdrawn`` (a
        tombstone is in some bucket and this claimant has no majority), ``claimed`` (another
        claim holds a majority, or is settled — :data:`SETTLED_AFTER_MS` — with the unreachable
        buckets able to complete one), ``failed`` (nothing decided: ``error`` says why). Unless
        ``won`` or ``mine``, the caller must release what it won (:func:`won_revisions`).
    """
    q = quorum_of(len(votes))
    held = [v.claim for v in votes if v.claim is not None]
    own_held = [c for c in held if mine(c)]
    if sum(v.state == "won" for v in votes) + len(own_held) >= q:
        return ("mine", own_held[0], "") if own_held else ("won", None, "")
    tombs = [c for c in held if c.withdrawn and not mine(c)]
    if tombs:
        return "withdrawn", tombs[0], ""
    down = [v for v in votes if v.state == "down"]
    others = [c for c in held if not mine(c)]
    if others:  # by node: one node's retry may differ in value
        node, n = _most(others)
        claim = max((c for c in others if c.node == node), key=lambda c: c.claimed_unix_ms)
        if n >= q or (n + len(down) >= q and now_ms() - claim.claimed_unix_ms >= SETTLED_AFTER_MS):
            return "claimed", claim, ""
    if down and len(votes) == 1:
        return "failed", None, down[0].error
    why = "; ".join(v.error for v in down) or "no majority yet (a concurrent claimant)"
    return "failed", None, f"{len(votes) - len(down)} of {len(votes)} claim buckets answered: {why}"


def holder(votes: Sequence[Vote]) -> Claim | None:
    """The claim of the node most buckets name (a read's :class:`Vote` list; its newest value; a
    tombstone counts too, as node ""), None when no bucket that answered holds one."""
    held = [v.claim for v in votes if v.claim is not None]
    if not held:
        return None
    node, _ = _most(held)
    return max((c for c in held if c.node == node), key=lambda c: c.claimed_unix_ms)


async def read_holder(claims: ClaimQuorum, request_id: str) -> Claim | None:
    """:func:`holder` of attempt ``request_id``'s claim key. Never raises (a bad id: None)."""
    try:
        key = S.claim_key(request_id)
    except S.SubjectError:
        return None
    return holder(await claims.read(key))


def tombstone(code: str) -> Claim:
    """The tombstone claim of an attempt the ingress answered with error ``code``."""
    if not code:
        raise ValueError("a tombstone needs the error code the attempt was answered with")
    return Claim(node="", kind="keep", withdrawn=code, claimed_unix_ms=now_ms())


async def withdraw(claims: ClaimQuorum, request_id: str, code: str, until_unix_ms: float,
                   retry_s: float = 0.25) -> tuple[Withdrawal, Claim | None]:
    """Store the tombstone of attempt ``request_id`` in a majority of the claim buckets, retried
    every ``retry_s`` until that is decided or the wall clock passes ``until_unix_ms`` (the
    attempt's deadline: after it no dispatcher routes the request and no node accepts it,
    kairos/services/node_agent: ``deadline_passed``). A tombstone stored in fewer buckets is kept: a
    node that meets it refuses the job all the same.

    Returns:
        ``("withdrawn", tombstone)`` once a majority holds a tombstone, ``("ran", claim)`` when a
        node's claim holds the request (``claim``: that node), ``("expired", None)`` when neither
        was decided before ``until_unix_ms``.

    Raises:
        SubjectError: ``request_id`` is not a subject token. Bus errors are retried, never raised.
    """
    key, value = S.claim_key(request_id), tombstone(code)
    while now_ms() < until_unix_ms:
        outcome, held, _ = decide(await claims.create(key, value), mine=lambda c: bool(c.withdrawn))
        if outcome in ("won", "mine"):
            return "withdrawn", held or value
        if outcome == "claimed":
            return "ran", held
        await asyncio.sleep(retry_s)
    return "expired", None
