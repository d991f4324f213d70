"""Settings of one simulated run: cluster size, the dispatcher's view, ground truth, noise, rules.

Inputs: the ``kairos sim`` options (:mod:`kairos.cli.main`), the experiment runners
(:mod:`kairos.sim.experiments`) and the report generator. Outputs: one frozen :class:`SimConfig`
read by :class:`kairos.sim.simulator.Simulator` and the modules it drives (:mod:`kairos.sim.nodes`
builds the engines from it, :mod:`kairos.sim.view` the dispatcher's view). Times are ms unless a
name says s.
"""

from __future__ import annotations

from dataclasses import dataclass

from kairos.core.model.latency import LatencyModel
from kairos.core.workload.workloads import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class SimConfig:
    """Cluster and experiment settings.

    Attributes:
        n_prefill, n_decode: node counts (paper: 2P2D).
        heartbeat_ms: Δh, state refresh period of the dispatcher view; 0 = exact state (Oracle).
        link: KV-transfer link name from the profile (None: its default, the paper-calibrated one).
        tbt_guard: kairos+ node-side guard: decode engines shrink a deflected chunk whose predicted
            step would exceed β·τ at the current batch.
        truth: ground-truth latency model of the engines (None: the policy's model).
        truth_scale: every engine's steps take this × the truth model (1.1: 10 % slower).
        drift_node: node id (``decode-0``) that drifts; None: no drift.
        drift_scale: from ``drift_at_s`` on, ``drift_node``'s steps take this × longer (1.15).
        drift_at_s: simulated time (s) the drift starts.
        noise: σ of multiplicative log-normal noise on every step's latency (0: none).
        seed: RNG seed of the noise.
        correction_window_ms: sliding window of the model-correction estimator (ms).
        reservation_rule: apply the live dispatcher's reservation rule (kairos/core/cluster/routing.py rule 3)
            with ``deflection_slots`` per decode node; False: deflections queue on any node.
        deflection_slots: deflections per decode node under the rule; 0: the policy's live
            default (:func:`kairos.core.cluster.routing.deflection_slots`).
        prefix_caching: engines keep prefix caches (kairos/core/engine_model/prefix.py); requests with block
            hashes (the Mooncake trace) hit them. The dispatcher's prefix index is refreshed with
            the view (every Δh) from the engines' cache events.
        prefix_block_tokens: tokens per hashed block of the workload's ``block_hashes`` (the
            Mooncake trace: 512).
    """

    n_prefill: int = 2
    n_decode: int = 2
    heartbeat_ms: float = 100.0
    link: str | None = None
    tbt_guard: bool = False
    truth: LatencyModel | None = None
    truth_scale: float = 1.0
    drift_node: str | None = None
    drift_scale: float = 1.0
    drift_at_s: float = 0.0
    noise: float = 0.0
    seed: int = 0
    correction_window_ms: float = 10_000.0
    reservation_rule: bool = True
    deflection_slots: int = 0
    prefix_caching: bool = True
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS
