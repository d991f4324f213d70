"""The default profile against each calibration statement of the paper (§3.2, Fig. 1,
Tables 1 and 3). docs/calibration.md lists which statements it meets."""

import itertools

import pytest

from kairos.core.model.latency import load_profile
from kairos.core.policy.estimates import prefill_exec_ms

M = load_profile("a100-dsv2lite")
BATCHES = (4, 8, 16, 32)
CONTEXTS = (842, 998, 3569, 13968, 14013)  # K per decode request (Table 1 medians)
LOW_K, HIGH_K = (842, 998), (3569, 13968, 14013)


def delta_at_chunk(B, ctx, chi, index):
    """ΔT of the index-th (1-based) successive chunk of total size χ (χ − B prefill tokens each)."""
    p = chi - B
    return M.mixed_delta_ms(B, B * ctx, p, (index - 1) * p)


def test_is_marked_as_calibration():
    assert M.metadata["provenance"] == "calibration"
    assert "NOT A MEASUREMENT" in M.metadata["note"]


@pytest.mark.parametrize("chi", [128, 256, 512])
def test_small_chunks_add_at_most_30ms_over_five_chunks(chi):
    for B, ctx, i in itertools.product(BATCHES, CONTEXTS, range(1, 6)):
        assert delta_at_chunk(B, ctx, chi, i) <= 30.0, (B, ctx, i)


def test_chunk_1024_first_chunk_30ms_low_context_up_to_50ms_high():
    low = [delta_at_chunk(B, ctx, 1024, 1) for B in BATCHES for ctx in LOW_K]
    high = [delta_at_chunk(B, ctx, 1024, 1) for B in BATCHES for ctx in HIGH_K]
    assert all(25 <= d <= 35 for d in low), low  # ≈ 30 ms
    assert 45 <= max(high) <= 55, max(high)  # up to ≈ 50 ms
    assert min(high) >= min(low)


def test_delta_grows_with_batch_chunk_index_and_context():
    for chi in (1024, 2048):
        assert delta_at_chunk(32, 3569, chi, 1) > delta_at_chunk(4, 3569, chi, 1)
        assert delta_at_chunk(16, 3569, chi, 5) > delta_at_chunk(16, 3569, chi, 1)
        assert delta_at_chunk(16, 14013, chi, 1) > delta_at_chunk(16, 842, chi, 1)


def test_chunk_2048_reaches_about_250ms_by_fifth_chunk():
    fifth = [delta_at_chunk(B, ctx, 2048, 5) for B in BATCHES for ctx in CONTEXTS]
    assert 220 <= min(fifth) and max(fifth) <= 290, (min(fifth), max(fifth))


@pytest.mark.parametrize("B,ctx", [(4, 14013), (8, 3569), (16, 3569), (16, 998)])
def test_decode_step_near_50ms_at_table1_loads(B, ctx):
    assert 45.0 <= M.decode_step_ms(B, B * ctx) <= 55.0


def test_prefill_exec_matches_table3_scale():
    chi_p = M.engine.max_num_batched_tokens
    # Bursty P95 prefill exec 1,070 ms at its P95 prompt (~14K tokens)
    assert prefill_exec_ms(M, 14_000, chi_p) == pytest.approx(1070, rel=0.15)
    # roughly 10K prompt tokens/s on long prompts
    assert 9_000 <= 20_000 / (prefill_exec_ms(M, 20_000, chi_p) / 1000) <= 16_000
