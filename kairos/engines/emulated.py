"""The emulated engine backend: the engine model driven in real time (also the sample backend).

:class:`EmulatedBackend` is :class:`kairos.core.engine_model.Engine` with a wall clock — ``plan_step()``,
sleep for the step's duration, ``commit_step()`` — where the simulator runs the same model with a
virtual clock (one model, two clocks: docs/architecture.md). Its request events come out of each committed
step; its KV transfers are emulated link times (one transfer per link at a time). It is also the
smallest complete implementation of the :class:`~kairos.engines.base.EngineBackend` contract:
read it first when adding a backend (kairos/engines/README.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kairos.contracts.wire import CACHE_SYNC_MAX_HASHES, InferenceRequest
from kairos.core.engine_model import Engine, EngineConfig, EngineState, GroundTruth
from kairos.core.engine_model.text import EmulatedCompletion, ResumedCompletion, emulated_completion
from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import RequestPhase
from kairos.engines.base import EngineBackend, EngineEvents, StepOutput

#: the event loop's epoll wait rounds timeouts up to whole milliseconds (selectors.EpollSelector), so a
#: 0.05 ms step slept with asyncio.sleep took ~1.1 ms; shorter waits yield to the loop instead
TIMER_RESOLUTION_S = 0.001
#: a step due to start more than this long ago (s) means the engine process did not run — a SIGSTOP,
#: a starved host — rather than scheduling overhead: like a real engine it does not replay the lost
#: time in a burst of back-to-back steps; its clock restarts at now
MAX_CATCH_UP_S = 0.1
#: after such a stall, how long (s) the engine lets what arrived meanwhile be handled before it commits
#: the step it was in: a cancel sent while the node was stopped (its request moved to another node,
#: issue 33) then removes the request from that step, and it emits nothing more for nobody
STALL_SETTLE_S = 0.01


def emulated_output(req: InferenceRequest) -> EmulatedCompletion | ResumedCompletion:
    """The emulated engine's output of ``req``: its length (given to the engine model as the output
    tokens), per-token text and finish reason, honouring the request's sampling parameters
    (:mod:`kairos.core.engine_model.text`; a request without ``max_tokens`` ends with the emulated EOS).
    A migrated request (``req.resume``) gets the original's output after the tokens already sent.

    Raises:
        ValueError: the request resumes where the original output had ended (the engine refuses it)."""
    done = req.resume.output_tokens if req.resume is not None else 0
    full = emulated_completion(req.sampling, req.max_tokens + done, req.prompt_text, req.prompt_token_ids,
                               natural_end=not req.max_tokens_explicit)
    return ResumedCompletion(full, done) if done else full


class EmulatedBackend(EngineBackend):
    """:class:`kairos.core.engine_model.Engine` advanced in real time (``asyncio.sleep(duration)``).

    ``model`` is what the node believes (``StepOutput.predicted_ms``, the guard); ``truth`` (a
    :class:`~kairos.core.engine_model.GroundTruth`, e.g. another artifact or a scale) is how long its steps
    really take — None: exactly the model. ``kairos profile`` recovers the truth, not the model.
    """

    def __init__(self, role: str, model: LatencyModel, tbt_guard_ms: float | None = None,
                 link: str | None = None, truth: GroundTruth | None = None) -> None:
        self.model = model
        self.link = link
        self.engine = Engine(EngineConfig.from_limits(role, model.engine), model, tbt_guard_ms=tbt_guard_ms,
                             truth=truth)
        self._wake = asyncio.Event()
        self._links: dict[str, asyncio.Lock] = {}  # src node -> the link's single transfer slot
        self._outputs: dict[str, EmulatedCompletion | ResumedCompletion] = {}  # decode side: each request's output
        self._hashes: dict[str, list[int]] = {}  # req id -> block hashes for its add_* call

    def set_tbt_guard_ms(self, ms: float | None) -> None:
        self.engine.tbt_guard_ms = ms

    @classmethod
    def from_config(cls, cfg: Any, model: LatencyModel, truth: GroundTruth | None = None) -> "EmulatedBackend":
        """The node's role, guard and KV link from an :class:`~kairos.services.node_agent.config.AgentConfig`."""
        return cls(cfg.role, model, cfg.tbt_guard_ms, cfg.link, truth)

    def note_block_hashes(self, req_id: str, block_hashes: list[int], block_tokens: int) -> None:
        # hashes of another granularity would never match this engine's blocks: ignored
        if block_hashes and self.engine.cache is not None and block_tokens == self.engine.cache.block_tokens:
            self._hashes[req_id] = block_hashes

    def cache_events(self, full: bool) -> tuple[int, list[int], list[int], bool] | None:
        cache = self.engine.cache
        if cache is None:
            return None
        stored, removed = self.engine.drain_cache_events()
        if full or len(stored) + len(removed) > CACHE_SYNC_MAX_HASHES:
            return cache.block_tokens, cache.recent_hashes(CACHE_SYNC_MAX_HASHES), [], True
        return cache.block_tokens, stored, removed, False

    def kv_transfer_ms(self, kv_tokens: int) -> float:
        """Emulated transfer time of ``kv_tokens`` on this node's link, without queueing (ms)."""
        return float(self.model.kv_transfer_ms(kv_tokens, self.link))

    async def pull_kv(self, src_node: str, req_id: str, kv_tokens: int) -> float:
        t0 = time.monotonic()
        async with self._links.setdefault(src_node, asyncio.Lock()):
            if self.engine.phase(req_id) is RequestPhase.AWAITING_KV:  # not aborted while queued for the link
                # only the blocks this node's prefix cache lacks cross the link (vLLM's NixlConnector
                # pulls the tokens past the decode side's local prefix hit)
                kv_tokens -= self.engine.cached_prefix_tokens(req_id)
                await asyncio.sleep(self.kv_transfer_ms(kv_tokens) / 1000.0)
        return (time.monotonic() - t0) * 1000.0

    # lifecycle: every external event wakes the driver (it may be idle-waiting)
    def add_prefill(self, req: InferenceRequest) -> None:
        self.engine.add_prefill(req.request_id, req.prompt_tokens, self._hashes.pop(req.request_id, ()))
        self._wake.set()

    def add_remote_decode(self, req: InferenceRequest, kv_transfer_params: dict[str, Any] | None = None) -> None:
        out = emulated_output(req)
        self.engine.add_remote_decode(req.request_id, req.prompt_tokens, out.n_tokens,
                                      self._hashes.pop(req.request_id, ()))
        self._outputs[req.request_id] = out
        self.engine.admit()  # allocate now so the KV transfer can start without waiting for a step
        self._wake.set()

    def add_deflected(self, req: InferenceRequest, chunk_schedule: list[int], decision_batch_size: int = 0) -> None:
        # the engine model applies χ_i − B with the B of each step itself (kairos/core/engine_model/core.py)
        out = emulated_output(req)
        self.engine.add_deflected(req.request_id, req.prompt_tokens, out.n_tokens, chunk_schedule,
                                  self._hashes.pop(req.request_id, ()))
        self._outputs[req.request_id] = out
        self._wake.set()

    def kv_arrived(self, req_id: str) -> None:
        self.engine.kv_arrived(req_id)
        self._wake.set()

    def release(self, req_id: str) -> None:
        self.engine.release(req_id)
        self.engine.admit()
        self._wake.set()

    def abort(self, req_id: str) -> bool:
        out = self.engine.abort(req_id)
        self._outputs.pop(req_id, None)
        self._wake.set()
        return out

    def take_allocated(self) -> list[str]:
        return self.engine.poll_allocated()

    def phase(self, req_id: str) -> RequestPhase | None:
        return self.engine.phase(req_id)

    def state(self) -> EngineState:
        return self.engine.state()

    async def run(self, events: EngineEvents, stop: asyncio.Event) -> None:
        """Plan, wait until the step's end on the wall clock, commit, report the step and then its
        request events (prefill done, tokens with the emulated text, finished with its finish reason and
        the stop string / stop token id that ended it, as the last token's event has them too).

        Step ends are absolute deadlines: a busy engine's step i+1 starts at step i's planned end,
        not when the event loop got round to it, so scheduling overhead (~0.1–1 ms per step) does
        not accumulate into a slower engine than the latency model says (SimPy's
        ``RealtimeEnvironment`` does the same). After an idle wait, or when the process did not run for
        more than :data:`MAX_CATCH_UP_S` (stopped, starved), the clock restarts at now. Every step
        yields to the event loop at least once, so a cancel that arrived meanwhile is read before the
        next step (after a SIGCONT the node used to run its requests' missed seconds of tokens in a
        burst before it read their cancels). A step the process was stopped in waits
        :data:`STALL_SETTLE_S` before it commits, so a cancel sent meanwhile removes its request from
        that step too.
        """
        eng = self.engine
        stop_wait = asyncio.ensure_future(stop.wait())
        deadline: float | None = None  # monotonic planned end of the previous step, while busy
        try:
            while not stop.is_set():
                self._wake.clear()  # before planning: an event during the step/plan is not lost
                plan = eng.plan_step()
                alloc = eng.poll_allocated()
                if alloc:
                    await events.on_allocated(alloc)
                if plan is None:
                    deadline = None
                    wake = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait({wake, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    continue
                now = time.monotonic()
                start = now if deadline is None or now - deadline > MAX_CATCH_UP_S else min(deadline, now)
                deadline = start + plan.duration_ms / 1000.0
                started = time.time() * 1000.0 - (now - start) * 1000.0
                if deadline - now >= TIMER_RESOLUTION_S:
                    await asyncio.sleep(deadline - now)
                else:
                    await asyncio.sleep(0)  # at least one turn of the loop per step (cancels, jobs)
                while time.monotonic() < deadline:  # sub-ms rest: the loop's timers round up to 1 ms
                    await asyncio.sleep(0)
                if time.monotonic() - deadline > MAX_CATCH_UP_S:  # stopped mid-step: cancels first
                    await asyncio.sleep(STALL_SETTLE_S)
                wall = (time.monotonic() - start) * 1000.0
                res = eng.commit_step(plan)
                await events.on_step(StepOutput(
                    step=res.step, started_unix_ms=started, wall_ms=wall, predicted_ms=plan.predicted_ms,
                    batch_size=plan.batch_size, kv_tokens=plan.kv_tokens, prefill_tokens=plan.prefill_tokens,
                    prefill_chunks=plan.prefill_chunks, deflected_chunk=plan.deflected_chunk, tokens=res.tokens,
                    first_tokens=res.first_tokens, prefill_done=res.prefill_done, finished=res.finished))
                for rid in res.prefill_done:
                    await events.on_prefill_done(rid)
                ending = set(res.finished)  # a finished request's last token is in this step's tokens
                for rid, idx in res.tokens:
                    out = self._outputs.get(rid)
                    last = (out.finish_reason if out is not None else "length") if rid in ending else None
                    why = out.stop_reason if out is not None and rid in ending else None
                    await events.on_tokens(rid, idx, 1, out.text(idx) if out is not None else "", last,
                                           stop_reason=why, token_ids=[out.token_id(idx)] if out is not None else None)
                for rid in res.finished:
                    out = self._outputs.pop(rid, None)
                    await events.on_finished(rid, out.finish_reason if out is not None else "length", 0,
                                             stop_reason=out.stop_reason if out is not None else None)
        finally:
            stop_wait.cancel()

