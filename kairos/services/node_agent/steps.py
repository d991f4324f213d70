"""Every engine step the node ran: its bus record, its metrics, the node's step-time correction.

The backend reports each executed step as a backend-neutral :class:`~kairos.engines.base.StepOutput`
(``EngineEvents.on_step``). :class:`StepRecords` turns it into a ``StepRecordEvent`` on
``kairos.steps.<node>`` (contract D: the profiler fits latency models from them, the aggregator
corrects the dispatchers' predictions), batched — one message per :data:`STEP_BATCH_S` or per
:data:`STEP_BATCH_MAX` records, in step order, nothing while idle — and notes on each request what the
step did to it: the prefill's first chunk (its clock starts after the prefix-cache hit) and every
deflected chunk (χ, predicted vs measured ms: a span event and the chunk metrics).
"""

from __future__ import annotations

import asyncio

from kairos.contracts import subjects as S
from kairos.contracts.wire import STEP_BATCH_MAX, STEP_BATCH_S, StepRecordEvent, encode
from kairos.core.model.correction import CorrectionEstimator
from kairos.engines.base import StepOutput
from kairos.runtime import telemetry
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.tracing import spans_of


class StepRecords:
    """A node's step records and step metrics (module docstring).

    Args:
        ctx: the node's shared state.
        corrector: the node's own step-time correction (its kairos+ guard; the aggregator computes
            the same for the view).
    """

    def __init__(self, ctx: NodeContext, corrector: CorrectionEstimator) -> None:
        self.ctx, self.corrector = ctx, corrector
        self._batch: list[StepRecordEvent] = []  #: records not sent yet (:meth:`queue`)
        self._timer: asyncio.TimerHandle | None = None
        #: the newest batch's publish (:meth:`flush`); each waits for the one before it
        self._sending: asyncio.Task | None = None

    def record(self, out: StepOutput) -> StepRecordEvent:
        """The bus record of one executed step (contract D: ``kairos.steps.<node>``)."""
        n = sum(t for _, t, _ in out.prefill_chunks)
        cached = sum(t * c for _, t, c in out.prefill_chunks) / n if n else 0.0
        cfg = self.ctx.cfg
        return StepRecordEvent(node=cfg.node_id, role=cfg.role, step=out.step, started_unix_ms=out.started_unix_ms,
                               wall_ms=out.wall_ms, predicted_ms=out.predicted_ms, batch_size=out.batch_size,
                               kv_tokens=out.kv_tokens, prefill_tokens=out.prefill_tokens, prefill_cached=cached,
                               prefill_chunks=len(out.prefill_chunks), deflected=out.deflected_chunk is not None,
                               model_version=self.ctx.model.artifact_version)

    async def on_step(self, out: StepOutput) -> None:
        """Step metrics, the step record on the bus, the node's step-time correction and the
        deflected chunk's record (span event, predicted vs measured)."""
        ctx, node = self.ctx, self.ctx.node
        self.corrector.observe(node, out.predicted_ms, out.wall_ms, out.started_unix_ms + out.wall_ms,
                               mixed=out.batch_size > 0 and out.prefill_tokens > 0)
        self.queue(self.record(out))
        ctx.metrics.steps.labels(node).inc()
        ctx.metrics.step.labels(node).observe(telemetry.seconds(out.wall_ms))
        for rid, _n, cached in out.prefill_chunks:
            if (r := ctx.reqs.get(rid)) is not None:
                r.prefill_chunk_ran(out.started_unix_ms, cached)
        if out.deflected_chunk is not None:
            self._deflected_chunk(out)

    def _deflected_chunk(self, out: StepOutput) -> None:
        assert out.deflected_chunk is not None
        rid, idx, chi, toks = out.deflected_chunk
        ctx, node = self.ctx, self.ctx.node
        r = ctx.reqs.get(rid)
        if r is None:
            return
        pred = r.deflected_chunk_ran(idx, chi, out.predicted_ms, out.wall_ms)
        span = spans_of(r).chunk_span
        if span is not None:
            span.add_event("chunk", {"chi": chi, "step_index": idx, "prefill_tokens": toks, "predicted_ms": pred,
                                     "engine_predicted_ms": out.predicted_ms, "actual_ms": out.wall_ms,
                                     "batch_size": out.batch_size})
        m = ctx.metrics
        m.chunks.labels(node).inc()
        m.chunk_pred.labels(node).observe(telemetry.seconds(pred))
        m.chunk_meas.labels(node).observe(telemetry.seconds(out.wall_ms))
        if pred > 0:
            m.chunk_err.labels(node, "decision").observe((out.wall_ms - pred) / pred)
        if out.predicted_ms > 0:
            m.chunk_err.labels(node, "engine").observe((out.wall_ms - out.predicted_ms) / out.predicted_ms)

    # -- batching -----------------------------------------------------------------------------------
    def queue(self, rec: StepRecordEvent) -> None:
        """Batch ``rec`` for ``kairos.steps.<node>``: sent at most ``STEP_BATCH_S`` after the batch's
        first step, or at once at ``STEP_BATCH_MAX`` records (one bus message per batch; nothing is
        sent while the engine is idle)."""
        self._batch.append(rec)
        if len(self._batch) >= STEP_BATCH_MAX:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(STEP_BATCH_S, self.flush)

    def flush(self) -> None:
        """Publish the waiting step records as one message (a JSON array, :data:`kairos.contracts.wire.StepRecords`)."""
        self.drop_timer()
        batch, self._batch = self._batch, []
        if batch and self.ctx.nc is not None:
            self._sending = self.ctx.tasks.spawn(self._publish(batch, self._sending), "step_records")

    def drop_timer(self) -> None:
        """Forget the pending flush (a crash: what is not sent is lost)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def sent(self) -> None:
        """Flush, and wait until every record so far went out (before a heartbeat: a consumer that
        sees the node idle has every record of the work that came before)."""
        self.flush()
        if self._sending is not None and not self._sending.done():
            await asyncio.wait({self._sending})

    async def _publish(self, batch: list[StepRecordEvent], previous: asyncio.Task | None) -> None:
        """Publish ``batch`` after ``previous`` (the batch before it) went out: records stay in step order."""
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        try:
            await self.ctx.nc.publish(S.steps_subject(self.ctx.node), encode(batch))
        except Exception as exc:  # disconnected: the steps still count, their records are lost
            self.ctx.log.warning("step_record_failed", error=repr(exc), records=len(batch))
