"""The real-time emulated backend against independent expectations (not against the engine model
it wraps): step compositions derived by hand from the chunking rules, step predictions from the
node's believed model and step wall times from a *different* ground-truth model, both evaluated
here with the latency formulas, and step ends that do not drift from the sum of the true times."""

from __future__ import annotations

import asyncio
import time

import pytest

from kairos.engines.emulated import EmulatedBackend
from kairos.core.engine_model import GroundTruth
from kairos.contracts.wire import InferenceRequest
from tests.factories import tiny_model

# the node believes ~2-6 ms steps (the tiny model scaled down 10x) ...
BELIEF = tiny_model(prefill_intercept_ms=1.0, prefill_coef=(0.01, 0.00001), decode_intercept_ms=2.0,
                    decode_coef=(0.1, 0.0001), mixed_delta_coef=(0.01, 0.0, 0.0001, 0.0))
# ... its steps really follow another form (larger intercepts, a p² term), 30 % slower on top
TRUTH = tiny_model(name="truth", prefill_intercept_ms=3.0, prefill_coef=(0.012, 0.00002), decode_intercept_ms=4.0,
                   decode_coef=(0.05, 0.0002), mixed_delta_coef=(0.005, 0.0001, 0.0001, 0.00001))
SCALE = 1.3


def truth_ms(B: int, K: int, p: int, c: float) -> float:
    """The truth's formulas written out (kairos/core/model/latency.py module docstring), × SCALE."""
    if p == 0:
        t = 4.0 + 0.05 * B + 0.0002 * K
    elif B == 0:
        t = 3.0 + 0.012 * p + 0.00002 * p * c
    else:
        t = 4.0 + 0.05 * B + 0.0002 * K + p * (0.005 + 0.0001 * p + 0.0001 * c + 0.00001 * K)
    return t * SCALE


def belief_ms(B: int, K: int, p: int, c: float) -> float:
    if p == 0:
        return 2.0 + 0.1 * B + 0.0001 * K
    if B == 0:
        return 1.0 + 0.01 * p + 0.00001 * p * c
    return 2.0 + 0.1 * B + 0.0001 * K + p * (0.01 + 0.0001 * c)


# Hand-derived from the chunking rules (budget 100 tokens; a deflected step carries
# min(remaining, χ_i − B, budget − B) prompt tokens, the last χ repeating; running decodes first):
# (B, K, prompt tokens, cached before)
DECODE_CASE = [("a", 300, 3, [90, 60, 20]), ("b", 120, 2, [60])]
DECODE_STEPS = (
    [(0, 0, 90, 0), (0, 0, 60, 90)] + [(0, 0, 20, 150 + 20 * i) for i in range(7)] + [(0, 0, 10, 290)]
    # a decodes (token 0 came with its last chunk): two more tokens while b prefills with χ − B = 59
    + [(1, 301, 59, 0), (1, 302, 59, 59)]
    # a finished; b's last 2 tokens, then b's one decode step
    + [(0, 0, 2, 118), (1, 121, 0, 0)]
)
# prefill node, FIFO chunked prefill sharing the 100-token budget
PREFILL_CASE = [("p1", 250), ("p2", 90), ("p3", 400)]
PREFILL_STEPS = [  # per step: [(req, tokens, cached)]
    [("p1", 100, 0)], [("p1", 100, 100)], [("p1", 50, 200), ("p2", 50, 0)], [("p2", 40, 50), ("p3", 60, 0)],
    [("p3", 100, 60)], [("p3", 100, 160)], [("p3", 100, 260)], [("p3", 40, 360)],
]


def request(rid: str, prompt: int, output: int = 1) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=output,
                            created_unix_ms=0.0, deadline_unix_ms=1e15)


