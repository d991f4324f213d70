"""β from a fitted profile's own step noise (kairos.core.model.latency.tbt_safety_beta) and where the vLLM
testbed uses it (kairos up/demo --engine vllm without --beta).

Truth for the fit report: the noise the records were generated with (a lognormal factor of known
quantiles on a known linear model), not the fitting code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.core.model.fitting import StepRecord, fit_latency_model
from kairos.core.model.latency import load_profile, step_noise_sigma, tbt_safety_beta

SIGMA = 0.12  #: log-sd of the generated steps' noise


def noisy_records(n: int = 4000, seed: int = 0) -> list[StepRecord]:
    """Prefill-only, decode-only and mixed steps: 5 + 0.05 p ms, 10 + 0.5 B ms, their sum, × e^N(0, σ²)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 3
        B = 0 if kind == 0 else int(rng.integers(1, 32))
        p = 0 if kind == 1 else int(rng.integers(16, 512))
        ms = (5.0 + 0.05 * p if kind == 0 else 10.0 + 0.5 * B + (0.05 * p if kind == 2 else 0.0))
        out.append(StepRecord(B, 100 * B, p, 0, ms * math.exp(rng.normal(0.0, SIGMA))))
    return out


def test_the_fit_reports_the_held_out_ratio_quantiles_of_the_noise_it_was_given():
    m = fit_latency_model(noisy_records(), name="n", version="1", base=load_profile("cpu-testbed-vllm"))
    q = m.metadata["fit"]["heldout_ratio_quantiles"]
    assert set(q) == {"prefill", "decode", "mixed"}
    # measured ÷ predicted of a least-squares fit: e^N(0, σ²) over its mean e^(σ²/2)
    for kind in q:
        for name, z in (("p50", 0.0), ("p95", 1.6449)):
            want = math.exp(z * SIGMA - SIGMA ** 2 / 2)
            assert q[kind][name] == pytest.approx(want, rel=0.04), (kind, name)
    assert tbt_safety_beta(m) == math.floor(100 / q["mixed"]["p95"]) / 100 < 0.9
    assert step_noise_sigma(m) == pytest.approx(SIGMA, rel=0.1)  # the simulator's noise: the generating σ
    assert step_noise_sigma(load_profile("a100-dsv2lite")) == 0.0


def test_beta_is_one_without_a_noise_report_or_without_noise_and_refuses_unknown_quantiles():
    assert tbt_safety_beta(load_profile("a100-dsv2lite")) == 1.0  # an emulated profile: no report
    exact = [StepRecord(r.batch_size, r.kv_tokens, r.prefill_tokens, 0,
                        (5.0 + 0.05 * r.prefill_tokens) if r.batch_size == 0 else
                        10.0 + 0.5 * r.batch_size + 0.05 * r.prefill_tokens) for r in noisy_records(600)]
    assert tbt_safety_beta(fit_latency_model(exact, name="e", version="1")) == 1.0  # never above 1
    with pytest.raises(KeyError, match="p97"):
        tbt_safety_beta(load_profile("cpu-testbed-vllm"), "p97")


def test_the_vllm_testbed_plans_with_the_profiles_beta_unless_beta_is_given(monkeypatch, tmp_path):
    import kairos.cli.demo
    from kairos.cli.demo import VLLM_DEMO
    import kairos.cli.up

    seen: list = []
    monkeypatch.setattr(kairos.cli.up, "run_up", lambda opts: seen.append(opts) or 0)
    monkeypatch.setattr(kairos.cli.demo, "run_demo", lambda opts, **kw: seen.append(opts) or 0)
    want = tbt_safety_beta(load_profile("cpu-testbed-vllm"))
    assert want < 1.0  # the committed testbed profile measured its noise
    vllm = ["up", "--engine", "vllm", "--model", str(tmp_path)]
    for args, beta, tau in ((vllm, want, VLLM_DEMO["tbt_slo_ms"]), (vllm + ["--beta", "0.95"], 0.95, VLLM_DEMO["tbt_slo_ms"]),
                            (vllm + ["--tbt-slo-ms", "90"], want, 90.0),
                            (["up"], 1.0, 70.0),  # emulated engines: the paper's β = 1, the default τ
                            (["demo", "--engine", "vllm", "--model", str(tmp_path)], want, VLLM_DEMO["tbt_slo_ms"])):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, (args, r.output)
        assert (seen[-1].beta, seen[-1].tbt_slo_ms) == (beta, tau), args
    # kairos up --engine vllm plans as the demo does: with τ = 70 ms and that β no chunk was deflectable
    assert seen[0].ttft_slo_ms == VLLM_DEMO["ttft_slo_ms"]
