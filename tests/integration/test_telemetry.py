"""Observability against a real nats-server (issue #5): one trace per request across ingress,
dispatcher and agents with the right parent links (W3C context in NATS headers), decision attributes
equal to the decision record, one chunk event per scheduled chunk, the span file and its
``kairos trace`` tree, per-service /metrics that parse and move, logs with request and trace ids."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections import defaultdict

import aiohttp
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.runtime import telemetry
from kairos.runtime.bus import flush_barrier
from kairos.cli.trace import trace_report
from tests.integration.conftest import components_known, fast_model, get_record, stack, wait_until

pytestmark = pytest.mark.integration

KEEP_SPANS = ["ingress.request", "ingress.attempt", "dispatcher.decide", "node.prefill", "node.kv_handoff",
              "node.kv_transfer", "node.decode"]
DEFLECT_SPANS = ["ingress.request", "ingress.attempt", "dispatcher.decide", "node.deflected_prefill", "node.decode"]


def _hex_trace(span) -> str:
    return format(span.context.trace_id, "032x")


async def _trace_of(exporter: InMemorySpanExporter, rid: str, names: list[str]) -> dict:
    """The finished spans of request ``rid`` by name, once every span in ``names`` has ended."""

    def ready():
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("kairos.request_id") == rid]
        got = {s.name for s in spans}
        return spans if set(names) <= got else None

    spans = await wait_until(ready, 10, f"spans {names} of {rid}")
    by_name: dict = {}
    for s in spans:
        assert s.name not in by_name, f"two {s.name} spans for {rid}"
        by_name[s.name] = s
    return by_name


def _assert_chain(by_name: dict, names: list[str]) -> None:
    """One trace id for all; each span's parent is the previous one; the first is the root."""
    assert len({_hex_trace(s) for s in by_name.values()}) == 1, "one trace per request"
    first = by_name[names[0]]
    assert first.parent is None
    for parent, child in zip(names, names[1:]):
        assert by_name[child].parent.span_id == by_name[parent].context.span_id, f"{child} under {parent}"


def _assert_decision_equals_record(attrs: dict, rec: dict) -> None:
    """Every decision attribute on the dispatcher span equals GET /v1/requests/{id}."""
    est = rec["estimates"]
    routing = rec["routing"]
    assert attrs["kairos.policy"] == rec["policy"]
    assert attrs["kairos.decision"] == rec["decision"]
    assert attrs["kairos.reason"] == rec["reason"]
    assert attrs["kairos.node"] == rec["node"]
    assert attrs["kairos.decode_node"] == rec["decode_node"]
    assert list(attrs["kairos.chunk_schedule"]) == rec["chunk_schedule"]
    assert list(attrs["kairos.predicted_step_ms"]) == est["predicted_step_ms"]
    assert attrs.get("kairos.ttft_prefill_est_ms") == est["ttft_prefill_est_ms"]
    assert attrs.get("kairos.kv_transfer_est_ms") == est["kv_transfer_est_ms"]
    span_est = {k[len("kairos.ttft_decode_est_ms."):]: v for k, v in attrs.items()
                if k.startswith("kairos.ttft_decode_est_ms.")}
    assert span_est == {n: v for n, v in est["ttft_decode_est_ms"].items() if v is not None}
    span_why = {k[len("kairos.decode_infeasible."):]: v for k, v in attrs.items()
                if k.startswith("kairos.decode_infeasible.")}
    assert span_why == est["decode_infeasible"]
    assert attrs["kairos.state_age_ms"] == routing["state_age_ms"]
    assert attrs["kairos.model_version"] == routing["model_version"]
    assert attrs["kairos.replica_id"] == routing["dispatcher"]
    assert attrs["kairos.attempts"] == routing["attempts"]


