"""The node agent's Prometheus metrics, all labelled by ``node`` (docs/observability.md lists them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kairos.runtime import telemetry


class AgentMetrics:
    """The node agent's Prometheus metrics, all labelled by ``node`` (docs/observability.md)."""

    def __init__(self, reg: CollectorRegistry, node: str) -> None:
        T = telemetry
        lbl = {"labelnames": ("node",), "registry": reg}
        self.jobs = Counter("kairos_agent_jobs_total", "Jobs received, by kind and outcome", ("node", "kind", "outcome"),
                            registry=reg)
        self.steps = Counter("kairos_agent_steps_total", "Engine steps executed", **lbl)
        self.step = Histogram("kairos_agent_step_seconds", "Engine step wall time", buckets=T.STEP_BUCKETS, **lbl)
        self.tokens = Counter("kairos_agent_tokens_total", "Output tokens emitted", **lbl)
        self.kv_transfers = Counter("kairos_agent_kv_transfers_total", "KV caches pulled (decode side)", **lbl)
        self.kv = Histogram("kairos_agent_kv_transfer_seconds", "KV transfer including waiting for the link",
                            buckets=T.KV_TRANSFER_BUCKETS, **lbl)
        self.chunks = Counter("kairos_agent_deflected_chunks_total", "Deflected chunked-prefill steps run", **lbl)
        self.chunk_pred = Histogram("kairos_agent_chunk_step_predicted_seconds",
                                    "Deflected chunk steps: the dispatcher's predicted step latency (Eq. 5)",
                                    buckets=T.STEP_BUCKETS, **lbl)
        self.chunk_meas = Histogram("kairos_agent_chunk_step_measured_seconds",
                                    "Deflected chunk steps: measured step latency", buckets=T.STEP_BUCKETS, **lbl)
        self.chunk_err = Histogram("kairos_agent_chunk_step_error_ratio",
                                   "Deflected chunk steps: (measured - predicted) / predicted; predictor=decision "
                                   "is the dispatcher's Eq. 5 value (stale state + model error), predictor=engine "
                                   "the latency model on the batch actually run (model error only)",
                                   ("node", "predictor"), registry=reg, buckets=T.ERROR_RATIO_BUCKETS)
        self.overlap = Counter("kairos_agent_deflect_overlap_total",
                               "Deflect jobs that arrived while every deflection slot here was taken (refused, re-routed)", **lbl)
        self.inflight = Gauge("kairos_agent_requests_in_flight", "Requests this node holds (any phase)", **lbl)
        self.batch = Gauge("kairos_agent_batch_size", "Running decodes (B)", **lbl)
        self.kv_tokens = Gauge("kairos_agent_kv_tokens", "KV tokens of running decodes (K)", **lbl)
        self.queue = Gauge("kairos_agent_queue_prompt_tokens", "Prefill tokens queued", **lbl)
        self.draining = Gauge("kairos_agent_draining", "1 while this node drains (SIGTERM, kairos drain)", **lbl)
        self.node = node
        for m in (self.steps, self.step, self.tokens, self.kv_transfers, self.kv, self.chunks, self.chunk_pred,
                  self.chunk_meas, self.overlap, self.inflight, self.batch, self.kv_tokens, self.queue, self.draining):
            m.labels(node)  # this node's series exist (at 0) from the start
        for predictor in ("decision", "engine"):
            self.chunk_err.labels(node, predictor)
