"""The dispatcher's Prometheus metrics: one object per replica, registered on its telemetry registry.

Names, types and labels are the contract of docs/observability.md and the Grafana dashboard
(tests/unit/test_observability_catalog.py checks both against what is registered here).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kairos.runtime import telemetry


class DispatcherMetrics:
    """The dispatcher's Prometheus metrics (docs/observability.md has the table), on registry ``reg``."""

    def __init__(self, reg: CollectorRegistry) -> None:
        T = telemetry
        self.decisions = Counter("kairos_dispatcher_decisions_total", "Requests routed, by the decision carried out",
                                 ("policy", "decision", "reason"), registry=reg)
        self.decide = Histogram("kairos_dispatcher_decision_seconds",
                                "Policy evaluation time per routed request (all attempts)", registry=reg,
                                buckets=T.DECIDE_BUCKETS)
        self.route = Histogram("kairos_dispatcher_routing_seconds", "Dequeue to a node accepting the job",
                               registry=reg, buckets=T.ROUTING_BUCKETS)
        self.state_age = Histogram("kairos_dispatcher_decision_state_age_seconds",
                                   "Age of the cluster state a routed decision used", registry=reg,
                                   buckets=T.STATE_AGE_BUCKETS)
        self.conflicts = Counter("kairos_dispatcher_reservation_conflicts_total",
                                 "Deflections that found the decode node's slots taken (node_refused: the node "
                                 "refused it, deflection_in_flight — another replica's deflection got there first)",
                                 ("source",), registry=reg)
        for source in ("node_refused",):  # known label values start at 0 (rate() works at once)
            self.conflicts.labels(source)
        self.reroutes = Counter("kairos_dispatcher_reroutes_total", "Jobs re-routed after a node refused or was silent",
                                ("why",), registry=reg)
        self.bus_retries = Counter("kairos_dispatcher_bus_retries_total",
                                   "Jobs sent again, the node not excluded, after a bus fault (no responders: its "
                                   "agent reconnecting, a NATS cluster failing over)", ("why",), registry=reg)
        self.errors = Counter("kairos_dispatcher_errors_total", "Requests answered with an error", ("code",),
                              registry=reg)
        self.redeliveries = Counter("kairos_dispatcher_redeliveries_total",
                                    "Requests received again (their ingress heard nothing of an earlier copy's "
                                    "routing in time)", registry=reg)
        self.duplicates = Counter("kairos_dispatcher_duplicates_total",
                                  "Requests whose node answered duplicate (a copy sent again reached the node "
                                  "running it): routing event published again, no new decision counted", registry=reg)
        self.expired = Counter("kairos_dispatcher_expired_total",
                               "Requests dequeued after their deadline (the ingress had answered 504)", registry=reg)
        self.stale_copies = Counter("kairos_dispatcher_stale_copies_total",
                                    "Requests dropped unanswered because they arrived long after they were sent "
                                    "(this replica was frozen or cut off: the ingress sent other copies)", registry=reg)
        self.inflight = Gauge("kairos_dispatcher_requests_in_flight", "Requests being routed by this replica",
                              registry=reg)
