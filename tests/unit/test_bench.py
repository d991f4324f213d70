"""`kairos bench` (kairos/cli/bench/): SSE parsing, chunk → token accounting, record building, and a
replay against an in-process fake OpenAI server (its own thread and event loop, port 0).

The fake's behaviour is keyed on the prompt length (exact, since bench sends token-id prompts):
see ``FakeOpenAI._respond``. Synchronisation is by events, never by sleeping; the only sleep is
the fake's deliberate first-token delay, which the TTFT assertion bounds from below.
"""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import numpy as np
from aiohttp import web
from click.testing import CliRunner

from kairos.cli.bench import (BenchConfig, BenchError, SSEParser, StreamState, build_report, check_url, chunk_tokens,
                          deflect_delta, make_record, parse_deflect_counter, prompt_token_ids, request_body,
                          run_bench)
from kairos.cli.main import main
from kairos.cli.up import free_port
from kairos.core.workload.serving_metrics import format_table, summarize
from kairos.core.workload.workloads import WorkloadRequest, load_plain_csv

# prompt lengths that select a behaviour of the fake server
PL_400, PL_CLOSE, PL_STREAM_ERR, PL_MULTI, PL_SLOW, PL_HOLD_A, PL_HOLD_B, PL_STALL = 13, 17, 19, 20, 30, 40, 41, 50
PL_EMPTY_FIRST, PL_NO_USAGE = 60, 61  # an empty chunk at once, then the first text SLOW_FIRST_S later; no usage
PL_BATCH = 70  # all the token events in one write (they reach the client in one read)
DEFLECTED_PL = {PL_MULTI, PL_SLOW}
SLOW_FIRST_S = 0.15
MODEL = "fake-model"


# --- fake server ----------------------------------------------------------------------------------

