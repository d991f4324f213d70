"""Engine backends of the node agent: the interface, and the emulated one driven in real time.

The agent talks to its engine only through :class:`EngineBackend`: request lifecycle calls
(mirroring :class:`shared.engine.Engine`), ``state()`` for heartbeats, and :meth:`run`, which
executes steps and reports each one as a :class:`StepOutput`. A vLLM backend implements the same
interface by talking to a local vLLM server (ARCHITECTURE §6) — the agent does not change.

:class:`EmulatedBackend` is the engine model with a wall clock: ``plan_step()``, sleep for the
step's duration, ``commit_step()`` — the simulator runs the same model with a virtual clock.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from shared.engine import Engine, EngineConfig, EngineState, GroundTruth
from shared.latency import LatencyModel


@dataclass(frozen=True)
class StepOutput:
    """One executed engine step, backend-neutral."""

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


class EngineBackend(abc.ABC):
    """What the node agent needs from an engine (see module docstring)."""

    @abc.abstractmethod
    def add_prefill(self, req_id: str, prompt_tokens: int) -> None: ...

    @abc.abstractmethod
    def add_remote_decode(self, req_id: str, prompt_tokens: int, output_tokens: int) -> None: ...

    @abc.abstractmethod
    def add_deflected(self, req_id: str, prompt_tokens: int, output_tokens: int, chunk_schedule: list[int]) -> None: ...

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
        """Transfer ``req_id``'s KV cache from ``src_node`` into the blocks allocated here; returns
        the transfer time in ms, including waiting for the link (one transfer at a time per link)."""

    @abc.abstractmethod
    def state(self) -> EngineState: ...

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

    def cache_events(self, full: bool) -> tuple[int, list[int], list[int]] | None:
        """``(block_tokens, stored, removed)`` prefix-cache block hashes since the last call (net),
        or with ``full`` the whole cache as ``stored``; None: this backend reports no cache.

        Hook for the vLLM backend (not implemented here): start vLLM with
        ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'``,
        subscribe to its ZMQ feed (``vllm/distributed/kv_events.py``: ``KVEventBatch`` of
        ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size)`` /
        ``BlockRemoved(block_hashes)`` / ``AllBlocksCleared``) and return the hashes accumulated
        since the previous call. The dispatcher's index (shared/prefix.py) must then match them with
        request hashes computed the same way as vLLM's (``hash_block_tokens`` over token ids, with
        the same ``PYTHONHASHSEED``/sha256 setting), i.e. the ingress must hash token ids like vLLM.
        """
        return None

    @abc.abstractmethod
    async def run(self, on_step: Callable[[StepOutput], Awaitable[None]],
                  on_allocated: Callable[[list[str]], Awaitable[None]], stop: asyncio.Event) -> None:
        """Execute steps until ``stop`` is set, reporting each step and every KV-block allocation."""


class EmulatedBackend(EngineBackend):
    """:class:`shared.engine.Engine` advanced in real time (``asyncio.sleep(duration)``).

    ``model`` is what the node believes (``StepOutput.predicted_ms``, the guard); ``truth`` (a
    :class:`~shared.engine.GroundTruth`, e.g. another artifact or a scale) is how long its steps
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
        if full:
            return cache.block_tokens, sorted(cache.hashes()), []
        return cache.block_tokens, stored, removed

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
    def add_prefill(self, req_id: str, prompt_tokens: int) -> None:
        self.engine.add_prefill(req_id, prompt_tokens, self._hashes.pop(req_id, ()))
        self._wake.set()

    def add_remote_decode(self, req_id: str, prompt_tokens: int, output_tokens: int) -> None:
        self.engine.add_remote_decode(req_id, prompt_tokens, output_tokens, self._hashes.pop(req_id, ()))
        self.engine.admit()  # allocate now so the KV transfer can start without waiting for a step
        self._wake.set()

    def add_deflected(self, req_id: str, prompt_tokens: int, output_tokens: int, chunk_schedule: list[int]) -> None:
        self.engine.add_deflected(req_id, prompt_tokens, output_tokens, chunk_schedule, self._hashes.pop(req_id, ()))
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
        self._wake.set()
        return out

    def take_allocated(self) -> list[str]:
        return self.engine.poll_allocated()

    def phase(self, req_id: str) -> str | None:
        return self.engine.phase(req_id)

    def state(self) -> EngineState:
        return self.engine.state()

    async def run(self, on_step, on_allocated, stop: asyncio.Event) -> None:
        """Plan, wait until the step's end on the wall clock, commit, report.

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
                    await on_allocated(alloc)
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
                if deadline > now:
                    await asyncio.sleep(deadline - now)
                wall = (time.monotonic() - start) * 1000.0
                res = eng.commit_step(plan)
                await on_step(StepOutput(
                    step=res.step, started_unix_ms=started, wall_ms=wall, predicted_ms=plan.predicted_ms,
                    batch_size=plan.batch_size, kv_tokens=plan.kv_tokens, prefill_tokens=plan.prefill_tokens,
                    prefill_chunks=plan.prefill_chunks, deflected_chunk=plan.deflected_chunk, tokens=res.tokens,
                    first_tokens=res.first_tokens, prefill_done=res.prefill_done, finished=res.finished))
        finally:
            stop_wait.cancel()


def make_backend(kind: str, role: str, model: LatencyModel, tbt_guard_ms: float | None = None,
                 link: str | None = None, truth: GroundTruth | None = None) -> EngineBackend:
    """Backend by name (``emulated``; ``vllm`` later). ``truth``: the emulated engine's real step
    times (see :class:`EmulatedBackend`)."""
    if kind == "emulated":
        return EmulatedBackend(role, model, tbt_guard_ms, link, truth)
    raise ValueError(f"unknown engine backend {kind!r} (known: emulated)")
