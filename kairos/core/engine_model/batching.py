"""Small pure functions of the engine model: KV blocks, chunk-schedule honouring, the TBT guard.

Used by :class:`kairos.core.engine_model.core.Engine` on every step; free of engine state so that the
policies and tests can evaluate exactly what the engine will do. Tokens and ms throughout.
"""

from __future__ import annotations

from typing import Sequence

from kairos.core.model.latency import LatencyModel


def blocks_needed(tokens: int, block_size: int) -> int:
    """KV blocks (of ``block_size`` tokens) that hold ``tokens`` tokens: ⌈tokens / block_size⌉."""
    return -(-tokens // block_size)


def chunk_size_at(schedule: Sequence[int], step_index: int, budget: int) -> int:
    """χ of a deflected request's ``step_index``-th prefill step (0-based).

    Past the end of the schedule the last χ is reused (the policy sizes the schedule for the
    decision-time state; more steps are needed only when the batch grew). An empty schedule means
    "no schedule": the node's token budget (vLLM's plain chunked prefill).
    """
    if step_index < len(schedule):
        return schedule[step_index]
    return schedule[-1] if schedule else budget


def deflected_chunk_tokens(remaining: int, chi: int, batch_size: int, budget_left: int) -> int:
    """Prompt tokens of a deflected step: ``min(remaining, χ − B, budget left)``, at least 1.

    χ is the step's total tokens including the B decode tokens (paper §3.2, §5.4), so the chunk
    adds χ − B prompt tokens. When χ ≤ B the decodes alone fill χ; one prompt token is still
    scheduled so that the prefill always progresses (as ``fixed_chunk_steps`` in
    ``kairos/core/policy/estimates.py`` assumes). The caller guarantees ``budget_left ≥ 1``.
    """
    n = min(remaining, chi - batch_size, budget_left)
    return n if n >= 1 else 1


def guard_chunk_tokens(model: LatencyModel, batch_size: int, kv_tokens: int, tokens: int, cached: int,
                       limit_ms: float) -> int:
    """Largest p ≤ ``tokens`` with ``model.step_ms(B, K, p, cached) ≤ limit_ms``, at least 1.

    The kairos+ node-side TBT guard (paper §7: decodes that joined after the dispatch decision
    are unknown to it). Bisection, ≈ log2(tokens) model calls and only when the full chunk is over
    the limit; valid because every step latency is non-decreasing in p (non-negative
    coefficients, ``kairos/core/model/latency.py``).
    """
    step = model.step_ms
    if step(batch_size, kv_tokens, tokens, cached) <= limit_ms:
        return tokens
    lo, hi = 1, tokens - 1
    if hi < 1 or step(batch_size, kv_tokens, 1, cached) > limit_ms:
        return 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step(batch_size, kv_tokens, mid, cached) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo
