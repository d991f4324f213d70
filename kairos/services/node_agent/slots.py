"""A decode node's deflection slots and their reservations (``kairos_resv/decode.<node>.<slot>``).

A decode node takes ``max_deflections`` deflected prefills at a time (1 for kairos, paper §5.3); the
node is the authority on its own slots (it refuses a deflect job beyond them, ``deflection_in_flight``)
and so the only writer of its reservation keys: a plain put with a TTL, no atomic create. A slot is
taken as the engine gets the job, before the reservation's put is awaited (a concurrent deflect job
sees it taken), its reservation published once the engine has the job (the job's answer carries the reservation and its revision,
which the dispatcher applies at once), and released at the request's first token, failure or
cancel (the key's delete follows its put on the same connection, so it never overtakes it). A node
that dies leaves its reservations to their TTL; a new incarnation deletes its keys at start.
"""

from __future__ import annotations

from kairos.contracts import subjects as S
from kairos.contracts.wire import Job, Reservation, encode
from kairos.runtime.messaging import kv_delete_nowait, kv_put_ttl
from kairos.services.node_agent.context import NodeContext

#: TTL (s) of a deflection reservation whose job names none (the dispatcher's floor, reservation_ttl_s)
DEFAULT_RESERVATION_TTL_S = 30
#: longest wait (s) for the bus to confirm a reservation before the job is answered without it
RESERVATION_PUT_TIMEOUT_S = 0.5


class DeflectionSlots:
    """The deflection slots of one decode node (module docstring).

    Attributes:
        held: request id -> the reservation key of the slot it holds.
        max_concurrent: the most deflections accepted at once so far (the cross-replica invariant says ≤ 1 for kairos).
        overlaps: deflect jobs that arrived while every slot was taken (refused, re-routed).
    """

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.held: dict[str, str] = {}
        self.max_concurrent = 0
        self.overlaps = 0

    def __len__(self) -> int:
        return len(self.held)

    def take(self, rid: str) -> str:
        """Hold the lowest free slot of this node for ``rid`` (again: the one it holds); returns its key."""
        if rid in self.held:
            return self.held[rid]
        used = set(self.held.values())
        node = self.ctx.node
        slot = next(i for i in range(len(used) + 1) if S.reservation_key(node, i) not in used)
        key = self.held[rid] = S.reservation_key(node, slot)
        return key

    def give_back(self, rid: str) -> None:
        """Free ``rid``'s slot without a bus write (its reservation was never published)."""
        self.held.pop(rid, None)

    async def reserve(self, rid: str, job: Job) -> tuple[Reservation, str, int | None]:
        """Store the reservation of ``rid``'s slot (taken now if it holds none) for the dispatchers,
        TTL ``job.reservation_ttl_s``; returns (reservation, key, revision — None if the bus did not
        confirm it within :data:`RESERVATION_PUT_TIMEOUT_S`: the slot is still held here, and the
        dispatcher holds it until it expires)."""
        key = self.take(rid)
        self.max_concurrent = max(self.max_concurrent, len(self.held))
        ttl = job.reservation_ttl_s or DEFAULT_RESERVATION_TTL_S
        now = self.ctx.clock.now_ms()
        value = Reservation(request_id=rid, decode_node=self.ctx.node, dispatcher_id=job.dispatcher_id,
                            prompt_tokens=job.request.prompt_tokens, output_tokens=job.request.max_tokens,
                            created_unix_ms=now, expires_unix_ms=now + ttl * 1000.0)
        try:
            rev = await kv_put_ttl(self.ctx.nc, S.RESERVATION_BUCKET, key, encode(value), ttl, RESERVATION_PUT_TIMEOUT_S)
        except Exception as exc:  # the bus down or slow: logged, the job is still answered (without a revision)
            self.ctx.rlog(rid).warning("reservation_publish_failed", key=key, error=repr(exc))
            return value, key, None
        return value, key, rev

    def release(self, rid: str) -> None:
        """The deflected prefill of ``rid`` finished or failed: free its slot and delete its key (in
        the background; a failure is logged: the key then expires by its TTL)."""
        key = self.held.pop(rid, None)
        if key is None or self.ctx.nc is None:
            return

        async def delete() -> None:
            try:
                await kv_delete_nowait(self.ctx.nc, S.RESERVATION_BUCKET, key)
            except Exception as exc:  # disconnected: the key expires by its TTL
                self.ctx.rlog(rid).info("reservation_release_failed", key=key, error=repr(exc))
        self.ctx.tasks.spawn(delete(), "reservation_release")

    async def clear_stale(self) -> None:
        """At start: a new incarnation holds no deflection, so a crashed one's keys go now, not at their TTL."""
        for slot in range(self.ctx.cfg.max_deflections):
            await kv_delete_nowait(self.ctx.nc, S.RESERVATION_BUCKET, S.reservation_key(self.ctx.node, slot))
