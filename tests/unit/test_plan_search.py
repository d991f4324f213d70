"""``kairos plan``'s searches (kairos/plan/search.py, kairos/plan/planner.py) against a capacity model whose
answers are known in closed form: a split meets the target iff its prefill and decode pools each
have capacity for the rate, so the smallest cluster, the best split and the sustained rate can be
computed independently of the search and compared."""

from __future__ import annotations

import math

import pytest

from kairos.plan.evaluate import Outcome, Point
from kairos.plan.planner import plan
from kairos.plan.search import (FULL_GRID, RATE_PRECISION, RATE_SPAN, PlanError, Spread, best_split, clearly_better,
                                max_rates, meets_beyond_spread, smallest_cluster)

TARGET = 0.9


class Capacity:
    """Attainment of P prefill + D decode nodes at ``rps``: each prefill node serves ``per_prefill``
    req/s and each decode node ``per_decode`` (per policy); attainment = min(1, capacity / rps) of each
    pool, multiplied, capped by the workload's ceiling (``top`` per policy, else 1: the
    attainment of an isolated point); a seed scales the capacities and a given ceiling by (1 +
    ``jitter`` × (seed − 2))."""

    def __init__(self, per_prefill: dict[str, float], per_decode: dict[str, float], jitter: float = 0.0,
                 base_rps: float = 10.0, top: dict[str, float] | None = None) -> None:
        self.pp, self.pd, self.jitter, self.base = per_prefill, per_decode, jitter, base_rps
        self.top = top or {}
        self.calls: list[Point] = []
        self.batches: list[int] = []

    def ceiling(self, policy: str, seed: int) -> float:
        return min(1.0, self.top[policy] * (1 + self.jitter * (seed - 2))) if policy in self.top else 1.0

    def attainment(self, policy: str, p: int, d: int, rps: float | None, seed: int) -> float:
        k = 1 + self.jitter * (seed - 2)
        r = self.base if rps is None else rps
        return min(self.ceiling(policy, seed), min(1.0, p * self.pp[policy] * k / r) * min(1.0, d * self.pd[policy] * k / r))

    def __call__(self, points):
        self.batches.append(len(points))
        self.calls.extend(points)
        return [Outcome(self.ceiling(p.policy, p.seed) if p.isolated else
                        self.attainment(p.policy, p.prefill, p.decode, p.rps, p.seed), 100.0 + p.prefill, 30.0,
                        100, 0) for p in points]


def brute_smallest(cap: Capacity, policy: str, lo: int, hi: int, seeds, rps=None):
    """The fewest nodes with a split whose worst seed, less the seeds' spread, meets the target."""
    for n in range(lo, hi + 1):
        for p in range(1, n):
            a = [cap.attainment(policy, p, n - p, rps, s) for s in seeds]
            if min(a) - (max(a) - min(a)) >= TARGET:
                return n
    return None


@pytest.mark.parametrize("n", [2, 3, FULL_GRID + 1, FULL_GRID + 2, 17, 40, 64])
@pytest.mark.parametrize("pp,pd", [(1.0, 4.0), (3.0, 1.0), (0.7, 0.7)])
def test_best_split_finds_the_brute_force_best_without_trying_every_split(n, pp, pd):
    cap = Capacity({"x": pp}, {"x": pd}, base_rps=n * 0.9 * min(pp, pd))
    got, seen = best_split(cap, "x", n, None, 1)
    best = max(cap.attainment("x", p, n - p, None, 1) for p in range(1, n))
    assert cap.attainment("x", got, n - got, None, 1) == pytest.approx(best)
    assert set(seen) <= set(range(1, n))
    if n >= 17:
        assert len(seen) < n - 1, "a large size is searched on a grid, not at every split"


def test_best_split_every_evaluates_each_split_once_in_one_batch():
    cap = Capacity({"x": 1.0}, {"x": 1.0})
    _, seen = best_split(cap, "x", 30, None, 1, every=True)
    assert sorted(seen) == list(range(1, 30))
    assert cap.batches == [29]


