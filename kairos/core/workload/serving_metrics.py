"""Request-level serving metrics: TTFT, TBT, SLO attainment, throughput (paper §3.1, §3.4, §6).

Where records come from: the simulator and the live ``kairos bench`` client each emit one
:class:`RequestRecord` per request. Where summaries go: reports and the CLI table
(:func:`format_table`), compared with the paper's Table 3 (P95 TTFT breakdown) and Table 4
(P95 TTFT, TBT violation rate, SLO attainment, deflections). No I/O.

Units: times *of day* are seconds (``arrival_s``, ``token_times_s``, on one clock per run);
latencies are milliseconds (``*_ms``). Percentiles are ``numpy.percentile(method="linear")``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from kairos.core.policy import DEFAULT_PARAMS

#: TTFT components of Table 3, in the order a request meets them
BREAKDOWN_COMPONENTS: tuple[str, ...] = ("prefill_queue", "prefill_exec", "kv_transfer", "decode_queue")


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one request.

    Token timing is recorded as ``token_times_s`` (absolute times) rather than a list of
    inter-token latencies: the gaps are ``diff(token_times_s)``, TTFT can be cross-checked against
    ``token_times_s[0] - arrival_s``, and the last token time bounds the run for throughput. A
    streaming client that receives k tokens in one chunk records k equal times (gaps of 0 ms), so
    client-side TBT percentiles are those of the stream as the user sees it.
    """

    id: str  #: request id (WorkloadRequest.id)
    arrival_s: float  #: arrival time, seconds, on the same clock as token_times_s
    prompt_tokens: int  #: prompt length in tokens
    output_tokens: int  #: output tokens generated (for a completed request)
    ttft_ms: float | None = None  #: time to first token in ms; None if no token was produced
    #: absolute time in seconds of each output token, the first included, ascending
    token_times_s: list[float] = []
    deflected: bool = False  #: prefilled on a decode node (§4) instead of a prefill node
    prefill_queue_ms: float | None = None  #: wait before prefill starts; None when unknown (client side)
    prefill_exec_ms: float | None = None  #: prefill execution time; None when unknown
    kv_transfer_ms: float | None = None  #: KV-cache transfer incl. link queueing; None when unknown
    decode_queue_ms: float | None = None  #: wait for decode admission; None when unknown
    cached_tokens: int | None = None  #: prompt tokens served from the prefilling node's prefix cache
    error: str | None = None  #: failure reason; None if the request completed

    @property
    def failed(self) -> bool:
        """True if the request errored or produced no first token."""
        return self.error is not None or self.ttft_ms is None