async def test_keep_path_trace_parent_links_and_decision_attributes(nats_url):
    exporter = InMemorySpanExporter()
    async with stack(nats_url, policy="pd", span_exporter=exporter) as st:
        async with st.http.post(f"{st.base}/v1/completions", json={"model": "kairos-emulated", "prompt": [7] * 700,
                                                                   "max_tokens": 3}) as r:
            assert r.status == 200
            body = await r.json()
            trace_header = r.headers["X-Trace-Id"]
        rid = body["id"]
        rec = await get_record(st, rid, components_known)
        by_name = await _trace_of(exporter, rid, KEEP_SPANS)
    _assert_chain(by_name, KEEP_SPANS)
    assert _hex_trace(by_name["ingress.request"]) == trace_header
    services = {n: s.resource.attributes["service.name"] for n, s in by_name.items()}
    assert services["ingress.request"] == "kairos-ingress" and services["dispatcher.decide"] == "kairos-dispatcher"
    assert services["node.prefill"] == services["node.decode"] == "kairos-node_agent"
    assert by_name["node.prefill"].resource.attributes["service.instance.id"] == rec["node"]
    assert by_name["node.decode"].resource.attributes["service.instance.id"] == rec["records"]["decode"]["node"]
    ing = by_name["ingress.request"]
    assert ing.kind == SpanKind.SERVER and by_name["dispatcher.decide"].kind == SpanKind.CONSUMER
    a = ing.attributes
    assert a["gen_ai.response.id"] == rid and a["gen_ai.request.model"] == "kairos-emulated"
    assert a["gen_ai.usage.input_tokens"] == 700 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.operation.name"] == "text_completion" and a["http.response.status_code"] == 200
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(rec["measured"]["ttft_ms"] / 1000, abs=2e-3)
    dec = by_name["dispatcher.decide"].attributes
    assert dec["kairos.decision"] == "keep"
    _assert_decision_equals_record(dec, rec)
    assert by_name["node.kv_handoff"].attributes["kairos.decode_node"] == rec["decode_node"]


async def test_deflected_trace_has_one_chunk_event_per_scheduled_chunk(nats_url):
    exporter = InMemorySpanExporter()
    async with stack(nats_url, policy="sl:100000", span_exporter=exporter) as st:
        status, body = await st.complete([7] * 700, max_tokens=3)
        assert status == 200
        rid = body["id"]
        rec = await get_record(st, rid, components_known)
        by_name = await _trace_of(exporter, rid, DEFLECT_SPANS)
    _assert_chain(by_name, DEFLECT_SPANS)
    dec = by_name["dispatcher.decide"].attributes
    assert dec["kairos.decision"] == "deflect" and dec["kairos.policy"] == "sl:100000"
    _assert_decision_equals_record(dec, rec)
    schedule = rec["chunk_schedule"]
    assert len(schedule) >= 5  # 700 tokens at χ = 128
    events = [e for e in by_name["node.deflected_prefill"].events if e.name == "chunk"]
    assert len(events) == len(schedule) == len(rec["measured"]["chunk_actual_ms"])
    assert [e.attributes["chi"] for e in events] == schedule
    assert [e.attributes["predicted_ms"] for e in events] == rec["estimates"]["predicted_step_ms"]
    assert [e.attributes["actual_ms"] for e in events] == rec["measured"]["chunk_actual_ms"]
    assert by_name["node.deflected_prefill"].attributes["kairos.chunks_run"] == len(schedule)


async def test_kairos_decision_carries_every_decode_nodes_estimate(nats_url):
    exporter = InMemorySpanExporter()
    async with stack(nats_url, policy="kairos", span_exporter=exporter) as st:
        status, body = await st.complete([7] * 3000, max_tokens=2)
        assert status == 200
        rid = body["id"]
        rec = await get_record(st, rid, components_known)
        spans = await _trace_of(exporter, rid, ["ingress.request", "dispatcher.decide", "node.decode"])
    dec = spans["dispatcher.decide"].attributes
    _assert_decision_equals_record(dec, rec)
    for node in ("decode-0", "decode-1"):  # every decode node: an estimate or why it was infeasible
        assert f"kairos.ttft_decode_est_ms.{node}" in dec or f"kairos.decode_infeasible.{node}" in dec
    assert "kairos.ttft_prefill_est_ms" in dec and dec["kairos.state_age_ms"] >= 0


async def test_trace_context_travels_in_nats_headers(nats_url):
    """The job message carries a W3C traceparent naming the dispatcher span (propagator API)."""
    exporter = InMemorySpanExporter()
    async with stack(nats_url, policy="pd", span_exporter=exporter) as st:
        seen: list = []

        async def spy(msg):
            seen.append(msg)
        sub = await st.ingress.nc.subscribe("kairos.jobs.>", cb=spy)  # an extra listener: gets a copy
        kv_sub = await st.ingress.nc.subscribe("kairos.kv.>", cb=spy)
        await flush_barrier(st.ingress.nc)
        status, body = await st.complete("hello", max_tokens=2)
        assert status == 200
        by_name = await _trace_of(exporter, body["id"], KEEP_SPANS)
        await sub.unsubscribe()
        await kv_sub.unsubscribe()
    job = next(m for m in seen if m.subject.startswith("kairos.jobs."))
    version, trace_id, span_id, flags = job.headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert trace_id == _hex_trace(by_name["dispatcher.decide"])
    assert span_id == format(by_name["dispatcher.decide"].context.span_id, "016x")
    kv = next(m for m in seen if m.subject.startswith("kairos.kv."))
    assert kv.headers["traceparent"].split("-")[2] == format(by_name["node.kv_handoff"].context.span_id, "016x")


