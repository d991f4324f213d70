"""One trace per request across every hop (W3C context in NATS headers), the decision on the
dispatcher span, one span event per deflected chunk, and per-service Prometheus metrics."""

from __future__ import annotations

import json
from collections import defaultdict

import aiohttp
import pytest

from services.node_agent.agent import NodeAgent
from services.node_agent.config import AgentConfig
from tests.integration.conftest import fast_model, get_record, components_known, stack

pytestmark = pytest.mark.integration


def _spans(path) -> dict[str, list[dict]]:
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        s = json.loads(line)
        by_trace[s["context"]["trace_id"]].append(s)
    return by_trace


async def test_one_trace_per_request_with_decision_and_chunk_events(nats_url, tmp_path):
    trace = tmp_path / "spans.jsonl"
    async with stack(nats_url, policy="sl:100000", trace_file=str(trace)) as st:
        status, deflected = await st.complete([7] * 700, max_tokens=3)
        assert status == 200
        await get_record(st, deflected["id"], components_known)
    async with stack(nats_url, policy="pd", trace_file=str(trace)) as st:
        status, kept = await st.complete([7] * 700, max_tokens=3)
        assert status == 200
        await get_record(st, kept["id"], components_known)
    # leaving the stacks shut the tracer providers down, which flushed the file
    traces = _spans(trace)
    by_rid = {}
    for spans in traces.values():
        for s in spans:
            rid = s["attributes"].get("kairos.request_id")
            if rid:
                by_rid.setdefault(rid, set()).add(s["context"]["trace_id"])
    assert len(by_rid[deflected["id"]]) == 1 and len(by_rid[kept["id"]]) == 1  # one trace per request

    d_spans = {s["name"]: s for s in traces[next(iter(by_rid[deflected["id"]]))]}
    assert {"ingress.request", "dispatcher.decide", "node.deflected_prefill", "node.decode"} <= set(d_spans)
    dec = d_spans["dispatcher.decide"]["attributes"]
    assert dec["kairos.decision"] == "deflect" and dec["kairos.policy"] == "sl:100000"
    for k in ("kairos.reason", "kairos.node", "kairos.chunk_schedule", "kairos.state_age_ms", "kairos.model_version",
              "kairos.replica_id"):
        assert k in dec, k
    events = d_spans["node.deflected_prefill"]["events"]
    assert len(events) >= 5 and all(e["name"] == "chunk" for e in events)
    assert all({"chi", "predicted_ms", "actual_ms"} <= set(e["attributes"]) for e in events)
    # parent links: dispatcher under ingress, agent span under dispatcher
    assert d_spans["dispatcher.decide"]["parent_id"] == d_spans["ingress.request"]["context"]["span_id"]
    assert d_spans["node.deflected_prefill"]["parent_id"] == d_spans["dispatcher.decide"]["context"]["span_id"]

    k_spans = {s["name"]: s for s in traces[next(iter(by_rid[kept["id"]]))]}
    assert {"ingress.request", "dispatcher.decide", "node.prefill", "node.kv_handoff", "node.kv_transfer",
            "node.decode"} <= set(k_spans), set(k_spans)
    assert k_spans["dispatcher.decide"]["attributes"]["kairos.decision"] == "keep"
    assert "kairos.ttft_prefill_est_ms" in k_spans["dispatcher.decide"]["attributes"]


async def test_metrics_endpoint_of_a_non_http_service(nats_url):
    agent = NodeAgent(AgentConfig(node_id="decode-9", role="decode", nats_url=nats_url, metrics_port=0),
                      model=fast_model())
    await agent.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{agent.metrics_port}/metrics") as r:
                assert r.status == 200
                assert "kairos_agent_batch_size" in await r.text()
            async with http.get(f"http://127.0.0.1:{agent.metrics_port}/health") as r:
                assert r.status == 200
    finally:
        await agent.close()
