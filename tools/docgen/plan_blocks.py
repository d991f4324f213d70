"""Blocks of ``kairos plan`` (docs/plan.md, docs/cli.md, README.md): a plan's report as the command prints
it, and its targets measured by ``bench/plan_targets.py`` (replays on other seeds, time over the node
range, a live stack of the recommended size)."""

from __future__ import annotations

from tools.docgen.fmt import command, num, one_run, pct
from tools.docgen.results import DocgenError, Load


def plan_example(load: Load) -> str:
    """Result ``plan-example`` (``kairos plan --json``'s file): the command and the report it printed
    (:func:`kairos.plan.report.text` of the recorded plan)."""
    from kairos.plan.planner import plan_from_json
    from kairos.plan.report import text

    r = load("plan-example")
    if len(r.rows) != 1:
        raise DocgenError("plan-example: expected the one plan kairos plan --json wrote")
    row = r.rows[0]
    return (f"```\n$ {command(r.meta)}\n{text(plan_from_json(row))}\n```\n"
            f"({num(row['simulated'])} points simulated in {row['wall_s']:g} s; {one_run(r)}.)")


def _cluster(x: dict | None) -> str:
    return "none" if x is None else f"{x['prefill'] + x['decode']} ({x['prefill']}P{x['decode']}D)"


def _nodes_saved(s: dict) -> str:
    if s["nodes"] is None:
        return "–"
    return f"{s['nodes']}" + ("" if s["nodes"] == 0 or s["nodes_clear"] else " (inside the spread)")


def _ceiling(values: list[float]) -> str:
    return f"{pct(min(values), 1)}–{pct(max(values), 1)}" if min(values) != max(values) else pct(values[0], 1)


def plan_replay(load: Load) -> str:
    """Result ``plan-replay``: per workload and target the workload's ceiling, the smallest cluster of
    each policy, the saving, the rate ratio at the budget, and the recommended ``kairos+`` cluster
    replayed on three other seeds (a miss the plan warned of says so)."""
    r = load("plan-replay")
    x0 = r.rows[0]
    lines = [f"{one_run(r)}; engine steps with {pct(x0['noise'])} log-normal noise, nodes "
             f"{x0['nodes'][0]}–{x0['nodes'][1]}, budget {x0['budget']}; the ceiling is `kairos+`'s on the plan's "
             f"seeds / on the replay's:", "",
             "| workload | req/s | target | ceiling | smallest `pd` | smallest `kairos+` | nodes saved | sustained "
             "rate on the budget, `kairos+` ÷ `pd` | `kairos+` replayed on seeds "
             + ", ".join(map(str, x0["replay"]["seeds"])) + " | points simulated |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r.rows:
        s, rep = x["saving"], x.get("replay")
        rate = "–" if s["rate_ratio"] is None else f"×{s['rate_ratio']:.2f}" + ("" if s["rate_clear"] else
                                                                                 " (inside the spread)")
        warned = x.get("warned", False)  # rows recorded before the plan had a ceiling: none
        verdict = (" (met)" if rep and rep["met"] else
                   " (missed, as the plan warned)" if warned else " (**missed**)")
        got = "–" if rep is None else ", ".join(pct(a, 1) for a in rep["attainment"]) + verdict
        top = "–" if "ceiling" not in x else (
            f"{_ceiling(x['ceiling']['plan'])} / {_ceiling(x['ceiling']['replay'])}"
            + (" (plan: other draws may miss the target on any cluster)" if warned else ""))
        lines.append(f"| `{x['workload']}` | {x['rps']:g} | {pct(x['target'])} | {top} | "
                     f"{_cluster(x['smallest']['pd'])} | {_cluster(x['smallest']['kairos+'])} | {_nodes_saved(s)} | "
                     f"{rate} | {got} | {num(x['points'])} |")
    return "\n".join(lines)


def plan_scaling(load: Load) -> str:
    """Result ``plan-scaling``: a cold plan's wall time and points simulated against the node range."""
    r = load("plan-scaling")
    x0 = r.rows[0]
    lines = [f"{one_run(r)}: `{x0['workload']}` at {x0['rps']:g} req/s, {x0['duration_s']:g} s, `pd` and "
             f"`kairos+`, three seeds, a cold cache, {num(x0['cores'])} cores:", "",
             "| nodes searched (= budget) | wall s | points simulated | smallest `pd` / `kairos+` |",
             "|---|---|---|---|"]
    for x in r.rows:
        lines.append(f"| {x['nodes'][0]}–{x['nodes'][1]} | {x['wall_s']:g} | {num(x['points'])} | "
                     f"{_cluster(x['smallest']['pd'])} / {_cluster(x['smallest']['kairos+'])} |")
    return "\n".join(lines)


def plan_live(load: Load) -> str:
    """Result ``plan-live``: the live stack of the recommended size against the plan's prediction."""
    r = load("plan-live")
    x = r.rows[0]
    return (f"{one_run(r)}: `kairos plan` for `{x['workload']}` ({x['duration_s']:g} s) recommends "
            f"{x['prefill']}P{x['decode']}D for `kairos+`, predicting {pct(x['predicted'], 1)} SLO attainment; "
            f"`kairos demo` of that cluster (emulated engines, the real services and NATS) served "
            f"{num(x['completed'])} of {num(x['requests'])} requests with {pct(x['live'], 1)} "
            f"({pct(x['sim_in_demo'], 1)} in the demo's own simulation): {x['points_apart']:g} points from the "
            f"prediction (target: within 5, {'met' if x['met'] else '**missed**'}).")


def plan_saving(load: Load) -> str:
    """README: what ``kairos+`` saves over ``pd`` by the planner, per workload of ``plan-replay``."""
    r = load("plan-replay")
    parts = []
    for x in r.rows:
        s = x["saving"]
        bits = []
        if s["nodes"] is not None:
            bits.append(f"{_cluster(x['smallest']['kairos+'])} nodes instead of {_cluster(x['smallest']['pd'])}"
                        + ("" if s["nodes"] == 0 or s["nodes_clear"] else ", inside the seeds' spread"))
        if s["rate_ratio"] is not None:
            bits.append(f"×{s['rate_ratio']:.2f} the rate on {x['budget']} nodes"
                        + ("" if s["rate_clear"] else " (inside the spread)"))
        parts.append(f"`{x['workload']}` at {x['rps']:g} req/s, {pct(x['target'])} target: " + "; ".join(bits))
    return (f"`kairos plan` on the bundled traces and the paper's workloads ({one_run(r)}; "
            f"[docs/plan.md](docs/plan.md)): " + " — ".join(parts) + ".")
