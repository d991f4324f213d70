"""The simulated cluster's nodes: one engine model per prefill and decode node, with its ground truth.

Inputs: :class:`~kairos.sim.config.SimConfig` (node counts, truth, bias, drift, noise, seed,
the node-side guard, prefix caching), the policy's latency model and its parameters, and the
simulator's virtual clock (ms; a drift starts at a virtual time). Outputs: :class:`SimNodes`, the
:class:`~kairos.core.engine_model.Engine` of every node, each planning with the policy's model and
advancing by its own :class:`~kairos.core.engine_model.GroundTruth` (None: the exact-model run, where the
prediction is the truth) and the seeded multiplicative log-normal noise shared by all nodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kairos.core.engine_model import Engine, EngineConfig, GroundTruth
from kairos.core.model.latency import LatencyModel
from kairos.core.policy import PolicyParams
from kairos.sim.config import SimConfig


@dataclass
class SimNodes:
    """The engines of a simulated cluster, by node index, and their ids (``prefill-0``, ``decode-0``)."""

    prefill_ids: list[str]
    decode_ids: list[str]
    prefill: list[Engine]
    decode: list[Engine]
    #: the decode nodes' kairos+ TBT guard before any correction, ms (β·τ); None when it is off
    guard_ms: float | None


def build_nodes(cfg: SimConfig, model: LatencyModel, params: PolicyParams, clock: Callable[[], float]) -> SimNodes:
    """Build every node's engine for one run.

    ``params`` are the policy's effective parameters (TaiChi's ``flowing_decode`` makes prefill
    nodes P-heavy instances with step budget ``prefill_chunk_tokens``); ``clock`` returns the
    virtual time in ms.

    Raises:
        ValueError: fewer than one prefill or decode node, or a drift node that is not a node.
    """
    if cfg.n_prefill < 1 or cfg.n_decode < 1:
        raise ValueError("need at least one prefill and one decode node")
    truth = cfg.truth or model
    prefill_ids = [f"prefill-{i}" for i in range(cfg.n_prefill)]
    decode_ids = [f"decode-{i}" for i in range(cfg.n_decode)]
    if cfg.drift_node is not None and cfg.drift_node not in prefill_ids + decode_ids:
        raise ValueError(f"drift node {cfg.drift_node!r} is not one of {prefill_ids + decode_ids}")

    def ground_truth(node: str) -> GroundTruth | None:
        drifts = node == cfg.drift_node and cfg.drift_scale != 1.0
        if truth is model and cfg.truth_scale == 1.0 and not drifts:
            return None  # the exact-model run: the engine's prediction is the truth (no second evaluation)
        return GroundTruth(truth, scale=cfg.truth_scale, drift_scale=cfg.drift_scale if drifts else 1.0,
                           drift_at_ms=cfg.drift_at_s * 1000.0 if drifts else math.inf, clock=clock)

    rng = np.random.default_rng(cfg.seed)
    noise = None
    if cfg.noise > 0:
        sigma = cfg.noise

        def noise(ms: float) -> float:
            return ms * math.exp(sigma * rng.standard_normal() - sigma * sigma / 2)

    guard = params.step_limit_ms if cfg.tbt_guard else None
    pc = dict(prefix_block_tokens=cfg.prefix_block_tokens, prefix_caching=cfg.prefix_caching)
    pcfg = EngineConfig.from_limits("prefill", truth.engine, **pc)
    if params.flowing_decode:  # TaiChi P-heavy instances: the chunk-size slider
        pcfg = dataclasses.replace(pcfg, max_num_batched_tokens=max(params.prefill_chunk_tokens, pcfg.max_num_seqs))
    prefill = [Engine(pcfg, model, step_noise=noise, truth=ground_truth(n)) for n in prefill_ids]
    dcfg = EngineConfig.from_limits("decode", truth.engine, **pc)
    decode = [Engine(dcfg, model, step_noise=noise, tbt_guard_ms=guard, truth=ground_truth(n)) for n in decode_ids]
    return SimNodes(prefill_ids, decode_ids, prefill, decode, guard)
