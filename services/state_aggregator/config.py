"""State aggregator configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.envconfig import require


@dataclass(frozen=True)
class AggregatorConfig:
    """The state aggregator (one per cluster)."""

    nats_url: str = "nats://127.0.0.1:4222"
    state_period_ms: float = 100.0  #: heartbeat period the agents use (Δh); also the view write period
    stale_after_ms: float | None = None  #: no heartbeat for this long → stale (default 3 × state_period_ms)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  #: 0: any free port; -1: no metrics server
    trace_file: str | None = None  #: append finished spans as JSON lines here (kairos trace reads it)
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"  #: auto: console on a TTY, else JSON lines

    def __post_init__(self) -> None:
        require(self.state_period_ms > 0, "state_period_ms", "must be > 0")
        require(self.stale_after_ms is None or self.stale_after_ms > 0, "stale_after_ms", "must be > 0")
        require(-1 <= self.metrics_port <= 65535, "metrics_port", "must be -1..65535")
