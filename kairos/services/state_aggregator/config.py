"""State aggregator configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass

from kairos.runtime.envconfig import MetricsServiceConfig, require


@dataclass(frozen=True)
class AggregatorConfig(MetricsServiceConfig):
    """The state aggregator (one per cluster)."""

    state_period_ms: float = 100.0  #: heartbeat period the agents use (Δh); also the view write period
    stale_after_ms: float | None = None  #: no heartbeat for this long → stale (default 3 × state_period_ms)
    correction_window_ms: float = 10_000.0  #: sliding window of the step-time correction (kairos/core/model/correction.py)
    #: TBT SLO τ in ms, made a bucket boundary of the decode-step histogram so that the share of
    #: engine decode steps above τ (Table 4's "% of decode steps") is read from it exactly
    tbt_slo_ms: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.state_period_ms > 0, "state_period_ms", "must be > 0")
        require(self.stale_after_ms is None or self.stale_after_ms > 0, "stale_after_ms", "must be > 0")
        require(self.correction_window_ms > 0, "correction_window_ms", "must be > 0")
        require(self.tbt_slo_ms is None or self.tbt_slo_ms > 0, "tbt_slo_ms", "must be > 0")
