"""kairos.stepscale reads the aggregator's correction gauge as prometheus_client exposes it."""

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kairos.stepscale import GAUGE, HISTOGRAM, parse_bias, parse_decode_steps, violation_rate


def test_parse_bias_reads_each_nodes_bias_from_a_real_exposition():
    reg = CollectorRegistry()
    g = Gauge(GAUGE, "Learned step-time correction per node", ("node", "factor"), registry=reg)
    g.labels("prefill-0", "bias").set(1.8)
    g.labels("prefill-0", "safety").set(2.6)
    g.labels("decode-0", "bias").set(1.1)
    g.labels("prefill-1", "bias").set(1.0)  # the identity: too few steps for an estimate
    other = Gauge("kairos_aggregator_nodes", "Nodes", ("role",), registry=reg)
    other.labels("decode").set(1)
    assert parse_bias(generate_latest(reg).decode()) == {"prefill-0": 1.8, "decode-0": 1.1}


def test_parse_bias_without_the_gauge_is_empty():
    assert parse_bias("# HELP x y\n# TYPE x gauge\nx 1.0\n") == {}


def _histogram(observations: dict[str, list[float]], tbt_slo_ms: float | None = None) -> str:
    """The aggregator's decode-step histogram (its own buckets) with these observations, exposed."""
    from prometheus_client import Histogram

    from services.state_aggregator.service import decode_step_buckets

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
