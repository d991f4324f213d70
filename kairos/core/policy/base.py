"""Policy parameters and the decision value every policy returns.

One :class:`PolicyParams` object is shared by ``kairos decide``, the simulator and the dispatcher,
so α, β, τ and the TTFT SLO mean the same thing everywhere.
"""

from __future__ import annotations

import math
import msgspec

from kairos.core.vocabulary import PathKind

DEFAULT_CANDIDATES: tuple[int, ...] = (2048, 1024, 512, 256, 128)


class PolicyError(ValueError):
    """Unknown policy name, bad policy argument or invalid parameter value."""


class PolicyParams(msgspec.Struct, frozen=True):
    """Parameters of the deflection policies (paper §4, Algorithm 1).

    Attributes:
        alpha: α ≥ 1, deflect when TTFT_dec ≤ α·TTFT_pf (Eq. 7). Paper default 1.3.
        beta: β > 0, TBT safety factor: every predicted step must be ≤ β·τ (Eq. 5).
        tbt_slo_ms: τ, the TBT (ITL) SLO in ms. Paper: 70 ms.
        ttft_slo_ms: TTFT SLO in ms (Eq. 7 second clause). Paper: 4000 ms.
        chunk_candidates: 𝒳, candidate chunk sizes χ (total batch tokens per step), any order;
            used in descending order.
        prefill_chunk_tokens: χ_p, the prefill nodes' chunk size (vLLM max_num_batched_tokens).
        static_chunk_tokens: the fixed χ of the static policies SQ/SL (§3.4: 128) and Dynamo's
            local prefill (the decode engine's own budget).
        kv_transfer_aware: kairos+ — add the KV-transfer time (and link backlog) to TTFT_pf.
        project_decode_state: kairos+ — instead of the one-in-flight rule, project each decode
            node's (B, K) forward with the deflections already sent to it since its last heartbeat.
        link: KV-transfer link name of the profile used by kv_transfer_aware (None: default link).
        model_correction: kairos+ — apply each node's learned step-time correction (the snapshot's
            ``step_bias``/``step_safety``, kairos/core/model/correction.py): TTFT estimates (Eq. 1–3, 6) are
            scaled by the node's bias, and Eq. 5 checks ``T·step_safety ≤ β·τ``. Off: Algorithm 1
            as printed (the fields are ignored).
        flowing_decode: TaiChi (``taichi``) — keep-path requests decode on their prefill
            (P-heavy) node from the first token on and migrate their KV to a decode (D-heavy)
            node once at risk; prefill nodes' step budget is ``prefill_chunk_tokens``. Simulator
            only (the live node agents do not migrate decodes).
        flow_tpot_fraction: TaiChi flowing decode: a request on a P-heavy node starts migrating
            when its mean time per output token so far exceeds this × ``tbt_slo_ms``.
        prefix_aware: kairos+ — use the snapshot's per-node ``cached_prefix_tokens``: Eq. 1–3
            prefill only the chosen prefill node's uncached tokens and the keep path transfers only
            what its decode node lacks (the receiver is the node holding the longest prefix);
            Eq. 4–6 schedule only the decode node's uncached tokens, from its cached prefix c > 0.
            Off: caches are ignored (Algorithm 1 as printed).
    """

    alpha: float = 1.3
    beta: float = 1.0
    tbt_slo_ms: float = 70.0
    ttft_slo_ms: float = 4000.0
    chunk_candidates: tuple[int, ...] = DEFAULT_CANDIDATES
    prefill_chunk_tokens: int = 2048
    static_chunk_tokens: int = 128
    kv_transfer_aware: bool = False
    project_decode_state: bool = False
    link: str | None = None
    model_correction: bool = False
    flowing_decode: bool = False
    flow_tpot_fraction: float = 1.0
    prefix_aware: bool = False

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "tbt_slo_ms", "ttft_slo_ms"):
            if not math.isfinite(getattr(self, name)):
                raise PolicyError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.alpha >= 1.0:
            raise PolicyError(f"alpha must be >= 1 (paper §4.4), got {self.alpha}")
        if not self.beta > 0:
            raise PolicyError(f"beta must be > 0, got {self.beta}")
        if not self.tbt_slo_ms > 0:
            raise PolicyError(f"tbt_slo_ms must be > 0, got {self.tbt_slo_ms}")
        if not self.ttft_slo_ms > 0:
            raise PolicyError(f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        if not self.chunk_candidates or any(c <= 0 for c in self.chunk_candidates):
            raise PolicyError(f"chunk_candidates must be positive token counts, got {self.chunk_candidates}")
        if not (math.isfinite(self.flow_tpot_fraction) and self.flow_tpot_fraction > 0):
            raise PolicyError(f"flow_tpot_fraction must be > 0, got {self.flow_tpot_fraction}")
        if self.prefill_chunk_tokens <= 0 or self.static_chunk_tokens <= 0:
            raise PolicyError("prefill_chunk_tokens and static_chunk_tokens must be > 0")

    @property
    def step_limit_ms(self) -> float:
        """β·τ, the per-step latency bound of Eq. 5 (ms)."""
        return self.beta * self.tbt_slo_ms


#: the decision's path (one vocabulary with the wire and the lifecycle: kairos.core.vocabulary)
DecisionKind = PathKind


class Decision(msgspec.Struct, frozen=True, omit_defaults=False):
    """One routing decision (Algorithm 1's output plus why).

    Attributes:
        request_id: the routed request.
        policy: policy spec that decided (e.g. ``kairos``, ``sl:1024``).
        decision: ``deflect`` (chunked prefill on a decode node) or ``keep`` (prefill node).
        node: node that runs the prefill (a decode node when deflecting).
        decode_node: node that decodes; for ``keep`` the node receiving the KV cache.
        chunk_schedule: χ per step of the deflected prefill (total batch tokens incl. the B decode
            tokens); empty for keep.
        predicted_step_ms: predicted latency of each scheduled step, ms (Eq. 5 left-hand side).
        ttft_prefill_est_ms: TTFT_pf of the chosen (or best) prefill node, ms (Eq. 1), or None
            when the policy does not estimate it.
        ttft_decode_est_ms: decode node id → TTFT_dec (Eq. 6) in ms, or None when infeasible.
        decode_infeasible: decode node id → why it could not take the deflection.
        kv_transfer_est_ms: KV-transfer estimate of the keep path, ms (kairos+ and informational).
        reason: short machine-readable code (see docs/policies.md).
        model_version: latency-model artifact ``name@version``.
    """

    request_id: str
    policy: str
    decision: DecisionKind
    node: str
    decode_node: str
    reason: str
    chunk_schedule: list[int] = []
    predicted_step_ms: list[float] = []
    ttft_prefill_est_ms: float | None = None
    ttft_decode_est_ms: dict[str, float | None] = {}
    decode_infeasible: dict[str, str] = {}
    kv_transfer_est_ms: float | None = None
    model_version: str = ""

    @property
    def deflected(self) -> bool:
        """True for a deflection."""
        return self.decision == "deflect"
