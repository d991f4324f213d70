"""``kairos profile``: measure one decode node's step latencies and publish a fitted latency model.

Against a running cluster (``--nats-url``, the node named by ``--node``), or self-contained with
``--emulated``: a bundled nats-server and one emulated decode-node agent as child processes
(``--truth-profile``/``--truth-scale`` set what its steps really take; the fit should recover that,
not the model the node predicts with). The grid and the service are ``shared.profiling`` and
``services.profiler``; this module only starts/stops processes and prints.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from services.node_agent.config import AgentConfig
from shared.envconfig import to_env
from shared.latency import FitRefused, LatencyModel, load_profile
from shared.profiling import GRIDS, fit_summary


@dataclass(frozen=True)
class ProfileOptions:
    """Options of ``kairos profile`` (see ``kairos profile --help``)."""

    node: str = "decode-0"
    nats_url: str | None = None
    emulated: bool = False
    node_profile: str = "a100-dsv2lite"
    truth_profile: str | None = None
    truth_scale: float = 1.0
    grid: str = "quick"
    name: str | None = None
    version: str | None = None
    out: str | None = None
    publish: bool = True
    max_mape: float | None = 10.0
    base_profile: str = "a100-dsv2lite"
    engine: str | None = None
    served_model: str = "kairos-emulated"
    label: str | None = None
    background: str = "handoff"
    quiet: bool = False
    connect_timeout_s: float = 10.0
    replay: str | None = None  #: workload spec replayed after the grid (``azure-code:busiest``, ``bursty``)
    replay_duration_s: float = 30.0
    replay_rps: float | None = None


def _start_emulated(stack: ExitStack, opts: ProfileOptions) -> str:
    """A bundled nats-server and one emulated decode agent (child processes); returns the NATS URL."""
    from kairos.up import _port_open, free_port, nats_server_binary

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kairos-profile-")))
    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp / "js")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    stack.callback(_stop, nats)
    deadline = time.monotonic() + 10
    while not _port_open("127.0.0.1", port):
        if nats.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("nats-server did not start")
        time.sleep(0.05)
    url = f"nats://127.0.0.1:{port}"
    cfg = AgentConfig(node_id=opts.node, role="decode", profile=opts.node_profile, nats_url=url, metrics_port=-1,
                      truth_profile=os.path.abspath(opts.truth_profile) if opts.truth_profile and
                      Path(opts.truth_profile).exists() else opts.truth_profile,
                      truth_scale=opts.truth_scale, log_format="json", log_level="warning")
    log = open(tmp / "agent.log", "wb")
    stack.callback(log.close)
    agent = subprocess.Popen([sys.executable, "-m", "services.node_agent"],
                             env={**os.environ, **to_env(cfg), "PYTHONUNBUFFERED": "1"}, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             cwd=str(Path(__file__).resolve().parent.parent))
    stack.callback(_stop, agent)
    return url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _profile(opts: ProfileOptions, url: str, base: LatencyModel) -> tuple[LatencyModel, dict[str, int]]:
    from services.profiler.service import Profiler, fit_run, publish_model
    from shared.bus import close, connect, connect_service
    from shared.envconfig import ServiceConfig, from_env

    # a running cluster: log in as KAIROS_NATS_USER (role ``profiler``) with its password/TLS files
    # from the environment, as the services do; the bundled --emulated NATS has no authentication
    login = connect(url, "kairos-profile") if opts.emulated else connect_service(
        from_env(ServiceConfig, nats_url=url), "kairos-profile")
    try:  # connect() retries forever (services may start before NATS); a one-shot command gives up
        nc = await asyncio.wait_for(login, opts.connect_timeout_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"cannot reach NATS at {url} within {opts.connect_timeout_s:g} s") from None
    try:
        say = (lambda line: None) if opts.quiet else (lambda line: print(f"kairos profile: {line}", file=sys.stderr,
                                                                         flush=True))
        grid = GRIDS[opts.grid]
        replay = []
        if opts.replay:
            from shared.workloads import parse_workload

            replay = parse_workload(opts.replay, opts.replay_rps, opts.replay_duration_s, 1,
                                    max_model_len=base.engine.max_model_len)
        run = await Profiler(nc, opts.node, grid, background=opts.background, served_model=opts.served_model,
                             progress=say).run(replay)
        engine = opts.engine or ("emulated (kairos shared.engine)" if opts.emulated else "unknown")
        label = opts.label or (f"{engine}, node {opts.node}, grid {opts.grid}"
                               + (f", replay {opts.replay} {opts.replay_duration_s:g} s" if opts.replay else ""))
        model = fit_run(run, node=opts.node, grid_name=opts.grid, grid=grid, name=opts.name or f"profiled-{opts.node}",
                        version=opts.version, base=base, engine=engine, served_model=opts.served_model, label=label,
                        max_mape=opts.max_mape)
        revisions = await publish_model(nc, model) if opts.publish else {}
        return model, revisions
    finally:
        await close(nc)


def run_profile(opts: ProfileOptions) -> LatencyModel:
    """Profile, fit, write the artifact, publish. Prints the fit report on stdout.

    Raises:
        FitRefused: held-out MAPE above ``max_mape`` (nothing written or published).
        services.profiler.service.ProfileError: the node did not run the profiler's work.
        RuntimeError: the bundled nats-server did not start.
    """
    base = load_profile(opts.base_profile)
    with ExitStack() as stack:
        url = _start_emulated(stack, opts) if opts.emulated else (opts.nats_url or "nats://127.0.0.1:4222")
        try:
            model, revisions = asyncio.run(_profile(opts, url, base))
        except FitRefused as exc:
            print(fit_summary(exc.model))
            raise
    out = Path(opts.out or f"out/profiles/{model.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(fit_summary(model))
    print(f"wrote {out}")
    for key, rev in revisions.items():
        print(f"published KV kairos_models/{key} (revision {rev})")
    return model
