"""Values the engine model exchanges with its driver: config, step plan, step result, state.

Where they come from: :class:`~kairos.core.engine_model.core.Engine` builds :class:`StepPlan` in
``plan_step()``, :class:`StepResult` in ``commit_step()`` and :class:`EngineState` in ``state()``.
Where they go: the simulator (virtual clock) and the node agent's emulated backend (wall clock)
advance time by ``StepPlan.duration_ms`` and act on the result (stream tokens, start KV handoffs);
``EngineState`` goes into heartbeats and from there into the dispatcher's cluster view
(:class:`kairos.core.cluster.snapshot.PrefillNodeView` / :class:`kairos.core.cluster.snapshot.DecodeNodeView`).

All times are ms, all sizes are tokens unless a name says blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from kairos.core.model.latency import EngineLimits
from kairos.core.cluster.snapshot import InFlightDeflection

Role = Literal["prefill", "decode"]


class EngineError(ValueError):
    """Invalid use of the engine model.

    Raised for: an unknown or duplicate request id, a request sent to the wrong role, token counts
    < 1, a request whose KV blocks exceed the node's whole capacity (it could never be admitted),
    an event that does not match the request's phase (``kv_arrived`` before allocation,
    ``release`` before the prefill finished), a stale or foreign plan passed to ``commit_step``,
    and a step-noise function returning a negative or non-finite duration.
    """


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of one engine instance (vLLM ``SchedulerConfig`` / ``CacheConfig`` equivalents).

    Attributes:
        role: ``prefill`` (keep-path prefill node) or ``decode`` (decode node; also runs deflected
            prefills).
        max_num_seqs: max requests holding a running slot at once (vLLM ``--max-num-seqs``,
            ``Scheduler.max_num_running_reqs``).
        max_num_batched_tokens: token budget of one step (vLLM ``--max-num-batched-tokens``).
        kv_capacity_tokens: paged KV-cache capacity in tokens; the engine manages
            ``kv_capacity_tokens // block_size`` whole blocks.
        block_size: tokens per KV block (vLLM ``--block-size``).
        prefix_block_tokens: tokens per hashed block of the prefix cache (the granularity of the
            requests' ``block_hashes``); 0 = ``block_size``. The Mooncake trace hashes 512-token
            blocks. See :mod:`kairos.core.engine_model.prefix`.
        prefix_caching: keep a prefix cache (vLLM ``--enable-prefix-caching``, on by default in
            V1). Requests without block hashes never hit, so it only matters for those with.
    """

    role: Role
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    block_size: int
    prefix_block_tokens: int = 0
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise EngineError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not isinstance(self.prefix_block_tokens, int) or self.prefix_block_tokens < 0:
            raise EngineError(f"prefix_block_tokens must be an int >= 0, got {self.prefix_block_tokens!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EngineError(f"{name} must be an int >= 1, got {v!r}")
        # vLLM SchedulerConfig._verify_args rejects max_num_batched_tokens < max_num_seqs. We rely
        # on it: with every running decode taking one token, a step always has budget left for a
        # prefill token of a request that holds a running slot.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                              f"max_num_seqs ({self.max_num_seqs}), as vLLM requires")
        if self.kv_capacity_tokens < self.block_size:
            raise EngineError(f"kv_capacity_tokens ({self.kv_capacity_tokens}) is less than one block "
                              f"({self.block_size} tokens)")

    @classmethod
    def from_limits(cls, role: Role, limits: EngineLimits, prefix_block_tokens: int = 0,
                    prefix_caching: bool = True) -> "EngineConfig":
        """Config of a node of ``role`` from a profile's :class:`EngineLimits`.

        Prefill nodes use ``limits.max_num_batched_tokens`` (χ_p of Eq. 2–3), decode nodes
        ``limits.decode_max_num_batched_tokens``.
        """
        budget = limits.max_num_batched_tokens if role == "prefill" else limits.decode_max_num_batched_tokens
        return cls(role=role, max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=budget,
                   kv_capacity_tokens=limits.kv_capacity_tokens, block_size=limits.block_size,
                   prefix_block_tokens=prefix_block_tokens, prefix_caching=prefix_caching)

    @property
    def cache_block_tokens(self) -> int:
        """Tokens per hashed prefix-cache block (``prefix_block_tokens`` or ``block_size``)."""
        return self.prefix_block_tokens or self.block_size

    @property
    def total_blocks(self) -> int:
        """Whole KV blocks the node manages (a partial trailing block is unusable, as in vLLM)."""
        return self.kv_capacity_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the next engine step runs and how long it takes (returned by ``plan_step()``).

    Attributes:
        duration_ms: the step's latency to advance the clock by: the engine's ground truth
            (``truth.step_ms``, else ``predicted_ms``), passed through ``step_noise`` when the
            engine has a noise function (the simulator's per-step noise).
        predicted_ms: the latency model's prediction ``model.step_ms(batch_size, kv_tokens,
            prefill_tokens, prefill_cached)``, ms.
        decode_ids: running decodes in the step, one token each, in the order they started decoding.
        prefill_chunks: ``(req_id, tokens, cached_before)`` per prefill chunk in the step, FIFO:
            ``tokens`` new prompt tokens after ``cached_before`` already-computed prompt tokens of
            that request. On decode nodes the (single) deflected chunk is listed here too.
        batch_size: B, decodes in the step (= ``len(decode_ids)``).
        kv_tokens: K, context tokens of those decodes, summed (prompt + tokens emitted so far).
        prefill_tokens: Σ tokens over ``prefill_chunks``.
        prefill_cached: the chunks' token-weighted mean ``cached_before`` passed to the model
            (exact for the bilinear n·c / p·c features).
        deflected_chunk: ``(req_id, step_index, chi, tokens)`` when a deflected prefill runs:
            its ``step_index``-th prefill step (0-based) under chunk size ``chi`` of its schedule
            (total step tokens, §5.4), with ``tokens`` prompt tokens; else None.
        allocated: remote decodes whose KV blocks were allocated while planning this step (also
            reported by ``poll_allocated()``; informational).
        step: 0-based index of this step on this engine (committed steps before it).
    """

    duration_ms: float
    predicted_ms: float
    decode_ids: tuple[str, ...]
    prefill_chunks: tuple[tuple[str, int, int], ...]
    batch_size: int
    kv_tokens: int
    prefill_tokens: int
    prefill_cached: float
    deflected_chunk: tuple[str, int, int, int] | None
    allocated: tuple[str, ...]
    step: int

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step (decode tokens + prefill tokens); ≤ the token budget."""
        return self.batch_size + self.prefill_tokens


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a committed step produced (returned by ``commit_step()``).

    Attributes:
        tokens: ``(req_id, token_index)`` per output token emitted, ``token_index`` 0 being the
            request's first token: one per decode in the step, plus the first token of a deflected
            request whose prefill completed in this step. Requests aborted while the step ran are
            left out.
        first_tokens: requests whose first token (index 0) is in ``tokens`` (TTFT ends here).
        prefill_done: prefill-node requests whose prompt finished in this step; the caller starts
            the KV handoff and calls ``release()`` when it is done.
        finished: requests that emitted their last output token; their blocks are already free.
        allocated: same as the plan's ``allocated`` (informational; see ``poll_allocated()``).
        step: index of the committed step.
    """

    tokens: tuple[tuple[str, int], ...]
    first_tokens: tuple[str, ...]
    prefill_done: tuple[str, ...]
    finished: tuple[str, ...]
    allocated: tuple[str, ...]
    step: int


class EngineState(msgspec.Struct, frozen=True):
    """Snapshot of one engine for heartbeats and the dispatcher's view (§5.3).

    Maps onto :class:`kairos.core.cluster.snapshot.DecodeNodeView` (``batch_size``, ``kv_tokens``,
    ``deflection_in_flight``, ``in_flight``, ``waiting``) and
    :class:`kairos.core.cluster.snapshot.PrefillNodeView` (``queue_prompt_tokens``).
    """

    role: str  #: "prefill" or "decode"
    batch_size: int  #: B_n, running decodes (requests past their prefill that are generating)
    kv_tokens: int  #: K_n, context tokens of those decodes, summed (tokens)
    #: [ℓ_1..ℓ_k] of Eq. 2: prefill tokens still to compute per request in prefill or waiting for
    #: it, FIFO, the running one(s) first (remainders only). Prefill nodes: keep-path prompts;
    #: decode nodes: deflected prompts.
    queue_prompt_tokens: list[int]
    deflection_in_flight: bool  #: some deflected request has not finished its prefill (§5.3, §7)
    #: (prompt tokens still to compute, output tokens) of each deflected request not yet decoding, FIFO
    in_flight: list[InFlightDeflection]
    waiting: int  #: requests waiting for KV blocks, a running slot or their KV transfer
    free_kv_tokens: int  #: free KV capacity, tokens (free blocks × block_size)
    running: int  #: requests holding a running slot (prefilling, queued deflections, decoding)
    awaiting_kv: int = 0  #: remote decodes with blocks allocated whose KV has not arrived
    held: int = 0  #: prefill-node requests done prefilling whose KV is not yet released
    used_kv_tokens: int = 0  #: allocated KV capacity, tokens (allocated blocks × block_size)
    steps: int = 0  #: steps committed so far
