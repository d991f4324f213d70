"""The ingress's Prometheus metrics (docs/observability.md has the table; the Grafana dashboard reads them).

Where data comes from: the relay of each request (TTFT, TBT, end-to-end, errors by code), the
watchers of in-flight requests (nodes lost, streams interrupted, lane moves), the heartbeat intake
and the HTTP layer (auth failures, slow clients, overload shedding). Where it goes: ``GET /metrics``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kairos.core.cluster.heartbeat import REJECT_REASONS
from kairos.core.vocabulary import PathKind
from kairos.runtime import telemetry

#: reasons of ``kairos_ingress_dropped_events_total`` (kairos.services.ingress.lifecycle's drops worth counting)
DROP_REASONS = ("old_attempt", "foreign_node", "duplicate", "routed_elsewhere")


class IngressMetrics:
    """The ingress's Prometheus metrics, registered in ``reg`` (a ``CollectorRegistry``)."""

    def __init__(self, reg) -> None:
        T = telemetry
        self.requests = Counter("kairos_ingress_requests_total", "HTTP completion requests by endpoint and status",
                                ("endpoint", "status"), registry=reg)
        self.ttft = Histogram("kairos_ingress_ttft_seconds", "Time to first token as the client sees it",
                              registry=reg, buckets=T.TTFT_BUCKETS)
        self.tbt = Histogram("kairos_ingress_tbt_seconds", "Time between consecutive output tokens (per token)",
                             registry=reg, buckets=T.TBT_BUCKETS)
        self.e2e = Histogram("kairos_ingress_request_duration_seconds", "Request received to last token sent",
                             registry=reg, buckets=T.E2E_BUCKETS)
        self.inflight = Gauge("kairos_ingress_requests_in_flight", "Completion requests being served",
                              registry=reg)
        self.ttft_pred = Histogram("kairos_ingress_ttft_predicted_seconds",
                                   "The decision's TTFT estimate for the path taken (keep: Eq. 1 TTFT_pf; "
                                   "deflect: Eq. 6 TTFT_dec of the chosen node)", ("decision",), registry=reg,
                                   buckets=T.TTFT_BUCKETS)
        self.ttft_meas = Histogram("kairos_ingress_ttft_measured_seconds",
                                   "Measured TTFT of requests whose decision carried an estimate", ("decision",),
                                   registry=reg, buckets=T.TTFT_BUCKETS)
        self.ttft_err = Histogram("kairos_ingress_ttft_prediction_error_seconds",
                                  "Measured minus predicted TTFT (signed)", ("decision",), registry=reg,
                                  buckets=T.ERROR_SECONDS_BUCKETS)
        self.node_lost = Counter("kairos_ingress_node_lost_total",
                                 "In-flight requests whose node went stale or left the view, by outcome "
                                 "(resubmitted to the dispatchers, or failed with 503 node_lost)", ("outcome",),
                                 registry=reg)
        self.disconnects = Counter("kairos_ingress_client_disconnects_total",
                                   "Requests whose client closed the connection before the end (499)",
                                   ("endpoint", "stream"), registry=reg)
        self.interrupted = Counter("kairos_ingress_stream_interrupted_total",
                                   "In-flight requests whose token stream lost events (a bus outage), by outcome",
                                   ("outcome",), registry=reg)
        self.dropped = Counter("kairos_ingress_dropped_events_total",
                               "Out events not relayed, by reason (old_attempt, foreign_node: tokens of another "
                               "execution; duplicate; routed_elsewhere: a dispatcher's error for a copy of an "
                               "attempt a node had accepted)", ("reason",), registry=reg)
        self.hb_rejected = Counter("kairos_ingress_heartbeats_rejected_total",
                                   "Heartbeats refused by the liveness tracker, by reason", ("reason",), registry=reg)
        self.bus_down = Counter("kairos_ingress_bus_unavailable_total",
                                "Requests ended because NATS stayed unreachable", registry=reg)
        self.shed = Counter("kairos_ingress_overload_shed_total",
                            "Requests refused with 429 overloaded (max_in_flight reached)", registry=reg)
        self.enqueue_retries = Counter("kairos_ingress_enqueue_retries_total",
                                       "Enqueues re-sent because JetStream gave no acknowledgement", registry=reg)
        self.lane_moves = Counter("kairos_ingress_lane_moves_total",
                                  "Queued requests enqueued again on another request lane (theirs stalled: its "
                                  "NATS member died)", registry=reg)
        for outcome in ("resubmitted", "failed"):
            self.node_lost.labels(outcome)
            self.interrupted.labels(outcome)
        for r in DROP_REASONS:
            self.dropped.labels(r)
        for r in REJECT_REASONS:
            self.hb_rejected.labels(r)
        self.auth_failures = Counter("kairos_ingress_auth_failures_total",
                                     "Requests refused with 401 (API key missing or invalid)", ("reason",),
                                     registry=reg)
        self.slow_clients = Counter("kairos_ingress_slow_clients_dropped_total",
                                    "Connections closed because their request head did not arrive within "
                                    "header_timeout_s", registry=reg)

    def observe_prediction(self, kind: PathKind, pred_ms: float, ttft_ms: float) -> None:
        """Predicted vs measured TTFT: the dispatcher's estimate for the path taken (``pred_ms``,
        decision ``kind``, carried by the routing event of the attempt that served the request)
        against the TTFT the client saw (``ttft_ms``)."""
        self.ttft_pred.labels(kind).observe(telemetry.seconds(pred_ms))
        self.ttft_meas.labels(kind).observe(telemetry.seconds(ttft_ms))
        self.ttft_err.labels(kind).observe(telemetry.seconds(ttft_ms - pred_ms))
