"""``kairos plan``'s answer per policy, and what the deflecting policy saves over ``pd``.

:func:`plan` runs the searches of :mod:`kairos.plan.search` for each policy and returns a
:class:`Plan`: per policy the workload's ceiling (its requests each alone on an idle cluster) and the
smallest cluster meeting the SLOs; then, at the rate the budget would
carry (:func:`stress_rate`: at the workload's own rate a budget larger than needed meets the SLOs
with most splits alike), the best P:D split of the node budget (with the splits the noise rule
cannot tell from it) and the attainment curve over its splits (the plot), and the highest request
rate that split sustains per seed; then the
saving of every other policy over the baseline (``pd`` when planned, else the first): nodes at equal
SLOs and rate at equal nodes, each called a saving only outside the spread over seeds.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from kairos.plan.evaluate import Outcome
from kairos.plan.search import (Evaluate, PlanError, Sized, Spread, best_split, ceiling, check_range, clearly_better,
                                max_rates, out_of_reach, smallest_cluster, spread, spreads)

#: the policy the others are compared with when it is planned
BASELINE = "pd"
#: a budget of at most this many splits is evaluated at every split (the plot's whole curve); a
#: larger one on :func:`~kairos.plan.search.best_split`'s grid and around its best
CURVE_EVERY = 16


@dataclass(frozen=True)
class PolicyPlan:
    """One policy's answers (attainments are fractions 0–1; rates requests/s).

    Attributes:
        policy: its spec.
        smallest: the fewest nodes in the range meeting the target on every seed (None: none does).
        budget_split: prefill nodes of the best split of the budget (decode: budget − it), at
            ``stress_rps``.
        budget_spread: that split's attainment over the seeds, at ``stress_rps``.
        ties: other prefill counts of the budget whose attainment the noise rule cannot tell apart.
        max_rps: per seed, the highest rate the budget's best split sustains (None: not even the
            bracket's bottom).
        stress_rps: the rate the budget's splits were compared at (:func:`stress_rate`).
        curve: prefill count → outcome (first seed, at ``stress_rps``) for the splits of the budget
            evaluated (every one up to :data:`CURVE_EVERY`).
        ceiling: the workload's ceiling per seed at the plan's rate (:func:`~kairos.plan.search.ceiling`:
            each request alone on an idle cluster; None in a plan file written before it existed).
    """

    policy: str
    smallest: Sized | None
    budget_split: int
    budget_spread: Spread
    ties: list[int]
    max_rps: list[float | None]
    stress_rps: float = 0.0
    curve: dict[int, Outcome] = field(default_factory=dict)
    ceiling: Spread | None = None

    @property
    def sustained_rps(self) -> float | None:
        """The rate every seed sustains (the lowest of :attr:`max_rps`; None if one has none)."""
        return None if any(r is None for r in self.max_rps) else min(self.max_rps)


@dataclass(frozen=True)
class Saving:
    """What ``policy`` saves over ``baseline``: ``nodes`` fewer for the SLOs (None: either found no
    cluster; negative: it needs more), ``nodes_clear`` whether that is beyond the seeds' spread (on
    the smaller of the two node counts, the best split of the one needing more misses the target on
    every seed), ``rate_ratio``
    the rate sustained on the budget ÷ the baseline's (the lowest over the seeds each; None without
    both) and ``rate_clear`` whether every seed's rate of ``policy`` is above every seed's of the
    baseline."""

    policy: str
    baseline: str
    nodes: int | None
    nodes_clear: bool
    rate_ratio: float | None
    rate_clear: bool


@dataclass(frozen=True)
class Plan:
    """Every policy's :class:`PolicyPlan` and each one's :class:`Saving` over the baseline."""

    target: float
    lo: int
    hi: int
    budget: int
    seeds: list[int]
    base_rps: float
    rps: float | None
    policies: list[PolicyPlan]
    savings: list[Saving]

    def to_json(self) -> dict:
        """A JSON-ready dict (curve keys as strings, spreads with their mean/lo/hi)."""
        def pol(p: PolicyPlan) -> dict:
            d = asdict(p)
            d["curve"] = {str(k): asdict(v) for k, v in p.curve.items()}
            d["budget_spread"] = _spread_json(p.budget_spread)
            d["ceiling"] = None if p.ceiling is None else _spread_json(p.ceiling)
            d["sustained_rps"] = p.sustained_rps
            if p.smallest is not None:
                d["smallest"] = {"prefill": p.smallest.prefill, "decode": p.smallest.decode,
                                 "nodes": p.smallest.nodes, "spread": _spread_json(p.smallest.spread)}
            return d
        return {"target": self.target, "nodes": [self.lo, self.hi], "budget": self.budget, "seeds": self.seeds,
                "base_rps": self.base_rps, "rps": self.rps, "policies": [pol(p) for p in self.policies],
                "savings": [asdict(s) for s in self.savings]}


def plan_from_json(d: dict) -> Plan:
    """The :class:`Plan` of :meth:`Plan.to_json`'s dict (``kairos plan --json``'s file: extra keys are
    ignored). Raises KeyError / TypeError for another shape."""
    def spread_of(x: dict) -> Spread:
        return Spread(tuple(x["values"]))

    def pol(x: dict) -> PolicyPlan:
        sm = x["smallest"]
        return PolicyPlan(x["policy"], None if sm is None else Sized(sm["prefill"], sm["decode"], spread_of(sm["spread"])),
                          x["budget_split"], spread_of(x["budget_spread"]), list(x["ties"]), list(x["max_rps"]),
                          x["stress_rps"], {int(k): Outcome(**v) for k, v in x["curve"].items()},
                          None if x.get("ceiling") is None else spread_of(x["ceiling"]))
    return Plan(d["target"], d["nodes"][0], d["nodes"][1], d["budget"], list(d["seeds"]), d["base_rps"], d["rps"],
                [pol(x) for x in d["policies"]], [Saving(**x) for x in d["savings"]])


def _spread_json(s: Spread) -> dict:
    return {"values": list(s.values), "mean": s.mean, "lo": s.lo, "hi": s.hi}


def stress_rate(rate: float, budget: int, smallest: Sequence[Sized | None]) -> float:
    """The rate (requests/s) the budget's splits are compared at: what ``budget`` nodes carry if the
    rate grows as the nodes do from the smallest cluster found (of any policy) at ``rate``; ``rate``
    when none was found. At the workload's own rate a budget above the smallest cluster meets the
    SLOs with most splits alike; near its capacity the splits differ."""
    found = [s.nodes for s in smallest if s is not None]
    return round(rate * budget / min(found), 6) if found else rate


def plan_budget(evaluate: Evaluate, policy: str, smallest: Sized | None, budget: int, stress_rps: float,
                rate: float, seeds: Sequence[int], target: float, top: Spread | None = None) -> PolicyPlan:
    """One policy's answers for the budget: its splits compared at ``stress_rps`` (every split when
    there are at most :data:`CURVE_EVERY`), the best one's neighbours inside the seeds' spread, and
    the rate the best one sustains per seed (searched from the policy's own guess: ``rate`` × budget
    ÷ its smallest cluster; None on every seed without a search when the target is out of the
    ceiling ``top``'s reach)."""
    p, curve = best_split(evaluate, policy, budget, stress_rps, seeds[0], every=budget - 1 <= CURVE_EVERY)
    near = [q for q in (p - 1, p + 1) if 1 <= q < budget]
    by = spreads(evaluate, policy, [p, *near], budget, stress_rps, seeds)
    at = by[p]
    # the neighbours: a split the noise rule cannot rank below the best
    ties = [q for q in near if not clearly_better(at, by[q])]
    guess = rate * budget / smallest.nodes if smallest is not None else stress_rps
    if top is not None and out_of_reach(top, target):  # no rate meets what no cluster can: none searched
        rates: list[float | None] = [None] * len(seeds)
    else:
        rates = max_rates(evaluate, policy, p, budget - p, rate, seeds, target, start_rps=guess)
    return PolicyPlan(policy, smallest, p, at, ties, rates, stress_rps, curve, top)


def _saving(evaluate: Evaluate, pol: PolicyPlan, base: PolicyPlan, rps: float | None,
            seeds: Sequence[int], target: float) -> Saving:
    nodes = clear = None
    if pol.smallest is not None and base.smallest is not None:
        nodes = base.smallest.nodes - pol.smallest.nodes
        clear = False
        if nodes != 0:
            # clear when the one needing more nodes, on the other's smaller count, misses the target on every seed
            more, fewer = (base, pol) if nodes > 0 else (pol, base)
            n = fewer.smallest.nodes  # type: ignore[union-attr]
            bp, _ = best_split(evaluate, more.policy, n, rps, seeds[0])
            clear = spread(evaluate, more.policy, bp, n - bp, rps, seeds).hi < target
    ratio, rate_clear = None, False
    if pol.sustained_rps is not None and base.sustained_rps is not None:
        ratio = round(pol.sustained_rps / base.sustained_rps, 3)
        rate_clear = pol.sustained_rps > max(base.max_rps)  # type: ignore[type-var]
    return Saving(pol.policy, base.policy, nodes, bool(clear), ratio, rate_clear)


def plan(evaluate: Evaluate, policies: Sequence[str], lo: int, hi: int, budget: int, rps: float | None,
         base_rps: float, seeds: Sequence[int], target: float, cancel: Callable[[], None] | None = None) -> Plan:
    """Plan every policy over clusters of ``lo``–``hi`` nodes (the search range) and a budget of
    ``budget`` nodes (the split and rate questions), at ``rps`` requests/s (None: the workload's own
    timing; ``base_rps`` is then its mean rate, where the rate search starts), over ``seeds``, for
    an attainment ``target`` (fraction, e.g. 0.9). ``cancel``: called when the plan is interrupted
    (Ctrl-C) so that the searches still running stop (:meth:`~kairos.plan.evaluate.Evaluator.abort`).

    Raises:
        PlanError: a bad range, budget outside it, no seeds, no policy or one twice, or a target
            outside (0, 1].
    """
    check_range(lo, hi, seeds, target)
    if not policies:
        raise PlanError("no policy to plan")
    if not lo <= budget <= hi:
        raise PlanError(f"the budget of {budget} nodes is outside the node range {lo}:{hi}")
    if len(set(policies)) != len(policies):
        raise PlanError(f"a policy is named twice in {', '.join(policies)}")
    rate = base_rps if rps is None else rps
    with ThreadPoolExecutor(max_workers=len(policies)) as side_by_side:  # each policy's batches fill the pool
        try:
            tops = list(side_by_side.map(lambda p: ceiling(evaluate, p, rps, seeds), policies))
            smallest = list(side_by_side.map(
                lambda pt: smallest_cluster(evaluate, pt[0], lo, hi, rps, seeds, target, pt[1]), zip(policies, tops)))
            stress = stress_rate(rate, budget, smallest)
            plans = list(side_by_side.map(
                lambda ps: plan_budget(evaluate, ps[0], ps[1], budget, stress, rate, seeds, target, ps[2]),
                zip(policies, smallest, tops)))
        except BaseException:  # Ctrl-C here: the searches still running stop at their next evaluation
            if cancel is not None:
                cancel()
            raise
    base = next((p for p in plans if p.policy == BASELINE), plans[0])
    savings = [_saving(evaluate, p, base, rps, seeds, target) for p in plans if p is not base]
    return Plan(target, lo, hi, budget, list(seeds), base_rps, rps, plans, savings)
