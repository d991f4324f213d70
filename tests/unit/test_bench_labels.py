"""``kairos bench`` prints ``vllm bench serve``'s result block: its labels, order, section headers and
number formats, with vLLM's peak output throughput and peak concurrency (issue 20).

The reference is vLLM 0.32's source, copied here as a fixture (this tier must not read the vLLM
virtualenv): :data:`SERVE_PY_BLOCK` is every line ``benchmark()`` in ``vllm/benchmarks/serve.py`` can
print between the ``Serving Benchmark Result`` line and the closing ``=`` line, in order, with
the condition under which vLLM prints it, a metric section with ``process_one_metric``'s arguments
(independent of the product's own table, ``PERCENTILE_METRICS`` in kairos/cli/bench/vllm_block.py,
whose labels the tests here check); :func:`vllm_peaks` is ``calculate_metrics``' loop for
the two peak figures, verbatim but for the names. The vLLM tier
(tests/vllm/servers/test_bench_parity.py) checks this fixture against the installed source and
compares the two tools' live outputs line by line.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from kairos.cli.bench.client import BenchResult, Outcome
from kairos.cli.bench.report import build_report, format_report, rates_note
from kairos.cli.bench.stream import StreamState
from kairos.cli.bench.vllm_block import block_labels, peak_figures, result_block
from kairos.core.workload.serving_metrics import RequestRecord
from kairos.core.workload.workloads import WorkloadRequest


class Metric(NamedTuple):
    """A ``process_one_metric(stem, name, header)`` call of serve.py: the section of ``--percentile-metrics``
    stem ``stem``, its header line and its ``Mean/Median/P<p> <name> (ms):`` labels."""

    stem: str
    name: str
    header: str


#: vLLM 0.32 ``vllm/benchmarks/serve.py`` ``benchmark()``, lines 1181-1246 (the summary) and
#: ``process_one_metric`` calls, lines 1396-1411: (label, section header or :class:`Metric`; condition). Conditions:
#: ``max_concurrency`` (``--max-concurrency`` given), ``finite_rate`` (``--request-rate`` not inf),
#: ``tokenizer`` (vLLM has a tokenizer: always so for generation), ``goodput`` (``--goodput``
#: given), ``embedding``/``audio``/``probe`` (never for Kairos: pooling models, RTFx > 0, probe
#: requests); a :class:`Metric` section is printed when its stem is in ``--percentile-metrics``
#: (and, for the queue ones, under ``max_concurrency``, the last also with ``finite_rate``).
SERVE_PY_BLOCK: tuple[tuple[str | Metric, str | None], ...] = (
    ("Serving Benchmark Result", None),
    ("Successful requests:", None),
    ("Failed requests:", None),
    ("Maximum request concurrency:", "max_concurrency"),
    ("Request rate configured (RPS):", "finite_rate"),
    ("Benchmark duration (s):", None),
    ("Total input tokens:", None),
    ("Total generated tokens:", "tokenizer"),
    ("Request throughput (req/s):", None),
    ("Input throughput (inputs/s):", "embedding"),
    ("Request goodput (req/s):", "goodput"),
    ("Output token throughput (tok/s):", "tokenizer"),
    ("Peak output token throughput (tok/s):", "tokenizer"),
    ("Peak concurrent requests:", None),
    ("RTFx (Inverse Real-Time Factor):", "audio"),
    ("Total token throughput (tok/s):", "tokenizer"),
    ("Probe Requests", "probe"),
    ("Probe requests completed:", "probe"),
    ("Probe requests failed:", "probe"),
    ("Median probe E2EL (ms):", "probe"),
    ("P99 probe E2EL (ms):", "probe"),
    ("Max probe E2EL (ms):", "probe"),
    (Metric("ttft", "TTFT", "Time to First Token"), "tokenizer"),
    (Metric("tpot", "TPOT", "Time per Output Token (excl. 1st token)"), "tokenizer"),
    (Metric("itl", "ITL", "Inter-token Latency"), "tokenizer"),
    (Metric("e2el", "E2EL", "End-to-end Latency"), None),
    (Metric("client_queue_time", "Client Queue Time", "Client-side Queueing"), "max_concurrency"),
    (Metric("e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
     "max_concurrency+finite_rate"),
)
#: :data:`SERVE_PY_BLOCK` as (label, condition), a metric section as ``metric:<stem>``; with
#: :data:`VLLM_METRICS` (stem → (name, header)), what the vLLM tier (tests/vllm/servers/test_bench_parity.py)
#: compares with the installed serve.py
VLLM_BLOCK: tuple[tuple[str, str | None], ...] = tuple(
    (f"metric:{row.stem}" if isinstance(row, Metric) else row, cond) for row, cond in SERVE_PY_BLOCK)
VLLM_METRICS: dict[str, tuple[str, str]] = {
    row.stem: (row.name, row.header) for row, _ in SERVE_PY_BLOCK if isinstance(row, Metric)}
#: printed with ``"{:<40} {:<10}"`` (counts); every other value line is ``"{:<40} {:<10.2f}"`` (Kairos: the
#: same, without the trailing padding)
VLLM_INT_LABELS = {"Successful requests:", "Failed requests:", "Maximum request concurrency:", "Total input tokens:",
                   "Total generated tokens:", "Probe requests completed:", "Probe requests failed:"}


def vllm_labels(*, max_concurrency: bool, finite_rate: bool, goodput: bool, metrics: tuple[str, ...],
                percentiles: tuple[float, ...]) -> list[str]:
    """The labels vLLM prints for a generation run with a tokenizer under these options."""
    on = {"tokenizer", *(["max_concurrency"] if max_concurrency else []), *(["finite_rate"] if finite_rate else []),
          *(["goodput"] if goodput else [])}
    out = []
    for row, cond in SERVE_PY_BLOCK:
        if cond is not None and not all(c in on for c in cond.split("+")):
            continue
        if not isinstance(row, Metric):
            out.append(row)
            continue
        if row.stem not in metrics:
            continue
        out += [row.header, f"Mean {row.name} (ms):", f"Median {row.name} (ms):"]
        out += [f"P{str(int(p)) if int(p) == p else str(p)} {row.name} (ms):" for p in percentiles]
    return out


def vllm_peaks(outputs: list[dict]) -> tuple[float, int]:
    """serve.py ``calculate_metrics``, lines 688-726, on ``{start_time, ttft, itl, latency}`` (s)."""
    min_start_time = min(o["start_time"] for o in outputs)
    max_end_time = max(o["start_time"] + o["latency"] for o in outputs)
    duration_seconds = int(np.ceil(max_end_time - min_start_time)) + 1
    tokens_per_second = np.zeros(duration_seconds)
    concurrent_requests_per_second = np.zeros(duration_seconds)
    for o in outputs:
        token_times = [o["start_time"] + o["ttft"]]
        current_time = token_times[0]
        for itl_value in o["itl"]:
            current_time += itl_value
            token_times.append(current_time)
        for token_time in token_times:
            second_bucket = int(token_time - min_start_time)
            if 0 <= second_bucket < duration_seconds:
                tokens_per_second[second_bucket] += 1
        request_start_second = int(o["start_time"] - min_start_time)
        request_end_second = int((o["start_time"] + o["latency"]) - min_start_time)
        for second in range(request_start_second, request_end_second + 1):
            concurrent_requests_per_second[second] += 1
    return float(np.max(tokens_per_second)), int(np.max(concurrent_requests_per_second))


def _records(seed: int, n: int = 40) -> list[RequestRecord]:
    """Requests of 1-6 content events (some of several tokens), sent over ~6 s, lasting up to ~3 s."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        sent = float(rng.uniform(0, 6))
        events = np.cumsum(rng.uniform(0.05, 0.8, int(rng.integers(1, 7)))) + sent
        per = rng.integers(1, 3, len(events))
        out.append(RequestRecord(id=f"r{i}", arrival_s=sent, prompt_tokens=int(rng.integers(5, 50)),
                                 output_tokens=int(per.sum()), ttft_ms=(events[0] - sent) * 1000.0,
                                 token_times_s=[float(t) for t, k in zip(events, per) for _ in range(k)]))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_peak_figures_are_vllms(seed):
    recs = _records(seed)
    failed = RequestRecord(id="x", arrival_s=0.0, prompt_tokens=3, output_tokens=0, error="HTTP 500")
    outputs = []
    for r in recs:
        ev = sorted(set(r.token_times_s))
        outputs.append({"start_time": r.arrival_s, "ttft": ev[0] - r.arrival_s, "itl": list(np.diff(ev)),
                        "latency": ev[-1] - r.arrival_s})
    tok, conc = vllm_peaks(outputs)
    got = peak_figures([*recs, failed])  # a failed request counts in neither (vLLM: successful outputs only)
    assert got["max_output_tokens_per_s"] == tok and got["max_concurrent_requests"] == conc
    assert peak_figures([failed]) == {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}


