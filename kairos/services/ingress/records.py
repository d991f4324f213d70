"""A request's records: the ingress's own (written when it ends), and the ``GET /v1/requests/{id}`` answer.

Where data comes from: the ``kairos_requests`` KV bucket, one key per writer so nobody overwrites
anybody: ``<rid>.decision`` (dispatcher), ``<rid>.prefill.<node>`` (prefill agent, keep path),
``<rid>.decode.<node>`` (decode agent), ``<rid>.ingress`` (ingress, :func:`write_ingress_record`);
the ingress reads the node records of the nodes the request's decision record names (an agent may write only
keys with its own node id; :func:`lookup`). Where it goes: the ingress's JSON (:func:`request_record`
merges the records). The bucket is reached through :class:`~.ports.IngressBus` (no I/O here).

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

from kairos.contracts import subjects as S
from kairos.contracts.wire import encode
from kairos.contracts.records import DecisionRecord, DecodeTiming, IngressTiming, PrefillTiming
from kairos.core.vocabulary import DEFLECT
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.ports import IngressBus

#: key of the (decision kind, predicted TTFT ms) pair in a request's timing dict (not part of its record)
PREDICTED = "predicted_ttft"
#: keys of a request's timing dict that are not part of its record: the answer's finish reason and
#: ``usage.prompt_tokens_details.cached_tokens`` (the relay sets both on completion), the prediction
NOT_RECORDED = ("finish_reason", "cached_tokens", PREDICTED)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def ttft_components(prefill: PrefillTiming | None, dec: DecodeTiming | None) -> dict[str, float | None]:
    """The four measured components in ms (None where a timestamp is missing)."""
    if dec is not None and dec.kind == DEFLECT:
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
        "client_request_id": ingress.client_request_id if ingress is not None else None,
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
        # every attempt when there was more than one: its node, its tokens, why it moved (issue 33)
        "attempts": msgspec.to_builtins(ingress.attempts) if ingress is not None else [],
        "records": {k: (msgspec.to_builtins(v) if v is not None else None)
                    for k, v in (("prefill", prefill), ("decode", dec), ("ingress", ingress))},
    }
    return out


def first_token_attempt(rid: str, resubmitted_as: list[str]) -> str:
    """The attempt of request ``rid`` that sent the client's first token: the last re-submission
    (``<rid>-r<n>``) in ``resubmitted_as``, else ``rid``; a migration's continuation (``<rid>-m<n>``)
    resumed after tokens the client had, so it never is."""
    return next((a for a in reversed(resubmitted_as) if not a.startswith(f"{rid}-m")), rid)


async def lookup(rid: str, bus: IngressBus) -> dict[str, Any] | None:
    """The ``GET /v1/requests/{id}`` body of request ``rid`` (:func:`request_record`), None when the
    bucket holds no record of it (unknown, or older than the record TTL).

    A request re-submitted after a node was lost is explained by the records of the attempt that
    sent its first token (the last re-submission ``<id>-r<n>`` of ``resubmitted_as``: the measured TTFT
    and its components are that attempt's; a migration's continuations ``<id>-m<n>`` are listed in
    ``attempts``); its node records are those of the nodes its decision record names (the node that
    accepted its job; each node writes only keys with its own id).

    Raises:
        Exception: the bucket did not answer (the caller's 500).
    """
    ingress = await bus.read_record(S.record_key(rid, "ingress"), IngressTiming)
    served_by = first_token_attempt(rid, ingress.resubmitted_as if ingress is not None else [])
    decision = await bus.read_record(S.record_key(served_by, "decision"), DecisionRecord)
    node = decision.node if decision is not None else ""
    keep = decision is not None and not decision.decision.deflected
    prefill = (await bus.read_record(S.record_key(served_by, "prefill", node), PrefillTiming)
               if node and keep else None)
    dec_node = (prefill.handoff_node if prefill else None) or (decision.decode_node if decision is not None else "")
    dec_node = dec_node if keep else node
    dec = await bus.read_record(S.record_key(served_by, "decode", dec_node), DecodeTiming) if dec_node else None
    if decision is None and prefill is None and dec is None and ingress is None:
        return None
    return request_record(rid, decision, prefill, dec, ingress)


async def write_ingress_record(bus: IngressBus, rid: str, timing: dict[str, Any], metrics: IngressMetrics,
                               log: Any) -> None:
    """Store ``<rid>.ingress`` from the request's ``timing`` dict (``received_unix_ms``, ``status``, …:
    the fields of :class:`IngressTiming`, plus :data:`NOT_RECORDED`, left out), observe the ended
    request in the vLLM-named families (:meth:`~.metrics.VllmRequestMetrics.finished`: success by
    finished_reason, e2e, token counts, prefix-cache hits) and predicted vs measured TTFT of a
    request that succeeded. A failed write is logged."""
    metrics.vllm.finished(timing)  # before the first await: observed as the request ends
    rec = ingress_timing(timing)
    if timing.get("status") == 200 and rec.first_token_unix_ms is not None and timing.get(PREDICTED) is not None:
        metrics.observe_prediction(*timing[PREDICTED], rec.first_token_unix_ms - rec.received_unix_ms)
    await store_ingress_record(bus, rid, rec, log)


def ingress_timing(timing: dict[str, Any]) -> IngressTiming:
    """The :class:`IngressTiming` of a request's ``timing`` dict as it is now (:data:`NOT_RECORDED` left out)."""
    return msgspec.convert({k: v for k, v in timing.items() if k not in NOT_RECORDED}, IngressTiming)


async def store_ingress_record(bus: IngressBus, rid: str, rec: IngressTiming, log: Any) -> None:
    """Store ``<rid>.ingress``: when the request ends, and while it streams after a migration (its
    ``attempts`` so far, ``finished_unix_ms`` still None: ``GET /v1/requests/{id}`` shows where it
    runs now). A failed write is logged."""
    try:
        await bus.write_record(S.record_key(rid, "ingress"), encode(rec))
    except Exception as exc:  # a lost record costs GET /v1/requests/<id> its ingress part, never the request
        log.warning("record_write_failed", request_id=rid, error=repr(exc))
