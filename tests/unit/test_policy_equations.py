"""Hand-computed cases for Eq. 2, Eq. 3, Eq. 6 and Eq. 7 with the tiny model (tests/factories.py)."""

import msgspec
import pytest

from kairos.core.policy import PolicyParams

from kairos.core.policy import parse_policy
from kairos.core.model.latency import LatencyModel
from kairos.core.policy.estimates import decode_schedule, expand_runs, prefill_exec_ms, prefill_queue_wait_ms
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


# -- Eq. 1 and Eq. 3 from a cached prefix ---------------------------------------------------------

def test_eq1_is_queue_wait_plus_prefill_exec():
    from kairos.core.policy.estimates import prefill_ttft_ms

    # W(Σℓ = 400, χ_p = 100) = 88 (test_eq2) + T_pf(250, χ_p = 100) = 57 (test_eq3) = 145
    assert prefill_ttft_ms(M, 250, [300, 100], 100) == pytest.approx(145.0)
    assert prefill_ttft_ms(M, 250, [], 100) == pytest.approx(57.0)  # empty queue: Eq. 3 alone


def test_eq3_from_a_cached_prefix_computes_only_the_rest():
    # ℓ = 250, c = 50, χ_p = 100: u = 200 → chunks (100, c=50) = 10 + 10 + 0.5 = 20.5 and
    # (100, c=150) = 10 + 10 + 1.5 = 21.5 → 42
    assert prefill_exec_ms(M, 250, 100, 50) == pytest.approx(42.0)
    # u = 130: (100, c=120) = 21.2, then the 30-token rest after 220: 10 + 3 + 0.0001·30·220 = 13.66
    assert prefill_exec_ms(M, 250, 100, 120) == pytest.approx(34.86)
    assert prefill_exec_ms(M, 250, 100, 250) == 0.0  # nothing left to compute


# -- Eq. 5–6: the schedule's runs, from a cached prefix ------------------------------------------

def test_eq5_eq6_runs_carry_their_tokens_cache_and_first_step():
    from kairos.core.policy.estimates import ChunkRun

    # the schedule of test_eq5_eq6_schedule_by_hand, run by run (ChunkRun(χ, steps, p, first c,
    # last step's p, first step, first ms, slope, last ms)): 110 once (p = 100, 60.01 next);
    # 60 from step 1, c = 100, four steps 50.01 + 2.51·j; 20 from step 5, c = 300, p = 10:
    # T = 40 + 0.01·i + 1 + 0.01·c → 44.05, +0.11 per step; the 100 last tokens take 10 steps
    _, runs = decode_schedule(M, 10, 10_000, 400, [110, 60, 20], 60.001)
    want = [ChunkRun(110, 1, 100, 0, 100, 0, 50.0, 10.01, 50.0),
            ChunkRun(60, 4, 50, 100, 50, 1, 50.01, 2.51, 57.54),
            ChunkRun(20, 10, 10, 300, 10, 5, 44.05, 0.11, 45.04)]
    assert [r[:6] for r in runs] == [w[:6] for w in want]
    assert [r[6:] for r in runs] == [pytest.approx(w[6:]) for w in want]
    # ℓ = 395: the last run takes 10 steps, the last one 5 tokens after c = 390 at step 14:
    # 40.14 + 5·(0.1 + 0.39) = 42.59
    ttft, runs = decode_schedule(M, 10, 10_000, 395, [110, 60, 20], 60.001)
    assert runs[-1][:6] == (20, 10, 10, 300, 5, 5)
    assert runs[-1].last_ms == pytest.approx(42.59)
    assert ttft == pytest.approx(265.1 + 9 * 44.05 + 0.11 * 36 + 42.59)  # Σ_{j<9} (44.05 + 0.11·j) = 400.41


