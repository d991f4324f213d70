"""The search of ``kairos plan``: how many prefill and decode nodes a workload needs under each policy.

Pure: it asks an ``evaluate`` callable (:meth:`kairos.plan.evaluate.Evaluator.evaluate`, or a stand-in in
tests) for the outcomes of batches of points and decides from them alone. For each policy:

* **best split at a size** — every P:D split of ``n`` nodes when there are few, else an even grid of
  them, then finer grids between the neighbours of the best so far until every split between them
  is known (:func:`best_split`; the attainment over the splits is unimodal in practice);
* **smallest cluster** — over the node count, the question "does a split of n nodes meet the
  attainment target?" (feasibility grows with n): n doubled from the range's bottom until it does,
  then a bisection, the answer confirmed on every seed, going up by growing steps while a seed
  misses (:func:`smallest_cluster`);
* **highest sustainable rate** at a split — from a guess, a widening bracket, then a bisection to
  :data:`RATE_PRECISION`, of the request rate at which the target holds, every seed's search in
  step (:func:`max_rates`);
* **the ceiling** — the attainment of the workload's requests each alone on an idle cluster: what no
  cluster size beats (long prompts whose prefill alone outlasts the TTFT SLO miss on any); a target
  above it on some seed is out of reach, found without a search (:func:`ceiling`);
* **the noise rule** — outcomes over several seeds give a range [min, max]; one split or policy is
  called better than another only when the ranges do not overlap (:func:`clearly_better`), and a
  cluster meets the target only when its worst seed clears it by more than the range is wide
  (:func:`meets_beyond_spread`).

SLO attainment is the fraction of requests with TTFT ≤ the TTFT SLO and P95 inter-token gap ≤ τ
(paper §6, :func:`kairos.core.workload.serving_metrics.summarize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kairos.plan.evaluate import Outcome, Point

Evaluate = Callable[[Sequence[Point]], list[Outcome]]

#: splits of one size evaluated directly when there are at most this many; else a grid of this many
FULL_GRID = 9
#: the finer grid between the neighbours of the best so far while they are further apart than this
REFINE_GRID = 5
#: a size is confirmed on every seed with at most this many of its best splits on the first seed
CONFIRM_SPLITS = 3
#: rate search: steps to bracket the sustainable rate, then bisection steps at most; the relative
#: width of the final bracket; how far from the workload's rate it looks (× and ÷)
RATE_BRACKET_STEPS, RATE_BISECT_STEPS, RATE_PRECISION, RATE_SPAN = 8, 8, 0.04, 256.0


class PlanError(ValueError):
    """A plan that cannot be searched (bad range, no seeds, target out of (0, 1])."""


@dataclass(frozen=True)
class Spread:
    """Attainment of one (policy, split, rate) over seeds: ``mean``, ``lo`` (min), ``hi`` (max), and
    the per-seed ``values`` (fractions 0–1, in seed order)."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)


def meets_beyond_spread(s: Spread, target: float) -> bool:
    """The target is met beyond the noise: the worst seed minus the seeds' spread (max − min) still
    reaches it. A cluster whose worst seed clears the target by less than the seeds disagree could
    miss it on the next seed (one seed: no spread, its value alone)."""
    return s.lo - (s.hi - s.lo) >= target


def clearly_better(a: Spread, b: Spread) -> bool:
    """``a`` beats ``b`` beyond the noise: every seed of ``a`` scored above every seed of ``b``
    (their [min, max] ranges do not overlap). A difference inside the spread is no difference."""
    return a.lo > b.hi


def _splits(n: int) -> list[int]:
    """Prefill counts evaluated first for ``n`` nodes: all of 1..n-1, or an even grid of :data:`FULL_GRID`."""
    if n - 1 <= FULL_GRID:
        return list(range(1, n))
    step = (n - 2) / (FULL_GRID - 1)
    return sorted({1 + round(i * step) for i in range(FULL_GRID)})


def _rank(o: Outcome) -> tuple[float, float]:
    """Sort key of a split's outcome: higher attainment first, then lower P95 TTFT."""
    return (o.attainment, -(o.ttft_p95_ms if o.ttft_p95_ms is not None else float("inf")))


