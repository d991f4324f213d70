"""Blocks of the simulator and the policy (docs/results.md, docs/policies.md, docs/calibration.md):
``kairos sim`` runs, the simulator's speed, the prefix index's and the decision's cost per request,
and the figures other docs quote from the reproduction report (``docs/results/paper-reproduction.json``,
written by ``python -m tools.docgen.reproduction``). Each renderer takes the result loader and
returns markdown; every figure is a field of a committed result or arithmetic on it.
"""

from __future__ import annotations

import json
from typing import Any

from tools.docgen.fmt import command, num, pct, provenance, seconds, sig, us
from tools.docgen.results import ROOT, DocgenError, Load


#: the decision-cost targets of issues #2 and #12 (p99 per decision, µs): cluster → budget
DECISION_TARGETS_US = {"8P64D": 200.0, "32P256D": 1000.0}


def sim_bursty(load: Load) -> str:
    """`kairos sim` on Bursty 4 RPS, pd vs kairos (result ``sim-bursty``)."""
    r = load("sim-bursty")
    pd, k = r.one(policy="pd"), r.one(policy="kairos")
    return (f"`{command(r.meta)}`: P95 TTFT {seconds(pd['ttft_ms']['p95'])} (pd) → "
            f"{seconds(k['ttft_ms']['p95'])} (kairos), SLO attainment {pct(pd['slo_attainment'])} → "
            f"{pct(k['slo_attainment'])}, {num(k['deflections'])} deflections, TBT violations "
            f"{pct(k['tbt_violation_rate'], 2)} of decode steps (decodes that joined a node during a deflection; "
            f"`kairos+`'s node-side guard removes them).")


def sim_speed(load: Load) -> str:
    """Simulated vs wall seconds of the two runs against :data:`tools.docgen.repro_experiments.SPEED_TARGETS` (``sim-bursty``, ``sim-speed-8p32d``)."""
    from tools.docgen.repro_experiments import SPEED_TARGETS

    small, big = load("sim-bursty"), load("sim-speed-8p32d")
    runs = [(small, small.one(policy="kairos")), (big, big.one(policy="kairos"))]
    parts = []
    for (n_p, n_d, rps, target), (res, row) in zip(SPEED_TARGETS, runs):
        parts.append(f"{n_p}P{n_d}D Bursty {rps} RPS for {num(row['sim_seconds'])} simulated s in "
                     f"{row['wall_seconds']:.2f} wall s, {num(row['speedup'])}× real time (target {target}×: "
                     f"{'met' if row['speedup'] >= target else 'missed'}; `{command(res.meta)}`)")
    return f"Simulator speed, one core: {parts[0]}; {parts[1]}. The 8P32D run: {provenance(big)}."


def sim_mooncake(load: Load) -> str:
    """P95 TTFT and SLO attainment per policy on the Mooncake trace, with and without prefix caches."""
    r, nc = load("sim-mooncake"), load("sim-mooncake-no-prefix-cache")

    def fig(row: dict) -> str:
        return f"{row['policy']} {seconds(row['ttft_ms']['p95'], 2)} / {pct(row['slo_attainment'], 1)}"

    reqs = {row["requests"] for row in r.rows}
    return (f"On the Mooncake conversation trace, `{command(r.meta)}` ({'/'.join(num(x) for x in sorted(reqs))} "
            f"requests): P95 TTFT / SLO attainment {', '.join(fig(x) for x in r.rows)}; with `--no-prefix-cache` "
            f"{' and '.join(fig(x) for x in nc.rows)}.")


def prefix_index(load: Load) -> str:
    """``bench/prefix_index.py``: per-cluster lookup cost (µs) of the prefix index."""
    r = load("prefix-index")
    rows = r.rows
    p50s = ", ".join(f"{us(x['p50_us'])} ({x['cluster']})" for x in rows)
    return (f"The per-node prefix index answers a request for every node in p50 {p50s}, CPU p99 "
            f"{' / '.join(sig(x['cpu_p99_us']) for x in rows)} µs (`{command(r.meta)}`: caches filled by the whole "
            f"Mooncake trace, whose first block every request shares, so every node matches every request; "
            f"one run: {provenance(r)}).")


