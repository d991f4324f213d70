"""ops/grafana/kairos-vllm-dashboard.json against the ingress's registry, and its provisioning.

Every PromQL expression of the dashboard (panel targets and template variable queries) is
tokenised: each metric name it selects must be a sample the ingress registers (``kairos:*``, the
vLLM-named families of kairos/services/ingress/metrics.py), each label it matches or groups by
must be one of that series, and brackets must balance. The provisioning file must point Grafana
at the folder the dashboards are mounted in, naming each dashboard file of ops/grafana.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kairos.runtime.telemetry import metric_names
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "ops" / "grafana"
DASHBOARD = GRAFANA / "kairos-vllm-dashboard.json"
PROVISIONING = GRAFANA / "provisioning" / "dashboards" / "kairos.yaml"
#: PromQL functions, aggregations and keywords the dashboards use (anything else is a metric name)
PROMQL_WORDS = {"histogram_quantile", "sum", "rate", "increase", "by", "without", "max", "min", "avg", "count",
                "label_values", "clamp_min", "irate", "on", "ignoring", "and", "or", "unless", "topk"}
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\$\{?\w+\}?|\[[^\]]*\]|[A-Za-z_:][A-Za-z0-9_:]*|[0-9.]+|\S')


def series_of(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The metric names ``expr`` selects, each with the label names of its ``{...}`` matchers, and the
    label names it groups by. Raises AssertionError on unbalanced brackets or a stray name."""
    selected: list[tuple[str, set[str]]] = []
    grouped: set[str] = set()
    toks = TOKEN.findall(expr)
    depth, i = 0, 0
    while i < len(toks):
        t = toks[i]
        if t in "()":
            depth += 1 if t == "(" else -1
            assert depth >= 0, expr
        elif t in ("by", "without"):
            assert toks[i + 1] == "(", expr
            j = toks.index(")", i)
            grouped |= {x for x in toks[i + 2:j] if x != ","}
            i = j
        elif t == "label_values":  # Grafana's label_values(metric, label): the metric must carry the label
            assert toks[i + 1] == "(" and toks[i + 3] == "," and toks[i + 5] == ")", expr
            selected.append((toks[i + 2], {toks[i + 4]}))
            i += 5
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", t) and t not in PROMQL_WORDS:
            labels: set[str] = set()
            if i + 1 < len(toks) and toks[i + 1] == "{":
                j = toks.index("}", i)
                inner = toks[i + 2:j]
                labels = {inner[k] for k in range(len(inner) - 1) if inner[k + 1] in ("=", "!", "~")
                          and re.fullmatch(r"[a-z_]+", inner[k])}
                assert labels, (expr, inner)
                i = j
            selected.append((t, labels))
        i += 1
    assert depth == 0, f"unbalanced parentheses: {expr}"
    return selected, grouped


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"] if isinstance(v["query"], dict) else v["query"]))
    return out


@pytest.fixture(scope="module")
def registered() -> dict[str, tuple[str, frozenset[str]]]:
    ing = Ingress(IngressConfig())  # constructed, never started: no I/O
    try:
        return metric_names(ing.tel.registry, prefix="kairos:")
    finally:
        ing.tel.shutdown()


def test_tokeniser_finds_names_labels_and_groupings():
    sel, grp = series_of('histogram_quantile(0.9, sum by (le, engine) (rate(kairos:x_bucket{model_name=~"$m"}[5m])))')
    assert sel == [("kairos:x_bucket", {"model_name"})] and grp == {"le", "engine"}
    assert series_of("label_values(kairos:y, model_name)") == ([("kairos:y", {"model_name"})], set())
    with pytest.raises(AssertionError):
        series_of("sum(rate(kairos:x_total[5m])")


def test_dashboard_is_valid_json_with_a_datasource_and_a_model_variable():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "kairos-vllm" and d["title"] and d["panels"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def test_every_dashboard_series_is_registered_by_the_ingress_with_its_labels(registered):
    used = set()
    for where, expr in exprs(json.loads(DASHBOARD.read_text())):
        selected, grouped = series_of(expr)
        assert selected, (where, expr)
        for name, labels in selected:
            assert name in registered, f"{where}: {name} is not a sample of the ingress's registry"
            assert labels <= registered[name][1], f"{where}: {name} has no label {labels - registered[name][1]}"
            used.add(name)
        have = set().union(*(registered[n][1] for n, _l in selected))
        assert grouped <= have, f"{where}: groups by {grouped - have}, which its series lack"
    # the panels the issue asks for: latency quantiles, throughput, scheduler state, cache, outcomes
    for name in ("kairos:time_to_first_token_seconds_bucket", "kairos:inter_token_latency_seconds_bucket",
                 "kairos:e2e_request_latency_seconds_bucket", "kairos:prompt_tokens_total",
                 "kairos:generation_tokens_total", "kairos:num_requests_running", "kairos:num_requests_waiting",
                 "kairos:prefix_cache_hits_total", "kairos:prefix_cache_queries_total",
                 "kairos:request_success_total"):
        assert name in used, name
    text = DASHBOARD.read_text()
    assert "histogram_quantile(0.99, sum by (le) (rate(kairos:time_to_first_token_seconds_bucket" in text
    assert "sum by (finished_reason) (rate(kairos:request_success_total" in text


def test_provisioning_points_grafana_at_every_dashboard():
    prov = yaml.safe_load(PROVISIONING.read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    comment = PROVISIONING.read_text()
    uids = set()
    for f in sorted(GRAFANA.glob("*.json")):
        d = json.loads(f.read_text())
        assert d["uid"] not in uids, f"{f.name}: uid {d['uid']} used twice"
        uids.add(d["uid"])
        # the mount each dashboard needs, under the provider's folder
        assert f"ops/grafana/{f.name}  " in comment or f"ops/grafana/{f.name} " in comment, f.name
        assert f"{path}/{f.name} (uid {d['uid']})" in comment, f.name
    assert {"kairos-overview", "kairos-vllm"} <= uids
