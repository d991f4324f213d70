"""The simulator runs of the reproduction report (``python -m tools.docgen.reproduction``): Table 3
(the PD baseline's P95 TTFT breakdown), Table 4 (static policies, TaiChi and Kairos on Bursty), the
§6 RPS sweeps, the kairos+ ablation, robustness to model noise, model error (bias, noise, drift),
the conversation traces, the oracle check and the simulator's speed. Each function runs
``kairos.sim`` and returns its markdown table with the raw rows (``run_one``'s dicts); the rows are
written to ``paper-reproduction.json`` and the prose's figures are computed from them
(:mod:`tools.docgen.repro_facts`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from kairos.core.model.latency import load_profile
from kairos.core.policy import Policy, PolicyParams, parse_policy
from kairos.core.policy.registry import KAIROS_PLUS_SLOTS
from kairos.core.workload.workloads import generate, parse_workload
from kairos.sim.experiments import max_sustainable_rps, plot_sweep, run_one, sweep_title
from kairos.sim.simulator import SimConfig
from tools.docgen.fmt import num
from tools.docgen.paper import PAPER_RPS, PAPER_S6, PAPER_T3, PAPER_T4

SPEED_TARGETS = ((2, 2, 4, 200), (8, 32, 16, 20))  # (P, D, RPS, ≥ × real time) — the simulator's targets

S6_POLICIES = ("pd", "dynamo", "kairos", "taichi")

CONV_TRACES = ("mooncake", "azure-conv")

CONV_POLICIES = ("pd", "kairos", "kairos+", "dynamo", "taichi")

CONV_UTILS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)  # prefill-pool loads scanned for pd's knee

CONV_LOADS = (0.7, 1.0)  # further loads shown when above the first one where pd misses the SLO

ABLATION_RATES = (4, 8)

ROBUST_NOISE = (0.0, 0.05, 0.10)

LINKS = ("paper", "rdma")

PAPER_RATES = tuple(float(r) for r in range(6, 13))  # the paper's §6 sweep (RPS)

NORMALIZED_RATES = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)  # the same sweep scaled to our prefill capacity

LOAD_MATCH = 0.7  # prefill-pool utilization of the load-matched Table 3

MODEL_ERROR_POLICIES = ("pd", "sq:1", "sl:1024", "dynamo", "kairos", "kairos+")



def prefill_capacity_tok_s(n_prefill: int = 2) -> float:
    """Prefill-pool throughput of the profile in prompt tokens/s (full χ_p chunks, ~4K cached)."""
    model = load_profile()
    chi = model.engine.max_num_batched_tokens
    return n_prefill * chi / float(model.prefill_step_ms(chi, 4096)) * 1000.0



def load_matched_rps(workload: str, utilization: float, seed: int) -> float:
    """Rate at which ``workload``'s mean prompt loads our prefill pool to ``utilization``."""
    sample = generate(workload, 50, 200, seed)
    mean_prompt = sum(r.prompt_tokens for r in sample) / len(sample)
    return round(utilization * prefill_capacity_tok_s() / mean_prompt, 2)



def table3(duration: float, seed: int, link: str, params: PolicyParams,
           utilization: float | None = None) -> tuple[str, list[dict]]:
    """PD baseline P95 TTFT breakdown per workload, at the paper's rates or at load-matched ones."""
    model = load_profile()
    rows = []
    lines = ["| workload | RPS | prefill queue | prefill exec | KV transfer | decode queue | TTFT P95 | paper (same order) |",
             "|---|---|---|---|---|---|---|---|"]
    for wl, paper_rps in PAPER_RPS.items():
        rps = paper_rps if utilization is None else load_matched_rps(wl, utilization, seed)
        r = run_one(generate(wl, rps, duration, seed), parse_policy("pd"), model, params, SimConfig(link=link), rps=rps)
        rows.append({"workload": wl, **r})
        b = r["ttft_breakdown_p95_ms"]
        paper = " / ".join(f"{v:,}" for v in PAPER_T3[wl])
        lines.append(f"| {wl.upper()} | {rps} | {num(b['prefill_queue'])} | {num(b['prefill_exec'])} | "
                     f"{num(b['kv_transfer'])} | {num(b['decode_queue'])} | {num(r['ttft_ms']['p95'])} | {paper} |")
    return "\n".join(lines), rows



