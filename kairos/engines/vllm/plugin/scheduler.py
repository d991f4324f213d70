"""vLLM scheduler plugin: Kairos chunk schedules for deflected prefills + the engine-state stream.

Load it in the engine with ``--scheduler-cls kairos.engines.vllm.plugin.scheduler.KairosScheduler`` (or
``KairosAsyncScheduler`` where async scheduling is on; the CPU platform forces it off,
``vllm/platforms/cpu.py``). Both share :class:`KairosSchedulerMixin`:

* **Chunk cap.** vLLM calls ``Scheduler._reserve_prefill_lookahead(request, num_computed_tokens,
  num_new_tokens)`` for every request it is about to schedule, after the token budget, the
  long-prefill threshold and the max-model-len clamp and before KV allocation
  (``vllm/v1/core/sched/scheduler.py`` 0.32.0: l. 751 for running requests, l. 1213 for waiting
  ones). The override returns ``min(vLLM's count, c_k − num_computed_tokens)`` for a request
  carrying ``kairos_prefill_chunks`` whose prompt is not computed yet (:mod:`kairos.engines.vllm.plugin.chunks`),
  so it never returns 0 where vLLM did not (a 0 for a waiting request would stop admissions for the
  step). Requests without a schedule get vLLM's own count, unchanged.
* **State stream.** With ``$KAIROS_ENGINE_STATE_ADDR`` set, a :class:`~kairos.engines.vllm.plugin.publisher.StatePublisher`
  bound there sends an :class:`~kairos.engines.vllm.plugin.protocol.EngineSnapshot` after every step (with its
  :class:`~kairos.engines.vllm.plugin.protocol.StepRecord`), on ``add_request`` / ``finish_requests``, and at
  least every 100 ms otherwise. Everything is read on the engine thread from the scheduler's own
  lists; sending never blocks.

The overridden private method is not a public vLLM interface: :func:`check_vllm_compat` runs at
import and raises :class:`VllmCompatError` naming the installed vLLM version when the version is
not the pinned one or a method is missing or changed its signature.
"""

from __future__ import annotations

import collections
import inspect
import os
import time
from dataclasses import dataclass
from typing import Any

import vllm
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kairos.engines.vllm.plugin import VLLM_VERSION
from kairos.engines.vllm.plugin.chunks import ChunkScheduleError, chunk_position, kairos_request_id, parse_chunks, prefill_cap
from kairos.engines.vllm.plugin.protocol import (STATE_ADDR_ENV, DeflectedChunk, EngineSnapshot, PrefillChunk, StepRecord,
                                  WaitingRequest)
from kairos.engines.vllm.plugin.publisher import StatePublisher

logger = init_logger("vllm.kairos_vllm")  # under "vllm", whose handlers vLLM configures

#: Set to 1 to run on a vLLM version other than the pinned one (the signature checks still apply).
UNPINNED_ENV = "KAIROS_VLLM_UNPINNED"

#: The vLLM methods the plugin overrides or calls, with the parameters it relies on (in order).
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "_reserve_prefill_lookahead": ("self", "request", "num_computed_tokens", "num_new_tokens"),
    "schedule": ("self", "throttle_prefills"),
    "update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "add_request": ("self", "request"),
    "finish_requests": ("self", "request_ids", "finished_status"),
    "shutdown": ("self",),
}
#: Scheduler attributes read when building snapshots (checked once per engine, after __init__).
EXPECTED_ATTRIBUTES = ("running", "waiting", "kv_holding_waiting", "requests", "kv_cache_manager", "block_size")


class VllmCompatError(RuntimeError):
    """The installed vLLM does not have the scheduler internals the plugin was written against."""


