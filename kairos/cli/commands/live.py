"""``kairos bench`` and ``kairos trace``: against a running stack (its ingress, its span file)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from kairos.cli.options import workload_options, writable_file
from kairos.core.policy import DEFAULT_PARAMS


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="Ingress base URL, as vllm bench serve's --base-url: requests go to URL/v1/completions. "
                   "A trailing /v1 (an OpenAI client's base URL) is dropped, with a note.")
@workload_options(60.0, vllm_names=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--reuse-prompts", is_flag=True,
              help="Send the same prompts whatever --seed (index-only; a rerun hits the prefix cache on purpose).")
@click.option("--model", default=None, help="Model name (default: the first id of GET /v1/models).")
@click.option("--max-concurrency", type=click.IntRange(1), default=None, help="Max requests in flight (default: none).")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=300.0, show_default=True,
              help="Per-request timeout, seconds; a timed-out request counts as failed.")
@click.option("--max-model-len", type=click.IntRange(2), default=None,
              help="Cap prompt+output (tokens). Default: the server's max_model_len if /v1/models has one, else 32768.")
@click.option("--label", default="live", show_default=True, help="Row name in the table and the JSON.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write the report as JSON.")
@click.option("--save-records", is_flag=True, help="Include per-request records in the --json report.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress on stderr: a bar on a terminal, else a line every 10 s.")
@click.option("--tbt-slo-ms", type=float, default=DEFAULT_PARAMS.tbt_slo_ms, show_default=True,
              help="τ, TBT SLO in ms.")
@click.option("--ttft-slo-ms", type=float, default=DEFAULT_PARAMS.ttft_slo_ms, show_default=True,
              help="TTFT SLO in ms.")
@click.option("--goodput", multiple=True, metavar="KEY:MS",
              help="Goodput SLOs as in `vllm bench serve` (ttft, tpot, e2el; ms; repeatable). "
                   "Default: ttft:<--ttft-slo-ms> tpot:<--tbt-slo-ms>.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, show_envvar=True,
              help="Sent as Authorization: Bearer KEY (an ingress started with API keys).")
@click.option("--percentile-metrics", default=None, metavar="LIST",
              help="As in `vllm bench serve`: metrics given a section (ttft,tpot,itl,e2el,client_queue_time,"
                   "e2el_including_client_queue). Default: ttft,tpot,itl.")
@click.option("--metric-percentiles", default="99", show_default=True, metavar="LIST",
              help="As in `vllm bench serve`: percentiles of each section, comma-separated.")
def bench(**opts) -> None:
    """Replay a workload against a live ingress with streaming requests (like `vllm bench serve`).

    Ctrl-C (SIGINT) or SIGTERM stops the run early: nothing more is sent, the requests in flight are
    cancelled, the results of those that finished are printed (marked INTERRUPTED) and written to
    --json, and the exit status is 130 (SIGINT) or 143 (SIGTERM). A second Ctrl-C aborts at once."""
    from kairos.cli.bench import BenchError, bench_cli
    from kairos.cli.bench.interrupt import exit_status

    try:
        report = bench_cli(**opts, handle_signals=True)
    except BenchError as exc:
        click.echo(f"kairos bench: {exc}", err=True)
        sys.exit(2)
    if (status := exit_status(report)) is not None:  # Ctrl-C / SIGTERM: what finished is reported, exit 130 / 143
        sys.exit(status)
    if report["completed"] == 0:  # a run in which nothing completed measured nothing: not a success
        click.echo("kairos bench: no request completed (see the errors above)", err=True)
        sys.exit(1)


@click.command()
@click.argument("request_id")
@click.option("--trace-file", type=click.Path(dir_okay=False), envvar="KAIROS_TRACE_FILE", default=None,
              help="Span file written by `kairos up --trace-file PATH` (default: $KAIROS_TRACE_FILE).")
@click.option("--json", "as_json", is_flag=True, help="Print the request's spans as JSON lines instead of a tree.")
def trace(request_id: str, trace_file: str | None, as_json: bool) -> None:
    """Print one request's spans as a tree: REQUEST_ID is the response id (cmpl-…) or a trace id."""
    from kairos.cli.trace import TraceLookupError, find_spans, trace_report

    if not trace_file:
        click.echo("kairos trace: no trace file: pass --trace-file PATH (the file given to `kairos up --trace-file`)"
                   " or set KAIROS_TRACE_FILE", err=True)
        sys.exit(2)
    path = Path(trace_file)
    if not path.is_file():
        click.echo(f"kairos trace: trace file {path} not found (start the stack with `kairos up --trace-file {path}`)",
                   err=True)
        sys.exit(2)

    def lines():
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f

    if as_json:
        spans = find_spans(lines, request_id)
        for s in spans:
            click.echo(json.dumps(dataclasses.asdict(s)))
        if spans:
            return
    else:
        try:
            click.echo(trace_report(lines, request_id))
            return
        except TraceLookupError:
            pass
    click.echo(f"kairos trace: no spans of request {request_id!r} in {path} (spans are written about 0.1 s after "
               "they finish; was the stack started with this --trace-file?)", err=True)
    sys.exit(2)


@click.command()
@click.argument("node")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="Ingress base URL.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, show_envvar=True,
              help="Sent as Authorization: Bearer KEY (an ingress started with API keys needs one).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              help="Seconds to wait for the ingress's answer.")
def drain(node: str, url: str, api_key: str | None, timeout_s: float) -> None:
    """Drain NODE gracefully (a rolling restart, a scale-down): it takes nothing new, its queued requests
    move to other nodes at once, its running ones finish (up to its KAIROS_DRAIN_TIMEOUT_S; what is left
    then moves, the streams continuing on other nodes), then its agent exits. Asks the ingress at --url
    (POST /v1/admin/nodes/NODE/drain), which tells the node over NATS."""
    import urllib.error
    import urllib.request

    from kairos.cli.bench.client import BenchError, check_url
    from kairos.contracts.errors import error_message
    from kairos.contracts.subjects import SubjectError, check_token

    try:
        check_token(node, "node id")
        url = check_url(url)  # a trailing /v1 (an OpenAI client's base URL) is dropped
    except (SubjectError, BenchError) as exc:
        raise click.UsageError(str(exc)) from None
    req = urllib.request.Request(f"{url}/v1/admin/nodes/{node}/drain", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        message = error_message(exc.read(), str(exc.reason))
        raise click.ClickException(f"the ingress refused: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"could not reach the ingress at {url}: {exc}") from None
    again = " (it was draining already)" if body.get("was_draining") else ""
    click.echo(f"node {body['node']} is draining{again}: it finishes its running requests (up to its "
               f"KAIROS_DRAIN_TIMEOUT_S), moves the rest to other nodes, then its agent exits. "
               f"GET {url}/health lists the draining nodes.")
