"""One engine model, two clocks: the same arrivals through a virtual-clock driver (the simulator's
way) and through the node agent's real-time emulated backend produce the same step plans, and the
wall-clock step ends track the virtual ones (absolute deadlines, no accumulated drift)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.node_agent.backend import EmulatedBackend
from shared.engine import Engine, EngineConfig
from shared.wire import InferenceRequest
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


def request(rid: str, prompt: int, output: int = 1) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=output,
                            created_unix_ms=0.0, deadline_unix_ms=1e15)


def add_to_backend(backend: EmulatedBackend, role: str) -> None:
    if role == "decode":
        for rid, prompt, output, sched in DEFLECTED:
            backend.add_deflected(request(rid, prompt, output), sched)
    else:
        for rid, prompt in PREFILLS:
            backend.add_prefill(request(rid, prompt))


class Recorder:
    """The agent's side of EngineEvents: steps with their wall-clock end, and request events."""

    def __init__(self, expected: int, stop: asyncio.Event) -> None:
        self.steps: list = []
        self.events: list[tuple] = []
        self.expected, self.stop, self.t0 = expected, stop, time.monotonic()

    async def on_step(self, s) -> None:
        self.steps.append((s, (time.monotonic() - self.t0) * 1000.0))

    async def on_allocated(self, ids) -> None:  # no remote decodes in these cases
        raise AssertionError(ids)

    async def on_prefill_done(self, rid) -> None:
        self.events.append(("prefill_done", rid))
        self._check()

    async def on_tokens(self, rid, first_index, count, text) -> None:
        self.events.append(("tokens", rid, first_index, count))

    async def on_finished(self, rid, finish_reason, cached_tokens) -> None:
        self.events.append(("finished", rid, finish_reason))
        self._check()

    async def on_failed(self, rid, status, code, message) -> None:
        raise AssertionError((rid, code, message))

    def _check(self) -> None:
        if len(self.steps) == self.expected:
            self.stop.set()


async def realtime_run(role: str) -> tuple[list[tuple], list[tuple]]:
    backend = EmulatedBackend(role, MODEL)
    add_to_backend(backend, role)
    stop = asyncio.Event()
    rec = Recorder(len(virtual_run(role)), stop)
    await asyncio.wait_for(backend.run(rec, stop), timeout=30)
    return rec.steps, rec.events


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_same_arrivals_same_step_plans_on_both_clocks(role):
    virtual = virtual_run(role)
    real, events = await realtime_run(role)
    assert len(virtual) >= 8
    assert [(s.prefill_chunks, s.deflected_chunk) for s, _ in real] == [(v[1], v[2]) for v in virtual]
    # wall-clock step ends follow the virtual clock: no drift accumulates over the run
    end_virtual = virtual[-1][3]
    end_real = real[-1][1]
    assert end_real >= end_virtual - 1.0
    assert end_real - end_virtual < 0.25 * end_virtual + 15.0


async def test_emulated_backend_reports_request_events_from_its_steps():
    """Every output token is reported once, in order from index 0, then the request finishes
    with ``length``; prefill nodes report prefill done for each prompt and no tokens."""
    _steps, events = await realtime_run("decode")
    for rid, _prompt, output, _sched in DEFLECTED:
        mine = [e for e in events if e[1] == rid]
        assert mine == [("tokens", rid, i, 1) for i in range(output)] + [("finished", rid, "length")]
    _steps, events = await realtime_run("prefill")
    assert sorted(events) == sorted(("prefill_done", rid) for rid, _ in PREFILLS)
