"""``kairos plan``: how many prefill and decode nodes a workload needs, with deflection and without
(:mod:`kairos.plan`: the simulator's search over P:D splits, cluster sizes and rates)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import click

from kairos.cli.options import (creatable_dir, load_model_or_exit, make_params, policy_option, policy_params_options,
                                workload_options, workload_size_or_exit, writable_file)
from kairos.core.model.latency import DEFAULT_PROFILE, LatencyProfileError
from kairos.core.policy import Policy


#: without a terminal, a progress line this often (s)
PROGRESS_EVERY_S = 10.0


#: the largest cluster a plan searches (nodes)
MAX_PLAN_NODES = 1024

#: the lowest ``--attainment`` (%): below it a fraction was meant (0.9 for 90 %), and the rate search
#: would climb to 256 × the rate on full-length points
MIN_ATTAINMENT_PCT = 1.0


def _node_range(ctx, param, value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    if (not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or len(hi.strip()) > 6
            or not 2 <= int(lo) <= int(hi) <= MAX_PLAN_NODES):
        raise click.BadParameter(f"{value!r} must be LO:HI node counts with 2 <= LO <= HI <= {MAX_PLAN_NODES} "
                                 "(e.g. 2:16)")
    return int(lo), int(hi)


def _finite(ctx, param, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _seeds(ctx, param, value: str) -> list[int]:
    try:
        seeds = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} must be a comma list of integers (e.g. 1,2,3)") from None
    if any(not 0 <= x < 2 ** 32 for x in seeds):
        raise click.BadParameter(f"{value!r}: seeds are integers from 0 to 2^32 - 1")
    if not seeds or len(set(seeds)) != len(seeds):
        raise click.BadParameter(f"{value!r} must name at least one seed, each once")
    return seeds


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kairos/plan`` (``~/.cache/kairos/plan``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kairos" / "plan"


@click.command()
@workload_options(300.0)
@click.option("--from-live", "live_url", default=None, metavar="URL",
              help="Plan for what a running Kairos served: its ingress URL; the workload is the arrivals and "
                   "token counts of its recent requests (--window), instead of --workload.")
@click.option("--window", "window_s", type=click.FloatRange(1, 86400), default=600.0, show_default=True,
              callback=_finite,
              help="With --from-live: seconds of recent requests taken.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, show_envvar=True,
              help="With --from-live: sent as Authorization: Bearer KEY (an ingress started with API keys needs one).")
@policy_option("pd,kairos+", many=True)
@click.option("--attainment", type=click.FloatRange(MIN_ATTAINMENT_PCT, 100), default=90.0, show_default=True,
              callback=_finite,
              help="SLO attainment wanted, % (90, not 0.9): requests with TTFT <= --ttft-slo-ms and P95 TBT <= "
                   "--tbt-slo-ms.")
@click.option("--nodes", "node_range", default="2:16", show_default=True, callback=_node_range, metavar="LO:HI",
              help="Cluster sizes searched (nodes; a node is one engine instance).")
@click.option("--budget", type=click.IntRange(2), default=None,
              help="Nodes available: the best split and the sustained rate are given for it (default: HI).")
@click.option("--gpus-per-node", type=click.IntRange(1), default=1, show_default=True,
              help="GPUs of one engine instance (tensor parallelism), for the GPU counts shown.")
@click.option("--seeds", default="1,2,3", show_default=True, callback=_seeds,
              help="Seeds of the workload and the simulator: the spread over them is the noise a difference must exceed.")
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Latency profile (name or path).")
@click.option("--link", default=None, help="KV link setting of the profile (default: its default).")
@click.option("--heartbeat-ms", type=click.FloatRange(0, 60_000), default=100.0, show_default=True, callback=_finite,
              help="Δh, the dispatchers' state refresh period.")
@click.option("--noise", type=click.FloatRange(0, 5), default=0.0, show_default=True, callback=_finite,
              help="σ of log-normal noise on every simulated engine step.")
@click.option("--jobs", "-j", type=click.IntRange(1), default=None, help="Simulations at once (default: every core).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where simulated points are kept by input hash (default: ~/.cache/kairos/plan).")
@click.option("--no-cache", is_flag=True, help="Simulate every point again and keep nothing.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("out/plan/attainment.png"), show_default=True, help="PNG of attainment against the split.")
@click.option("--no-plot", is_flag=True, help="Draw no plot.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write the plan as JSON.")
@click.option("--emit", type=click.Choice(["k8s", "compose"]), default=None,
              help="Write the smallest cluster of the last policy as a kustomize overlay of deploy/k8s, or a copy of "
                   "docker-compose.yml with that many emulated nodes.")
@click.option("--emit-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("out/plan"),
              show_default=True, help="Where --emit writes.")
@policy_params_options
def plan(workload, rps, duration, live_url, window_s, api_key, policies: list[Policy], attainment, node_range, budget,
         gpus_per_node, seeds, profile, link, heartbeat_ms, noise, jobs, cache_dir, no_cache, plot_path, no_plot,
         json_path, emit, emit_dir, **params) -> None:
    """Size a P/D cluster for a workload with the simulator: per policy the smallest cluster meeting the
    SLOs, the best prefill:decode split of a node budget and the rate it sustains, and what the
    deflecting policy saves over pd."""
    from kairos.core.workload.workloads import MAX_REQUESTS, TABLE1_RPS, WorkloadError
    from kairos.plan.evaluate import MIN_POINT_DURATION_S, PlanInputs, pin_trace, workload_rate
    from kairos.plan.search import RATE_SPAN

    link = link or None  # "" is the profile's default link, as for kairos sim
    model = load_model_or_exit(profile)
    try:
        model.link(link)
    except LatencyProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--link") from None
    pp = make_params(**params)
    lo, hi = node_range
    budget = hi if budget is None else budget
    if not lo <= budget <= hi:
        raise click.BadParameter(f"{budget} is outside --nodes {lo}:{hi}", param_hint="--budget")
    ctx = click.get_current_context()
    if live_url is not None:
        if not live_url.strip():
            raise click.BadParameter("an empty URL (an unset variable?): give the ingress's URL", param_hint="--from-live")
        given = [f"--{o}" for o in ("workload", "duration", "rps")
                 if ctx.get_parameter_source(o) not in (None, click.core.ParameterSource.DEFAULT)]
        if given:
            raise click.UsageError(f"--from-live plans the workload the stack served (--window seconds of it): "
                                   f"drop {', '.join(given)}")
    workload_size_or_exit(duration, [rps])
    cache = None if no_cache else (cache_dir or default_cache_dir())
    _writable_dirs({"--cache-dir": cache, "--emit-dir": emit_dir if (emit or live_url) else None,
                    "--plot": None if no_plot else _plot_dir(plot_path)})
    if live_url:
        from kairos.plan.live import LiveWorkloadError, fetch_live_workload

        try:
            workload, n = fetch_live_workload(live_url, window_s, Path(emit_dir) / "live-workload.csv", api_key)
        except LiveWorkloadError as exc:
            raise click.BadParameter(str(exc), param_hint="--from-live") from None
        click.echo(f"kairos plan: {n} requests of the last {window_s:g} s from {live_url} -> {workload[6:]}", err=True)
        duration = window_s
    try:
        base_rps = rps if rps is not None else workload_rate(workload, seeds[0], model.engine.max_model_len)
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from None
    per_point = base_rps * max(duration, RATE_SPAN * min(MIN_POINT_DURATION_S, duration))
    if per_point > MAX_REQUESTS:  # the rate search's top point simulates this many requests
        raise click.BadParameter(f"a plan point would simulate up to {per_point:,.0f} requests (the rate × the "
                                 f"duration, or {MIN_POINT_DURATION_S:g} s at {RATE_SPAN:g} × the rate); at most "
                                 f"{MAX_REQUESTS:,}: a lower --rps or a shorter --duration",
                                 param_hint="--rps" if rps is not None else "--duration")
    if rps is None and not workload.startswith("trace:") and workload.strip().lower() in TABLE1_RPS:
        rps = base_rps  # a generated workload's default rate is a rate (Table 1), not a trace's own timing
    inputs = PlanInputs(workload=workload, duration_s=duration, profile=profile, link=link, heartbeat_ms=heartbeat_ms,
                        noise=noise, base_rps=base_rps, params={"alpha": pp.alpha, "beta": pp.beta, "tbt_slo_ms": pp.tbt_slo_ms,
                                             "ttft_slo_ms": pp.ttft_slo_ms})
    with tempfile.TemporaryDirectory(prefix="kairos-plan-") as scratch:
        try:  # the trace as it is now: what every point simulates, whatever happens to the file meanwhile
            inputs = pin_trace(inputs, cache or Path(scratch))
        except OSError as exc:
            raise click.BadParameter(f"cannot read or keep the trace: {exc}", param_hint="--workload") from None
        _run(inputs=inputs, cache=cache, jobs=jobs, policies=policies, lo=lo, hi=hi, budget=budget, rps=rps,
             base_rps=base_rps, seeds=seeds, attainment=attainment, gpus_per_node=gpus_per_node,
             plot_path=None if no_plot else plot_path, json_path=json_path, emit=emit, emit_dir=emit_dir,
             live_url=live_url, workload=workload, duration=duration, profile=profile)


def _plot_dir(path: Path) -> Path:
    if path.suffix.lower() != ".png" or not path.stem:
        raise click.BadParameter(f"{str(path)!r} is not a .png file name", param_hint="--plot")
    return path.parent


def _writable_dirs(dirs: dict[str, Path | None]) -> None:
    """Create every directory given (option → dir) and check it takes a file, before any simulation
    (:func:`~kairos.cli.options.creatable_dir`); a usage error naming the option otherwise."""
    for option, d in dirs.items():
        try:
            creatable_dir(None, None, d)
        except click.BadParameter as exc:
            exc.param_hint = option
            raise


def _stop_on_signals() -> list[int]:
    """Make the first SIGINT or SIGTERM stop the plan (a KeyboardInterrupt in the main thread, which
    aborts the searches and stops the workers) and ignore any later one while it stops: a second
    Ctrl-C during the pool's shutdown could leave it waiting on its workers, and a SIGTERM (``kill``,
    ``docker stop``) ended the process at once, leaving its workers blocked. Returns the list the
    signal received is appended to. Off the main thread (a test calling the command from a worker
    thread) nothing is installed: Python takes signals in the main thread only."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return got

    def stop(signum: int, frame) -> None:
        got.append(signum)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    return got


