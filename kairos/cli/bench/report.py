"""``kairos bench``'s results: the JSON report of a run and the text it prints.

Inputs: a :class:`~kairos.cli.bench.client.BenchResult` (records, outcomes, durations in s,
deflections), the run's options and SLOs (ms). Outputs: the report dict of :func:`build_report`
(:func:`kairos.core.workload.serving_metrics.summarize`'s keys, the same code the simulator uses,
plus ``vllm bench serve``'s serving metrics, offered vs achieved rate, errors, optionally the
records), written as ``--json``; and :func:`format_report`, what ``kairos bench`` prints on stdout
(also used by the doc generator to render a saved report): ``vllm bench serve``'s result block
(:mod:`kairos.cli.bench.vllm_block`, the same labels in the same order), then how to read the rates
(:func:`rates_note`), then the paper's metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from kairos.cli.bench.client import DEFAULT_REQUEST_TIMEOUT_S, BenchResult
from kairos.cli.bench.vllm_block import (DEFAULT_METRIC_PERCENTILES, DEFAULT_PERCENTILE_METRICS, peak_figures,
                                         queue_figures, result_block)
from kairos.core.policy.registry import DEFAULT_PARAMS
from kairos.core.workload.serving_metrics import format_table, serving_metrics, summarize

ERROR_GROUPS_SHOWN = 5  #: failure groups printed under the summary (the rest are counted in one line)


def build_report(result: BenchResult, *, url: str, workload: dict[str, Any], label: str = "live",
                 tbt_slo_ms: float = DEFAULT_PARAMS.tbt_slo_ms, ttft_slo_ms: float = DEFAULT_PARAMS.ttft_slo_ms,
                 max_concurrency: int | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, goodput_slo_ms: dict[str, float] | None = None,
                 save_records: bool = False, percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                 metric_percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES) -> dict[str, Any]:
    """The JSON report: :func:`kairos.core.workload.serving_metrics.summarize`'s keys (ms; throughput over the bench's
    wall ``duration_s``) with ``deflections`` replaced by the measured count (None = unknown),
    plus ``label``, ``url``, ``model``, ``workload``, ``sent``, ``duration_s`` (s),
    ``deflections_source``, ``max_concurrency``, ``request_timeout_s``, ``tbt_slo_ms``,
    ``ttft_slo_ms``, ``errors`` ({message: count}), ``error_groups`` (:func:`error_groups`), ``serving`` (:func:`kairos.core.workload.serving_metrics.serving_metrics`,
    ``vllm bench serve``'s keys, with its ``max_output_tokens_per_s`` and ``max_concurrent_requests``
    (:func:`kairos.cli.bench.vllm_block.peak_figures`) and, under ``max_concurrency``, its
    client-queue figures; goodput under ``goodput_slo_ms``, default TTFT ≤ ``ttft_slo_ms``
    and TPOT ≤ ``tbt_slo_ms``), ``request_rate`` (what vLLM prints as the configured rate: the
    workload's ``rps``, else its offered rate), ``offered_rps`` (the workload's arrivals: (n − 1) ÷
    their span), ``achieved_rps`` (requests
    actually sent per second: (sent − 1) / first-to-last send span), ``first_send_s`` (the run's
    start to the first send, s: the workload's first arrival), ``send_window_s`` (first to
    last send, s), ``drain_s`` (last send to the end of the run, s: the requests still streaming),
    ``last_to_finish`` (the request whose last token came last: ``index``, ``output_tokens``,
    ``e2el_s``; None without a completed request), ``percentile_metrics``, ``metric_percentiles``,
    ``usage_reported`` (responses that carried ``usage``), ``interrupted`` (None, or for a run stopped
    by a signal: ``signal``, ``sent`` and ``requests`` (the workload's), ``cancelled_in_flight`` (sent,
    cancelled, in no figure), ``after_s``) and, if ``save_records``, ``records``."""
    summary = summarize(result.records, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms,
                        duration_s=result.duration_s)
    summary["deflections"] = result.deflections
    errors = Counter(r.error for r in result.records if r.error is not None)
    slos = goodput_slo_ms if goodput_slo_ms is not None else {"ttft": ttft_slo_ms, "tpot": tbt_slo_ms}
    rate = workload.get("rps") if workload.get("rps") is not None else workload.get("offered_rps")
    serving = {**serving_metrics(result.records, duration_s=result.duration_s, goodput_slo_ms=slos,
                                 percentiles=tuple(metric_percentiles)),
               **peak_figures(result.records)}
    if max_concurrency is not None:
        serving.update(queue_figures(result.records, [o.queued_s if o.queued_s is not None else o.sent_s
                                                      for o in result.outcomes],
                                     request_rate=rate, percentiles=tuple(metric_percentiles)))
    sends = [o.sent_s for o in result.outcomes]
    done = [(i, r) for i, r in enumerate(result.records) if not r.failed and r.token_times_s]
    last = max(done, key=lambda ir: ir[1].token_times_s[-1], default=None)
    report: dict[str, Any] = {
        "label": label, "url": url, "model": result.model, "workload": workload,
        "sent": result.sent, "duration_s": round(result.duration_s, 6), **summary,
        "serving": serving, "goodput_slo_ms": slos, "request_rate": rate, "offered_rps": workload.get("offered_rps"),
        "achieved_rps": round((result.sent - 1) / result.send_span_s, 3) if result.send_span_s > 0 else None,
        "first_send_s": round(min(sends), 6) if sends else None,
        "send_window_s": round(result.send_span_s, 6),
        "drain_s": round(result.duration_s - max(sends), 6) if sends else None,
        "last_to_finish": None if last is None else {
            "index": result.outcomes[last[0]].index, "output_tokens": last[1].output_tokens,
            "e2el_s": round(last[1].token_times_s[-1] - last[1].arrival_s, 6)},
        "percentile_metrics": list(percentile_metrics), "metric_percentiles": list(metric_percentiles),
        "usage_reported": sum(o.state.usage_completion_tokens is not None for o in result.outcomes),
        "deflections_source": result.deflections_source,
        "max_concurrency": max_concurrency, "request_timeout_s": request_timeout_s,
        "tbt_slo_ms": tbt_slo_ms, "ttft_slo_ms": ttft_slo_ms,
        "errors": dict(errors.most_common()),
        "error_groups": error_groups(result),
        "interrupted": None if result.interrupted is None else {
            "signal": result.interrupted, "sent": result.sent, "requests": result.requests,
            "cancelled_in_flight": result.cancelled, "after_s": round(result.duration_s, 6)},
    }
    if save_records:
        report["records"] = [{**msgspec.to_builtins(r), "server_id": o.server_id,
                              "scheduled_s": o.req.arrival_s}
                             for r, o in zip(result.records, result.outcomes)]
    return report


def error_groups(result: BenchResult) -> list[dict[str, Any]]:
    """The failures grouped by cause, largest first (ties by code): ``[{"code", "count", "example"}]``.

    A message often embeds the request id (``the ingress serving request cmpl-… is shutting down``),
    so identical causes never share a message; the group is the
    :attr:`~kairos.cli.bench.client.Outcome.error_code` instead (the server's error ``code`` /
    ``type``, ``HTTP <status>``, the client-side exception class, ``incomplete_stream``), or
    ``no_output_tokens`` for a stream that ended cleanly without a token. ``example`` is the first
    failure's message of the group. The counts add up to the failed requests."""
    groups: dict[str, dict[str, Any]] = {}
    for rec, out in zip(result.records, result.outcomes):
        if rec.error is None:
            continue
        code = out.error_code or (rec.error if out.error is not None else "no_output_tokens")
        g = groups.setdefault(code, {"code": code, "count": 0, "example": rec.error})
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: (-g["count"], g["code"]))


