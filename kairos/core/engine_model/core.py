"""The continuous-batching engine model: a clock-free step planner (docs/architecture.md).

Where it is used: the simulator advances one :class:`Engine` per node in virtual time, the node
agent's emulated backend in real time (``await asyncio.sleep(plan.duration_ms / 1e3)``). Both run
the same loop, so the same arrivals give the same step plans (one model, two clocks: docs/architecture.md)::

    plan = engine.plan_step()          # None: nothing runnable until an external event
    for rid in engine.poll_allocated():
        start_kv_transfer(rid)         # remote decodes that just got blocks
    advance_clock(plan.duration_ms)    # heap event (sim) or sleep (agent)
    result = engine.commit_step(plan)  # tokens, first tokens, prefill done, finished

Like vLLM's V1 scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``) there is no
prefill or decode *phase*: each step, running decodes get one token each first, then prefill work
gets the rest of the token budget. What this model emulates and where it simplifies:

* **Running first, then waiting, FCFS.** ``schedule()`` serves ``self.running`` before
  ``self.waiting`` and stops the waiting loop when ``len(self.running) == max_num_running_reqs``
  or when ``kv_cache_manager.allocate_slots`` returns None (head-of-line blocking). Here admission
  walks the waiting queue the same way: the head needs its blocks and a free running slot, else
  nobody behind it is admitted.
* **Admission is decoupled from the token budget.** vLLM admits a waiting request only inside a
  step with budget left; here :meth:`Engine.admit` can run between steps (the node agent admits a
  remote decode as soon as it arrives so that its KV transfer can start). ``plan_step`` always
  admits first.
* **Whole-request block reservation, no preemption.** vLLM allocates blocks chunk by chunk and
  token by token and, when a running request cannot grow, preempts the last running request
  (``RequestStatus.PREEMPTED``, recompute). Here a prefill-node request reserves blocks for its
  prompt at admission and a decode-node request for prompt + output tokens, so nothing ever needs
  preempting and capacity can never be exceeded. This is conservative (KV is reserved earlier than
  vLLM would) and omits preemption storms.
* **Remote KV.** A keep-path request on a decode node gets its blocks FIFO like any other, then
  sits in the equivalent of ``RequestStatus.WAITING_FOR_REMOTE_KVS`` (not running, blocks held)
  until :meth:`Engine.kv_arrived`; it then takes a running slot (ahead of new admissions, as vLLM
  prepends ``skipped_waiting_requests``) and samples its first token in its first decode step.
  On the prefill node the request holds its blocks after its prompt is computed until
  :meth:`Engine.release` (vLLM connectors' ``delay_free_blocks``).
* **Chunk schedules** (paper §5.4, Kairos' scheduler change): on a decode node one deflected
  prefill runs at a time, FIFO, and its i-th step carries ``min(remaining, χ_i − B, budget − B)``
  prompt tokens, at least 1 (χ counts the B decode tokens, §3.2).

:class:`Engine` is the API and its argument checks; the work is done by three collaborators:
:class:`~kairos.core.engine_model.queues.PhaseQueues` (where each request is, FIFO admission, removal),
:class:`~kairos.core.engine_model.kv.KvBlocks` (KV blocks and the prefix cache) and
:mod:`kairos.core.engine_model.step` (composing and committing one step).
"""

from __future__ import annotations

from typing import Callable

from kairos.core.engine_model import step
from kairos.core.engine_model.kv import KvBlocks
from kairos.core.engine_model.prefix import PrefixCache
from kairos.core.engine_model.queues import PhaseQueues
from kairos.core.engine_model.request import AWAIT_KV, DEFLECT, HELD, PREFILL, REMOTE, Req, as_count
from kairos.core.engine_model.truth import GroundTruth
from kairos.core.engine_model.types import EngineConfig, EngineError, EngineState, StepPlan, StepResult
from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import RequestPhase


