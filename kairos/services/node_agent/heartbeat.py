"""The node's heartbeats: its state on ``kairos.state.<node>`` every ``state_period_ms``.

Each heartbeat (a :class:`~kairos.contracts.wire.NodeState`) carries the engine's state (B, K, the
prefill queue, deflections in flight, free KV), this incarnation (``epoch_unix_ms``, ``seq``), the
KV this prefill node still holds for decode nodes (``kv_backlog_ms``), whether it accepts work, and
the prefix cache's events (net deltas; the whole cache on the first and every
:data:`CACHE_RESYNC`-th heartbeat: a lost heartbeat makes the dispatchers' index forget the node
until then). The step records the heartbeat reflects go out before it, on the same connection. The
loop also runs the node's periodic chores (the KV holds' expiry, the kairos+ guard).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from kairos.contracts import subjects as S
from kairos.contracts.wire import InFlight, NodeState, encode
from kairos.core.model.correction import CorrectionEstimator
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.slots import DeflectionSlots
from kairos.services.node_agent.steps import StepRecords

#: every this many heartbeats (and on the first) the prefix-cache events carry the whole cache
CACHE_RESYNC = 50


class Heartbeats:
    """One node's heartbeats (module docstring).

    Args:
        ctx: the node's shared state.
        slots: its deflection slots (a slot held counts as a deflection in flight).
        steps: its step records (sent before each heartbeat).
        corrector: its step-time correction (the kairos+ guard).
        epoch_unix_ms: this incarnation's start (a restart is a newer epoch).
    """

    def __init__(self, ctx: NodeContext, slots: DeflectionSlots, steps: StepRecords, corrector: CorrectionEstimator,
                 epoch_unix_ms: float) -> None:
        self.ctx, self.slots, self.steps, self.corrector = ctx, slots, steps, corrector
        self.epoch_unix_ms = epoch_unix_ms
        self.seq = 0

    def node_state(self) -> NodeState:
        """The next heartbeat (``seq`` advances)."""
        ctx = self.ctx
        st = ctx.backend.state()
        self.seq += 1
        cache = ctx.backend.cache_events(full=self.seq % CACHE_RESYNC == 1)
        cache_fields = {} if cache is None else dict(
            cache_block_tokens=cache[0], cache_stored=cache[1], cache_removed=cache[2], cache_full=cache[3])
        return NodeState(**cache_fields, node=ctx.node, role=ctx.cfg.role, seq=self.seq,
                         sent_unix_ms=ctx.clock.now_ms(), epoch_unix_ms=self.epoch_unix_ms,
                         period_ms=ctx.cfg.state_period_ms, batch_size=st.batch_size, kv_tokens=st.kv_tokens,
                         queue_prompt_tokens=list(st.queue_prompt_tokens),
                         deflection_in_flight=st.deflection_in_flight or bool(len(self.slots)),
                         in_flight=[InFlight(f.prompt_tokens, f.output_tokens) for f in st.in_flight],
                         waiting=st.waiting, free_kv_tokens=st.free_kv_tokens, running=st.running,
                         kv_backlog_ms=sum(r.kv_backlog_ms for r in ctx.reqs.values()),
                         accepting=ctx.accepting and ctx.backend.available, draining=ctx.draining)

    async def send(self) -> None:
        """Publish a heartbeat, after the records of the steps it reflects (the profiler stops
        listening at a heartbeat that shows the node idle, kairos/services/profiler)."""
        ctx = self.ctx
        await self.steps.sent()
        st = self.node_state()
        m, node = ctx.metrics, ctx.node
        m.batch.labels(node).set(st.batch_size)
        m.kv_tokens.labels(node).set(st.kv_tokens)
        m.queue.labels(node).set(sum(st.queue_prompt_tokens))
        m.inflight.labels(node).set(len(ctx.reqs))
        await ctx.nc.publish(S.state_subject(node), encode(st))

    async def run(self, stop: asyncio.Event, chores: Callable[[], Awaitable[None]]) -> None:
        """Heartbeat every ``state_period_ms`` until ``stop``; after each, ``chores()`` and the guard."""
        period = self.ctx.cfg.state_period_ms / 1000.0
        while not stop.is_set():
            try:
                await self.send()
            except Exception as exc:  # disconnected: keep trying, nats-py reconnects
                self.ctx.log.warning("heartbeat_failed", error=repr(exc))
            await chores()
            self.tighten_guard()
            await self.ctx.clock.wait_event(stop, period)

    def tighten_guard(self) -> None:
        """kairos+ node-side guard: β·τ / the node's learned safety factor (as in the simulator)."""
        cfg = self.ctx.cfg
        if cfg.tbt_guard_ms is not None and cfg.guard_correction:
            safety = self.corrector.correction(cfg.node_id, self.ctx.clock.now_ms()).safety
            self.ctx.backend.set_tbt_guard_ms(cfg.tbt_guard_ms / safety)
