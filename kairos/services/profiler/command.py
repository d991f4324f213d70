"""The profiler's command line: ``python -m kairos.services.profiler`` profiles one decode node of a
running cluster (:func:`kairos.services.profiler.session.profile_node`).

Its options are defined once, here (:data:`OPTIONS`), and ``kairos profile`` (kairos/cli/commands/
profile.py) uses the same definitions for the same options beside its self-contained modes
(``--emulated``, ``--vllm``, ``--testbed``: they start processes, so they are the CLI's); so are
the checks before a run (:func:`workload_or_exit`, :func:`artifact_folder_or_exit`) and the way a
failed run ends (:func:`run_or_exit`: one line on stderr, exit 1 for a failed or refused run, 2 for
bad settings, 130 when interrupted).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable

import click

from kairos.core.model.latency import DEFAULT_PROFILE
from kairos.core.model.profiling import GRIDS
from kairos.core.workload.workloads import WorkloadError, parse_workload

PROG = "python -m kairos.services.profiler"
#: NATS of a running cluster when ``--nats-url`` is not given
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

#: the help of ``--nats-url`` (both commands)
NATS_URL_HELP = f"NATS of a running cluster (default {DEFAULT_NATS_URL})."

#: the running-cluster options, by parameter name: the same definition in both commands
OPTIONS: dict[str, Callable] = {
    "node": click.option("--node", default="decode-0", show_default=True, help="Decode node to profile."),
    "nats_url": click.option("--nats-url", default=None, help=NATS_URL_HELP),
    "grid": click.option(
        "--grid", type=click.Choice(sorted(GRIDS)), default=None,
        help="quick (~15 s emulated; the default), the paper's §3.2 grid (minutes), cpu-testbed (the --vllm "
             "default: the testbed's operating region within its 2,048-token context, a few minutes), cpu-tiny "
             "(contexts ≤ 1,024, chunks ≤ 512) or cpu-tiny-ci (its smallest fittable grid)."),
    "name": click.option("--name", default=None, help="Artifact name (default profiled-<node>)."),
    "version_": click.option("--version", "version_", default=None,
                             help="Artifact version (default: UTC time of the fit)."),
    "out": click.option("--out", type=click.Path(dir_okay=False), default=None,
                        help="Artifact path (default out/profiles/<name>.json)."),
    "records_out": click.option(
        "--records", "records_out", type=click.Path(dir_okay=False), default=None,
        help="Also write the raw step records (JSON lines, kairos.steps.<node> messages) to this file."),
    "publish": click.option(
        "--publish/--no-publish", default=None,
        help="Put it into KV kairos_models (latency.<name> and latency.current; dispatchers hot-reload). "
             "Default: on, except with --emulated/--vllm (their NATS goes away with them)."),
    "max_mape": click.option(
        "--max-mape", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
        help="Refuse (exit 1, nothing written) if a model's held-out MAPE exceeds this, percent."),
    "base_profile": click.option(
        "--base-profile", default=None,
        help=f"KV-transfer links and engine limits are carried over from this profile (default {DEFAULT_PROFILE}; "
             "cpu-testbed-vllm with --vllm, whose vLLM server also gets its engine limits)."),
    "engine": click.option("--engine", default=None,
                           help="Engine label for the provenance (e.g. 'vllm 0.11.0 CPU')."),
    "served_model": click.option(
        "--served-model", default=None,
        help="Model name of the requests and label for the provenance (default kairos-emulated; kairos-vllm "
             "with --vllm)."),
    "label": click.option("--label", default=None, help="What this artifact is, in words (recorded in its metadata)."),
    "background": click.option(
        "--background", type=click.Choice(["handoff", "deflect"]), default=None,
        help="Start the background decodes by KV handoffs (all at once) or deflect jobs (one by one, "
             "prefilled on the node: for backends that cannot pull a pseudo KV cache; the --vllm default). "
             "Default handoff."),
    "replay": click.option(
        "--replay", default=None, metavar="WORKLOAD",
        help="After the grid, replay this workload on the node (as for `kairos sim --workload`, e.g. "
             "azure-code:busiest) for realistic step mixes."),
    "replay_duration_s": click.option(
        "--replay-duration", "replay_duration_s", type=click.FloatRange(0, min_open=True), default=30.0,
        show_default=True, help="Seconds of --replay workload."),
    "replay_rps": click.option("--replay-rps", type=click.FloatRange(0, min_open=True), default=None,
                               help="Rate of --replay."),
    "connect_timeout_s": click.option(
        "--connect-timeout", "connect_timeout_s", type=click.FloatRange(0, min_open=True), default=10.0,
        show_default=True, help="Give up if NATS cannot be reached within this many seconds."),
}


def options(*names: str) -> Callable:
    """A decorator adding the :data:`OPTIONS` named ``names`` to a click command, in that order."""
    def apply(f: Callable) -> Callable:
        for name in reversed(names):  # click lists the decorator nearest the function first
            f = OPTIONS[name](f)
        return f
    return apply


def workload_or_exit(spec: str, rps: float | None, duration_s: float, seed: int, option: str) -> list:
    """:func:`kairos.core.workload.workloads.parse_workload` of a workload option, or a usage error
    (exit 2) naming ``option``."""
    try:
        return parse_workload(spec, rps, duration_s, seed)
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


def artifact_folder_or_exit(out: Path) -> None:
    """Create the folder of the artifact path ``out`` before minutes of profiling are spent, or a
    usage error (exit 2) naming ``--out``."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create the artifact's folder {out.parent}: {exc}", param_hint="--out") from None


