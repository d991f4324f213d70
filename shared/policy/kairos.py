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
  are scaled by ``step_bias`` — the node's learned correction (``shared/correction.py``).
* ``prefix_aware``: per node, the request's cached prefix ``c`` (snapshot ``cached_prefix_tokens``)
  is not recomputed: Eq. 3 prefills ℓ − c on each prefill node, the keep path's KV transfer
  carries only what the receiving decode node lacks, and Eq. 5–6 schedule ℓ − c tokens from
  ``c_0 = c`` on each decode node (docs/policies.md, "Cache-aware Eq. 1–6").
"""

from __future__ import annotations

from shared.latency import LatencyModel
from shared.policy.base import Decision, PolicyParams
from shared.policy.common import best_prefill, keep_receiver, request_hit
from shared.policy.estimates import decode_schedule, expand_runs
from shared.snapshot import ClusterSnapshot


def decide_kairos(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
    """Algorithm 1 for ``snap.request``.

    Returns a deflect decision for the decode node with the lowest TTFT_dec (Eq. 6) when Eq. 7
    holds, else keep on the prefill node with the lowest TTFT_pf (Eq. 1) with the KV going to the
    least-loaded decode node. Ties go to the node listed first.
    """
    req = snap.request
    ell = req.prompt_tokens
    aware = params.prefix_aware
    recv, recv_hit = keep_receiver(snap, aware)
    pf_node, ttft_pf, kv_ms = best_prefill(snap, model, params, include_kv=params.kv_transfer_aware,
                                           kv_tokens=ell - recv_hit)
    limit = params.step_limit_ms
    cands = sorted(set(params.chunk_candidates), reverse=True)

    ests: dict[str, float | None] = {}
    why: dict[str, str] = {}
    best: tuple[float, str, list, float] | None = None
    corr = params.model_correction
    for dn in snap.decode_nodes:
        B, K, wait_ms = dn.batch_size, dn.kv_tokens, 0.0
        bias = dn.step_bias if corr else 1.0
        lim = limit / dn.step_safety if corr else limit
        if dn.deflection_in_flight or dn.in_flight:
            if not params.project_decode_state or (dn.deflection_in_flight and not dn.in_flight):
                ests[dn.id], why[dn.id] = None, "deflection_in_flight"
                continue
            for f in dn.in_flight:  # kairos+: earlier deflections run first, then decode
                ahead = decode_schedule(model, B, K, f.prompt_tokens, cands, lim) if f.prompt_tokens else (0.0, [])
                if ahead is None:
                    break
                wait_ms += ahead[0] * bias
                B, K = B + 1, K + f.prompt_tokens
            else:
                ahead = (0.0, [])
            if ahead is None:
                ests[dn.id], why[dn.id] = None, "tbt_unsafe_in_flight"
                continue
        res = decode_schedule(model, B, K, ell, cands, lim, request_hit(dn, ell) if aware else 0)
        if res is None:
            ests[dn.id], why[dn.id] = None, "tbt_unsafe"
            continue
        ttft = wait_ms + res[0] * bias
        ests[dn.id] = ttft
        if best is None or ttft < best[0]:
            best = (ttft, dn.id, res[1], bias)

    common = dict(request_id=req.id, policy=spec, ttft_prefill_est_ms=ttft_pf, ttft_decode_est_ms=ests,
                  decode_infeasible=why, kv_transfer_est_ms=kv_ms, model_version=model.artifact_version)
    if best is None:
        reason = "keep_all_reserved" if why and all(v == "deflection_in_flight" for v in why.values()) \
            else "keep_no_feasible_node"
        return Decision(decision="keep", node=pf_node, decode_node=recv, reason=reason, **common)
    ttft_dec, node, runs, bias = best
    if ttft_dec > params.alpha * ttft_pf:  # Eq. 7, first clause
        return Decision(decision="keep", node=pf_node, decode_node=recv,
                        reason="keep_alpha_margin", **common)
    if ttft_dec > params.ttft_slo_ms:  # Eq. 7, second clause
        return Decision(decision="keep", node=pf_node, decode_node=recv,
                        reason="keep_over_ttft_slo", **common)
    chis, steps = expand_runs(runs)
    if bias != 1.0:
        steps = [t * bias for t in steps]
    return Decision(decision="deflect", node=node, decode_node=node, chunk_schedule=chis, predicted_step_ms=steps,
                    reason="deflect_faster" if ttft_dec <= ttft_pf else "deflect_within_alpha", **common)
