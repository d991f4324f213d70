"""Dispatcher configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kairos.contracts.subjects import SubjectError, check_token
from kairos.runtime.envconfig import MetricsServiceConfig, require
from kairos.core.model.latency import DEFAULT_PROFILE
from kairos.core.policy import DEFAULT_PARAMS, DEFAULT_POLICY, PolicyError, PolicyParams, parse_policy
from kairos.core.policy.registry import SHARED_PARAMS


@dataclass(frozen=True)
class DispatcherConfig(MetricsServiceConfig):
    """One dispatcher replica (any number share the requests, as one queue group)."""

    #: shown in decision records and spans, and a token of the replica's NATS client name and of its records' and
    #: error events' source (``dispatcher:<id>``): a subject token, as node ids (kairos.contracts.subjects.check_token)
    replica_id: str = f"dispatcher-{os.getpid()}"
    #: a live policy of the policy table (kairos.core.policy.registry.POLICIES), e.g. ``kairos+``, ``sl:1024``
    policy: str = DEFAULT_POLICY
    profile: str = DEFAULT_PROFILE  #: latency profile (bundled name or artifact path)
    alpha: float = DEFAULT_PARAMS.alpha  #: α, Eq. 7 TTFT margin (kairos.core.policy.base.PolicyParams)
    beta: float = DEFAULT_PARAMS.beta  #: β, TBT safety factor (Eq. 5)
    tbt_slo_ms: float = DEFAULT_PARAMS.tbt_slo_ms  #: τ, TBT SLO, ms
    ttft_slo_ms: float = DEFAULT_PARAMS.ttft_slo_ms  #: TTFT SLO, ms
    link: str | None = None  #: KV link of the profile used by kv-transfer-aware policies
    job_ack_timeout_s: float = 1.0  #: a node must accept/refuse a job within this, else re-route
    reservation_ttl_s: float = 30.0  #: floor of a deflection reservation's TTL
    #: deflection slots per decode node; must equal the node agents' ``max_deflections`` (both default
    #: to 1, §5.3); ``kairos up`` sets both to the policy's ``PolicySpec.deflection_slots`` (kairos+: 4)
    max_deflections_per_node: int = 1
    no_node_wait_s: float = 2.0  #: wait this long for a routable node before answering 503
    #: … and this long (s) for a migrated request's continuation (issue 33): its client holds part of
    #: the answer, so a pause of the only decode node must not cut the stream (within its deadline)
    migration_node_wait_s: float = 30.0
    #: a job that reached no agent (no responders: its agent is reconnecting) is sent again, the
    #: live node not excluded, for at most this long per request (kairos/services/dispatcher/busretry.py); 0: never
    bus_retry_s: float = 5.0
    max_concurrency: int = 64  #: requests routed concurrently by this replica
    #: hot-reload the latency model from KV ``kairos_models``/``latency.current`` (``kairos profile --publish``)
    watch_models: bool = True
    #: tokens per prefix-cache block the ingress hashes and the engines cache (the prefix-aware
    #: policies': ``PolicySpec.needs_prefix_index``); must equal the ingress's ``KAIROS_PREFIX_BLOCK_TOKENS``
    prefix_block_tokens: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_token(self.replica_id, "replica id")
        except SubjectError as exc:
            require(False, "replica_id", str(exc))
        try:
            parse_policy(self.policy, live=True)
        except PolicyError as exc:
            require(False, "policy", str(exc))
        try:
            self.params()
        except PolicyError as exc:
            bad = next((f for f in SHARED_PARAMS if str(exc).startswith(f)), "policy")
            require(False, bad, str(exc))
        require(self.job_ack_timeout_s > 0, "job_ack_timeout_s", "must be > 0")
        require(self.max_deflections_per_node >= 1, "max_deflections_per_node", "must be >= 1")
        require(self.reservation_ttl_s >= 1, "reservation_ttl_s", "must be >= 1 (the bus TTL unit is 1 s)")
        require(self.no_node_wait_s >= 0, "no_node_wait_s", "must be >= 0")
        require(self.migration_node_wait_s >= 0, "migration_node_wait_s", "must be >= 0")
        require(self.bus_retry_s >= 0, "bus_retry_s", "must be >= 0")
        require(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")

    def params(self, prefill_chunk_tokens: int = DEFAULT_PARAMS.prefill_chunk_tokens) -> PolicyParams:
        """The shared policy parameters (α, β, τ, TTFT SLO) of this replica."""
        return PolicyParams(alpha=self.alpha, beta=self.beta, tbt_slo_ms=self.tbt_slo_ms, ttft_slo_ms=self.ttft_slo_ms,
                            prefill_chunk_tokens=prefill_chunk_tokens, link=self.link)
