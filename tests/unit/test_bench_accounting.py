"""`kairos bench` (kairos/cli/bench/), its pure pieces: SSE parsing, chunk → token accounting,
record building, the deflection counter, prompts and request bodies, vLLM's serving metrics and
the progress lines. The replays against a fake server are in tests/unit/test_bench.py."""

from __future__ import annotations

import json

import pytest
import numpy as np

from kairos.cli.bench import (BenchError, SSEParser, StreamState, check_url, chunk_tokens, deflect_delta, make_record,
                              parse_deflect_counter, prompt_token_ids, request_body)
from kairos.core.workload.serving_metrics import summarize
from kairos.core.workload.workloads import WorkloadRequest


# --- pure pieces -----------------------------------------------------------------------------------

def test_sse_parser_events_done_comments_and_multiline():
    p = SSEParser()
    got = p.feed(b": ping\n\ndata: {\"a\": 1}\n\nevent: x\nid: 3\ndata: line1\ndata:line2\n\n: keep-alive\n\n"
                 b"data: [DONE]\n\n")
    assert got == ['{"a": 1}', "line1\nline2", "[DONE]"]
    assert p.close() == []


def test_sse_parser_split_reads_crlf_cr_and_utf8():
    p = SSEParser()
    raw = "data: {\"t\": \"é\"}\r\n\r\ndata: x\r\rdata: y\n\n".encode()
    out = []
    for i in range(len(raw)):  # one byte at a time: splits "\r|\n" and the two UTF-8 bytes of é
        out += p.feed(raw[i:i + 1])
    assert out == ['{"t": "é"}', "x", "y"]


def test_sse_parser_ignores_events_without_data_and_flushes_unterminated_last_event():
    p = SSEParser()
    assert p.feed(b"event: ping\n\nretry: 10\n\ndata:\n\n") == [""]  # "data:" alone is an empty data event
    assert p.feed(b"data: [DONE]") == []
    assert p.close() == ["[DONE]"]


def test_chunk_tokens_rules():
    text = {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}
    assert chunk_tokens(text, None, 0) == 1
    assert chunk_tokens({**text, "text": ""}, None, 0) == 0  # nothing generated (an empty first chunk): not a token
    assert chunk_tokens({**text, "text": ""}, 1, 0) == 1  # ... unless usage says a (special) token was generated
    assert chunk_tokens({**text, "text": "", "finish_reason": "length"}, None, 0) == 0  # finish marker
    assert chunk_tokens({**text, "text": "x", "finish_reason": "length"}, None, 0) == 1  # last token + finish
    assert chunk_tokens({**text, "logprobs": {"tokens": ["a", "b", "c"]}}, None, 0) == 3
    assert chunk_tokens(text, 7, 4) == 3  # cumulative usage per chunk (vLLM continuous_usage_stats)
    assert chunk_tokens({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}, None, 0) == 0
    assert chunk_tokens({"index": 0, "delta": {"content": "hi"}, "finish_reason": None}, None, 0) == 1


def test_stream_state_accounting():
    s = StreamState()
    s.on_data(json.dumps({"id": "cmpl-1", "choices": [{"text": "a", "finish_reason": None}], "usage": None}), 1.0)
    s.on_data(json.dumps({"id": "cmpl-1", "choices": [{"text": "bc", "logprobs": {"tokens": ["b", "c"]},
                                                       "finish_reason": None}]}), 1.5)
    s.on_data(json.dumps({"id": "cmpl-1", "choices": [{"text": "", "finish_reason": "length"}]}), 1.6)
    s.on_data(json.dumps({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 3}}), 1.7)
    assert not s.done
    s.on_data("[DONE]", 1.8)
    assert s.done and s.error is None and s.server_id == "cmpl-1"
    assert s.chunks == [(1.0, 1), (1.5, 2)] and s.usage_completion_tokens == 3

    e = StreamState()
    e.on_data(json.dumps({"error": {"message": "engine crashed", "code": "boom"}}), 2.0)
    e.on_data("{not json", 2.1)
    assert e.error == "engine crashed (boom)"  # the first error wins


def test_make_record_repeats_chunk_times_per_token():
    req = WorkloadRequest("r-1", 0.0, 10, 4)
    rec = make_record(req, 1.0, [(1.25, 1), (1.5, 2), (1.6, 1)], output_tokens=4)
    assert rec.token_times_s == [1.25, 1.5, 1.5, 1.6]
    assert rec.ttft_ms == pytest.approx(250.0) and rec.output_tokens == 4 and not rec.failed
    assert rec.arrival_s == 1.0 and rec.prompt_tokens == 10 and rec.id == "r-1"
    assert make_record(req, 1.0, [(1.25, 1)]).output_tokens == 1  # no usage: the tokens counted
    empty = make_record(req, 1.0, [])
    assert empty.failed and empty.ttft_ms is None and empty.error == "no output tokens in the stream"
    failed_late = make_record(req, 1.0, [(1.1, 1)], error="boom")
    assert failed_late.failed and failed_late.ttft_ms == pytest.approx(100.0)
    s = summarize([rec])  # gaps: 250 ms, 0 ms (same chunk), 100 ms
    assert s["tbt_ms"]["p50"] == pytest.approx(100.0)


