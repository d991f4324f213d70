"""What the profiler measures on the node: the §3.2 grid's phases, in order, and the trace replay.

:func:`run_grid` walks :class:`kairos.core.model.profiling.ProfileGrid` — prefill-only steps with a
growing cached prefix (``prefill_chunks``), then per (B, context) point ``B`` background decodes and
deflected prefills of chunk χ beside them (``mixed_plan``, ``mixed_prefixes``) — skipping, with a
progress line, the points whose requests exceed the node's context or its free KV cache; then the
optional :func:`replay_trace`. How each action talks to the node (jobs, KV handoffs, cancels, its
heartbeats and step records) is :class:`kairos.services.profiler.service.Profiler`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Sequence

from kairos.core.workload.workloads import WorkloadRequest
from kairos.services.profiler.results import ProfileRunError

if TYPE_CHECKING:
    from kairos.services.profiler.service import Profiler


async def run_grid(prof: Profiler, replay: Sequence[WorkloadRequest]) -> None:
    """The body of :meth:`Profiler.run`: the grid's phases, the replay, the final idle heartbeat.

    Raises:
        ProfileRunError: the node is not a decode node, or refused, lost or never ran the work.
    """
    g = prof.grid
    await prof.until(lambda: prof.state is not None, 10.0, "sent no heartbeat")
    if prof.state.role != "decode":
        raise ProfileRunError(f"node {prof.node} is a {prof.state.role} node; profile a decode node "
                           "(its engine runs prefill-only, decode-only and mixed steps)")
    await prof.drain([])
    prof.result.extra["idle_free_kv_tokens"] = prof.state.free_kv_tokens  # the node's KV capacity, measured
    for n in g.prefill_chunks:  # prefill-only steps with a growing cached prefix
        prompt = g.chunk_steps * n
        if not prof.fits(prompt, 1):  # shortened to the context while a chunk follows the first
            prompt = prof.max_model_len - 1 if prof.max_model_len - 1 > n else 0
        if not prompt:
            prof.progress(f"prefill-only χ={n}: skipped, a chunk of {n} prompt tokens fills the node's "
                          f"context {prof.max_model_len}")
            continue
        for _ in range(g.repeats):
            await prof.measure_chunks(prompt, n)
        prof.progress(f"prefill-only χ={n}: {len(prof.result.events)} steps recorded")
    for batch, ctx, chis in g.mixed_plan():
        fit = [chi for chi in chis if prof.fits(g.chunk_steps * (chi - batch), 1)]
        if prof.background_tokens(ctx) < prof.grid.decode_dwell_steps or not fit:
            prof.progress(f"B={batch} ctx={ctx}: skipped, its requests exceed the node's context "
                          f"{prof.max_model_len}")
            continue
        if fit != chis:
            prof.progress(f"B={batch} ctx={ctx}: χ={sorted(set(chis) - set(fit))} skipped (prompts exceed "
                          f"the node's context {prof.max_model_len})")
            chis = fit
        need = batch * (ctx + prof.background_tokens(ctx))
        if prof.state is not None and need > prof.state.free_kv_tokens:
            prof.progress(f"B={batch} ctx={ctx}: skipped, needs {need} KV tokens, node has "
                          f"{prof.state.free_kv_tokens} free")
            continue
        rids = await prof.start_background(batch, ctx)
        for prefix in g.mixed_prefixes:
            for chi in chis:
                if not prof.fits(prefix + g.chunk_steps * (chi - batch), 1):
                    continue  # the prefixed run of a large χ: its prompt exceeds the context
                for _ in range(g.repeats):
                    await prof.measure_chunks(prefix + g.chunk_steps * (chi - batch), chi, batch, prefix)
        prof.progress(f"B={batch} ctx={ctx} χ={chis}: {len(prof.result.events)} steps recorded")
        await prof.drain(rids)
    if replay:
        counts = prof.result.replay_counts = await prof.replay(replay)
        prof.progress(f"replay of {len(replay)} requests {counts}: {len(prof.result.events)} steps recorded")
    # an idle heartbeat follows the records of every step before it (the node agent sends
    # them first): after it, nothing the run caused is still on its way
    await prof.drain(list(prof._live))


async def replay_trace(prof: Profiler, workload: Sequence[WorkloadRequest],
                       time_scale: float = 1.0) -> dict[str, int]:
    """Trace replay on the node (realistic mixes of B, K and chunks): each request at its
    arrival time (× ``time_scale``) becomes a deflection — its prefill runs here in chunks of
    the engine's budget, then it decodes — when none of the profiler's is in flight, else a KV
    handoff (it only decodes here). Requests the node refuses (too long, no memory) are
    skipped and counted. Everything still running at the end is cancelled.

    Returns:
        counts: ``deflected``, ``handed_off``, ``refused``.
    """
    counts = {"deflected": 0, "handed_off": 0, "refused": 0}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deflecting: asyncio.Task | None = None
    try:
        for i, w in enumerate(workload):
            delay = t0 + w.arrival_s * time_scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the replay (arrival times), not synchronization
            if deflecting is not None and deflecting.done():
                if deflecting.exception() is not None:
                    counts["refused"] += 1
                deflecting = None
            if deflecting is None:
                deflecting = asyncio.create_task(prof.deflect(w.prompt_tokens, [], w.output_tokens))
                counts["deflected"] += 1
            elif (await prof.handoff(w.prompt_tokens, w.output_tokens, i))[0] is None:
                counts["refused"] += 1
            else:
                counts["handed_off"] += 1
        if deflecting is not None:
            try:
                await deflecting
            except ProfileRunError:
                counts["refused"] += 1
    finally:
        if deflecting is not None and not deflecting.done():
            deflecting.cancel()
    await prof.drain(list(prof._live))
    return counts
