"""The ingress's Prometheus metrics (docs/observability.md has the ``kairos_*`` table, docs/metrics.md the
vLLM-named ``kairos:*`` families; the Grafana dashboards in ops/grafana read them).

Where data comes from: the relay of each request (TTFT, TBT, end-to-end, errors by code), the
watchers of in-flight requests (nodes lost, streams interrupted, routings sent again), the heartbeat intake
and the HTTP layer (auth failures, slow clients, overload shedding). Where it goes: ``GET /metrics``.

The request-level families of vLLM 0.32's frontend (:class:`VllmRequestMetrics`) are exported under
the same names with ``kairos:`` for ``vllm:``, the same label names (``model_name``, ``engine``, and
``finished_reason`` on ``request_success``) and the same buckets (vllm/v1/metrics/loggers.py,
``PrometheusStatLogger``; vllm/v1/metrics/buckets.py), so a dashboard made for vLLM works on the
ingress by changing the prefix.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kairos.contracts.errors import ErrorCode
from kairos.core.cluster.heartbeat import REJECT_REASONS
from kairos.core.vocabulary import PathKind
from kairos.runtime import telemetry

#: reasons of ``kairos:request_migrations_total`` (the lifecycle's ``Migrate.why`` codes)
MIGRATION_REASONS = ("node_lost", "node_shutdown", "engine_error", "stream_interrupted", "kv_handoff_failed")
#: reasons of ``kairos_ingress_dropped_events_total`` (kairos.services.ingress.lifecycle's drops worth counting)
DROP_REASONS = ("old_attempt", "foreign_node", "duplicate", "routed_elsewhere")


class IngressMetrics:
    """The ingress's Prometheus metrics, registered in ``reg`` (a ``CollectorRegistry``).

    ``model_name``, ``engine``, ``max_model_len`` and ``flights`` are those of
    :class:`VllmRequestMetrics` (``self.vllm``).
    """

    def __init__(self, reg, *, model_name: str, engine: str, max_model_len: int,
                 flights: Callable[[], Iterable[Any]] = tuple) -> None:
        T = telemetry
        #: the vLLM-named request families (``kairos:*``; :class:`VllmRequestMetrics`)
        self.vllm = VllmRequestMetrics(reg, model_name=model_name, engine=engine, max_model_len=max_model_len,
                                       flights=flights)
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
        self.route_resends = Counter("kairos_ingress_route_resends_total",
                                     "Queued requests sent to the dispatchers again (their routing went silent: "
                                     "its dispatcher or NATS member died)", registry=reg)
        self.jobs = Counter("kairos_ingress_jobs_total",
                            "Jobs the dispatchers handed to this ingress for its requests (issue 34), by what "
                            "became of them: accepted / refused by the node, no_responders (no agent), silent "
                            "(no answer in time: the attempt moved), not_sent (the attempt ran elsewhere, "
                            "moved or ended)", ("answer",), registry=reg)
        #: issue 33: requests continued on another node once output had reached the client (Dynamo's
        #: migration), by the code of why their node was left
        migrations = Counter("kairos:request_migrations", "Requests continued on another node after output "
                             "reached the client, by why their node was left", (*VLLM_LABELS, "reason"), registry=reg)
        self.migrations = {r: migrations.labels(model_name, engine, r) for r in MIGRATION_REASONS}
        for outcome in ("resubmitted", "migrated", "failed"):
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
        decision ``kind``, carried by the job of the attempt that served the request)
        against the TTFT the client saw (``ttft_ms``)."""
        self.ttft_pred.labels(kind).observe(telemetry.seconds(pred_ms))
        self.ttft_meas.labels(kind).observe(telemetry.seconds(ttft_ms))
        self.ttft_err.labels(kind).observe(telemetry.seconds(ttft_ms - pred_ms))


# --- the vLLM-named request families ------------------------------------------------------------------

#: label names of every ``kairos:*`` family, as vLLM's ``PrometheusStatLogger`` has them
#: (vllm/v1/metrics/loggers.py: ``labelnames = ["model_name", "engine"]``)
VLLM_LABELS = ("model_name", "engine")
#: values of ``finished_reason`` (vLLM's ``FinishReason``, vllm/v1/engine/__init__.py, all pre-created)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
#: vllm/v1/metrics/buckets.py ``TIME_TO_FIRST_TOKEN_BUCKETS`` (seconds; up to 2,560 s)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: vllm/v1/metrics/buckets.py ``INTER_TOKEN_LATENCY_BUCKETS`` (seconds; also time per output token)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
#: vllm/v1/metrics/buckets.py ``REQUEST_LATENCY_BUCKETS`` (seconds; e2e and the request phases)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
RUNNING_HELP = ("Requests past their first token: the ingress relays their tokens (vLLM: requests in model "
                "execution batches; here the first token of the current attempt has arrived and the request has "
                "not finished)")
WAITING_HELP = ("Requests accepted by the ingress with no first token yet: queued for a dispatcher, or in a "
                "node's queue or prefill (vLLM: requests waiting to be processed)")


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``request_tokens`` bucket family: 1, 2, 5, 10, 20, 50, … up to ``max_model_len``
    (vllm/v1/metrics/buckets.py ``build_1_2_5_buckets``). Raises ValueError if it is below 1."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class SchedulerState(Collector):
    """``kairos:num_requests_running`` / ``kairos:num_requests_waiting``, counted over the in-flight
    registry when scraped (so they can never drift): ``flights()`` yields the in-flight requests
    (:class:`~.flights.Flight`; one whose lifecycle has received a token of its current attempt is
    running, else waiting; a request re-submitted after losing its node waits again)."""

    def __init__(self, labels: tuple[str, str], flights: Callable[[], Iterable[Any]]) -> None:
        self._labelnames = VLLM_LABELS  # read by kairos.runtime.telemetry.metric_names
        self.labels, self.flights = list(labels), flights

    def _families(self, running: int, waiting: int) -> list[GaugeMetricFamily]:
        out = []
        for name, doc, value in (("kairos:num_requests_running", RUNNING_HELP, running),
                                 ("kairos:num_requests_waiting", WAITING_HELP, waiting)):
            fam = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            fam.add_metric(self.labels, value)
            out.append(fam)
        return out

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families(0, 0)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = waiting = 0
        for f in self.flights():
            if f.lc.received > 0:
                running += 1
            else:
                waiting += 1
        yield from self._families(running, waiting)


class VllmRequestMetrics:
    """The request-level families of vLLM 0.32's ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py),
    named ``kairos:<name>`` for ``vllm:<name>``, as the ingress sees its requests (docs/metrics.md).

    Every child carries ``model_name`` (the served model) and ``engine`` (vLLM: the engine-core
    index; here the ingress replica that observed it); all are created up front, as vLLM does.

    Args:
        reg: the ``CollectorRegistry``.
        model_name: the served model (``IngressConfig.served_model``).
        engine: the ``engine`` label value (the ingress's ``replica_id``).
        max_model_len: top of the token-count buckets (vLLM: 1-2-5 buckets up to max_model_len).
        flights: the in-flight requests, for the running/waiting gauges (:class:`SchedulerState`).

    Where data comes from: :meth:`tokens` (the relay, at each token event it relays) and
    :meth:`finished` (:func:`~.records.write_ingress_record`, when a request ends).
    """

    def __init__(self, reg, *, model_name: str, engine: str, max_model_len: int,
                 flights: Callable[[], Iterable[Any]] = tuple) -> None:
        lv = (model_name, engine)
        tok_b = request_tokens_buckets(max_model_len)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, VLLM_LABELS, registry=reg).labels(*lv)

        def hist(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, VLLM_LABELS, registry=reg, buckets=buckets).labels(*lv)

        reg.register(SchedulerState(lv, flights))
        self.prompt_tokens = counter("kairos:prompt_tokens", "Number of prefill tokens processed (counted at "
                                     "each attempt's first token: its prompt was prefilled)")
        self.generation_tokens = counter("kairos:generation_tokens", "Number of generation tokens processed "
                                         "(counted as their token events arrive)")
        self.prefix_cache_queries = counter("kairos:prefix_cache_queries", "Prefix cache queries, in terms of "
                                            "number of queried tokens (prompt tokens of completed requests)")
        self.prefix_cache_hits = counter("kairos:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                         "cached tokens (usage.prompt_tokens_details.cached_tokens of completed "
                                         "requests)")
        self.prompt_tokens_cached = counter("kairos:prompt_tokens_cached", "Number of cached prompt tokens "
                                            "(local + external; the answers' cached_tokens)")
        success = Counter("kairos:request_success", "Count of successfully processed requests (finished_reason: "
                          "the answer's stop/length/abort; abort also for a client that left (499) and a choice stopped "
                          "because another of its request failed (sibling_failed); error for an "
                          "accepted request answered with an error)", (*VLLM_LABELS, "finished_reason"), registry=reg)
        self.success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        self.ttft = hist("kairos:time_to_first_token_seconds", "Histogram of time to first token in seconds "
                         "(request received to its first token relayed)", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = hist("kairos:inter_token_latency_seconds", "Histogram of inter-token latency in seconds "
                        "(one per token event after the first: an engine step's tokens)", INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("kairos:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                         "per request (first to last token over completion tokens - 1)", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("kairos:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds "
                        "(request received to its end)", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("kairos:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                "request (first to last token)", REQUEST_LATENCY_BUCKETS)
        self.req_prompt = hist("kairos:request_prompt_tokens", "Number of prefill tokens processed (per request)",
                               tok_b)
        self.req_generation = hist("kairos:request_generation_tokens", "Number of generation tokens processed (per "
                                   "request: the tokens the client got)", tok_b)
        self.prefill_computed = hist("kairos:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                     "computed during prefill (excluding cached tokens; completed requests)", tok_b)

    def tokens(self, first: bool, gap_ms: float, count: int, prompt_tokens: int) -> None:
        """A token event of ``count`` tokens was relayed, ``gap_ms`` after the request was received
        (``first``: the first token of its attempt, a TTFT; its ``prompt_tokens`` were prefilled) or
        after the previous token event (an inter-token latency: vLLM observes one per engine step
        output, and one token event carries one engine step's tokens)."""
        if first:
            self.ttft.observe(telemetry.seconds(gap_ms))
            self.prompt_tokens.inc(prompt_tokens)
        else:
            self.itl.observe(telemetry.seconds(gap_ms))
        self.generation_tokens.inc(count)

    def finished(self, timing: dict[str, Any]) -> None:
        """An accepted request ended; ``timing`` is its ingress timing dict (``received_unix_ms``,
        ``finished_unix_ms``, ``status``, ``prompt_tokens``, ``completion_tokens``, and when there
        were ``first_token_unix_ms``, ``finish_reason``, ``cached_tokens``).

        finished_reason: the answer's (status 200), ``abort`` for a client that left (499) and for a
        choice of a fanned-out request stopped because another failed (``error`` ``sibling_failed``,
        kairos/services/ingress/fanout.py: vLLM's label of a request aborted before its end), ``error``
        for any other error answer. Per-request phase times need a first token; the
        prefix-cache counters need the answer's usage (status 200)."""
        status = timing.get("status", 200)
        aborted = status == 499 or timing.get("error") == ErrorCode.SIBLING_FAILED
        reason = timing.get("finish_reason") if status == 200 else ("abort" if aborted else "error")
        self.success.get(reason, self.success["error"]).inc()
        received, done = timing["received_unix_ms"], timing.get("finished_unix_ms")
        if done is not None:
            self.e2e.observe(telemetry.seconds(done - received))
        prompt, completion = timing.get("prompt_tokens", 0), timing.get("completion_tokens", 0)
        self.req_prompt.observe(prompt)
        self.req_generation.observe(completion)
        first = timing.get("first_token_unix_ms")
        if first is not None and done is not None:
            decode_s = telemetry.seconds(done - first)
            self.decode_time.observe(decode_s)
            self.tpot.observe(decode_s / (completion - 1) if completion > 1 else 0.0)
        cached = timing.get("cached_tokens")
        if status == 200 and cached is not None:
            self.prefix_cache_queries.inc(prompt)
            self.prefix_cache_hits.inc(cached)
            self.prompt_tokens_cached.inc(cached)
            self.prefill_computed.observe(max(prompt - cached, 0))
