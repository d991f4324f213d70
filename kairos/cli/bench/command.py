"""``kairos bench`` as a function: check the options, build the workload, run, print and write the report.

Inputs: the options of the ``kairos bench`` click command (:mod:`kairos.cli.main`), also called by
``kairos demo`` and ``kairos profile --testbed``. Outputs: ``vllm bench serve``'s result block and
the paper's metrics table on stdout, a summary and warnings on stderr, the JSON report at
``--json``; the report dict is returned. Usage errors raise
:class:`~kairos.cli.bench.client.BenchError` (the CLI exits 2).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kairos.cli.bench.client import BenchConfig, BenchError, check_url, run_bench, v1_note
from kairos.cli.bench.interrupt import Interrupt, stop_on_signals
from kairos.cli.bench.progress import DEFAULT_PROGRESS_INTERVAL_S
from kairos.cli.bench.report import build_report, failure_lines, format_report
from kairos.cli.bench.vllm_block import DEFAULT_PERCENTILE_METRICS, parse_metric_percentiles, parse_percentile_metrics
from kairos.runtime.service import run_on_event_loop
from kairos.core.workload.workloads import DEFAULT_MAX_MODEL_LEN, WorkloadRequest


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``vllm bench serve --goodput`` syntax: ``KEY:VALUE`` pairs (ms), keys ttft, tpot, e2el.

    Raises:
        BenchError: malformed pair, unknown key or a value that is not a positive number.
    """
    out: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or key not in ("ttft", "tpot", "e2el") or not (ms > 0 and ms != float("inf")):
            raise BenchError(f"--goodput {spec!r}: expected ttft:MS, tpot:MS or e2el:MS with MS > 0")
        out[key] = ms
    return out


def bench_cli(*, url: str, workload: str, rps: float | None, duration: float | None, seed: int,
              model: str | None, max_concurrency: int | None, request_timeout: float, max_model_len: int | None,
              label: str, json_path: str | None, save_records: bool, progress: bool, tbt_slo_ms: float,
              ttft_slo_ms: float, goodput: Sequence[str] = (),
              progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S, api_key: str | None = None,
              reuse_prompts: bool = False, percentile_metrics: str | None = None,
              metric_percentiles: str = "99", num_prompts: int | None = None,
              handle_signals: bool = False) -> dict[str, Any]:
    """What ``kairos bench`` does: run, print ``vllm bench serve``'s result block and the paper's
    metrics table (stdout) and a summary (stderr), write JSON. ``num_prompts``: send exactly the
    first N requests of the workload (``vllm bench serve --num-prompts``;
    :func:`kairos.core.workload.counted.first_requests`) instead of those of ``duration`` seconds
    (give one: both is a usage error). The prompts depend on ``seed``
    (another seed, other prompts: no prefix-cache hits left by an earlier run) unless
    ``reuse_prompts``, which sends the index-only prompts of every run. ``percentile_metrics`` and
    ``metric_percentiles``: ``vllm bench serve``'s options of the same names (which metrics get a
    section, which percentiles; default ``ttft,tpot,itl`` and ``99`` as vLLM's). ``handle_signals``
    (the ``kairos bench`` command): SIGINT and SIGTERM stop the run early
    (:mod:`kairos.cli.bench.interrupt`): nothing more is sent, the requests in flight are cancelled,
    and the report of what finished is printed and written, its ``interrupted`` set
    (:func:`kairos.cli.bench.interrupt.exit_status` gives the exit status: 130, 143); else the
    signals keep their handlers (``kairos demo`` has its own).

    Raises:
        BenchError: any usage error (the CLI exits 2).
    """
    import click

    from kairos.core.workload.counted import first_requests
    from kairos.core.workload.workloads import WorkloadError, WorkloadSizeError, check_workload_size, parse_workload

    given, url = url, check_url(url)
    from kairos.cli.options import size_option
    if num_prompts is not None and duration is not None:
        raise BenchError(f"--num-prompts {num_prompts} and --duration {duration:g}: give one")
    try:
        check_workload_size(duration, [rps], num_prompts)
    except WorkloadSizeError as exc:
        raise BenchError(f"{size_option(exc.param)}: {exc}") from None
    if save_records and not json_path:
        raise BenchError("--save-records needs --json PATH")
    slos = parse_goodput(goodput) if goodput else None
    try:
        stems = parse_percentile_metrics(percentile_metrics) if percentile_metrics else DEFAULT_PERCENTILE_METRICS
        pcts = parse_metric_percentiles(metric_percentiles)
    except ValueError as exc:
        raise BenchError(str(exc)) from None

    def make_workload(n: int) -> list[WorkloadRequest]:
        try:
            if num_prompts is not None:
                return first_requests(workload, rps, num_prompts, seed, max_model_len=n)
            return parse_workload(workload, rps, duration, seed, max_model_len=n)
        except WorkloadSizeError as exc:
            raise BenchError(f"{size_option(exc.param)}: {exc}") from None
        except WorkloadError as exc:
            raise BenchError(f"--workload: {exc}") from None

    cache: dict[int, list[WorkloadRequest]] = {}

    def workload_fn(server_max_len: int | None) -> list[WorkloadRequest]:
        n = max_model_len or server_max_len or DEFAULT_MAX_MODEL_LEN
        if n not in cache:
            cache.clear()
            cache[n] = make_workload(n)
        return cache[n]

    workload_fn(None)  # workload errors before touching the network
    if note := v1_note(given, url):
        click.echo(f"kairos bench: {note}", err=True)
    cfg = BenchConfig(url=url, model=model, max_concurrency=max_concurrency, request_timeout_s=request_timeout,
                      progress=progress, progress_interval_s=progress_interval_s, api_key=api_key,
                      prompt_seed=None if reuse_prompts else seed)
    wl_info: dict[str, Any] = {"spec": workload, "rps": rps, "duration_s": duration, "num_prompts": num_prompts,
                               "seed": seed, "reuse_prompts": reuse_prompts}
    interrupt = Interrupt()
    with stop_on_signals(interrupt) if handle_signals else contextlib.nullcontext():
        result = run_on_event_loop(run_bench(cfg, workload_fn, interrupt), "kairos bench")  # uvloop as the services
    wl = next(iter(cache.values()))
    span = wl[-1].arrival_s - wl[0].arrival_s
    wl_info.update(requests=len(wl), offered_rps=round((len(wl) - 1) / span, 3) if span > 0 else None)
    report = build_report(result, url=url, workload=wl_info, label=label, tbt_slo_ms=tbt_slo_ms,
                          ttft_slo_ms=ttft_slo_ms, max_concurrency=max_concurrency,
                          request_timeout_s=request_timeout, goodput_slo_ms=slos, save_records=save_records,
                          percentile_metrics=stems, metric_percentiles=pcts)
    click.echo(format_report(report))
    if report["usage_reported"] == 0 and report["completed"]:
        click.echo("kairos bench: warning: the server sent no usage; output tokens are counted as one per chunk "
                   "with text, which undercounts when a chunk carries several tokens", err=True)
    src = f" (from {report['deflections_source']})" if report["deflections_source"] else ""
    cut = report["interrupted"]
    cancelled = f", cancelled {cut['cancelled_in_flight']} in flight ({cut['signal']})" if cut else ""
    click.echo(f"sent {report['sent']}, completed {report['completed']}, failed {report['failed']}{cancelled} in "
               f"{report['duration_s']:.1f} s; deflections: {report['deflections']}{src}", err=True)
    for line in failure_lines(report):
        click.echo(line, err=True)
    if json_path:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    return report