def failure_lines(report: dict[str, Any], shown: int = ERROR_GROUPS_SHOWN, width: int = 200) -> list[str]:
    """What ``kairos bench`` prints under its summary about the failures: one line per group of
    :func:`error_groups` (``N x code: example``, the example cut at ``width`` characters), at most
    ``shown``, then how many failures (of how many other groups) those lines leave out, so that the
    counts printed add up to ``report["failed"]``. A saved report without ``error_groups`` groups its
    ``errors`` by message."""
    groups = report.get("error_groups")
    if groups is None:
        groups = [{"code": msg, "count": n, "example": None} for msg, n in (report.get("errors") or {}).items()]
    lines = []
    for g in groups[:shown]:
        ex = g.get("example")
        if ex and ex != g["code"]:
            ex = ex.removeprefix(f"{g['code']}: ")  # HTTP 502: …, ClientPayloadError: …
            ex = ex if len(ex) <= width else ex[:width - 1] + "…"
            lines.append(f"  {g['count']} x {g['code']}: {ex}")
        else:
            lines.append(f"  {g['count']} x {g['code']}")
    rest = groups[shown:]
    if rest:
        n = sum(g["count"] for g in rest)
        lines.append(f"  … and {n} more failure{'s' if n != 1 else ''} of {len(rest)} other kind"
                     f"{'s' if len(rest) != 1 else ''} (all in --json's error_groups)")
    return lines


