"""Every figure the prose of the reproduction report quotes (tools/docgen/templates/report_notes.md),
computed from the run's rows and the paper's constants: the prose itself holds no figure
(tests/unit/test_report_prose.py).
"""

from __future__ import annotations

from typing import Any

from kairos.core.model.latency import load_profile
from kairos.core.policy import PolicyParams
from kairos.core.workload.workloads import generate
from kairos.sim.experiments import max_sustainable_rps
from tools.docgen.fmt import in_seconds, num, num_range, pct
from tools.docgen.paper import PAPER_LP_MEDIAN, PAPER_RPS, PAPER_S6, PAPER_T3, PAPER_T4
from tools.docgen.repro_experiments import CONV_TRACES, CONV_UTILS, LINKS, S6_POLICIES, prefill_capacity_tok_s, sustainable_gain

def note_facts(data: dict[str, Any], params: PolicyParams, seed: int) -> dict[str, str]:
    """Every figure the prose of tools/docgen/templates/report_notes.md quotes, computed from this run's ``data``
    (and the paper constants above). Raises KeyError if a row the prose needs is missing."""
    f: dict[str, str] = {}
    model = load_profile()
    cap = prefill_capacity_tok_s()

    def t3(key: str, wl: str) -> dict:
        return next(r for r in data[key] if r["workload"] == wl)

    def row(key: str, label: str) -> dict:
        return next(r for r in data[key] if r["policy"] == label)

    # Table 3
    lp = generate("lpld", 50, 200, seed)
    lp_prompts = sorted(r.prompt_tokens for r in lp)
    f["lp_median"] = f"{lp_prompts[len(lp_prompts) // 2]:,}"
    f["paper_lp_median"] = f"{PAPER_LP_MEDIAN:,}"
    offered = [PAPER_RPS[w] * sum(r.prompt_tokens for r in generate(w, 50, 200, seed)) / len(generate(w, 50, 200, seed))
               / cap for w in ("lpld", "lphd")]
    f["lp_offered"] = num_range(offered, 1) + "×"
    f["lp_matched_ttft_s"] = in_seconds(max(t3("table3-load-matched-paper", w)["ttft_ms"]["p95"] for w in ("lpld", "lphd")))
    b = t3("table3-load-matched-paper", "bursty")
    f["bursty_matched_rps"] = f"{b['rps']:g}"
    f["bursty_exec_s"] = in_seconds(b["ttft_breakdown_p95_ms"]["prefill_exec"])
    f["bursty_ttft_s"] = in_seconds(b["ttft_ms"]["p95"])
    hp_share = [t3("table3-paper", w)["ttft_breakdown_p95_ms"]["prefill_exec"] / t3("table3-paper", w)["ttft_ms"]["p95"]
                for w in ("hpld", "hphd")]
    f["hp_exec_share"] = num_range(hp_share, 0, 100) + " %"
    f["paper_hp_exec_share"] = num_range([PAPER_T3[w][1] / PAPER_T3[w][4] for w in ("hpld", "hphd")], 0, 100) + " %"
    f["bursty_kv_s"] = in_seconds(t3("table3-paper", "bursty")["ttft_breakdown_p95_ms"]["kv_transfer"], 1)
    f["paper_bursty_kv_s"] = f"{PAPER_T3['bursty'][2] / 1000:.1f}"
    f["hp_kv_s"] = num_range([t3("table3-paper", w)["ttft_breakdown_p95_ms"]["kv_transfer"] for w in ("hpld", "hphd")],
                          1, 1 / 1000)
    f["paper_hp_kv_s"] = num_range([PAPER_T3[w][2] for w in ("hpld", "hphd")], 1, 1 / 1000)
    f["rdma_kv_ms"] = num_range([t3("table3-rdma", w)["ttft_breakdown_p95_ms"]["kv_transfer"]
                              for w in ("hpld", "hphd", "bursty")])
    f["dq_ms"] = num_range([r["ttft_breakdown_p95_ms"]["decode_queue"] for r in data["table3-load-matched-paper"]])
    f["paper_dq_ms"] = num_range([v[3] for v in PAPER_T3.values()])
    f["first_step_ms"] = f"{float(model.step_ms(1, 4096, 0, 0.0)):.0f}"
    # Table 4
    for link in LINKS:
        key = f"table4-{link}"
        pd, k = row(key, "pd"), row(key, "kairos (Δh=100 ms)")
        within = [r for r in data[key] if r["tbt_violation_rate"] <= k["tbt_violation_rate"]]
        best = min(within, key=lambda r: r["ttft_ms"]["p95"])
        f[f"t4_best_{link}"] = f"`{best['policy'].split(' (')[0]}`"
        f[f"t4_k_vs_pd_{link}"] = f"{100 * (1 - k['ttft_ms']['p95'] / pd['ttft_ms']['p95']):.0f} %"
        f[f"t4_k_viol_{link}"] = pct(k["tbt_violation_rate"], 2)
    f["paper_oracle_cut"] = f"{100 * (1 - PAPER_T4['oracle'][1] / PAPER_T4['pd'][1]):.0f} %"
    k, o = row("table4-paper", "kairos (Δh=100 ms)"), row("table4-paper", "oracle")
    f["t4_k_ttft_s"], f["t4_oracle_ttft_s"] = in_seconds(k["ttft_ms"]["p95"]), in_seconds(o["ttft_ms"]["p95"])
    v = k["deflected_step_violations"]
    f["t4_k_over"], f["t4_k_joined"] = str(v["over_limit"]), str(v["decode_joined"])
    d = row("table4-paper", "dynamo")
    f["t4_dynamo_viol"], f["t4_dynamo_slo"] = pct(d["tbt_violation_rate"], 1), pct(d["slo_attainment"], 1)
    for lab in ("sq:1", "sl:2048"):
        q, r = row("table4-paper", f"{lab} (queued)"), row("table4-paper", lab)
        tag = lab.replace(":", "")
        f[f"t4_{tag}_defl"], f[f"t4_{tag}_ttft_s"] = str(r["deflections"]), in_seconds(r["ttft_ms"]["p95"])
        f[f"t4_{tag}_q_defl"], f[f"t4_{tag}_q_ttft_s"] = str(q["deflections"]), in_seconds(q["ttft_ms"]["p95"])
        f[f"t4_{tag}_viol"], f[f"t4_{tag}_q_viol"] = pct(r["tbt_violation_rate"], 2), pct(q["tbt_violation_rate"], 2)
    f["paper_sl2048_viol"] = f"{PAPER_T4['sl:2048'][2]} %"
    f["paper_sq1_defl"] = str(PAPER_T4["sq:1"][0])
    t = row("table4-paper", "taichi")
    f["t4_taichi_ttft_s"], f["t4_taichi_viol"] = in_seconds(t["ttft_ms"]["p95"]), pct(t["tbt_violation_rate"], 1)
    f["t4_taichi_slo"], f["t4_pd_ttft_s"] = pct(t["slo_attainment"], 1), in_seconds(row("table4-paper", "pd")["ttft_ms"]["p95"])
    f["pheavy_chunk"] = f"{params.prefill_chunk_tokens:,}"
    # §6
    sw = data["sweep-paper"]
    rates = sorted({r["rps"] for r in sw})
    f["s6_rates"] = f"{rates[0]:g}–{rates[-1]:g}"
    bursty = generate("bursty", 50, 200, seed)
    mean_b = sum(r.prompt_tokens for r in bursty) / len(bursty)
    f["s6_offered"] = f"{rates[0] * mean_b / cap:.1f}–{rates[-1] * mean_b / cap:.1f}×"
    meeting = sorted({r["policy"] for r in sw if (r["ttft_ms"]["p95"] or 0) <= params.ttft_slo_ms
                      and (r["tbt_ms"]["p95"] or 0) <= params.tbt_slo_ms})
    f["s6_meeting"] = ", ".join(f"`{p}`" for p in meeting) if meeting else "none"
    for link in LINKS:
        rows = data[f"sweep-normalized-{link}"]
        best = {p: max_sustainable_rps(rows, p, params) for p in S6_POLICIES}
        f[f"s6n_gain_{link}"] = sustainable_gain(best)
        f[f"s6n_taichi_{link}"] = f"{best['taichi']:g} RPS" if best["taichi"] else "below the lowest swept rate"
        f[f"s6n_pd_{link}"] = f"{best['pd']:g} RPS" if best["pd"] else "below the lowest swept rate"
        diffs = [next(r for r in rows if r["rps"] == x and r["policy"] == "kairos")["tbt_ms"]["p95"]
                 - next(r for r in rows if r["rps"] == x and r["policy"] == "pd")["tbt_ms"]["p95"]
                 for x in sorted({r["rps"] for r in rows})]
        f[f"s6n_tbt_above_{link}"] = num_range(diffs)
        top = max(r["rps"] for r in rows)
        tt = next(r for r in rows if r["rps"] == top and r["policy"] == "taichi")
        f[f"s6n_taichi_top_tbt_{link}"], f["s6n_top"] = num(tt["tbt_ms"]["p95"], 0), f"{top:g}"
    f["paper_gain"] = f"+{PAPER_S6['gain_pct']} %"
    f["paper_tbt_above"] = PAPER_S6["tbt_above_pd_ms"]
    f["paper_defl_low"], f["paper_defl_high"] = (f"more than {PAPER_S6['defl_low'][1]} at {PAPER_S6['defl_low'][0]} RPS",
                                                 f"{PAPER_S6['defl_high'][1]} at {PAPER_S6['defl_high'][0]} RPS")
    lo = next(r for r in sw if r["rps"] == rates[0] and r["policy"] == "kairos")
    hi = next(r for r in sw if r["rps"] == rates[-1] and r["policy"] == "kairos")
    f["s6_defl_low"] = f"{lo['deflections']} ({pct(lo['deflections'] / lo['requests'], 0)} of requests) at {rates[0]:g} RPS"
    f["s6_defl_high"] = f"{hi['deflections']} ({pct(hi['deflections'] / hi['requests'], 0)}) at {rates[-1]:g} RPS"
    # ablation
    ab = [r for r in data["ablation-paper"]]
    r0 = min(r["rps"] for r in ab)
    a = {r["policy"]: r for r in ab if r["rps"] == r0}
    base = a["kairos"]["ttft_ms"]["p95"]
    f["abl_rps"] = f"{r0:g}"
    for lab, key in (("+ projected state", "proj"), ("+ KV-aware TTFT_pf", "kv"), ("kairos+ (all four)", "all"),
                     ("+ node-side guard", "guard")):
        f[f"abl_{key}_ttft"] = f"{100 * (a[lab]['ttft_ms']['p95'] / base - 1):+.1f} %"
        f[f"abl_{key}_over"] = str(a[lab]["deflected_step_violations"]["over_limit"])
        f[f"abl_{key}_defl"] = str(a[lab]["deflections"])
    f["abl_k_over"], f["abl_k_defl"] = str(a["kairos"]["deflected_step_violations"]["over_limit"]), str(a["kairos"]["deflections"])
    # robustness
    rb = data["robustness"]
    noise = sorted({r["noise"] for r in rb})[1]
    betas = sorted({r["beta"] for r in rb})
    pick = {(r["policy"], r["beta"]): r for r in rb if r["noise"] == noise}
    f["rob_noise"], f["rob_beta_hi"], f["rob_beta"] = f"{noise:g}", f"{betas[-1]:g}", f"{betas[0]:g}"
    f["rob_k_viol"], f["rob_k_viol_beta"] = (pct(pick[("kairos", betas[-1])]["tbt_violation_rate"], 2),
                                             pct(pick[("kairos", betas[0])]["tbt_violation_rate"], 2))
    # conversation traces
    for trace in CONV_TRACES:
        c = data["conversation"][trace]
        tag = trace.replace("-", "_")
        first = c["runs"][0]
        f[f"conv_{tag}_rps"] = f"{first['rps']:g} RPS (load {pct(first['utilization'], 0)})"
        f[f"conv_{tag}_more"] = ", ".join(f"{r['rps']:g} RPS ({pct(r['utilization'], 0)})" for r in c["runs"][1:]) \
            or "no higher load"
        f[f"conv_{tag}_n"] = num_range([r["requests"] for r in c["runs"]])
        f[f"conv_{tag}_met"] = f"{sum(r['target_met'] for r in c['runs'])} of {len(c['runs'])}"
    runs = data["conversation"]["mooncake"]["runs"]

    def viol(spec: str) -> str:
        return num_range([next(r for r in run["rows"] if r["policy"] == spec)["tbt_violation_rate"] for run in runs],
                      2, 100) + " %"
    f["conv_taichi_viol"], f["conv_plus_viol"], f["conv_pd_viol"] = viol("taichi"), viol("kairos+"), viol("pd")
    mk_pd = next(r for r in data["conversation"]["mooncake"]["runs"][0]["rows"] if r["policy"] == "pd")
    f["conv_mk_parts"] = ", ".join(f"{k.replace('_', ' ')} {in_seconds(v)} s" for k, v in mk_pd["ttft_breakdown_p95_ms"].items())
    f["conv_utils"] = f"{pct(CONV_UTILS[0], 0)}–{pct(CONV_UTILS[-1], 0)}"
    return f
