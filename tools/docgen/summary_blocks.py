"""The README's results summary: one line per headline figure, each linking to the generated table
in docs/ it comes from. Sources: the result files of those tables (``sim-bursty``, ``fidelity``,
``vllm-ab``, ``decision-cost-kairos``, ``control-plane``, ``nats-cluster-failover``, ``mutation``)
and the targets the benchmarks and CLI define themselves.
"""

from __future__ import annotations

import statistics

from tools.docgen.fmt import num, pct, ratio, seconds, us
from tools.docgen.results import Load, bench_module
from tools.docgen.sim_blocks import DECISION_TARGETS_US


def _row(what: str, figure: str, link: str, target: str) -> str:
    return f"| {what} | {figure} | [{link}]({target}) |"


def results_summary(load: Load) -> str:
    """A markdown table: what was measured, the headline figure, and the docs section holding its
    full table (links relative to the repo root: the block lives in README.md)."""
    from kairos.cli.demo import FIDELITY_TOLERANCE

    sim = load("sim-bursty")
    pd, k = sim.one(policy="pd"), sim.one(policy="kairos")
    live = load("fidelity").rows[0]
    ttft = {q: ratio(live["ttft_ms"][q], live["simulated"]["ttft_ms"][q]) for q in ("p50", "p95")}
    ab = bench_module("vllm_ab").ratios(load("vllm-ab").rows)["kairos"]
    cost = load("decision-cost-kairos")
    cp_bench = bench_module("control_plane")
    cp = load("control-plane").rows
    top = max(r["offered_rps"] for r in cp)
    one = [r for r in cp if r["dispatchers"] == 1 and r["offered_rps"] == top]
    fail = load("nats-cluster-failover").rows[-1]
    mut = load("mutation").rows
    mutants = sum(x["mutants"] for x in mut)
    killed = sum(x["killed"] + x["timeout"] for x in mut)
    lines = ["| what | measured | full table |", "|---|---|---|", _row(
        f"Simulator, Bursty at {num(pd['rps'])} RPS (`kairos sim`)",
        f"P95 TTFT {seconds(pd['ttft_ms']['p95'])} with `pd` → {seconds(k['ttft_ms']['p95'])} with `kairos`; SLO "
        f"attainment {pct(pd['slo_attainment'])} → {pct(k['slo_attainment'])}", "results", "docs/results.md#the-simulator"),
        _row("The live stack on emulated engines vs the simulator (`kairos demo`)",
             f"TTFT live ÷ simulated {ttft['p50']} at P50, {ttft['p95']} at P95 (target: within "
             f"±{100 * FIDELITY_TOLERANCE:.0f} %)", "fidelity",
             "docs/results.md#fidelity-the-live-system-vs-the-simulator"),
        _row("Real vLLM-CPU engines, `pd` vs `kairos` (`bench/vllm_ab.py`)",
             f"P95 TTFT `kairos` ÷ `pd`: {ab['live']:.2f} live, {ab['simulated']:.2f} in the simulator", "vLLM",
             "docs/results.md#real-vllm-engines-on-cpu"),
        _row("Decision cost per request, one core (`bench/decision_cost.py`)",
             "`kairos` p99: " + ", ".join(f"{us(cost.one(cluster=c)['p99_us'])} at {c} (target ≤ {us(t)})"
                                          for c, t in DECISION_TARGETS_US.items()), "decision cost", "docs/results.md#decision-cost"),
        _row(f"Control plane at {num(top)} req/s, one dispatcher (`bench/control_plane.py`)",
             f"added latency p50 {statistics.median(r['added_ms']['p50'] for r in one):.1f} ms, p99 "
             f"{statistics.median(r['added_ms']['p99'] for r in one):.1f} ms, medians of {len(one)} runs (targets "
             f"≤ {cp_bench.TARGET_P50_MS:g} ms, ≤ {cp_bench.TARGET_P99_MS:g} ms)", "control plane",
             "docs/results.md#control-plane-throughput"),
        _row(f"A {num(fail['servers'])}-server NATS cluster, each member SIGKILLed in turn under load",
             f"{num(fail['completed'])} of {num(fail['sent'])} streaming requests completed, {num(fail['lost'])} lost, "
             f"{num(fail['duplicated'])} executed twice; p99 TTFT "
             f"{fail['p99_ttft_failover_s'] - fail['p99_ttft_steady_s']:+.2f} s in failover", "reliability",
             "docs/reliability.md#a-nats-cluster-survives-the-loss-of-a-member"),
        _row("Mutation tier over the safety core (`make mutation`)",
             f"{pct(killed / mutants, 1)} of {num(mutants)} planted bugs caught", "mutation tier",
             "docs/reliability.md#tests-that-catch-bugs-the-mutation-tier"),
    ]
    return "\n".join(lines)
