"""``kairos bench``: replay a workload against a live OpenAI-compatible ingress and measure it.

Behaviour follows ``vllm bench serve`` (vLLM ``vllm/benchmarks/serve.py`` and
``vllm/benchmarks/lib/endpoint_request_func.py``, ``async_request_openai_completions``):

* **Open loop.** Each :class:`~kairos.core.workload.workloads.WorkloadRequest` is sent at its ``arrival_s``
  offset (seconds since the bench start, as given by the workload) without waiting for earlier
  requests, like ``vllm bench serve --request-rate``. ``max_concurrency`` (like
  ``--max-concurrency``) bounds the requests in flight; a request waiting for a slot is sent
  late, and, as in vLLM, its TTFT is measured from the moment it is actually sent.
* **Request.** ``POST {url}/v1/completions`` with ``prompt`` = a list of ``prompt_tokens`` token
  ids (exact prompt length, no tokenizer needed; drawn from ``--seed`` so that a run with another
  seed does not hit the prefix cache an earlier run filled, or index-only with ``--reuse-prompts``;
  see :func:`prompt_token_ids`), ``max_tokens`` =
  ``output_tokens``, ``stream: true``, ``ignore_eos: true`` (vLLM extension, like vLLM's
  ``--ignore-eos``) and ``stream_options: {"include_usage": true}``.
* **Timing.** Every SSE event is stamped with its own ``time.perf_counter()`` when it is parsed,
  converted to seconds since the bench start, as vLLM's client stamps each message: events that
  arrived in one read are separate arrivals (an event stamped no later than the previous one is
  moved one float after it, see :class:`StreamState`). TTFT (ms) = first content chunk − send
  time; ITL is one gap per content event, as ``vllm bench serve`` 0.32 appends one ITL per chunk
  (the tokens of one event are one arrival, one gap). The token times feed
  :func:`kairos.core.workload.serving_metrics.summarize`, the same code the simulator uses, so TBT (ms) is the
  gap between consecutive tokens as the client sees them (0 ms inside one event).
* **Tokens per chunk.** A chunk carries ``usage.completion_tokens`` growth if the server streams
  cumulative usage (vLLM ``continuous_usage_stats``), else ``len(logprobs.tokens)`` if present,
  else one token — vLLM's client counts every chunk with choices as one token too. Unlike vLLM,
  a pure finish marker (empty text *and* a ``finish_reason``, as vLLM sends when its last output has no token) is
  not a token. A chunk of k tokens records k equal times (gaps of 0 ms), see
  :class:`~kairos.core.workload.serving_metrics.RequestRecord`. A chunk without generated text (an empty first chunk, a
  role-only chat delta) carries no token unless its cumulative usage or logprobs say it does (a
  special token), so TTFT is the first chunk that *generated* something. Here we differ from vLLM,
  whose client takes TTFT at the first chunk with ``choices`` even if its text is empty: a server
  that sends an empty chunk at once would get a TTFT of a few ms. ``output_tokens`` is the final ``usage`` count when the server reports one (as vLLM does),
  else the tokens counted; the run warns when the server sent no usage at all.
  ``cached_tokens`` (``--save-records``) is the final usage's
  ``prompt_tokens_details.cached_tokens`` (OpenAI's and vLLM's field), null when not reported.
* **Figures** are :func:`kairos.core.workload.serving_metrics.serving_metrics` (``vllm bench serve``'s names and
  definitions: throughputs, mean/median/P99 TTFT, TPOT, ITL, E2EL, goodput) with vLLM's peak output
  throughput and peak concurrency (:func:`~kairos.cli.bench.vllm_block.peak_figures`), printed as
  ``vllm bench serve`` prints them — the same labels, order, section headers and number formats,
  ``--percentile-metrics`` and ``--metric-percentiles`` as vLLM's
  (:func:`~kairos.cli.bench.vllm_block.result_block`) — then how to read the rates (offered vs
  sent, the drain after the last send: :func:`~kairos.cli.bench.report.rates_note`), then the
  paper's metrics (:func:`kairos.core.workload.serving_metrics.summarize`).
* **Progress**: a tqdm bar when stderr is a terminal, else one line every ``progress_interval_s``
  (so a redirected run, e.g. under ``make run``, still shows it is alive), also while no request
  finishes; once every request is sent, the line names those still streaming with their output
  tokens so far ÷ requested and the time left at their own rate.
* **Failures** are counted, never fatal: an HTTP status ≠ 200, an ``error`` object in the stream,
  a stream that ends without ``data: [DONE]``, a connection error, or no answer within
  ``request_timeout_s`` (seconds, whole request). Only usage errors (bad URL, server unreachable
  at start, bad workload) raise :class:`BenchError`. The summary groups the failures by the
  error's code (the server's ``code``/``type``, else the exception class; a message often embeds
  the request id), one line per group with its count and an example, the largest five, then how
  many failures those lines leave out (:func:`~kairos.cli.bench.report.error_groups`).
* **Interruption.** Under ``kairos bench``, Ctrl-C (SIGINT) or SIGTERM stops the run early
  (:mod:`~kairos.cli.bench.interrupt`): no request is sent any more, those in flight are cancelled
  (their connections closed) and left out of every figure, and the report of what finished is
  printed and written with ``interrupted`` set; the command exits 130 or 143. A second Ctrl-C aborts.
* **Deflections.** After the run, ``GET {url}/v1/requests/{id}`` (the id the ingress returned in
  the stream's ``id``, or the ``x-request-id`` header) for every request that got one, counting
  ``decision == "deflect"`` and setting ``RequestRecord.deflected``. If no record is found at all
  (e.g. the endpoint 404s), fall back to the delta of the ``kairos_decisions_total`` (or
  ``kairos_dispatcher_decisions_total``) counter with ``decision="deflect"`` between ``GET
  {url}/metrics`` before and after the run; if that fails too, deflections are ``None``.

The package, one concern a module: :mod:`~kairos.cli.bench.stream` (one request's body, SSE
stream and record; pure), :mod:`~kairos.cli.bench.client` (the HTTP replay and the deflection
count), :mod:`~kairos.cli.bench.progress` (the progress bar or lines), :mod:`~kairos.cli.bench.interrupt`
(stopping early on a signal),
:mod:`~kairos.cli.bench.vllm_block` (``vllm bench serve``'s result block and figures),
:mod:`~kairos.cli.bench.report` (the JSON report and what is printed) and
:mod:`~kairos.cli.bench.command` (:func:`bench_cli`, what the ``kairos bench`` command runs). The
names below are re-exported here, where the CLI, ``kairos demo``, the benches and the tests import
them. Pure pieces (no I/O, unit-tested): :class:`SSEParser`, :class:`StreamState`,
:func:`make_record`, :func:`parse_deflect_counter`, :func:`build_report`.
"""