def decision_cost(load: Load) -> str:
    """``bench/decision_cost.py`` for kairos, kairos+ and cold states: a table (µs) and the verdict on :data:`DECISION_TARGETS_US`."""
    k, kp = load("decision-cost-kairos"), load("decision-cost-kairos+")
    cold = load("decision-cost-cold")
    lines = [
        f"Decision cost per request, one core (`{command(k.meta)}`, and `--policy kairos+`; prompts from the Bursty "
        f"distribution, decode batches 0–48, a fifth of the decode nodes reserved, 0–3 nodes holding a cached "
        f"prefix of the request; node states change when their heartbeat arrives, as in a dispatcher's view). "
        f"Wall clock, and in brackets the thread's CPU time (the machine is shared: wall-clock p99 includes the "
        f"OS giving the core to other jobs; `kairos`: {provenance(k)}; `kairos+`: {provenance(kp)}):",
        "",
        "| cluster | `kairos` p50 | `kairos` p99 | `kairos+` p50 | `kairos+` p99 | target (p99) |",
        "|---|---|---|---|---|---|",
    ]
    verdict: dict[tuple[str, str], bool] = {}
    for row in k.rows:
        c = row["cluster"]
        o = kp.one(cluster=c)
        target = DECISION_TARGETS_US.get(c)
        lines.append(f"| {c} | {us(row['p50_us'])} | {us(row['p99_us'])} ({sig(row['cpu_p99_us'])}) | "
                     f"{us(o['p50_us'])} | {us(o['p99_us'])} ({sig(o['cpu_p99_us'])}) | "
                     f"{'≤ ' + us(target) if target else ''} |")
        if target:
            for pol, x in (("kairos", row), ("kairos+", o)):
                verdict[(pol, "wall")] = verdict.get((pol, "wall"), True) and x["p99_us"] <= target
                verdict[(pol, "cpu")] = verdict.get((pol, "cpu"), True) and x["cpu_p99_us"] <= target

    def met(kind: str) -> str:
        ok = [p for p in ("kairos", "kairos+") if verdict.get((p, kind))]
        return {0: "neither policy", 1: f"`{ok[0]}` only", 2: "both policies"}[len(ok)]

    where = (f"by {met('wall')} in wall-clock and in CPU time" if met("wall") == met("cpu")
             else f"in wall-clock time by {met('wall')} and in CPU time by {met('cpu')}")
    lines += ["", f"The p99 targets are met {where}. "
              f"With every node's state new at every decision (`--states cold`, nothing reusable — not what a "
              f"dispatcher sees) `kairos` costs "
              + " and ".join(f"p50 {us(x['cpu_p50_us'])} / p99 {us(x['cpu_p99_us'])} CPU at {x['cluster']}"
                             for x in cold.rows) + "."]
    return "\n".join(lines)


def reproduction_data() -> dict[str, Any]:
    return json.loads((ROOT / "docs" / "results" / "paper-reproduction.json").read_text())


def model_error_table(load: Load) -> str:
    """The model-error rows of docs/results/paper-reproduction.json (``python -m tools.docgen.reproduction``)."""
    rows = reproduction_data()["model-error"]

    def get(scen: str, pol: str) -> dict[str, Any]:
        m = [r for r in rows if r["scenario"] == scen and r["policy"] == pol]
        if len(m) != 1:
            raise DocgenError(f"paper-reproduction.json model-error: {len(m)} rows for {scen!r} / {pol}")
        return m[0]

    lines = ["| engines' truth | `kairos` TBT viol. | `kairos+` TBT viol. | `kairos+` P95 TTFT | `pd` P95 TTFT |",
             "|---|---|---|---|---|"]
    for scen in dict.fromkeys(r["scenario"] for r in rows):
        k, kp, pd = get(scen, "kairos"), get(scen, "kairos+"), get(scen, "pd")
        note = ""
        if kp.get("drift"):
            dr = kp["drift"]
            note = (f" (decode-{dr['node']} after {dr['settle_s']:g} s: {pct(dr['rate_after_settle'], 3)}; last "
                    f"violation {dr['last_violation_after_s']:g} s after the drift)")
        lines.append(f"| {scen} | {pct(k['tbt_violation_rate'], 3)} | {pct(kp['tbt_violation_rate'], 3)}{note} | "
                     f"{seconds(kp['ttft_ms']['p95'], 2)} | {seconds(pd['ttft_ms']['p95'], 2)} |")
    return "\n".join(lines)


def calibration_link(load: Load) -> str:
    """The PD baseline's P95 KV-transfer time on Bursty 4 RPS per link, from the reproduction report."""
    data = reproduction_data()

    def kv(link: str) -> float:
        rows = [r for r in data[f"table4-{link}"] if r["policy"] == "pd"]
        if len(rows) != 1:
            raise DocgenError(f"paper-reproduction.json table4-{link}: {len(rows)} pd rows")
        return rows[0]["ttft_breakdown_p95_ms"]["kv_transfer"]

    return (f"The paper-calibrated link (one transfer at a time per prefill→decode link) puts the PD baseline's P95 "
            f"KV-transfer time on Bursty at 4 RPS at {seconds(kv('paper'))} in the simulator, in the range of "
            f"Table 3's (see docs/results/paper-reproduction.md, `python -m tools.docgen.reproduction`); the RDMA-class link "
            f"gives {num(kv('rdma'))} ms.")