# B = 10, K = 1000, 𝒳 = (110, 60), limit 45: T = 31 + 0.01·i + p·(0.1 + 0.001·c)
CACHED_CASES = [
    # ℓ = 150 from c = 50: i=0 χ=110 → 31 + 100·0.15 = 46 ✗, χ=60 → 31 + 50·0.15 = 38.5;
    # i=1 c=100 → 31.01 + 50·0.2 = 41.01; 100 tokens done
    (150, 50, [60, 60], [38.5, 41.01]),
    # one token left after c = 50: χ=60 (110 is unsafe as above) carrying 1 token → 31 + 0.15
    (51, 50, [60], [31.15]),
    # nothing left: TTFT 0, no step
    (50, 50, [], []),
    # no cache: i=0 χ=110 → 41; i=1 c=100 → 31.01 + 20 = 51.01 ✗, χ=60 → 31.01 + 10 = 41.01;
    # i=2 c=150, the last 50 tokens → 31.02 + 50·0.25 = 43.52
    (200, 0, [110, 60, 60], [41.0, 41.01, 43.52]),
]


@pytest.mark.parametrize("ell, cached, chis, steps", CACHED_CASES)
def test_eq5_eq6_from_a_cached_prefix(ell, cached, chis, steps):
    ttft, runs = decode_schedule(M, 10, 1000, ell, [110, 60], 45.0, cached_tokens=cached)
    got_chis, got_steps = expand_runs(runs)
    assert got_chis == chis
    assert got_steps == pytest.approx(steps)
    assert ttft == pytest.approx(sum(steps)) and (ttft == 0.0) == (not steps)


def test_sweeps_are_cached_per_model():
    # ℓ = 150 from c = 50, limit 55 (T as in CACHED_CASES): χ=110 → 46 takes the 100 tokens at once
    # (the run's slope: 0.01 for K + 10, 100·0.001·100 for c + 100 → 10.01)
    assert decode_schedule(M, 10, 1000, 150, [110, 60], 55.0, 50) == (pytest.approx(46.0), [pytest.approx(
        (110, 1, 100, 50, 100, 0, 46.0, 10.01, 46.0))])
    # the same node state under a model 10 ms slower per step gets its own schedule, not the
    # other model's cached one: χ=110 → 56 ✗, χ=60 → 48.5; i=1 c=100 → 41.01 + 10 = 51.01
    slower = tiny_model(decode_intercept_ms=30.0)
    ttft, runs = decode_schedule(slower, 10, 1000, 150, [110, 60], 55.0, 50)
    assert expand_runs(runs) == ([60, 60], [pytest.approx(48.5), pytest.approx(51.01)])
    assert ttft == pytest.approx(99.51)


# -- the static policies' fixed-χ schedule -----------------------------------------------------------

FIXED_CASES = [
    # B = 10, K = 1000, χ = 110 → p = 100, ⌈250/100⌉ = 3 steps, the last with 50 tokens:
    # (K, p, c) = (1000, 100, 0) → 31 + 10 = 41; (1010, 100, 100) → 31.01 + 20 = 51.01;
    # (1020, 50, 200) → 31.02 + 50·0.3 = 46.02
    (250, 110, 0, [110] * 3, [41.0, 51.01, 46.02]),
    # from c = 50: u = 200, 2 steps: (1000, 100, 50) → 31 + 15 = 46; (1010, 100, 150) → 31.01 + 25
    (250, 110, 50, [110] * 2, [46.0, 56.01]),
    # χ ≤ B: one prompt token per step, 3 steps: 31 + 0.1, 31.01 + 0.101, 31.02 + 0.102
    (3, 10, 0, [10] * 3, [31.1, 31.111, 31.122]),
]


@pytest.mark.parametrize("ell, chi, cached, chis, steps", FIXED_CASES)
def test_fixed_chunk_schedule(ell, chi, cached, chis, steps):
    from kairos.core.policy.estimates import fixed_chunk_steps

    args = (M, 10, 1000, ell, chi) + ((cached,) if cached else ())  # c = 0 is the default
    got_chis, got_steps = fixed_chunk_steps(*args)
    assert got_chis == chis
    assert got_steps == pytest.approx(steps)


def test_a_sweep_is_grown_only_as_far_as_asked():
    from kairos.core.policy.estimates import decode_sweep

    # test_eq5_eq6_schedule_by_hand's node (c = 0 by default): its first run (χ = 110, one step)
    # covers exactly 100 tokens, the second (χ = 60, four steps of 50) 300
    sweep = decode_sweep(M, 10, 10_000, (110, 60, 20), 60.001)
    assert sweep.ttft(100) == pytest.approx(50.0)
    assert len(sweep.runs) == 1  # a prompt ending where a run ends needs no further run
    assert sweep.ttft(400) == pytest.approx(710.55)
    assert [r[0] for r in sweep.runs] == [110, 60, 20]