def _run(*, inputs, cache, jobs, policies, lo, hi, budget, rps, base_rps, seeds, attainment, gpus_per_node, plot_path,
         json_path, emit, emit_dir, live_url, workload, duration, profile) -> None:
    """The plan itself, its report, plot, JSON and emitted files (the options checked by :func:`plan`)."""
    from kairos.core.workload.workloads import WorkloadError
    from kairos.plan.evaluate import Evaluator, PlanAborted
    from kairos.plan.planner import plan as run_plan
    from kairos.plan.report import plot, text
    from kairos.plan.search import PlanError

    tty = sys.stderr.isatty()
    last = [time.monotonic()]

    def progress(simulated: int, cached: int) -> None:
        """A line that updates on a terminal, else one every PROGRESS_EVERY_S seconds."""
        if tty:
            click.echo(f"\rkairos plan: {simulated} simulated, {cached} from the cache", err=True, nl=False)
        elif time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            click.echo(f"kairos plan: {simulated} simulated, {cached} from the cache", err=True)

    t0 = time.perf_counter()
    stopped_by = _stop_on_signals()
    try:
        with Evaluator(inputs, cache, min(jobs or os.cpu_count() or 1, os.cpu_count() or 1), progress) as ev:
            result = run_plan(ev.evaluate, [p.spec for p in policies], lo, hi, budget, rps, base_rps, seeds,
                              attainment / 100.0, cancel=ev.abort)
    except PlanError as exc:
        raise click.UsageError(str(exc)) from None
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from None
    except (KeyboardInterrupt, PlanAborted):
        click.echo("\nkairos plan: stopped" + ("; what was simulated is in the cache" if cache else ""), err=True)
        sys.exit(128 + (stopped_by[0] if stopped_by else signal.SIGINT))
    except BrokenProcessPool:
        raise click.ClickException("a simulation process died (killed, or out of memory)"
                                   + ("; what was simulated before is in the cache" if cache else "")) from None
    wall = time.perf_counter() - t0
    if tty:
        click.echo("", err=True)
    click.echo(f"kairos plan: {ev.simulated} points simulated, {ev.cached} from the cache, {wall:.1f} s", err=True)
    click.echo(text(result, gpus_per_node))
    chosen = result.policies[-1]
    if emit and chosen.smallest is None:  # before any file is written
        raise click.UsageError(f"--emit: {chosen.policy} has no cluster meeting the target in --nodes {lo}:{hi}")
    title = f"{workload if not live_url else 'live: ' + live_url}, {duration:g} s, profile {profile}"
    if plot_path is not None:
        click.echo(f"plot: {plot(result, Path(plot_path), title)}", err=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        out = {"workload": workload, "duration_s": duration, "profile": profile, "wall_s": round(wall, 2),
               "simulated": ev.simulated, "cached": ev.cached, **result.to_json()}
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    if emit:
        from kairos.plan.emit import EmitError, emit_plan

        try:
            paths = emit_plan(emit, chosen.smallest.prefill, chosen.smallest.decode, Path(emit_dir))
        except (EmitError, OSError) as exc:
            raise click.UsageError(f"--emit: {exc}") from None
        for path in paths:
            click.echo(f"wrote {path}", err=True)