def run_or_exit(run: Callable[[], Any], *, prog: str, publish: bool, failures: tuple[type[Exception], ...] = (),
                interrupted: str = "interrupted; nothing was written", longer: str = "a larger --grid",
                nats_url_option: str | None = None) -> None:
    """Run ``run()`` (a profiling run that writes its artifact) as a command: SIGTERM is taken as
    Ctrl-C (what ``run`` started is stopped on the way out), and a failure ends the process with one
    line ``<prog>: <reason>`` on stderr — no traceback:

    * exit 130: interrupted (``interrupted`` says what was left behind);
    * exit 1: the fit was refused (:class:`~kairos.core.model.fitting.FitRefused`: held-out MAPE over
      ``--max-mape``; nothing written, nor published with ``publish``), the node did not run the
      work (:class:`~kairos.services.profiler.results.ProfileRunError`), NATS or a server could not
      be reached (RuntimeError), a file could not be written (OSError), one of ``failures``, or too
      few steps of a kind to fit (ValueError; ``longer`` says what records more);
    * exit 2: the environment's ``KAIROS_NATS_*`` settings are invalid
      (:class:`~kairos.runtime.envconfig.ConfigError`, :class:`~kairos.runtime.bus.BusAuthError`);
      ``nats_url_option``: the NATS URL came from that command-line option, not ``KAIROS_NATS_URL``,
      so an error about it names the option.
    """
    from kairos.core.model.fitting import FitRefused
    from kairos.runtime.bus import BusAuthError
    from kairos.runtime.envconfig import ConfigError
    from kairos.services.profiler.results import ProfileRunError

    def on_term(signum, _frame) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        run()
    except KeyboardInterrupt:
        click.echo(f"{prog}: {interrupted}", err=True)
        sys.exit(130)
    except FitRefused as exc:
        click.echo(f"{prog}: {exc}; no artifact written{' or published' if publish else ''} "
                   f"(--max-mape sets the limit; single CPU steps are noisy: docs/calibration.md)", err=True)
        sys.exit(1)
    except (ProfileRunError, RuntimeError, OSError, *failures) as exc:
        click.echo(f"{prog}: {exc}", err=True)
        sys.exit(1)
    except (ConfigError, BusAuthError) as exc:
        click.echo(f"{prog}: {_named(str(exc), nats_url_option)}", err=True)
        sys.exit(2)
    except ValueError as exc:
        click.echo(f"{prog}: {exc}; a longer run records more ({longer})", err=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _named(message: str, nats_url_option: str | None) -> str:
    """``message`` (a ConfigError's, which names ``KAIROS_NATS_URL`` for a bad URL, kairos/runtime/envconfig.py)
    naming ``nats_url_option`` instead where the URL came from that option."""
    env = "KAIROS_NATS_URL: "
    return nats_url_option + ": " + message[len(env):] if nats_url_option and message.startswith(env) else message


@click.command()
@options("node")
# the service's --nats-url defaults to KAIROS_NATS_URL, which every other service reads (kairos/runtime/envconfig.py);
# kairos profile's does not: its --emulated/--vllm start their own NATS and refuse a --nats-url
@click.option("--nats-url", default=None, envvar="KAIROS_NATS_URL", show_envvar=True, help=NATS_URL_HELP)
@options("grid", "name", "version_", "out", "records_out", "publish", "max_mape", "base_profile",
         "engine", "served_model", "label", "background", "replay", "replay_duration_s", "replay_rps",
         "connect_timeout_s")
def profile_running_node(nats_url: str | None, base_profile: str | None, out: str | None, version_: str | None,
                         **kw: Any) -> None:
    """Profile a decode node of a running cluster over the bus, fit the latency model, write and
    publish the artifact. The self-contained modes (--emulated, --vllm, --testbed: a bundled NATS
    and node started for the run) are `kairos profile`'s."""
    import asyncio

    from kairos.core.model.fitting import FitRefused
    from kairos.core.model.latency import LatencyProfileError, load_profile
    from kairos.core.model.profiling import fit_summary
    from kairos.services.profiler.session import (NodeProfileOptions, command_line, default_artifact_path,
                                                  profile_node, write_artifact)

    opts = NodeProfileOptions(**{k: v for k, v in kw.items() if v is not None}, version=version_,
                              prog=PROG, command=command_line(PROG))
    try:
        base = load_profile(base_profile or DEFAULT_PROFILE)
    except LatencyProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-profile") from None
    if opts.replay:
        workload_or_exit(opts.replay, opts.replay_rps, opts.replay_duration_s, 1, "--replay")
    artifact_folder_or_exit(Path(out) if out else default_artifact_path(opts.name or "profiled"))

    def run() -> None:
        try:
            model, revisions = asyncio.run(profile_node(opts, nats_url or DEFAULT_NATS_URL, base))
        except FitRefused as exc:
            print(fit_summary(exc.model))
            raise
        write_artifact(model, out, revisions)

    typed = click.get_current_context().get_parameter_source("nats_url") == click.core.ParameterSource.COMMANDLINE
    run_or_exit(run, prog=PROG, publish=opts.publish, nats_url_option="--nats-url" if typed else None)


def main(argv: list[str] | None = None) -> None:
    """``python -m kairos.services.profiler`` with the options in ``argv`` (default: this process's);
    exits as the command does (0; 1 for a failed or refused run; 2 for bad options or settings)."""
    profile_running_node.main(args=argv, prog_name=PROG)
