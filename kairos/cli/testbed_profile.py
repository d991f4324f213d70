"""``kairos profile --vllm --testbed WORKLOAD``: the CPU testbed's latency profile from the steps its
engines run while it serves a workload.

Why not the grid alone: on the 1P1D testbed of ``kairos up --engine vllm`` the engines' steps
under serving load are slower than the same step shapes measured on an otherwise quiet node — the
other engine computes on the second core, the control plane (ingress, dispatcher, aggregator,
agents, NATS, the client) and the KV transfers (NIXL's UCX progress threads, in the engines'
processes) take CPU time on both cores, and that grows with the load. A profile measured beside an
idle stack, even with the other engine kept prefilling (:mod:`kairos.cli.coload`), predicts the steps a
loaded testbed runs too fast, and a chunk planned just under τ then breaks it (docs/calibration.md
shows the per-kind ratios of the grid-only profile on a live run). So this mode measures the
testbed itself:

1. start the whole stack exactly as ``kairos demo --engine vllm`` does (:class:`kairos.cli.up.Supervisor`,
   1P1D, one dispatcher, policy ``kairos`` on ``--base-profile`` with its β, the demo's SLOs: how much
   the decode engine deflects sets how loaded each core is);
2. replay a *training* workload (``--testbed`` spec, rate, duration, seed — a seed other than the
   demo's, so the demo's run is held out) through the ingress with ``kairos bench``'s client, while
   a NATS client logged in as the ``profiler`` role records every engine step of both nodes
   (``kairos.steps.*``; the plugin's records carry each prefill chunk's context,
   ``kairos.engines.vllm.plugin.protocol.PrefillChunk``);
3. fit the latency model on those steps (:func:`kairos.core.model.fitting.fit_latency_model`: held-out MAPE per
   kind; no warm-up rule — every live step is a step serving sees).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from kairos.core.model.fitting import fit_latency_model
from kairos.core.model.latency import LatencyModel
from kairos.core.model.profiling import decode_spread, default_version, provenance, step_records
from kairos.contracts.wire import StepRecordEvent

#: a replay is over when no step record came for this long after the client finished (the agents
#: batch records for ≤ 50 ms; a last long prefill step of the testbed takes < 1 s)
QUIET_S = 2.0
#: the testbed's own NATS is up when its stack is: a login that takes longer has failed
CONNECT_TIMEOUT_S = 10.0


async def record_steps(nats_url: str, password_file: str | None, replay: Any, quiet_s: float = QUIET_S,
                       idle_nodes: tuple[str, ...] = ()) -> tuple[list[StepRecordEvent], Any, dict[str, int]]:
    """Record every step record on ``kairos.steps.*`` (as the ``profiler`` NATS user with the
    password in ``password_file``; None: no login) while ``replay()`` (a blocking callable: the
    bench client) runs in a thread, then until no record came for ``quiet_s``. Before the replay,
    waits (≤ 30 s) for a heartbeat of each of ``idle_nodes`` and keeps its free KV tokens (the idle
    engine's KV capacity). Returns (records in arrival order, ``replay()``'s result,
    ``{node: idle free KV tokens}``).

    Raises:
        RuntimeError: NATS refused the connection (with its reason), or an idle node sent no heartbeat.
    """
    from kairos.contracts import subjects as S
    from kairos.runtime.bus import close, connect_within
    from kairos.services.profiler.session import CLIENT_NAME
    from kairos.runtime.envconfig import ServiceConfig, from_env
    from kairos.contracts.wire import NodeState, WireError, decode, decode_step_records

    events: list[StepRecordEvent] = []
    last = [time.monotonic()]
    idle: dict[str, int] = {}
    heard = asyncio.Event()

    async def on_state(msg) -> None:
        try:
            st = decode(msg.data, NodeState)
        except WireError:
            return
        if st.node in idle_nodes and st.node not in idle:
            idle[st.node] = st.free_kv_tokens
            if set(idle) == set(idle_nodes):
                heard.set()

    async def on_steps(msg) -> None:
        try:
            events.extend(decode_step_records(msg.data))
        except WireError:
            return
        last[0] = time.monotonic()

    cfg = None if password_file is None else from_env(ServiceConfig, nats_url=nats_url, nats_user="profiler",
                                                       nats_password_file=password_file)
    nc = await connect_within(nats_url, CONNECT_TIMEOUT_S, cfg, name=CLIENT_NAME)
    try:
        await nc.subscribe(S.STEPS_WILDCARD, cb=on_steps)
        if idle_nodes:
            await nc.subscribe(S.STATE_WILDCARD, cb=on_state)
        await nc.flush()
        if idle_nodes:
            try:
                await asyncio.wait_for(heard.wait(), 30.0)
            except asyncio.TimeoutError:
                raise RuntimeError(f"no heartbeat from {sorted(set(idle_nodes) - set(idle))} within 30 s") from None
        result = await asyncio.to_thread(replay)
        while time.monotonic() - last[0] < quiet_s:
            await asyncio.sleep(0.2)  # a one-shot tool waits for the last batches, not a test
    finally:
        await close(nc)
    return events, result, idle


def run_testbed_profile(opts: Any, base: LatencyModel) -> LatencyModel:
    """Up the testbed, replay ``opts.testbed`` while recording, stack down, fit (see the module
    docstring). ``opts``: a :class:`kairos.cli.profile.ProfileOptions` with ``vllm`` and ``testbed`` set;
    ``base``: its base profile (the stack plans with it; its links and engine limits are carried
    over). With ``opts.records_out`` the records are written there; the artifact is
    :func:`kairos.cli.profile.run_profile`'s to write.

    Raises:
        kairos.core.model.fitting.FitRefused: held-out MAPE above ``opts.max_mape``.
        ValueError: too few steps of a kind to fit.
        RuntimeError: the stack did not start, or its NATS refused the profiler.
        kairos.cli.bench.BenchError: the replay could not run.
    """
    from kairos.cli.bench import bench_cli
    from kairos.cli.demo import vllm_testbed_options
    from kairos.engines.vllm.facts import VLLM_ENGINE_LABEL, measured_engine_facts, model_card
    from kairos.engines.vllm.launch import cached_tiny_model
    from kairos.cli.up import Supervisor
    from kairos.services.profiler.results import load_average_since, write_records
    from kairos.services.profiler.session import command_line

    model_dir = opts.model_dir or cached_tiny_model(size=opts.model_size)
    # the demo's stack and planning (β too) on the base profile: how much the decode engine deflects
    # decides how loaded each core is, and the steps' speed depends on it
    up = vllm_testbed_options(model_dir, profile=opts.base_profile, served_model=opts.served_model)
    sup = Supervisor(up, out=sys.stderr)
    load_before = os.getloadavg()
    started = time.time() * 1000.0
    try:
        sup.up()
        nats_url = next(c.endpoint for c in sup.procs if c.endpoint.startswith("nats://"))
        if not sup.creds or "profiler" not in sup.creds:
            raise RuntimeError("the testbed stack has no profiler credential (kairos up without NATS auth?)")

        def replay() -> dict[str, Any]:
            return bench_cli(url=f"http://127.0.0.1:{up.port}", workload=opts.testbed, rps=opts.testbed_rps,
                             duration=opts.testbed_duration_s, seed=opts.testbed_seed, model=None, max_concurrency=None,
                             request_timeout=300.0, max_model_len=None, label="testbed profile replay", json_path=None,
                             save_records=False, progress=not opts.quiet, tbt_slo_ms=up.tbt_slo_ms,
                             ttft_slo_ms=up.ttft_slo_ms)

        events, report, idle = asyncio.run(record_steps(nats_url, str(sup.creds["profiler"]), replay,
                                                        idle_nodes=("decode-0",)))
    finally:
        sup.finish()
    if opts.records_out:
        write_records(opts.records_out, events)
    card = model_card(model_dir)
    meta = provenance(
        node="prefill-0, decode-0", grid_name="testbed replay", grid=None, events=events, engine=VLLM_ENGINE_LABEL,
        served_model=opts.served_model, label=opts.label or f"{VLLM_ENGINE_LABEL}, the 1P1D CPU testbed serving "
        f"{opts.testbed}", started_unix_ms=started, finished_unix_ms=time.time() * 1000.0,
        extra={"testbed": {"workload": opts.testbed, "rps": opts.testbed_rps, "duration_s": opts.testbed_duration_s,
                           "seed": opts.testbed_seed, "sent": report.get("sent"), "completed": report.get("completed"),
                           "failed": report.get("failed"), "deflections": report.get("deflections"),
                           "steps_per_node": {n: sum(1 for e in events if e.node == n)
                                              for n in sorted({e.node for e in events})}},
               "load_average": load_average_since(load_before), "decode_spread": decode_spread(events),
               "model_card": card, "idle_free_kv_tokens": idle["decode-0"],
               "command": command_line("kairos") if opts.command is None else opts.command})
    return fit_latency_model(step_records(events), name=opts.name or "profiled-testbed",
                             version=opts.version or default_version(),
                             base=measured_engine_facts(base, card, idle["decode-0"]), metadata=meta,
                             max_mape=opts.max_mape)
