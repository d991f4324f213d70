"""The aggregator's node log lines say what happened to a stale node: ``node_fresh`` when its
heartbeats came back, ``node_forgotten`` when it left the view (forget_after_ms) — a new user's trial
saw a killed node logged as fresh a minute after it died."""

from kairos.contracts.wire import ClusterView, NodeView
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator


class Log:
    def __init__(self):
        self.lines = []

    def info(self, event, **kw):
        self.lines.append((event, kw.get("node")))

    warning = info


def view(seq: int, *nodes: tuple[str, bool]) -> ClusterView:
    return ClusterView(seq=seq, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0, nodes=[NodeView(node=n, role="decode", stale=s, age_ms=0.0)
                                                          for n, s in nodes])


def test_a_stale_node_is_fresh_when_it_comes_back_and_forgotten_when_it_leaves_the_view():
    agg = StateAggregator(AggregatorConfig(metrics_port=-1))
    agg.log = log = Log()
    agg._report(view(1, ("decode-0", False), ("decode-1", False)))
    agg._report(view(2, ("decode-0", True), ("decode-1", True)))
    assert set(log.lines) == {("node_stale", "decode-0"), ("node_stale", "decode-1")}
    log.lines.clear()
    agg._report(view(3, ("decode-0", False)))  # decode-0 is back, decode-1 was forgotten
    assert set(log.lines) == {("node_fresh", "decode-0"), ("node_forgotten", "decode-1")}
