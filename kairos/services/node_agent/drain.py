"""A node's graceful drain (issue 33): SIGTERM, or an operator's ``kairos drain NODE``.

What a draining node does, in order (:meth:`Drain.run`):

1. **Say so.** It stops accepting (jobs are refused ``draining``, KV handoffs too) and sends a
   heartbeat at once with ``draining`` set: the aggregator's view carries it, dispatchers leave the
   node out of every snapshot (their decision records name it ``draining``), the ingress's ``/health``
   lists it.
2. **Move what has not started.** A request accepted but not started here (no prompt token
   computed, or a remote decode still waiting for blocks: :attr:`~.request.NodeRequest.unstarted`)
   ends here with ``node_shutdown`` at once; the ingress sends it elsewhere (a re-submission: nothing
   reached its client).
3. **Finish what runs,** for at most ``drain_timeout_s`` (``KAIROS_DRAIN_TIMEOUT_S``): running
   decodes and prefills go on; a prefill node's KV handed off waits for its decode node's pull.
4. **Move what is left** at the deadline with ``node_shutdown``: the ingress migrates a request whose
   tokens reached the client (it resumes on another node after them) and re-submits the others.

Then the agent exits (its caller closes it). Every step is logged: ``drain_started``,
``drain_moved`` (per request: why), ``drain_finished`` with the counts; the agent's
``kairos_agent_draining`` gauge is 1 meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from kairos.contracts.errors import ErrorCode
from kairos.core.vocabulary import RequestPhase
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.effects import Effects


@dataclass
class DrainReport:
    """What a drain did: requests finished here, moved before they started, moved at the deadline,
    and its duration (s)."""

    finished: int = 0
    moved_unstarted: list[str] = field(default_factory=list)
    moved_at_deadline: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


class Drainer:
    """One node's drain (module docstring).

    Args:
        ctx: the node's shared state; ``effects`` carries out the requests' endings.
        heartbeat: sends a heartbeat now (the draining state, at once).
    """

    def __init__(self, ctx: NodeContext, effects: Effects, heartbeat: Callable[[], Awaitable[None]]) -> None:
        self.ctx, self.effects, self.heartbeat = ctx, effects, heartbeat
        self.report: DrainReport | None = None  #: set once a drain started (complete when it returned)
        self._drain: asyncio.Future[DrainReport] | None = None

    async def run(self, why: str) -> DrainReport:
        """Drain (module docstring); returns what it did. A second call (a ``kairos drain`` sent twice,
        SIGTERM after a preStop hook's drain) waits for the drain under way and returns its report:
        it neither starts another nor cuts the first short."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._run(why))
        return await asyncio.shield(self._drain)

    async def _run(self, why: str) -> DrainReport:
        ctx, clock = self.ctx, self.ctx.clock
        rep = self.report = DrainReport()
        t0 = clock.monotonic()
        ctx.accepting, ctx.draining = False, True
        ctx.metrics.draining.labels(ctx.node).set(1)
        held = set(ctx.reqs)
        ctx.log.info("drain_started", why=why, requests=len(held), timeout_s=ctx.cfg.drain_timeout_s)
        try:
            await self.heartbeat()
        except Exception as exc:  # disconnected: the next heartbeats say it
            ctx.log.warning("heartbeat_failed", error=repr(exc))
        for r in [r for r in ctx.reqs.values() if r.unstarted]:
            rep.moved_unstarted.append(r.rid)
            await self._move(r.rid, "it had not started")
        deadline = t0 + ctx.cfg.drain_timeout_s
        while self._running() and clock.monotonic() < deadline:
            await clock.sleep(min(ctx.cfg.state_period_ms / 1000.0, max(0.0, deadline - clock.monotonic())))
        for rid in [r.rid for r in ctx.reqs.values() if not r.done and r.phase is not RequestPhase.HANDED_OFF]:
            rep.moved_at_deadline.append(rid)
            await self._move(rid, f"the drain deadline ({ctx.cfg.drain_timeout_s:g} s) passed")
        moved = set(rep.moved_unstarted) | set(rep.moved_at_deadline)
        rep.finished = len(held - moved)
        rep.elapsed_s = round(clock.monotonic() - t0, 3)
        ctx.log.info("drain_finished", why=why, finished=rep.finished, moved_unstarted=len(rep.moved_unstarted),
                     moved_at_deadline=len(rep.moved_at_deadline), elapsed_s=rep.elapsed_s)
        return rep

    def _running(self) -> bool:
        """Something of a request is still here (a prefill node's handed-off KV until it was pulled)."""
        return any(not r.done for r in self.ctx.reqs.values())

    async def _move(self, rid: str, why: str) -> None:
        r = self.ctx.reqs.get(rid)
        if r is None or r.done:
            return
        self.ctx.rlog(rid).info("drain_moved", why=why, phase=r.phase.value, tokens_sent=r.tokens)
        await self.effects.fail(r, ErrorCode.NODE_SHUTDOWN, f"node {self.ctx.node} is draining and {why}: the request "
                                                           f"moves to another node")
