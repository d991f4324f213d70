"""Property tests (hypothesis) of the kairos policy over random snapshots (issue #2).

The reference below is a literal step-by-step transcription of Algorithm 1's per-node loop
(LargestSafe at every step); the policy computes the same schedule in closed form per run.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos.core.model.latency import load_profile
from kairos.core.policy import PolicyParams
from kairos.core.policy import parse_policy
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, PrefillNodeView, RequestView

MODEL = load_profile()
KAIROS = parse_policy("kairos")


def reference_schedule(model, B, K, ell, cands_desc, limit, c0=0):
    """Algorithm 1, lines 'while served < ℓ_r': one LargestSafe per step, from a cached prefix of
    ``c0`` prompt tokens (0: the paper's case). Returns (χs, steps) or None."""
    chis, steps, served = [], [], c0
    while served < ell:
        chosen = None
        # Eq. 5's K_n + Σ_{j<i} χ^(j): the B decode tokens of every earlier step, and the prompt so far
        k_i = K + len(chis) * B
        for chi in cands_desc:  # LargestSafe: first χ in descending order satisfying Eq. 5
            p = chi - B
            if p > 0 and model.mixed_step_ms(B, k_i, p, served) <= limit:
                chosen = chi
                break
        if chosen is None:
            return None
        tokens = min(chosen - B, ell - served)
        chis.append(chosen)
        steps.append(model.mixed_step_ms(B, k_i, tokens, served))
        served += tokens
    return chis, steps


params_st = st.builds(
    PolicyParams,
    alpha=st.floats(1.0, 3.0),
    beta=st.floats(0.7, 1.5),
    tbt_slo_ms=st.floats(45.0, 150.0),
    ttft_slo_ms=st.floats(500.0, 10_000.0),
)

decode_st = st.tuples(st.integers(0, 200), st.integers(0, 600), st.booleans())  # B, K/B-ish, in flight


@st.composite
def snapshots(draw):
    n_p = draw(st.integers(1, 4))
    n_d = draw(st.integers(1, 6))
    prefill = [PrefillNodeView(id=f"p{i}", queue_prompt_tokens=draw(st.lists(st.integers(0, 30_000), max_size=6)))
               for i in range(n_p)]
    decode = []
    for i in range(n_d):
        b = draw(st.integers(0, 160))
        per_req = draw(st.integers(0, 20_000))
        decode.append(DecodeNodeView(id=f"d{i}", batch_size=b, kv_tokens=b * per_req,
                                     deflection_in_flight=draw(st.booleans())))
    req = RequestView(id="r", prompt_tokens=draw(st.integers(1, 32_768)))
    return ClusterSnapshot(request=req, prefill_nodes=prefill, decode_nodes=decode)


@settings(max_examples=300, deadline=None)
@given(snap=snapshots(), params=params_st)
def test_kairos_properties(snap, params):
    d = KAIROS.decide(snap, MODEL, params)
    limit = params.beta * params.tbt_slo_ms
    cands = sorted(params.chunk_candidates, reverse=True)
    ell = snap.request.prompt_tokens

    # every node's estimate equals the literal Algorithm 1 loop (Eq. 5-6)
    for dn in snap.decode_nodes:
        if dn.deflection_in_flight:
            assert d.ttft_decode_est_ms[dn.id] is None and d.decode_infeasible[dn.id] == "deflection_in_flight"
            continue
        ref = reference_schedule(MODEL, dn.batch_size, dn.kv_tokens, ell, cands, limit)
        if ref is None:
            assert d.ttft_decode_est_ms[dn.id] is None and d.decode_infeasible[dn.id] == "tbt_unsafe"
        else:
            assert d.ttft_decode_est_ms[dn.id] == pytest.approx(sum(ref[1]), rel=1e-9, abs=1e-6)

    feasible = {k: v for k, v in d.ttft_decode_est_ms.items() if v is not None}
    if not feasible:  # every decode node infeasible or holding a deflection: keep
        assert d.decision == "keep" and d.chunk_schedule == []
    if d.decision == "deflect":
        dn = next(x for x in snap.decode_nodes if x.id == d.node)
        assert not dn.deflection_in_flight
        B, K = dn.batch_size, dn.kv_tokens
        # the schedule covers the prompt: Σχ ≥ Σ(χ − B) ≥ ℓ_r
        assert sum(d.chunk_schedule) >= ell
        assert sum(c - B for c in d.chunk_schedule) >= ell
        # every predicted step ≤ β·τ (Eq. 5)
        assert all(s <= limit + 1e-9 for s in d.predicted_step_ms)
        assert len(d.predicted_step_ms) == len(d.chunk_schedule)
        # each χ is the largest candidate satisfying Eq. 5 at its step
        cached = 0
        for i, chi in enumerate(d.chunk_schedule):
            k_i = K + i * B
            assert MODEL.mixed_step_ms(B, k_i, chi - B, cached) <= limit + 1e-9
            for bigger in (c for c in cands if c > chi):
                assert bigger - B <= 0 or MODEL.mixed_step_ms(B, k_i, bigger - B, cached) > limit
            cached += min(chi - B, ell - cached)
        # Eq. 7 holds for the chosen node, which is the fastest feasible one
        # the schedule and its per-step predictions are the literal loop's, step by step
        ref_chis, ref_steps = reference_schedule(MODEL, B, K, ell, cands, limit)
        assert d.chunk_schedule == ref_chis
        assert d.predicted_step_ms == pytest.approx(ref_steps, rel=1e-9, abs=1e-9)
        t = d.ttft_decode_est_ms[d.node]
        assert t <= params.alpha * d.ttft_prefill_est_ms + 1e-9 and t <= params.ttft_slo_ms + 1e-9
        assert t == min(feasible.values())
        assert t == pytest.approx(sum(d.predicted_step_ms))
    else:
        assert d.node in {p.id for p in snap.prefill_nodes}
        assert d.decode_node in {x.id for x in snap.decode_nodes}
        if feasible:
            best = min(feasible.values())
            assert best > params.alpha * d.ttft_prefill_est_ms or best > params.ttft_slo_ms

    # same input → same output
    assert msgspec.json.encode(KAIROS.decide(snap, MODEL, params)) == msgspec.json.encode(d)


@settings(max_examples=100, deadline=None)
@given(snap=snapshots())
def test_keep_when_every_decode_node_reserved(snap):
    reserved = msgspec.structs.replace(
        snap, decode_nodes=[msgspec.structs.replace(x, deflection_in_flight=True) for x in snap.decode_nodes])
    d = KAIROS.decide(reserved, MODEL, PolicyParams())
    assert d.decision == "keep" and d.reason == "keep_all_reserved"


@settings(max_examples=100, deadline=None)
@given(snap=snapshots())
def test_keep_when_every_decode_node_tbt_infeasible(snap):
    # τ below every node's decode-only step: no schedule exists anywhere
    d = KAIROS.decide(snap, MODEL, PolicyParams(tbt_slo_ms=MODEL.decode_intercept_ms - 1))
    assert d.decision == "keep"
    assert all(v is None for v in d.ttft_decode_est_ms.values())
