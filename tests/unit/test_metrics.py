"""Serving metrics (kairos/core/workload/serving_metrics.py): hand-computed percentiles, SLO attainment, table."""

from __future__ import annotations

import msgspec
import pytest

from kairos.core.workload.serving_metrics import RequestRecord, format_table, summarize

KEYS = {"requests", "completed", "failed", "ttft_ms", "ttft_breakdown_p95_ms", "tbt_ms",
        "tbt_violation_rate", "tbt_gap_violation_rate", "slo_attainment", "deflections", "output_tokens_per_s",
        "total_tokens_per_s"}


def rec(i: int, arrival_s: float, ttft_ms: float | None, token_times_s: list[float], **kw) -> RequestRecord:
    return RequestRecord(id=f"r{i}", arrival_s=arrival_s, prompt_tokens=100,
                         output_tokens=len(token_times_s), ttft_ms=ttft_ms,
                         token_times_s=token_times_s, **kw)


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # gaps 50, 100 ms → own P95 97.5 ms > τ: misses TBT
        rec(0, 0.0, 100.0, [0.1, 0.15, 0.25], prefill_queue_ms=10.0, kv_transfer_ms=5.0),
        # gaps 60, 60, 60 → meets both
        rec(1, 1.0, 200.0, [1.2, 1.26, 1.32, 1.38], prefill_queue_ms=20.0, deflected=True),
        # single token: TBT part met, TTFT 5 s misses
        rec(2, 2.0, 5000.0, [7.0], prefill_queue_ms=30.0),
        # single token, meets both
        rec(3, 3.0, 300.0, [3.3], prefill_queue_ms=40.0),
        # failed before its first token
        RequestRecord(id="r4", arrival_s=4.0, prompt_tokens=100, output_tokens=0, error="timeout",
                      deflected=True),
    ]


def test_hand_computed_summary(records: list[RequestRecord]) -> None:
    s = summarize(records)
    assert set(s) == KEYS
    assert (s["requests"], s["completed"], s["failed"], s["deflections"]) == (5, 4, 1, 2)
    # TTFTs sorted 100, 200, 300, 5000; linear: p50 = 250, p95 at rank 2.85, p99 at rank 2.97
    assert s["ttft_ms"] == pytest.approx({"p50": 250.0, "p95": 300 + 0.85 * 4700, "p99": 300 + 0.97 * 4700})
    # gaps sorted 50, 60, 60, 60, 100: p50 = 60, p95 at rank 3.8 = 60 + 0.8 * 40
    assert s["tbt_ms"] == pytest.approx({"p50": 60.0, "p95": 92.0})
    assert s["tbt_violation_rate"] == pytest.approx(1 / 5)  # the single 100 ms gap
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # r1 and r3
    # duration = last token 7.0 s − first arrival 0 s; output tokens 3 + 4 + 1 + 1
    assert s["output_tokens_per_s"] == pytest.approx(9 / 7)
    assert s["total_tokens_per_s"] == pytest.approx((9 + 400) / 7)


def test_breakdown_p95_over_known_components(records: list[RequestRecord]) -> None:
    b = summarize(records)["ttft_breakdown_p95_ms"]
    assert b["prefill_queue"] == pytest.approx(30 + 0.85 * 10)  # 10, 20, 30, 40 at rank 2.85
    assert b["kv_transfer"] == pytest.approx(5.0)
    assert b["prefill_exec"] is None and b["decode_queue"] is None


def test_violation_rate_from_engine_steps_is_strictly_above_tau(records: list[RequestRecord]) -> None:
    s = summarize(records, decode_step_ms=[10.0, 80.0, 70.0, 71.0])
    assert s["tbt_violation_rate"] == pytest.approx(0.5)  # 80 and 71; 70 is not > 70
    assert s["tbt_ms"]["p95"] == pytest.approx(92.0)  # gaps still from token times
    assert s["tbt_gap_violation_rate"] == pytest.approx(1 / 5)  # the client's view: the single 100 ms gap
    assert summarize(records, decode_step_ms=[])["tbt_violation_rate"] is None


def test_slo_thresholds_and_explicit_duration(records: list[RequestRecord]) -> None:
    loose = summarize(records, tbt_slo_ms=100.0, ttft_slo_ms=5000.0, duration_s=9.0)
    assert loose["slo_attainment"] == pytest.approx(4 / 5)  # all but the failed one; bounds inclusive
    assert loose["tbt_violation_rate"] == 0.0
    assert loose["output_tokens_per_s"] == pytest.approx(1.0)


def test_request_tbt_uses_p95_not_max() -> None:
    times = [0.1]
    for gap_ms in [50.0] * 19 + [200.0]:
        times.append(times[-1] + gap_ms / 1000)
    # own gaps: 19 × 50 ms and one 200 ms; P95 at rank 18.05 = 50 + 0.05 × 150 = 57.5 ≤ 70
    s = summarize([rec(0, 0.0, 100.0, times)])
    assert s["slo_attainment"] == 1.0
    assert s["tbt_violation_rate"] == pytest.approx(1 / 20)


def test_empty_input_gives_zeros_and_none() -> None:
    s = summarize([])
    assert s == {
        "requests": 0, "completed": 0, "failed": 0,
        "ttft_ms": {"p50": None, "p95": None, "p99": None},
        "ttft_breakdown_p95_ms": {"prefill_queue": None, "prefill_exec": None, "kv_transfer": None,
                                  "decode_queue": None},
        "tbt_ms": {"p50": None, "p95": None}, "tbt_violation_rate": None, "tbt_gap_violation_rate": None,
        "slo_attainment": None, "deflections": 0, "output_tokens_per_s": 0.0, "total_tokens_per_s": 0.0,
    }
    only_failed = summarize([RequestRecord(id="x", arrival_s=0.0, prompt_tokens=1, output_tokens=0, error="e")])
    assert (only_failed["failed"], only_failed["slo_attainment"], only_failed["output_tokens_per_s"]) == (1, 0.0, 0.0)


def test_record_round_trips_through_json(records: list[RequestRecord]) -> None:
    data = msgspec.json.encode(records)
    assert msgspec.json.decode(data, type=list[RequestRecord]) == records


def test_format_table_renders_rows_and_missing_values(records: list[RequestRecord]) -> None:
    row = summarize(records) | {"policy": "kairos", "rps": 4.0}
    text = format_table([row, summarize([])])
    lines = text.splitlines()
    header = next(line for line in lines if "policy" in line)
    for column in ("rps", "requests", "TTFT p50 ms", "TTFT p95 ms", "TTFT p99 ms", "TBT p50 ms",
                   "TBT p95 ms", "TBT viol %", "SLO %", "deflections"):
        assert column in header
    kairos = next(line for line in lines if "kairos" in line).split()
    assert kairos == ["kairos", "4", "5", "250", "4295", "4859", "60.0", "92.0", "20.00", "40.0", "2"]
    empty = next(line for line in lines if line.split()[:1] == ["-"]).split()
    assert empty == ["-", "-", "0", "-", "-", "-", "-", "-", "-", "-", "0"]
    assert "\x1b[" not in text  # plain text, no ANSI codes
