"""Blocks of the before/after benchmarks of issue 19 §3 (docs/results.md): the parts of the control
plane whose work grew with nodes × rate, timed old against new in one run on the same inputs.

* ``snapshot-cost`` ("Decision cost"): ``bench/snapshot_cost.py`` — a dispatcher's routing inputs
  per request (reservations, the view with the routed events folded in, the snapshot), the oracle
  functions against ``RoutingState.snapshot``, per policy and cluster;
* ``view-costs`` ("Control plane at fleet scale"): ``bench/view_costs.py`` — the ingress's intake
  and the aggregator's metric report per view at the largest cluster.

Every figure is a field of the committed rows (µs of the thread's CPU time) or arithmetic on them.
"""

from __future__ import annotations

from tools.docgen.fmt import num, one_run, sig
from tools.docgen.results import Load

#: the stages that make up a request's routing inputs, in the order the table prints them
INPUT_STAGES = ("reservations", "view", "snapshot")


def _inputs(stages: dict) -> str:
    """``536 (14 + 106 + 262)``: the inputs' mean µs per request and its split by stage."""
    return f"{sig(stages['inputs'])} ({' + '.join(sig(stages[k]) for k in INPUT_STAGES)})"


def snapshot_cost(load: Load) -> str:
    """One row per policy and cluster: the inputs and the whole request before / after / ratio (µs of
    CPU per request), then each policy's growth of the inputs from the first cluster to the last."""
    r = load("snapshot-cost")
    rows = r.rows
    requests = {row["requests"] for row in rows}
    lines = [f"A dispatcher's routing inputs per request, before (the oracle functions) and after "
             f"(`RoutingState.snapshot`), mean µs of the thread's CPU time over "
             f"{' / '.join(num(n) for n in sorted(requests))} requests per cluster and policy on one core "
             f"(rows of {one_run(r)}). Inputs: reservations + view (routed events folded in) + snapshot; the "
             "whole request adds the decision and the upkeep, the same code in both paths:", "",
             "| cluster (nodes) | policy | inputs before | inputs after | before/after | whole request before "
             "| whole request after | before/after |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b, a = row["before_us"], row["after_us"]
        lines.append(f"| {row['cluster']} ({num(row['nodes'])}) | `{row['policy']}` | {_inputs(b)} | {_inputs(a)} | "
                     f"{sig(row['inputs_before_over_after'])} | {sig(b['total'])} | {sig(a['total'])} | "
                     f"{sig(row['before_over_after'])} |")
    growth = []
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = sorted(r.where(policy=policy), key=lambda x: x["nodes"])
        first, last = mine[0], mine[-1]
        if first is last:
            continue
        growth.append(f"`{policy}` ×{sig(last['before_us']['inputs'] / first['before_us']['inputs'])} before, "
                      f"×{sig(last['after_us']['inputs'] / first['after_us']['inputs'])} after")
        span = (first["cluster"], last["cluster"])
    if growth:
        lines += ["", f"Growth of the inputs from {span[0]} to {span[1]}: " + "; ".join(growth) + "."]
    return "\n".join(lines)


#: ``bench/view_costs.py``'s part names as the table words them (an unknown part prints as it is)
VIEW_PARTS = {
    "ingress take_view (2 copies)": "ingress: a view taken, both copies (`Readiness.take_view`)",
    "aggregator _report": "aggregator: the per-node metrics of a view (`StateAggregator._report`)",
}


def view_costs(load: Load) -> str:
    """One row per part: µs of CPU per view, old / new / ratio, at the recorded cluster."""
    r = load("view-costs")
    rows = r.rows
    first = rows[0]
    lines = [f"Per view of {first['cluster']} ({num(first['nodes'])} nodes, a view of "
             f"{num(first['view_bytes'] / 1024)} KiB), old code against new on the same views: µs of the thread's "
             f"CPU time per view, each the median of {num(first['repeats'])} timed runs of "
             f"{num(first['iterations'])} views, old and new alternating (rows of {one_run(r)}):", "",
             "| part | old | new | old/new |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {VIEW_PARTS.get(row['part'], row['part'])} | {sig(row['old_cpu_us'])} | "
                     f"{sig(row['new_cpu_us'])} | {sig(row['old_over_new_cpu'])} |")
    return "\n".join(lines)
