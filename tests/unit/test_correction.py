"""Closed-loop correction: the estimator against residuals drawn from a known distribution, the
policy's use of it (Eq. 5 limit and Eq. 6 scale), the ground truth's drift, and `kairos sim`'s
model-error options."""

from __future__ import annotations

import json
import math

import msgspec
import numpy as np
import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.core.model.correction import IDENTITY, CorrectionEstimator, StepCorrection
from kairos.core.engine_model import GroundTruth
from kairos.core.policy import PolicyParams
from kairos.core.policy import parse_policy
from kairos.core.policy.estimates import decode_schedule
from kairos.core.cluster.snapshot import DecodeNodeView
from tests.factories import snapshot, tiny_model

MODEL = tiny_model()


def feed(est: CorrectionEstimator, node: str, ratios, t0: float = 0.0, dt: float = 10.0) -> float:
    t = t0
    for r in ratios:
        est.observe(node, 50.0, 50.0 * r, t)
        t += dt
    return t


def test_bias_and_safety_match_the_residual_distribution():
    rng = np.random.default_rng(0)
    sigma, scale = 0.05, 1.1
    ratios = scale * np.exp(sigma * rng.standard_normal(2000))
    est = CorrectionEstimator(window_ms=1e9, quantile=0.999)
    t = feed(est, "d0", ratios)
    c = est.correction("d0", t)
    assert c.samples == 2000
    assert c.bias == pytest.approx(scale * math.exp(sigma ** 2 / 2), rel=0.01)
    assert c.safety == pytest.approx(scale * math.exp(3.09 * sigma), rel=0.02)
    # the bound holds out of sample: fresh ratios exceed it about 0.1 % of the time
    fresh = scale * np.exp(sigma * rng.standard_normal(200_000))
    assert np.mean(fresh > c.safety) < 0.003


def test_window_forgets_old_steps_and_follows_a_drift():
    est = CorrectionEstimator(window_ms=1000.0, min_samples=10)
    t = feed(est, "d0", [1.0] * 200)  # 2 s at exact
    assert est.correction("d0", t).safety == pytest.approx(1.0)
    t = feed(est, "d0", [1.15] * 50, t0=t)  # 0.5 s after a 15 % drift: a mixture, margin widened
    mid = est.correction("d0", t)
    assert mid.safety > 1.15
    t = feed(est, "d0", [1.15] * 150, t0=t)  # the window holds only drifted steps
    assert est.correction("d0", t).bias == pytest.approx(1.15)
    idle = est.correction("d0", t + 5000)  # all aged out (the node idled): the last correction stays
    assert idle.samples == 0 and idle.bias == pytest.approx(1.15)


def test_too_few_or_bad_samples_give_identity():
    est = CorrectionEstimator(min_samples=30)
    c = est.correction("nobody", 0.0)
    assert (c.bias, c.safety, c.samples) == (IDENTITY.bias, IDENTITY.safety, 0)
    feed(est, "d0", [2.0] * 29)
    assert est.correction("d0", 300.0).bias == 1.0
    assert not est.observe("d0", 0.0, 5.0, 1.0) and not est.observe("d0", 5.0, math.nan, 1.0)
    with pytest.raises(ValueError):
        CorrectionEstimator(quantile=1.0)


def test_policy_applies_the_safety_to_eq5_and_the_bias_to_eq6():
    snap = snapshot(126, [[5000]], [(2, 1000, False)])
    plain = parse_policy("kairos").decide(snap, MODEL, PolicyParams())
    node = msgspec.structs.replace(snap.decode_nodes[0], step_bias=1.2, step_safety=1.5)
    corrected_snap = msgspec.structs.replace(snap, decode_nodes=[node])
    pp = PolicyParams(model_correction=True)
    got = parse_policy("kairos").decide(corrected_snap, MODEL, pp)
    limit = pp.step_limit_ms / 1.5
    want = decode_schedule(MODEL, 2, 1000, 126, sorted(pp.chunk_candidates, reverse=True), limit)
    assert want is not None
    assert plain.chunk_schedule == [256] and got.chunk_schedule == [128]  # 256: T = 48.4 ms > 70 / 1.5
    assert got.ttft_decode_est_ms["decode-0"] == pytest.approx(1.2 * want[0])
    assert all(t / 1.2 <= limit + 1e-9 for t in got.predicted_step_ms)
    assert got.ttft_decode_est_ms["decode-0"] != pytest.approx(plain.ttft_decode_est_ms["decode-0"])
    # kairos (Algorithm 1 as printed) ignores the fields
    assert parse_policy("kairos").decide(corrected_snap, MODEL, PolicyParams()) == plain
    assert parse_policy("kairos+").params(PolicyParams()).model_correction


