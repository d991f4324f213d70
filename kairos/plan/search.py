"""The search of ``kairos plan``: how many prefill and decode nodes a workload needs under each policy.

Pure: it asks an ``evaluate`` callable (:meth:`kairos.plan.evaluate.Evaluator.evaluate`, or a stand-in in
tests) for the outcomes of batches of points and decides from them alone. For each policy:

* **best split at a size** — every P:D split of ``n`` nodes when there are few, else an even grid of
  them and then every split around the grid's best (:func:`best_split`);
* **smallest cluster** — a bisection over the node count of the question "does the best split of n
  nodes meet the attainment target?" (feasibility grows with n), the answer confirmed on every seed,
  going up one node at a time while a seed misses (:func:`smallest_cluster`);
* **highest sustainable rate** at a split — doubling, then bisection, of the request rate while the
  attainment target holds, every seed's search in step (:func:`max_rates`);
* **the noise rule** — outcomes over several seeds give a range [min, max]; one split or policy is
  called better than another only when the ranges do not overlap (:func:`clearly_better`).

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
#: rate search: doublings/halvings to bracket the sustainable rate, then bisection steps
RATE_BRACKET_STEPS, RATE_BISECT_STEPS = 8, 7


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
               every: bool = False) -> tuple[int, dict[int, Outcome]]:
    """The prefill count P (decode: ``n`` − P) of ``n`` nodes with the highest attainment (ties: the
    lower P95 TTFT, then the fewer prefill nodes), and every split evaluated (P → outcome).
    ``every``: evaluate all n − 1 splits (a plot's full curve). Raises PlanError for n < 2."""
    if n < 2:
        raise PlanError(f"a P/D cluster needs at least 2 nodes, got {n}")
    first = list(range(1, n)) if every else _splits(n)
    seen = dict(zip(first, evaluate([Point(policy, p, n - p, rps, seed) for p in first])))
    if not every and len(first) < n - 1:  # refine: every split between the grid neighbours of the best
        best = max(first, key=lambda p: (_rank(seen[p]), -p))
        i = first.index(best)
        lo, hi = first[max(0, i - 1)], first[min(len(first) - 1, i + 1)]
        more = [p for p in range(lo, hi + 1) if p not in seen]
        seen.update(zip(more, evaluate([Point(policy, p, n - p, rps, seed) for p in more])))
    best = max(seen, key=lambda p: (_rank(seen[p]), -p))
    return best, dict(sorted(seen.items()))


def spread(evaluate: Evaluate, policy: str, prefill: int, decode: int, rps: float | None,
           seeds: Sequence[int]) -> Spread:
    """Attainment of one split over ``seeds``."""
    outs = evaluate([Point(policy, prefill, decode, rps, s) for s in seeds])
    return Spread(tuple(o.attainment for o in outs))


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
                     seeds: Sequence[int], target: float) -> Sized | None:
    """The fewest nodes in [lo, hi] with a split meeting ``target`` attainment on every seed, or None
    if even ``hi`` nodes have none. Bisection on the first seed (feasibility grows with nodes); then,
    from the size found up, the splits of a size that meet the target on the first seed are run on
    every seed and the one with the best worst seed is taken if that meets the target, else the next
    size is tried.

    Raises:
        PlanError: ``lo`` < 2, ``hi`` < ``lo``, no seeds, or ``target`` outside (0, 1].
    """
    check_range(lo, hi, seeds, target)
    seed = seeds[0]

    def feasible(n: int) -> int | None:
        p, seen = best_split(evaluate, policy, n, rps, seed)
        return p if seen[p].attainment >= target else None

    if feasible(hi) is None:
        return None
    a, b = lo, hi  # invariant: b feasible; everything below a infeasible (or a == lo)
    while a < b:
        mid = (a + b) // 2
        if feasible(mid) is not None:
            b = mid
        else:
            a = mid + 1
    for n in range(a, hi + 1):  # confirm on every seed: of the splits meeting the target on the first,
        _, seen = best_split(evaluate, policy, n, rps, seed)  # the one whose worst seed does best
        ok = [p for p, o in seen.items() if o.attainment >= target]
        if not ok:
            continue
        evaluate([Point(policy, p, n - p, rps, s) for p in ok for s in seeds])  # one batch
        spreads = {p: spread(evaluate, policy, p, n - p, rps, seeds) for p in ok}
        p = max(ok, key=lambda q: (spreads[q].lo, spreads[q].mean, -q))
        if spreads[p].lo >= target:
            return Sized(p, n - p, spreads[p])
    return None


def max_rates(evaluate: Evaluate, policy: str, prefill: int, decode: int, base_rps: float, seeds: Sequence[int],
              target: float) -> list[float | None]:
    """Per seed, the highest request rate (requests/s) at which ``prefill``P``decode``D meets
    ``target`` attainment: from ``base_rps``, doubled (or halved) up to :data:`RATE_BRACKET_STEPS` times
    until the target flips, then :data:`RATE_BISECT_STEPS` bisections (the bracket's lower end is
    returned, within 2^-7 of it). None for a seed that misses even at base_rps / 2^8; a seed still
    meeting the target at base_rps × 2^8 answers that rate. The seeds advance together: one batch of
    points per step. Raises PlanError for a base rate that is not > 0."""
    if not base_rps > 0:
        raise PlanError(f"the rate search needs a base rate > 0, got {base_rps}")

    def ok(probe: dict[int, float]) -> dict[int, bool]:
        """Seed index → rate probed: met or not (one batch)."""
        idx = sorted(probe)
        outs = evaluate([Point(policy, prefill, decode, round(probe[i], 6), seeds[i]) for i in idx])
        return {i: o.attainment >= target for i, o in zip(idx, outs)}

    first = ok({i: base_rps for i in range(len(seeds))})
    good: list[float | None] = [base_rps if first[i] else None for i in range(len(seeds))]
    bad: list[float | None] = [None if first[i] else base_rps for i in range(len(seeds))]
    for _ in range(RATE_BRACKET_STEPS):
        probe = {i: (g * 2 if b is None else b / 2) for i, (g, b) in enumerate(zip(good, bad))
                 if g is None or b is None}  # type: ignore[operator]
        if not probe:
            break
        for i, passed in ok(probe).items():
            if bad[i] is None:  # going up from a rate that met the target
                good[i], bad[i] = (probe[i], None) if passed else (good[i], probe[i])
            else:  # going down from one that missed it
                good[i], bad[i] = (probe[i], bad[i]) if passed else (None, probe[i])
    for _ in range(RATE_BISECT_STEPS):
        probe = {i: (g + b) / 2 for i, (g, b) in enumerate(zip(good, bad)) if g is not None and b is not None}
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
