"""``vllm bench serve``'s result block, line for line: the figures vLLM adds to the serving metrics and the text.

Source: vLLM 0.32 ``vllm/benchmarks/serve.py`` — ``calculate_metrics`` (peak output throughput and
peak concurrency), ``benchmark`` (the printed block: ``"{:<40} {:<10}"`` for counts,
``"{:<40} {:<10.2f}"`` for the rest, section headers centred in 50 columns, the header line in ``=``,
the metric sections in ``-``) and ``process_one_metric`` (Mean, Median, then ``P<p>`` per
``--metric-percentiles``, for each metric of ``--percentile-metrics``, default ``ttft,tpot,itl``).

Inputs: :class:`~kairos.core.workload.serving_metrics.RequestRecord` (times in s on the bench's
clock, latencies in ms), the scheduled-vs-sent times of each request (s) for the client-queue
metrics, and the dict of :func:`kairos.core.workload.serving_metrics.serving_metrics`. Outputs:
the extra figures (dicts, ms or per second) and the block's text. Pure: no I/O.

Where Kairos's client differs from vLLM's (documented in :mod:`kairos.cli.bench`): a content event
is one that carried generated tokens, so the Kairos ingress's finish-only event is no token and no
ITL; a figure without data prints ``-`` where vLLM prints ``0.00``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kairos.core.workload.serving_metrics import RequestRecord

#: ``--percentile-metrics`` stems in vLLM's print order → (name in the labels, section header)
PERCENTILE_METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}
DEFAULT_PERCENTILE_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl")  #: vLLM's default for generation
DEFAULT_METRIC_PERCENTILES: tuple[float, ...] = (99.0,)  #: vLLM's ``--metric-percentiles`` default
TITLE = " Serving Benchmark Result "


def parse_percentile_metrics(spec: str) -> tuple[str, ...]:
    """``--percentile-metrics`` (comma-separated stems of :data:`PERCENTILE_METRICS`).

    Raises:
        ValueError: an empty list or an unknown stem (the message lists the known ones).
    """
    stems = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [s for s in stems if s not in PERCENTILE_METRICS]
    if not stems or bad:
        raise ValueError(f"--percentile-metrics {spec!r}: expected a comma-separated subset of "
                         f"{','.join(PERCENTILE_METRICS)}")
    return stems


def parse_metric_percentiles(spec: str) -> tuple[float, ...]:
    """``--metric-percentiles`` (comma-separated numbers in (0, 100]).

    Raises:
        ValueError: an empty list, a non-number or a value outside (0, 100].
    """
    try:
        ps = tuple(float(s) for s in spec.split(",") if s.strip())
    except ValueError:
        ps = ()
    if not ps or not all(0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {spec!r}: expected comma-separated percentiles in (0, 100], e.g. 50,99")
    return ps


def p_word(p: float) -> str:
    """vLLM's name of a percentile in labels and keys: ``99`` for 99.0, ``99.9`` for 99.9."""
    return str(int(p)) if int(p) == p else str(p)


def event_times(record: RequestRecord) -> np.ndarray:
    """The arrival time (s) of each content event of a request: the distinct ``token_times_s``
    (the tokens of one event share its time; :class:`~kairos.cli.bench.stream.StreamState` keeps
    events strictly increasing)."""
    return np.unique(np.asarray(record.token_times_s, dtype=float))


def peak_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """``max_output_tokens_per_s`` and ``max_concurrent_requests`` as vLLM's ``calculate_metrics``
    computes them, over the completed requests: one-second buckets from the earliest send, each
    content event counted as one token in the bucket of its arrival (vLLM rebuilds the arrivals as
    send + TTFT + cumulative ITLs, one per event), and a request counted as running in every bucket
    from its send's to its last event's, both included. 0.0 and 0 without a completed request."""
    done = [r for r in records if not r.failed and r.token_times_s]
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.arrival_s for r in done)
    end = max(r.token_times_s[-1] for r in done)
    n = int(np.ceil(end - t0)) + 1
    tokens = np.zeros(n)
    running = np.zeros(n)
    for r in done:
        b = (event_times(r) - t0).astype(int)
        np.add.at(tokens, b[(b >= 0) & (b < n)], 1)
        running[int(r.arrival_s - t0):int(r.token_times_s[-1] - t0) + 1] += 1
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(running.max())}


def _stats(values_ms: Sequence[float], stem: str, percentiles: Sequence[float]) -> dict[str, float | None]:
    v = np.asarray(values_ms, dtype=float)
    out: dict[str, float | None] = {f"mean_{stem}_ms": float(v.mean()) if v.size else None,
                                    f"median_{stem}_ms": float(np.median(v)) if v.size else None,
                                    f"std_{stem}_ms": float(v.std()) if v.size else None}
    for p in percentiles:
        out[f"p{p_word(p)}_{stem}_ms"] = float(np.percentile(v, p)) if v.size else None
    return out