def best_split(evaluate: Evaluate, policy: str, n: int, rps: float | None, seed: int,
               every: bool = False, enough: float | None = None) -> tuple[int, dict[int, Outcome]]:
    """The prefill count P (decode: ``n`` − P) of ``n`` nodes with the highest attainment (ties: the
    lower P95 TTFT, then the fewer prefill nodes), and every split evaluated (P → outcome).
    ``every``: evaluate all n − 1 splits (a plot's full curve); ``enough``: no refinement when a
    grid split already reaches this attainment (the question is only "does one?").
    Raises PlanError for n < 2."""
    if n < 2:
        raise PlanError(f"a P/D cluster needs at least 2 nodes, got {n}")
    first = list(range(1, n)) if every else _splits(n)
    seen = dict(zip(first, evaluate([Point(policy, p, n - p, rps, seed) for p in first])))
    reached = enough is not None and max(o.attainment for o in seen.values()) >= enough
    while not every and not reached:  # refine between the grid neighbours of the best, on a finer grid
        done = sorted(seen)
        best = max(done, key=lambda p: (_rank(seen[p]), -p))
        i = done.index(best)
        lo, hi = done[max(0, i - 1)], done[min(len(done) - 1, i + 1)]
        inside = [p for p in range(lo + 1, hi) if p not in seen]
        if not inside:
            break
        if len(inside) > REFINE_GRID:  # still wide: an even grid of it, then again
            step = (len(inside) - 1) / (REFINE_GRID - 1)
            inside = sorted({inside[round(k * step)] for k in range(REFINE_GRID)})
        seen.update(zip(inside, evaluate([Point(policy, p, n - p, rps, seed) for p in inside])))
    best = max(seen, key=lambda p: (_rank(seen[p]), -p))
    return best, dict(sorted(seen.items()))


def spread(evaluate: Evaluate, policy: str, prefill: int, decode: int, rps: float | None,
           seeds: Sequence[int]) -> Spread:
    """Attainment of one split over ``seeds``."""
    return spreads(evaluate, policy, [prefill], prefill + decode, rps, seeds)[prefill]


def spreads(evaluate: Evaluate, policy: str, prefills: Sequence[int], n: int, rps: float | None,
            seeds: Sequence[int]) -> dict[int, Spread]:
    """Attainment over ``seeds`` of each split of ``n`` nodes with a prefill count in ``prefills``,
    evaluated as one batch (prefill count → spread)."""
    outs = evaluate([Point(policy, p, n - p, rps, s) for p in prefills for s in seeds])
    k = len(seeds)
    return {p: Spread(tuple(o.attainment for o in outs[i * k:(i + 1) * k])) for i, p in enumerate(prefills)}


def ceiling(evaluate: Evaluate, policy: str, rps: float | None, seeds: Sequence[int]) -> Spread:
    """The workload's ceiling under ``policy`` over ``seeds``: the attainment of its requests each
    alone on an idle 1P1D cluster (``Point.isolated``). Queueing is all a larger cluster removes,
    so no cluster scores above it; a request whose prefill alone outlasts the TTFT SLO (a long
    prompt) misses on every cluster. One batch."""
    outs = evaluate([Point(policy, 1, 1, rps, s, isolated=True) for s in seeds])
    return Spread(tuple(o.attainment for o in outs))


def out_of_reach(top: Spread, target: float) -> bool:
    """No cluster meets ``target``: even the best seed's ceiling (:func:`ceiling`) plus the seeds'
    spread is below it (the spread allows for step noise drawn differently under load)."""
    return top.hi + (top.hi - top.lo) < target


def near_ceiling(top: Spread, target: float) -> bool:
    """``target`` is within the seeds' spread of the ceiling (:func:`meets_beyond_spread` fails
    for it): another draw of the workload may miss it whatever the cluster's size."""
    return not meets_beyond_spread(top, target)


@dataclass(frozen=True)
class Sized:
    """The smallest cluster found for a policy: ``prefill`` + ``decode`` nodes, and its attainment
    over the seeds (``spread``). ``None`` fields never occur: no cluster is a None :class:`Sized`."""

    prefill: int
    decode: int
    spread: Spread

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode


def smallest_cluster(evaluate: Evaluate, policy: str, lo: int, hi: int, rps: float | None,
                     seeds: Sequence[int], target: float, top: Spread | None = None) -> Sized | None:
    """The fewest nodes in [lo, hi] with a split meeting ``target`` attainment on every seed beyond
    their spread (:func:`meets_beyond_spread`), or None
    if even ``hi`` nodes have none — at once, without a search, when the workload's ceiling ``top``
    (:func:`ceiling`) is out of reach (:func:`out_of_reach`). On the first seed (feasibility grows with nodes): sizes doubled
    from ``lo`` until one is feasible, then a bisection of the last gap; then,
    from the size found up, the best few splits of a size on the first seed (:data:`CONFIRM_SPLITS`)
    are run on every seed and the one with the best worst seed less the spread is taken if that meets the target,
    else larger sizes are tried (steps of 1, 2, 4, … nodes, then a bisection).

    Raises:
        PlanError: ``lo`` < 2, ``hi`` < ``lo``, no seeds, or ``target`` outside (0, 1].
    """
    check_range(lo, hi, seeds, target)
    if top is not None and out_of_reach(top, target):
        return None
    seed = seeds[0]

    def feasible(n: int) -> bool:
        _, seen = best_split(evaluate, policy, n, rps, seed, enough=target)
        return max(o.attainment for o in seen.values()) >= target

    # gallop up from lo (small clusters are the cheap ones to simulate), then bisect the last gap
    bad, n = lo - 1, lo
    while not feasible(n):
        bad = n
        if n == hi:
            return None
        n = min(hi, 2 * n)
    a, b = bad + 1, n  # b feasible; everything up to bad is not
    while a < b:
        mid = (a + b) // 2
        if feasible(mid):
            b = mid
        else:
            a = mid + 1
    def on_every_seed(n: int) -> Sized | None:
        """Of the splits of n meeting the target on the first seed (its best few), the one whose worst
        seed does best, if that meets the target."""
        _, seen = best_split(evaluate, policy, n, rps, seed, enough=target)
        ok = sorted((p for p, o in seen.items() if o.attainment >= target),
                    key=lambda p: (-seen[p].attainment, p))[:CONFIRM_SPLITS]
        if not ok:
            return None
        by = spreads(evaluate, policy, ok, n, rps, seeds)
        p = max(ok, key=lambda q: (2 * by[q].lo - by[q].hi, by[q].mean, -q))
        return Sized(p, n - p, by[p]) if meets_beyond_spread(by[p], target) else None

    # confirm on every seed: from the first seed's answer up, by doubling steps, then a bisection
    found = on_every_seed(a)
    if found is not None:
        return found
    bad, step = a, 1
    while found is None:
        if bad >= hi:
            return None
        n = min(hi, a + step)
        found = on_every_seed(n)
        if found is None:
            bad, step = n, step * 2
    lo_n, hi_n = bad + 1, found.nodes
    while lo_n < hi_n:
        mid = (lo_n + hi_n) // 2
        got = on_every_seed(mid)
        if got is not None:
            found, hi_n = got, mid
        else:
            lo_n = mid + 1
    return found


