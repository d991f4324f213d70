"""TaiChi baseline (Wang et al., 2025, "Prefill-Decode Aggregation or Disaggregation? Unifying
Both for Goodput-Optimized LLM Serving"; the Kairos paper's §6 baseline and §8 description).

TaiChi runs two kinds of instances that both prefill *and* decode: prefill-heavy (P-heavy: large
prefill chunk, fast prefill, decodes suffer interference) and decode-heavy (D-heavy: small prefill
chunk, slow prefill, little interference). Three sliders: the P-heavy:D-heavy ratio and the two
chunk sizes. It shifts latency between requests with two schedulers:

* **Length-aware prefill scheduling** (this module, the routing decision): a request is
  prefilled on a P-heavy instance (its first token comes from there) unless that instance would
  miss the TTFT SLO, or a D-heavy instance would give it a first token no later; then it goes to
  the D-heavy instance with the lowest predicted TTFT, provided that TTFT meets the SLO (and, with
  the optional length slider ``L``, the prompt is ≤ L tokens). Long prompts thus stay on P-heavy
  instances (their D-heavy TTFT in small chunks is long), short ones use D-heavy prefill capacity.
* **Flowing decode** (the simulator, ``PolicyParams.flowing_decode``): a request prefilled on a
  P-heavy instance decodes there right away (no KV transfer before the first token) and *flows* to
  a D-heavy instance — a live KV migration, decoding continues on the source meanwhile — once its
  TPOT so far exceeds ``flow_tpot_fraction``·τ (at risk of missing the TPOT SLO).

In our cluster the ``prefill-*`` nodes are the P-heavy instances (chunk χ_p =
``params.prefill_chunk_tokens``; the simulator sizes their step budget from it when
``flowing_decode`` is on) and the ``decode-*`` nodes the D-heavy ones (chunk χ_D, the first
policy argument). D-heavy prefills queue FIFO on the node (no one-in-flight reservation: TaiChi
has none). What is our reading rather than the TaiChi paper's text is listed in docs/policies.md.

Spec: ``taichi[:χ_D[:L]]`` — χ_D default 256 tokens per D-heavy step (decode tokens included, as
χ everywhere in this package), L default 0 (no length cap: the TTFT prediction decides).
"""

from __future__ import annotations

from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import Decision, PolicyError, PolicyParams
from kairos.core.policy.common import best_prefill, least_loaded_decode
from kairos.core.policy.estimates import fixed_chunk_steps
from kairos.core.cluster.snapshot import ClusterSnapshot

DEFAULT_DECODE_CHUNK = 256


def dheavy_ttft_ms(model: LatencyModel, batch_size: int, kv_tokens: int, queued_prompt_tokens: int,
                   prompt_tokens: int, chunk_tokens: int) -> tuple[float, list[int], list[float]]:
    """Predicted TTFT (ms) of a prompt prefilled on a D-heavy instance behind ``queued_prompt_tokens``
    of earlier prefills, in fixed χ_D = ``chunk_tokens`` steps at the node's current decode batch
    (B = ``batch_size``, K = ``kv_tokens``), and this prompt's own chunk schedule and step ms.

    The queue ahead is modelled as one longer prompt (same χ_D, same B and K): a lower bound
    that ignores the decodes the earlier prefills add.
    """
    ahead_ms = sum(fixed_chunk_steps(model, batch_size, kv_tokens, queued_prompt_tokens, chunk_tokens)[1]) \
        if queued_prompt_tokens > 0 else 0.0
    chis, steps = fixed_chunk_steps(model, batch_size, kv_tokens, prompt_tokens, chunk_tokens)
    return ahead_ms + sum(steps), chis, steps


def decide_taichi(decode_chunk: int = DEFAULT_DECODE_CHUNK, max_len: int = 0):
    """``taichi[:χ_D[:L]]`` — length-aware prefill scheduling (see the module docstring).

    Raises:
        PolicyError: χ_D < 1.
    """
    if decode_chunk < 1:
        raise PolicyError("χ_D (decode-heavy chunk tokens) must be >= 1")

    def decide(spec: str, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        req = snap.request
        ell = req.prompt_tokens
        # flowing decode: the first token comes from the P-heavy node, so no KV transfer in TTFT_P
        pf_node, ttft_p, kv_ms = best_prefill(snap, model, params)
        ests: dict[str, float | None] = {}
        best: tuple[float, str, list[int], list[float]] | None = None
        for dn in snap.decode_nodes:
            queued = sum(f.prompt_tokens for f in dn.in_flight)
            t, chis, steps = dheavy_ttft_ms(model, dn.batch_size, dn.kv_tokens, queued, ell, decode_chunk)
            ests[dn.id] = t
            if best is None or t < best[0]:
                best = (t, dn.id, chis, steps)
        common = dict(request_id=req.id, policy=spec, ttft_prefill_est_ms=ttft_p, ttft_decode_est_ms=ests,
                      kv_transfer_est_ms=kv_ms, model_version=model.artifact_version)
        keep = dict(decision="keep", node=pf_node, decode_node=least_loaded_decode(snap))
        if best is None:
            return Decision(reason="taichi_pheavy", **keep, **common)
        ttft_d, node, chis, steps = best
        if max_len and ell > max_len:
            return Decision(reason="taichi_pheavy_long_prompt", **keep, **common)
        if ttft_d > params.ttft_slo_ms:
            return Decision(reason="taichi_pheavy_dheavy_misses_slo", **keep, **common)
        if ttft_p <= params.ttft_slo_ms and ttft_d > ttft_p:
            return Decision(reason="taichi_pheavy_meets_slo", **keep, **common)
        return Decision(decision="deflect", node=node, decode_node=node, chunk_schedule=chis, predicted_step_ms=steps,
                        reason="taichi_dheavy_faster" if ttft_d <= ttft_p else "taichi_dheavy_pheavy_at_risk",
                        **common)

    return decide