def test_ground_truth_scale_and_drift_from_its_clock():
    now = [0.0]
    gt = GroundTruth(MODEL, scale=1.1, drift_scale=1.15, drift_at_ms=1000.0, clock=lambda: now[0])
    base = MODEL.step_ms(4, 1000, 0, 0)
    assert gt.step_ms(4, 1000, 0, 0) == pytest.approx(1.1 * base)
    now[0] = 1000.0
    assert gt.step_ms(4, 1000, 0, 0) == pytest.approx(1.1 * 1.15 * base)
    with pytest.raises(ValueError):
        GroundTruth(MODEL, scale=0.0)


@pytest.mark.parametrize("drift", ["decode-9:15:10", "decode-0:15", "decode-0:-100:1", "x:y:z"])
def test_kairos_sim_rejects_a_bad_drift(drift):
    res = CliRunner().invoke(main, ["sim", "--duration", "5", "--drift", drift])
    assert res.exit_code == 2 and "--drift" in res.stderr


def test_kairos_sim_truth_scale_and_drift_slow_the_engines(tmp_path):
    def tbt_p50(*extra) -> float:
        out = tmp_path / "r.json"
        res = CliRunner().invoke(main, ["sim", "--duration", "30", "--policy", "pd", "--json", str(out), *extra])
        assert res.exit_code == 0, res.output
        return json.loads(out.read_text())[0]["tbt_ms"]["p50"]
    base = tbt_p50()
    assert tbt_p50("--truth-scale", "1.5") == pytest.approx(1.5 * base, rel=0.05)
    assert base < tbt_p50("--drift", "decode-0:50:0") < 1.5 * base  # one of two decode nodes slower


# z of the 0.975 quantile of the standard normal (table value): the small-window cases below use it
Z975 = 1.959964


def feed_logs(est: CorrectionEstimator, node: str, logs, mixed: bool = False, t0: float = 0.0) -> float:
    """One step per log-residual x (predicted 100 ms, actual 100·e^x ms), 10 ms apart."""
    t = t0
    for x in logs:
        assert est.observe(node, 100.0, 100.0 * math.exp(x), t, mixed=mixed)
        t += 10.0
    return t


@pytest.mark.parametrize("logs, bias, safety", [
    # n = 2, x = ±0.1: m = 0, s² = (0.01 + 0.01) / (2 − 1) = 0.02, s = 0.141421, sqrt(1 + 1/2) = 1.224745
    # safety = exp(1.959964 · 0.141421 · 1.224745) = exp(0.339468) = 1.404211; bias = cosh(0.1) = 1.005004
    # (without n/(n−1): s = 0.1, 1.271307; without sqrt(1 + 1/n): exp(0.277180) = 1.319405)
    ([-0.1, 0.1], 1.005004, 1.404211),
    # n = 3, x = −0.1, 0, 0.1: m = 0, s² = 0.02 / 2 = 0.01, s = 0.1, sqrt(1 + 1/3) = 1.154701
    # safety = exp(1.959964 · 0.1 · 1.154701) = exp(0.226317) = 1.253973; bias = (e^−0.1 + 1 + e^0.1) / 3 = 1.003336
    ([-0.1, 0.0, 0.1], 1.003336, 1.253973),
    # n = 4, x = 0.1, 0.1, 0.3, 0.3: m = 0.2, s² = 4 · 0.01 / 3 = 0.013333, s = 0.115470, sqrt(1 + 1/4) = 1.118034
    # safety = exp(0.2 + 1.959964 · 0.115470 · 1.118034) = exp(0.453029) = 1.573072
    # bias = (2·e^0.1 + 2·e^0.3) / 4 = (1.105171 + 1.349859) / 2 = 1.227515
    ([0.1, 0.1, 0.3, 0.3], 1.227515, 1.573072),
])
def test_small_window_bound_has_the_small_sample_terms(logs, bias, safety):
    est = CorrectionEstimator(window_ms=1e6, min_samples=2, quantile=0.975)
    t = feed_logs(est, "d0", logs)
    c = est.correction("d0", t)
    assert c.samples == len(logs) and c.window_ms == 1e6
    assert c.bias == pytest.approx(bias, rel=1e-5)
    assert c.safety == pytest.approx(safety, rel=1e-5)


