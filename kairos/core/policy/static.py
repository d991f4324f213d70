"""Baseline and static policies: ``pd`` (no deflection), ``sq:θ``, ``sl:ℓ`` (paper §3.4) and
``dynamo`` (NVIDIA Dynamo's early disaggregation router rule).

* ``pd`` — DistServe-style P/D: always keep.
* ``sq:θ`` — deflect when the prefill queue length exceeds θ on *all* prefill nodes; χ = 128.
  Queue length = number of requests with prefill work left on the node (the running one counts).
* ``sl:ℓ`` — deflect every request with prompt length < ℓ tokens; χ = 128.
* ``dynamo[:L[:Q]]`` — Dynamo's conditional disaggregation (``DisaggregatedRouter.prefill_remote``
  in ai-dynamo/dynamo ``lib/llm/src/disagg_router.rs`` and the vLLM worker's
  ``prefill_remote and queue_size < max_prefill_queue_size``): the request's decode worker is the
  one holding its longest cached prefix (Dynamo's KV router; least loaded on ties; with no prefix
  anywhere, the static policies' choice: least loaded, preferring no deflection in flight), and the
  prefill runs remotely iff the *uncached* prompt ``ℓ − prefix_hit > L`` (1000) and the prefill
  queue holds < Q (2) requests; else locally on that decode worker, computing only the uncached
  tokens. Dynamo has one global prefill queue; here "the prefill queue" is the queue of the
  least-loaded prefill node, i.e. local when every prefill node holds ≥ Q requests. Local prefill
  uses the decode engine's own token budget (``engine.decode_max_num_batched_tokens``), as Dynamo
  does not chunk-schedule. Without cache information (hit 0) it is the plain length rule.

Static policies deflect to the least-loaded decode node (preferring one without a deflection in
flight) and report the predicted steps of their fixed schedule, but never check them.
"""

from __future__ import annotations

from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import Decision, PolicyParams
from kairos.core.policy.common import best_prefill, deflect_target, keep_receiver, least_loaded_decode
from kairos.core.policy.estimates import fixed_chunk_steps
from kairos.core.cluster.snapshot import ClusterSnapshot

#: ``dynamo``'s L: the longest uncached prompt it prefills locally (Dynamo's ``max_local_prefill_length``)
DYNAMO_MAX_LOCAL_PREFILL = 1000
#: ``dynamo``'s Q: prefill queue size from which it prefills locally (Dynamo's ``max_prefill_queue_size``)
DYNAMO_MAX_QUEUE = 2


def _decision(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams, deflect: bool,
              reason: str, chunk_tokens: int, target: tuple[str, int] | None = None) -> Decision:
    """``target``: (decode node, its cached prefix of the request) chosen by the rule (Dynamo);
    None: keep to the least-loaded node, deflect to :func:`deflect_target`, no cache."""
    pf_node, ttft_pf, kv_ms = best_prefill(
        snap, model, params, kv_tokens=None if target is None else snap.request.prompt_tokens - target[1])
    common = dict(request_id=snap.request.id, policy=spec, reason=reason, ttft_prefill_est_ms=ttft_pf,
                  kv_transfer_est_ms=kv_ms, model_version=model.artifact_version)
    if not deflect:
        return Decision(decision="keep", node=pf_node,
                        decode_node=least_loaded_decode(snap) if target is None else target[0], **common)
    node, hit = (deflect_target(snap), 0) if target is None else target
    dn = next(d for d in snap.decode_nodes if d.id == node)
    chis, steps = fixed_chunk_steps(model, dn.batch_size, dn.kv_tokens, snap.request.prompt_tokens, chunk_tokens,
                                    hit)
    return Decision(decision="deflect", node=node, decode_node=node, chunk_schedule=chis,
                    predicted_step_ms=steps, **common)


def decide_pd(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
    """``pd``: always keep (reason ``pd_never_deflects``)."""
    return _decision(spec, snap, model, params, False, "pd_never_deflects", 0)


def decide_sq(theta: int):
    """``sq:θ`` (§3.4)."""

    def decide(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        hot = all(sum(1 for t in pn.queue_prompt_tokens if t > 0) > theta for pn in snap.prefill_nodes)
        return _decision(spec, snap, model, params, hot,
                         "sq_queue_above_threshold" if hot else "sq_queue_within_threshold",
                         params.static_chunk_tokens)

    return decide


def decide_sl(length: int):
    """``sl:ℓ`` (§3.4)."""

    def decide(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        short = snap.request.prompt_tokens < length
        return _decision(spec, snap, model, params, short,
                         "sl_prompt_below_threshold" if short else "sl_prompt_not_below_threshold",
                         params.static_chunk_tokens)

    return decide


def decide_dynamo(max_local_prefill: int = DYNAMO_MAX_LOCAL_PREFILL, max_queue: int = DYNAMO_MAX_QUEUE):
    """``dynamo[:L[:Q]]``."""

    def decide(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        target: tuple[str, int] | None = keep_receiver(snap, True)
        if not target[1]:  # no node holds a prefix: the load rules of the cache-blind version
            target = None
        if snap.request.prompt_tokens - (target[1] if target else 0) <= max_local_prefill:
            local, reason = True, "dynamo_short_prompt"
        elif min(sum(1 for t in pn.queue_prompt_tokens if t > 0) for pn in snap.prefill_nodes) >= max_queue:
            local, reason = True, "dynamo_prefill_queue_full"
        else:
            local, reason = False, "dynamo_remote_prefill"
        return _decision(spec, snap, model, params, local, reason, model.engine.decode_max_num_batched_tokens,
                         target)

    return decide
