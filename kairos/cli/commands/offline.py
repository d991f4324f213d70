"""``kairos decide`` and ``kairos sim``: the policies without a running stack (one snapshot, or the
cluster in virtual time, :mod:`kairos.sim`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import msgspec

from kairos.cli.options import (load_model_or_exit, make_params, policy_option, policy_params_options,
                                workload_options, workload_size_or_exit, writable_file)
from kairos.core.cluster.snapshot import SnapshotError, parse_snapshot
from kairos.core.model.latency import DEFAULT_PROFILE, LatencyProfileError
from kairos.core.policy import DEFAULT_POLICY, Policy
from kairos.core.policy.registry import node_guard_policies


@click.command()
@click.argument("snapshot", type=click.File("rb"), default="-")
@policy_option(DEFAULT_POLICY)
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Bundled profile name or artifact path.")
@policy_params_options
def decide(snapshot, policy: Policy, profile: str, **params) -> None:
    """Print one routing decision (JSON) for a cluster SNAPSHOT (file or - for stdin)."""
    model = load_model_or_exit(profile)
    pp = make_params(**params)
    if getattr(snapshot, "name", "") == "<stdin>" and sys.stdin.isatty():
        click.echo("kairos decide: reading the snapshot JSON from stdin (end with Ctrl-D; or pass a file)", err=True)
    data = snapshot.read()
    if not data.strip():
        raise click.UsageError("no snapshot: the input is empty (give a SNAPSHOT file, or pipe its JSON into '-')")
    try:
        snap = parse_snapshot(data)
    except SnapshotError as exc:
        click.echo(f"kairos decide: {exc}", err=True)
        sys.exit(2)
    decision = policy.decide(snap, model, pp)
    click.echo(msgspec.json.format(msgspec.json.encode(decision), indent=2))


def parse_drift(spec: str | None, n_prefill: int, n_decode: int) -> tuple[str | None, float, float]:
    """``NODE:PCT:AT_S`` → (node, 1 + PCT/100, AT_S); (None, 1.0, 0.0) for None.

    Raises:
        click.BadParameter: malformed, unknown node, PCT ≤ −100 or AT_S < 0 (names ``--drift``).
    """
    if not spec:
        return None, 1.0, 0.0
    nodes = [f"prefill-{i}" for i in range(n_prefill)] + [f"decode-{i}" for i in range(n_decode)]
    try:
        node, pct, at = spec.split(":")
        scale, at_s = 1.0 + float(pct) / 100.0, float(at)
    except ValueError:
        raise click.BadParameter(f"{spec!r} must be NODE:PCT:AT_S, e.g. decode-0:15:300", param_hint="--drift") from None
    if node not in nodes:
        raise click.BadParameter(f"unknown node {node!r}; the cluster has {', '.join(nodes)}", param_hint="--drift")
    if not scale > 0 or not at_s >= 0:
        raise click.BadParameter("PCT must be > -100 and AT_S >= 0", param_hint="--drift")
    return node, scale, at_s


@click.command()
@workload_options(600.0)
@policy_option("pd,kairos", many=True)
@click.option("--prefill", "n_prefill", type=click.IntRange(1), default=2, show_default=True)
@click.option("--decode", "n_decode", type=click.IntRange(1), default=2, show_default=True)
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Latency profile (name or path).")
@click.option("--link", default=None, help="KV link setting of the profile (default: its default, 'paper').")
@click.option("--heartbeat-ms", type=click.FloatRange(0), default=100.0, show_default=True,
              help="Δh, dispatcher state refresh period; 0 = exact state (Oracle).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--truth-profile", default=None, help="Ground-truth profile of the engines (default: --profile).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Engines' steps take this × the truth profile (1.1: 10 % slower than the policy believes).")
@click.option("--drift", default=None, metavar="NODE:PCT:AT_S",
              help="NODE becomes PCT % slower AT_S seconds into the run (e.g. decode-0:15:300).")
@click.option("--noise", type=click.FloatRange(0), default=0.0, show_default=True,
              help="σ of multiplicative log-normal noise on every engine step.")
@click.option("--tbt-guard/--no-tbt-guard", default=None,
              help=f"Node-side chunk guard (default: on for {', '.join(node_guard_policies())}, off otherwise).")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Engines keep prefix caches (requests with block hashes, e.g. the mooncake trace, hit them).")
@click.option("--sweep-rps", default=None, help="START:STOP[:STEP]: run every policy at each rate and plot.")
@click.option("--plots-dir", type=click.Path(file_okay=False), default="out/plots", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write rows as JSON.")
@policy_params_options
def sim(workload, rps, duration, policies: list[Policy], n_prefill, n_decode, profile, link, heartbeat_ms, seed,
        truth_profile, truth_scale, drift, noise, tbt_guard, prefix_cache, sweep_rps, plots_dir, json_path,
        **params) -> None:
    """Simulate the P/D cluster in virtual time and print the paper's metrics per policy."""
    from kairos.core.workload.serving_metrics import format_table
    from kairos.core.workload.workloads import WorkloadError, parse_workload
    from kairos.sim.experiments import parse_range, plot_sweep, run_one, sweep_title
    from kairos.sim.simulator import SimConfig

    model = load_model_or_exit(profile)
    truth = load_model_or_exit(truth_profile, "--truth-profile") if truth_profile else None
    drift_node, drift_scale, drift_at_s = parse_drift(drift, n_prefill, n_decode)
    try:
        model.link(link)
    except LatencyProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--link") from None
    pp = make_params(**params)
    try:
        rates = parse_range(sweep_rps) if sweep_rps else [rps]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sweep-rps") from None
    workload_size_or_exit(duration, rates)
    if sweep_rps:  # fail before the sweep runs, not after
        try:
            Path(plots_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.BadParameter(f"cannot create {plots_dir}: {exc.strerror}", param_hint="--plots-dir") from None

    rows = []
    for rate in rates:
        try:
            wl = parse_workload(workload, rate, duration, seed, max_model_len=model.engine.max_model_len)
        except WorkloadError as exc:
            raise click.BadParameter(str(exc), param_hint="--workload") from None
        for pol in policies:
            cfg = SimConfig(n_prefill=n_prefill, n_decode=n_decode, heartbeat_ms=heartbeat_ms, link=link,
                            tbt_guard=pol.traits.node_guard if tbt_guard is None else tbt_guard, truth=truth,
                            truth_scale=truth_scale, drift_node=drift_node, drift_scale=drift_scale,
                            drift_at_s=drift_at_s, noise=noise, seed=seed, prefix_caching=prefix_cache)
            row = run_one(wl, pol, model, pp, cfg, rps=rate)
            rows.append(row)
            click.echo(f"  {pol.spec} @ {rate or 'default'} rps: {row['requests']} requests, "
                       f"{row['sim_seconds']:.0f} sim s in {row['wall_seconds']:.1f} wall s "
                       f"({row['speedup']}x real time)", err=True)
    click.echo(format_table(rows))
    if sweep_rps:
        title = sweep_title(workload, duration, n_prefill, n_decode, profile, link, seed)
        for p in plot_sweep(rows, plots_dir, pp, title=title):
            click.echo(f"plot: {p}", err=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