def table4(duration: float, seed: int, link: str, params: PolicyParams) -> tuple[str, list[dict]]:
    model = load_profile()
    wl = generate("bursty", 4, duration, seed)
    specs = [("pd", "pd", 100.0), ("sq:1", "sq:1", 100.0), ("sq:4", "sq:4", 100.0), ("sl:512", "sl:512", 100.0),
             ("sl:1024", "sl:1024", 100.0), ("sl:2048", "sl:2048", 100.0), ("dynamo", "dynamo", 100.0),
             ("kairos (Δh=100 ms)", "kairos", 100.0), ("oracle", "kairos", 0.0), ("taichi", "taichi", 100.0)]
    specs += [(f"{s} (queued)", s, 100.0) for s in ("sq:1", "sl:1024", "sl:2048", "dynamo")]
    rows = []
    lines = ["| policy | deflections | P95 TTFT (s) | TBT viol. (%) | SLO attain. (%) | P95 TBT (ms) | paper: defl / P95 TTFT / viol % / SLO % |",
             "|---|---|---|---|---|---|---|"]
    for label, spec, hb in specs:
        cfg = SimConfig(link=link, heartbeat_ms=hb, reservation_rule=not label.endswith("(queued)"))
        r = run_one(wl, parse_policy(spec), model, params, cfg, rps=4, label=label)
        rows.append(r)
        p = PAPER_T4.get(label)
        paper = "–" if p is None else f"{p[0]} / {p[1]} / {p[2]} / {p[3]}"
        lines.append(f"| {label} | {r['deflections']} | {num(r['ttft_ms']['p95'] / 1000, 2)} | "
                     f"{num(100 * r['tbt_violation_rate'], 2)} | {num(100 * r['slo_attainment'], 1)} | "
                     f"{num(r['tbt_ms']['p95'], 1)} | {paper} |")
    return "\n".join(lines), rows



def sweep6(duration: float, seed: int, link: str, params: PolicyParams, out: Path,
           rates: tuple[float, ...] = PAPER_RATES, tag: str = "") -> tuple[str, list[dict], list[Path]]:
    """§6: Bursty RPS sweep, pd vs dynamo vs kairos vs taichi, with plots and the highest SLO-meeting rate."""
    model = load_profile()
    rows = []
    for rps in rates:
        wl = generate("bursty", rps, duration, seed)
        for spec in S6_POLICIES:
            rows.append(run_one(wl, parse_policy(spec), model, params, SimConfig(link=link), rps=rps))
    plots = plot_sweep(rows, out / "plots", params, prefix=f"sweep-{link}{tag}",
                       title=sweep_title("bursty", duration, 2, 2, model.name, link, seed))
    lines = ["| RPS | " + " | ".join(f"{p} P95 TTFT s / P95 TBT ms / SLO % / defl" for p in S6_POLICIES) + " |",
             "|---" * (len(S6_POLICIES) + 1) + "|"]
    for rps in rates:
        cells = []
        for spec in S6_POLICIES:
            r = next(x for x in rows if x["rps"] == rps and x["policy"] == spec)
            cells.append(f"{num(r['ttft_ms']['p95'] / 1000, 2)} / {num(r['tbt_ms']['p95'], 1)} / "
                         f"{num(100 * r['slo_attainment'], 1)} / {r['deflections']}")
        lines.append(f"| {rps:g} | " + " | ".join(cells) + " |")
    best = {p: max_sustainable_rps(rows, p, params) for p in S6_POLICIES}
    lines.append("")
    lines.append(f"Highest swept RPS meeting both SLOs (P95 TTFT ≤ {params.ttft_slo_ms / 1000:g} s and P95 TBT ≤ "
                 f"{params.tbt_slo_ms:g} ms): " +
                 ", ".join(f"{p}: {f'{v:g}' if v else f'none ≥ {rates[0]:g}'}" for p, v in best.items()) +
                 f"; kairos vs pd sustainable rate: {sustainable_gain(best)} (paper: PD {PAPER_S6['pd']}, Kairos "
                 f"{PAPER_S6['kairos']}, TaiChi {PAPER_S6['taichi']} RPS, +{PAPER_S6['gain_pct']} %).")
    return "\n".join(lines), rows, plots