@pytest.mark.parametrize("logs, bias, safety", [
    ([math.log(5.0)] * 3, 4.0, 4.0),  # every step 5× the model: both factors capped at MAX_FACTOR = 4
    ([math.log(0.2)] * 3, 0.25, 0.25),  # every step 0.2×: both raised to MIN_FACTOR = 0.25
    ([math.log(3.9)] * 3, 3.9, 3.9),  # just inside the bounds: unchanged (s = 0, safety = e^m = 3.9)
    ([math.log(0.3)] * 3, 0.3, 0.3),
    # x = ln 2 ± 0.5: bias = 2·cosh(0.5) = 2.255252 stays; s² = 0.5 / 1, s = 0.707107,
    # safety = 2·exp(1.959964 · 0.707107 · 1.224745) = 2·e^1.697378 = 10.92 → capped at 4
    ([math.log(2.0) - 0.5, math.log(2.0) + 0.5], 2.255252, 4.0),
])
def test_factors_are_clamped_to_a_quarter_and_four(logs, bias, safety):
    est = CorrectionEstimator(window_ms=1e6, min_samples=2, quantile=0.975)
    c = est.correction("d0", feed_logs(est, "d0", logs))
    assert c.bias == pytest.approx(bias, rel=1e-5) and c.safety == pytest.approx(safety, rel=1e-5)


def test_defaults_and_rejected_settings():
    est = CorrectionEstimator()  # docs/policies.md: a 10 s window, 30 steps, q = 0.999, a mixed window 3× longer
    assert (est.window_ms, est.min_samples, est.quantile, est.max_samples) == (10_000.0, 30, 0.999, 4096)
    assert est.mixed_window_ms == 30_000.0
    assert est.z == pytest.approx(3.090232, rel=1e-6)  # z of 0.999 (normal table)
    assert CorrectionEstimator(window_ms=100.0, mixed_window_factor=0.5).mixed_window_ms == 100.0  # never shorter
    CorrectionEstimator(window_ms=0.5, min_samples=2, quantile=0.51, max_samples=2)  # the smallest valid settings
    for bad in ({"window_ms": 0.0}, {"min_samples": 1}, {"quantile": 0.5}, {"quantile": 1.0},
                {"min_samples": 5, "max_samples": 4}):
        with pytest.raises(ValueError, match=r"^need window_ms > 0, min_samples >= 2, 0.5 < quantile < 1, "
                                             r"max_samples >= min_samples$"):
            CorrectionEstimator(**bad)


def test_observe_accepts_any_positive_finite_time():
    est = CorrectionEstimator(window_ms=1e6, min_samples=2)
    assert est.observe("d0", 0.5, 0.5, 0.0) and est.observe("d0", 0.5, 0.5, 1.0)  # sub-millisecond steps count
    for pred, actual in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, math.inf), (math.inf, 1.0)):
        assert not est.observe("d0", pred, actual, 2.0)
    assert est.correction("d0", 2.0).samples == 2