def test_parse_deflect_counter_and_delta():
    text = ('# TYPE kairos_decisions_total counter\n'
            'kairos_decisions_total{decision="deflect",policy="kairos"} 3.0\n'
            'kairos_decisions_total{decision="deflect",policy="kairos+"} 2.0\n'
            'kairos_decisions_total{decision="keep",policy="kairos"} 9.0\n')
    assert parse_deflect_counter(text) == 5.0
    disp = 'kairos_dispatcher_decisions_total{decision="keep",policy="pd",reason="x"} 4.0\n'
    assert parse_deflect_counter(disp) == 0.0  # family present, no deflects
    assert parse_deflect_counter("other_total 1.0\n") is None
    assert deflect_delta(text.replace("3.0", "1.0"), text) == 2.0
    assert deflect_delta(None, text) is None and deflect_delta("other 1\n", "other 2\n") is None


def test_prompt_ids_and_body():
    ids = prompt_token_ids(1234, 50)
    assert len(ids) == 50 and all(1 <= t <= 1000 for t in ids)
    assert prompt_token_ids(1234, 50) == ids  # deterministic
    assert len({tuple(prompt_token_ids(i, 3)[:2]) for i in range(5000)}) == 5000  # no shared prefixes
    body = request_body(WorkloadRequest("x", 0.0, 7, 9), 3, "m")
    assert body == {"model": "m", "prompt": prompt_token_ids(3, 7), "max_tokens": 9, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}


def test_check_url():
    assert check_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for bad in ("ftp://x", "localhost:8000", "http://", "nonsense"):
        with pytest.raises(BenchError, match="--url"):
            check_url(bad)


def test_make_record_takes_deflection_and_ttft_components_from_the_decision_record():
    req = WorkloadRequest("w", 0.0, 100, 2)
    rec = make_record(req, 1.0, [(1.3, 1), (1.35, 1)], record={
        "decision": "deflect", "measured": {"prefill_queue_ms": 5.0, "prefill_exec_ms": 280.0,
                                            "kv_transfer_ms": 0.0, "decode_queue_ms": 0.0, "ttft_ms": 290.0}})
    assert rec.deflected and rec.prefill_exec_ms == 280.0 and rec.kv_transfer_ms == 0.0
    keep = make_record(req, 1.0, [(1.3, 1)], record={"decision": "keep", "measured": {"kv_transfer_ms": None}})
    assert not keep.deflected and keep.kv_transfer_ms is None and keep.prefill_queue_ms is None


# --- vllm bench serve figures (issue 11) -------------------------------------------------------------

def _rec(i: int, arrival_s: float, times: list[float], *, prompt: int = 10, error: str | None = None):
    from kairos.core.workload.serving_metrics import RequestRecord
    return RequestRecord(id=f"r{i}", arrival_s=arrival_s, prompt_tokens=prompt, output_tokens=len(times),
                         ttft_ms=(times[0] - arrival_s) * 1000 if times else None, token_times_s=times, error=error)


def test_serving_metrics_follow_vllm_definitions():
    from kairos.core.workload.serving_metrics import serving_metrics
    a = _rec(0, 0.0, [0.1, 0.2, 0.4])          # TTFT 100, E2EL 400, TPOT (400-100)/2 = 150, ITL 100, 200
    b = _rec(1, 1.0, [1.5], prompt=20)         # one token: TTFT = E2EL = 500, no TPOT (0 for goodput), no ITL
    c = _rec(2, 0.5, [0.9, 0.9, 1.0])          # 2 tokens in one chunk: ITL is one 100 ms gap between chunks
    failed = _rec(3, 0.0, [], error="boom")
    m = serving_metrics([a, b, c, failed], duration_s=2.0, goodput_slo_ms={"ttft": 450.0, "tpot": 200.0})
    assert (m["completed"], m["failed"], m["duration"]) == (3, 1, 2.0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 7)
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(23.5)
    assert m["mean_ttft_ms"] == pytest.approx((100 + 500 + 400) / 3) and m["median_ttft_ms"] == pytest.approx(400)
    assert m["mean_e2el_ms"] == pytest.approx((400 + 500 + 500) / 3)
    # TPOT: a (400-100)/2 = 150, c (500-400)/2 = 50; b has none
    assert m["mean_tpot_ms"] == pytest.approx(100) and m["median_tpot_ms"] == pytest.approx(100)
    assert m["mean_itl_ms"] == pytest.approx((100 + 200 + 100) / 3)
    assert m["p99_itl_ms"] == pytest.approx(float(np.percentile([100, 200, 100], 99)))
    # goodput: a (100 ≤ 450, 150 ≤ 200) and c (400, 50) are good; b's TTFT 500 > 450
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert serving_metrics([], duration_s=0.0)["mean_ttft_ms"] is None
    with pytest.raises(ValueError, match="unknown goodput metric 'itl'"):
        serving_metrics([a], duration_s=1.0, goodput_slo_ms={"itl": 5.0})


