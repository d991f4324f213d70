"""One engine step: what it contains and how long it takes (plan), and what it did (commit).

Inputs: the admitted requests in :class:`~kairos.core.engine_model.queues.PhaseQueues`, the node's
token budget, the step-latency model (``model.step_ms(B, K, Σn, c)``, ms), the optional ground
truth and step noise, and the kairos+ TBT guard (ms). Outputs: a
:class:`~kairos.core.engine_model.types.StepPlan` plus the request references it was built from
(:func:`plan_step`), and after the caller advanced its clock a
:class:`~kairos.core.engine_model.types.StepResult` (:func:`commit_step`), whose requests have moved
on in the queues. :class:`~kairos.core.engine_model.core.Engine` calls both; the semantics (vLLM's
"running decodes first, then prefill work in the budget left", the chunk schedule χ_i − B of
paper §5.4) are described in :mod:`kairos.core.engine_model.core`.
"""

from __future__ import annotations

import math
from typing import Callable

from kairos.core.engine_model.batching import chunk_size_at, deflected_chunk_tokens, guard_chunk_tokens
from kairos.core.engine_model.queues import PhaseQueues
from kairos.core.engine_model.request import DECODING, DEFLECTING, HELD, PREFILLING, Req
from kairos.core.engine_model.truth import GroundTruth
from kairos.core.engine_model.types import EngineError, StepPlan, StepResult
from kairos.core.model.latency import LatencyModel

#: what a plan was built from, for its commit: the running decodes and the ``(request, prompt
#: tokens)`` of each prefill chunk
StepRefs = tuple[list[Req], list[tuple[Req, int]]]

NO_REFS: StepRefs = ([], [])


def plan_step(q: PhaseQueues, model: LatencyModel, truth: GroundTruth | None,
              noise: Callable[[float], float] | None, tbt_guard_ms: float | None,
              allocated: tuple[str, ...], step_index: int) -> tuple[StepPlan | None, StepRefs]:
    """Compose the next step from the admitted requests; ``(None, NO_REFS)`` when nothing runs.

    Every running decode gets one token; then on a prefill node the admitted prompts FIFO, each
    ``min(remaining, budget left)`` tokens (vLLM chunked prefill); on a decode node the head
    deflected prefill with ``min(remaining, χ_i − B, budget − B)`` tokens, at least 1, shrunk by the
    TBT guard when set. ``predicted_ms = model.step_ms(B, K, Σn, Σn·c/Σn)``; the duration is the
    truth's time (or the prediction), passed through ``noise``. ``allocated`` and ``step_index``
    are copied into the plan. Does not touch request progress.

    Raises:
        EngineError: ``noise`` returned a negative or non-finite duration.
    """
    budget = q.config.max_num_batched_tokens
    decs = list(q.decoding.values())
    B = len(decs)
    K = q.decode_kv
    left = budget - B
    chunks: list[tuple[str, int, int]] = []
    refs: list[tuple[Req, int]] = []
    defl: tuple[str, int, int, int] | None = None
    ptok = 0
    pcw = 0  # Σ n·cached
    if q.prefilling:
        for r in q.prefilling:
            if left <= 0:
                break
            n = r.prompt - r.computed
            if n > left:
                n = left
            chunks.append((r.id, n, r.computed))
            refs.append((r, n))
            left -= n
            ptok += n
            pcw += n * r.computed
    elif q.deflect:
        r = q.deflect[0]
        i = r.steps
        chi = chunk_size_at(r.schedule, i, budget)
        # left ≥ 1: r holds a running slot, so B < max_num_seqs ≤ budget
        n = deflected_chunk_tokens(r.prompt - r.computed, chi, B, left)
        if tbt_guard_ms is not None:
            n = guard_chunk_tokens(model, B, K, n, r.computed, tbt_guard_ms)
        chunks.append((r.id, n, r.computed))
        refs.append((r, n))
        defl = (r.id, i, chi, n)
        ptok = n
        pcw = n * r.computed
    if not B and not ptok:
        return None, NO_REFS
    cached = pcw / ptok if ptok else 0.0
    predicted = model.step_ms(B, K, ptok, cached)
    duration = predicted if truth is None else truth.step_ms(B, K, ptok, cached)
    if noise is not None:
        true_ms = duration
        duration = float(noise(true_ms))
        if not (duration >= 0.0 and math.isfinite(duration)):
            raise EngineError(f"step_noise({true_ms!r}) returned {duration!r}; need a finite ms >= 0")
    plan = StepPlan(duration, predicted, tuple(q.decoding), tuple(chunks), B, K, ptok, cached,
                    defl, allocated, step_index)
    return plan, (decs, refs)


def commit_step(q: PhaseQueues, refs: StepRefs, allocated: tuple[str, ...], step_index: int) -> StepResult:
    """Apply a planned step built from ``refs`` and return what it produced.

    Each decode emits its next token; a request that emitted ``output_tokens`` finishes and its
    blocks are freed. Prefill chunks advance; a prefill-node prompt that completes goes to
    ``held`` (reported in ``prefill_done``) or, aggregated, emits token 0 and decodes here; a
    deflected prompt that completes emits token 0 and joins the decodes. Requests no longer in
    the phase they were planned in (aborted meanwhile) are skipped.
    """
    q.snapshot = None
    decs, chunk_refs = refs
    tokens: list[tuple[str, int]] = []
    first: list[str] = []
    done: list[str] = []
    finished: list[str] = []
    decoding = q.decoding
    for r in decs:
        if r.phase != DECODING:
            continue  # aborted while the step ran
        idx = r.generated
        r.generated = idx + 1
        tokens.append((r.id, idx))
        if idx == 0:
            first.append(r.id)
        if idx + 1 >= r.output:
            del decoding[r.id]
            q.decode_kv -= r.prompt + idx
            q.drop(r)
            finished.append(r.id)
        else:
            q.decode_kv += 1
    for r, n in chunk_refs:
        if r.phase == PREFILLING:
            r.computed += n
            r.steps += 1
            if r.computed >= r.prompt:
                q.prefilling.remove(r)  # a FIFO prefix: found at the front
                q.kv.insert(r)
                if r.output > 0:  # aggregated: first token here, then decode here
                    _first_token(q, r, tokens, first, finished)
                    continue
                r.phase = HELD
                q.held[r.id] = r
                done.append(r.id)
        elif r.phase == DEFLECTING:
            r.computed += n
            r.steps += 1
            if r.computed >= r.prompt:
                q.deflect.popleft()  # r is the head: only abort can remove it earlier
                q.kv.insert(r)
                _first_token(q, r, tokens, first, finished)
    return StepResult(tuple(tokens), tuple(first), tuple(done), tuple(finished), allocated, step_index)


def _first_token(q: PhaseQueues, r: Req, tokens: list, first: list, finished: list) -> None:
    """``r``'s prefill completed on this node: its first output token is emitted in this step
    (index 0); then it decodes here, or is finished if it wanted one token."""
    r.generated = 1
    tokens.append((r.id, 0))
    first.append(r.id)
    if r.output <= 1:
        q.drop(r)
        finished.append(r.id)
    else:
        q.start_decode(r)
