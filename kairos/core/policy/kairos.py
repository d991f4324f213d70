"""Kairos deflection decision: Algorithm 1 with Eq. 1–7 (paper §4.4), and kairos+ (§7 future work).

``kairos`` is Algorithm 1 as printed, with the one-in-flight-deflection rule of §5.3/§7: a decode
node whose deflected prefill has not finished is skipped (reason ``deflection_in_flight``).

``kairos+`` switches (each a :class:`PolicyParams` field, measured separately in the report):

* ``kv_transfer_aware``: TTFT_pf also counts the KV transfer of the request's cache (link model)
  and the node's queued transfer work — Table 3 shows transfer dominates P95 TTFT, yet Eq. 1
  omits it.
* ``project_decode_state``: instead of skipping a node with deflections in flight, project its
  state: the in-flight deflected prefills run first (the engine serves deflections FIFO), their
  time is added to the candidate's TTFT, and each one joins the decode batch (B + 1, K + ℓ).
* ``model_correction``: per node, Eq. 5 checks ``T·step_safety ≤ β·τ`` (i.e. the schedule is
  searched under the limit ``β·τ / step_safety``) and Eq. 6's TTFT and the predicted step times
  are scaled by ``step_bias`` — the node's learned correction (``kairos/core/model/correction.py``).
* ``prefix_aware``: per node, the request's cached prefix ``c`` (snapshot ``cached_prefix_tokens``)
  is not recomputed: Eq. 3 prefills ℓ − c on each prefill node, the keep path's KV transfer
  carries only what the receiving decode node lacks, and Eq. 5–6 schedule ℓ − c tokens from
  ``c_0 = c`` on each decode node (docs/policies.md, "Cache-aware Eq. 1–6").
"""

from __future__ import annotations

from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import Decision, PolicyParams
from kairos.core.policy.common import best_prefill, keep_receiver, least_loaded_decode, request_hit
from kairos.core.policy.estimates import cached_sweep, expand_runs, sweep_cache
from kairos.core.cluster.snapshot import ClusterSnapshot


def decide_kairos(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
    """Algorithm 1 for ``snap.request``.

    Returns a deflect decision for the decode node with the lowest TTFT_dec (Eq. 6) when Eq. 7
    holds, else keep on the prefill node with the lowest TTFT_pf (Eq. 1) with the KV going to the
    least-loaded decode node (``prefix_aware``: the one holding the longest prefix of the request).
    Ties go to the node listed first. Each node's chunk schedule comes from its cached
    :class:`~kairos.core.policy.estimates.DecodeSweep` (per node state; deterministic, so the decision
    is a pure function of its inputs). O(nodes · log runs) per request for unchanged node states.
    """
    req = snap.request
    ell = req.prompt_tokens
    aware = params.prefix_aware
    # the keep path's KV receiver: needed up front only when the transfer size depends on it
    recv, recv_hit = keep_receiver(snap, True) if aware else ("", 0)
    pf_node, ttft_pf, kv_ms = best_prefill(snap, model, params, include_kv=params.kv_transfer_aware,
                                           kv_tokens=ell - recv_hit)
    limit = params.step_limit_ms
    cands = tuple(sorted(set(params.chunk_candidates), reverse=True))
    sweeps = sweep_cache(model)

    ests: dict[str, float | None] = {}
    why: dict[str, str] = {}
    best_ttft = 0.0
    best = None  # (node id, sweep, remaining prompt tokens, bias)
    corr = params.model_correction
    project = params.project_decode_state
    for dn in snap.decode_nodes:
        B, K, wait_ms = dn.batch_size, dn.kv_tokens, 0.0
        if corr:
            bias, lim = dn.step_bias, limit / dn.step_safety
        else:
            bias, lim = 1.0, limit
        if dn.deflection_in_flight or dn.in_flight:
            if not project or (dn.deflection_in_flight and not dn.in_flight):
                ests[dn.id], why[dn.id] = None, "deflection_in_flight"
                continue
            ahead: float | None = 0.0
            for f in dn.in_flight:  # kairos+: earlier deflections run first, then decode
                if f.prompt_tokens:
                    ahead = cached_sweep(sweeps, model, B, K, 0, lim, cands).ttft(f.prompt_tokens)
                    if ahead is None:
                        break
                    wait_ms += ahead * bias
                B, K = B + 1, K + f.prompt_tokens
            if ahead is None:
                ests[dn.id], why[dn.id] = None, "tbt_unsafe_in_flight"
                continue
        c = 0
        if aware and dn.cached_prefix_tokens:
            c = request_hit(dn, ell)
        sweep = cached_sweep(sweeps, model, B, K, c, lim, cands)
        t = sweep.ttft(ell - c)
        if t is None:
            ests[dn.id], why[dn.id] = None, "tbt_unsafe"
            continue
        ttft = wait_ms + t * bias
        ests[dn.id] = ttft
        if best is None or ttft < best_ttft:
            best_ttft, best = ttft, (dn.id, sweep, ell - c, bias)

    if not recv:
        recv = least_loaded_decode(snap)
    common = dict(request_id=req.id, policy=spec, ttft_prefill_est_ms=ttft_pf, ttft_decode_est_ms=ests,
                  decode_infeasible=why, kv_transfer_est_ms=kv_ms, model_version=model.artifact_version)
    if best is None:
        reason = "keep_all_reserved" if why and all(v == "deflection_in_flight" for v in why.values()) \
            else "keep_no_feasible_node"
        return Decision(decision="keep", node=pf_node, decode_node=recv, reason=reason, **common)
    ttft_dec = best_ttft
    node, sweep, remaining, bias = best
    if ttft_dec > params.alpha * ttft_pf:  # Eq. 7, first clause
        return Decision(decision="keep", node=pf_node, decode_node=recv,
                        reason="keep_alpha_margin", **common)
    if ttft_dec > params.ttft_slo_ms:  # Eq. 7, second clause
        return Decision(decision="keep", node=pf_node, decode_node=recv,
                        reason="keep_over_ttft_slo", **common)
    runs = sweep.schedule(remaining)[1]
    chis, steps = expand_runs(runs)
    if bias != 1.0:
        steps = [t * bias for t in steps]
    return Decision(decision="deflect", node=node, decode_node=node, chunk_schedule=chis, predicted_step_ms=steps,
                    reason="deflect_faster" if ttft_dec <= ttft_pf else "deflect_within_alpha", **common)
