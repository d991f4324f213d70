"""Where each request of one engine is: the per-phase queues, FIFO admission, arrivals, removal.

Inputs: the requests :class:`~kairos.core.engine_model.core.Engine` is given (id, kind, token counts,
χ schedule, prefix hashes; checked and turned into :class:`~kairos.core.engine_model.request.Req`
records here), the node's limits
(:class:`~kairos.core.engine_model.types.EngineConfig`) and its :class:`~kairos.core.engine_model.kv.KvBlocks`.
Outputs: the queues the step planner reads (:mod:`kairos.core.engine_model.step`), the remote decodes
that got blocks (for their KV transfers), the :class:`~kairos.core.engine_model.types.EngineState`
snapshot and the invariant check.

Every request the engine holds is in exactly one index, keyed by its phase::

    waiting ──admit──> prefilling ──prompt done──> held (prefill node, until release)
            │                     └─(aggregated)─> decoding
            ├────────> deflect ──prompt done──> decoding
            └────────> await_kv ──kv arrived──> ready ──slot──> decoding ──last token──> gone

``decode_kv`` is K, Σ (prompt + generated) over the running decodes, kept incrementally.
"""

from __future__ import annotations

from collections import deque

from kairos.core.cluster.snapshot import InFlightDeflection
from kairos.core.engine_model.batching import blocks_needed
from kairos.core.engine_model.kv import KvBlocks
from kairos.core.engine_model.request import (AWAIT_KV, DECODING, DEFLECT, DEFLECTING, GONE, PREFILL, PREFILLING, READY,
                                        REMOTE, WAITING, Req, as_count)
from kairos.core.engine_model.types import EngineConfig, EngineError, EngineState
from kairos.core.vocabulary import RequestRole