def check_vllm_compat(version: str, scheduler_cls: type, *, allow_unpinned: bool = False) -> None:
    """Check ``version`` equals :data:`kairos.engines.vllm.plugin.VLLM_VERSION` (a local suffix such as ``+cpu``
    is ignored) and that ``scheduler_cls`` has every method of :data:`EXPECTED_SIGNATURES` with
    exactly those parameter names.

    Raises :class:`VllmCompatError` naming the vLLM version and the method; a version mismatch
    only logs a warning when ``allow_unpinned`` (env ``KAIROS_VLLM_UNPINNED=1``).
    """
    base = version.split("+", 1)[0]
    if base != VLLM_VERSION:
        msg = (f"kairos.engines.vllm.plugin supports vLLM {VLLM_VERSION}, found vLLM {version}: the scheduler plugin "
               f"overrides private vLLM methods; re-verify them and update kairos.engines.vllm.plugin.VLLM_VERSION")
        if not allow_unpinned:
            raise VllmCompatError(msg + f" (or set {UNPINNED_ENV}=1 to try anyway)")
        logger.warning("%s (%s=1: continuing)", msg, UNPINNED_ENV)
    for name, params in EXPECTED_SIGNATURES.items():
        fn = getattr(scheduler_cls, name, None)
        if not callable(fn):
            raise VllmCompatError(f"vLLM {version}: {scheduler_cls.__name__}.{name} is missing; "
                                  f"kairos.engines.vllm.plugin (written for vLLM {VLLM_VERSION}) cannot cap prefill chunks")
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            raise VllmCompatError(f"vLLM {version}: {scheduler_cls.__name__}.{name} has parameters {got}, "
                                  f"kairos.engines.vllm.plugin (written for vLLM {VLLM_VERSION}) expects {params}")


check_vllm_compat(vllm.__version__, Scheduler, allow_unpinned=os.environ.get(UNPINNED_ENV) == "1")


class KairosConfigError(RuntimeError):
    """The engine runs with a setting under which the plugin cannot be correct (the text names it)."""


def check_scheduler_config(scheduler_cls: type, scheduler_config: Any) -> None:
    """Refuse an engine configuration the plugin cannot serve correctly.

    * ``enable_chunked_prefill`` off: vLLM then schedules a waiting prompt whole or not at all
      (``vllm/v1/core/sched/scheduler.py`` 0.32.0, l. 1160: ``break`` when it exceeds the budget),
      so a chunk schedule cannot be honoured, yet the cap still split prompts.
    * ``async_scheduling`` on with a class that is not an ``AsyncScheduler``
      (:class:`KairosScheduler`): the engine overlaps scheduling with the forward pass, which only
      ``AsyncScheduler`` accounts for (``_update_after_schedule``; the engine then decoded only
      every other step). Use :class:`KairosAsyncScheduler`. Conversely an ``AsyncScheduler`` without
      async scheduling counts output placeholders no step fills.

    Raises:
        KairosConfigError: naming the setting, its value and the way out.
    """
    name = scheduler_cls.__name__
    if not getattr(scheduler_config, "enable_chunked_prefill", False):
        raise KairosConfigError(f"kairos.engines.vllm.plugin: {name} needs chunked prefill, but enable_chunked_prefill is off "
                                "(--no-enable-chunked-prefill): deflected prefills are chunked by the plugin; "
                                "start vLLM with --enable-chunked-prefill")
    is_async = bool(getattr(scheduler_config, "async_scheduling", False))
    if is_async and not issubclass(scheduler_cls, AsyncScheduler):
        raise KairosConfigError(f"kairos.engines.vllm.plugin: {name} cannot run with async_scheduling on (--async-scheduling): "
                                "use --scheduler-cls kairos.engines.vllm.plugin.scheduler.KairosAsyncScheduler, or "
                                "--no-async-scheduling")
    if not is_async and issubclass(scheduler_cls, AsyncScheduler):
        raise KairosConfigError(f"kairos.engines.vllm.plugin: {name} needs async_scheduling on (--async-scheduling), it is off: "
                                "use --scheduler-cls kairos.engines.vllm.plugin.scheduler.KairosScheduler")


@dataclass
class _PendingStep:
    """What schedule() saw, until update_from_output() closes the step."""

    output: Any  #: the SchedulerOutput (matched by identity)
    started_mono: float  #: time.perf_counter() when schedule() returned (s)
    started_unix_ms: float
    prefill_tokens: int
    decode_count: int
    kv_tokens: int
    cached_tokens: int
    chunks: list[DeflectedChunk]
    first_scheduled: list[str]
    prefills: list[PrefillChunk]


