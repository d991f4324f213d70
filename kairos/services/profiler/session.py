"""Profile one decode node of a running cluster: connect, run the grid, fit, publish, write.

The session of ``python -m kairos.services.profiler`` and of ``kairos profile`` (whose self-contained
modes, ``--emulated``/``--vllm``, first start a bundled nats-server and the node, then run this on
it: ``kairos.cli.profile``): :func:`profile_node` logs in to NATS (bounded:
:func:`kairos.runtime.bus.connect_within`), drives the node through the grid and an optional trace
replay (:class:`kairos.services.profiler.service.Profiler`), records the run's provenance, fits
(:func:`kairos.services.profiler.service.fit_run`) and publishes the artifact; :func:`write_artifact`
writes it and prints the fit report. :class:`NodeProfileOptions` is what it takes.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kairos.core.model.latency import LatencyModel
from kairos.core.model.profiling import GRIDS, decode_spread, fit_summary
from kairos.services.profiler.results import ProfileRunError, load_average_since, write_records

#: the NATS client name of a profiling session (the server's connection list shows it)
CLIENT_NAME = "kairos-profile"


@dataclass(frozen=True)
class NodeProfileOptions:
    """What profiling one decode node of a running cluster takes (the options of ``python -m
    kairos.services.profiler``; ``kairos.cli.profile.ProfileOptions`` builds one for ``kairos profile``).

    Attributes:
        node: the decode node's id.
        grid: a name of :data:`kairos.core.model.profiling.GRIDS`.
        background: how background decodes start: ``handoff`` (KV handoffs) or ``deflect`` (deflect jobs).
        served_model: the model name the requests carry, recorded in the provenance.
        name: artifact name (None: ``profiled-<node>``).
        version: artifact version (None: the UTC time of the fit).
        max_mape: refuse the fit (:class:`kairos.core.model.fitting.FitRefused`) above this held-out
            MAPE, percent (None: never).
        publish: put the artifact into KV ``kairos_models`` (``latency.<name>``, ``latency.current``).
        records_out: also write the raw step records there (JSON lines), a failed run's too.
        replay: a workload spec replayed on the node after the grid (``azure-code:busiest``), for
            realistic step mixes; ``replay_duration_s`` seconds of it at ``replay_rps`` (None: the spec's rate).
        label: what the artifact is, in words (None: engine, node, grid and replay).
        engine: the engine label of the provenance.
        command: the command line recorded in the provenance (the front end's :func:`command_line`;
            None: this process's ``sys.argv``).
        quiet: no progress lines (one per grid point, on stderr, prefixed ``<prog>:``).
        connect_timeout_s: give up when NATS cannot be reached within this (seconds).
        login: log in as the environment's ``KAIROS_NATS_*`` user with its password/TLS files, as the
            services do (a running cluster); False: no credentials (a bundled nats-server).
        measure_engine_facts: the run's model card and the idle node's free KV replace the base
            profile's KV bytes per token and KV capacity
            (:func:`kairos.engines.vllm.facts.measured_engine_facts`: a vLLM node).
        prog: the command's name in its progress lines.
    """

    node: str = "decode-0"
    grid: str = "quick"
    background: str = "handoff"
    served_model: str = "kairos-emulated"
    name: str | None = None
    version: str | None = None
    max_mape: float | None = 10.0
    publish: bool = True
    records_out: str | None = None
    replay: str | None = None
    replay_duration_s: float = 30.0
    replay_rps: float | None = None
    label: str | None = None
    engine: str = "unknown"
    command: str | None = None
    quiet: bool = False
    connect_timeout_s: float = 10.0
    login: bool = True
    measure_engine_facts: bool = False
    prog: str = "kairos profile"


def command_line(prog: str) -> str:
    """This process's command line as ``prog`` and its arguments, shell-quoted (the provenance's
    ``command``; ``prog`` names the entry point: ``kairos``, ``python -m kairos.services.profiler``)."""
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


async def profile_node(opts: NodeProfileOptions, url: str, base: LatencyModel,
                       info: dict[str, Any] | None = None) -> tuple[LatencyModel, dict[str, int]]:
    """Profile node ``opts.node`` through the NATS at ``url`` and fit its latency model on ``base``
    (its KV-transfer links and engine limits are carried over; ``base.engine.max_model_len`` bounds
    the grid and the replay). ``info``: more provenance for the artifact's metadata; a callable
    value is called once the measurements end and its result recorded (a co-load's ``stop``).

    Returns:
        (the fitted model, ``{KV key: revision}`` of what was published — empty unless ``opts.publish``).

    Raises:
        RuntimeError: NATS cannot be reached within ``opts.connect_timeout_s`` or refused the login.
        kairos.runtime.envconfig.ConfigError: the environment's ``KAIROS_NATS_*`` settings are invalid.
        ProfileRunError: the node refused, lost or never ran the profiler's work (with
            ``opts.records_out``, the records collected until then are written there).
        kairos.core.model.fitting.FitRefused: held-out MAPE above ``opts.max_mape`` (nothing published).
        ValueError: too few valid steps of a kind to fit, or a bad ``opts.replay`` spec.
    """
    from kairos.runtime.bus import close, connect_within
    from kairos.runtime.envconfig import ServiceConfig, from_env
    from kairos.services.profiler.service import Profiler, fit_run, publish_model

    cfg = from_env(ServiceConfig, nats_url=url) if opts.login else None
    nc = await connect_within(url, opts.connect_timeout_s, cfg, name=CLIENT_NAME)
    try:
        say: Callable[[str], None] = (lambda line: None) if opts.quiet else (
            lambda line: print(f"{opts.prog}: {line}", file=sys.stderr, flush=True))
        grid = GRIDS[opts.grid]
        replay = []
        if opts.replay:
            from kairos.core.workload.workloads import parse_workload

            replay = parse_workload(opts.replay, opts.replay_rps, opts.replay_duration_s, 1,
                                    max_model_len=base.engine.max_model_len)
        load_before = os.getloadavg()
        try:
            run = await Profiler(nc, opts.node, grid, background=opts.background, served_model=opts.served_model,
                                 progress=say, max_model_len=base.engine.max_model_len).run(replay)
        except ProfileRunError as exc:
            if opts.records_out and exc.partial is not None and exc.partial.events:
                write_records(opts.records_out, exc.partial.events)
                raise ProfileRunError(f"{exc} (the {len(exc.partial.events)} step records collected until then "
                                      f"are in {opts.records_out})") from exc
            raise
        run.extra["load_average"] = load_average_since(load_before)
        run.extra["decode_spread"] = decode_spread(run.events)
        run.extra.update({k: v() if callable(v) else v for k, v in (info or {}).items()})
        run.extra["command"] = " ".join(map(shlex.quote, sys.argv)) if opts.command is None else opts.command
        label = opts.label or (f"{opts.engine}, node {opts.node}, grid {opts.grid}"
                               + (f", replay {opts.replay} {opts.replay_duration_s:g} s" if opts.replay else ""))
        if opts.measure_engine_facts:
            from kairos.engines.vllm.facts import measured_engine_facts

            base = measured_engine_facts(base, run.extra.get("model_card"), run.extra.get("idle_free_kv_tokens"))
        if opts.records_out:
            write_records(opts.records_out, run.events)
        model = fit_run(run, node=opts.node, grid_name=opts.grid, grid=grid, name=opts.name or f"profiled-{opts.node}",
                        version=opts.version, base=base, engine=opts.engine, served_model=opts.served_model,
                        label=label, max_mape=opts.max_mape)
        revisions = await publish_model(nc, model) if opts.publish else {}
        return model, revisions
    finally:
        await close(nc)


def default_artifact_path(name: str) -> Path:
    """Where an artifact named ``name`` is written without ``--out``: ``out/profiles/<name>.json``."""
    return Path(f"out/profiles/{name}.json")


def write_artifact(model: LatencyModel, out: str | None, revisions: dict[str, int]) -> Path:
    """Write ``model`` to ``out`` (None: :func:`default_artifact_path` of its name; the folder is
    created) and print its fit report (:func:`kairos.core.model.profiling.fit_summary`), the path and
    the published ``revisions`` (``{KV key: revision}``) on stdout. Returns the path.

    Raises:
        OSError: the artifact cannot be written.
    """
    path = Path(out) if out else default_artifact_path(model.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    print(fit_summary(model))
    print(f"wrote {path}")
    for key, rev in revisions.items():
        print(f"published KV kairos_models/{key} (revision {rev})")
    return path
