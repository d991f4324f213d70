"""The generated blocks of README.md and docs/*.md (see :mod:`tools.docgen.docgen`): one renderer per
block name, each a function of the committed result files (``bench/results/<name>.jsonl``, read
through the ``load`` callable it is given) or of other committed data (the reproduction report's
JSON, a bundled trace, ``examples/snapshot.json``). Renderers only format: every figure in their
output is a field of that data or arithmetic on it; the words around the figures are theirs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.docgen.docgen import ROOT, DocgenError, Result
from tools.docgen.error_codes import error_codes

Load = Callable[[str], Result]

#: the decision-cost targets of issues #2 and #12 (p99 per decision, µs): cluster → budget
DECISION_TARGETS_US = {"8P64D": 200.0, "32P256D": 1000.0}


# ---------------------------------------------------------------- formatting helpers

def num(x: float | None, nd: int = 0) -> str:
    """``x`` with ``nd`` decimals and thousands separators; ``–`` for None."""
    return "–" if x is None else f"{x:,.{nd}f}"


def sig(x: float, digits: int = 2) -> str:
    """``x`` to about ``digits`` significant figures, never in exponent form (13, 4.3, 0.17, 1,100)."""
    if x == 0:
        return "0"
    nd = max(0, digits - 1 - int(f"{abs(x):e}".split("e")[1]))
    return num(round(x, nd), nd)


def us(x: float) -> str:
    """A duration given in µs: ``13 µs``, ``460 µs``, ``4.3 ms``."""
    return f"{sig(x)} µs" if x < 1000 else f"{sig(x / 1000.0)} ms"


def seconds(ms: float, nd: int = 1) -> str:
    """A duration given in ms, in seconds with ``nd`` decimals (``9.4 s``)."""
    return f"{num(ms / 1000.0, nd)} s"


def pct(frac: float | None, nd: int = 0) -> str:
    """A fraction as a percentage (``0.684`` → ``68 %``)."""
    return "–" if frac is None else f"{100.0 * frac:.{nd}f} %"


def command(meta: dict) -> str:
    """The recorded command as a user types it: without the ``.venv/bin/`` prefix and without the
    ``--json PATH`` / ``--no-progress`` the recorder used to collect the rows quietly."""
    cmd = meta.get("command", "")
    cmd = re.sub(r"^timeout \d+ ", "", cmd)
    cmd = re.sub(r"(^|\s)\.venv/bin/", r"\1", cmd)
    cmd = re.sub(r"(^|\s)/(?:root|home/[^/\s]+)/\.cache/", r"\1~/.cache/", cmd)
    cmd = re.sub(r"\s--json\s+\S+", "", cmd)
    cmd = re.sub(r"\s--no-progress\b", "", cmd)
    return cmd


def provenance(r: Result) -> str:
    """``2026-11-30, 2 cores, 1-minute load average 4.0–4.4`` from a result's meta
    (the 1-minute load average before and after the run; '' without meta)."""
    m = r.meta
    if not m:
        return ""
    load = m.get("loadavg_1m", {})
    cores = m.get("machine", {}).get("cpus")
    return (f"{m.get('date', '?')[:10]}, {cores} cores, 1-minute load average "
            f"{span([load.get('start', 0.0), load.get('end', 0.0)], lambda x: f'{x:.1f}')}")


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    """``a–b`` over ``values`` (``a`` alone if they agree once formatted)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


# ---------------------------------------------------------------- README: results

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
    """Simulated vs wall seconds of the two runs against :data:`tools.docgen.reproduction.SPEED_TARGETS` (``sim-bursty``, ``sim-speed-8p32d``)."""
    from tools.docgen.reproduction import SPEED_TARGETS

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


