"""Blocks of the control plane's cost (docs/results.md): ``bench/control_plane.py`` (the whole stack
at open-loop rates: added latency, CPU and bus messages per request), the same against the previous
release, and ``bench/bus_floor.py`` (the bus's own latency for the same sequence of operations).
The targets come from the benchmark itself (``bench/control_plane.py``: ``TARGET_P50_MS``,
``TARGET_P99_MS``).
"""

from __future__ import annotations

import statistics

from tools.docgen.fmt import command, ms, num, provenance, sig
from tools.docgen.results import Load, Result, bench_module


def _spread(xs: list[float]) -> str:
    """Median of ``xs`` (ms), with the range when there are several: ``2.4 ms (2.1–3.0)``."""
    if not xs:
        return "–"
    if len(xs) == 1:
        return ms(xs[0])
    return f"{ms(statistics.median(xs))} ({min(xs):.1f}–{max(xs):.1f})"


def control_plane(load: Load, name: str = "control-plane") -> str:
    """Rows of ``bench/control_plane.py`` (its JSON lines, saved with or without a meta line); the
    runs of one (dispatchers, rate) — ``--repeat`` — are one table row: medians with their range."""
    cp = bench_module("control_plane")
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
    cp = bench_module("control_plane")
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


def bus_routes(load: Load) -> str:
    """Rows of ``bench/bus_floor.py`` run for issue 34's choice of a request path without JetStream:
    per variant its sequential passes (``bench/bus_floor.py`` ``PASSES``), latency and the CPU per
    request of every process, nats-server included; then the chosen route against ``kairos``."""
    r = load("bus-floor-routes")
    lines = [f"Rows of `{command(r.meta) or 'python bench/bus_floor.py'}`" + (f" ({provenance(r)})" if r.meta else "")
             + ":", "", "| variant | passes before the engine / the relay | p50 | p99 | CPU per request: "
             "front / router / worker / nats-server | total CPU |", "|---|---|---|---|---|---|"]
    for row in r.rows:
        lat, cpu, p = row["latency_ms"], row["cpu_ms_per_request"], row["passes"]
        lines.append(f"| `{row['variant']}` | {p['engine']} / {p['relay']} | {ms(lat['p50'])} | {ms(lat['p99'])} | "
                     f"{' / '.join(sig(cpu[k]) for k in ('front', 'router', 'worker', 'nats'))} ms | "
                     f"{sig(cpu['total'])} ms |")
    by = {row["variant"]: row for row in r.rows}
    if "arbiter" in by and "kairos" in by:
        a, k = by["arbiter"], by["kairos"]
        lines += ["", f"`arbiter` against `kairos`, same run: latency p50 ×"
                      f"{a['latency_ms']['p50'] / k['latency_ms']['p50']:.2f}, CPU per request ×"
                      f"{a['cpu_ms_per_request']['total'] / k['cpu_ms_per_request']['total']:.2f} "
                      f"(nats-server ×{a['cpu_ms_per_request']['nats'] / k['cpu_ms_per_request']['nats']:.2f})."]
    return "\n".join(lines)
