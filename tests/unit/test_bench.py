"""`kairos bench` (kairos/cli/bench/) against an in-process fake OpenAI server
(tests/unit/fake_openai.py): replays (TTFT, tokens, deflections, open loop, concurrency, timeouts,
errors) and the CLI (JSON report, table, vLLM's result block, prompts, records).

The pure pieces (SSE parsing, chunk → token accounting, records, metrics) are in
tests/unit/test_bench_accounting.py. The tests here serve HTTP with aiohttp: the mutation tier
leaves this file out (pyproject.toml, ``[tool.mutmut]``).
"""

from __future__ import annotations

import json

import pytest
import numpy as np
from aiohttp import web
from click.testing import CliRunner

from kairos.cli.bench import BenchConfig, BenchError, build_report, prompt_token_ids, run_bench
from kairos.cli.main import main
from kairos.cli.up import free_port
from kairos.core.workload.serving_metrics import format_table
from kairos.core.workload.workloads import WorkloadRequest, load_plain_csv
from tests.unit.fake_openai import (MODEL, PL_400, PL_BATCH, PL_CLOSE, PL_EMPTY_FIRST, PL_HOLD_A, PL_HOLD_B,
                                    PL_MULTI, PL_NO_USAGE, PL_SLOW, PL_STALL, PL_STREAM_ERR, SLOW_FIRST_S,
                                    FakeOpenAI, serve, write_csv)


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


# --- vllm bench serve figures (issue 11) -------------------------------------------------------------

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


def test_save_records_writes_the_reported_cached_tokens(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 2), (0.01, PL_NO_USAGE, 2)])
    out = tmp_path / "b.json"
    with serve(FakeOpenAI()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--workload", f"trace:{csv}", "--duration", "10",
                                        "--json", str(out), "--save-records", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert [r["cached_tokens"] for r in json.loads(out.read_text())["records"]] == [5, None]


async def test_replay_gives_one_itl_per_event_even_when_a_read_carries_several():
    from kairos.core.workload.serving_metrics import serving_metrics
    with serve(FakeOpenAI()) as url:
        res = await run_bench(BenchConfig(url=url, progress=False), [WorkloadRequest("a", 0.0, PL_BATCH, 6)])
    rec = res.records[0]
    assert rec.output_tokens == 6 and len(set(rec.token_times_s)) == 6
    assert len(np.unique(rec.token_times_s)) - 1 == 5  # serving_metrics' ITL sample count
    assert serving_metrics(res.records, duration_s=res.duration_s)["mean_itl_ms"] is not None