async def test_span_file_and_kairos_trace_tree(nats_url, tmp_path):
    trace = tmp_path / "spans.jsonl"
    async with stack(nats_url, policy="sl:100000", trace_file=str(trace)) as st:
        status, deflected = await st.complete([7] * 700, max_tokens=3)
        assert status == 200
        await get_record(st, deflected["id"], components_known)
    async with stack(nats_url, policy="pd", trace_file=str(trace)) as st:
        status, kept = await st.complete([7] * 700, max_tokens=3)
        assert status == 200
        rec = await get_record(st, kept["id"], components_known)
    # leaving the stacks shut the tracer providers down, which flushed the file
    by_rid: dict[str, set] = defaultdict(set)
    for line in trace.read_text().splitlines():
        s = json.loads(line)
        assert s["end_time_unix_nano"] >= s["start_time_unix_nano"] > 0
        if "kairos.request_id" in s["attributes"]:
            by_rid[s["attributes"]["kairos.request_id"]].add(s["context"]["trace_id"])
    assert len(by_rid[deflected["id"]]) == 1 and len(by_rid[kept["id"]]) == 1

    def lines():
        return trace.read_text().splitlines()

    tree = trace_report(lines, kept["id"])
    for name in KEEP_SPANS:
        assert name in tree, tree
    assert f"KEEP → {rec['node']} · reason {rec['reason']} · policy pd" in tree
    assert "└─ dispatcher.decide" in tree and "└─ node.decode" in tree
    tree = trace_report(lines, deflected["id"])
    assert "DEFLECT → decode-" in tree and tree.count("chunk ") >= 5, tree
    trace_id = next(iter(by_rid[deflected["id"]]))
    assert trace_report(lines, trace_id) == tree  # the trace id finds the same tree


async def _scrape(http: aiohttp.ClientSession, url: str) -> dict:
    """name → list of (labels, value) of every kairos_ sample (the body must parse)."""
    async with http.get(url) as r:
        assert r.status == 200
        text = await r.text()
    out: dict = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("kairos_"):
                out[smp.name].append((smp.labels, smp.value))
    return out