def sustainable_gain(best: dict[str, float | None]) -> str:
    """kairos' highest SLO-meeting swept rate relative to pd's, as ``+x.x %`` (``n/a`` without both)."""
    return f"{100 * (best['kairos'] / best['pd'] - 1):+.1f} %" if best.get("pd") and best.get("kairos") else "n/a"



def ablation(duration: float, seed: int, link: str, params: PolicyParams) -> tuple[str, list[dict]]:
    """kairos+ features one at a time vs kairos (Bursty at 4 and 8 RPS; exact model, so the
    correction's effect here is only its cost: ~identity factors)."""
    model = load_profile()
    base = parse_policy("kairos")

    def switched(spec: str, switch: str) -> Policy:
        """``kairos`` with one of kairos+'s :class:`PolicyParams` switches on (recorded as ``spec``)."""
        return dataclasses.replace(base, spec=spec, traits=dataclasses.replace(base.traits, overrides={switch: True}))

    variants = [
        ("kairos", base, False),
        ("+ KV-aware TTFT_pf", switched("kairos+kv", "kv_transfer_aware"), False),
        ("+ projected state", switched("kairos+proj", "project_decode_state"), False),
        ("+ node-side guard", base, True),
        ("+ model correction", switched("kairos+corr", "model_correction"), False),
        ("kairos+ (all four)", parse_policy("kairos+"), True),
    ]
    rows = []
    lines = ["| RPS | variant | deflections | P95 TTFT (s) | P99 TTFT (s) | TBT viol. (%) | SLO attain. (%) | deflected steps > β·τ (joined / other) |",
             "|---|---|---|---|---|---|---|---|"]
    for rps in ABLATION_RATES:
        wl = generate("bursty", rps, duration, seed)
        for label, pol, guard in variants:
            # projection plans several deflections per node: it gets kairos+'s slots (kairos: one)
            slots = KAIROS_PLUS_SLOTS if pol.overrides.get("project_decode_state") else 0
            r = run_one(wl, pol, model, params, SimConfig(link=link, tbt_guard=guard, deflection_slots=slots),
                        rps=rps, label=label)
            rows.append(r)
            v = r["deflected_step_violations"]
            lines.append(f"| {rps} | {label} | {r['deflections']} | {num(r['ttft_ms']['p95'] / 1000, 2)} | "
                         f"{num(r['ttft_ms']['p99'] / 1000, 2)} | {num(100 * r['tbt_violation_rate'], 3)} | "
                         f"{num(100 * r['slo_attainment'], 1)} | {v['over_limit']} ({v['decode_joined']} / {v['other']}) |")
    return "\n".join(lines), rows



def robustness(duration: float, seed: int, params: PolicyParams) -> tuple[str, list[dict]]:
    """Model error: the engines' step latencies carry multiplicative noise the policy does not know."""
    model = load_profile()
    wl = generate("bursty", 4, duration, seed)
    rows = []
    lines = ["| noise σ | policy | β | P95 TTFT (s) | TBT viol. (%) | SLO attain. (%) | deflected steps > β·τ |",
             "|---|---|---|---|---|---|---|"]
    for noise in ROBUST_NOISE:
        for spec, beta in (("pd", 1.0), ("kairos", 1.0), ("kairos+", 1.0), ("kairos", 0.9), ("kairos+", 0.9)):
            pp = msgspec.structs.replace(params, beta=beta)
            r = run_one(wl, parse_policy(spec), model, pp,
                        SimConfig(noise=noise, seed=seed, tbt_guard=parse_policy(spec).traits.node_guard), rps=4)
            rows.append({"noise": noise, "beta": beta, **r})
            over = r["deflected_step_violations"]["over_limit"]
            lines.append(f"| {noise} | {spec} | {beta} | {num(r['ttft_ms']['p95'] / 1000, 2)} | "
                         f"{num(100 * r['tbt_violation_rate'], 3)} | {num(100 * r['slo_attainment'], 1)} | {over} |")
    return "\n".join(lines), rows



