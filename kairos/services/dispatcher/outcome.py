"""How a routing ends, told to the cluster: routed (a node accepted the job) or an error.

* **accepted** — the node took the job: a :class:`~kairos.contracts.wire.RoutedEvent` on
  ``kairos.route.decided`` (the aggregator folds it into the view, the other replicas
  see it), the decision's ``kairos.*`` span attributes (docs/observability.md, "Tracing"), the metrics,
  and the :class:`~kairos.contracts.records.DecisionRecord` in the requests bucket (written
  unacknowledged: the routing event and the record leave in one socket write);
* **error** — an :class:`~kairos.contracts.events.ErrorEvent` to the request's out subject, its code one of
  :class:`kairos.contracts.errors.ErrorCode` and its status the code's.

The bus is two callables (``publish(subject, message)``, ``put_record(key, bytes)``), so a unit test
hands in fakes.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
from opentelemetry.trace import Status, StatusCode

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import DISPATCHER
from kairos.contracts.events import ErrorEvent
from kairos.contracts.wire import encode, InferenceRequest, JobAck, RoutedEvent
from kairos.contracts.records import DecisionRecord
from kairos.core.cluster.routing import predicted_ttft_ms
from kairos.core.policy import Decision
from kairos.runtime import telemetry
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.services.dispatcher.metrics import DispatcherMetrics

#: ``publish(subject, message)``: a core-NATS publish of a typed message (kairos.runtime.messaging.publish)
Publish = Callable[[str, msgspec.Struct], Awaitable[None]]
#: ``put_record(key, value, if_absent=False)``: an unacknowledged write to the requests bucket
#: (kairos.runtime.messaging.kv_put_nowait; ``if_absent``: only if the key holds nothing yet)
PutRecord = Callable[..., Awaitable[None]]


class Outcomes:
    """The end of each routing of one replica (see the module docstring).

    Args:
        replica_id: this replica (decision records, error sources).
        policy_spec: the policy's spec string (a metric label).
        metrics: the replica's metrics.
        publish: see :data:`Publish`.
        put_record: see :data:`PutRecord`.
        log: the replica's logger.
        clock: wall clock of records and events.

    Attributes:
        routed: requests this replica routed (accepted by a node).
    """

    def __init__(self, replica_id: str, policy_spec: str, metrics: DispatcherMetrics, publish: Publish,
                 put_record: PutRecord, log: Any, clock: Clock = SYSTEM_CLOCK) -> None:
        self.replica_id, self.policy_spec, self.m = replica_id, policy_spec, metrics
        self.publish, self.put_record, self.log, self.clock = publish, put_record, log, clock
        self.routed = 0

    async def accepted(self, req: InferenceRequest, d: Decision, ack: JobAck, *, state_age_ms: float | None,
                       attempts: int, excluded: dict[str, str], conflicts: list[str], decide_ms: float,
                       routing_ms: float, view_seq: int, span: Any) -> None:
        """``ack.node`` accepted ``req``'s job carrying out decision ``d`` (times in ms). A ``duplicate``
        answer (a copy sent again reached the node already running it) is not a new decision: its
        routing event goes out again (the replica that routed it may have died before sending it),
        but it is counted apart and its record is written only if the request has none (the first
        routing's record stays)."""
        rid = req.request_id
        duplicate = ack.reason == "duplicate"
        rec = DecisionRecord(request_id=rid, dispatcher_id=self.replica_id, decision=d, node=ack.node,
                             decode_node=d.decode_node, attempts=attempts, excluded_nodes=excluded,
                             reservation_conflicts=conflicts, state_age_ms=state_age_ms, view_seq=view_seq,
                             decided_unix_ms=self.clock.now_ms(), decide_ms=decide_ms, routing_ms=routing_ms)
        if span.is_recording():  # built only for a span that is exported (a map per decode node)
            set_decision_attributes(span, d, state_age_ms, attempts, excluded, conflicts)
            span.set_attributes({"kairos.accepted_by": ack.node, "kairos.view_seq": rec.view_seq,
                                 "kairos.decide_ms": decide_ms, "kairos.routing_ms": routing_ms})
        if duplicate:
            self.m.duplicates.inc()
        else:
            self.m.decisions.labels(self.policy_spec, d.decision, d.reason).inc()
            self.m.decide.observe(telemetry.seconds(decide_ms))
            self.m.route.observe(telemetry.seconds(routing_ms))
            if state_age_ms is not None:
                self.m.state_age.observe(telemetry.seconds(state_age_ms))
            self.routed += 1
        self.log.debug("request_routed", request_id=rid, decision=d.decision, reason=d.reason, node=ack.node,
                      decode_node=d.decode_node, attempts=attempts, state_age_ms=state_age_ms)
        await self.publish(S.ROUTED_SUBJECT, RoutedEvent(
            request_id=rid, kind="deflect" if d.deflected else "keep", node=ack.node, decode_node=d.decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=ack.accepted_unix_ms,
            predicted_ttft_ms=predicted_ttft_ms(d), node_epoch_unix_ms=ack.epoch_unix_ms))
        try:
            await self.put_record(S.record_key(rid, "decision"), encode(rec), if_absent=duplicate)
        except Exception as exc:  # a record is advisory: the request is routed all the same
            self.log.warning("record_write_failed", request_id=rid, error=repr(exc))

    async def error(self, req: InferenceRequest, code: ErrorCode, message: str, span: Any = None) -> None:
        """End ``req`` with ``code`` (HTTP status ``code.status``) and ``message`` to its client."""
        self.m.errors.labels(code.value).inc()
        if span is not None:
            span.set_attribute("kairos.outcome", code.value)
            span.set_status(Status(StatusCode.ERROR, f"{code.value}: {message}"))
        self.log.warning("request_failed", request_id=req.request_id, code=code.value, message=message)
        await self.publish(S.out_subject(req.request_id, DISPATCHER), ErrorEvent(
            request_id=req.request_id, status=code.status, code=code, message=message,
            source=f"dispatcher:{self.replica_id}", sent_unix_ms=self.clock.now_ms()))


def set_decision_attributes(span: Any, d: Decision, state_age_ms: float | None, attempts: int,
                            excluded: dict[str, str], conflicts: list[str]) -> None:
    """The decision as ``kairos.*`` span attributes (docs/observability.md, "Tracing").

    Per-node maps are flattened (span attributes are scalars or homogeneous lists):
    ``kairos.ttft_decode_est_ms.<node>`` for every decode node with an estimate and
    ``kairos.decode_infeasible.<node>`` (the reason) for every node that could not take the
    deflection. Values equal the decision record (``GET /v1/requests/{id}``)."""
    attrs = {"kairos.decision": d.decision, "kairos.reason": d.reason, "kairos.node": d.node, "kairos.outcome": "routed",
             "kairos.decode_node": d.decode_node, "kairos.chunk_schedule": list(d.chunk_schedule),
             "kairos.predicted_step_ms": list(d.predicted_step_ms), "kairos.attempts": attempts,
             "kairos.model_version": d.model_version, "kairos.policy": d.policy}
    if d.ttft_prefill_est_ms is not None:
        attrs["kairos.ttft_prefill_est_ms"] = d.ttft_prefill_est_ms
    if d.kv_transfer_est_ms is not None:
        attrs["kairos.kv_transfer_est_ms"] = d.kv_transfer_est_ms
    if state_age_ms is not None:
        attrs["kairos.state_age_ms"] = state_age_ms
    for node, est in d.ttft_decode_est_ms.items():
        if est is not None:
            attrs[f"kairos.ttft_decode_est_ms.{node}"] = est
    for node, why in d.decode_infeasible.items():
        attrs[f"kairos.decode_infeasible.{node}"] = why
    if excluded:
        attrs["kairos.excluded"] = [f"{k}:{v}" for k, v in excluded.items()]
    if conflicts:
        attrs["kairos.reservation_conflicts"] = list(conflicts)
    span.set_attributes(attrs)
    span.set_status(Status(StatusCode.OK))
