"""``kairos bench --num-prompts N`` (kairos/cli/options.py, kairos/core/workload/counted.py): as
``vllm bench serve --num-prompts N`` (vllm/benchmarks/serve.py), exactly the first N requests of the
workload are sent, on its own schedule at the rate: counted at the fake OpenAI server
(tests/unit/fake_openai.py) and in vLLM's result block. Bad counts (0, negative, over
:data:`~kairos.core.workload.workloads.MAX_REQUESTS`, a span over a week, more than a trace holds)
are usage errors naming --num-prompts; with a typed ``--duration`` too, a usage error."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.core.workload.counted import first_requests
from kairos.core.workload.workloads import MAX_REQUESTS, MAX_WORKLOAD_S, parse_workload
from tests.unit.fake_openai import PL_400, FakeOpenAI, serve, write_csv


def _bench(url: str, *args: str):
    return CliRunner().invoke(main, ["bench", "--url", url, "--no-progress", *args])


def _successful(stdout: str) -> int:
    """``Successful requests:`` of vLLM's result block."""
    return int(re.search(r"^Successful requests:\s+(\d+)", stdout, re.M).group(1))


@pytest.mark.parametrize("spec, rate", [("lpld", "200"), ("bursty", "300")])
def test_a_generated_workload_sends_exactly_n_requests(tmp_path, spec, rate):
    out = tmp_path / "b.json"
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = _bench(url, "--workload", spec, "--request-rate", rate, "--num-prompts", "9", "--seed", "4",
                     "--json", str(out))
    assert res.exit_code == 0, res.output
    assert len(fake.bodies) == 9  # counted where they arrive
    rep = json.loads(out.read_text())
    assert rep["sent"] == rep["requests"] == rep["completed"] == 9 and rep["failed"] == 0
    assert rep["workload"]["num_prompts"] == 9 and rep["workload"]["duration_s"] is None
    assert _successful(res.stdout) == 9
    assert "sent 9, completed 9, failed 0" in res.stderr


def test_a_trace_sends_its_first_n_and_the_result_block_counts_a_failure(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 2), (0.01, PL_400, 2), (0.02, 11, 2), (0.03, 12, 2)])
    out = tmp_path / "b.json"
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = _bench(url, "--workload", f"trace:{csv}", "--num-prompts", "3", "--json", str(out), "--save-records")
    assert res.exit_code == 0, res.output
    assert len(fake.bodies) == 3
    rep = json.loads(out.read_text())
    assert [r["id"] for r in rep["records"]] == ["trace-000000", "trace-000001", "trace-000002"]
    assert (rep["sent"], rep["completed"], rep["failed"]) == (3, 2, 1)
    assert _successful(res.stdout) == 2 and re.search(r"^Failed requests:\s+1\b", res.stdout, re.M)


def test_a_trace_shorter_than_n_names_both_numbers_and_sends_nothing(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 2), (0.01, 11, 2)])
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = _bench(url, "--workload", f"trace:{csv}", "--num-prompts", "5")
    assert res.exit_code == 2, res.output
    assert "--num-prompts: 5 requests asked for" in res.stderr and "holds only 2" in res.stderr, res.stderr
    assert fake.bodies == []


def test_busiest_keeps_the_n_consecutive_arrivals_spanning_the_least_time(tmp_path):
    csv = write_csv(tmp_path / "wl.csv", [(0.0, 10, 1), (5.0, 11, 1), (9.0, 12, 1), (9.5, 13, 1), (20.0, 14, 1)])
    got = first_requests(f"trace:{csv}:busiest", None, 3, 0)
    assert [r.id for r in got] == ["trace-000001", "trace-000002", "trace-000003"]
    assert [r.arrival_s for r in got] == [0.0, 4.0, 4.5]  # re-based to the first of them
    assert [r.id for r in first_requests(f"trace:{csv}", None, 3, 0)] == ["trace-000000", "trace-000001",
                                                                          "trace-000002"]


def test_generated_arrivals_are_the_first_n_of_the_seeds_process():
    """Asking for fewer requests cuts the same arrival process shorter; the count is exact."""
    long = first_requests("bursty", 4.0, 2000, seed=3)
    for n in (1, 2, 37, 2000):
        got = first_requests("bursty", 4.0, n, seed=3)
        assert len(got) == n
        assert [r.arrival_s for r in got] == [r.arrival_s for r in long[:n]]
    assert [r.arrival_s for r in long] == [r.arrival_s for r in parse_workload("bursty", 4.0, 2000.0, 3)[:2000]]


# --- usage errors (nothing runs: the `captured` fixture of tests/unit/conftest.py) ----------------------

@pytest.mark.parametrize("value", ["0", "-3", str(MAX_REQUESTS + 1), "1.5", "many"])
def test_a_bad_count_is_a_usage_error_naming_the_option(captured, value):
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--num-prompts", value])
    assert res.exit_code == 2, res.output
    assert "--num-prompts" in res.output.split("Error:", 1)[1], res.output
    assert captured == {}


def test_the_count_alone_replaces_the_default_duration(captured):
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--request-rate", "3", "--num-prompts", "40"])
    assert res.exit_code == 0, res.output
    assert captured["num_prompts"] == 40 and captured["duration"] is None and captured["rps"] == 3.0


def test_count_and_a_typed_duration_is_a_usage_error(captured):
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--num-prompts", "40", "--duration", "60"])
    assert res.exit_code == 2, res.output
    assert "--num-prompts 40 and --duration 60" in res.output and "give one" in res.output, res.output
    assert captured == {}


def test_a_count_longer_than_a_week_at_its_rate_is_refused_before_any_request(tmp_path):
    fake = FakeOpenAI()
    n = int(MAX_WORKLOAD_S) + 1  # hpld's Table 1 rate is 1 request/s
    with serve(fake) as url:
        res = _bench(url, "--workload", "hpld", "--num-prompts", str(n))
    assert res.exit_code == 2, res.output
    assert f"--num-prompts: {n} requests at 1 requests/s" in res.stderr and "604800" in res.stderr, res.stderr
    assert fake.bodies == []