@pytest.mark.parametrize("pp,pd,rps", [(1.0, 4.0, 10.0), (2.5, 1.0, 10.0), (1.0, 1.0, 23.0), (0.3, 5.0, 4.0)])
def test_smallest_cluster_is_the_brute_force_one_on_every_seed(pp, pd, rps):
    cap = Capacity({"x": pp}, {"x": pd}, jitter=0.05)
    seeds = [1, 2, 3]
    got = smallest_cluster(cap, "x", 2, 64, rps, seeds, TARGET)
    want = brute_smallest(cap, "x", 2, 64, seeds, rps)
    assert got is not None and got.nodes == want
    assert got.spread.lo - (got.spread.hi - got.spread.lo) >= TARGET, "its worst seed clears the target by the spread"
    assert len(got.spread.values) == 3, "one attainment per seed"


def test_smallest_cluster_is_none_when_even_the_largest_misses():
    cap = Capacity({"x": 0.1}, {"x": 0.1})
    assert smallest_cluster(cap, "x", 2, 8, 50.0, [1], TARGET) is None


def test_smallest_cluster_moves_up_when_the_first_seed_is_lucky():
    # jitter < 0: seed 1 has 1.15 × the capacity, seed 3 0.85 ×; the bisection runs on the first seed
    cap = Capacity({"x": 1.0}, {"x": 4.0}, jitter=-0.15)
    got = smallest_cluster(cap, "x", 2, 64, 10.0, [1, 3], TARGET)
    assert got is not None and got.nodes == brute_smallest(cap, "x", 2, 64, [1, 3], 10.0)
    assert got.nodes > brute_smallest(cap, "x", 2, 64, [1], 10.0)


def test_max_rates_finds_each_seeds_threshold_and_steps_the_seeds_together():
    cap = Capacity({"x": 2.0}, {"x": 5.0}, jitter=0.1)
    p, d = 4, 2
    rates = max_rates(cap, "x", p, d, 3.0, [1, 2, 3], TARGET)
    for r, s in zip(rates, [1, 2, 3]):
        k = 1 + 0.1 * (s - 2)
        # attainment = min(1, 8k/r) * min(1, 10k/r) >= 0.9 ... solve on the binding pool
        true = max(x for x in [i / 1000 for i in range(1, 60000)]
                   if min(1, p * 2.0 * k / x) * min(1, d * 5.0 * k / x) >= TARGET)
        assert true * (1 - RATE_PRECISION) <= r <= true + 1e-3
    assert max(cap.batches) == 3 and set(cap.batches) <= {1, 2, 3}


@pytest.mark.parametrize("start", [0.5, 3.0, 14.0, 200.0])
def test_max_rates_lands_on_the_same_rate_from_any_start(start):
    cap = Capacity({"x": 2.0}, {"x": 5.0})
    (r,) = max_rates(cap, "x", 4, 2, 3.0, [2], TARGET, start_rps=start)
    true = max(x for x in [i / 1000 for i in range(1, 60000)] if min(1, 8 / x) * min(1, 10 / x) >= TARGET)
    assert true * (1 - RATE_PRECISION) <= r <= true + 1e-3


def test_max_rates_none_when_never_met_and_the_top_when_always_met():
    never = Capacity({"x": 1e-9}, {"x": 1.0})
    assert max_rates(never, "x", 1, 1, 1.0, [1], TARGET) == [None]
    always = Capacity({"x": 1e12}, {"x": 1e12})
    assert max_rates(always, "x", 1, 1, 1.0, [1], TARGET) == [RATE_SPAN]


def test_a_target_met_inside_the_seeds_spread_is_not_met():
    assert meets_beyond_spread(Spread((0.95, 0.97)), 0.9)
    assert not meets_beyond_spread(Spread((0.905, 0.93)), 0.9), "0.905 clears 0.9 by less than the seeds disagree"
    assert meets_beyond_spread(Spread((0.9,)), 0.9)