def _bench_module(name: str):
    """``bench/<name>.py`` as a module (its constants: targets the benchmark itself checks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ms(x: float | None) -> str:
    """A latency in ms: one decimal below 100 ms (``9.4 ms``), none above (``127 ms``)."""
    return "–" if x is None else f"{x:.1f} ms" if x < 100 else f"{num(x)} ms"


def _spread(xs: list[float]) -> str:
    """Median of ``xs`` (ms), with the range when there are several: ``2.4 ms (2.1–3.0)``."""
    import statistics

    if not xs:
        return "–"
    if len(xs) == 1:
        return ms(xs[0])
    return f"{ms(statistics.median(xs))} ({min(xs):.1f}–{max(xs):.1f})"


def control_plane(load: Load, name: str = "control-plane") -> str:
    """Rows of ``bench/control_plane.py`` (its JSON lines, saved with or without a meta line); the
    runs of one (dispatchers, rate) — ``--repeat`` — are one table row: medians with their range."""
    import statistics

    cp = _bench_module("control_plane")
    r = load(name)
    groups: dict[tuple, list[dict]] = {}
    for row in r.rows:
        groups.setdefault((row["dispatchers"], row["offered_rps"]), []).append(row)
    runs = max(len(g) for g in groups.values()) if groups else 0
    head = ("| dispatchers | offered req/s | runs | achieved req/s (lowest) | added p50 | added p99 | CPU per request "
            "(median): ingress / dispatchers / agents / aggregator / nats-server / client | load average |")
    lines = [f"Rows of `{command(r.meta) or 'python bench/control_plane.py'}`"
             + (f" ({provenance(r)})" if r.meta else "") + ":"
             + (" medians of the runs of each rate, their range in brackets" if runs > 1 else ""), "", head,
             "|---|---|---|---|---|---|---|---|"]
    kinds = ("ingress", "dispatcher", "agent", "aggregator", "nats", "client")
    for (disp, rate), g in groups.items():
        added = [row.get("added_ms", {}) for row in g]
        cpu = {x: statistics.median(row["cpu_ms_per_request"][x] for row in g) for x in kinds
               if all(x in row.get("cpu_ms_per_request", {}) for row in g)}
        loads = [row["loadavg"] for row in g if row.get("loadavg") is not None]
        lines.append(f"| {disp} | {num(rate)} | {len(g)} | {num(min(row['achieved_rps'] for row in g), 1)} | "
                     f"{_spread([a['p50'] for a in added if a.get('p50') is not None])} | "
                     f"{_spread([a['p99'] for a in added if a.get('p99') is not None])} | "
                     f"{' / '.join(sig(cpu[x]) if x in cpu else '–' for x in kinds)} ms | "
                     + ("–" if not loads else f"{min(loads):.1f}" if min(loads) == max(loads)
                        else f"{min(loads):.1f}–{max(loads):.1f}") + " |")
    n = len(r.rows)
    failed = sum(row.get("failed", 0) for row in r.rows)
    sustained = sum(bool(row.get("sustained")) for row in r.rows)
    p50_ok = sum(row.get("added_ms", {}).get("p50") is not None and row["added_ms"]["p50"] <= cp.TARGET_P50_MS
                 for row in r.rows)
    p99_ok = sum(row.get("added_ms", {}).get("p99") is not None and row["added_ms"]["p99"] <= cp.TARGET_P99_MS
                 for row in r.rows)
    lines += ["", f"{'Nothing failed' if failed == 0 else f'{num(failed)} requests failed'}; {sustained} of {n} runs "
              f"sustained their rate (no failure, ≥ 95 % of the offered rate achieved). The added-latency targets "
              f"(p50 ≤ {cp.TARGET_P50_MS:g} ms, p99 ≤ {cp.TARGET_P99_MS:g} ms) are met for p50 in {p50_ok} and for "
              f"p99 in {p99_ok} of the {n} runs."]
    return "\n".join(lines)


def control_plane_compare(load: Load) -> str:
    """``control-plane-before`` against ``control-plane`` (the same command on the previous
    release's services): per dispatcher count at the highest rate, the added p50 (median and range
    of the runs) and the bus messages per request (in / out of nats-server, median of the runs)."""
    import statistics

    before, now = load("control-plane-before"), load("control-plane")

    def top(r: Result) -> tuple[float, dict[int, list[dict]]]:
        """The highest rate of ``r`` and its rows per dispatcher count."""
        rate = max(row["offered_rps"] for row in r.rows)
        out: dict[int, list[dict]] = {}
        for row in r.rows:
            if row["offered_rps"] == rate:
                out.setdefault(row["dispatchers"], []).append(row)
        return rate, out

    (_, b), (rate, n) = top(before), top(now)

    def msgs(rows: list[dict]) -> str:
        return (f"{statistics.median(row['bus_msgs_per_request']['in'] for row in rows):.1f} / "
                f"{statistics.median(row['bus_msgs_per_request']['out'] for row in rows):.1f}")

    lines = [f"At {num(rate)} req/s, the previous release's services (`control-plane-before`, "
             f"{provenance(before)}) against this release's (`control-plane`, {provenance(now)}):", "",
             "| dispatchers | added p50 before | added p50 now | bus messages per request before (in / out) | now |",
             "|---|---|---|---|---|"]
    for disp in sorted(set(b) & set(n)):
        lines.append(f"| {disp} | {_spread([row['added_ms']['p50'] for row in b[disp]])} | "
                     f"{_spread([row['added_ms']['p50'] for row in n[disp]])} | {msgs(b[disp])} | {msgs(n[disp])} |")
    return "\n".join(lines)


def bus_floor(load: Load) -> str:
    """Rows of ``bench/bus_floor.py``: the bus's own latency for the control-plane benchmark's
    sequence of NATS operations, per variant and rate, against the added-latency target."""
    cp = _bench_module("control_plane")
    r = load("bus-floor")
    lines = [f"Rows of `{command(r.meta) or 'python bench/bus_floor.py'}`" + (f" ({provenance(r)})" if r.meta else "")
             + ":", "", "| variant | offered req/s | p50 | p99 | CPU per request: front / router / worker |",
             "|---|---|---|---|---|"]
    for row in r.rows:
        lat, cpu = row["latency_ms"], row["cpu_ms_per_request"]
        lines.append(f"| `{row['variant']}` | {num(row['offered_rps'])} | {ms(lat['p50'])} | {ms(lat['p99'])} | "
                     f"{' / '.join(sig(cpu[k]) for k in ('front', 'router', 'worker'))} ms |")
    full = [row for row in r.rows if row["variant"] == "kairos"]
    if full:
        top = max(full, key=lambda row: row["offered_rps"])
        share = 100.0 * top["latency_ms"]["p50"] / cp.TARGET_P50_MS
        lines += ["", f"At {num(top['offered_rps'])} req/s the bus operations of a deflected request alone take "
                      f"{ms(top['latency_ms']['p50'])} at the median, {share:.0f} % of the {cp.TARGET_P50_MS:g} ms "
                      f"added-latency target, before any HTTP, policy, tracing, logging or engine work."]
    return "\n".join(lines)


def fidelity(load: Load) -> str:
    """``kairos demo --json`` (live report + ``simulated``): :func:`kairos.cli.demo.side_by_side` and the TTFT targets."""
    from kairos.cli.demo import FIDELITY_TOLERANCE, side_by_side

    r = load("fidelity")
    live = r.rows[0]
    sim = live["simulated"]
    ratios = [live["ttft_ms"][q] / sim["ttft_ms"][q] for q in ("p50", "p95")]
    ok = all(abs(x - 1.0) <= FIDELITY_TOLERANCE for x in ratios)
    return (f"`{command(r.meta)}` (one run: {provenance(r)}); {num(live['completed'])}/{num(live['sent'])} requests "
            f"completed:\n\n```\n{side_by_side(live, sim)}\n```\n\n"
            f"The targets (TTFT P50 and P95 within ±{100 * FIDELITY_TOLERANCE:.0f} % of the simulator's) are "
            f"{'met' if ok else 'not met'} in this run (live / sim {ratios[0]:.2f} at P50, {ratios[1]:.2f} at P95).")


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
    live_viol = _bench_module("vllm_ab").live_step_violations
    for x in r.rows:
        lv, sm = x["live"], x["simulated"]
        gaps = f" ({pct(lv['tbt_gap_violation_rate'], 2)})" if steps else ""
        lines.append(f"| `{x['policy']}` | {seconds(lv['ttft_ms']['p95'])} | {pct(live_viol(lv), 2)}{gaps} | "
                     f"{num(lv['failed'])}/{num(lv['sent'])} | {seconds(sm['ttft_ms']['p95'])} | "
                     f"{pct(sm['tbt_violation_rate'], 2)} |")
    ratios = _bench_module("vllm_ab").ratios(r.rows)
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
        viol = _bench_module("vllm_ab").live_step_violations
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


def bench_example(load: Load) -> str:
    """``kairos bench --json``'s report printed as ``kairos bench`` prints it (:func:`kairos.cli.bench.format_report`)."""
    from kairos.cli.bench import format_report

    r = load("bench-example")
    return f"```\n{format_report(r.rows[0]).rstrip()}\n```\n(one run: {provenance(r)}.)"