def test_window_edges_and_sample_cap():
    est = CorrectionEstimator(window_ms=100.0, min_samples=2, max_samples=3)
    feed_logs(est, "d0", [0.0, 0.0, 0.0, 0.0])  # t = 0, 10, 20, 30: the cap keeps the last 3
    assert est.correction("d0", 30.0).samples == 3
    assert est.correction("d0", 110.0).samples == 3  # cutoff 10: the step at t = 10 is still in
    assert est.correction("d0", 110.1).samples == 2


def test_exactly_min_samples_is_enough_and_refilled_window_starts_clean():
    est = CorrectionEstimator(window_ms=100.0, min_samples=3, quantile=0.975)
    t = feed_logs(est, "d0", [math.log(2.0)] * 2)
    assert est.correction("d0", t) == StepCorrection(samples=2, window_ms=100.0)  # 2 < 3: identity
    t = feed_logs(est, "d0", [math.log(2.0)], t0=t)
    assert est.correction("d0", t).bias == pytest.approx(2.0)  # 3 steps of ratio 2
    assert est.correction("d0", 1000.0).samples == 0  # all aged out: the sums restart from 0
    feed_logs(est, "d0", [math.log(3.0)], t0=1000.0)
    feed_logs(est, "d0", [0.0], t0=1150.0)
    assert est.correction("d0", 1150.0).samples == 1  # the ratio-3 step left, one ratio-1 step stays
    t = feed_logs(est, "d0", [0.0, 0.0], t0=1160.0)
    c = est.correction("d0", t)  # three ratio-1 steps, no residue of the earlier ones in the sums
    assert (c.bias, c.safety, c.samples) == (pytest.approx(1.0), pytest.approx(1.0), 3)


def test_an_idle_node_keeps_its_last_correction_whole():
    est = CorrectionEstimator(window_ms=100.0, min_samples=2, quantile=0.975)
    t = feed_logs(est, "d0", [-0.1, 0.1])  # bias 1.005004, safety 1.404211 (the n = 2 case above)
    learned = est.correction("d0", t)
    assert est.correction("d0", 10_000.0) == StepCorrection(bias=learned.bias, safety=learned.safety,
                                                               samples=0, window_ms=100.0)
    assert learned.safety == pytest.approx(1.404211, rel=1e-5)


def test_mixed_steps_set_the_bias_and_can_only_widen_the_safety():
    est = CorrectionEstimator(window_ms=1e6, min_samples=2, quantile=0.975, mixed_window_factor=1.0)
    t = feed_logs(est, "d0", [0.1, 0.1, 0.3, 0.3])  # pooled alone: bias 1.227515, safety 1.573072 (n = 4 above)
    assert est.correction("d0", t).bias == pytest.approx(1.227515, rel=1e-5)
    t = feed_logs(est, "d0", [-0.1], mixed=True, t0=t)  # one mixed step (< 2): the pooled numbers still rule
    assert est.correction("d0", t).samples == 5
    t = feed_logs(est, "d0", [0.1], mixed=True, t0=t)
    # mixed window x = ±0.1 (n = 2): bias cosh(0.1) = 1.005004, safety 1.404211; the pooled window (now
    # 0.1, 0.1, 0.3, 0.3, −0.1, 0.1) has a larger bound, so it stays the safety
    c = est.correction("d0", t)
    assert c.bias == pytest.approx(1.005004, rel=1e-5) and c.safety > 1.404211 * 1.01
    est2 = CorrectionEstimator(window_ms=1e6, min_samples=2, quantile=0.975)
    t = feed_logs(est2, "d0", [0.0, 0.0])  # pooled s = 0 before the mixed steps
    t = feed_logs(est2, "d0", [-0.1, 0.1], mixed=True, t0=t)
    # pooled 0, 0, −0.1, 0.1: s² = 0.02 / 3, s = 0.081650, bound exp(1.959964 · 0.081650 · 1.118034) = 1.195924;
    # the mixed bound 1.404211 is larger and wins
    c = est2.correction("d0", t)
    assert c.safety == pytest.approx(1.404211, rel=1e-5) and c.bias == pytest.approx(1.005004, rel=1e-5)