def _pcts(values: Sequence[float] | np.ndarray, qs: Sequence[float]) -> list[float | None]:
    """Linear-interpolated percentiles as Python floats; all None for no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return [None] * len(qs)
    return [float(v) for v in np.percentile(arr, qs, method="linear")]


def _gaps_ms(record: RequestRecord) -> np.ndarray:
    return np.diff(np.asarray(record.token_times_s, dtype=float)) * 1000.0


def summarize(records: Sequence[RequestRecord], *, tbt_slo_ms: float = DEFAULT_PARAMS.tbt_slo_ms,
              ttft_slo_ms: float = DEFAULT_PARAMS.ttft_slo_ms,
              decode_step_ms: Sequence[float] | None = None,
              duration_s: float | None = None) -> dict[str, Any]:
    """Summarize a run (paper Table 3 and Table 4 metrics). Never raises on empty input.

    Args:
        records: one record per request.
        tbt_slo_ms: τ, the TBT SLO in ms (§6: 70 ms).
        ttft_slo_ms: TTFT SLO in ms (§6: 4 s).
        decode_step_ms: engine-side decode step latencies in ms, one per step of every decode
            node, if known (simulator). The violation rate is then the fraction of steps with
            latency > τ, as in Table 4 ("% of decode steps"). If None (live client), it is the
            fraction of all inter-token gaps > τ.
        duration_s: seconds over which throughput is computed; default last token time − first
            arrival.

    Returns:
        A dict with exactly these keys (ms unless stated; None = no data):
        ``requests``, ``completed``, ``failed`` (int counts; failed = error set or no TTFT);
        ``ttft_ms`` {p50, p95, p99} over every record with a TTFT (a request failing after its
        first token still measured one); ``ttft_breakdown_p95_ms`` {prefill_queue, prefill_exec,
        kv_transfer, decode_queue}: P95 over the records where that component is known, None if
        none is; ``tbt_ms`` {p50, p95} over all inter-token gaps of all records;
        ``tbt_violation_rate`` (fraction in [0, 1], see ``decode_step_ms``);
        ``tbt_gap_violation_rate``: fraction of all inter-token gaps > τ, whatever ``decode_step_ms``
        (what a client sees: engine steps plus the streaming path's jitter; None without a gap);
        ``slo_attainment``: fraction of all requests that completed with TTFT ≤ ``ttft_slo_ms``
        and whose own P95 inter-token gap ≤ τ (a single-token request has no gap and meets the
        TBT part; failed requests do not meet); ``deflections`` (count of deflected records);
        ``output_tokens_per_s`` and ``total_tokens_per_s`` (prompt + output): tokens of completed
        requests per second of ``duration_s`` (0.0 if the duration is 0 or unknown).
    """
    n = len(records)
    done = [r for r in records if not r.failed]
    ttft = _pcts([r.ttft_ms for r in records if r.ttft_ms is not None], (50, 95, 99))
    breakdown = {c: _pcts([v for r in records if (v := getattr(r, f"{c}_ms")) is not None], (95,))[0]
                 for c in BREAKDOWN_COMPONENTS}
    gaps = [_gaps_ms(r) for r in records]
    all_gaps = np.concatenate(gaps) if gaps else np.empty(0)
    tbt = _pcts(all_gaps, (50, 95))

    steps = all_gaps if decode_step_ms is None else np.asarray(decode_step_ms, dtype=float)
    violation = float(np.mean(steps > tbt_slo_ms)) if steps.size else None
    gap_violation = float(np.mean(all_gaps > tbt_slo_ms)) if all_gaps.size else None

    def meets(r: RequestRecord, g: np.ndarray) -> bool:
        tbt_ok = g.size == 0 or float(np.percentile(g, 95, method="linear")) <= tbt_slo_ms
        return not r.failed and r.ttft_ms <= ttft_slo_ms and tbt_ok

    met = sum(meets(r, g) for r, g in zip(records, gaps))

    if duration_s is None:
        last = max((r.token_times_s[-1] for r in records if r.token_times_s), default=None)
        duration_s = 0.0 if last is None else last - min(r.arrival_s for r in records)
    out_tokens = sum(r.output_tokens for r in done)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 and math.isfinite(duration_s) else (lambda x: 0.0)

    return {
        "requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "ttft_ms": dict(zip(("p50", "p95", "p99"), ttft)),
        "ttft_breakdown_p95_ms": breakdown,
        "tbt_ms": dict(zip(("p50", "p95"), tbt)),
        "tbt_violation_rate": violation,
        "tbt_gap_violation_rate": gap_violation,
        "slo_attainment": met / n if n else None,
        "deflections": sum(r.deflected for r in records),
        "output_tokens_per_s": float(per_s(out_tokens)),
        "total_tokens_per_s": float(per_s(all_tokens)),
    }


#: The metrics of ``vllm bench serve`` (vLLM ``vllm/benchmarks/serve.py``, ``calculate_metrics``),
#: in its order: (JSON key stem, printed name)
SERVE_LATENCIES: tuple[tuple[str, str], ...] = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def serving_metrics(records: Sequence[RequestRecord], *, duration_s: float,
                    goodput_slo_ms: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (99.0,)) -> dict[str, Any]:
    """The figures ``vllm bench serve`` reports, with its names and definitions
    (vLLM ``vllm/benchmarks/serve.py``, ``calculate_metrics``). Never raises on empty input.

    Definitions, over the *completed* requests (not :attr:`RequestRecord.failed`):

    * ``ttft`` = ``ttft_ms`` (first token with generated text);
    * ``e2el`` = last token arrival − ``arrival_s``, ms (vLLM: the last chunk with choices);
    * ``tpot`` = (e2el − ttft) / (output_tokens − 1), ms, for requests with > 1 output token;
    * ``itl`` = the gaps between consecutive *chunks* of every request, ms: tokens that arrived in
      one chunk share a time in ``token_times_s`` and count as one arrival, as vLLM appends one
      ITL per received chunk;
    * throughputs are per second of ``duration_s``; ``total_token_throughput`` counts prompt and
      output tokens of completed requests;
    * goodput: completed requests whose ttft, tpot (0 for a single-token request, as vLLM) and
      e2el are all ≤ the SLOs given in ``goodput_slo_ms`` (keys ``ttft``, ``tpot``, ``e2el``), per
      second; None when no SLO is given.

    Args:
        records: one per request sent.
        duration_s: benchmark duration, seconds (start → last response).
        goodput_slo_ms: SLOs in ms by metric stem, or None.
        percentiles: which percentiles to report (vLLM's ``--metric-percentiles``, default 99).

    Returns:
        ``completed``, ``failed``, ``duration`` (s), ``total_input_tokens``, ``total_output_tokens``,
        ``request_throughput``, ``request_goodput``, ``output_throughput``, ``total_token_throughput``
        (per s), and for each stem in :data:`SERVE_LATENCIES` ``mean_<stem>_ms``, ``median_<stem>_ms``,
        ``std_<stem>_ms`` and ``p<P>_<stem>_ms`` (None without data).

    Raises:
        ValueError: an unknown goodput key or a non-positive SLO.
    """
    slos = dict(goodput_slo_ms or {})
    for k, v in slos.items():
        if k not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"unknown goodput metric {k!r} (known: ttft, tpot, e2el)")
        if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise ValueError(f"goodput SLO {k} must be a positive number of ms, got {v!r}")
    done = [r for r in records if not r.failed]
    vals: dict[str, list[float]] = {stem: [] for stem, _ in SERVE_LATENCIES}
    good = 0
    for r in done:
        e2el = (r.token_times_s[-1] - r.arrival_s) * 1000.0
        tpot = (e2el - r.ttft_ms) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        vals["ttft"].append(r.ttft_ms)
        vals["e2el"].append(e2el)
        if r.output_tokens > 1:
            vals["tpot"].append(tpot)
        arrivals = np.unique(np.asarray(r.token_times_s, dtype=float))
        vals["itl"].extend((np.diff(arrivals) * 1000.0).tolist())
        got = {"ttft": r.ttft_ms, "tpot": tpot, "e2el": e2el}
        good += all(got[k] <= v for k, v in slos.items())
    in_tokens = sum(r.prompt_tokens for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 and math.isfinite(duration_s) else (lambda x: 0.0)
    out: dict[str, Any] = {
        "completed": len(done), "failed": len(records) - len(done), "duration": float(duration_s),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": float(per_s(len(done))),
        "request_goodput": float(per_s(good)) if slos else None,
        "output_throughput": float(per_s(out_tokens)),
        "total_token_throughput": float(per_s(in_tokens + out_tokens)),
    }
    for stem, _ in SERVE_LATENCIES:
        v = np.asarray(vals[stem], dtype=float)
        out[f"mean_{stem}_ms"] = float(v.mean()) if v.size else None
        out[f"median_{stem}_ms"] = float(np.median(v)) if v.size else None
        out[f"std_{stem}_ms"] = float(v.std()) if v.size else None
        for p, q in zip(percentiles, _pcts(v, percentiles)):
            out[f"p{p:g}_{stem}_ms"] = q
    return out


def _fmt(value: Any, spec: str, scale: float | None = None) -> str:
    if value is None:
        return "-"
    return format(value if scale is None else value * scale, spec)


#: (header, how to render one summary row); rows may carry extra ``policy`` and ``rps`` keys
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("policy", lambda r: str(r.get("policy", "-"))),
    ("rps", lambda r: _fmt(r.get("rps"), "g")),
    ("requests", lambda r: _fmt(r.get("requests"), "d")),
    ("TTFT p50 ms", lambda r: _fmt((r.get("ttft_ms") or {}).get("p50"), ".0f")),
    ("TTFT p95 ms", lambda r: _fmt((r.get("ttft_ms") or {}).get("p95"), ".0f")),
    ("TTFT p99 ms", lambda r: _fmt((r.get("ttft_ms") or {}).get("p99"), ".0f")),
    ("TBT p50 ms", lambda r: _fmt((r.get("tbt_ms") or {}).get("p50"), ".1f")),
    ("TBT p95 ms", lambda r: _fmt((r.get("tbt_ms") or {}).get("p95"), ".1f")),
    ("TBT viol %", lambda r: _fmt(r.get("tbt_violation_rate"), ".2f", 100.0)),
    ("SLO %", lambda r: _fmt(r.get("slo_attainment"), ".1f", 100.0)),
    ("deflections", lambda r: _fmt(r.get("deflections"), "d")),
)


def format_table(rows: list[dict[str, Any]], name_column: str = "policy") -> str:
    """Render :func:`summarize` results as a plain-text table (rich, no colour codes).

    Each row is a summary dict, optionally with ``policy`` (str) and ``rps`` (float) keys; missing
    values print as ``-``. Columns: policy (headed ``name_column``: ``kairos bench`` rows are runs,
    not policies), rps, requests, TTFT p50/p95/p99 (ms), TBT p50/p95 (ms), TBT viol %, SLO %,
    deflections.
    """
    table = Table(box=box.SIMPLE_HEAD)
    for header, _ in _COLUMNS:
        table.add_column(name_column if header == "policy" else header,
                         justify="left" if header == "policy" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(render(row) for _, render in _COLUMNS))
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
