"""kairos.stepscale reads the aggregator's correction gauge as prometheus_client exposes it."""

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kairos.stepscale import GAUGE, parse_bias


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