def max_rates(evaluate: Evaluate, policy: str, prefill: int, decode: int, base_rps: float, seeds: Sequence[int],
              target: float, start_rps: float | None = None) -> list[float | None]:
    """Per seed, the highest request rate (requests/s) at which ``prefill``P``decode``D meets
    ``target`` attainment, to within :data:`RATE_PRECISION` (the bracket's lower end is returned).
    From ``start_rps`` (default ``base_rps``; a guess near the answer saves steps) the rate is moved
    by a factor of 1.25, squared at each step (1.25, 1.56, 2.44, …), until the target flips, within
    [base_rps / :data:`RATE_SPAN`, base_rps × :data:`RATE_SPAN`]; then bisected. None for a seed that
    misses even at the bottom; a seed meeting it at the top answers the top. The seeds advance
    together: one batch of points per step. Raises PlanError for a rate that is not > 0."""
    if not base_rps > 0 or (start_rps is not None and not start_rps > 0):
        raise PlanError(f"the rate search needs rates > 0, got {base_rps}, {start_rps}")
    top, bottom = base_rps * RATE_SPAN, base_rps / RATE_SPAN
    start = min(top, max(bottom, start_rps or base_rps))

    def ok(probe: dict[int, float]) -> dict[int, bool]:
        """Seed index → rate probed: met or not (one batch)."""
        idx = sorted(probe)
        outs = evaluate([Point(policy, prefill, decode, round(probe[i], 6), seeds[i]) for i in idx])
        return {i: o.attainment >= target for i, o in zip(idx, outs)}

    n = len(seeds)
    first = ok({i: start for i in range(n)})
    good: list[float | None] = [start if first[i] else None for i in range(n)]
    bad: list[float | None] = [None if first[i] else start for i in range(n)]
    factor = 1.25
    for _ in range(RATE_BRACKET_STEPS):
        probe = {}
        for i in range(n):
            if bad[i] is None and good[i] < top:  # type: ignore[operator]
                probe[i] = min(top, good[i] * factor)  # type: ignore[operator]
            elif good[i] is None and bad[i] > bottom:  # type: ignore[operator]
                probe[i] = max(bottom, bad[i] / factor)  # type: ignore[operator]
        if not probe:
            break
        for i, passed in ok(probe).items():
            if bad[i] is None:  # going up from a rate that met the target
                good[i], bad[i] = (probe[i], None) if passed else (good[i], probe[i])
            else:  # going down from one that missed it
                good[i], bad[i] = (probe[i], bad[i]) if passed else (None, probe[i])
        factor *= factor
    for _ in range(RATE_BISECT_STEPS):
        probe = {i: (g + b) / 2 for i, (g, b) in enumerate(zip(good, bad))
                 if g is not None and b is not None and (b - g) / g > RATE_PRECISION}
        if not probe:
            break
        for i, passed in ok(probe).items():
            good[i], bad[i] = (probe[i], bad[i]) if passed else (good[i], probe[i])
    return [None if g is None else round(g, 3) for g in good]


def check_range(lo: int, hi: int, seeds: Sequence[int], target: float) -> None:
    """Raise PlanError for a node range that is not 2 ≤ lo ≤ hi, no seeds or a target outside (0, 1]."""
    if lo < 2:
        raise PlanError(f"a P/D cluster needs at least 2 nodes: the range starts at {lo}")
    if hi < lo:
        raise PlanError(f"the node range {lo}:{hi} is empty")
    if not seeds:
        raise PlanError("at least one seed is needed")
    if not 0 < target <= 1:
        raise PlanError(f"the attainment target must be in (0, 1], got {target}")