async def poll(fn, timeout: float, what: str):
    """Await ``fn()`` until it returns something truthy (deadline, no fixed sleeps as sync)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = await fn()
        if v:
            return v
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


async def test_metrics_of_every_service_parse_and_move(nats_url):
    async with stack(nats_url, policy="kairos", metrics=True) as st:
        urls = {"ingress": f"{st.base}/metrics", "aggregator": f"http://127.0.0.1:{st.aggregator.metrics_port}/metrics"}
        urls |= {d.cfg.replica_id: f"http://127.0.0.1:{d.metrics_port}/metrics" for d in st.dispatchers}
        urls |= {n: f"http://127.0.0.1:{a.metrics_port}/metrics" for n, a in st.agents.items()}
        scraped = {name: await _scrape(st.http, url) for name, url in urls.items()}  # every body parses

        async def decisions(**labels) -> float:
            total = 0.0
            for d in st.dispatchers:
                total += _total(await _scrape(st.http, urls[d.cfg.replica_id]), "kairos_dispatcher_decisions_total",
                                **labels)
            return total

        before = await decisions()
        # idle cluster, 3000 tokens: no KV transfer makes the decode path faster (Eq. 7 holds) → deflect
        status, events = await st.complete([7] * 3000, max_tokens=4, stream=True)
        assert status == 200
        rec = await get_record(st, json.loads(events[0])["id"], components_known)
        assert rec["decision"] == "deflect", rec
        assert await decisions() == before + 1
        assert await decisions(policy="kairos", decision="deflect", reason=rec["reason"]) == 1

        async def prediction_observed():  # the ingress compares with the decision record in the background
            s = await _scrape(st.http, urls["ingress"])
            return s if _total(s, "kairos_ingress_ttft_prediction_error_seconds_count", decision="deflect") else None
        ing = await poll(prediction_observed, 5, "the ingress's TTFT prediction error")
        assert _total(ing, "kairos_ingress_ttft_seconds_count") == 1
        assert _total(ing, "kairos_ingress_ttft_predicted_seconds_sum", decision="deflect") == pytest.approx(
            rec["estimates"]["ttft_decode_est_ms"][rec["node"]] / 1000)
        assert _total(ing, "kairos_ingress_ttft_measured_seconds_sum", decision="deflect") == pytest.approx(
            rec["measured"]["ttft_ms"] / 1000, abs=2e-3)
        assert _total(ing, "kairos_ingress_tbt_seconds_count") == 3  # 4 tokens, 3 gaps
        assert _total(ing, "kairos_ingress_requests_total", endpoint="completions", status="200") == 1
        assert "kairos_ingress_requests_in_flight" in ing
        agg = await _scrape(st.http, urls["aggregator"])
        ages = {lab["node"]: v for lab, v in agg["kairos_aggregator_node_state_age_seconds"]}
        assert set(ages) == set(st.agents) and all(0 <= v < 1 for v in ages.values())
        node, chunks = rec["node"], len(rec["chunk_schedule"])
        ag = await _scrape(st.http, urls[node])
        assert _total(ag, "kairos_agent_deflected_chunks_total", node=node) == chunks
        assert _total(ag, "kairos_agent_chunk_step_error_ratio_count", node=node, predictor="decision") == chunks
        assert _total(ag, "kairos_agent_chunk_step_measured_seconds_sum", node=node) == pytest.approx(
            sum(rec["measured"]["chunk_actual_ms"]) / 1000)
        assert _total(ag, "kairos_agent_chunk_step_predicted_seconds_sum", node=node) == pytest.approx(
            sum(rec["estimates"]["predicted_step_ms"]) / 1000)
    for name in ("kairos_dispatcher_redeliveries_total", "kairos_dispatcher_requests_in_flight",
                 "kairos_dispatcher_reservation_conflicts_total", "kairos_dispatcher_decision_seconds_count",
                 "kairos_dispatcher_decision_state_age_seconds_count"):
        assert name in scraped["dispatcher-0"], name
    assert "kairos_agent_batch_size" in scraped["decode-0"] and "kairos_aggregator_nodes" in scraped["aggregator"]


async def test_logs_carry_request_and_trace_id(nats_url):
    buf = io.StringIO()
    telemetry.configure_logging("debug", "json", stream=buf)  # request_routed is a debug line
    exporter = InMemorySpanExporter()
    try:
        async with stack(nats_url, policy="pd", span_exporter=exporter) as st:
            status, body = await st.complete("hello", max_tokens=2)
            assert status == 200
            rid = body["id"]
            by_name = await _trace_of(exporter, rid, KEEP_SPANS)
    finally:
        telemetry.configure_logging("info", "json", stream=sys.stderr)
    lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]  # every line is JSON
    mine = [x for x in lines if x.get("request_id") == rid]
    events = {x["event"] for x in mine}
    assert {"request_finished", "request_routed"} <= events, events
    assert all(x["trace_id"] == _hex_trace(by_name["ingress.request"]) for x in mine), mine
    assert all({"service", "level", "timestamp"} <= set(x) for x in lines)


@pytest.mark.parametrize("policy", ["pd", "kairos"])  # a kept request and a deflected one
async def test_one_info_line_per_request(nats_url, policy):
    """At the default level a request that goes well logs one line, the ingress's access line; the
    dispatcher's decision and the agent's acceptance are debug lines (issue 34: log lines were a
    third of the services' per-request work)."""
    buf = io.StringIO()
    telemetry.configure_logging("info", "json", stream=buf)
    try:
        async with stack(nats_url, policy=policy) as st:
            status, body = await st.complete("hello " * 40, max_tokens=3)
            assert status == 200
            rid = body["id"]
            await wait_until(lambda: any(rid in x and '"request_finished"' in x for x in buf.getvalue().splitlines()),
                             5, "the access line")
    finally:
        telemetry.configure_logging("info", "json", stream=sys.stderr)
    mine = [orjson.loads(x) for x in buf.getvalue().splitlines() if rid in x]
    assert [x["event"] for x in mine] == ["request_finished"], mine


async def test_metrics_endpoint_of_a_non_http_service(nats_url):
    agent = NodeAgent(AgentConfig(node_id="decode-9", role="decode", nats_url=nats_url, metrics_port=0),
                      model=fast_model())
    await agent.start()
    try:
        async with aiohttp.ClientSession() as http:
            samples = await _scrape(http, f"http://127.0.0.1:{agent.metrics_port}/metrics")
            assert "kairos_agent_batch_size" in samples
            async with http.get(f"http://127.0.0.1:{agent.metrics_port}/health") as r:
                assert r.status == 200
    finally:
        await agent.close()
