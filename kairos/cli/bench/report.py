"""``kairos bench``'s results: the JSON report of a run and the text block it prints.

Inputs: a :class:`~kairos.cli.bench.client.BenchResult` (records, outcomes, durations in s,
deflections), the run's options and SLOs (ms). Outputs: the report dict of :func:`build_report`
(:func:`kairos.core.workload.serving_metrics.summarize`'s keys, the same code the simulator uses,
plus ``vllm bench serve``'s serving metrics, offered vs achieved rate, errors, optionally the
records), written as ``--json``; and :func:`format_report`, what ``kairos bench`` prints on stdout
(also used by the doc generator to render a saved report).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kairos.cli.bench.client import DEFAULT_REQUEST_TIMEOUT_S, BenchResult
from kairos.core.policy.registry import DEFAULT_PARAMS
from kairos.core.workload.serving_metrics import format_serving, format_table, serving_metrics, summarize


def build_report(result: BenchResult, *, url: str, workload: dict[str, Any], label: str = "live",
                 tbt_slo_ms: float = DEFAULT_PARAMS.tbt_slo_ms, ttft_slo_ms: float = DEFAULT_PARAMS.ttft_slo_ms,
                 max_concurrency: int | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, goodput_slo_ms: dict[str, float] | None = None,
                 save_records: bool = False) -> dict[str, Any]:
    """The JSON report: :func:`kairos.core.workload.serving_metrics.summarize`'s keys (ms; throughput over the bench's
    wall ``duration_s``) with ``deflections`` replaced by the measured count (None = unknown),
    plus ``label``, ``url``, ``model``, ``workload``, ``sent``, ``duration_s`` (s),
    ``deflections_source``, ``max_concurrency``, ``request_timeout_s``, ``tbt_slo_ms``,
    ``ttft_slo_ms``, ``errors`` ({message: count}), ``serving`` (:func:`kairos.core.workload.serving_metrics.serving_metrics`,
    ``vllm bench serve``'s keys; goodput under ``goodput_slo_ms``, default TTFT ≤ ``ttft_slo_ms``
    and TPOT ≤ ``tbt_slo_ms``), ``offered_rps`` (the workload's rate), ``achieved_rps`` (requests
    actually sent per second: (sent − 1) / first-to-last send span), ``usage_reported`` (responses
    that carried ``usage``) and, if ``save_records``, ``records``."""
    summary = summarize(result.records, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms,
                        duration_s=result.duration_s)
    summary["deflections"] = result.deflections
    errors = Counter(r.error for r in result.records if r.error is not None)
    slos = goodput_slo_ms if goodput_slo_ms is not None else {"ttft": ttft_slo_ms, "tpot": tbt_slo_ms}
    report: dict[str, Any] = {
        "label": label, "url": url, "model": result.model, "workload": workload,
        "sent": result.sent, "duration_s": round(result.duration_s, 6), **summary,
        "serving": serving_metrics(result.records, duration_s=result.duration_s, goodput_slo_ms=slos),
        "goodput_slo_ms": slos, "offered_rps": workload.get("offered_rps"),
        "achieved_rps": round((result.sent - 1) / result.send_span_s, 3) if result.send_span_s > 0 else None,
        "usage_reported": sum(o.state.usage_completion_tokens is not None for o in result.outcomes),
        "deflections_source": result.deflections_source,
        "max_concurrency": max_concurrency, "request_timeout_s": request_timeout_s,
        "tbt_slo_ms": tbt_slo_ms, "ttft_slo_ms": ttft_slo_ms,
        "errors": dict(errors.most_common()),
    }
    if save_records:
        report["records"] = [{**msgspec.to_builtins(r), "server_id": o.server_id,
                              "scheduled_s": o.req.arrival_s}
                             for r, o in zip(result.records, result.outcomes)]
    return report


def format_report(report: dict[str, Any]) -> str:
    """What ``kairos bench`` prints on stdout for a :func:`build_report` report: ``vllm bench serve``'s
    result block (:func:`kairos.core.workload.serving_metrics.format_serving`), then the paper's metrics
    (:func:`kairos.core.workload.serving_metrics.format_table`) in one row labelled ``report["label"]``. Also renders a
    saved ``--json`` report (``tools.docgen.docgen``)."""
    serving = format_serving(report["serving"], extra=[
        ("Maximum request concurrency:", report.get("max_concurrency")),
        ("Request rate offered (req/s):", report["offered_rps"]),
        ("Request send rate achieved (req/s):", report["achieved_rps"])])
    table = format_table([{**report, "policy": report["label"], "rps": report["achieved_rps"]}], name_column="run")
    return f"{serving}\n{table}"
