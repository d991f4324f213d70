"""The Grafana dashboard and docs/observability.md against the metrics the services really register.

Every ``kairos_*`` series a dashboard query uses must exist (with the labels the query uses), and
the metric table in the docs must list exactly the registered metrics, so neither can go stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator
from kairos.runtime.telemetry import metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "kairos-dashboard.json"
DOC = ROOT / "docs" / "observability.md"
NAME = re.compile(r"\bkairos_[a-z0-9_]+")


@pytest.fixture(scope="module")
def registered() -> dict[str, tuple[str, frozenset[str]]]:
    """Sample name → (type, label names) over every service (constructed, never started: no I/O)."""
    services = [Ingress(IngressConfig()), Dispatcher(DispatcherConfig()), StateAggregator(AggregatorConfig()),
                NodeAgent(AgentConfig(node_id="decode-0", role="decode")),
                NodeAgent(AgentConfig(node_id="prefill-0", role="prefill"))]
    out: dict = {}
    for svc in services:
        out |= metric_names(svc.tel.registry)
        svc.tel.shutdown()
    return out


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def test_dashboard_is_valid_json_with_a_datasource_variable():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and d["panels"]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in d["templating"]["list"])
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_every_dashboard_series_exists_with_its_labels(registered):
    exprs = _exprs(json.loads(DASHBOARD.read_text()))
    assert len(exprs) >= 20
    used = set()
    for title, expr in exprs:
        names = NAME.findall(expr)
        assert names, (title, expr)
        for n in names:
            assert n in registered, f"panel {title!r}: {n} is not registered by any service"
            used.add(n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count"))
        # label matchers {a="b"} on a series must be labels of that series
        for n, matchers in re.findall(r"(kairos_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in registered[n][1], f"panel {title!r}: {n} has no label {label!r}"
        # grouping labels must exist on some series of the expression
        labels = set().union(*(registered[n][1] for n in names))
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels, f"panel {title!r}: groups by {label!r}, which its series lack"
    # the headline metrics of issue #5 are on the dashboard
    for base in ("kairos_ingress_ttft_seconds", "kairos_ingress_tbt_seconds", "kairos_dispatcher_decisions_total",
                 "kairos_agent_chunk_step_error_ratio", "kairos_aggregator_node_state_age_seconds",
                 "kairos_ingress_ttft_prediction_error_seconds"):
        assert base in used, base


def test_metric_names_follow_prometheus_conventions(registered):
    for name, (typ, _labels) in registered.items():
        if typ == "counter":
            assert name.endswith("_total"), name
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert not re.search(r"_ms(_|$)", base), f"{name}: durations are exported in seconds"
        if typ == "histogram":
            assert base.endswith(("_seconds", "_ratio")), f"{name}: histogram without a unit suffix"


def test_docs_metric_table_lists_exactly_the_registered_metrics(registered):
    families = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                for n, (typ, _l) in registered.items() if typ == "histogram"}
    families |= {n for n, (typ, _l) in registered.items() if typ != "histogram"}
    text = DOC.read_text()
    table = [line for line in text.splitlines() if line.startswith("| `kairos_")]
    documented = {re.match(r"\| `(kairos_[a-z0-9_]+)`", line).group(1) for line in table}
    assert documented == families, (f"undocumented: {sorted(families - documented)}; "
                                    f"documented but not registered: {sorted(documented - families)}")
    for line in table:  # the labels column names exactly the metric's labels
        name = re.match(r"\| `(kairos_[a-z0-9_]+)`", line).group(1)
        key = name + "_bucket" if name + "_bucket" in registered else name
        want = registered[key][1] - {"le"}
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        got = set(re.findall(r"`([a-z_]+)`", cells[2]))
        assert got == set(want), f"{name}: docs say labels {sorted(got)}, code has {sorted(want)}"
