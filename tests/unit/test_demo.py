"""`kairos demo`'s live-vs-simulated table: SLO attainment and TBT violations are shown, and a ratio
outside the stated tolerance is flagged (issue 11)."""

from kairos.cli.demo import FIDELITY_TOLERANCE, side_by_side


def _summary(ttft_p50, slo, viol, defl=10):
    return {"ttft_ms": {"p50": ttft_p50, "p95": 2 * ttft_p50}, "tbt_ms": {"p50": 48.0},
            "ttft_breakdown_p95_ms": {}, "tbt_violation_rate": viol, "slo_attainment": slo, "deflections": defl}


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(name))


def test_slo_and_tbt_rows_with_flags_outside_the_tolerance():
    live = _summary(1100.0, 0.408, 0.063)
    sim = _summary(1000.0, 0.707, 0.0002)
    text = side_by_side(live, sim)
    flag = f"outside ±{FIDELITY_TOLERANCE * 100:g} %"
    slo = _row(text, "SLO attainment %")
    assert "40.8" in slo and "70.7" in slo and "0.58" in slo and flag in slo
    viol = _row(text, "TBT violations %")
    assert "6.30" in viol and "0.02" in viol and "more than 1 point apart" in viol  # 6.28 points apart
    near = side_by_side(_summary(1000.0, 0.7, 0.0), _summary(1000.0, 0.7, 0.0006))
    assert "<--" not in _row(near, "TBT violations %")  # 0.00 % vs 0.06 %: within a point, no miss
    ttft = _row(text, "TTFT p50 ms")  # 1.10: inside ±15 %
    assert "1.10" in ttft and flag not in ttft
    assert flag not in _row(text, "deflections")


def test_missing_values_are_dashes_not_flags():
    text = side_by_side(_summary(1000.0, None, None), _summary(1000.0, 0.5, 0.0))
    assert "outside" not in _row(text, "SLO attainment %") and "outside" not in _row(text, "TBT violations %")


def test_tbt_rows_compare_engine_steps_when_the_live_run_counted_them():
    live = {**_summary(1000.0, 0.9, 0.20), "engine_tbt_violation_rate": 0.004, "tbt_gap_violation_rate": 0.20}
    sim = {**_summary(1000.0, 0.9, 0.005), "tbt_gap_violation_rate": 0.01}
    text = side_by_side(live, sim)
    steps = _row(text, "TBT violations % of decode steps")
    assert "0.40" in steps and "0.50" in steps and "0.80" in steps  # engine steps vs simulated steps
    gaps = _row(text, "inter-token gaps")
    assert "20.00" in gaps and "1.00" in gaps
    old = side_by_side(_summary(1000.0, 0.9, 0.20), sim)  # a report recorded before the engines' count
    assert "20.00" in _row(old, "TBT violations % (live: gaps)") and "inter-token gaps" not in old


def test_the_handoff_note_compares_the_live_kv_time_with_the_simulators_link_and_decode_queue():
    from kairos.cli.demo import handoff_note

    live = {"ttft_breakdown_p95_ms": {"kv_transfer": 293.0, "decode_queue": 0.0}}
    sim = {"ttft_breakdown_p95_ms": {"kv_transfer": 22.0, "decode_queue": 130.0}}
    note = handoff_note(live, sim)
    assert "live 293 ms" in note and "simulator 152 ms (link 22 + decode queue 130)" in note
    assert handoff_note(live, {"ttft_breakdown_p95_ms": {"kv_transfer": None}}) is None
    assert handoff_note({}, sim) is None
