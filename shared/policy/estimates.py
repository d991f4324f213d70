"""The two predictors of Algorithm 1: Prefill-Node TTFT Estimator (§4.2, Eq. 1–3) and Decode-Node
Feasibility Checker (§4.3, Eq. 4–6).

Pure functions of token counts and a :class:`~shared.latency.LatencyModel`; no I/O. Every time is ms.

Choices where the paper is ambiguous (also in docs/policies.md):

* **χ counts the B decode tokens.** §3.2 defines χ as the total tokens of the batch, each chunk
  adding χ − B prefill tokens, and §5.4 says χ caps the batch's tokens. So a step with χ carries
  ``p = χ − B`` prompt tokens; a candidate with χ ≤ B carries none and is never safe. Algorithm 1's
  ``served ← served + χ`` therefore becomes ``served ← served + (χ − B)``, and the returned
  schedule's χ sum is ≥ ℓ_r + |X|·B ≥ ℓ_r.
* **Eq. 5's KV argument, split.** ``T_step(B_n, K_n + Σ_{j<i} χ^(j), χ^(i))`` is evaluated as
  ``T(B_n, K_n + i·B_n, p_i, c_i)``: since each χ carries the B decode tokens, Σχ grows the
  decodes' KV by B per step and the deflected prompt's cache by ``c_i = Σ_{j<i} p_j``; the model
  keeps the two apart (``shared/latency.py``).
* **The last chunk.** Eq. 5 is checked for the full chunk χ on every step, the last included (as
  Algorithm 1 charges a full χ); Eq. 6 sums the latency of the tokens actually scheduled, so the
  final partial chunk's predicted step and the TTFT are not over-charged.
* **Eq. 3's bounds.** The printed sum runs i = 0..⌈ℓ/χ_p⌉, one chunk more than the prompt needs;
  we sum the ⌈ℓ/χ_p⌉ chunks the engine runs, chunk i holding min(χ_p, ℓ − iχ_p) tokens after
  iχ_p cached ones.
* **Eq. 2's queue.** ``[ℓ_1..ℓ_k]`` are the prefill tokens still to compute for every request
  ahead (the running one's remainder first). Σℓ/χ_p is not rounded up, as printed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from shared.latency import LatencyModel


def prefill_queue_wait_ms(model: LatencyModel, queue_prompt_tokens: Sequence[int], chunk_tokens: int) -> float:
    """W_queue (Eq. 2): (Σℓ_i / χ_p) · T_step(χ_p, Σℓ_i / 2), ms; 0 for an empty queue."""
    total = sum(queue_prompt_tokens)
    if total <= 0:
        return 0.0
    return total / chunk_tokens * float(model.prefill_step_ms(chunk_tokens, total / 2.0))


def prefill_exec_ms(model: LatencyModel, prompt_tokens: int, chunk_tokens: int, cached_tokens: int = 0) -> float:
    """T_pf (Eq. 3): Σ_i T_step(min(χ_p, u − iχ_p), c + iχ_p) over the ⌈u/χ_p⌉ chunks of the
    u = ℓ − c uncached tokens, ms. O(1).

    ``cached_tokens`` c: leading prompt tokens the node serves from its prefix cache (cache-aware
    policies; 0 = Eq. 3 as printed): only the rest is computed, each chunk attending to them.
    Uses the closed form of the sum for the full chunks (T is affine in the cached tokens).
    """
    todo = prompt_tokens - cached_tokens
    if todo <= 0:
        return 0.0
    full, last = divmod(todo, chunk_tokens)
    first = float(model.prefill_step_ms(chunk_tokens, cached_tokens))
    slope = float(model.prefill_step_ms(chunk_tokens, cached_tokens + chunk_tokens)) - first  # per chunk of cache
    total = full * first + slope * full * (full - 1) / 2.0
    if last:
        total += float(model.prefill_step_ms(last, cached_tokens + full * chunk_tokens))
    return total


def prefill_ttft_ms(model: LatencyModel, prompt_tokens: int, queue_prompt_tokens: Sequence[int],
                    chunk_tokens: int) -> float:
    """TTFT_pf (Eq. 1) = W_queue (Eq. 2) + T_pf (Eq. 3), ms."""
    return prefill_queue_wait_ms(model, queue_prompt_tokens, chunk_tokens) + prefill_exec_ms(
        model, prompt_tokens, chunk_tokens)


class ChunkRun(NamedTuple):
    """``steps`` consecutive steps of chunk size ``chi`` in a schedule (one run of equal χ).

    Every step carries ``prefill_tokens`` prompt tokens except the last, which carries
    ``last_tokens``; the first is step ``first_step`` (0-based) of the schedule and starts after
    ``first_cached`` cached prompt tokens. Predicted latencies (ms): step j of the run takes
    ``first_ms + j·slope_ms`` (T is affine in the step index within a run), the last one
    ``last_ms``.
    """

    chi: int
    steps: int
    prefill_tokens: int
    first_cached: int
    last_tokens: int
    first_step: int
    first_ms: float
    slope_ms: float
    last_ms: float


def decode_schedule(
    model: LatencyModel,
    batch_size: int,
    kv_tokens: int,
    prompt_tokens: int,
    candidates_desc: Sequence[int],
    step_limit_ms: float,
    cached_tokens: int = 0,
) -> tuple[float, list[ChunkRun]] | None:
    """Greedy TBT-safe chunk schedule on one decode node (Eq. 5) and its TTFT (Eq. 6).

    At step i (0-based) the largest χ in ``candidates_desc`` with
    ``T(B, K + i·B, χ − B, c_i) ≤ step_limit_ms`` is taken (Algorithm 1's LargestSafe). The KV
    argument is Eq. 5's ``K_n + Σ_{j<i} χ^(j)`` split in two: the decodes' KV grows by their B
    tokens per step (``K + i·B``, the B decode tokens each χ carries) and the deflected prompt's
    own cache by its chunks (``c_i = Σ_{j<i} (χ^(j) − B)``).

    Because T is non-decreasing in both, once a χ becomes unsafe it stays unsafe, so the schedule
    is a few runs of equal χ; within a run T grows by a constant per step, so each run's length
    and latency sum are computed in closed form, which makes the sweep O(|𝒳|) per node instead of
    O(steps).

    Args:
        batch_size, kv_tokens: B_n and K_n of the node.
        prompt_tokens: ℓ_r.
        candidates_desc: 𝒳 in descending order.
        step_limit_ms: β·τ.
        cached_tokens: c, leading prompt tokens already held by the node's prefix cache
            (cache-aware policies): the schedule prefills the ℓ_r − c others and starts from
            ``c_0 = c`` (each chunk attends to the cached prefix). 0: Algorithm 1 as printed.

    Returns:
        ``(ttft_dec_ms, runs)`` or ``None`` when no schedule exists (some step has no safe χ).
    """
    remaining = prompt_tokens - cached_tokens
    cached = cached_tokens
    step = 0
    total = 0.0
    runs: list[ChunkRun] = []
    k = 0
    n_cand = len(candidates_desc)
    B = batch_size
    mixed = model.mixed_step_ms
    while remaining > 0:
        K = kv_tokens + step * B
        # LargestSafe from the current index: larger χ were unsafe earlier and stay unsafe.
        while k < n_cand:
            p = candidates_desc[k] - B
            if p > 0:
                t1 = float(mixed(B, K, p, cached))
                if t1 <= step_limit_ms:
                    break
            k += 1
        else:
            return None
        slope = float(mixed(B, K + B, p, cached + p)) - t1  # T(step j+1) − T(step j) within the run
        need = -(-remaining // p)  # ceil
        if slope > 0.0:
            n_safe = 1 + int((step_limit_ms - t1) / slope)
            # guard the float division at the boundary
            while n_safe > 1 and t1 + slope * (n_safe - 1) > step_limit_ms:
                n_safe -= 1
            while t1 + slope * n_safe <= step_limit_ms and n_safe < need:
                n_safe += 1
        else:
            n_safe = need
        n = min(n_safe, need)
        if n == need:  # run finishes the prompt; its last step may be partial
            last = remaining - (n - 1) * p
            t_last = float(mixed(B, K + (n - 1) * B, last, cached + (n - 1) * p))
            total += (n - 1) * t1 + slope * (n - 1) * (n - 2) / 2.0 + t_last
            runs.append(ChunkRun(candidates_desc[k], n, p, cached, last, step, t1, slope, t_last))
            return total, runs
        total += n * t1 + slope * n * (n - 1) / 2.0
        runs.append(ChunkRun(candidates_desc[k], n, p, cached, p, step, t1, slope, t1 + slope * (n - 1)))
        cached += n * p
        remaining -= n * p
        step += n
        k += 1
    return total, runs  # pragma: no cover - prompt_tokens <= 0


def expand_runs(runs: Sequence[ChunkRun]) -> tuple[list[int], list[float]]:
    """Per-step (χ list, predicted step ms list) of a schedule returned by :func:`decode_schedule`.

    O(steps) list building without model calls: within a run the step latency is
    ``first_ms + j·slope_ms`` (exact up to float rounding), the run's last step ``last_ms``.
    """
    chis: list[int] = []
    steps: list[float] = []
    for r in runs:
        chis.extend([r.chi] * r.steps)
        t1, slope = r.first_ms, r.slope_ms
        steps.extend([t1 + slope * j for j in range(r.steps - 1)])
        steps.append(r.last_ms)
    return chis, steps


def fixed_chunk_steps(model: LatencyModel, batch_size: int, kv_tokens: int, prompt_tokens: int,
                      chunk_tokens: int, cached_tokens: int = 0) -> tuple[list[int], list[float]]:
    """A fixed-χ schedule (static policies, Dynamo): ⌈(ℓ−c)/(χ−B)⌉ steps and their predicted ms,
    starting after ``cached_tokens`` c prefix-cached prompt tokens.

    When χ ≤ B the decodes alone fill the budget; we still schedule one prompt token per step so
    that the schedule is finite (the engine model does the same, see shared/engine).
    """
    p = max(chunk_tokens - batch_size, 1)
    todo, c = prompt_tokens - cached_tokens, cached_tokens
    n = -(-todo // p)
    last = todo - (n - 1) * p
    B, K, mixed = batch_size, kv_tokens, model.mixed_step_ms
    t1 = float(mixed(B, K, p, c))
    slope = float(mixed(B, K + B, p, c + p)) - t1
    t_last = float(mixed(B, K + (n - 1) * B, last, c + (n - 1) * p))
    return expand_runs([ChunkRun(chunk_tokens, n, p, c, last, 0, t1, slope, t_last)])