class FakeOpenAI:
    """A tiny OpenAI-compatible streaming server with scripted behaviours."""

    def __init__(self, *, requests_endpoint: bool = True, metrics: bool = False,
                 models: tuple[str, ...] = (MODEL,)) -> None:
        self.requests_endpoint, self.metrics, self.models_list = requests_endpoint, metrics, models
        self.bodies: list[dict] = []
        self.decisions: dict[str, str] = {}
        self.deflect_total = 5  # pre-existing deflections: the bench must report the delta only
        self.keep_total = 7
        self.in_flight = 0
        self.max_in_flight = 0
        self.n = 0
        self.lookups = 0  #: GET /v1/requests/{id} calls
        self.b_received: asyncio.Event | None = None
        self.release: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        if self.requests_endpoint:
            app.router.add_get("/v1/requests/{rid}", self.request_info)
        if self.metrics:
            app.router.add_get("/metrics", self.metrics_view)
        return app

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models_list]})

    async def request_info(self, r: web.Request) -> web.Response:
        rid = r.match_info["rid"]
        self.lookups += 1
        if rid not in self.decisions:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"id": rid, "decision": self.decisions[rid]})

    async def metrics_view(self, _r: web.Request) -> web.Response:
        text = ("# HELP kairos_decisions_total Routing decisions\n# TYPE kairos_decisions_total counter\n"
                f'kairos_decisions_total{{decision="deflect",policy="kairos"}} {self.deflect_total}.0\n'
                f'kairos_decisions_total{{decision="keep",policy="kairos"}} {self.keep_total}.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self.in_flight -= 1

        try:
            return await self._respond(r, body, leave)
        finally:
            leave()

    def _chunk(self, rid: str, text: str, finish: str | None = None, logprobs=None) -> dict:
        return {"id": rid, "object": "text_completion", "model": MODEL, "usage": None,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    async def _respond(self, r: web.Request, body: dict, leave) -> web.StreamResponse:
        n_prompt, n_out = len(body["prompt"]), body["max_tokens"]
        if n_prompt == PL_400:
            return web.json_response({"error": {"message": "bad things", "type": "invalid_request_error",
                                                "code": "nope"}}, status=400)
        self.n += 1
        rid = f"cmpl-{self.n:04d}"
        decision = "deflect" if n_prompt in DEFLECTED_PL else "keep"
        self.decisions[rid] = decision
        if decision == "deflect":
            self.deflect_total += 1
        else:
            self.keep_total += 1
        if n_prompt == PL_HOLD_B:
            self.b_received.set()
        if n_prompt == PL_HOLD_A:
            await self.b_received.wait()  # open loop: B must be sent while A is still unanswered
        if n_prompt == PL_STALL:
            await self.release.wait()  # never answers before the client times out
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": rid})
        await resp.prepare(r)
        eol = "\r\n" if n_prompt == PL_MULTI else "\n"

        async def send(obj) -> None:
            raw = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}{eol}{eol}".encode()
            if n_prompt == PL_MULTI:  # split every event across two writes, mid-JSON
                await resp.write(raw[:len(raw) // 2])
                await resp.write(raw[len(raw) // 2:])
            else:
                await resp.write(raw)

        await resp.write(b": keep-alive\n\n")
        if n_prompt == PL_EMPTY_FIRST:
            await send(self._chunk(rid, ""))  # generated nothing yet: not the first token
        if n_prompt in (PL_SLOW, PL_EMPTY_FIRST):
            await asyncio.sleep(SLOW_FIRST_S)  # the delay TTFT must show, not a synchronisation
        if n_prompt == PL_MULTI:  # two tokens per chunk, counted via logprobs.tokens
            for k in range(0, n_out, 2):
                toks = [f"t{k}", f"t{k + 1}"][:n_out - k]
                await send(self._chunk(rid, "".join(toks), logprobs={"tokens": toks}))
        elif n_prompt == PL_BATCH:
            await resp.write("".join(f"data: {json.dumps(self._chunk(rid, f't{k} '))}\n\n"
                                     for k in range(n_out)).encode())
        else:
            for k in range(n_out):
                await send(self._chunk(rid, f"t{k} "))
                if n_prompt == PL_CLOSE and k == 1:
                    r.transport.close()  # connection dropped mid-stream, no [DONE]
                    return resp
                if n_prompt == PL_STREAM_ERR and k == 0:
                    await send({"error": {"message": "engine crashed", "type": "server_error", "code": "boom"}})
                    await send("[DONE]")
                    return resp
        await send(self._chunk(rid, "", finish="length"))
        if n_prompt != PL_NO_USAGE:
            await send({"id": rid, "object": "text_completion", "model": MODEL, "choices": [],
                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                  "total_tokens": n_prompt + n_out,
                                  "prompt_tokens_details": {"cached_tokens": n_prompt // 2}}})
        leave()  # before [DONE]: a client bounded to one request cannot send the next one earlier
        await send("[DONE]")
        await resp.write_eof()
        return resp


@contextmanager
def serve(fake: FakeOpenAI):
    """Run the fake on 127.0.0.1:<free port> in its own thread; yield its base URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        fake.loop = loop
        fake.b_received, fake.release = asyncio.Event(), asyncio.Event()
        runner = web.AppRunner(fake.app(), shutdown_timeout=1.0, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(fake.release.set)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)


def write_csv(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    return path


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


# --- replay against the fake ------------------------------------------------------------------------

def _wl(*rows: tuple[float, int, int]) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"w-{i:02d}", a, p, o) for i, (a, p, o) in enumerate(rows)]


async def test_replay_counts_ttft_tokens_and_deflections():
    fake = FakeOpenAI()
    wl = _wl((0.0, 10, 5), (0.0, PL_400, 5), (0.01, PL_CLOSE, 5), (0.01, PL_STREAM_ERR, 5),
             (0.02, PL_MULTI, 6), (0.02, PL_SLOW, 3), (0.03, 10, 4))
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=10), wl)
    by_id = {r.id: r for r in res.records}
    assert res.sent == 7 and len(res.records) == 7 and set(by_id) == {r.id for r in wl}  # all accounted for
    assert res.model == MODEL
    ok, e400, close, serr, multi, slow, ok2 = (by_id[r.id] for r in wl)

    assert [not r.failed for r in res.records] == [True, False, False, False, True, True, True]
    assert e400.error.startswith("HTTP 400") and "bad things" in e400.error and e400.ttft_ms is None
    assert close.error and close.ttft_ms is not None and len(close.token_times_s) == 2  # failed after 2 tokens
    assert serr.error == "engine crashed (boom)" and len(serr.token_times_s) == 1

    assert ok.output_tokens == 5 and len(ok.token_times_s) == 5 and ok2.output_tokens == 4
    assert multi.output_tokens == 6 and len(multi.token_times_s) == 6  # 3 chunks of 2 tokens (logprobs)
    assert multi.token_times_s[0] == multi.token_times_s[1] and multi.token_times_s[2] == multi.token_times_s[3]
    assert slow.output_tokens == 3
    assert slow.ttft_ms >= SLOW_FIRST_S * 1000  # measured from the SSE arrival of the first token
    for r in res.records:
        if r.ttft_ms is not None:
            assert r.ttft_ms == pytest.approx((r.token_times_s[0] - r.arrival_s) * 1000)
            assert r.token_times_s == sorted(r.token_times_s) and r.ttft_ms > 0

    # deflections from GET /v1/requests/{id}
    assert res.deflections_source == "requests" and res.deflections == 2
    assert {r.id for r in res.records if r.deflected} == {multi.id, slow.id}
    # the server saw exact prompts, ids it assigned were recorded (body id == x-request-id)
    assert sorted(len(b["prompt"]) for b in fake.bodies) == sorted(w.prompt_tokens for w in wl)
    assert all(b["stream"] and b["ignore_eos"] and b["model"] == MODEL for b in fake.bodies)
    assert {o.server_id for o in res.outcomes if o.server_id} == set(fake.decisions)

    report = build_report(res, url=url, workload={"spec": "test"}, save_records=True)
    assert report["sent"] == 7 and report["completed"] == 4 and report["failed"] == 3
    assert report["deflections"] == 2 and report["errors"][e400.error] == 1
    assert [r["id"] for r in report["records"]] == [w.id for w in wl]
    assert all((r["server_id"] is None) == (r["id"] == e400.id) for r in report["records"])
    assert report["duration_s"] >= SLOW_FIRST_S


async def test_without_record_lookups_no_request_record_is_read():
    fake = FakeOpenAI()
    wl = _wl((0.0, 10, 3), (0.0, PL_MULTI, 4))
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=10, lookup_records=False), wl)
        assert fake.lookups == 0
        with_lookups = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=10), wl)
    assert not any(r.failed for r in res.records) and res.deflections is None and res.deflections_source is None
    assert fake.lookups == 2 and with_lookups.deflections == 1  # the same run with lookups reads both records


async def test_open_loop_does_not_wait_for_earlier_requests():
    fake = FakeOpenAI()  # A is answered only once B has reached the server
    wl = _wl((0.0, PL_HOLD_A, 2), (0.05, PL_HOLD_B, 2))
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=5), wl)
    a, b = res.records
    assert not a.failed and not b.failed
    assert a.token_times_s[0] >= b.arrival_s >= 0.05  # A's first token came after B was sent
    assert fake.max_in_flight == 2


async def test_max_concurrency_bounds_requests_in_flight():
    fake = FakeOpenAI()
    wl = _wl(*[(0.0, 10, 3)] * 6)
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, max_concurrency=1), wl)
    assert all(not r.failed for r in res.records) and fake.max_in_flight == 1
    sent = [r.arrival_s for r in res.records]
    ends = [r.token_times_s[-1] for r in res.records]
    assert all(s2 >= e1 for e1, s2 in zip(ends, sent[1:]))  # each sent after the previous one finished


async def test_timeout_fails_the_request_not_the_run():
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=0.3),
                              _wl((0.0, PL_STALL, 2), (0.0, 10, 2)))
    stall, ok = res.records
    assert stall.failed and stall.error == "timeout after 0.3 s" and not ok.failed


async def test_deflections_fall_back_to_metrics_then_to_none():
    fake = FakeOpenAI(requests_endpoint=False, metrics=True)
    wl = _wl((0.0, PL_MULTI, 2), (0.0, 10, 2), (0.0, PL_SLOW, 1))
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False), wl)
    assert res.deflections_source == "metrics" and res.deflections == 2  # 7 → 9 (5 before the run)
    assert not any(r.deflected for r in res.records)  # unknown per request

    fake = FakeOpenAI(requests_endpoint=False, metrics=False)
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False), wl)
    assert res.deflections is None and res.deflections_source is None
    report = build_report(res, url=url, workload={})
    assert report["deflections"] is None
    assert "live" in format_table([{**report, "policy": "live"}])


async def test_unreachable_server_and_missing_model():
    port = free_port()
    with pytest.raises(BenchError, match=f"cannot reach the ingress at http://127.0.0.1:{port}"):
        await run_bench(BenchConfig(url=f"http://127.0.0.1:{port}", progress=False), _wl((0.0, 10, 1)))
    fake = FakeOpenAI(models=())
    with serve(fake) as url:
        with pytest.raises(BenchError, match="pass --model"):
            await run_bench(BenchConfig(url=url, progress=False), _wl((0.0, 10, 1)))
        res = await run_bench(BenchConfig(url=url, model="explicit", progress=False), _wl((0.0, 10, 1)))
    assert res.model == "explicit" and fake.bodies[0]["model"] == "explicit" and not res.records[0].failed


async def test_a_model_the_server_does_not_serve_is_a_usage_error():
    fake = FakeOpenAI()
    with serve(fake) as url:
        with pytest.raises(BenchError, match="--model 'nope' is not served"):
            await run_bench(BenchConfig(url=url, model="nope", progress=False), _wl((0.0, 10, 1)))
    assert fake.bodies == []  # nothing was sent


# --- CLI -------------------------------------------------------------------------------------------

REQUIRED_KEYS = {"sent", "completed", "failed", "ttft_ms", "tbt_ms", "slo_attainment", "deflections", "duration_s",
                 "url", "workload", "requests", "tbt_violation_rate", "output_tokens_per_s", "deflections_source"}


def test_cli_trace_writes_json_and_table(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 3), (0.01, PL_400, 3), (0.02, PL_MULTI, 4), (0.03, 12, 2)])
    out = tmp_path / "out" / "bench.json"
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--duration", "10",
                                        "--json", str(out), "--save-records", "--no-progress", "--label", "fake"])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(rep)
    assert set(rep["ttft_ms"]) == {"p50", "p95", "p99"} and set(rep["tbt_ms"]) == {"p50", "p95"}
    assert (rep["sent"], rep["completed"], rep["failed"], rep["deflections"]) == (4, 3, 1, 1)
    assert rep["workload"]["spec"] == f"trace:{csv}" and rep["workload"]["requests"] == 4
    assert [r["id"] for r in rep["records"]] == [w.id for w in load_plain_csv(csv, id_prefix="trace")]
    assert "fake" in res.stdout and "TTFT p95 ms" in res.stdout
    assert "sent 4, completed 3, failed 1" in res.stderr


def test_cli_generated_workload(tmp_path):
    out = tmp_path / "b.json"
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", "lpld", "--rps", "40", "--duration",
                                        "0.25", "--seed", "3", "--json", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["sent"] == rep["requests"] == rep["completed"] == rep["workload"]["requests"] > 0
    assert rep["failed"] == 0 and rep["deflections"] == 0 and "records" not in rep
    assert len(fake.bodies) == rep["sent"]


@pytest.mark.parametrize("args, needle", [
    (["--url", "ftp://nowhere"], "bad --url"),
    (["--url", "http://127.0.0.1:{port}"], "cannot reach the ingress at http://127.0.0.1:{port}"),
    (["--workload", "nope"], "unknown workload"),
    (["--save-records"], "--save-records needs --json"),
    (["--duration", "0"], "must be > 0"),
])
def test_cli_usage_errors_exit_2(args, needle):
    port = free_port()
    args = [a.format(port=port) for a in args]
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--url", f"http://127.0.0.1:{port}", *args])
    assert res.exit_code == 2
    assert needle.format(port=port) in res.stderr


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


async def test_ttft_waits_for_generated_text_and_counts_without_usage():
    fake = FakeOpenAI()
    wl = _wl((0.0, PL_EMPTY_FIRST, 3), (0.0, PL_NO_USAGE, 4))
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, request_timeout_s=10), wl)
    empty, no_usage = res.records
    assert empty.ttft_ms >= SLOW_FIRST_S * 1000 and empty.output_tokens == 3  # not the empty chunk's arrival
    assert no_usage.output_tokens == 4 and not no_usage.failed  # counted from chunks, not off by one
    report = build_report(res, url=url, workload={"offered_rps": None})
    assert report["usage_reported"] == 1


async def test_achieved_rate_is_below_the_offered_one_under_max_concurrency():
    fake = FakeOpenAI()
    wl = _wl(*[(0.01 * i, PL_SLOW, 2) for i in range(4)])  # offered: 3 intervals in 0.03 s = 100 req/s
    with serve(fake) as url:
        res = await run_bench(BenchConfig(url=url, progress=False, max_concurrency=1, request_timeout_s=10), wl)
    report = build_report(res, url=url, workload={"offered_rps": 100.0})
    sent = sorted(r.arrival_s for r in res.records)
    assert report["achieved_rps"] == pytest.approx(3 / (sent[-1] - sent[0]), abs=1e-3)
    assert report["achieved_rps"] < 1 / SLOW_FIRST_S < report["offered_rps"]  # each waits for the previous one


def test_cli_prints_the_vllm_result_block_and_warns_without_usage(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, PL_NO_USAGE, 3), (0.01, 12, 2)])
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--no-progress",
                                        "--goodput", "ttft:5000", "--goodput", "e2el:9000",
                                        "--percentile-metrics", "ttft,tpot,itl,e2el"])
    assert res.exit_code == 0, res.output
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                  "Request goodput (req/s):", "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):",
                  "Request rate configured (RPS):", "Peak concurrent requests:", "How to read the rates"):
        assert label in res.stdout, label
    assert "run " in res.stdout and "policy" not in res.stdout  # the row is a run, not a policy
    assert "warning" not in res.stderr  # one response carried usage
    only = write_csv(tmp_path / "nousage.csv", [(0.0, PL_NO_USAGE, 3)])
    with serve(FakeOpenAI()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{only}", "--no-progress"])
    assert res.exit_code == 0 and "warning: the server sent no usage" in res.stderr
    bad = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "--goodput", "ttft=5"])
    assert bad.exit_code == 2 and "--goodput 'ttft=5'" in bad.stderr


def test_bench_defaults_to_a_one_minute_workload():
    from kairos.cli.main import bench as bench_cmd
    opt = next(o for o in bench_cmd.params if o.name == "duration")
    assert opt.default == 60.0


def test_a_run_where_nothing_completed_exits_1(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, PL_400, 3), (0.01, PL_400, 2)])
    with serve(FakeOpenAI()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--no-progress"])
    assert res.exit_code == 1 and "no request completed" in res.stderr


async def test_a_401_says_an_api_key_is_needed():
    class Locked(FakeOpenAI):
        async def models(self, _r):
            return web.json_response({"error": {"message": "bad key", "code": "invalid_api_key"}}, status=401)
    with serve(Locked()) as url:
        with pytest.raises(BenchError, match="requires an API key .* --api-key"):
            await run_bench(BenchConfig(url=url, progress=False, model=MODEL), _wl((0.0, 10, 1)))


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


@pytest.mark.parametrize("reuse", [False, True])
def test_cli_prompts_follow_seed_and_reuse_prompts_keeps_them(tmp_path, reuse):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 24, 2), (0.01, 24, 2)])
    prompts = []
    for seed in (1, 2, 1):
        fake = FakeOpenAI()
        with serve(fake) as url:
            res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--duration", "10",
                                            "--seed", str(seed), "--no-progress",
                                            *(["--reuse-prompts"] if reuse else [])])
        assert res.exit_code == 0, res.output
        prompts.append([b["prompt"] for b in fake.bodies])
    assert prompts[0] == prompts[2]  # same seed, same prompts
    assert prompts[0][0] != prompts[0][1]  # two requests never share a prompt
    if reuse:
        assert prompts[0] == prompts[1] == [prompt_token_ids(0, 24), prompt_token_ids(1, 24)]
    else:
        assert all(p != q for p, q in zip(prompts[0], prompts[1]))


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


def test_save_records_writes_the_reported_cached_tokens(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 2), (0.01, PL_NO_USAGE, 2)])
    out = tmp_path / "b.json"
    with serve(FakeOpenAI()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--duration", "10",
                                        "--json", str(out), "--save-records", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert [r["cached_tokens"] for r in json.loads(out.read_text())["records"]] == [5, None]


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


async def test_replay_gives_one_itl_per_event_even_when_a_read_carries_several():
    from kairos.core.workload.serving_metrics import serving_metrics
    with serve(FakeOpenAI()) as url:
        res = await run_bench(BenchConfig(url=url, progress=False), [WorkloadRequest("a", 0.0, PL_BATCH, 6)])
    rec = res.records[0]
    assert rec.output_tokens == 6 and len(set(rec.token_times_s)) == 6
    assert len(np.unique(rec.token_times_s)) - 1 == 5  # serving_metrics' ITL sample count
    assert serving_metrics(res.records, duration_s=res.duration_s)["mean_itl_ms"] is not None