def _report(*, max_concurrency: int | None = None, rps: float | None = 2.0, metrics=("ttft", "tpot", "itl"),
            percentiles=(99.0,), goodput: dict | None = None, records: list[RequestRecord] | None = None) -> dict:
    recs = records if records is not None else _records(1, 12)
    reqs = [WorkloadRequest(id=r.id, arrival_s=r.arrival_s, prompt_tokens=r.prompt_tokens, output_tokens=8)
            for r in recs]
    outcomes = [Outcome(i, q, r.arrival_s, StreamState(), r.error, f"cmpl-{i}", queued_s=r.arrival_s - 0.01 * i)
                for i, (q, r) in enumerate(zip(reqs, recs))]
    sends = [r.arrival_s for r in recs]
    res = BenchResult(records=recs, outcomes=outcomes, model="m", sent=len(recs),
                      duration_s=max(t for r in recs for t in r.token_times_s) + 0.01,
                      send_span_s=max(sends) - min(sends), deflections=None, deflections_source=None)
    return build_report(res, url="http://x", workload={"rps": rps, "offered_rps": 1.9 if rps else None},
                        max_concurrency=max_concurrency, goodput_slo_ms=goodput, percentile_metrics=metrics,
                        metric_percentiles=percentiles)


@pytest.mark.parametrize("case", [
    {},  # kairos bench's defaults: goodput from the SLOs, vLLM's default metrics and percentile
    {"max_concurrency": 4, "metrics": tuple(VLLM_METRICS), "percentiles": (50.0, 99.0, 99.9)},
    {"max_concurrency": 2, "rps": None, "metrics": ("e2el", "client_queue_time", "e2el_including_client_queue")},
])
def test_the_block_has_vllms_labels_in_vllms_order(case):
    report = _report(**case)
    text = format_report(report)
    want = vllm_labels(max_concurrency=case.get("max_concurrency") is not None,
                       finite_rate=case.get("rps", 2.0) is not None, goodput=True,
                       metrics=case.get("metrics", ("ttft", "tpot", "itl")), percentiles=case.get("percentiles", (99.0,)))
    assert block_labels(text) == want


