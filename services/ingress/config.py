"""Ingress configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.envconfig import ServiceConfig, require
from shared.latency import DEFAULT_PROFILE


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

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", "must be 0..65535")
        require(bool(self.served_model), "served_model", "must not be empty")
        require(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.idle_timeout_s > 0, "idle_timeout_s", "must be > 0")
