"""What ``kairos plan`` prints and draws: a text report of a :class:`~kairos.plan.planner.Plan` and a PNG
of SLO attainment against the P:D split of the budget, one line per policy, the chosen splits marked."""

from __future__ import annotations

from pathlib import Path

from kairos.plan.planner import Plan, PolicyPlan
from kairos.plan.search import RATE_SPAN, Spread, near_ceiling, out_of_reach


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _range(s: Spread) -> str:
    """``93.1 %`` for one seed or equal seeds, else ``93.1 % (92.0–94.3 %)`` (mean, min–max)."""
    return _pct(s.mean) if s.lo == s.hi else f"{_pct(s.mean)} ({100 * s.lo:.1f}–{_pct(s.hi)})"


def _rate(p: PolicyPlan, base_rps: float, target: float) -> str:
    r = p.sustained_rps
    if r is None and p.ceiling is not None and out_of_reach(p.ceiling, target):
        return "none (not searched: the target is above the workload's ceiling)"
    if r is None:
        return "none (the split misses the target even at the lowest rate tried)"
    if r >= base_rps * RATE_SPAN * (1 - 1e-6):
        return f"at least {r:g} req/s (the search's top, ×{RATE_SPAN:g} the workload's)"
    spread = "" if len(set(p.max_rps)) == 1 else f", seeds {min(p.max_rps):g}–{max(p.max_rps):g}"  # type: ignore[type-var]
    return f"{r:g} req/s (×{r / base_rps:.2f} the workload's{spread})"


def _seeds_changed_nothing(plan: Plan) -> bool:
    """Every seed scored alike at every point reported (a deterministic trace without ``--noise``)."""
    for p in plan.policies:
        spreads = ([p.budget_spread] + ([p.smallest.spread] if p.smallest is not None else [])
                   + ([p.ceiling] if p.ceiling is not None else []))
        if any(s.lo != s.hi for s in spreads) or len(set(p.max_rps)) > 1:
            return False
    return True


def text(plan: Plan, gpus_per_node: int = 1) -> str:
    """The report: per policy its smallest cluster, the budget's best split (and splits tied with it
    by the noise rule), the rate that split sustains; then each policy's saving over the baseline."""
    g = f" ({gpus_per_node} GPUs per node)" if gpus_per_node > 1 else ""
    lines = [f"SLO attainment target {_pct(plan.target)}, clusters of {plan.lo}–{plan.hi} nodes{g}, budget "
             f"{plan.budget} nodes, seeds {', '.join(map(str, plan.seeds))}, workload rate "
             f"{plan.base_rps:g} req/s" + ("" if plan.rps is not None else " (its own timing)"),
             f"(the budget's splits are compared at {plan.policies[0].stress_rps:.4g} req/s: the rate it carries "
             "if the rate grows with the nodes from the smallest cluster)"]
    same = len(plan.seeds) > 1 and _seeds_changed_nothing(plan)
    if same:
        lines.append("(every seed gave the same result: a trace replays the same requests whatever the seed, so "
                     "no spread was measured; --noise adds engine step noise that the seeds vary)")
    lines.append("")
    for p in plan.policies:
        lines.append(f"{p.policy}:")
        if p.ceiling is not None:
            lines.append(f"  ceiling (each request alone on an idle cluster): attainment {_range(p.ceiling)}"
                         + (": the target is out of reach on any cluster" if out_of_reach(p.ceiling, plan.target) else
                            ": the target is within the seeds' spread of it, other draws of this workload may miss "
                            "it on any cluster" if near_ceiling(p.ceiling, plan.target) else ""))
        if p.smallest is None:
            lines.append(f"  smallest cluster: none of {plan.lo}–{plan.hi} nodes meets the target on every seed")
        else:
            s = p.smallest
            lines.append(f"  smallest cluster: {s.nodes} nodes = {s.prefill}P{s.decode}D "
                         f"({s.nodes * gpus_per_node} GPUs), attainment {_range(s.spread)}")
        d = plan.budget - p.budget_split
        tie = (f"; within the seeds' spread of {', '.join(f'{q}P{plan.budget - q}D' for q in p.ties)}"
               if p.ties and not same else "")
        lines.append(f"  best split of {plan.budget} nodes: {p.budget_split}P{d}D, attainment "
                     f"{_range(p.budget_spread)} at {p.stress_rps:.4g} req/s{tie}")
        lines.append(f"  highest sustained rate at {p.budget_split}P{d}D: {_rate(p, plan.base_rps, plan.target)}")
    for s in plan.savings:
        lines.append("")
        if s.nodes is None:
            lines.append(f"{s.policy} vs {s.baseline}: no node saving to report (a smallest cluster is missing)")
        elif s.nodes > 0:
            lines.append(f"{s.policy} vs {s.baseline}: {s.nodes} fewer node{'s' if s.nodes > 1 else ''} for the same "
                         f"SLOs" + ("" if s.nodes_clear else " (inside the seeds' spread: not a clear saving)"))
        else:
            lines.append(f"{s.policy} vs {s.baseline}: no fewer nodes ({-s.nodes} more"
                         + (")" if s.nodes_clear else ", inside the seeds' spread: not a clear loss)") if s.nodes < 0
                         else f"{s.policy} vs {s.baseline}: the same number of nodes")
        if s.rate_ratio is not None:
            lines.append(f"{s.policy} vs {s.baseline}: ×{s.rate_ratio:.2f} the sustained rate on {plan.budget} nodes"
                         + ("" if s.rate_clear else " (inside the seeds' spread: not a clear gain)"))
    return "\n".join(lines)


def plot(plan: Plan, path: Path, title: str = "") -> Path:
    """Write a PNG: attainment (%) against the prefill count of the budget (decode = budget − P), one
    line per policy (first seed), its best split marked, the target drawn (and a policy's ceiling
    below 100 %, dotted). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for p in plan.policies:
        xs = sorted(p.curve)
        line, = ax.plot(xs, [100 * p.curve[x].attainment for x in xs], marker=".", label=p.policy)
        ax.plot([p.budget_split], [100 * p.curve[p.budget_split].attainment], marker="*", markersize=14,
                color=line.get_color(), linestyle="none")
        if p.ceiling is not None and p.ceiling.mean < 1:  # what no split can beat (at 100 %: the frame)
            ax.axhline(100 * p.ceiling.mean, color=line.get_color(), linestyle=":", linewidth=1,
                       label=f"{p.policy} ceiling")
    ax.axhline(100 * plan.target, color="red", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel(f"prefill nodes of {plan.budget} (decode = {plan.budget} − prefill), at "
                  f"{plan.policies[0].stress_rps:.4g} req/s")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
