"""A workload asked for by request count, not by length: the first N requests, as ``vllm bench
serve --num-prompts N`` sends N requests (vllm/benchmarks/serve.py; ``kairos bench --num-prompts``).

Inputs: a :func:`~kairos.core.workload.workloads.parse_workload` spec, the rate (requests/s, None:
the Table 1 rate or the trace's own timing), N, the seed, ``max_model_len`` (tokens). Output: a
``list[WorkloadRequest]`` of exactly N requests on the workload's own schedule (``arrival_s`` in s).
Pure: no I/O beyond reading the trace file.

* Generated kinds (``bursty``, ``lpld``, ...): generated (:func:`~kairos.core.workload.workloads.generate`)
  over a span long enough to hold N arrivals, then cut to the first N. The arrivals are the first N
  of the seed's arrival process whatever the span (numpy draws the gaps one after another, so a
  longer span only appends to them); the lengths depend on the seed, the rate and N.
* Traces: the whole trace (rescaled to the rate if one is given), then its first N requests, or with
  ``:busiest`` the N consecutive arrivals spanning the least time (earliest on ties), re-based to 0.
  A trace holding fewer than N requests is an error naming both numbers (vLLM would oversample; a
  replayed trace has no more requests to give).
"""

from __future__ import annotations

import math

import numpy as np

from kairos.core.workload.workloads import (KINDS, DEFAULT_GAMMA_SHAPE, DEFAULT_MAX_MODEL_LEN, MAX_WORKLOAD_S,
                                            TABLE1_RPS, WorkloadError, WorkloadRequest, WorkloadSizeError,
                                            check_workload_size, parse_workload, window)


def first_requests(spec: str, rps: float | None, num_requests: int, seed: int,
                   max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> list[WorkloadRequest]:
    """The first ``num_requests`` requests of the workload ``spec`` at ``rps`` (requests/s; None: the
    Table 1 rate of a generated kind, a trace's own timing).

    Raises:
        WorkloadSizeError: (param ``num_requests``) N out of :func:`check_workload_size`'s bounds, N
            generated requests whose expected span N ÷ rate exceeds :data:`MAX_WORKLOAD_S`, or a
            trace holding fewer than N requests (the message names both numbers).
        WorkloadError: any error of :func:`parse_workload` (unknown spec, bad trace...).
    """
    check_workload_size(None, [rps], num_requests)
    key = spec.strip().lower()
    busiest = key.endswith(":busiest")
    base = spec.strip()[: -len(":busiest")] if busiest else spec.strip()
    if base.lower() in KINDS:
        if busiest:
            raise WorkloadError(f"':busiest' applies to traces, not to {base!r}")
        return _generated(base.lower(), TABLE1_RPS[base.lower()] if rps is None else rps, num_requests, seed,
                          max_model_len)
    requests = parse_workload(base, rps, None, seed, max_model_len=max_model_len)
    if len(requests) < num_requests:
        raise WorkloadSizeError("num_requests", f"{num_requests} requests asked for, but the workload {spec!r} "
                                                f"holds only {len(requests)}")
    if not busiest:
        return requests[:num_requests]
    t = np.fromiter((r.arrival_s for r in requests), float, len(requests))
    start = int(np.argmin(t[num_requests - 1:] - t[: t.size - num_requests + 1]))
    return window(requests[start: start + num_requests], float(t[start]), math.inf)


def _generated(kind: str, rps: float, n: int, seed: int, max_model_len: int) -> list[WorkloadRequest]:
    """The first ``n`` requests of :func:`parse_workload`'s ``kind`` at ``rps``: generated over the
    expected span of n arrivals plus six standard deviations of it (gap CV 1/√k for Bursty's Gamma
    gaps, 1 for Poisson), doubled until it holds n (in practice never)."""
    mean_s = n / rps
    if mean_s > MAX_WORKLOAD_S:
        raise WorkloadSizeError("num_requests", f"{n} requests at {rps:g} requests/s take about {mean_s:g} s, "
                                                f"over the {MAX_WORKLOAD_S:g} s a workload may last")
    cv = 1 / math.sqrt(DEFAULT_GAMMA_SHAPE) if kind == "bursty" else 1.0
    span_s = (n + 6 * cv * math.sqrt(n) + 10 * cv) / rps
    while True:
        requests = parse_workload(kind, rps, span_s, seed, max_model_len=max_model_len)
        if len(requests) >= n:
            return requests[:n]
        span_s *= 2