def demo_default(load: Load) -> str:
    """`make run`'s workload, counted from the bundled trace (deterministic: computed here)."""
    from kairos.cli.demo import EMULATED_DEMO as D
    from kairos.core.workload.workloads import parse_workload

    wl = parse_workload(D["workload"], D["rps"], D["duration"], 1)
    span_s = wl[-1].arrival_s - wl[0].arrival_s
    return (f"That window (`--workload {D['workload']} --duration {D['duration']:g}`, the demo's defaults) holds "
            f"{num(len(wl))} requests, {sig((len(wl) - 1) / span_s)} per second on average.")


def decide_example(load: Load) -> str:
    """`kairos decide examples/snapshot.json --policy kairos`, abridged (deterministic: computed here)."""
    from kairos.core.model.latency import load_profile
    from kairos.core.policy import PolicyParams
    from kairos.core.policy import parse_policy
    from kairos.core.cluster.snapshot import parse_snapshot

    import msgspec

    snap = parse_snapshot((ROOT / "examples" / "snapshot.json").read_bytes())
    d = msgspec.to_builtins(parse_policy("kairos").decide(snap, load_profile(), PolicyParams()))
    keys = ("request_id", "policy", "decision", "node", "decode_node", "reason", "chunk_schedule",
            "predicted_step_ms", "ttft_prefill_est_ms", "ttft_decode_est_ms")
    missing = [k for k in keys if k not in d]
    if missing:
        raise DocgenError(f"decide output lacks {missing}")

    def val(k: str) -> str:
        v = d[k]
        if k == "predicted_step_ms":
            return "[" + ", ".join(f"{x:.2f}" for x in v[:5]) + (", ...]" if len(v) > 5 else "]")
        if isinstance(v, float):
            return f"{v:.2f}"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{a}": {b:.2f}' for a, b in v.items()) + "}"
        return json.dumps(v)

    body = ",\n".join(f'  "{k}": {val(k)}' for k in keys)
    return f"```\n{{\n{body},\n  ...\n}}\n```\n(abridged: the real output is the full indented JSON with unrounded floats.)"