class Recorder:
    """The agent's side of EngineEvents: steps with their wall-clock end, and the request events."""

    def __init__(self, expected: int, stop: asyncio.Event) -> None:
        self.steps: list = []
        self.events: list[tuple] = []
        self.expected, self.stop, self.t0 = expected, stop, time.monotonic()

    async def on_step(self, s) -> None:
        self.steps.append((s, (time.monotonic() - self.t0) * 1000.0))
        if len(self.steps) == self.expected:
            self.stop.set()  # the run loop still reports this step's request events

    async def on_allocated(self, ids) -> None:  # no remote decodes in these cases
        raise AssertionError(ids)

    async def on_prefill_done(self, rid) -> None:
        self.events.append(("prefill_done", rid))

    async def on_tokens(self, rid, first_index, count, text, finish_reason=None, stop_reason=None,
                        token_ids=None) -> None:
        self.events.append(("tokens", rid, first_index, count))

    async def on_finished(self, rid, finish_reason, cached_tokens, stop_reason=None) -> None:
        self.events.append(("finished", rid, finish_reason))

    async def on_failed(self, rid, status, code, message) -> None:
        raise AssertionError((rid, code, message))


async def realtime_run(backend: EmulatedBackend, expected: int, rec: Recorder | None = None) -> list[tuple]:
    stop = asyncio.Event()
    rec = rec or Recorder(expected, stop)
    rec.stop = stop
    await asyncio.wait_for(backend.run(rec, stop), timeout=30)
    return rec.steps


def check_times(real: list[tuple], comps: list[tuple[int, int, int, float]]) -> None:
    truths = [truth_ms(*c) for c in comps]
    for (s, _), c, t in zip(real, comps, truths):
        assert s.predicted_ms == pytest.approx(belief_ms(*c), rel=1e-9)  # predictions: the belief
        assert s.wall_ms >= t - 0.5  # a step never ends before its true time ...
        assert s.predicted_ms < t  # ... which is not the prediction (the test would catch a mix-up)
    # ... and the step ends follow the sum of the true times: no drift accumulates
    end_truth, end_real = sum(truths), real[-1][1]
    assert end_real >= end_truth - 1.0
    assert end_real - end_truth < 0.25 * end_truth + 15.0


async def test_decode_node_runs_hand_derived_chunks_in_true_time():
    backend = EmulatedBackend("decode", BELIEF, truth=GroundTruth(TRUTH, scale=SCALE))
    for rid, prompt, output, sched in DECODE_CASE:
        backend.add_deflected(request(rid, prompt, output), sched)
    real = await realtime_run(backend, len(DECODE_STEPS))
    got = [(s.batch_size, s.kv_tokens, s.prefill_tokens, s.prefill_chunks[0][2] if s.prefill_chunks else 0)
           for s, _ in real]
    assert got == DECODE_STEPS
    check_times(real, DECODE_STEPS)


async def test_prefill_node_runs_hand_derived_chunks_in_true_time():
    backend = EmulatedBackend("prefill", BELIEF, truth=GroundTruth(TRUTH, scale=SCALE))
    for rid, prompt in PREFILL_CASE:
        backend.add_prefill(request(rid, prompt))
    real = await realtime_run(backend, len(PREFILL_STEPS))
    assert [list(s.prefill_chunks) for s, _ in real] == PREFILL_STEPS
    comps = []
    for chunks in PREFILL_STEPS:
        n = sum(t for _, t, _ in chunks)
        comps.append((0, 0, n, sum(t * c for _, t, c in chunks) / n))
    check_times(real, comps)


async def test_emulated_backend_reports_request_events_from_its_steps():
    """Every output token is reported once, in order from index 0, then the request finishes with
    ``length``; a prefill node reports prefill done once per prompt and no tokens."""
    backend = EmulatedBackend("decode", BELIEF)
    for rid, prompt, output, sched in DECODE_CASE:
        backend.add_deflected(request(rid, prompt, output), sched)
    rec = Recorder(len(DECODE_STEPS), asyncio.Event())
    await realtime_run(backend, len(DECODE_STEPS), rec)
    for rid, _prompt, output, _sched in DECODE_CASE:
        mine = [e for e in rec.events if e[1] == rid]
        assert mine == [("tokens", rid, i, 1) for i in range(output)] + [("finished", rid, "length")]
    backend = EmulatedBackend("prefill", BELIEF)
    for rid, prompt in PREFILL_CASE:
        backend.add_prefill(request(rid, prompt))
    rec = Recorder(len(PREFILL_STEPS), asyncio.Event())
    await realtime_run(backend, len(PREFILL_STEPS), rec)
    assert sorted(rec.events) == sorted(("prefill_done", rid) for rid, _ in PREFILL_CASE)
