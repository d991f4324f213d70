"""Merge a request's records into the ``GET /v1/requests/{id}`` answer (no I/O).

Where data comes from: the ``kairos_requests`` KV bucket, one key per writer so nobody overwrites
anybody: ``<rid>.decision`` (dispatcher), ``<rid>.prefill.<node>`` (prefill agent, keep path),
``<rid>.decode.<node>`` (decode agent), ``<rid>.ingress`` (ingress); the ingress reads the node
records of the nodes the request's claim names (an agent may write only keys with its own node id).
Where it goes: the ingress's JSON.

Measured TTFT components (the paper's Table 3 breakdown), each a difference of two timestamps
taken on the *same* node, so clock skew between hosts does not enter:

=============== ============================================== ===============================
component       keep path                                      deflect path
=============== ============================================== ===============================
prefill_queue   P: first prefill step start − job received     D: first chunk start − job received
prefill_exec    P: prompt done − first prefill step start       D: first token − first chunk start
kv_transfer     D: KV arrived − blocks allocated (incl. link     0
                wait, one transfer per link at a time)
decode_queue    D: (blocks allocated − handoff received) +      0
                (first token − KV arrived)
=============== ============================================== ===============================

``ttft_ms`` is what the ingress measured (first token sent to the client − request received);
``other_ms`` = ttft − Σ components (dispatch, bus hops, handoff messaging).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kairos.contracts.wire import DecisionRecord, DecodeTiming, IngressTiming, PrefillTiming


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def ttft_components(prefill: PrefillTiming | None, dec: DecodeTiming | None) -> dict[str, float | None]:
    """The four measured components in ms (None where a timestamp is missing)."""
    if dec is not None and dec.kind == "deflect":
        return {"prefill_queue_ms": _diff(dec.prefill_start_unix_ms, dec.received_unix_ms),
                "prefill_exec_ms": _diff(dec.first_token_unix_ms, dec.prefill_start_unix_ms),
                "kv_transfer_ms": 0.0, "decode_queue_ms": 0.0}
    out: dict[str, float | None] = {"prefill_queue_ms": None, "prefill_exec_ms": None, "kv_transfer_ms": None,
                                    "decode_queue_ms": None}
    if prefill is not None:
        out["prefill_queue_ms"] = _diff(prefill.prefill_start_unix_ms, prefill.received_unix_ms)
        out["prefill_exec_ms"] = _diff(prefill.prefill_done_unix_ms, prefill.prefill_start_unix_ms)
    if dec is not None:
        out["kv_transfer_ms"] = _diff(dec.kv_arrived_unix_ms, dec.kv_allocated_unix_ms)
        wait_alloc = _diff(dec.kv_allocated_unix_ms, dec.received_unix_ms)
        wait_first = _diff(dec.first_token_unix_ms, dec.kv_arrived_unix_ms)
        out["decode_queue_ms"] = None if wait_alloc is None or wait_first is None else round(wait_alloc + wait_first, 3)
    return out


def request_record(rid: str, decision: DecisionRecord | None, prefill: PrefillTiming | None,
                   dec: DecodeTiming | None, ingress: IngressTiming | None) -> dict[str, Any]:
    """The JSON body of ``GET /v1/requests/{id}``."""
    d = decision.decision if decision is not None else None
    comps = ttft_components(prefill, dec)
    ttft = None
    e2e = None
    if ingress is not None:
        ttft = _diff(ingress.first_token_unix_ms, ingress.received_unix_ms)
        e2e = _diff(ingress.finished_unix_ms, ingress.received_unix_ms)
    known = [v for v in comps.values() if v is not None]
    other = round(ttft - sum(known), 3) if ttft is not None and len(known) == 4 else None
    out: dict[str, Any] = {
        "id": rid,
        "policy": d.policy if d else None,
        "decision": d.decision if d else None,
        "reason": d.reason if d else None,
        "node": decision.node if decision else None,
        "decode_node": decision.decode_node if decision else None,
        "chunk_schedule": list(d.chunk_schedule) if d else [],
        "estimates": {
            "ttft_prefill_est_ms": d.ttft_prefill_est_ms, "ttft_decode_est_ms": dict(d.ttft_decode_est_ms),
            "decode_infeasible": dict(d.decode_infeasible), "kv_transfer_est_ms": d.kv_transfer_est_ms,
            "predicted_step_ms": list(d.predicted_step_ms),
        } if d else None,
        "measured": {"ttft_ms": ttft, "e2e_ms": e2e, **comps, "other_ms": other,
                     "chunk_sizes": list(dec.chunk_sizes) if dec else [],
                     "chunk_predicted_ms": list(dec.chunk_predicted_ms) if dec else [],
                     "chunk_actual_ms": list(dec.chunk_actual_ms) if dec else []},
        "routing": {"dispatcher": decision.dispatcher_id, "attempts": decision.attempts,
                    "excluded_nodes": dict(decision.excluded_nodes),
                    "reservation_conflicts": list(decision.reservation_conflicts),
                    "state_age_ms": decision.state_age_ms, "view_seq": decision.view_seq,
                    "decide_ms": decision.decide_ms, "routing_ms": decision.routing_ms,
                    "model_version": d.model_version if d else None} if decision else None,
        "records": {k: (msgspec.to_builtins(v) if v is not None else None)
                    for k, v in (("prefill", prefill), ("decode", dec), ("ingress", ingress))},
    }
    return out