def test_clearly_better_only_outside_the_spread():
    assert clearly_better(Spread((0.95, 0.97)), Spread((0.90, 0.94)))
    assert not clearly_better(Spread((0.95, 0.97)), Spread((0.90, 0.95)))
    assert not clearly_better(Spread((0.95,)), Spread((0.95,)))


def test_plan_reports_the_saving_of_a_policy_with_more_capacity():
    cap = Capacity({"pd": 1.0, "kairos+": 1.0}, {"pd": 1.0, "kairos+": 4.0}, jitter=0.02)
    res = plan(cap, ["pd", "kairos+"], 2, 40, 12, 10.0, 10.0, [1, 2, 3], TARGET)
    pd, kp = res.policies
    assert pd.smallest.nodes == brute_smallest(cap, "pd", 2, 40, [1, 2, 3], 10.0)
    assert kp.smallest.nodes == brute_smallest(cap, "kairos+", 2, 40, [1, 2, 3], 10.0)
    (s,) = res.savings
    assert s.baseline == "pd" and s.nodes == pd.smallest.nodes - kp.smallest.nodes > 0 and s.nodes_clear
    assert s.rate_ratio is not None and s.rate_ratio > 1 and s.rate_clear


def test_a_policy_needing_more_nodes_is_a_clear_loss_only_beyond_the_spread():
    """The noise rule holds both ways: more nodes are a loss only when, on the baseline's count, the
    policy misses the target on every seed."""
    cap = Capacity({"pd": 1.0, "kairos+": 1.0}, {"pd": 4.0, "kairos+": 1.0}, jitter=0.02)
    (s,) = plan(cap, ["pd", "kairos+"], 2, 40, 12, 10.0, 10.0, [1, 2, 3], TARGET).savings
    assert s.nodes is not None and s.nodes < 0 and s.nodes_clear
    close = Capacity({"pd": 1.0, "kairos+": 0.97}, {"pd": 1.0, "kairos+": 0.97}, jitter=0.1)
    res = plan(close, ["pd", "kairos+"], 2, 40, 30, 10.0, 10.0, [1, 2, 3], TARGET)
    (s,) = res.savings
    pd, kp = res.policies
    assert kp.smallest.nodes > pd.smallest.nodes and s.nodes < 0 and not s.nodes_clear, s
    from kairos.plan.report import text

    assert "not a clear loss" in text(res)


def test_plan_calls_a_difference_inside_the_seeds_spread_no_gain():
    cap = Capacity({"pd": 1.0, "kairos+": 1.02}, {"pd": 1.0, "kairos+": 1.02}, jitter=0.1)
    res = plan(cap, ["pd", "kairos+"], 2, 40, 30, 10.0, 10.0, [1, 2, 3], TARGET)
    (s,) = res.savings
    assert s.rate_ratio is not None and s.rate_ratio > 1
    assert not s.rate_clear
    kp = res.policies[1]
    assert kp.ties, "neighbouring splits inside the spread are named as ties"


def test_plan_json_is_plain_data():
    import json

    cap = Capacity({"pd": 1.0}, {"pd": 1.0})
    out = plan(cap, ["pd"], 2, 8, 4, None, 2.0, [1], TARGET).to_json()
    assert json.loads(json.dumps(out))["policies"][0]["curve"].keys() == {"1", "2", "3"}


@pytest.mark.parametrize("args,msg", [
    ((1, 8, 4, [1], 0.9), "at least 2 nodes"),
    ((5, 4, 4, [1], 0.9), "is empty"),
    ((2, 8, 4, [], 0.9), "seed"),
    ((2, 8, 4, [1], 0.0), "(0, 1]"),
    ((2, 8, 4, [1], 1.5), "(0, 1]"),
    ((2, 8, 9, [1], 0.9), "outside the node range"),
])
def test_plan_refuses_a_bad_range(args, msg):
    lo, hi, budget, seeds, target = args
    with pytest.raises(PlanError, match=re_escape(msg)):
        plan(Capacity({"pd": 1.0}, {"pd": 1.0}), ["pd"], lo, hi, budget, None, 1.0, seeds, target)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_a_large_plan_costs_logarithmically_many_points():
    """How the search scales: the smallest-cluster bisection costs O(log(hi − lo)) sizes of at most
    ~2 × FULL_GRID splits; the budget's curve is a grid when it has more than 16 splits."""
    cap = Capacity({"pd": 1.0, "kairos+": 1.3}, {"pd": 3.0, "kairos+": 3.0}, jitter=0.02)
    plan(cap, ["pd", "kairos+"], 2, 64, 64, 20.0, 20.0, [1, 2, 3], TARGET)
    per_policy = len(set(cap.calls)) / 2
    assert per_policy < 20 * math.log2(64) + 60, per_policy