class Engine:
    """Continuous-batching engine model of one prefill or decode node; pure and deterministic.

    Args:
        config: limits of the node.
        model: step-latency model; ``model.step_ms`` gives every step's predicted ms.
        step_noise: maps a predicted step latency (ms) to the "true" one (ms), e.g. the
            simulator's seeded multiplicative noise. None: duration = prediction.
        tbt_guard_ms: kairos+ node-side guard (paper §7: decodes that join after the dispatch
            decision are not known to it): when set, a deflected chunk is shrunk so that the
            predicted step (current B and K) stays ≤ this many ms; still ≥ 1 token. Settable (the
            simulator tightens it with the node's learned correction).
        truth: the node's real step times (:class:`kairos.core.engine_model.truth.GroundTruth`), independent
            of ``model``; None: the step takes what ``model`` predicts. ``step_noise`` then applies
            to the true time.
    """

    __slots__ = ("config", "model", "tbt_guard_ms", "truth", "cache", "_noise", "_kv", "_q", "_plan", "_plan_refs",
                 "_steps")

    def __init__(self, config: EngineConfig, model: LatencyModel,
                 step_noise: Callable[[float], float] | None = None, *,
                 tbt_guard_ms: float | None = None, truth: GroundTruth | None = None) -> None:
        if tbt_guard_ms is not None and not tbt_guard_ms > 0:
            raise EngineError(f"tbt_guard_ms must be > 0 or None, got {tbt_guard_ms!r}")
        self.config = config
        self.model = model
        self.tbt_guard_ms = tbt_guard_ms
        self.truth = truth
        self._noise = step_noise
        self._kv = KvBlocks(config)
        self._q = PhaseQueues(config, self._kv)
        self._plan: StepPlan | None = None
        self._plan_refs: step.StepRefs = step.NO_REFS
        self._steps = 0
        #: the node's prefix cache (None when ``config.prefix_caching`` is off)
        self.cache: PrefixCache | None = self._kv.cache

    # -- adding requests ----------------------------------------------------------------------
    def add_prefill(self, req_id: str, prompt_tokens: int, block_hashes: tuple[int, ...] | list[int] = (),
                    output_tokens: int = 0) -> None:
        """Keep path on a prefill node: compute the prompt, then hold its KV until :meth:`release`.

        The request waits FIFO for ``ceil(prompt_tokens / block_size)`` blocks and a running slot.
        Its chunks share steps with other prefills (vLLM chunked prefill). No token is emitted
        here: the keep path's first token comes from the decode node.

        With ``output_tokens > 0`` the node also decodes the request (PD aggregation, the TaiChi
        baseline's prefill-heavy instances): blocks for prompt + output are reserved, the step
        that completes the prompt emits token 0, and the request then decodes here one token per
        step, sharing steps with the node's prefill chunks, until it finishes or the caller
        migrates it (:meth:`progress`, :meth:`abort`, then ``add_remote_decode`` +
        ``kv_arrived(generated=…)`` on the target).

        Raises:
            EngineError: not a prefill node, duplicate id, ``prompt_tokens < 1``, ``output_tokens
                < 0``, or the request needs more blocks than the node has.
        """
        if as_count(req_id, "output_tokens", output_tokens) < 0:
            raise EngineError(f"{req_id!r}: output_tokens must be >= 0, got {output_tokens}")
        self._q.add(req_id, PREFILL, "prefill", prompt_tokens, output_tokens, (), block_hashes)

    def add_remote_decode(self, req_id: str, prompt_tokens: int, output_tokens: int,
                          block_hashes: tuple[int, ...] | list[int] = ()) -> None:
        """Keep path on a decode node: blocks for prompt + output, then KV transfer, then decode.

        Waits FIFO for blocks; once allocated (inside :meth:`admit` / :meth:`plan_step`) the id is
        reported by :meth:`poll_allocated` so the caller starts the transfer; :meth:`kv_arrived`
        makes it a running decode. Its first decode step emits token 0, then one token per step,
        ``output_tokens`` in total.

        Raises:
            EngineError: not a decode node, duplicate id, a token count < 1, or too large to ever fit.
        """
        self._q.add(req_id, REMOTE, "decode", prompt_tokens, output_tokens, (), block_hashes)

    def add_deflected(self, req_id: str, prompt_tokens: int, output_tokens: int,
                      chunk_schedule: list[int] | tuple[int, ...],
                      block_hashes: tuple[int, ...] | list[int] = ()) -> None:
        """Deflect path on a decode node: chunked prefill following the schedule, then decode here.

        Waits FIFO for blocks (prompt + output), then for the deflected prefills admitted before it
        (one runs at a time). Prefill step i carries ``min(remaining, χ_i − B, budget − B)`` prompt
        tokens, at least 1, where χ_i is ``chunk_schedule[i]`` (the last χ past the end; the token
        budget if the schedule is empty) and B the decodes in that step. The last prefill step
        emits token 0 (vLLM samples when the prompt completes); ``output_tokens − 1`` decode steps
        follow.

        Raises:
            EngineError: not a decode node, duplicate id, a token count or χ < 1, or too large.
        """
        sched = tuple(as_count(req_id, "chunk_schedule", c) for c in chunk_schedule)
        if any(c < 1 for c in sched):
            raise EngineError(f"{req_id!r}: chunk_schedule entries must be ints >= 1, got {list(sched)}")
        self._q.add(req_id, DEFLECT, "decode", prompt_tokens, output_tokens, sched, block_hashes)

    # -- admission and external events --------------------------------------------------------
    def admit(self) -> list[str]:
        """Admit waiting requests FIFO; return the remote decodes that got blocks in this call.

        First, remote decodes whose KV arrived take free running slots (FIFO). Then the waiting
        queue is walked from its head while a running slot is free (vLLM stops its waiting loop at
        ``max_num_running_reqs``): the head is admitted if its blocks fit, else admission stops
        (head-of-line, vLLM FCFS). Admitted prefills and deflections take a running slot; remote
        decodes only take blocks and await their KV.

        Every allocation is also queued for :meth:`poll_allocated`. Drive KV transfers from
        exactly one channel; ``poll_allocated()`` is the one that sees all allocations (those made
        here, in :meth:`plan_step`, and reported in ``StepPlan.allocated``).
        """
        return self._q.admit()

    def poll_allocated(self) -> list[str]:
        """Remote decodes whose blocks were allocated since the last poll, in allocation order.

        The caller starts their KV transfers and calls :meth:`kv_arrived` when each completes.
        Requests aborted (or whose KV arrived) before being polled are left out, so the log holds
        at most the awaiting-KV requests: a caller that consumes :meth:`admit`'s return value and
        ``StepPlan.allocated`` instead need never poll.
        """
        log = self._q.alloc_log
        out = list(log)
        log.clear()
        return out

    def kv_arrived(self, req_id: str, generated: int = 0) -> None:
        """The KV cache of remote decode ``req_id`` has arrived: it becomes a running decode now if
        a running slot is free (and no earlier arrival waits for one), else when one frees up.
        It is not part of a step planned before this call.

        ``generated`` (live migration of a decoding request, TaiChi's flowing decode): output
        tokens the source node emitted while the KV was in transit; the request resumes at that
        token index (its first step here emits token ``generated``), with K counting them.

        Raises:
            EngineError: unknown id, the request is not awaiting its KV, or ``generated`` is not
                in ``[0, output_tokens)``.
        """
        r = self._get(req_id)
        if r.phase != AWAIT_KV:
            raise EngineError(f"kv_arrived({req_id!r}): request is {r.phase}, not awaiting_kv")
        g = as_count(req_id, "generated", generated)
        if not 0 <= g < r.output:
            raise EngineError(f"kv_arrived({req_id!r}): generated must be in [0, {r.output}), got {g}")
        self._q.arrive(r, g)

    def release(self, req_id: str) -> None:
        """Prefill node: the KV of ``req_id`` has been handed off; free its blocks.

        Raises:
            EngineError: unknown id, or its prefill has not finished (use :meth:`abort`).
        """
        r = self._get(req_id)
        if r.phase != HELD:
            raise EngineError(f"release({req_id!r}): request is {r.phase}, not held; use abort()")
        del self._q.held[req_id]
        self._q.drop(r)

    def abort(self, req_id: str) -> bool:
        """Remove ``req_id`` in any phase and free its blocks (failure, cancellation, re-route).

        Idempotent for cancellation races: returns False if the id is unknown (never added, or
        already finished/released/aborted), True if it was removed. If it is in a planned step that
        is not yet committed, the commit skips it (no token, no progress), as vLLM discards the
        output of an aborted request.
        """
        r = self._q.reqs.get(req_id)
        if r is None:
            return False
        self._q.remove(r)
        return True

    # -- stepping -----------------------------------------------------------------------------
    def plan_step(self) -> StepPlan | None:
        """Admit (see :meth:`admit`), then plan the next step; None when nothing is runnable.

        Request progress is not touched (only :meth:`commit_step` advances it); admission may move
        waiting requests into prefill, the deflection queue, awaiting-KV or decoding. A new plan
        supersedes an uncommitted one. Each call that returns a plan calls ``step_noise`` once, so
        a caller that re-plans draws again (determinism needs the same call sequence).

        Composition (token budget = ``max_num_batched_tokens``): every running decode, one token
        each; then on a prefill node the admitted prompts FIFO, each ``min(remaining, budget
        left)`` tokens, several per step (vLLM chunked prefill); on a decode node the head
        deflected prefill with ``min(remaining, χ_i − B, budget − B)`` tokens, at least 1, shrunk by
        the TBT guard when set. ``predicted_ms = model.step_ms(B, K, Σn, Σn·c/Σn)``.
        """
        allocated = tuple(self._q.admit())
        plan, refs = step.plan_step(self._q, self.model, self.truth, self._noise, self.tbt_guard_ms, allocated,
                                    self._steps)
        self._plan = plan
        self._plan_refs = refs
        return plan

    def commit_step(self, plan: StepPlan) -> StepResult:
        """Apply ``plan`` (after the caller advanced time by ``plan.duration_ms``).

        Each decode emits its next token; a request that emitted ``output_tokens`` finishes and its
        blocks are freed. Prefill chunks advance; a prefill-node prompt that completes is reported
        in ``prefill_done`` and holds its blocks until :meth:`release`; a deflected prompt that
        completes emits token 0 and joins the decodes (or finishes if ``output_tokens == 1``).
        Requests aborted since the plan are skipped; requests added or arrived since then are not
        in it.

        Raises:
            EngineError: ``plan`` is not the latest plan of this engine, or was already committed.
        """
        if plan is not self._plan:
            raise EngineError("commit_step: plan is stale, already committed or from another engine")
        self._plan = None
        refs = self._plan_refs
        self._plan_refs = step.NO_REFS
        result = step.commit_step(self._q, refs, plan.allocated, self._steps)
        self._steps += 1
        return result

    # -- views --------------------------------------------------------------------------------
    def state(self) -> EngineState:
        """Snapshot for heartbeats and the dispatcher (see :class:`EngineState`); O(requests)."""
        return self._q.state(self._steps)

    @property
    def idle(self) -> bool:
        """True iff :meth:`plan_step` would return None now: no running work and no waiting
        request that admission alone would make runnable. Only an external event (add,
        ``kv_arrived``, ``release``, ``abort``) can then create work. Does not mutate."""
        return self._q.idle

    @property
    def decoding_ids(self) -> frozenset[str]:
        """Ids of the running decodes (the B_n of the node's state), for attribution in tests and
        the simulator (which decodes joined a node after a decision)."""
        return frozenset(self._q.decoding)

    @property
    def num_requests(self) -> int:
        """Requests the engine holds in any phase (0: fully drained)."""
        return len(self._q.reqs)

    @property
    def steps(self) -> int:
        """Steps committed so far."""
        return self._steps

    def phase(self, req_id: str) -> RequestPhase | None:
        """Phase of ``req_id`` (:class:`~kairos.core.vocabulary.RequestPhase`: ``waiting``, ``prefilling``,
        ``deflected_prefill``, ``awaiting_kv``, ``ready``, ``decoding``, ``held``), None if unknown or gone."""
        r = self._q.reqs.get(req_id)
        return None if r is None else r.phase

    def progress(self, req_id: str) -> tuple[int, int] | None:
        """``(prompt tokens computed here, output tokens emitted)`` of ``req_id``, None if unknown."""
        r = self._q.reqs.get(req_id)
        return None if r is None else (r.computed, r.generated)

    def check_invariants(self) -> None:
        """Recompute the bookkeeping from scratch and compare (tests, simulator debug mode).

        Raises:
            AssertionError: blocks, slots, K or the phase indexes are inconsistent, or the
                snapshot :meth:`state` keeps is not the queues' of now.
        """
        self._q.check_invariants()
        assert self._q.snapshot in (None, self._q._state(self._steps)), "state() is stale"

    # -- prefix cache -------------------------------------------------------------------------
    def cached_prefix_tokens(self, req_id: str) -> int:
        """Prompt tokens of ``req_id`` served from this node's prefix cache at its admission (0
        before admission or without hashes). On a decode node, the keep path's KV transfer only
        carries ``prompt − this`` tokens.

        Raises:
            EngineError: unknown id.
        """
        return self._get(req_id).hit

    def prefix_hit_tokens(self, block_hashes: tuple[int, ...] | list[int], prompt_tokens: int) -> int:
        """Leading tokens of a ``prompt_tokens`` prompt with ``block_hashes`` this node would serve
        from its cache now (0 when caching is off); see :meth:`PrefixCache.hit_tokens`."""
        if self.cache is None or not block_hashes:
            return 0
        return self.cache.hit_tokens(block_hashes, prompt_tokens)

    def drain_cache_events(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)`` block hashes since the last call (net; vLLM KV events); both
        empty when caching is off. Feed them to :meth:`kairos.core.cluster.prefix_index.PrefixIndex.apply`."""
        return self.cache.drain_events() if self.cache is not None else ([], [])

    # -- internals ----------------------------------------------------------------------------
    def _get(self, req_id: str) -> Req:
        r = self._q.reqs.get(req_id)
        if r is None:
            raise EngineError(f"unknown request id {req_id!r}")
        return r