def test_numbers_are_formatted_as_vllm_formats_them():
    report = _report(max_concurrency=3)
    block = result_block(report["serving"], request_rate=2.0, max_concurrency=3)
    lines = block.splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=") and lines[-1] == "=" * 50
    m = report["serving"]
    values = {"Successful requests:": m["completed"], "Failed requests:": m["failed"],
              "Maximum request concurrency:": 3, "Request rate configured (RPS):": 2.0,
              "Total input tokens:": m["total_input_tokens"], "Total generated tokens:": m["total_output_tokens"],
              "Peak concurrent requests:": m["max_concurrent_requests"],
              "Peak output token throughput (tok/s):": m["max_output_tokens_per_s"],
              "Median TTFT (ms):": m["median_ttft_ms"]}
    for label, v in values.items():
        want = ("{:<40} {:<10}" if label in VLLM_INT_LABELS else "{:<40} {:<10.2f}").format(label, v).rstrip()
        assert want in lines, (label, [x for x in lines if x.startswith(label)])
    header = next(x for x in lines if "Time per Output Token" in x)
    assert header == "{s:{c}^{n}}".format(s="Time per Output Token (excl. 1st token)", n=50, c="-")


def test_request_rate_configured_is_the_workloads_rate_else_its_offered_one():
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 2.0).rstrip() in format_report(_report(rps=2.0))
    r = _report(rps=None)
    assert r["request_rate"] is None and "Request rate configured" not in format_report(r)


def test_a_saved_report_of_the_previous_format_still_renders():
    """docs/cli.md renders bench/results/bench-example.jsonl, written before the peak figures existed."""
    report = _report()
    for key in ("request_rate", "first_send_s", "send_window_s", "drain_s", "last_to_finish", "percentile_metrics",
                "metric_percentiles"):
        report.pop(key)
    for key in ("max_output_tokens_per_s", "max_concurrent_requests"):
        report["serving"].pop(key)
    text = format_report(report)
    assert "{:<40} {:<10}".format("Peak concurrent requests:", "-").rstrip() in text
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 2.0).rstrip() in text  # the workload's rps
    note = rates_note(report)
    assert note.startswith("How to read the rates") and "drain" not in note and "because of" not in note