def test_a_plan_read_back_from_its_json_is_the_same_plan():
    import json

    from kairos.plan.planner import plan_from_json
    from kairos.plan.report import text

    cap = Capacity({"pd": 1.0, "kairos+": 1.3}, {"pd": 2.0, "kairos+": 2.0}, jitter=0.03)
    res = plan(cap, ["pd", "kairos+"], 2, 20, 8, 6.0, 6.0, [1, 2, 3], TARGET)
    back = plan_from_json(json.loads(json.dumps(res.to_json())))
    assert back == res and text(back) == text(res)


def test_a_target_no_seed_but_the_first_reaches_costs_few_points():
    """The first seed meets the target from 6 nodes on, the others never: the confirmation climbs by
    growing steps, not size by size with every split on every seed."""
    class Lucky(Capacity):
        def attainment(self, policy, p, d, rps, seed):
            return 0.95 if seed == 1 and p + d >= 6 else 0.5

    cap = Lucky({"x": 1.0}, {"x": 1.0})
    assert smallest_cluster(cap, "x", 2, 64, 1.0, [1, 2, 3], TARGET) is None
    assert len(set(cap.calls)) < 400, len(set(cap.calls))


def test_a_target_above_the_workloads_ceiling_is_answered_without_a_search():
    """Every seed's requests alone reach 80 % at most: a 90 % target is out of reach on any cluster —
    no cluster is searched, the report says why; an 88 % ceiling (seeds 86–90 %) leaves the target
    within the spread: searched, and the report warns that other draws may miss it."""
    from kairos.plan.report import text
    from kairos.plan.search import ceiling, near_ceiling, out_of_reach

    cap = Capacity({"x": 1.0}, {"x": 1.0}, jitter=0.02, top={"x": 0.8})
    top = ceiling(cap, "x", 10.0, [1, 2, 3])
    assert top.hi == pytest.approx(0.816) and out_of_reach(top, TARGET)
    assert smallest_cluster(cap, "x", 2, 64, 10.0, [1, 2, 3], TARGET, top) is None
    assert all(p.isolated for p in cap.calls), "nothing but the ceiling was simulated"
    low = Capacity({"pd": 1.0}, {"pd": 1.0}, jitter=0.02, top={"pd": 0.8})
    res = plan(low, ["pd"], 2, 16, 8, 10.0, 10.0, [1, 2, 3], TARGET)
    assert res.policies[0].smallest is None and "out of reach on any cluster" in text(res)
    assert res.policies[0].max_rps == [None] * 3 and "not searched: the target is above" in text(res)
    assert not [q for q in low.calls if q.rps is not None and q.rps < 10.0], "no rate below the workload's was probed"

    near = Capacity({"pd": 1.0}, {"pd": 1.0}, jitter=0.02, top={"pd": 0.93})
    top = ceiling(near, "pd", 10.0, [1, 2, 3])
    assert near_ceiling(top, TARGET) and not out_of_reach(top, TARGET)
    res = plan(near, ["pd"], 2, 16, 8, 10.0, 10.0, [1, 2, 3], TARGET)
    assert "other draws of this workload may miss it on any cluster" in text(res)
    assert res.policies[0].ceiling == top
    far = plan(Capacity({"pd": 1.0}, {"pd": 1.0}, jitter=0.02), ["pd"], 2, 16, 8, 10.0, 10.0, [1, 2, 3], TARGET)
    assert "ceiling" in text(far) and "miss it" not in text(far) and "out of reach" not in text(far)