class PhaseQueues:
    """The requests of one engine, indexed by phase, with their admission and removal rules.

    The containers are read directly by the step planner and the engine (hot paths); every
    phase change goes through a method here so the indexes stay a partition of ``reqs``. Each of
    them, and a step's commit, clears ``snapshot``: :meth:`state` until the next change (a
    heartbeat of a node that did nothing since the last one copies nothing).
    """

    __slots__ = ("config", "kv", "reqs", "waiting", "prefilling", "deflect", "await_kv", "ready", "decoding",
                 "held", "decode_kv", "alloc_log", "snapshot")

    def __init__(self, config: EngineConfig, kv: KvBlocks) -> None:
        self.config = config
        self.kv = kv
        self.reqs: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()  # waiting for blocks + a running slot, FIFO
        self.prefilling: deque[Req] = deque()  # prefill node: admitted, prompt not done, FIFO
        self.deflect: deque[Req] = deque()  # decode node: admitted deflections; head runs
        self.await_kv: dict[str, Req] = {}  # remote decodes with blocks, KV not arrived
        self.ready: deque[Req] = deque()  # KV arrived, no running slot yet
        self.decoding: dict[str, Req] = {}  # running decodes, in start order
        self.held: dict[str, Req] = {}  # prefill done, KV not yet released
        self.decode_kv = 0  # Σ (prompt + generated) over decoding
        self.alloc_log: dict[str, None] = {}  # allocated, not yet polled, still awaiting KV
        self.snapshot: EngineState | None = None

    @property
    def running(self) -> int:
        """Requests holding a running slot (prefilling, deflected prefills, decoding)."""
        return len(self.prefilling) + len(self.deflect) + len(self.decoding)

    def add(self, req_id: str, kind: RequestRole, role: str, prompt: int, output: int,
            sched: tuple[int, ...], hashes: tuple[int, ...] | list[int] = ()) -> None:
        """Check a new request and queue it at the tail of the waiting queue.

        ``kind`` is PREFILL, REMOTE or DEFLECT, ``role`` the node role it needs, ``prompt`` /
        ``output`` token counts, ``sched`` its χ schedule, ``hashes`` the prefix-cache hashes of
        its prompt (only the prompt's full cache blocks are kept).

        Raises:
            EngineError: wrong role, empty or duplicate id, a token count < 1 (output may be 0
                for PREFILL), or more KV blocks than the node has.
        """
        if self.config.role != role:
            raise EngineError(f"{req_id!r}: a {role} request was sent to a {self.config.role} engine")
        if not isinstance(req_id, str) or not req_id:
            raise EngineError(f"request id must be a non-empty str, got {req_id!r}")
        if req_id in self.reqs:
            raise EngineError(f"duplicate request id {req_id!r}")
        prompt, output = as_count(req_id, "prompt_tokens", prompt), as_count(req_id, "output_tokens", output)
        if prompt < 1 or (kind != PREFILL and output < 1):
            raise EngineError(f"{req_id!r}: need prompt_tokens >= 1 and output_tokens >= 1, got "
                              f"{prompt} and {output}")
        blocks = blocks_needed(prompt + output, self.config.block_size)
        if blocks > self.kv.total:
            raise EngineError(f"{req_id!r}: needs {blocks} KV blocks ({prompt + output} tokens), the node "
                              f"has {self.kv.total} in total; it could never be admitted")
        r = Req(req_id, kind, prompt, output, blocks, sched)
        cache = self.kv.cache
        if hashes and cache is not None:  # full blocks only (vLLM caches no partial block)
            r.hashes = tuple(hashes[:prompt // cache.block_tokens])
        self.reqs[req_id] = r
        self.waiting.append(r)
        self.snapshot = None

    def admit(self) -> list[str]:
        """FIFO admission (see :meth:`kairos.core.engine_model.core.Engine.admit`); returns the remote
        decodes that got blocks, in allocation order, and logs them for ``poll_allocated``."""
        self.snapshot = None
        cap = self.config.max_num_seqs
        running = len(self.prefilling) + len(self.deflect) + len(self.decoding)  # hot path: no property
        while self.ready and running < cap:
            self.start_decode(self.ready.popleft())
            running += 1
        new: list[str] = []
        waiting = self.waiting
        kv = self.kv
        while waiting and running < cap:
            r = waiting[0]
            if r.blocks > kv.free:
                break  # head-of-line: nobody behind it is admitted (vLLM FCFS)
            waiting.popleft()
            kv.reserve(r)
            if r.kind == REMOTE:
                r.phase = AWAIT_KV
                self.await_kv[r.id] = r
                new.append(r.id)
            elif r.kind == PREFILL:
                r.phase = PREFILLING
                self.prefilling.append(r)
                running += 1
            else:
                r.phase = DEFLECTING
                self.deflect.append(r)
                running += 1
        for rid in new:
            self.alloc_log[rid] = None
        kv.evict()
        return new

    def arrive(self, r: Req, generated: int) -> None:
        """The KV of awaiting remote decode ``r`` arrived (``generated`` tokens already emitted
        elsewhere): it decodes now if a slot is free and no earlier arrival waits, else it is ready."""
        self.snapshot = None
        r.generated = generated
        del self.await_kv[r.id]
        self.alloc_log.pop(r.id, None)
        self.kv.insert(r)
        if not self.ready and self.running < self.config.max_num_seqs:
            self.start_decode(r)
        else:
            r.phase = READY
            self.ready.append(r)

    def start_decode(self, r: Req) -> None:
        """``r`` becomes a running decode (its K joins ``decode_kv``)."""
        r.phase = DECODING
        self.decoding[r.id] = r
        self.decode_kv += r.prompt + r.generated

    def drop(self, r: Req) -> None:
        """Forget an admitted request and free its blocks (the caller removed it from its index)."""
        self.snapshot = None
        del self.reqs[r.id]
        self.kv.release(r)
        self.alloc_log.pop(r.id, None)  # unpolled allocation: its transfer must not start
        r.phase = GONE

    def remove(self, r: Req) -> None:
        """Take ``r`` out in whatever phase it is (abort): from its index, then :meth:`drop` it
        (a waiting request holds no blocks and is only forgotten)."""
        self.snapshot = None
        ph = r.phase
        if ph == WAITING:
            self.waiting.remove(r)
            del self.reqs[r.id]
            r.phase = GONE
            return
        if ph == PREFILLING:
            self.prefilling.remove(r)
        elif ph == DEFLECTING:
            self.deflect.remove(r)
        elif ph == AWAIT_KV:
            del self.await_kv[r.id]
        elif ph == READY:
            self.ready.remove(r)
        elif ph == DECODING:
            del self.decoding[r.id]
            self.decode_kv -= r.prompt + r.generated
        else:  # HELD
            del self.held[r.id]
        self.drop(r)

    @property
    def idle(self) -> bool:
        """True iff nothing is running and admission alone would make nothing runnable (see
        :attr:`kairos.core.engine_model.core.Engine.idle`). Does not mutate."""
        if self.decoding or self.prefilling or self.deflect or self.ready:
            return False
        free = self.kv.free  # running == 0 here, so only blocks gate admission
        for r in self.waiting:
            if r.blocks > free:
                break
            if r.kind != REMOTE:
                return False
            free -= r.blocks
        return True

    def state(self, steps: int) -> EngineState:
        """The :class:`EngineState` snapshot of these queues after ``steps`` committed steps: the one
        taken since the last change (``snapshot``; its lists are shared: do not mutate them)."""
        if self.snapshot is None:
            self.snapshot = self._state(steps)
        return self.snapshot

    def _state(self, steps: int) -> EngineState:
        role = self.config.role
        if role == "prefill":
            queue = [r.prompt - r.computed for r in self.prefilling]
            queue.extend(r.prompt for r in self.waiting)
            in_flight: list[InFlightDeflection] = []
        else:
            pending = list(self.deflect)
            pending.extend(r for r in self.waiting if r.kind == DEFLECT)
            queue = [r.prompt - r.computed for r in pending]
            in_flight = [InFlightDeflection(prompt_tokens=r.prompt - r.computed, output_tokens=r.output)
                         for r in pending]
        return EngineState(
            role=role,
            batch_size=len(self.decoding),
            kv_tokens=self.decode_kv,
            queue_prompt_tokens=queue,
            deflection_in_flight=bool(in_flight),
            in_flight=in_flight,
            waiting=len(self.waiting) + len(self.await_kv) + len(self.ready),
            free_kv_tokens=self.kv.free_tokens,
            running=self.running,
            awaiting_kv=len(self.await_kv),
            held=len(self.held),
            used_kv_tokens=self.kv.used_tokens,
            steps=steps,
        )

    def check_invariants(self) -> None:
        """Recompute the bookkeeping from scratch and compare.

        Raises:
            AssertionError: blocks, slots, K or the phase indexes are inconsistent.
        """
        self.kv.check(list(self.reqs.values()), sum(r.blocks for r in self.reqs.values() if r.phase != WAITING))
        assert self.running <= self.config.max_num_seqs, "running slots exceeded"
        assert self.decode_kv == sum(r.prompt + r.generated for r in self.decoding.values()), "K drift"
        n = (len(self.waiting) + len(self.prefilling) + len(self.deflect) + len(self.await_kv)
             + len(self.ready) + len(self.decoding) + len(self.held))
        assert n == len(self.reqs), "phase indexes do not partition the requests"
        assert all(rid in self.await_kv for rid in self.alloc_log), "allocation log holds a non-awaiting id"
