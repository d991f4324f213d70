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


# -- the per-node gauges (issue 19 §3: their labelled children are kept across views) ----------------

def exposed(agg: StateAggregator) -> dict[str, dict[tuple[str, ...], float]]:
    """The aggregator's node gauges as /metrics exposes them: family → labels → value."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for fam in agg.tel.registry.collect():
        if fam.name in ("kairos_aggregator_node_state_age_seconds", "kairos_aggregator_node_stale",
                        "kairos_aggregator_nodes", "kairos_aggregator_node_step_correction"):
            out[fam.name] = {tuple(s.labels.values()): s.value for s in fam.samples}
    return out


def oracle(v: ClusterView) -> dict[str, dict[tuple[str, ...], float]]:
    """What the gauges must say after ``v`` (docs/observability.md): every node of the view and no other."""
    counts = {(r, s): 0.0 for r in ("prefill", "decode") for s in ("true", "false")}
    for n in v.nodes:
        counts[(n.role, "true" if n.stale else "false")] += 1
    return {"kairos_aggregator_node_state_age_seconds": {(n.node, n.role): n.age_ms / 1000.0 for n in v.nodes},
            "kairos_aggregator_node_stale": {(n.node, n.role): float(n.stale) for n in v.nodes},
            "kairos_aggregator_nodes": counts}


def nv(node: str, role: str, age_ms: float, stale: bool = False) -> NodeView:
    return NodeView(node=node, role=role, stale=stale, age_ms=age_ms)


VIEWS = [
    [nv("prefill-0", "prefill", 10.0), nv("decode-0", "decode", 20.0), nv("decode-1", "decode", 30.0)],
    [nv("prefill-0", "prefill", 10.0), nv("decode-0", "decode", 420.0, stale=True), nv("decode-1", "decode", 5.0)],
    # decode-1 left the view, decode-0 is fresh again with the age it had before, decode-2 joined
    [nv("prefill-0", "prefill", 110.0), nv("decode-0", "decode", 20.0), nv("decode-2", "decode", 0.0)],
    # prefill-0 restarted as a decode node (its prefill series go), decode-0 stale again
    [nv("prefill-0", "decode", 1.0), nv("decode-0", "decode", 20.0, stale=True), nv("decode-2", "decode", 0.0)],
    [],  # every node forgotten
    [nv("decode-1", "decode", 30.0)],  # back, with the age it had two views before it left
]


def test_the_node_gauges_say_what_the_last_view_says():
    agg = StateAggregator(AggregatorConfig(metrics_port=-1))
    agg.log = Log()
    for seq, nodes in enumerate(VIEWS, start=1):
        v = ClusterView(seq=seq, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0, nodes=nodes)
        agg._report(v)
        got = exposed(agg)
        got.pop("kairos_aggregator_node_step_correction", None)
        assert got == oracle(v), seq


def test_labels_are_looked_up_once_per_node_not_per_view():
    agg = StateAggregator(AggregatorConfig(metrics_port=-1))
    agg.log = Log()
    calls: list[tuple[str, ...]] = []
    for g in (agg.m_age, agg.m_stale):
        real = g.labels
        g.labels = lambda *lab, _real=real: calls.append(lab) or _real(*lab)  # type: ignore[method-assign]
    nodes = [nv(f"decode-{i}", "decode", float(i)) for i in range(50)]
    for seq in range(1, 11):  # ten views of the same 50 nodes, every age changing
        nodes = [nv(n.node, n.role, n.age_ms + 100.0, stale=seq % 3 == 0) for n in nodes]
        v = ClusterView(seq=seq, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0, nodes=nodes)
        agg._report(v)
    assert len(calls) == 2 * 50  # one child per gauge and node, kept
    got = exposed(agg)
    got.pop("kairos_aggregator_node_step_correction", None)
    assert got == oracle(v)


def test_the_correction_gauges_keep_each_nodes_last_factors():
    from kairos.core.model.correction import StepCorrection

    agg = StateAggregator(AggregatorConfig(metrics_port=-1))
    agg._report_corrections({"decode-0": StepCorrection(bias=1.1, safety=1.3), "prefill-0": StepCorrection(bias=0.9)})
    agg._report_corrections({"decode-0": StepCorrection(bias=1.2, safety=1.3)})  # prefill-0's window emptied
    assert exposed(agg)["kairos_aggregator_node_step_correction"] == {
        ("decode-0", "bias"): 1.2, ("decode-0", "safety"): 1.3, ("prefill-0", "bias"): 0.9, ("prefill-0", "safety"): 1.0}