def test_no_schedule_is_longer_than_the_request_limit():
    from kairos.core.cluster.snapshot import MAX_TOKENS_PER_REQUEST

    # T = 20 + B + K/2^20 + p/8, binary-exact: B = 1, K = 0, 𝒳 = (1001, 9). χ = 1001 (p = 1000)
    # starts at 146 and grows by 2^-20 per step; a limit of 146 + 999999·2^-20 allows 10^6 steps,
    # i.e. exactly 10^9 = MAX_TOKENS_PER_REQUEST tokens. χ = 9 would be safe after them
    # (21 + 10^6/2^20 + 1 ≈ 22.95), but the sweep ends at the limit: a longer prompt has no schedule.
    assert MAX_TOKENS_PER_REQUEST == 10**9
    exact = tiny_model(decode_intercept_ms=20.0, decode_coef=(1.0, 2.0**-20), mixed_delta_coef=(0.125, 0.0, 0.0, 0.0))
    limit = 146.0 + 999_999 * 2.0**-20
    ttft, runs = decode_schedule(exact, 1, 0, 10**9, (1001, 9), limit)
    assert [(r.chi, r.steps) for r in runs] == [(1001, 10**6)]
    assert ttft == pytest.approx(146e6 + 2.0**-20 * 999_999 * 10**6 / 2)  # Σ_j (146 + j·2^-20), j < 10^6
    assert decode_schedule(exact, 1, 0, 10**9 + 8, (1001, 9), limit) is None
    assert decode_schedule(exact, 1, 0, 10**9 + 800, (1001, 9), limit) is None  # asked again, longer


# -- Algorithm 1's decision at its boundaries, with a binary-exact model ---------------------------
# T_pf(n, c) = 10 + n/8; T0(B, K) = 20 + B; ΔT = p/8. χ_p = 64, 𝒳 = (72,), τ = 40 (β = 1).
# ℓ = 64: TTFT_pf = 10 + 8 = 18 with an empty queue; W([64]) = 64/64 · 18 = 18 → 36.
# A decode node with B = 8, K = 0: one step χ = 72 (p = 64): 28 + 8 = 36 = TTFT_dec.
EXACT = tiny_model(prefill_coef=(0.125, 0.0), decode_coef=(1.0, 0.0), mixed_delta_coef=(0.125, 0.0, 0.0, 0.0))
EXACT_PARAMS = PolicyParams(tbt_slo_ms=40.0, chunk_candidates=(72,), prefill_chunk_tokens=64)


@pytest.mark.parametrize("queue, knobs, decision, reason", [
    ([64], {"alpha": 1.0}, "deflect", "deflect_faster"),  # 36 ≤ 1 · 36, and not slower
    ([64], {"alpha": 1.0, "tbt_slo_ms": 36.0}, "deflect", "deflect_faster"),  # the step is at β·τ, not over
    ([], {"alpha": 2.0}, "deflect", "deflect_within_alpha"),  # 36 ≤ 2 · 18
    ([], {"alpha": 1.5}, "keep", "keep_alpha_margin"),  # 36 > 1.5 · 18 = 27
    ([], {"alpha": 2.0, "ttft_slo_ms": 36.0}, "deflect", "deflect_within_alpha"),  # 36 is not over 36
    ([], {"alpha": 2.0, "ttft_slo_ms": 35.5}, "keep", "keep_over_ttft_slo"),
])
def test_eq7_at_its_boundaries(queue, knobs, decision, reason):
    params = msgspec.structs.replace(EXACT_PARAMS, **knobs)
    d = parse_policy("kairos").decide(snapshot(64, [queue], [(8, 0, False)]), EXACT, params)
    assert (d.decision, d.reason) == (decision, reason)
    assert d.ttft_decode_est_ms == {"decode-0": 36.0}
    if decision == "deflect":
        assert (d.node, d.decode_node, d.chunk_schedule, d.predicted_step_ms) == ("decode-0", "decode-0", [72], [36.0])
    else:
        assert (d.node, d.decode_node, d.chunk_schedule) == ("prefill-0", "decode-0", [])


