"""``kairos profile``: measure one decode node's step latencies over the bus and fit, write and publish
its latency model (:mod:`kairos.cli.profile` runs it). The options it shares with ``python -m
kairos.services.profiler`` (profiling a node of a running cluster) are defined once, in
:mod:`kairos.services.profiler.command`; the self-contained modes (``--emulated``, ``--vllm``,
``--testbed``) are this command's own."""

from __future__ import annotations

from pathlib import Path

import click

from kairos.cli.options import load_model_or_exit
from kairos.core.model.latency import DEFAULT_PROFILE
from kairos.services.profiler.command import artifact_folder_or_exit, options, run_or_exit, workload_or_exit


@click.command()
@options("node", "nats_url")
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
@options("grid", "name", "version_", "out", "records_out", "publish", "max_mape", "base_profile", "engine",
         "served_model", "label", "background", "replay", "replay_duration_s", "replay_rps")
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
@options("connect_timeout_s")
def profile(**kw) -> None:
    """Profile a decode node over the bus, fit the latency model, write and publish the artifact."""
    from kairos.cli.bench import BenchError
    from kairos.cli.profile import ProfileOptions, ProfileOptionsError, run_profile
    from kairos.services.profiler.session import default_artifact_path

    kw["version"] = kw.pop("version_")
    try:
        opts = ProfileOptions(**kw)  # checks the combination, fills the engine-dependent defaults
    except ProfileOptionsError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    for opt in ("node_profile", "truth_profile", "base_profile"):
        if getattr(opts, opt):
            load_model_or_exit(getattr(opts, opt), "--" + opt.replace("_", "-"))
    if kw["replay"]:
        workload_or_exit(kw["replay"], kw["replay_rps"], kw["replay_duration_s"], 1, "--replay")
    if kw["testbed"]:
        reqs = workload_or_exit(kw["testbed"], opts.testbed_rps, kw["testbed_duration_s"], kw["testbed_seed"],
                                "--testbed")
        if not reqs:  # found before the stack starts, not after it ran
            raise click.BadParameter(f"{kw['testbed']} at {opts.testbed_rps:g} req/s for {kw['testbed_duration_s']:g} s "
                                     "has no requests: give a longer --testbed-duration", param_hint="--testbed")
    artifact_folder_or_exit(Path(opts.out) if opts.out else default_artifact_path(opts.name or "profiled"))
    # BenchError: --testbed's replay; the servers it started are stopped on the way out of run_profile
    run_or_exit(lambda: run_profile(opts), prog="kairos profile", publish=opts.publish, failures=(BenchError,),
                interrupted="interrupted; the servers it started are stopped, nothing was written",
                longer="--testbed-duration, a larger --grid", nats_url_option="--nats-url")
