"""Hand-computed cases for Eq. 2, Eq. 3, Eq. 6 and Eq. 7 with the tiny model (tests/factories.py)."""

import msgspec
import pytest

from shared.policy import PolicyParams, parse_policy
from shared.policy.estimates import decode_schedule, expand_runs, prefill_exec_ms, prefill_queue_wait_ms
from tests.factories import snapshot, tiny_model

M = tiny_model()


def test_eq2_queue_wait():
    # Σℓ = 400, χ_p = 100: W = 400/100 · T_pf(100, 200) = 4 · (10 + 10 + 0.0001·100·200) = 4 · 22
    assert prefill_queue_wait_ms(M, [300, 100], 100) == pytest.approx(88.0)
    assert prefill_queue_wait_ms(M, [], 100) == 0.0


def test_eq3_prefill_exec():
    # ℓ = 250, χ_p = 100: chunks (100, c=0) = 20, (100, c=100) = 21, (50, c=200) = 10 + 5 + 1 = 16
    assert prefill_exec_ms(M, 250, 100) == pytest.approx(57.0)
    # exact multiple: (100,0)=20, (100,100)=21, (100,200)=22
    assert prefill_exec_ms(M, 300, 100) == pytest.approx(63.0)


EXPECTED_CHIS = [110] + [60] * 4 + [20] * 10
EXPECTED_STEPS = [50.0, 50.01, 52.52, 55.03, 57.54] + [44.05 + 0.11 * j for j in range(10)]


def test_eq5_eq6_schedule_by_hand():
    # B = 10, K = 10000, p = χ − B ∈ {100, 50, 10}. Eq. 5's K_n + Σ_{j<i} χ^(j) grows the decodes'
    # KV by B = 10 tokens per step: at step i, T = 20 + 10 + 0.001·(10000 + 10i) + p·(0.1 + 0.001c)
    #   = 40 + 0.01i + 0.1p + 0.001·p·c, limit 60.001.
    # i=0 c=0:   χ=110 → 50                       ✓
    # i=1 c=100: χ=110 → 60.01 ✗; χ=60 → 50.01     ✓ then 52.52, 55.03, 57.54 (c = 150, 200, 250)
    # i=5 c=300: χ=60 → 60.05 ✗; χ=20 → 44.05, then +0.11 per step for the last 100 tokens
    # TTFT_dec = 265.1 + 445.45 = 710.55
    res = decode_schedule(M, 10, 10_000, 400, [110, 60, 20], 60.001)
    assert res is not None
    ttft, runs = res
    chis, steps = expand_runs(runs)
    assert chis == EXPECTED_CHIS
    assert steps == pytest.approx(EXPECTED_STEPS)
    assert ttft == pytest.approx(sum(EXPECTED_STEPS)) and ttft == pytest.approx(710.55)


def test_eq5_infeasible_when_first_step_unsafe():
    # T0 alone = 20 + 10 + 10 = 40 > 39: no χ is safe
    assert decode_schedule(M, 10, 10_000, 400, [110, 60, 20], 39.0) is None
    # χ ≤ B carries no prefill tokens: never safe
    assert decode_schedule(M, 10, 10_000, 400, [10, 5], 1000.0) is None


def test_eq7_deflect_and_alpha_margin():
    params = PolicyParams(alpha=1.3, tbt_slo_ms=60.001, ttft_slo_ms=4000, chunk_candidates=(110, 60, 20),
                          prefill_chunk_tokens=100)
    # TTFT_dec = 710.55 for B=10,K=10000. TTFT_pf = W + T_pf(400) with T_pf(400) = 20+21+22+23 = 86.
    # Queue 3000 tokens: W = 30 · T_pf(100, 1500) = 30 · (20 + 15) = 1050 → TTFT_pf = 1136 ≥ 710.55: deflect.
    d = parse_policy("kairos").decide(snapshot(400, [[3000]], [(10, 10_000, False)]), M, params)
    assert d.decision == "deflect" and d.node == "decode-0" and d.reason == "deflect_faster"
    assert d.ttft_prefill_est_ms == pytest.approx(1136.0)
    assert d.ttft_decode_est_ms == {"decode-0": pytest.approx(710.55)}
    assert d.chunk_schedule == EXPECTED_CHIS
    # Queue 300 tokens: W = 3 · T_pf(100, 150) = 3 · 21.5 = 64.5 → TTFT_pf = 150.5; 1.3 · 150.5 < 710.55: keep
    d = parse_policy("kairos").decide(snapshot(400, [[300]], [(10, 10_000, False)]), M, params)
    assert d.decision == "keep" and d.reason == "keep_alpha_margin" and d.node == "prefill-0"
    assert d.chunk_schedule == [] and d.decode_node == "decode-0"
    # α large enough but TTFT SLO below 710.55: keep for the SLO clause
    tight = PolicyParams(alpha=10, tbt_slo_ms=60.001, ttft_slo_ms=500, chunk_candidates=(110, 60, 20),
                         prefill_chunk_tokens=100)
    d = parse_policy("kairos").decide(snapshot(400, [[300]], [(10, 10_000, False)]), M, tight)
    assert d.decision == "keep" and d.reason == "keep_over_ttft_slo"
    # Queue 1700: W = 17 · T_pf(100, 850) = 17 · 28.5 = 484.5 → TTFT_pf = 570.5 < 710.55 ≤ 1.3 · 570.5
    d = parse_policy("kairos").decide(snapshot(400, [[1700]], [(10, 10_000, False)]), M, params)
    assert d.ttft_prefill_est_ms == pytest.approx(570.5)
    assert d.decision == "deflect" and d.reason == "deflect_within_alpha"
    # the same request with α = 1: keep
    d = parse_policy("kairos").decide(snapshot(400, [[1700]], [(10, 10_000, False)]), M,
                                      msgspec.structs.replace(params, alpha=1.0))
    assert d.decision == "keep" and d.reason == "keep_alpha_margin"


def test_kairos_picks_fastest_node_and_skips_in_flight():
    params = PolicyParams(tbt_slo_ms=60.001, chunk_candidates=(110, 60, 20), prefill_chunk_tokens=100)
    snap = snapshot(400, [[5000]], [(10, 10_000, False), (2, 1_000, True), (5, 2_000, False)])
    d = parse_policy("kairos").decide(snap, M, params)
    assert d.decode_infeasible == {"decode-1": "deflection_in_flight"}
    assert d.ttft_decode_est_ms["decode-1"] is None
    assert d.node == "decode-2"  # lighter than decode-0
    assert d.ttft_decode_est_ms["decode-2"] < d.ttft_decode_est_ms["decode-0"]


def test_keep_goes_to_lowest_ttft_prefill_node_and_least_loaded_decode():
    params = PolicyParams(chunk_candidates=(110, 60, 20), prefill_chunk_tokens=100)
    snap = snapshot(400, [[900], [100], [500]], [(10, 10_000, True), (3, 500, True)])
    d = parse_policy("kairos").decide(snap, M, params)
    assert d.decision == "keep" and d.reason == "keep_all_reserved"
    assert d.node == "prefill-1" and d.decode_node == "decode-1"
