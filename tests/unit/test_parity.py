"""One engine model, two clocks: the same arrivals through a virtual-clock driver (the simulator's
way) and through the node agent's real-time emulated backend produce the same step plans, and the
wall-clock step ends track the virtual ones (absolute deadlines, no accumulated drift)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.node_agent.backend import EmulatedBackend
from shared.engine import Engine, EngineConfig
from tests.factories import tiny_model

# ~2-6 ms steps: the tiny model scaled down 10x
MODEL = tiny_model(prefill_intercept_ms=1.0, prefill_coef=(0.01, 0.00001), decode_intercept_ms=2.0,
                   decode_coef=(0.1, 0.0001), mixed_delta_coef=(0.01, 0.0, 0.0001, 0.0))
DEFLECTED = [("a", 300, 6, [110, 60, 20]), ("b", 120, 4, [60]), ("c", 50, 3, [])]
PREFILLS = [("p1", 250), ("p2", 90), ("p3", 400)]


def virtual_run(role: str) -> list[tuple]:
    """The simulator's driver: plan, advance virtual time by duration, commit."""
    eng = Engine(EngineConfig.from_limits(role, MODEL.engine), MODEL)
    add(eng, role)
    out, now = [], 0.0
    while (plan := eng.plan_step()) is not None:
        now += plan.duration_ms
        eng.commit_step(plan)
        out.append((plan.decode_ids, plan.prefill_chunks, plan.deflected_chunk, round(now, 6)))
    return out


def add(eng, role: str) -> None:
    if role == "decode":
        for rid, prompt, output, sched in DEFLECTED:
            eng.add_deflected(rid, prompt, output, sched)
    else:
        for rid, prompt in PREFILLS:
            eng.add_prefill(rid, prompt)


async def realtime_run(role: str) -> list[tuple]:
    backend = EmulatedBackend(role, MODEL)
    add(backend, role)
    stop = asyncio.Event()
    steps: list = []
    t0 = time.monotonic()
    expected = len(virtual_run(role))

    async def on_step(s) -> None:
        steps.append((s, (time.monotonic() - t0) * 1000.0))
        if len(steps) == expected:
            stop.set()

    async def on_allocated(ids) -> None:  # no remote decodes in these cases
        raise AssertionError(ids)

    await asyncio.wait_for(backend.run(on_step, on_allocated, stop), timeout=30)
    return steps


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_same_arrivals_same_step_plans_on_both_clocks(role):
    virtual = virtual_run(role)
    real = await realtime_run(role)
    assert len(virtual) >= 8
    assert [(s.prefill_chunks, s.deflected_chunk) for s, _ in real] == [(v[1], v[2]) for v in virtual]
    # wall-clock step ends follow the virtual clock: no drift accumulates over the run
    end_virtual = virtual[-1][3]
    end_real = real[-1][1]
    assert end_real >= end_virtual - 1.0
    assert end_real - end_virtual < 0.25 * end_virtual + 15.0
