"""Engine backends of the node agent: the interface, and the emulated one driven in real time.

The agent talks to its engine only through :class:`EngineBackend`: request lifecycle calls
(mirroring :class:`kairos.core.engine.Engine`), ``state()`` for heartbeats, and :meth:`EngineBackend.run`,
which drives the engine and reports to the agent through :class:`EngineEvents`: every executed step
as a backend-neutral :class:`StepOutput` (metrics, chunk records, the profiler's step records) and,
per request, prefill done / tokens / finished / failed. Two backends:

* :class:`EmulatedBackend` (here): the engine model with a wall clock — ``plan_step()``, sleep for
  the step's duration, ``commit_step()``; the simulator runs the same model with a virtual clock.
  Its request events come out of each committed step.
* :class:`kairos.engines.vllm.backend.VllmBackend`: a vLLM OpenAI server beside the agent;
  request events come from its HTTP responses, steps from the ``kairos.engines.vllm.plugin`` engine-state stream.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kairos.core.engine.text import EmulatedCompletion, emulated_completion
from kairos.core.engine import Engine
from kairos.core.engine import EngineConfig
from kairos.core.engine import EngineState
from kairos.core.engine import GroundTruth
from kairos.core.model.latency import LatencyModel
from kairos.contracts.wire import CACHE_SYNC_MAX_HASHES, InferenceRequest

def emulated_output(req: InferenceRequest) -> EmulatedCompletion:
    """The emulated engine's output of ``req``: its length (given to the engine model as the output
    tokens), per-token text and finish reason, honouring the request's sampling parameters
    (:mod:`kairos.core.engine.text`; a request without ``max_tokens`` ends with the emulated EOS)."""
    return emulated_completion(req.sampling, req.max_tokens, req.prompt_text, req.prompt_token_ids,
                               natural_end=not req.max_tokens_explicit)

#: the event loop's epoll wait rounds timeouts up to whole milliseconds (selectors.EpollSelector), so a
#: 0.05 ms step slept with asyncio.sleep took ~1.1 ms; shorter waits yield to the loop instead
TIMER_RESOLUTION_S = 0.001


@dataclass(frozen=True)
class StepOutput:
    """One executed engine step, backend-neutral.

    The emulated backend fills every field; the vLLM backend builds it from the plugin's
    ``StepRecord`` (``kairos.engines.vllm.plugin.protocol``) and leaves the per-request fields (``tokens``,
    ``first_tokens``, ``prefill_done``, ``finished``) empty: those come from HTTP responses.
    """

    step: int
    started_unix_ms: float
    wall_ms: float  #: measured duration of the step
    predicted_ms: float  #: the latency model's prediction for the step
    batch_size: int
    kv_tokens: int
    prefill_tokens: int
    prefill_chunks: tuple[tuple[str, int, int], ...]  #: (req_id, tokens, cached_before)
    deflected_chunk: tuple[str, int, int, int] | None  #: (req_id, step_index, chi, tokens)
    tokens: tuple[tuple[str, int], ...]  #: (req_id, token_index)
    first_tokens: tuple[str, ...]
    prefill_done: tuple[str, ...]
    finished: tuple[str, ...]
    cached_tokens: int = 0  #: prefix-cache hit tokens of requests first scheduled in this step


class EngineEvents(Protocol):
    """What a backend reports to the agent (the agent implements it; all ``async``).

    * ``on_step(out)``: an engine step executed.
    * ``on_allocated(rids)``: remote decodes whose KV blocks were allocated (start their transfer).
    * ``on_prefill_done(rid)``: keep path, prefill node: the prompt is computed, its KV held here.
    * ``on_tokens(rid, first_index, count, text)``: ``count`` output tokens from index
      ``first_index`` (0 = the first token: TTFT ends) with their text.
    * ``on_finished(rid, finish_reason, cached_tokens)``: last token emitted (``stop``/``length``);
      ``cached_tokens`` prompt tokens were served from the prefix cache.
    * ``on_failed(rid, status, code, message)``: the engine could not serve ``rid``.
    """

    async def on_step(self, out: StepOutput) -> None: ...

    async def on_allocated(self, rids: list[str]) -> None: ...

    async def on_prefill_done(self, rid: str) -> None: ...

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str) -> None: ...

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int) -> None: ...

    async def on_failed(self, rid: str, status: int, code: str, message: str) -> None: ...


class EngineBackend(abc.ABC):
    """What the node agent needs from an engine (see module docstring).

    Phases reported by :meth:`phase` follow :class:`kairos.core.engine.Engine` (``held``: prefill done,
    KV kept for the decode node; ``awaiting_kv``: remote decode whose KV is not here yet); None
    when the request is unknown or gone.
    """

    #: False while the engine cannot take work (the agent then reports ``accepting=False``)
    available: bool = True

    async def confirm_available(self, timeout_s: float) -> bool:
        """Whether the engine can take a request now, asked when :attr:`available` alone would
        refuse one (``timeout_s``: the longest this may wait, seconds). An engine whose state is
        late but which still answers is slow, not dead (issue 10): a backend that can ask the
        engine directly overrides this; the default is :attr:`available`."""
        return self.available

    @abc.abstractmethod
    def add_prefill(self, req: InferenceRequest) -> None:
        """Keep path, prefill node: compute ``req``'s prompt and hold its KV for a decode node."""

    @abc.abstractmethod
    def add_remote_decode(self, req: InferenceRequest, kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Keep path, decode node: decode ``req`` with the KV computed on the prefill node
        (``kv_transfer_params``: the prefill engine's handle for it, vLLM only)."""

    @abc.abstractmethod
    def add_deflected(self, req: InferenceRequest, chunk_schedule: list[int], decision_batch_size: int = 0) -> None:
        """Deflect path: chunked prefill along ``chunk_schedule`` (χ per step, total step tokens
        incl. the B decodes the decision assumed, ``decision_batch_size``), then decode here."""

    @abc.abstractmethod
    def kv_arrived(self, req_id: str) -> None: ...

    @abc.abstractmethod
    def release(self, req_id: str) -> None: ...

    @abc.abstractmethod
    def abort(self, req_id: str) -> bool: ...

    @abc.abstractmethod
    def take_allocated(self) -> list[str]:
        """Remote decodes whose KV blocks were allocated since the last call (start their transfer)."""

    @abc.abstractmethod
    def phase(self, req_id: str) -> str | None: ...

    @abc.abstractmethod
    async def pull_kv(self, src_node: str, req_id: str, kv_tokens: int) -> float:
        """Wait until ``req_id``'s KV cache from ``src_node`` is in the blocks allocated here; returns
        the transfer time in ms, including waiting for the link (one transfer at a time per link)."""

    @abc.abstractmethod
    def state(self) -> EngineState: ...

    def handoff_params(self, req_id: str) -> dict[str, Any] | None:
        """Prefill node: what the decode node's engine needs to pull ``req_id``'s KV (vLLM's
        ``kv_transfer_params``), None for engines that need nothing."""
        return None

    def kv_transfer_ms(self, kv_tokens: int) -> float:
        """Expected transfer time of ``kv_tokens`` (ms) for the prefill side's backlog estimate."""
        return 0.0

    def set_tbt_guard_ms(self, ms: float | None) -> None:
        """Tighten/relax the node-side chunk guard (kairos+ with the node's learned correction);
        a backend without a guard ignores it."""

    def note_block_hashes(self, req_id: str, block_hashes: list[int], block_tokens: int) -> None:
        """The prompt's prefix-cache block hashes, given just before ``add_*`` of ``req_id``
        (``InferenceRequest.block_hashes``). A backend whose engine hashes prompts itself (vLLM)
        ignores them."""

    def cache_events(self, full: bool) -> tuple[int, list[int], list[int], bool] | None:
        """``(block_tokens, stored, removed, is_full)`` prefix-cache block hashes since the last call
        (net), or — with ``full``, or when the net change exceeds ``kairos.contracts.wire.CACHE_SYNC_MAX_HASHES``
        — the cache itself as ``stored`` (at most that many hashes, the most recently used:
        ``is_full`` True); None: this backend reports no cache.

        Hook for the vLLM backend (not implemented here): start vLLM with
        ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'``,
        subscribe to its ZMQ feed (``vllm/distributed/kv_events.py``: ``KVEventBatch`` of
        ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size)`` /
        ``BlockRemoved(block_hashes)`` / ``AllBlocksCleared``) and return the hashes accumulated
        since the previous call. The dispatcher's index (kairos/core/cluster/prefix_index.py) must then match them with
        request hashes computed the same way as vLLM's (``hash_block_tokens`` over token ids, with
        the same ``PYTHONHASHSEED``/sha256 setting), i.e. the ingress must hash token ids like vLLM.
        """
        return None

    @abc.abstractmethod
    async def run(self, events: EngineEvents, stop: asyncio.Event) -> None:
        """Drive the engine until ``stop`` is set, reporting to ``events``."""


class EmulatedBackend(EngineBackend):
    """:class:`kairos.core.engine.Engine` advanced in real time (``asyncio.sleep(duration)``).

    ``model`` is what the node believes (``StepOutput.predicted_ms``, the guard); ``truth`` (a
    :class:`~kairos.core.engine.GroundTruth`, e.g. another artifact or a scale) is how long its steps
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
        self._outputs: dict[str, EmulatedCompletion] = {}  # decode side: the text each request generates
        self._hashes: dict[str, list[int]] = {}  # req id -> block hashes for its add_* call

    def set_tbt_guard_ms(self, ms: float | None) -> None:
        self.engine.tbt_guard_ms = ms

    def note_block_hashes(self, req_id: str, block_hashes: list[int], block_tokens: int) -> None:
        # hashes of another granularity would never match this engine's blocks: ignored
        if block_hashes and self.engine.cache is not None and block_tokens == self.engine.cache.block_tokens:
            self._hashes[req_id] = block_hashes

    def cache_events(self, full: bool) -> tuple[int, list[int], list[int]] | None:
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
            if self.engine.phase(req_id) == "awaiting_kv":  # not aborted while queued for the link
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
        # the engine model applies χ_i − B with the B of each step itself (kairos/core/engine/core.py)
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

    def phase(self, req_id: str) -> str | None:
        return self.engine.phase(req_id)

    def state(self) -> EngineState:
        return self.engine.state()

    async def run(self, events: EngineEvents, stop: asyncio.Event) -> None:
        """Plan, wait until the step's end on the wall clock, commit, report the step and then its
        request events (prefill done, tokens with the emulated text, finished with its finish reason).

        Step ends are absolute deadlines: a busy engine's step i+1 starts at step i's planned end,
        not when the event loop got round to it, so scheduling overhead (~0.1–1 ms per step) does
        not accumulate into a slower engine than the latency model says (SimPy's
        ``RealtimeEnvironment`` does the same). After an idle wait the clock restarts at now.
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
                start = now if deadline is None else min(deadline, now)
                deadline = start + plan.duration_ms / 1000.0
                started = time.time() * 1000.0 - (now - start) * 1000.0
                if deadline - now >= TIMER_RESOLUTION_S:
                    await asyncio.sleep(deadline - now)
                while time.monotonic() < deadline:  # sub-ms rest: the loop's timers round up to 1 ms
                    await asyncio.sleep(0)
                wall = (time.monotonic() - start) * 1000.0
                res = eng.commit_step(plan)
                await events.on_step(StepOutput(
                    step=res.step, started_unix_ms=started, wall_ms=wall, predicted_ms=plan.predicted_ms,
                    batch_size=plan.batch_size, kv_tokens=plan.kv_tokens, prefill_tokens=plan.prefill_tokens,
                    prefill_chunks=plan.prefill_chunks, deflected_chunk=plan.deflected_chunk, tokens=res.tokens,
                    first_tokens=res.first_tokens, prefill_done=res.prefill_done, finished=res.finished))
                for rid in res.prefill_done:
                    await events.on_prefill_done(rid)
                for rid, idx in res.tokens:
                    out = self._outputs.get(rid)
                    await events.on_tokens(rid, idx, 1, out.text(idx) if out is not None else "")
                for rid in res.finished:
                    out = self._outputs.pop(rid, None)
                    await events.on_finished(rid, out.finish_reason if out is not None else "length", 0)
        finally:
            stop_wait.cancel()


def make_backend(cfg: Any, model: LatencyModel, truth: GroundTruth | None = None) -> EngineBackend:
    """The backend ``cfg.backend`` names (``emulated`` or ``vllm``) for an
    :class:`~kairos.services.node_agent.config.AgentConfig`. ``truth``: the emulated engine's real step
    times (see :class:`EmulatedBackend`); a real engine has its own.

    Raises:
        ValueError: an unknown backend name.
        ConfigError: the vLLM server's key file cannot be read (``AgentConfig.engine_key``).
    """
    if cfg.backend == "emulated":
        return EmulatedBackend(cfg.role, model, cfg.tbt_guard_ms, cfg.link, truth)
    if cfg.backend == "vllm":
        from kairos.engines.vllm.backend import VllmBackend

        return VllmBackend(cfg.role, model, cfg.engine_url, cfg.engine_state_addr,
                           stale_after_ms=cfg.engine_stale_after_ms, api_key=cfg.engine_key())
    raise ValueError(f"unknown engine backend {cfg.backend!r} (known: emulated, vllm)")
