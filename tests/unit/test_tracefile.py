"""kairos.cli.trace (pure) and ``kairos trace`` (exit codes, env default, --json) on hand-built span files."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.cli.trace import TraceLookupError, find_spans, parse_span, render_trace, trace_report

T = "4bf92f3577b34da6a3ce929d0e0e4736"
T2 = "00000000000000000000000000000abc"
MS = 1_000_000


def span(name: str, sid: str, parent: str | None, start_ms: float, end_ms: float, trace: str = T,
         instance: str = "x", service: str = "kairos-svc", status: str = "UNSET", events=(), iso_only=False,
         **attrs) -> dict:
    t0 = 1_700_000_000_000 * MS
    d = {"name": name, "context": {"trace_id": "0x" + trace, "span_id": "0x" + sid, "trace_state": "[]"},
         "kind": "SpanKind.INTERNAL", "parent_id": "0x" + parent if parent else None,
         "start_time": "2023-11-14T22:13:20.000000Z", "end_time": None,
         "status": {"status_code": status, **({"description": "boom"} if status == "ERROR" else {})},
         "attributes": attrs, "events": list(events), "links": [],
         "resource": {"attributes": {"service.name": service, "service.instance.id": instance}, "schema_url": ""},
         "start_time_unix_nano": t0 + int(start_ms * MS), "end_time_unix_nano": t0 + int(end_ms * MS)}
    if iso_only:
        del d["start_time_unix_nano"], d["end_time_unix_nano"]
        d["start_time"] = f"2023-11-14T22:13:20.{int(start_ms * 1000):06d}Z"
        d["end_time"] = f"2023-11-14T22:13:20.{int(end_ms * 1000):06d}Z"
    return d


def chunk(chi: int, pred: float, act: float) -> dict:
    return {"name": "chunk", "timestamp": "2023-11-14T22:13:20.010000Z",
            "attributes": {"chi": chi, "predicted_ms": pred, "actual_ms": act, "batch_size": 3}}


RID = "cmpl-abc123"


def deflected_trace() -> list[dict]:
    return [
        span("ingress.request", "a" * 16, None, 0, 100, instance="ingress-0", **{
            "kairos.request_id": RID, "http.request.method": "POST", "http.route": "/v1/completions",
            "http.response.status_code": 200, "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 700,
            "gen_ai.usage.output_tokens": 3, "kairos.ttft_ms": 45.0}),
        span("dispatcher.decide", "b" * 16, "a" * 16, 2, 5, instance="dispatcher-1", **{
            "kairos.request_id": RID, "kairos.policy": "kairos", "kairos.decision": "deflect",
            "kairos.reason": "deflect_faster", "kairos.node": "decode-1", "kairos.decode_node": "decode-1",
            "kairos.chunk_schedule": [512, 188], "kairos.predicted_step_ms": [30.0, 20.0],
            "kairos.ttft_prefill_est_ms": 80.0, "kairos.ttft_decode_est_ms.decode-1": 50.0,
            "kairos.decode_infeasible.decode-0": "tbt_unsafe", "kairos.state_age_ms": 42.5,
            "kairos.model_version": "p@1", "kairos.replica_id": "dispatcher-1", "kairos.attempts": 1}),
        span("node.deflected_prefill", "c" * 16, "b" * 16, 6, 56, instance="decode-1",
             events=[chunk(512, 30.0, 33.0), chunk(188, 20.0, 18.0)], **{
                 "kairos.request_id": RID, "kairos.node": "decode-1", "kairos.prompt_tokens": 700,
                 "kairos.chunk_schedule": [512, 188], "kairos.chunks_run": 2}),
        span("node.decode", "d" * 16, "c" * 16, 56, 99, instance="decode-1", **{
            "kairos.request_id": RID, "kairos.node": "decode-1", "gen_ai.usage.output_tokens": 3,
            "kairos.tbt_mean_ms": 20.0, "kairos.tbt_max_ms": 21.0}),
    ]


def lines_of(spans: list[dict], noise: bool = True) -> list[str]:
    out = [json.dumps(s) for s in spans]
    if noise:  # a torn line and an unrelated span: both ignored
        out.insert(1, '{"name": "ingress.request", "context": {"trace_id": "0x4bf9')
        out.append(json.dumps(span("other", "e" * 16, None, 0, 1, trace=T2, **{"kairos.request_id": "cmpl-zzz"})))
    return out


def test_tree_shows_decision_reason_estimates_and_one_line_per_chunk():
    text = trace_report(lambda: lines_of(deflected_trace()), RID)
    lines = text.splitlines()
    assert lines[0] == f"request {RID}  trace {T}  (4 spans, 1 service, 100.0 ms)"
    assert "ingress.request [ingress-0]  POST /v1/completions → 200" in text and "TTFT 45.0 ms" in text
    assert "└─ dispatcher.decide [dispatcher-1]  DEFLECT → decode-1 · reason deflect_faster · policy kairos" in text
    assert "estimated TTFT: prefill path 80.0 ms · decode-0 infeasible (tbt_unsafe) · decode-1 50.0 ms" in text
    assert "chunk schedule χ [512, 188] · predicted step ms [30.0, 20.0]" in text
    assert "state age 42.5 ms · model p@1 · replica dispatcher-1 · attempts 1" in text
    assert "chunk  1  χ=512  predicted 30.0 ms  actual 33.0 ms  (+10.0%)  B=3" in text
    assert "chunk  2  χ=188  predicted 20.0 ms  actual 18.0 ms  (-10.0%)  B=3" in text
    assert "2 chunks run (2 scheduled)" in text
    assert "└─ node.decode [decode-1]  decode-1 · 3 tokens · TBT mean 20.0 ms · max 21.0 ms" in text
    # offsets and durations; children indented under their parents
    row = next(line for line in lines if "node.deflected_prefill" in line)
    assert row.split()[:2] == ["+6.0", "ms"] and "50.0 ms" in row
    depth = {n: next(line for line in lines if n in line).index(n) for n in
             ("ingress.request", "dispatcher.decide", "node.deflected_prefill", "node.decode")}
    assert depth["ingress.request"] < depth["dispatcher.decide"] < depth["node.deflected_prefill"] < depth["node.decode"]


def test_lookup_by_trace_id_and_iso_times_and_errors_and_orphans():
    spans = deflected_trace()
    assert trace_report(lambda: lines_of(spans), T) == trace_report(lambda: lines_of(spans), "0x" + T.upper())
    iso = [span("ingress.request", "a" * 16, None, 0, 12.5, iso_only=True, status="ERROR",
                **{"kairos.request_id": "cmpl-iso", "http.response.status_code": 503}),
           span("node.decode", "f" * 16, "9" * 16, 3, 4, iso_only=True, **{"kairos.request_id": "cmpl-iso"})]
    text = trace_report(lambda: lines_of(iso, noise=False), "cmpl-iso")
    assert "12.5 ms" in text and "→ 503" in text and "ERROR: boom" in text
    assert "node.decode [x]" in text and "(parent span not in file)" in text
    s = parse_span(iso[0])
    assert s.duration_ns == 12_500_000 and s.status == "ERROR"


def test_unknown_id_raises_and_find_reads_twice_at_most():
    calls = []

    def read():
        calls.append(1)
        return lines_of(deflected_trace())
    with pytest.raises(TraceLookupError):
        trace_report(read, "cmpl-nope")
    assert len(calls) == 1  # nothing matched: no second pass
    calls.clear()
    assert len(find_spans(read, RID)) == 4 and len(calls) == 2
    assert render_trace([]) == ""


@pytest.fixture()
def span_file(tmp_path):
    p = tmp_path / "spans.jsonl"
    p.write_text("\n".join(lines_of(deflected_trace())) + "\n")
    return p


@pytest.mark.parametrize("args,env,needle", [
    (["trace", RID], {}, "no trace file"),
    (["trace", RID, "--trace-file", "/nonexistent/spans.jsonl"], {}, "not found"),
    (["trace", "cmpl-missing", "--trace-file", "{file}"], {}, "no spans of request 'cmpl-missing'"),
    (["trace", "cmpl-missing", "--json", "--trace-file", "{file}"], {}, "no spans of request"),
], ids=["no-file-configured", "missing-file", "unknown-id", "unknown-id-json"])
def test_cli_errors_exit_2(span_file, args, env, needle):
    args = [a.replace("{file}", str(span_file)) for a in args]
    r = CliRunner().invoke(main, args, env={"KAIROS_TRACE_FILE": None, **env})
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and r.stdout == ""


def test_cli_prints_tree_from_flag_or_env(span_file):
    r = CliRunner().invoke(main, ["trace", RID, "--trace-file", str(span_file)])
    assert r.exit_code == 0, r.output
    assert "DEFLECT → decode-1 · reason deflect_faster" in r.stdout
    r2 = CliRunner().invoke(main, ["trace", RID], env={"KAIROS_TRACE_FILE": str(span_file)})
    assert r2.exit_code == 0 and r2.stdout == r.stdout
    r3 = CliRunner().invoke(main, ["trace", RID, "--json", "--trace-file", str(span_file)])
    rows = [json.loads(x) for x in r3.stdout.splitlines()]
    assert r3.exit_code == 0 and len(rows) == 4 and {x["trace_id"] for x in rows} == {T}
