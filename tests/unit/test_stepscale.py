"""kairos.cli.stepscale reads the aggregator's step counters and decode-step histogram as prometheus_client
exposes them (the aggregator's own metric names and buckets)."""

from prometheus_client import CollectorRegistry, Counter, generate_latest

from kairos.cli.stepscale import HISTOGRAM, STEP_TIME, STEPS, parse_decode_steps, parse_step_times, step_scales, violation_rate


def _histogram(observations: dict[str, list[float]], tbt_slo_ms: float | None = None) -> str:
    """The aggregator's decode-step histogram (its own buckets) with these observations, exposed."""
    from prometheus_client import Histogram

    from kairos.services.state_aggregator.service import decode_step_buckets

    reg = CollectorRegistry()
    h = Histogram(HISTOGRAM, "decode steps", ("node",), buckets=decode_step_buckets(tbt_slo_ms), registry=reg)
    for node, values in observations.items():
        for v in values:
            h.labels(node).observe(v / 1000.0)  # ms → s, as the aggregator does
    return generate_latest(reg).decode()


def test_decode_step_violations_between_two_snapshots():
    before = parse_decode_steps(_histogram({"decode-0": [40.0, 150.0]}), 100.0)
    assert before == {"decode-0": (2.0, 1.0)}
    # after: decode-0 gained 60, 100 (not > τ), 101 and 250 ms; prefill-0 (decoding under TaiChi) 90 ms
    after = parse_decode_steps(_histogram({"decode-0": [40.0, 150.0, 60.0, 100.0, 101.0, 250.0],
                                           "prefill-0": [90.0]}), 100.0)
    assert violation_rate(before, after) == 2 / 5
    assert violation_rate({}, after) == 3 / 7  # the histogram had no step when the run started
    assert violation_rate(before, before) is None and violation_rate(None, after) is None


def test_a_tau_that_is_not_a_bucket_boundary_gives_no_count():
    text = _histogram({"decode-0": [40.0, 150.0]})
    assert parse_decode_steps(text, 75.0) is None  # 75 ms is not a default boundary: no exact count
    assert parse_decode_steps(_histogram({"decode-0": [40.0, 80.0]}, tbt_slo_ms=75.0), 75.0) == {"decode-0": (2.0, 1.0)}
    assert parse_decode_steps("# HELP x y\n# TYPE x gauge\nx 1.0\n", 100.0) is None  # an aggregator without it


def _step_times(rows: dict[str, tuple[int, float, float]]) -> str:
    """The aggregator's step counters with ``{node: (steps, measured s, predicted s)}``, exposed."""
    reg = CollectorRegistry()
    steps = Counter(STEPS.removesuffix("_total"), "steps", ("node",), registry=reg)
    clock = Counter(STEP_TIME.removesuffix("_total"), "step time", ("node", "clock"), registry=reg)
    for node, (n, measured, predicted) in rows.items():
        steps.labels(node).inc(n)
        clock.labels(node, "measured").inc(measured)
        clock.labels(node, "predicted").inc(predicted)
    return generate_latest(reg).decode()


def test_step_scale_is_the_ratio_of_sums_between_snapshots():
    before = parse_step_times(_step_times({"decode-0": (100, 2.0, 2.0)}))
    assert before == {"decode-0": (100.0, 2.0, 2.0)}
    after = parse_step_times(_step_times({"decode-0": (300, 7.0, 6.0), "prefill-0": (12, 6.0, 4.0),
                                          "prefill-1": (9, 3.0, 1.0)}))
    scales = step_scales(before, after)
    assert scales["decode-0"] == 5.0 / 4.0  # 200 steps: 5 s measured, 4 s predicted
    assert scales["prefill-0"] == 1.5  # 12 long steps: enough for a ratio of sums
    assert "prefill-1" not in scales  # 9 steps < MIN_STEPS: no estimate (not the identity)