def model_error_scenarios(duration: float) -> list[tuple[str, dict[str, Any]]]:
    """(label, SimConfig fields) of the model-error section: the engines' truth vs the policy's model."""
    half = round(duration / 2.0, 1)
    return [
        ("exact model", {}),
        ("bias +10 %", {"truth_scale": 1.1}),
        ("bias −10 %", {"truth_scale": 0.9}),
        ("noise 5 %", {"noise": 0.05}),
        ("bias +10 % & noise 5 %", {"truth_scale": 1.1, "noise": 0.05}),
        (f"drift: decode-0 +15 % at {half:g} s", {"drift_node": "decode-0", "drift_scale": 1.15, "drift_at_s": half}),
    ]



def model_error(duration: float, seed: int, params: PolicyParams) -> tuple[str, list[dict], str]:
    """Every policy under each model-error scenario (Bursty 4 RPS, 2P2D, `paper` link), beside the
    exact-model run; and the issue-9 targets checked from the same rows."""
    model = load_profile()
    wl = generate("bursty", 4, duration, seed)
    rows: list[dict] = []
    lines = ["| engines' truth | policy | deflections | P95 TTFT (s) | P95 TTFT vs exact | TBT viol. (%) | "
             "SLO attain. (%) |", "|---|---|---|---|---|---|---|"]
    exact: dict[str, float] = {}
    for label, kw in model_error_scenarios(duration):
        for spec in MODEL_ERROR_POLICIES:
            r = run_one(wl, parse_policy(spec), model, params,
                        SimConfig(seed=seed, tbt_guard=parse_policy(spec).traits.node_guard, **kw), rps=4, label=spec)
            rows.append({"scenario": label, **r})
            p95 = r["ttft_ms"]["p95"]
            if not kw:
                exact[spec] = p95
            rel = f"{p95 / exact[spec]:.2f}×" if exact.get(spec) else "–"
            lines.append(f"| {label} | {spec} | {r['deflections']} | {num(p95 / 1000, 2)} | {rel} | "
                         f"{num(100 * r['tbt_violation_rate'], 3)} | {num(100 * r['slo_attainment'], 1)} |")

    def row(scen: str, spec: str) -> dict:
        return next(x for x in rows if x["scenario"] == scen and x["policy"] == spec)

    tgt = row("bias +10 % & noise 5 %", "kairos+")
    pd = row("bias +10 % & noise 5 %", "pd")
    viol, ratio = 100 * tgt["tbt_violation_rate"], tgt["ttft_ms"]["p95"] / pd["ttft_ms"]["p95"]
    drift_label = model_error_scenarios(duration)[-1][0]
    dr = row(drift_label, "kairos+")["drift"]
    dk = row(drift_label, "kairos")["drift"]
    after = 100 * (dr["rate_after_settle"] or 0.0)
    targets = "\n".join([
        f"* Bias +10 % and 5 % noise: `kairos+` TBT violations **{viol:.3f} %** of decode steps (target ≤ 0.1 %: "
        f"{'met' if viol <= 0.1 else 'missed'}); P95 TTFT **{ratio:.2f} × `pd`'s** under the same truth "
        f"({tgt['ttft_ms']['p95'] / 1000:.2f} s vs {pd['ttft_ms']['p95'] / 1000:.2f} s; target ≤ 0.75: "
        f"{'met' if ratio <= 0.75 else 'missed'}).",
        f"* Drift (decode-0 15 % slower from {dr['at_s']:g} s): `kairos+` violations on decode-0 "
        f"{100 * (dr['rate_first_settle'] or 0):.3f} % of its steps in the first {dr['settle_s']:g} s, "
        f"**{after:.3f} %** after them ({dr['steps_after_settle']} steps; target < 0.1 % within 30 s: "
        f"{'met' if after < 0.1 else 'missed'}); its last violation came {dr['last_violation_after_s']:g} s after "
        f"the drift. `kairos` (no correction): {100 * (dk['rate_after_settle'] or 0):.3f} % after the first "
        f"{dk['settle_s']:g} s.",
    ])
    return "\n".join(lines), rows, targets



