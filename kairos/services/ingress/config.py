"""Ingress configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from kairos.runtime.envconfig import ServiceConfig, require
from kairos.core.model.latency import DEFAULT_PROFILE


@dataclass(frozen=True)
class IngressConfig(ServiceConfig):
    """The OpenAI-compatible HTTP front end (any number of replicas)."""

    host: str = "127.0.0.1"
    port: int = 8000  #: 0: any free port
    served_model: str = "kairos-emulated"  #: the model name clients must send (GET /v1/models)
    profile: str = DEFAULT_PROFILE  #: latency profile; its engine limits give max_model_len
    tokenizer_path: str | None = None  #: local tokenizer.json (HF tokenizers); None: documented estimate
    default_max_tokens: int = 16  #: OpenAI's default for /v1/completions
    request_timeout_s: float = 600.0  #: whole request; then 504 and a cancel to the nodes
    idle_timeout_s: float = 60.0  #: max silence between two events of one request; then 504
    replica_id: str = "ingress-0"
    #: re-submissions of a request whose node was lost before any token reached the client
    max_resubmits: int = 2
    #: migrations of a request whose node was lost after tokens reached the client (issue 33): it
    #: continues on another node from the tokens sent; then 503 ``migration_limit`` naming the attempts
    max_migrations: int = 3
    #: /health: cluster view older than this (ingress receive clock) is stale; 0: the view's own stale_after_ms
    view_stale_after_ms: float = 0.0
    #: /health: ping the dispatchers at most this often
    dispatcher_check_interval_s: float = 1.0
    #: /health: a dispatcher's answer to a ping this recent counts as a dispatcher taking requests
    dispatcher_active_window_s: float = 5.0
    #: how often in-flight requests are checked for a client that closed its connection
    disconnect_poll_s: float = 0.2
    #: larger request bodies (counted after gzip/deflate decoding) get 413 ``request_too_large`` naming
    #: this limit, before validation. 16 MiB: far above what can be routed (a prompt must fit one NATS
    #: message, 1 MiB by default; a JSON body of token ids is ~3x its bus size), small enough that no
    #: body makes the ingress parse and tokenize tens of MB (a 30 MB prompt tokenized for 27 s)
    max_body_bytes: int = 16 * 1024 * 1024
    #: a node silent (no heartbeat, no token) this long, or 3 of its heartbeat periods where that is longer,
    #: is dead: its in-flight requests are moved or ended (kairos/core/cluster/heartbeat.py Liveness)
    liveness_timeout_s: float = 3.0
    #: after a NATS reconnect, a routed request with no event for this long lost its stream: moved or ended
    outage_grace_s: float = 3.0
    #: NATS unreachable this long: every in-flight request ends with 503 bus_unavailable
    bus_outage_timeout_s: float = 10.0
    #: a request no dispatcher took (none answered ``taken`` within 0.5 s, or none subscribes) is sent
    #: again, the same bus id, for this long, waiting for a reconnect meanwhile; then 503
    enqueue_timeout_s: float = 15.0
    #: a taken request whose routing gave no sign for this long before a node accepted its job (no job, no error, no
    #: ``alive`` notice: its dispatcher died or was cut off) is sent again, the same bus id (its
    #: attempt's arbiter keeps copies to one run; kairos/services/ingress/liveness.py)
    route_stall_s: float = 3.0
    #: a node must answer a job the ingress sends it within this (s), else it may be running it and the
    #: attempt moves under a new id (kairos/services/ingress/jobrelay.py); as the dispatchers' own
    job_ack_timeout_s: float = 1.0
    #: admission: requests in flight at this replica at most; more get 429 ``overloaded`` with
    #: ``Retry-After`` at once (shed explicitly, never by letting the bus time out); 0: no limit
    max_in_flight: int = 512
    #: the ``Retry-After`` seconds of that 429
    overload_retry_after_s: int = 1
    #: heartbeats stamped further ahead of this clock are refused (tolerated clock skew), ms
    heartbeat_max_future_ms: float = 5000.0
    #: accepted API keys (``Authorization: Bearer <key>``), comma-separated in KAIROS_API_KEYS;
    #: with api_key_file, the union. None of either: the API is open (a warning is logged)
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    api_key_file: str | None = None  #: one key per line (blank lines and ``#`` comments ignored)
    #: a client must send its complete request line and headers within this many seconds of
    #: connecting (or of starting the next request on a kept-alive connection); else it is dropped
    header_timeout_s: float = 10.0
    #: reading the whole request body may take at most this long; else 408
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0  #: idle kept-alive connections are closed after this
    #: tokens per prefix-cache block hashed into each request (kairos/core/cluster/prefix_index.py; the engines' block
    #: size, vLLM's 16); 0: no hashes (prefix-aware policies then see no cache)
    prefix_block_tokens: int = 16
    #: token streams: one ``kairos.out.*`` subscription with in-process dispatch by request id (no
    #: SUB/UNSUB per request, issue 12); but every replica then receives every replica's events, so
    #: with many ingress replicas set False: one ``kairos.out.<id>`` subscription per request
    out_wildcard: bool = True
    #: the engines behind this ingress: ``vllm-cpu`` refuses up front, on every route, what vLLM-CPU
    #: cannot serve without dying (a ``seed`` with temperature > 0: 400 naming ``seed``,
    #: :func:`kairos.engines.vllm.api.unsafe_seed`); ``emulated`` and ``vllm`` (GPU) serve it
    engine_kind: Literal["emulated", "vllm", "vllm-cpu"] = "emulated"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port <= 65535, "port", "must be 0..65535")
        require(bool(self.served_model), "served_model", "must not be empty")
        require(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.idle_timeout_s > 0, "idle_timeout_s", "must be > 0")
        require(0 <= self.max_resubmits <= 10, "max_resubmits", "must be 0..10")
        require(0 <= self.max_migrations <= 10, "max_migrations", "must be 0..10")
        require(self.view_stale_after_ms >= 0, "view_stale_after_ms", "must be >= 0")
        require(self.dispatcher_check_interval_s > 0, "dispatcher_check_interval_s", "must be > 0")
        require(self.dispatcher_active_window_s > 0, "dispatcher_active_window_s", "must be > 0")
        require(self.disconnect_poll_s > 0, "disconnect_poll_s", "must be > 0")
        require(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
        require(self.liveness_timeout_s > 0, "liveness_timeout_s", "must be > 0")
        require(self.outage_grace_s > 0, "outage_grace_s", "must be > 0")
        require(self.bus_outage_timeout_s > 0, "bus_outage_timeout_s", "must be > 0")
        require(self.engine_kind in ("emulated", "vllm", "vllm-cpu"), "engine_kind",
                f"must be emulated, vllm or vllm-cpu, got {self.engine_kind!r}")
        require(self.enqueue_timeout_s > 0, "enqueue_timeout_s", "must be > 0")
        require(self.route_stall_s > 0, "route_stall_s", "must be > 0")
        require(self.job_ack_timeout_s > 0, "job_ack_timeout_s", "must be > 0")
        require(self.max_in_flight >= 0, "max_in_flight", "must be >= 0 (0: no limit)")
        require(self.overload_retry_after_s >= 1, "overload_retry_after_s", "must be >= 1")
        require(self.heartbeat_max_future_ms > 0, "heartbeat_max_future_ms", "must be > 0")
        require(all(k.strip() == k and k for k in self.api_keys), "api_keys",
                "keys must be non-empty and without surrounding spaces")
        require(self.header_timeout_s > 0, "header_timeout_s", "must be > 0")
        require(self.body_timeout_s > 0, "body_timeout_s", "must be > 0")
        require(self.keepalive_timeout_s > 0, "keepalive_timeout_s", "must be > 0")
