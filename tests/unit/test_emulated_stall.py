"""The real-time emulated engine after its process did not run (SIGSTOP, a starved host): it does not
replay the missed time in a burst of back-to-back steps, and a cancel that arrived meanwhile is read
before its next step (kairos/engines/emulated.py ``EmulatedBackend.run``). The stall is made by moving
the engine's clocks forward, as a stopped process finds them on SIGCONT."""

from __future__ import annotations

import asyncio
import time
import types

import kairos.engines.emulated as emulated
from kairos.engines.emulated import EmulatedBackend
from tests.unit.test_parity import BELIEF, Recorder, request

STALL_S = 5.0


def stalled_clock(monkeypatch) -> types.SimpleNamespace:
    """The engine module's ``time``, with an ``offset`` (s) added to both clocks."""
    clock = types.SimpleNamespace(offset=0.0)
    clock.monotonic = lambda: time.monotonic() + clock.offset
    clock.time = lambda: time.time() + clock.offset
    monkeypatch.setattr(emulated, "time", clock)
    return clock


class StallingRecorder(Recorder):
    """After step ``at``, the process "was stopped" for STALL_S and a cancel for ``rid`` arrives,
    handled by another task (as the node agent's NATS callback is)."""

    def __init__(self, backend: EmulatedBackend, clock, at: int, rid: str, stop: asyncio.Event) -> None:
        super().__init__(10 ** 6, stop)
        self.backend, self.clock, self.at, self.rid = backend, clock, at, rid
        self.cancelled_after_step: int | None = None

    async def on_step(self, s) -> None:
        await super().on_step(s)
        if len(self.steps) == self.at:
            self.clock.offset += STALL_S
            asyncio.get_running_loop().call_soon(self._cancel)

    def _cancel(self) -> None:
        self.cancelled_after_step = len(self.steps)
        self.backend.abort(self.rid)
        if not self.backend.state().running:
            self.stop.set()

    async def on_finished(self, rid, finish_reason, cached_tokens, stop_reason=None) -> None:
        await super().on_finished(rid, finish_reason, cached_tokens, stop_reason)
        self.stop.set()


async def test_a_stalled_engine_reads_the_cancel_before_its_next_step_and_replays_no_lost_time(monkeypatch):
    clock = stalled_clock(monkeypatch)
    backend = EmulatedBackend("decode", BELIEF)
    backend.add_deflected(request("a", 20, 200), [20])  # one prefill step, then 199 decode steps of ~2 ms
    stop = asyncio.Event()
    rec = StallingRecorder(backend, clock, at=3, rid="a", stop=stop)
    await asyncio.wait_for(backend.run(rec, stop), timeout=30)
    # the cancel ran before the next step: at most the step already planned went on (no burst of
    # the 5 s of missed decode steps, ~2,500 tokens, before the cancel was read)
    assert rec.cancelled_after_step == 3
    assert len(rec.steps) <= 4
    assert ("finished", "a", "length") not in rec.events
    # a step after the stall is timed from when the engine ran again, not from its old deadline
    assert all(s.wall_ms < 1000.0 for s, _ in rec.steps)


class StoppedMidStep(StallingRecorder):
    """After step ``at``, the process is stopped while it sleeps through its next step (the clocks jump
    during that sleep); a cancel for ``rid``, sent while it was stopped, is handled a moment after it
    runs again (another task: the node agent's NATS callback reading its socket)."""

    async def on_step(self, s) -> None:
        await Recorder.on_step(self, s)
        if len(self.steps) == self.at:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._jump)

    def _jump(self) -> None:  # runs while the engine sleeps through step at + 1
        self.clock.offset += STALL_S
        asyncio.get_running_loop().call_later(0.003, self._cancel)


async def test_a_request_cancelled_while_the_engine_was_stopped_mid_step_emits_nothing_more(monkeypatch):
    """Fencing (issue 33): the request moved to another node while this one was stopped; the step the
    engine was in when it stopped must not emit a token of it once the cancel is read."""
    clock = stalled_clock(monkeypatch)
    backend = EmulatedBackend("decode", BELIEF)
    backend.add_deflected(request("a", 20, 200), [20])
    stop = asyncio.Event()
    rec = StoppedMidStep(backend, clock, at=3, rid="a", stop=stop)
    await asyncio.wait_for(backend.run(rec, stop), timeout=30)
    tokens = [e for e in rec.events if e[0] == "tokens" and e[1] == "a"]
    assert rec.cancelled_after_step == 3 and len(tokens) == 3, tokens  # steps 1 to 3: none after the stop
