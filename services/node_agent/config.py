"""Node agent configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.envconfig import MetricsServiceConfig, require
from shared.latency import DEFAULT_PROFILE
from shared.subjects import check_token


@dataclass(frozen=True)
class AgentConfig(MetricsServiceConfig):
    """One node agent (one engine instance)."""

    node_id: str  #: node name, a subject token (``prefill-0``, ``decode-1``)
    role: Literal["prefill", "decode"]
    profile: str = DEFAULT_PROFILE  #: latency profile (bundled name or artifact path) of the emulated engine
    backend: Literal["emulated"] = "emulated"
    state_period_ms: float = 100.0  #: heartbeat period (Δh)
    link: str | None = None  #: KV link name of the profile (None: its default link)
    kv_handoff_timeout_s: float = 2.0  #: prefill side: decode agent must accept a handoff within this
    kv_hold_timeout_s: float = 60.0  #: prefill side: free KV blocks whose decode node never confirmed the pull
    tbt_guard_ms: float | None = None  #: engine-side TBT guard for deflected chunks (kairos+), ms
    #: the guard is tbt_guard_ms / the node's learned step-time safety factor (shared/correction.py)
    guard_correction: bool = True
    max_deflections: int = 1  #: deflections this decode node takes at once (kairos: 1, §5.3; kairos+: several)
    #: emulated engine's real step times: this artifact (bundled name or path) × ``truth_scale``;
    #: None: the ``profile`` itself (the node's predictions are then exact)
    truth_profile: str | None = None
    truth_scale: float = 1.0  #: emulated engine: steps take this × the truth (1.1: 10 % slower than predicted)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_token(self.node_id, "node id")
        except ValueError as exc:
            require(False, "node_id", str(exc))
        require(self.role in ("prefill", "decode"), "role", f"must be prefill or decode, got {self.role!r}")
        require(self.state_period_ms > 0, "state_period_ms", "must be > 0")
        require(self.max_deflections >= 1, "max_deflections", "must be >= 1")
        require(self.kv_handoff_timeout_s > 0, "kv_handoff_timeout_s", "must be > 0")
        require(self.kv_hold_timeout_s > 0, "kv_hold_timeout_s", "must be > 0")
        require(self.truth_scale > 0, "truth_scale", "must be > 0")