def queue_figures(records: Sequence[RequestRecord], queued_s: Sequence[float], *, request_rate: float | None,
                  percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES) -> dict[str, float | None]:
    """vLLM's client-side queueing figures (ms) under ``--max-concurrency``: ``client_queue_time``
    = send − the moment the request was due and waiting for a slot, and, for a finite
    ``request_rate``, ``e2el_including_client_queue`` = e2el + that queue time, over the completed
    requests. ``queued_s[i]`` is when ``records[i]`` started waiting (s, the records' clock)."""
    pairs = [(r, q) for r, q in zip(records, queued_s) if not r.failed and r.token_times_s]
    out = _stats([(r.arrival_s - q) * 1000.0 for r, q in pairs], "client_queue_time", percentiles)
    if request_rate is not None and math.isfinite(request_rate):
        out.update(_stats([(r.token_times_s[-1] - q) * 1000.0 for r, q in pairs], "e2el_including_client_queue",
                          percentiles))
    return out


def _line(label: str, value: Any, spec: str) -> str:
    """One ``"{:<40} {:<10}"`` line (``spec`` ``""`` for counts, ``".2f"`` for the rest) without its
    trailing padding; None → ``-``."""
    text = "-" if value is None else format(value, spec)
    return f"{label:<40} {text:<10}".rstrip()


def result_block(m: dict[str, Any], *, request_rate: float | None, max_concurrency: int | None,
                 percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                 percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES) -> str:
    """The block ``vllm bench serve`` prints, for the serving metrics ``m`` (:func:`serving_metrics`'s
    keys plus :func:`peak_figures`' and, if measured, :func:`queue_figures`').

    Conditional lines as in vLLM: ``Maximum request concurrency`` when ``max_concurrency`` is set,
    ``Request rate configured (RPS)`` when ``request_rate`` is finite (not None), ``Request goodput``
    when goodput was measured (``m["request_goodput"]`` not None), the client-queue sections only
    when their figures are in ``m`` (vLLM: under ``--max-concurrency``). The token lines are always
    there (vLLM prints them when it has a tokenizer; Kairos counts the server's usage). Returns the
    text with a final newline; each line is vLLM's without its trailing spaces (``"{:<10}"`` pads
    the value: invisible on a terminal, noise in a file).
    """
    rows = ["{s:{c}^{n}}".format(s=TITLE, n=50, c="="),
            _line("Successful requests:", m["completed"], ""), _line("Failed requests:", m["failed"], "")]
    if max_concurrency is not None:
        rows.append(_line("Maximum request concurrency:", max_concurrency, ""))
    if request_rate is not None and math.isfinite(request_rate):
        rows.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    rows += [_line("Benchmark duration (s):", m["duration"], ".2f"),
             _line("Total input tokens:", m["total_input_tokens"], ""),
             _line("Total generated tokens:", m["total_output_tokens"], ""),
             _line("Request throughput (req/s):", m["request_throughput"], ".2f")]
    if m.get("request_goodput") is not None:
        rows.append(_line("Request goodput (req/s):", m["request_goodput"], ".2f"))
    rows += [_line("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
             _line("Peak output token throughput (tok/s):", m.get("max_output_tokens_per_s"), ".2f"),
             _line("Peak concurrent requests:", m.get("max_concurrent_requests"), ".2f"),
             _line("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")]
    for stem in PERCENTILE_METRICS:
        if stem not in percentile_metrics or f"mean_{stem}_ms" not in m:
            continue
        name, header = PERCENTILE_METRICS[stem]
        rows += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                 _line(f"Mean {name} (ms):", m[f"mean_{stem}_ms"], ".2f"),
                 _line(f"Median {name} (ms):", m[f"median_{stem}_ms"], ".2f")]
        rows += [_line(f"P{p_word(p)} {name} (ms):", m.get(f"p{p_word(p)}_{stem}_ms"), ".2f") for p in percentiles]
    rows.append("=" * 50)
    return "\n".join(rows) + "\n"


def block_labels(text: str) -> list[str]:
    """The labels of a printed result block, in order: its header lines (stripped of their ``=`` and
    ``-`` fill) and each line's text up to its colon. Everything before the ``Serving Benchmark
    Result`` line and after the closing ``=`` line is ignored (vLLM prints warnings, progress and a
    tip around it). Used to compare ``kairos bench`` with ``vllm bench serve``."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        s = line.strip()
        if not inside:
            inside = s.startswith("=") and TITLE.strip() in s
            if inside:
                out.append(TITLE.strip())
            continue
        if s and set(s) == {"="}:
            break
        if s.startswith("-") and s.endswith("-"):
            out.append(s.strip("-"))
        elif ":" in s:
            out.append(s[:s.index(":") + 1])
    return out


__all__ = ["DEFAULT_METRIC_PERCENTILES", "DEFAULT_PERCENTILE_METRICS", "PERCENTILE_METRICS", "block_labels",
           "event_times", "p_word", "parse_metric_percentiles", "parse_percentile_metrics", "peak_figures",
           "queue_figures", "result_block"]