def _num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def rates_note(report: dict[str, Any]) -> str:
    """How to read the block's rates, for someone new to it (printed after the block; a saved report
    without this version's fields prints what it has). Says: the rate the workload offered and the
    rate the requests were actually sent at, over which window; what the benchmark duration is made
    of (the wait for the first arrival, the sending, the drain: requests still streaming after the
    last send, naming the one that finished last and its output tokens); and that ``Request
    throughput (req/s)`` is completed ÷ that whole duration, so it reads below the offered rate when
    the run waited for a late first arrival or for long requests to drain (or requests failed).
    Lines wrap at 100 columns; a number and its unit stay on one line."""
    import textwrap

    nb = "\u00a0"  # joins a number and its unit while wrapping
    paras = []
    offered, achieved, sent = report.get("offered_rps"), report.get("achieved_rps"), report.get("sent", 0)
    window = report.get("send_window_s")
    offer = (f"the workload offered {offered:.2f}{nb}req/s (its arrival times)" if offered is not None
             else "the workload has no rate (one request)")
    sent_at = (f"{sent} requests sent over {_num(window)}{nb}s at {achieved:.2f}{nb}req/s"
               if window is not None and achieved is not None else f"{sent} requests sent")
    paras.append(f"Offered vs sent: {offer}; {sent_at}.")
    if (report.get("max_concurrency") is not None and offered and achieved is not None
            and achieved < 0.95 * offered):
        paras[-1] += f" --max-concurrency {report['max_concurrency']} held requests back: they were sent late."
    m = report.get("serving") or {}
    duration = m.get("duration", report.get("duration_s"))
    lead, drain, last = report.get("first_send_s"), report.get("drain_s"), report.get("last_to_finish")
    if None not in (lead, window, drain, duration):
        text = (f"Benchmark duration {_num(duration, 2)}{nb}s = {_num(lead)}{nb}s to the first arrival + "
                f"{_num(window)}{nb}s of sending + {_num(drain)}{nb}s of drain (the requests still streaming "
                f"after the last send")
        if last is not None:
            text += (f"; the last to finish, request #{last['index']}, streamed {last['output_tokens']:,} output "
                     f"tokens in {_num(last['e2el_s'])}{nb}s")
        paras.append(text + ").")
    if m.get("request_throughput") is not None and duration:
        text = (f"Request throughput (req/s) = {m['completed']} completed ÷ {_num(duration, 2)}{nb}s = "
                f"{m['request_throughput']:.2f}, over the whole duration")
        if offered and m["request_throughput"] < 0.95 * offered:
            causes = [c for c, on in ((f"{m['failed']} failed", bool(m.get("failed"))),
                                      ("the wait for the first arrival", lead is not None and lead > 0.05 * duration),
                                      ("the drain", drain is not None and drain > 0.05 * duration)) if on]
            text += ": below the offered rate" + (f" because of {_and(causes)}" if causes else "")
        paras.append(text + ".")
    lines = ["How to read the rates (kairos bench):"]
    for para in paras:
        lines += [line.replace(nb, " ")
                  for line in textwrap.wrap(para, width=100, initial_indent="  ", subsequent_indent="    ")]
    return "\n".join(lines) + "\n"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def format_report(report: dict[str, Any]) -> str:
    """What ``kairos bench`` prints on stdout for a :func:`build_report` report: ``vllm bench serve``'s
    result block (:func:`kairos.cli.bench.vllm_block.result_block`: its labels, order and number
    formats), :func:`rates_note`, then the paper's metrics
    (:func:`kairos.core.workload.serving_metrics.format_table`) in one row labelled ``report["label"]``; an
    interrupted run's output starts with :func:`interrupted_note`. Also renders a
    saved ``--json`` report (``tools.docgen.docgen``)."""
    rate = report.get("request_rate")
    if rate is None and "request_rate" not in report:  # a report saved before the field: the workload's rps
        rate = (report.get("workload") or {}).get("rps")
    block = result_block(report["serving"], request_rate=rate, max_concurrency=report.get("max_concurrency"),
                         percentile_metrics=report.get("percentile_metrics") or DEFAULT_PERCENTILE_METRICS,
                         percentiles=report.get("metric_percentiles") or DEFAULT_METRIC_PERCENTILES)
    table = format_table([{**report, "policy": report["label"], "rps": report["achieved_rps"]}], name_column="run")
    head = f"{note}\n\n" if (note := interrupted_note(report)) else ""
    return f"{head}{block}\n{rates_note(report)}\n{table}"


def interrupted_note(report: dict[str, Any]) -> str | None:
    """The line that marks an interrupted run's results (None for a run that ran out): which signal,
    after how long, how many of the workload's requests had been sent, and that the figures cover
    only those that finished (the cancelled ones in flight are in no figure)."""
    info = report.get("interrupted")
    if not info:
        return None
    of = f" of {info['requests']:,}" if info.get("requests") is not None else ""
    n = info.get("cancelled_in_flight", 0)
    return (f"INTERRUPTED ({info['signal']}) after {info['after_s']:,.1f} s: {info['sent']:,}{of} requests were sent; "
            f"the figures below cover the {info['sent'] - n:,} that finished; "
            + (f"the {n:,} still in flight {'was' if n == 1 else 'were'} cancelled and {'is' if n == 1 else 'are'} "
               f"in no figure." if n else "none was in flight."))