def test_progress_lines_when_stderr_is_not_a_terminal():
    import io
    from kairos.cli.bench import ProgressReporter
    now = [0.0]
    out = io.StringIO()  # not a terminal
    rep = ProgressReporter(5, enabled=True, interval_s=10.0, stream=out, clock=lambda: now[0])
    for t, failed in ((1.0, 0), (11.0, 1), (12.0, 1), (25.0, 1)):
        now[0] = t
        rep.update(failed)
    rep.close()
    lines = out.getvalue().splitlines()
    assert lines == ["bench: 2/5 requests done, 1 failed, 11 s elapsed",
                     "bench: 4/5 requests done, 1 failed, 25 s elapsed"]  # close() does not repeat it
    out2 = io.StringIO()
    rep2 = ProgressReporter(2, enabled=True, interval_s=10.0, stream=out2, clock=lambda: now[0])
    rep2.update(0)
    rep2.close()  # the run ended before the first period: one closing line
    assert out2.getvalue().splitlines() == ["bench: 1/2 requests done, 0 failed, 0 s elapsed"]
    quiet = io.StringIO()
    ProgressReporter(5, enabled=False, stream=quiet, clock=lambda: 99.0).update(0)
    assert quiet.getvalue() == ""


def test_bench_defaults_to_a_one_minute_workload():
    from kairos.cli.main import bench as bench_cmd
    opt = next(o for o in bench_cmd.params if o.name == "duration")
    assert opt.default == 60.0


# --- issue 20: seeded prompts, cached tokens, one ITL per SSE event ------------------------------------

def test_prompts_depend_on_the_seed_unless_reused():
    a, b = prompt_token_ids(7, 40, seed=1), prompt_token_ids(7, 40, seed=2)
    assert a == prompt_token_ids(7, 40, seed=1)  # same seed: same prompt (reproducible)
    assert len(a) == 40 and all(1 <= t <= 1000 for t in a + b)
    assert a[0] != b[0] and sum(x == y for x, y in zip(a, b)) < 10  # another seed: another prompt from the start
    assert len({tuple(prompt_token_ids(i, 3, seed=5)[:2]) for i in range(5000)}) == 5000  # no shared prefixes
    assert prompt_token_ids(7, 40) == [(7 + k) % 1000 + 1 if k != 1 else 1 for k in range(40)]  # index-only
    req = WorkloadRequest("x", 0.0, 7, 9)
    assert request_body(req, 3, "m", seed=4)["prompt"] == prompt_token_ids(3, 7, seed=4)


def test_cached_tokens_are_those_the_server_reports():
    s = StreamState()
    s.on_data(json.dumps({"id": "c", "choices": [{"text": "a", "finish_reason": None}], "usage": None}), 1.0)
    assert s.cached_tokens is None
    s.on_data(json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                                               "prompt_tokens_details": {"cached_tokens": 32}}}), 1.1)
    assert s.cached_tokens == 32
    req = WorkloadRequest("r", 0.0, 40, 1)
    assert make_record(req, 0.5, s.chunks, cached_tokens=s.cached_tokens).cached_tokens == 32
    assert make_record(req, 0.5, s.chunks).cached_tokens is None
    n = StreamState()
    n.on_data(json.dumps({"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens_details": None}}), 1.0)
    assert n.cached_tokens is None  # absent: null, not 0


def test_events_read_together_are_one_itl_each():
    from kairos.core.workload.serving_metrics import serving_metrics
    s = StreamState()
    for text, t in (("a", 1.0), ("b", 1.2), ("c", 1.2), ("d", 1.2)):  # b, c, d came in one read
        s.on_data(json.dumps({"choices": [{"text": text, "finish_reason": None}]}), t)
    s.on_data(json.dumps({"choices": [{"text": "ef", "logprobs": {"tokens": ["e", "f"]}}]}), 1.5)
    rec = make_record(WorkloadRequest("r", 0.0, 5, 6), 0.5, s.chunks)
    m = serving_metrics([rec], duration_s=2.0)
    assert [t for t, _ in s.chunks] == sorted({t for t, _ in s.chunks})  # one distinct arrival per event
    # 4 gaps for 5 events (vLLM appends one ITL per chunk); e and f, one event, are one arrival
    assert m["mean_itl_ms"] == pytest.approx(500.0 / 4)
    assert rec.output_tokens == 6 and rec.token_times_s[-1] == rec.token_times_s[-2] == 1.5


async def test_sse_json_yields_each_events_json_across_split_reads_and_leaves_done_out():
    """The streams' JSON as the churn benchmark and the faults tier read them: an event split over
    reads, a keep-alive comment, CRLF lines, a last event without its blank line."""
    from kairos.cli.bench.stream import sse_json

    async def reads():
        for chunk in (b'data: {"a": 1}\n\n: keep-alive\n\nda', b'ta: {"b": 2}\r\n\r\n', b"data: [DONE]\n\n",
                      b'data: {"c": 3}'):
            yield chunk

    assert [ev async for ev in sse_json(reads())] == [{"a": 1}, {"b": 2}, {"c": 3}]