def trace_rate(trace: str, utilization: float, seed: int) -> float:
    """RPS at which ``trace``'s mean prompt loads our prefill pool to ``utilization``."""
    full = parse_workload(trace, None, None, seed)
    return round(utilization * prefill_capacity_tok_s() / (sum(r.prompt_tokens for r in full) / len(full)), 2)



def conversation_rate(trace: str, duration: float, seed: int, params: PolicyParams) -> tuple[float, list[dict]]:
    """Lowest scanned rate at which ``pd``'s P95 TTFT on ``trace`` exceeds the TTFT SLO (the
    highest scanned rate if none does), and the pd rows of the scan. Rates are prefill-pool loads
    :data:`CONV_UTILS` converted with the trace's mean prompt."""
    model = load_profile()
    scan = []
    for u in CONV_UTILS:
        rps = trace_rate(trace, u, seed)
        r = run_one(parse_workload(trace, rps, duration, seed), parse_policy("pd"), model, params, SimConfig(),
                    rps=rps)
        scan.append({"utilization": u, **r})
        if (r["ttft_ms"]["p95"] or 0) > params.ttft_slo_ms:
            return rps, scan
    return scan[-1]["rps"], scan



def conversation(duration: float, seed: int, params: PolicyParams) -> tuple[str, dict[str, Any], str]:
    """kairos, kairos+, dynamo and taichi (and pd) on the conversation traces at the rate where
    pd's P95 TTFT first exceeds the SLO and at the higher loads of :data:`CONV_LOADS`; the
    issue-12 targets checked from the same rows, per (trace, rate)."""
    model = load_profile()
    lines = ["| trace | load | RPS | policy | deflections | P95 TTFT (s) | P99 TTFT (s) | TBT viol. (%) | SLO attain. (%) | "
             "P95 TBT (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    data: dict[str, Any] = {}
    targets = []
    for trace in CONV_TRACES:
        first, scan = conversation_rate(trace, duration, seed, params)
        u0 = scan[-1]["utilization"]
        loads = [(u0, first)] + [(u, trace_rate(trace, u, seed)) for u in CONV_LOADS if u > u0]
        data[trace] = {"pd_scan": scan, "runs": []}
        for u, rps in loads:
            rows = conversation_rows(trace, u, rps, duration, seed, params, lines)
            text, met = conversation_targets(trace, rps, rows, params)
            data[trace]["runs"].append({"utilization": u, "rps": rps, "requests": rows[0]["requests"], "rows": rows,
                                        "target_met": met})
            targets.append(text)
    return "\n".join(lines), data, "\n".join(targets)



def conversation_rows(trace: str, u: float, rps: float, duration: float, seed: int, params: PolicyParams,
                      lines: list[str]) -> list[dict]:
    """Every policy of :data:`CONV_POLICIES` on ``trace`` at ``rps``; appends the table lines."""
    model = load_profile()
    wl = parse_workload(trace, rps, duration, seed)
    rows = []
    for spec in CONV_POLICIES:
        r = run_one(wl, parse_policy(spec), model, params, SimConfig(tbt_guard=parse_policy(spec).traits.node_guard), rps=rps)
        rows.append(r)
        lines.append(f"| {trace} | {100 * u:.0f} % | {rps:g} | {spec} | {r['deflections']} | "
                     f"{num(r['ttft_ms']['p95'] / 1000, 2)} | {num(r['ttft_ms']['p99'] / 1000, 2)} | "
                     f"{num(100 * r['tbt_violation_rate'], 3)} | {num(100 * r['slo_attainment'], 1)} | "
                     f"{num(r['tbt_ms']['p95'], 1)} |")
    return rows



def conversation_targets(trace: str, rps: float, rows: list[dict], params: PolicyParams) -> tuple[str, bool]:
    """One generated bullet, and whether the target is met: kairos+ beats kairos, dynamo and
    taichi on P95 TTFT and SLO attainment with TBT violations no higher than kairos's (and pd's
    P95 TTFT exceeds the SLO at this rate); the bullet says by how much."""
    by = {r["policy"]: r for r in rows}
    plus, pd = by["kairos+"], by["pd"]
    parts, ok = [], (pd["ttft_ms"]["p95"] or 0) > params.ttft_slo_ms
    for other in ("kairos", "dynamo", "taichi"):
        o = by[other]
        d_ttft = 100 * (plus["ttft_ms"]["p95"] / o["ttft_ms"]["p95"] - 1)
        d_slo = 100 * (plus["slo_attainment"] - o["slo_attainment"])
        ok = ok and d_ttft < 0 and d_slo > 0
        parts.append(f"vs `{other}` P95 TTFT {d_ttft:+.1f} % ({plus['ttft_ms']['p95'] / 1000:.2f} s vs "
                     f"{o['ttft_ms']['p95'] / 1000:.2f} s), SLO attainment {d_slo:+.1f} points")
    v_plus, v_k = 100 * plus["tbt_violation_rate"], 100 * by["kairos"]["tbt_violation_rate"]
    ok = ok and v_plus <= v_k
    return (f"* `{trace}` at {rps:g} RPS (pd's P95 TTFT {pd['ttft_ms']['p95'] / 1000:.2f} s "
            f"{'>' if pd['ttft_ms']['p95'] > params.ttft_slo_ms else '≤'} the {params.ttft_slo_ms / 1000:g} s SLO): "
            f"`kairos+` {'; '.join(parts)}; TBT violations {v_plus:.3f} % vs `kairos`'s {v_k:.3f} % — "
            f"target **{'met' if ok else 'missed'}**."), ok



def oracle_check(duration: float, seed: int, params: PolicyParams) -> str:
    """Δh = 0, policy model = ground truth: deflected steps over β·τ, split by cause."""
    model = load_profile()
    r = run_one(generate("bursty", 4, duration, seed), parse_policy("kairos"), model, params,
                SimConfig(heartbeat_ms=0.0), rps=4)
    v = r["deflected_step_violations"]
    return (f"Bursty 4 RPS, kairos: {v['deflected_steps']} deflected-prefill steps, {v['over_limit']} above β·τ: "
            f"{v['decode_joined']} with a decode in the batch that was not running at the decision "
            f"(a KV handoff or another request joined the node), {v['other']} without such a join.")



def speed(seed: int, params: PolicyParams) -> str:
    """Simulated vs wall seconds of kairos runs, against :data:`SPEED_TARGETS`."""
    model = load_profile()
    out = []
    for n_p, n_d, rps, target in SPEED_TARGETS:
        wl = generate("bursty", rps, 600, seed)
        r = run_one(wl, parse_policy("kairos"), model, params, SimConfig(n_prefill=n_p, n_decode=n_d), rps=rps)
        out.append(f"{n_p}P{n_d}D Bursty {rps} RPS, 600 s: {r['sim_seconds']:.0f} simulated s in "
                   f"{r['wall_seconds']:.2f} wall s = **{r['speedup']:.0f}× real time** (target ≥ {target}×: "
                   f"{'met' if (r['speedup'] or 0) >= target else 'missed'})")
    return "\n".join(f"* {x}" for x in out)