from __future__ import annotations

from kairos.cli.bench.client import (DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_URL, DEFLECT_COUNTERS, LOOKUP_CONCURRENCY,
                                     LOOKUP_TIMEOUT_S, BenchConfig, BenchError, BenchResult, Outcome, check_url,
                                     deflect_delta, lookup_decisions, parse_deflect_counter, probe, run_bench,
                                     scrape_metrics, send_one)
from kairos.cli.bench.command import bench_cli, parse_goodput
from kairos.cli.bench.progress import DEFAULT_PROGRESS_INTERVAL_S, ProgressReporter
from kairos.cli.bench.report import build_report, format_report
from kairos.cli.bench.stream import SSEParser, StreamState, chunk_tokens, make_record, prompt_token_ids, request_body

__all__ = [
    "DEFAULT_URL", "DEFAULT_REQUEST_TIMEOUT_S", "DEFAULT_PROGRESS_INTERVAL_S", "DEFLECT_COUNTERS", "LOOKUP_CONCURRENCY",
    "LOOKUP_TIMEOUT_S", "BenchConfig", "BenchError", "BenchResult", "Outcome", "ProgressReporter", "SSEParser",
    "StreamState", "bench_cli", "build_report", "check_url", "chunk_tokens", "deflect_delta", "format_report",
    "lookup_decisions", "make_record", "parse_deflect_counter", "parse_goodput", "probe", "prompt_token_ids",
    "request_body", "run_bench", "scrape_metrics", "send_one",
]
