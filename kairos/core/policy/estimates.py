"""The two predictors of Algorithm 1: Prefill-Node TTFT Estimator (§4.2, Eq. 1–3) and Decode-Node
Feasibility Checker (§4.3, Eq. 4–6).

Pure functions of token counts and a :class:`~kairos.core.model.latency.LatencyModel`; no I/O. Every time is ms.

Choices where the paper is ambiguous (also in docs/policies.md):

* **χ counts the B decode tokens.** §3.2 defines χ as the total tokens of the batch, each chunk
  adding χ − B prefill tokens, and §5.4 says χ caps the batch's tokens. So a step with χ carries
  ``p = χ − B`` prompt tokens; a candidate with χ ≤ B carries none and is never safe. Algorithm 1's
  ``served ← served + χ`` therefore becomes ``served ← served + (χ − B)``, and the returned
  schedule's χ sum is ≥ ℓ_r + |X|·B ≥ ℓ_r.
* **Eq. 5's KV argument, split.** ``T_step(B_n, K_n + Σ_{j<i} χ^(j), χ^(i))`` is evaluated as
  ``T(B_n, K_n + i·B_n, p_i, c_i)``: since each χ carries the B decode tokens, Σχ grows the
  decodes' KV by B per step and the deflected prompt's cache by ``c_i = Σ_{j<i} p_j``; the model
  keeps the two apart (``kairos/core/model/latency.py``).
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

from bisect import bisect_left
from collections import OrderedDict
from typing import NamedTuple, Sequence

from kairos.core.model.latency import LatencyModel
from kairos.core.cluster.snapshot import MAX_TOKENS_PER_REQUEST


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


#: steps of a run that never becomes unsafe (slope ≤ 0: neither the decodes' KV nor the cache grows)
_UNBOUNDED = 1 << 62


class DecodeSweep:
    """The greedy TBT-safe chunk sweep of one decode-node state, for a prompt of any length.

    Algorithm 1's per-step LargestSafe does not look at ℓ_r except to stop: the χ chosen at step i
    depends only on (B, K, c_i, β·τ, 𝒳), so the schedule of a prompt is a prefix of one unbounded
    sweep. The sweep is a few runs of equal χ (T is non-decreasing, so a χ that became unsafe
    stays unsafe), each with the number of steps it can take (``cap``); within a run T grows by a
    constant per step, so a run's length and latency sum are closed-form. Runs are computed lazily,
    only as far as the longest prompt asked so far; :meth:`ttft` / :meth:`schedule` then cut the
    sweep at a prompt length in O(log runs). Sweeps are cached per (model, B, K, c, β·τ, 𝒳) by
    :func:`decode_schedule` / :func:`cached_sweep`, so a dispatcher pays for a node's runs once per
    state update.

    Built by :func:`decode_sweep`.
    """

    __slots__ = ("batch_size", "runs", "full", "ends", "_coef", "_kv", "_cands", "_limit", "_next")

    def __init__(self, model: LatencyModel, batch_size: int, kv_tokens: int, candidates_desc: Sequence[int],
                 step_limit_ms: float, cached_tokens: int) -> None:
        self.batch_size = batch_size
        #: per run: (χ, p, cap steps, first cached, first step, t1, slope, K at its first step,
        #: total ms of the runs before, prompt tokens covered before)
        self.runs: list[tuple] = []
        self.full: list[ChunkRun] = []  #: each run taken to its cap (the runs a longer prompt passes)
        #: prompt tokens covered at the end of each run (strictly increasing): a prompt of ``r``
        #: tokens ends in run ``bisect_left(ends, r)`` (``need ≤ cap ⟺ r − covered ≤ cap·p``)
        self.ends: list[int] = []
        # model.mixed_step_ms inlined (bit-identical, see LatencyModel.mixed_terms): the hot path
        self._coef = model.mixed_terms()
        self._kv, self._cands, self._limit = kv_tokens, candidates_desc, step_limit_ms
        #: where the next run starts: (candidate index, cached, step, total ms, covered), None: ended
        self._next: tuple[int, int, int, float, int] | None = (0, cached_tokens, 0, 0.0, 0)

    def _grow(self, remaining: int) -> None:
        """Compute runs until one covers ``remaining`` prompt tokens or the sweep ends (no safe χ,
        a run that never becomes unsafe, or :data:`MAX_TOKENS_PER_REQUEST` tokens)."""
        B = self.batch_size
        a, bd, kd, m1, m2, m3, m4 = self._coef
        base = a + bd * B
        limit, cands = self._limit, self._cands
        n_cand = len(cands)
        ends = self.ends
        while self._next is not None and (not ends or ends[-1] < remaining):
            k, cached, step, total, covered = self._next
            if covered >= MAX_TOKENS_PER_REQUEST:
                self._next = None
                return
            K = self._kv + step * B
            # LargestSafe from the current index: larger χ were unsafe earlier and stay unsafe.
            while k < n_cand:
                p = cands[k] - B
                if p > 0:
                    t1 = base + kd * K + p * (m1 + m2 * p + m3 * cached + m4 * K)
                    if t1 <= limit:
                        break
                k += 1
            else:
                self._next = None
                return
            K2 = K + B  # T(step j+1) − T(step j) within the run
            slope = (base + kd * K2 + p * (m1 + m2 * p + m3 * (cached + p) + m4 * K2)) - t1
            if slope > 0.0:
                cap = 1 + int((limit - t1) / slope)
                # guard the float division at the boundary
                while cap > 1 and t1 + slope * (cap - 1) > limit:
                    cap -= 1
                while t1 + slope * cap <= limit:
                    cap += 1
            else:
                cap = _UNBOUNDED
            self.runs.append((cands[k], p, cap, cached, step, t1, slope, K, total, covered))
            ends.append(covered + cap * p)
            if cap >= _UNBOUNDED:
                self._next = None
                return
            self.full.append(ChunkRun(cands[k], cap, p, cached, p, step, t1, slope, t1 + slope * (cap - 1)))
            self._next = (k + 1, cached + cap * p, step + cap, total + (cap * t1 + slope * cap * (cap - 1) / 2.0),
                          covered + cap * p)

    def _run(self, remaining: int) -> tuple[int, int, float, float] | None:
        """(run index, steps n in it, its last step's ms, TTFT ms) of a ``remaining``-token prompt."""
        ends = self.ends
        if not ends or ends[-1] < remaining:
            self._grow(remaining)
        i = bisect_left(ends, remaining)
        if i == len(ends):
            return None
        B = self.batch_size
        chi, p, cap, cached, step, t1, slope, K, before, covered = self.runs[i]
        left = remaining - covered
        n = -(-left // p)  # ceil: the steps this run takes (≤ cap)
        last = left - (n - 1) * p
        Kl = K + (n - 1) * B
        a, bd, kd, m1, m2, m3, m4 = self._coef
        t_last = a + bd * B + kd * Kl + last * (m1 + m2 * last + m3 * (cached + (n - 1) * p) + m4 * Kl)
        return i, n, t_last, before + ((n - 1) * t1 + slope * (n - 1) * (n - 2) / 2.0 + t_last)

    def ttft(self, remaining: int) -> float | None:
        """Eq. 6's TTFT_dec (ms) of a prompt with ``remaining`` tokens to prefill (> 0); None when
        the sweep becomes unsafe before it is prefilled."""
        r = self._run(remaining)
        return None if r is None else r[3]

    def schedule(self, remaining: int) -> tuple[float, list[ChunkRun]] | None:
        """``(ttft_dec_ms, runs)`` of a prompt with ``remaining`` tokens to prefill (> 0), exactly
        what the greedy loop computes for it; None when the sweep becomes unsafe before."""
        r = self._run(remaining)
        if r is None:
            return None
        i, n, t_last, total = r
        chi, p, cap, cached, step, t1, slope, K, before, covered = self.runs[i]
        runs = self.full[:i]
        runs.append(ChunkRun(chi, n, p, cached, remaining - covered - (n - 1) * p, step, t1, slope, t_last))
        return total, runs


def decode_sweep(model: LatencyModel, batch_size: int, kv_tokens: int, candidates_desc: Sequence[int],
                 step_limit_ms: float, cached_tokens: int = 0) -> DecodeSweep:
    """The (lazily computed) greedy sweep of a node state; see :class:`DecodeSweep` and
    :func:`decode_schedule`. At step i (0-based) the largest χ in ``candidates_desc`` with
    ``T(B, K + i·B, χ − B, c_i) ≤ step_limit_ms`` is taken, ``c_0 = cached_tokens``."""
    return DecodeSweep(model, batch_size, kv_tokens, candidates_desc, step_limit_ms, cached_tokens)


#: (id(model)) -> (model, {(B, K, c, β·τ, 𝒳): DecodeSweep}); bounded, oldest entry evicted first
_SWEEPS: dict[int, tuple[LatencyModel, dict]] = {}
_SWEEP_CACHE_MAX = 2048  # ≥ 8 × nodes of a 32P256D cluster; small, so the GC walks it fast


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
    own cache by its chunks (``c_i = c_0 + Σ_{j<i} (χ^(j) − B)``).

    Because T is non-decreasing in both, once a χ becomes unsafe it stays unsafe, so the schedule
    is a few runs of equal χ; within a run T grows by a constant per step, so each run's length
    and latency sum are computed in closed form, which makes the sweep O(|𝒳|) per node instead of
    O(steps). The ℓ-independent sweep (:class:`DecodeSweep`) is cached per node state and model,
    so repeated decisions against an unchanged node cost O(runs) without model evaluations.
    Property tests check it step by step against a literal transcription of Algorithm 1
    (tests/unit/test_policy_properties.py, tests/unit/test_policy_cache_aware.py).

    Args:
        batch_size, kv_tokens: B_n and K_n of the node.
        prompt_tokens: ℓ_r.
        candidates_desc: 𝒳 in descending order (a tuple for the cache; any sequence works).
        step_limit_ms: β·τ.
        cached_tokens: c, leading prompt tokens already held by the node's prefix cache
            (cache-aware policies): the schedule prefills the ℓ_r − c others and starts from
            ``c_0 = c`` (each chunk attends to the cached prefix). 0: Algorithm 1 as printed.

    Returns:
        ``(ttft_dec_ms, runs)`` or ``None`` when no schedule exists (some step has no safe χ).
    """
    remaining = prompt_tokens - cached_tokens
    if remaining <= 0:
        return 0.0, []
    return cached_sweep(sweep_cache(model), model, batch_size, kv_tokens, cached_tokens, step_limit_ms,
                        tuple(candidates_desc)).schedule(remaining)


def sweep_cache(model: LatencyModel) -> dict:
    """The sweep cache of ``model`` (one per model object; a hot-reloaded model gets a new one)."""
    entry = _SWEEPS.get(id(model))
    if entry is None or entry[0] is not model:
        if len(_SWEEPS) > 8:
            _SWEEPS.clear()
        entry = _SWEEPS[id(model)] = (model, OrderedDict())
    return entry[1]


def cached_sweep(cache: dict, model: LatencyModel, batch_size: int, kv_tokens: int, cached_tokens: int,
                 step_limit_ms: float, candidates_desc: tuple[int, ...]) -> DecodeSweep:
    """:func:`decode_sweep`, memoised in ``cache`` (from :func:`sweep_cache`) by node state."""
    key = (batch_size, kv_tokens, cached_tokens, step_limit_ms, candidates_desc)
    sweep = cache.get(key)
    if sweep is None:
        if len(cache) >= _SWEEP_CACHE_MAX:  # evict the oldest entry: O(1), no latency spike
            cache.popitem(last=False)
        sweep = cache[key] = decode_sweep(model, batch_size, kv_tokens, candidates_desc, step_limit_ms,
                                          cached_tokens)
    return sweep


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
    that the schedule is finite (the engine model does the same, see kairos/core/engine_model).
    """
    p = max(chunk_tokens - batch_size, 1)
    todo, c = prompt_tokens - cached_tokens, cached_tokens
    n = -(-todo // p)
    last = todo - (n - 1) * p
    B, K, mixed = batch_size, kv_tokens, model.mixed_step_ms
    t1 = float(mixed(B, K, p, c))
    slope = float(mixed(B, K + B, p, c + p)) - t1
    t_last = float(mixed(B, K + (n - 1) * B, last, c + (n - 1) * p))
    # one run of equal χ, as expand_runs lists it: step j takes t1 + j·slope, the last t_last
    return [chunk_tokens] * n, [t1 + slope * j for j in range(n - 1)] + [t_last]
