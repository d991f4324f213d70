"""Step-latency models: fitting, held-out MAPE, artifact round trip, vectorized evaluation."""

import json

import numpy as np
import pytest

from kairos.core.model.fitting import StepRecord, fit_latency_model, mape, report_mape
from kairos.core.model.latency import LatencyModel, LatencyProfileError, load_profile

TRUE = load_profile()


def synthetic_records(model: LatencyModel, n: int, seed: int, noise: float = 0.0) -> list[StepRecord]:
    """Step records of all three kinds generated from ``model`` (± multiplicative noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            B, K, p, c = 0, 0, int(rng.integers(16, 2049)), int(rng.integers(0, 30_000))
        elif kind == 1:
            B = int(rng.integers(1, 128))
            B, K, p, c = B, B * int(rng.integers(100, 15_000)), 0, 0
        else:
            B = int(rng.integers(1, 64))
            B, K, p, c = B, B * int(rng.integers(100, 15_000)), int(rng.integers(16, 2048)), int(rng.integers(0, 16_000))
        y = model.step_ms(B, K, p, c) * (1 + noise * rng.standard_normal())
        out.append(StepRecord(B, K, p, c, y))
    return out


def test_fit_recovers_known_coefficients():
    fitted = fit_latency_model(synthetic_records(TRUE, 900, seed=1), name="fit", version="1")
    assert fitted.prefill_intercept_ms == pytest.approx(TRUE.prefill_intercept_ms, rel=1e-6)
    assert fitted.prefill_coef == pytest.approx(TRUE.prefill_coef, rel=1e-6)
    assert fitted.decode_intercept_ms == pytest.approx(TRUE.decode_intercept_ms, rel=1e-6)
    assert fitted.decode_coef == pytest.approx(TRUE.decode_coef, rel=1e-6)
    assert fitted.mixed_delta_coef == pytest.approx(TRUE.mixed_delta_coef, rel=1e-5)
    assert all(v == pytest.approx(0.0, abs=1e-6) for v in fitted.mape.values())


def test_mape_is_measured_on_held_out_rows_only():
    recs = synthetic_records(TRUE, 600, seed=2, noise=0.05)
    # corrupt every record: a model fitted on them must report the error it makes on held-out rows
    fitted = fit_latency_model(recs, name="fit", version="1", holdout=0.25, seed=3)
    for kind in ("prefill", "decode", "mixed"):
        assert 1.0 < fitted.mape[kind] < 10.0  # 5 % Gaussian noise ≈ 4 % MAPE
    # the held-out MAPE is not the in-sample MAPE of the same rows
    in_sample = report_mape(fitted, recs)
    assert set(in_sample) == {"prefill", "decode", "mixed"}
    assert fitted.mape["prefill"] != pytest.approx(in_sample["prefill"], rel=1e-9)


def test_mape_definition():
    assert mape([100, 200], [110, 180]) == pytest.approx(10.0)


def test_fit_needs_records_of_each_kind():
    with pytest.raises(ValueError, match="at least 5"):
        fit_latency_model(synthetic_records(TRUE, 9, seed=1), name="x", version="1")


def test_artifact_round_trip(tmp_path):
    path = tmp_path / "m.json"
    TRUE.save(path)
    again = load_profile(path)
    assert again == TRUE
    doc = json.loads(path.read_text())
    assert doc["units"]["latency"] == "ms" and doc["metadata"]["provenance"] == "calibration"
    assert doc["mixed_delta"]["features"] == ["p", "p^2", "p*c", "p*K"]


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["decode"].update(features=["B"]), "decode.features"),
    (lambda d: d["mixed_delta"].update(coef=[0.1, -1, 0, 0]), "non-negative"),
    (lambda d: d.pop("prefill"), "missing field 'prefill'"),
    (lambda d: d["kv_transfer"].update(default_link="nope"), "default_link"),
])
def test_invalid_artifacts_are_rejected(tmp_path, mutate, match):
    doc = TRUE.to_dict()
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(LatencyProfileError, match=match):
        load_profile(p)


def test_unknown_profile_name_lists_bundled():
    with pytest.raises(LatencyProfileError, match="a100-dsv2lite"):
        load_profile("no-such-profile")


def test_vectorized_over_nodes_matches_scalar():
    B = np.array([0, 4, 16, 64])
    K = B * 3569
    vec = TRUE.mixed_step_ms(B, K, 512 - B, 1024)
    assert vec.shape == (4,)
    assert vec == pytest.approx([TRUE.mixed_step_ms(int(b), int(k), int(512 - b), 1024) for b, k in zip(B, K)])
    assert TRUE.kv_transfer_ms(np.array([0, 1000])) == pytest.approx(
        [TRUE.kv_transfer_ms(0), TRUE.kv_transfer_ms(1000)])


def test_kv_transfer_formula():
    link = TRUE.link("rdma")
    # 10,000 tokens · 31,104 B / 25 GB/s = 12.4416 ms + setup
    assert TRUE.kv_transfer_ms(10_000, "rdma") == pytest.approx(link.setup_ms + 12.4416)
    with pytest.raises(LatencyProfileError, match="unknown link"):
        TRUE.kv_transfer_ms(1, "pigeon")


def test_fit_hygiene_rejects_invalid_and_outlier_samples_and_counts_them():
    clean = synthetic_records(TRUE, 600, seed=4, noise=0.02)
    bad = [StepRecord(4, 4000, 0, 0, float("nan")), StepRecord(4, 4000, 0, 0, -3.0), StepRecord(0, 0, 0, 0, 5.0),
           StepRecord(-1, 10, 0, 0, 40.0)]
    # stalls: 20 decode steps that took 10x their time (a GC pause, a preempted CPU)
    stalls = [StepRecord(r.batch_size, r.kv_tokens, 0, 0, 10 * r.latency_ms) for r in clean[1:60:3]]
    fitted = fit_latency_model(clean + bad + stalls, name="fit", version="1", seed=1)
    fit = fitted.metadata["fit"]
    assert fit["rejected"]["invalid"] == 4
    assert 12 <= fit["rejected"]["outlier"] <= 25  # the ~16 stalls in the training split, few clean rows
    baseline = fit_latency_model(clean, name="fit", version="1", seed=1)
    assert fitted.decode_coef == pytest.approx(baseline.decode_coef, rel=0.05)
    assert fitted.decode_intercept_ms == pytest.approx(baseline.decode_intercept_ms, rel=0.05)
    assert set(fit["mape_regions"]) == {"prefill", "decode", "mixed"}
    assert all(v["rows"] > 0 for regs in fit["mape_regions"].values() for v in regs.values())


def test_fit_above_the_mape_threshold_is_refused():
    from kairos.core.model.fitting import FitRefused

    noisy = synthetic_records(TRUE, 600, seed=5, noise=0.2)
    with pytest.raises(FitRefused, match="MAPE above 3") as exc:
        fit_latency_model(noisy, name="fit", version="1", max_mape=3.0)
    assert exc.value.model.mape["decode"] > 3.0
    assert fit_latency_model(synthetic_records(TRUE, 600, seed=5, noise=0.01), name="fit", version="1", max_mape=3.0)