# ---------------------------------------------------------------- docs/vllm.md

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


# ---------------------------------------------------------------- docs/policies.md

def model_error_table(load: Load) -> str:
    """The model-error rows of docs/results/paper-reproduction.json (``python -m tools.docgen.reproduction``)."""
    rows = _reproduction()["model-error"]

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


# ---------------------------------------------------------------- docs/security.md

def slow_clients(load: Load) -> str:
    """``bench/slow_clients.py``: when the ingress closed slow-header connections (s)."""
    r = load("slow-clients")
    x = r.rows[0]
    return (f"Measured (`{command(r.meta)}`; one run: {provenance(r)}): {num(x['connections'])} connections that send a "
            f"request line and one header and then nothing are {'all' if x['closed'] == x['connections'] else 'not all'} "
            f"closed by the ingress, between {x['first_closed_s']:.2f} s and {x['last_closed_s']:.2f} s after they "
            f"connected (`KAIROS_HEADER_TIMEOUT_S` {x['header_timeout_s']:g}), and counted "
            f"(`kairos_ingress_slow_clients_dropped_total` {num(x['dropped_counter'])}).")


# ---------------------------------------------------------------- README / docs/bus.md: NATS cluster

def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"`{k}` {num(v)}" for k, v in sorted(codes.items(), key=lambda kv: -kv[1]))


def nats_cluster_failover(load: Load) -> str:
    """``tests/faults/test_nats_cluster.py``: a 3-server cluster under streaming load, every member
    SIGKILLed in turn (result ``nats-cluster-failover``, its last row)."""
    r = load("nats-cluster-failover")
    if not r.rows:
        raise DocgenError("nats-cluster-failover: no rows")
    x = r.rows[-1]
    errs = f" ({_codes(x['error_codes'])})" if x["error_codes"] else ""
    back = span(x["member_back_s"], lambda v: f"{v:.1f}")
    return (f"Measured (`{command(r.meta)}`; one run: {provenance(r)}): {num(x['servers'])} nats-servers, "
            f"{x['rate_rps']:g} streaming requests per second offered ({x['achieved_rps']:g} per second sent), "
            f"{num(x['kills'])} SIGKILLs — {num(x['meta_leader_kills'])} of them of the JetStream meta leader, "
            f"{num(x['req_leader_kills'])} of the member holding request lane 0 (one server may be both; every "
            f"member holds a lane and a claim bucket) — each member restarted and current "
            f"again {back} s after its kill. Of {num(x['sent'])} requests: {num(x['completed'])} completed with "
            f"exactly the expected text, {num(x['failed'])} ended with an explicit error{errs}, "
            f"{num(x['streams_cut'])} of them after their first token (streams cut); {num(x['lost'])} lost (hung "
            f"or no error), {num(x['duplicated'])} executed twice, {num(x['wrong_text'])} with wrong text"
            + (f"; {num(x['lane_moves'])} queued on a dead member's lane and enqueued again on another" if "lane_moves" in x
               else "") + ". "
            f"p99 TTFT {x['p99_ttft_steady_s']:.2f} s before the first kill, {x['p99_ttft_failover_s']:.2f} s "
            f"(max {x['max_ttft_failover_s']:.2f} s) for the requests sent within "
            f"{x['failover_window_s']:g} s after a kill: "
            f"{x['p99_ttft_failover_s'] - x['p99_ttft_steady_s']:+.2f} s (target: at most +2 s).")


def mutation(load: Load) -> str:
    """``bench/mutation.py`` (``make mutation``): mutants of each safety-critical module by outcome."""
    r = load("mutation")
    lines = ["| module | mutants | killed | timeout | survived | of them listed equivalent | score |",
             "|---|---|---|---|---|---|---|"]
    for x in r.rows:
        undetected = x["survived"] + x["no_tests"] + x["other"]
        lines.append(f"| `{x['module']}` | {num(x['mutants'])} | {num(x['killed'])} | {num(x['timeout'])} | "
                     f"{num(undetected)} | {num(x['equivalent'])} | {pct(x['score'], 1)} |")
    total = sum(x["mutants"] for x in r.rows)
    killed = sum(x["killed"] + x["timeout"] for x in r.rows)
    return (f"`make mutation` (`{command(r.meta)}`; {provenance(r)}; {num(total)} mutants in "
            f"{seconds(r.meta['wall_s'] * 1000.0, 0)}, {pct(killed / total, 1)} of them killed or timed out). "
            f"Score: (killed + timeout) ÷ (mutants − listed equivalents):\n\n" + "\n".join(lines))


def compose_smoke(load: Load) -> str:
    """``make compose-smoke`` (``ops/compose-smoke/smoke.py``): step times and the burst's outcome."""
    r = load("compose-smoke")
    x = r.rows[-1]
    t = x["times_s"]
    fresh = [what for what, done in (("installed Docker and Compose", x.get("installed_tools")),
                                     ("made the base image", x.get("built_base_image")),
                                     ("started dockerd", x.get("started_dockerd"))) if done]
    steps = ", ".join(f"{name} {seconds(v * 1000.0, 0)}" for name, v in t.items())
    errs = f" ({_codes(x['errors'])})" if x["errors"] else ""
    return (f"`{command(r.meta)}` ({provenance(r)}; {seconds(r.meta['wall_s'] * 1000.0, 0)} in all"
            + (f"; this run {', '.join(fresh)}" if fresh else "") + f"). Steps: {steps}. "
            f"Of {num(x['sent'])} streaming requests {num(x['completed'])} completed and {num(x['failed'])} failed{errs}, "
            f"{num(x['deflections'])} deflected; TTFT p50 {seconds(x['ttft_ms']['p50'])}, p99 {seconds(x['ttft_ms']['p99'])}; "
            f"{' and '.join(f'`{k}`' for k in x['killed'])} SIGKILLed mid-burst and restarted by Docker "
            f"({', '.join(f'{k}: {num(v)}' for k, v in x['restarts'].items())} restarts)"
            + (f"; failed checks: {'; '.join(x['failed_checks'])}" if x["failed_checks"] else "; every check passed") + ".")


# ---------------------------------------------------------------- docs/calibration.md

def _reproduction() -> dict[str, Any]:
    return json.loads((ROOT / "docs" / "results" / "paper-reproduction.json").read_text())


def calibration_link(load: Load) -> str:
    """The PD baseline's P95 KV-transfer time on Bursty 4 RPS per link, from the reproduction report."""
    data = _reproduction()

    def kv(link: str) -> float:
        rows = [r for r in data[f"table4-{link}"] if r["policy"] == "pd"]
        if len(rows) != 1:
            raise DocgenError(f"paper-reproduction.json table4-{link}: {len(rows)} pd rows")
        return rows[0]["ttft_breakdown_p95_ms"]["kv_transfer"]

    return (f"The paper-calibrated link (one transfer at a time per prefill→decode link) puts the PD baseline's P95 "
            f"KV-transfer time on Bursty at 4 RPS at {seconds(kv('paper'))} in the simulator, in the range of "
            f"Table 3's (see docs/results/paper-reproduction.md, `python -m tools.docgen.reproduction`); the RDMA-class link "
            f"gives {num(kv('rdma'))} ms.")


def profile_fit(load: Load, name: str) -> str:
    """Block ``profile-fit.<name>``: what the fitted artifact ``kairos/core/data/profiles/<name>.json`` records about
    its own fit (``kairos profile``'s provenance): held-out MAPE per model and the worst grid region (%),
    steps and seconds profiled, rejected outliers, engine and hardware."""
    path = ROOT / "kairos" / "core" / "data" / "profiles" / f"{name}.json"
    if not path.is_file():
        raise DocgenError(f"profile-fit.{name}: no {path.relative_to(ROOT)}")
    art = json.loads(path.read_text())
    meta = art.get("metadata", {})
    fit = meta.get("fit")
    if not fit:
        raise DocgenError(f"profile-fit.{name}: {path.name} records no fit (a calibration, not a measurement?)")
    worst_model, worst_region, worst = max(((m, reg, v["mape"]) for m, regs in fit["mape_regions"].items()
                                            for reg, v in regs.items()), key=lambda x: x[2])
    hw = meta.get("hardware", {})
    return (f"`{name}` ({meta.get('engine', '?')}, model {meta.get('model', '?')}, {hw.get('cores', '?')} cores "
            f"{hw.get('cpu', '')}, {meta.get('date', '?')[:10]}): held-out MAPE {art['prefill']['mape_heldout']:.1f} % "
            f"(prefill), {art['decode']['mape_heldout']:.1f} % (decode), {art['mixed_delta']['mape_heldout']:.1f} % "
            f"(mixed), per grid region up to {worst:.1f} % ({worst_model} steps with {worst_region}); "
            f"{num(meta.get('steps_recorded', 0))} steps in {meta.get('duration_s', 0):.0f} s, "
            f"{num(fit['rejected']['outlier'])} rejected as outliers{_load(meta)}.{_spread_and_predictions(path, meta)}")


def _load(meta: dict) -> str:
    """`` at load average B–A`` (1-minute, before and after the run) when the artifact records it."""
    la = meta.get("load_average") or {}
    before, after = (la.get("before") or [None])[0], (la.get("after") or [None])[0]
    return "" if before is None or after is None else f", load average {before:.1f} before and {after:.1f} after"


def _spread_and_predictions(path: Path, meta: dict) -> str:
    """The decode-step spread the artifact measured (its noise floor) and what its model predicts
    for a few steps (``LatencyModel.step_ms``, K = 600 tokens per decode; computed here)."""
    from kairos.core.model.latency import load_profile

    out = ""
    spread = meta.get("decode_spread")
    if spread:
        out += (f" Decode-only steps lie {spread['mape']:.1f} % (MAPE) from the median of the steps with the same "
                f"batch size ({num(spread['steps'])} steps, {num(spread['batch_sizes'])} batch sizes): the noise "
                f"floor no model of B and K can beat.")
    m = load_profile(str(path))

    def t(b: int, p: int) -> str:
        return f"{m.step_ms(b, 600 * b, p, 0.0):.1f}"

    return out + (f" It predicts decode-only B = 1 / 8 / 32 → {t(1, 0)} / {t(8, 0)} / {t(32, 0)} ms (K = 600 "
                  f"tokens per decode), a 512-token prefill alone {t(0, 512)} ms, a 512-token chunk with "
                  f"B = 1 / 8 / 32 decodes {t(1, 512)} / {t(8, 512)} / {t(32, 512)} ms.")


def emulated_cpu_fit(load: Load) -> str:
    """What the committed `emulated-cpu` artifact's own metadata says about its fit, and how its
    coefficients compare with the `a100-dsv2lite` calibration it emulated."""
    art = json.loads((ROOT / "kairos" / "core" / "data" / "profiles" / "emulated-cpu.json").read_text())
    ref = json.loads((ROOT / "kairos" / "core" / "data" / "profiles" / "a100-dsv2lite.json").read_text())
    meta, fit = art["metadata"], art["metadata"]["fit"]
    worst_model, worst_region, worst = max(((m, reg, v["mape"]) for m, regs in fit["mape_regions"].items()
                                            for reg, v in regs.items()), key=lambda x: x[2])

    def dev(a: float, b: float) -> float:
        return 100.0 * (a / b - 1.0)

    intercepts = {m: dev(art[m]["intercept_ms"], ref[m]["intercept_ms"]) for m in ("prefill", "decode")}
    slopes = {f"{m} `{f}`": dev(a, b) for m in ("prefill", "decode", "mixed_delta")
              for f, a, b in zip(art[m]["features"], art[m]["coef"], ref[m]["coef"])}
    big = {k: v for k, v in slopes.items() if abs(v) >= 5.0}
    small = max(abs(v) for k, v in slopes.items() if k not in big)
    return (f"What it shows: the profiler and the fit recover a node's step times through the whole bus path "
            f"with held-out MAPE of {art['prefill']['mape_heldout']:.2f} % (prefill), "
            f"{art['decode']['mape_heldout']:.2f} % (decode) and {art['mixed_delta']['mape_heldout']:.2f} % (mixed), "
            f"per grid region up to {worst:.2f} % ({worst_model} steps with {worst_region}), from "
            f"{num(meta['steps_recorded'])} steps in {meta['duration_s']:.0f} s; "
            f"{num(fit['rejected']['outlier'])} training steps were rejected as outliers (late wake-ups). Against "
            f"`a100-dsv2lite`'s coefficients: intercepts prefill {intercepts['prefill']:+.1f} %, decode "
            f"{intercepts['decode']:+.1f} % (the event-loop lateness added to every step); every other coefficient "
            f"within ±{small:.1f} %"
            + "".join(f", except {k} ({v:+.0f} %, from {num(fit['samples']['prefill'])} prefill-only steps)"
                      if k.startswith("prefill") else f", except {k} ({v:+.0f} %)" for k, v in big.items())
            + " — as they should be for the emulated engine (its metadata records all of this).")


#: block name prefix → renderer of the blocks ``<prefix>.<argument>`` (takes the loader and the argument)
PARAM_RENDERERS: dict[str, Callable[[Load, str], str]] = {
    "profile-fit": profile_fit,
}

#: block name → renderer (takes the result loader, returns markdown)
RENDERERS: dict[str, Callable[[Load], str]] = {
    "error-codes": error_codes,
    "sim-bursty": sim_bursty,
    "sim-speed": sim_speed,
    "sim-mooncake": sim_mooncake,
    "prefix-index": prefix_index,
    "decision-cost": decision_cost,
    "control-plane": control_plane,
    "bus-floor": bus_floor,
    "control-plane-compare": control_plane_compare,
    "control-plane-traced": lambda load: control_plane(load, "control-plane-traced"),
    "fidelity": fidelity,
    "bench-example": bench_example,
    "demo-default": demo_default,
    "decide-example": decide_example,
    "model-error": model_error_table,
    "calibration-link": calibration_link,
    "emulated-cpu-fit": emulated_cpu_fit,
    "slow-clients": slow_clients,
    "nats-cluster-failover": nats_cluster_failover,
    "vllm-step-times": vllm_step_times,
    "vllm-demo": vllm_demo,
    "vllm-pd-rate": vllm_pd_rate,
    "vllm-ab": vllm_ab,
    "vllm-headroom": vllm_headroom,
    "mutation": mutation,
    "compose-smoke": compose_smoke,
}