class KairosSchedulerMixin:
    """The Kairos behaviour on top of a vLLM ``Scheduler`` subclass (see the module docstring).

    Attributes: ``kairos_publisher`` (None without ``$KAIROS_ENGINE_STATE_ADDR``),
    ``kairos_steps`` (steps with scheduled tokens so far; counted only while publishing).
    Raises :class:`KairosConfigError` at construction when the engine's settings make the plugin
    incorrect (:func:`check_scheduler_config`), :class:`VllmCompatError` when an expected attribute
    is missing, and :class:`RuntimeError` when the state address cannot be bound.
    """

    # Typed for readers; provided by vllm's Scheduler.
    running: list
    requests: dict

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]  # Scheduler.__init__'s first
        check_scheduler_config(type(self), vllm_config.scheduler_config)  # before vLLM builds anything
        super().__init__(*args, **kwargs)
        missing = [a for a in EXPECTED_ATTRIBUTES if not hasattr(self, a)]
        if missing:
            raise VllmCompatError(f"vLLM {vllm.__version__}: Scheduler has no attribute(s) {missing}; "
                                  f"kairos.engines.vllm.plugin was written for vLLM {VLLM_VERSION}")
        self.kairos_steps = 0
        self._kairos_chunks: dict[str, tuple[int, ...] | None] = {}
        self._kairos_pending: collections.deque[_PendingStep] = collections.deque(maxlen=16)
        self.kairos_publisher: StatePublisher | None = None
        addr = os.environ.get(STATE_ADDR_ENV)
        if addr:
            try:
                self.kairos_publisher = StatePublisher(addr)
            except Exception as e:  # zmq.ZMQError: address in use, bad scheme, missing directory
                raise RuntimeError(f"kairos.engines.vllm.plugin: cannot bind the engine-state socket {STATE_ADDR_ENV}={addr!r}: {e}") from e
            logger.info("kairos.engines.vllm.plugin: publishing engine state on %s", self.kairos_publisher.addr)
            self.kairos_publish()  # the first state; the idle thread repeats it until something changes

    # ---- chunk schedule ------------------------------------------------------------------------

    def kairos_chunks(self, request: Any) -> tuple[int, ...] | None:
        """The request's ``kairos_prefill_chunks`` (parsed once per request), or None.

        An invalid schedule is logged as an error naming the request and ignored (the request runs
        uncapped): the engine loop must not fail on one request's arguments.
        """
        rid = request.request_id
        try:
            return self._kairos_chunks[rid]
        except KeyError:
            pass
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        try:
            chunks = parse_chunks(extra)
        except ChunkScheduleError as e:
            logger.error("kairos.engines.vllm.plugin: request %s: %s; running it without a chunk schedule", rid, e)
            chunks = None
        if len(self._kairos_chunks) > 2 * len(self.requests) + 64:  # drop finished requests' entries
            self._kairos_chunks = {k: v for k, v in self._kairos_chunks.items() if k in self.requests}
        self._kairos_chunks[rid] = chunks
        return chunks

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if n <= 0:
            return n
        chunks = self.kairos_chunks(request)
        if chunks is None:
            return n
        cap = prefill_cap(chunks, num_computed_tokens, request.num_prompt_tokens)
        return n if cap is None else min(n, cap)

    # ---- step records and the state stream ------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        if self.kairos_publisher is None or out.total_num_scheduled_tokens == 0:
            return out
        started_mono, started_unix_ms = time.perf_counter(), time.time() * 1000.0
        prefill = decodes = kv = cached = 0
        chunks: list[DeflectedChunk] = []
        prefills: list[PrefillChunk] = []
        first_time = {r.req_id for r in out.scheduled_new_reqs}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            before = req.num_computed_tokens - n  # schedule() already advanced it (_update_after_schedule)
            if before >= req.num_prompt_tokens:
                decodes += 1
                kv += before
                continue
            p = min(n, req.num_prompt_tokens - before)
            prefill += p
            if rid in first_time and req.num_preemptions == 0:
                cached += before
            sched = self.kairos_chunks(req)
            extra = req.sampling_params.extra_args if req.sampling_params is not None else None
            if sched is not None:
                k, _ = chunk_position(sched, before)
                chunks.append(DeflectedChunk(kairos_request_id(extra, rid), k, p, before))
            else:
                prefills.append(PrefillChunk(kairos_request_id(extra, rid), p, before))
        first = [kairos_request_id(r.sampling_params.extra_args if r.sampling_params is not None else None, r.req_id)
                 for r in out.scheduled_new_reqs]
        self._kairos_pending.append(_PendingStep(out, started_mono, started_unix_ms, prefill, decodes, kv, cached, chunks,
                                                 first, prefills))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        entered = time.perf_counter()
        pending = None
        while self._kairos_pending:  # sync: exactly one; async scheduling: the oldest ones first
            p = self._kairos_pending.popleft()
            if p.output is scheduler_output:
                pending = p
                break
        result = super().update_from_output(scheduler_output, model_runner_output)
        if pending is not None:
            self.kairos_steps += 1
            rec = StepRecord(step=self.kairos_steps, started_unix_ms=pending.started_unix_ms,
                             wall_ms=(entered - pending.started_mono) * 1000.0, prefill_tokens=pending.prefill_tokens,
                             decode_count=pending.decode_count, kv_tokens=pending.kv_tokens,
                             cached_tokens=pending.cached_tokens, chunks=pending.chunks,
                             first_scheduled=pending.first_scheduled, prefills=pending.prefills)
            self.kairos_publish(rec)
        return result

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        self.kairos_publish()

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list:
        result = super().finish_requests(request_ids, finished_status)
        self.kairos_publish()
        return result

    def shutdown(self) -> None:
        super().shutdown()
        if self.kairos_publisher is not None:
            self.kairos_publisher.close()

    def kairos_snapshot(self, step_record: StepRecord | None = None) -> EngineSnapshot:
        """The scheduler's state now (``seq``/``sent_unix_ms``/``engine_pid`` are stamped on send).

        B and K count running requests whose prompt is computed (``num_computed_tokens`` ≥ prompt);
        ``waiting`` lists running requests still prefilling (in running order), then the
        ``kv_holding_waiting`` and ``waiting`` queues in their scheduling order. For a waiting
        request, ``remaining_prefill_tokens`` subtracts only tokens already computed (after a KV
        load or a previous admission); prefix-cache hits are looked up when vLLM admits it.
        """
        batch = kv = 0
        waiting: list[WaitingRequest] = []
        for r in self.running:
            if r.num_computed_tokens >= r.num_prompt_tokens:
                batch += 1
                kv += r.num_computed_tokens
            else:
                waiting.append(self._kairos_waiting(r))
        for queue in (self.kv_holding_waiting, self.waiting):
            waiting.extend(self._kairos_waiting(r) for r in queue)
        num_running, num_waiting = len(self.running), len(self.waiting) + len(self.kv_holding_waiting)
        kvm = self.kv_cache_manager
        return EngineSnapshot(seq=0, sent_unix_ms=0.0, engine_pid=0, step=self.kairos_steps, batch_size=batch,
                              kv_tokens=kv, waiting=waiting, num_running=num_running, num_waiting=num_waiting,
                              kv_cache_usage=float(kvm.usage),
                              free_kv_tokens=kvm.block_pool.get_num_free_blocks() * self.block_size,
                              block_size=self.block_size, step_record=step_record)

    @staticmethod
    def _kairos_waiting(r: Any) -> WaitingRequest:
        extra = r.sampling_params.extra_args if r.sampling_params is not None else None
        return WaitingRequest(kairos_request_id(extra, r.request_id), r.num_prompt_tokens,
                              max(r.num_prompt_tokens - r.num_computed_tokens, 0))

    def kairos_publish(self, step_record: StepRecord | None = None) -> None:
        """Send the current snapshot (no-op without a publisher). Never raises into the engine loop:
        a failure is logged and the message dropped."""
        if self.kairos_publisher is None:
            return
        try:
            self.kairos_publisher.publish(self.kairos_snapshot(step_record))
        except Exception:  # a state-stream bug must not kill the engine
            logger.exception("kairos.engines.vllm.plugin: cannot publish the engine state")


class KairosScheduler(KairosSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with Kairos chunk schedules and the engine-state stream."""


class KairosAsyncScheduler(KairosSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with Kairos chunk schedules and the engine-state stream.

    With async scheduling, step N+1 is scheduled before step N's output is processed, so a step
    record's ``wall_ms`` (schedule() return → update_from_output() entry) spans the overlap.
    """


__all__ = ["KairosScheduler", "KairosAsyncScheduler", "KairosSchedulerMixin", "VllmCompatError",
           "check_vllm_compat", "EXPECTED_SIGNATURES"]