def test_ties_go_to_the_node_listed_first():
    params = msgspec.structs.replace(EXACT_PARAMS, alpha=2.0)
    d = parse_policy("kairos").decide(snapshot(64, [[], []], [(8, 0, False), (8, 0, False)]), EXACT, params)
    assert (d.decision, d.node) == ("deflect", "decode-0")
    d = parse_policy("kairos").decide(snapshot(64, [[], []], [(8, 0, False), (8, 0, False)]), EXACT,
                                      msgspec.structs.replace(params, alpha=1.0))
    assert (d.decision, d.node, d.ttft_prefill_est_ms) == ("keep", "prefill-0", 18.0)


def test_why_each_decode_node_could_not_take_the_request():
    # B = 30: T0 = 50 > 40 before any prompt token; decode-1 is reserved: no feasible node, and not
    # because every node is reserved
    d = parse_policy("kairos").decide(snapshot(64, [[]], [(30, 0, False), (8, 0, True)]), EXACT, EXACT_PARAMS)
    assert (d.decision, d.reason, d.node) == ("keep", "keep_no_feasible_node", "prefill-0")
    assert d.decode_infeasible == {"decode-0": "tbt_unsafe", "decode-1": "deflection_in_flight"}
    assert d.ttft_decode_est_ms == {"decode-0": None, "decode-1": None}


def _node(node_id, B, in_flight=(), flag=False, **kw):
    from kairos.core.cluster.snapshot import DecodeNodeView, InFlightDeflection

    return DecodeNodeView(id=node_id, batch_size=B, kv_tokens=0, deflection_in_flight=flag,
                          in_flight=[InFlightDeflection(prompt_tokens=t) for t in in_flight], **kw)


def test_kairos_plus_projects_the_deflections_in_flight():
    from kairos.core.cluster.snapshot import ClusterSnapshot, PrefillNodeView, RequestView

    nodes = [
        # a 32-token deflection runs first: one χ = 72 step carrying 32 tokens, 28 + 4 = 32; then
        # B = 9, K = 32: χ = 72 carries 63 tokens (29 + 63/8 = 36.875), then the last 1 (29.125) → 98
        _node("ahead", 8, [32], flag=True),
        # two run first: 32, then 29 + 32/8 = 33 at B = 9; then B = 10, K = 64: χ = 72 carries 62
        # tokens (30 + 62/8 = 37.75), then the last 2 (30.25) → 65 + 68 = 133
        _node("two ahead", 8, [32, 32], flag=True),
        # an in-flight deflection with nothing left to prefill only joins the batch: 36.875 + 29.125
        _node("joined", 8, [0], flag=True),
        # ... and on a node already unsafe for any chunk, the request is what cannot be scheduled
        _node("full", 20, [0], flag=True),
        # B = 20: the in-flight deflection's own first step (40 + 52/8 = 46.5) is over 40
        _node("unsafe", 20, [16], flag=True),
        # flagged, but nothing known about it to project: skipped as in Algorithm 1
        _node("flagged", 8, flag=True),
    ]
    snap = ClusterSnapshot(request=RequestView(id="r", prompt_tokens=64), prefill_nodes=[PrefillNodeView(id="p")],
                           decode_nodes=nodes)
    params = msgspec.structs.replace(EXACT_PARAMS, alpha=4.0, project_decode_state=True)
    d = parse_policy("kairos").decide(snap, EXACT, params)
    assert d.ttft_decode_est_ms == {"ahead": 98.0, "two ahead": 133.0, "joined": 66.0, "full": None, "unsafe": None,
                                    "flagged": None}
    assert d.decode_infeasible == {"full": "tbt_unsafe", "unsafe": "tbt_unsafe_in_flight",
                                   "flagged": "deflection_in_flight"}
    assert (d.decision, d.node, d.chunk_schedule, d.predicted_step_ms) == ("deflect", "joined", [72, 72],
                                                                          [36.875, 29.125])
    # without the switch every one of them is skipped
    d = parse_policy("kairos").decide(snap, EXACT, msgspec.structs.replace(params, project_decode_state=False))
    assert (d.decision, d.reason) == ("keep", "keep_all_reserved")


