"""Node agent configuration (env ``KAIROS_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kairos.engines import BACKENDS
from kairos.runtime.envconfig import MetricsServiceConfig, read_secret_file, require
from kairos.core.model.latency import DEFAULT_PROFILE
from kairos.contracts.subjects import check_token


@dataclass(frozen=True)
class AgentConfig(MetricsServiceConfig):
    """One node agent (one engine instance)."""

    node_id: str  #: node name, a subject token (``prefill-0``, ``decode-1``)
    role: Literal["prefill", "decode"]
    profile: str = DEFAULT_PROFILE  #: latency profile (bundled name or artifact path) of the emulated engine
    #: engine kind, a name of kairos.engines.BACKENDS: ``emulated`` (the engine model) or ``vllm`` (a vLLM server)
    backend: str = "emulated"
    #: vllm: the node's vLLM OpenAI server (``http://127.0.0.1:8100``), started with the kairos.engines.vllm.plugin plugin
    engine_url: str | None = None
    #: vllm: the plugin's engine-state stream (ZMQ, ``ipc:///tmp/kairos-decode-0.sock`` or ``tcp://host:port``);
    #: the same value as the engine's ``KAIROS_ENGINE_STATE_ADDR``
    engine_state_addr: str | None = None
    #: vllm: a file whose content (stripped) is the key the server requires (its ``VLLM_API_KEY``;
    #: ``kairos up`` generates one per server); every call to it then carries ``Authorization: Bearer``
    engine_api_key_file: str | None = None
    #: vllm: the key itself (prefer the file: environments leak); never logged
    engine_api_key: str | None = field(default=None, repr=False)
    #: vllm: no engine state for this long (ms; the plugin sends ≥ every 100 ms) → not accepting work
    engine_stale_after_ms: float = 2000.0
    state_period_ms: float = 100.0  #: heartbeat period (Δh)
    link: str | None = None  #: KV link name of the profile (None: its default link)
    kv_handoff_timeout_s: float = 2.0  #: prefill side: decode agent must accept a handoff within this
    kv_hold_timeout_s: float = 60.0  #: prefill side: free KV blocks whose decode node never confirmed the pull
    tbt_guard_ms: float | None = None  #: engine-side TBT guard for deflected chunks (kairos+), ms
    #: the guard is tbt_guard_ms / the node's learned step-time safety factor (kairos/core/model/correction.py)
    guard_correction: bool = True
    max_deflections: int = 1  #: deflections this decode node takes at once (kairos: 1, §5.3; kairos+: several)
    #: emulated engine's real step times: this artifact (bundled name or path) × ``truth_scale``;
    #: None: the ``profile`` itself (the node's predictions are then exact)
    truth_profile: str | None = None
    truth_scale: float = 1.0  #: emulated engine: steps take this × the truth (1.1: 10 % slower than predicted)
    #: a draining node (SIGTERM, ``kairos drain``) lets its running requests finish for this long (s),
    #: then moves what is left to other nodes and exits; its queued ones move at once (issue 33). The
    #: default outlasts a long request (thousands of tokens at tens of ms each); compose's
    #: stop_grace_period and the manifests' terminationGracePeriodSeconds are longer
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_token(self.node_id, "node id")
        except ValueError as exc:
            require(False, "node_id", str(exc))
        require(self.role in ("prefill", "decode"), "role", f"must be prefill or decode, got {self.role!r}")
        require(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        require(self.state_period_ms > 0, "state_period_ms", "must be > 0")
        require(self.max_deflections >= 1, "max_deflections", "must be >= 1")
        require(self.kv_handoff_timeout_s > 0, "kv_handoff_timeout_s", "must be > 0")
        require(self.kv_hold_timeout_s > 0, "kv_hold_timeout_s", "must be > 0")
        require(self.truth_scale > 0, "truth_scale", "must be > 0")
        require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0 (0: move everything at once)")
        require(self.engine_stale_after_ms > 0, "engine_stale_after_ms", "must be > 0")
        if self.backend == "vllm":
            require(bool(self.engine_url) and str(self.engine_url).startswith(("http://", "https://")), "engine_url",
                    f"backend vllm needs the vLLM server's URL (http://host:port), got {self.engine_url!r}")
            require(bool(self.engine_state_addr) and str(self.engine_state_addr).startswith(("ipc://", "tcp://")),
                    "engine_state_addr", "backend vllm needs the engine-state stream address (ipc://… or tcp://…), "
                    f"got {self.engine_state_addr!r}")
        require(not (self.engine_api_key and self.engine_api_key_file), "engine_api_key_file",
                "set either KAIROS_ENGINE_API_KEY or KAIROS_ENGINE_API_KEY_FILE, not both")

    def engine_key(self) -> str | None:
        """The vLLM server's API key: ``engine_api_key``, else the content of ``engine_api_key_file``
        (stripped), else None (an open server).

        Raises:
            ConfigError: the file cannot be read or is empty (the message names the variable, never the key).
        """
        if not self.engine_api_key_file:
            return self.engine_api_key or None
        return read_secret_file(self.engine_api_key_file, "engine_api_key_file")
