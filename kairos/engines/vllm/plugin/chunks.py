"""The chunk-schedule arithmetic of the scheduler plugin (pure; no vLLM import).

A deflected request carries ``kairos_prefill_chunks = [p_1, p_2, …]`` — prompt tokens per prefill
step, the last entry repeating past the end (contract B; the node agent converts the dispatcher's
χ_i, which counts the step's B decode tokens, into p_i = χ_i − B_decision, see docs/vllm.md).
The cumulative boundaries are c_k = p_1 + … + p_k. The plugin is *stateless*: in any step, a
prefilling request with ``num_computed_tokens`` = n may get at most c_k − n new tokens, where c_k
is the first boundary above n. Whatever moved n — a previous chunk, a prefix-cache hit, KV loaded
by a connector, a preemption that reset it to 0, a chunk cut short by the token budget — the next
chunk ends on the schedule's next boundary.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kairos.engines.vllm.plugin.protocol import CHUNKS_KEY, RID_KEY


class ChunkScheduleError(ValueError):
    """``kairos_prefill_chunks`` is not a non-empty list of positive integers."""


def parse_chunks(extra_args: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    """The request's prefill chunks from ``SamplingParams.extra_args``, or None when it has none.

    Raises :class:`ChunkScheduleError` (message names the key and the bad value) when the value is
    not a non-empty list of integers ≥ 1 (bools are refused).
    """
    if not extra_args or CHUNKS_KEY not in extra_args:
        return None
    raw = extra_args[CHUNKS_KEY]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ChunkScheduleError(f"{CHUNKS_KEY} must be a non-empty list of positive integers, got {raw!r}")
    for i, p in enumerate(raw):
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ChunkScheduleError(f"{CHUNKS_KEY}[{i}] must be an integer >= 1, got {p!r}")
    return tuple(raw)


def kairos_request_id(extra_args: Mapping[str, Any] | None, engine_request_id: str) -> str:
    """The Kairos request id (``extra_args["kairos_rid"]``) if it is a string, else vLLM's id."""
    rid = extra_args.get(RID_KEY) if extra_args else None
    return rid if isinstance(rid, str) and rid else engine_request_id


def chunk_position(chunks: Sequence[int], num_computed_tokens: int) -> tuple[int, int]:
    """``(k, c_k)``: the 0-based index of the chunk holding prompt position ``num_computed_tokens``
    and that chunk's cumulative end boundary (tokens); ``c_k > num_computed_tokens`` always.

    Past the end of ``chunks`` the last entry repeats: index ``len(chunks) - 1 + j`` ends at
    ``sum(chunks) + j * chunks[-1]``. ``chunks`` must be non-empty positive ints (see
    :func:`parse_chunks`); ``num_computed_tokens`` ≥ 0.
    """
    end = 0
    for k, p in enumerate(chunks):
        end += p
        if num_computed_tokens < end:
            return k, end
    last = chunks[-1]
    extra = (num_computed_tokens - end) // last + 1
    return len(chunks) - 1 + extra, end + extra * last


def prefill_cap(chunks: Sequence[int], num_computed_tokens: int, num_prompt_tokens: int) -> int | None:
    """Most prompt tokens the request may schedule this step, or None (no cap) once its prompt
    is computed (decoding, or recomputing output tokens after a preemption).

    The cap is ``c_k − num_computed_tokens`` (≥ 1) for the next boundary ``c_k`` (see
    :func:`chunk_position`). The scheduler applies ``min(its own count, cap)``.
    """
    if num_computed_tokens >= num_prompt_tokens:
        return None
    _, boundary = chunk_position(chunks, num_computed_tokens)
    return boundary - num_computed_tokens