def test_kairos_plus_correction_scales_the_estimate_and_tightens_eq5():
    from kairos.core.cluster.snapshot import ClusterSnapshot, PrefillNodeView, RequestView

    # bias 2: TTFT_dec and the predicted step 2 · 36 = 72; safety 1.25: 36 > 40 / 1.25 = 32 → unsafe
    nodes = [_node("biased", 8, step_bias=2.0), _node("unsure", 8, step_safety=1.25)]
    snap = ClusterSnapshot(request=RequestView(id="r", prompt_tokens=64), prefill_nodes=[PrefillNodeView(id="p")],
                           decode_nodes=nodes)
    params = msgspec.structs.replace(EXACT_PARAMS, alpha=4.0, model_correction=True)
    d = parse_policy("kairos").decide(snap, EXACT, params)
    assert d.ttft_decode_est_ms == {"biased": 72.0, "unsure": None}
    assert (d.decision, d.node, d.chunk_schedule, d.predicted_step_ms) == ("deflect", "biased", [72], [72.0])
    # Algorithm 1 as printed ignores both fields
    d = parse_policy("kairos").decide(snap, EXACT, msgspec.structs.replace(params, model_correction=False))
    assert d.ttft_decode_est_ms == {"biased": 36.0, "unsure": 36.0}


def test_a_chunk_of_one_prompt_token_is_a_chunk():
    # B = 8, 𝒳 = (9,): every step carries p = 1 token at 28 + 1/8 = 28.125 (slope 0): ℓ = 3 → 3 steps
    ttft, runs = decode_schedule(EXACT, 8, 0, 3, (9,), 40.0)
    assert expand_runs(runs) == ([9, 9, 9], [28.125] * 3) and ttft == 84.375


def test_eq5_refuses_a_step_one_ulp_over_the_limit_where_the_closed_form_guesses_one_more():
    """Eq. 5 (T ≤ β·τ) decided step by step, not by the run's closed form alone: with
    T(step j) = 0.7 + 2.5·j ms (B = 1, K = 0, χ = 2: p = 1, c_j = j), the second step takes 3.2 ms.
    Against a limit one ulp under 3.2, (limit − 0.7) / 2.5 rounds to exactly 1.0, so the closed-form
    guess of the run's length is 2 steps; the second is over the limit and must be refused (no χ is
    left, so a 2-token prompt has no schedule). At a limit of exactly 3.2 both steps are safe."""
    import math

    m = tiny_model(decode_intercept_ms=0.7, decode_coef=(0.0, 0.0), mixed_delta_coef=(0.0, 0.0, 2.5, 0.0))
    assert m.mixed_step_ms(1, 1, 1, 1) == 3.2  # the second step, by the model itself
    under = math.nextafter(3.2, 0.0)
    assert (under - 0.7) / ((0.7 + 2.5) - 0.7) == 1.0  # the float trap the guard exists for
    ttft, runs = decode_schedule(m, 1, 0, 1, (2,), under)  # a 1-token prompt: the first step only
    assert ttft == 0.7 and [(r.chi, r.steps) for r in runs] == [(2, 1)]
    assert decode_schedule(m, 1, 0, 2, (2,), under) is None
    ttft, runs = decode_schedule(m, 1, 0, 2, (2,), 3.2)
    assert ttft == pytest.approx(3.9)  # 0.7 + 3.2
    assert [(r.chi, r.steps) for r in runs] == [(2, 2)]


def test_queue_wait_of_a_one_token_queue():
    # Eq. 2 for a queue of one 1-token prompt, χ_p = 64: (1/64) · T_pf(64, c = 0.5)
    # = (10 + 6.4 + 0.0001·64·0.5) / 64 = 16.4032 / 64 = 0.2563 ms
    assert prefill_queue_wait_ms(M, [1], 64) == pytest.approx(0.2563)
    assert prefill_queue_wait_ms(M, [], 64) == 0.0


def test_decisions_under_two_models_use_each_models_own_sweeps():
    # the same node state decided under the tiny model and under one 10 ms slower per decode step:
    # the slower model's deflection estimate is its own, not the first model's memoised sweep
    params = PolicyParams(chunk_candidates=(110, 60, 20), tbt_slo_ms=60.001, ttft_slo_ms=10_000.0, alpha=100.0)
    s = snapshot(400, [[3000]], [(10, 10_000, False)])
    fast = parse_policy("kairos").decide(s, M, params)
    slow = parse_policy("kairos").decide(s, tiny_model(decode_intercept_ms=30.0), params)
    d0 = next(iter(fast.ttft_decode_est_ms))
    assert fast.ttft_decode_est_ms[d0] is not None and slow.ttft_decode_est_ms[d0] is not None
    assert slow.ttft_decode_est_ms[d0] > fast.ttft_decode_est_ms[d0]


def test_a_sweep_cache_is_never_another_models_even_under_a_reused_id():
    # CPython reuses the id of a freed object: a cache left under a new model's id by a model
    # that is gone must not be handed to the new one
    from kairos.core.policy import estimates as E

    old, new = tiny_model(), tiny_model(decode_intercept_ms=30.0)
    stale = E.sweep_cache(old)
    stale["marker"] = "old model's sweeps"
    E._SWEEPS[id(new)] = E._SWEEPS.pop(id(old))  # as if `new` got the id `old` had
    assert "marker" not in E.sweep_cache(new)
    assert E.sweep_cache(new) is E.sweep_cache(new)  # and the new model's cache is kept


@pytest.mark.parametrize("first_ms, slope_ms, limit, safe_steps", [
    # T(step j) = first + slope·j (B = 1, K = 0, χ = 2: p = 1, c_j = j). The run's length is guessed
    # in closed form, 1 + ⌊(limit − first)/slope⌋, and corrected step by step at float boundaries:
    # 44.18 + 5.1·6 = 74.78 = the limit: 7 steps, where the guess says 6 (too low by one)
    (44.18, 5.1, 74.78, 7),
    # 30.4 + 20·4 = 110.4 > the limit one ulp under it: 4 steps, where the guess says 5 (too high)
    (30.4, 20.0, 110.39999999999999, 4),
])
def test_a_runs_length_is_the_last_step_within_the_limit_not_the_closed_form_guess(first_ms, slope_ms, limit,
                                                                                    safe_steps):
    m = tiny_model(decode_intercept_ms=first_ms, decode_coef=(0.0, 0.0), mixed_delta_coef=(0.0, 0.0, slope_ms, 0.0))
    assert m.mixed_step_ms(1, 0, 1, safe_steps - 1) <= limit < m.mixed_step_ms(1, 0, 1, safe_steps)  # by the model
    ttft, runs = decode_schedule(m, 1, 0, safe_steps, (2,), limit)
    assert [(r.chi, r.steps) for r in runs] == [(2, safe_steps)]
    assert decode_schedule(m, 1, 0, safe_steps + 1, (2,), limit) is None  # no χ left after them



@pytest.mark.parametrize("first_ms, decode_kv_coef, slope_per_cached, limit", [
    # the decodes' KV coefficient at 1e-15 ms/token: step j takes 10.1 + 1e-15·j ms
    (10.1, 1e-15, 0.0, 11.0),
    # 1.4e-13 ms per step, the limit one ulp under a step 2.8·10^14 steps on: the closed form guesses one
    # step too many and the downward guard corrects it (a guard that restarted from one step would not return)
    (20.37, 0.0, 1.4210854715202004e-13, 60.36939713126835),
])
def test_a_run_that_grows_by_femtoseconds_per_step_is_sized_in_closed_form(first_ms, decode_kv_coef,
                                                                          slope_per_cached, limit):
    """A profile may set a coefficient to 1e-15 (``from_dict`` takes any finite non-negative number):
    T then grows by femtoseconds per step and a run's length is ~10^14 steps. The closed form sizes
    it at once and a prompt's schedule is that run's first ℓ steps; a guard loop that walked from a
    guess far off (from 1, or from (limit + T1)/slope) would never return."""
    m = LatencyModel.from_dict(tiny_model(decode_intercept_ms=first_ms - 0.1, decode_coef=(0.0, decode_kv_coef),
                                          mixed_delta_coef=(0.1, 0.0, slope_per_cached, 0.0)).to_dict())
    # B = 1, K = 0, χ = 2: p = 1; step j takes T(1, j, 1, j), within the limit for far more than 1000 steps
    ttft, runs = decode_schedule(m, 1, 0, 1000, (2,), limit)
    assert [(r.chi, r.steps, r.prefill_tokens) for r in runs] == [(2, 1000, 1)]
    assert ttft == pytest.approx(sum(m.mixed_step_ms(1, j, 1, j) for j in range(1000)), rel=1e-12)
