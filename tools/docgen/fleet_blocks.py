"""Block of ``bench/fleet.py`` (docs/results.md, "Control plane at fleet scale"): the real aggregator,
dispatchers and ingress under the bus traffic of 2P2D … 32P256D node agents at a fixed rate. The costs,
their growth and the targets come from the benchmark itself (``COSTS``, ``growth_table``, ``targets``)."""

from __future__ import annotations

from tools.docgen.fmt import MISSING, num, one_run
from tools.docgen.results import DocgenError, Load, bench_module


def _g(x: float | None) -> str:
    return MISSING if x is None else f"{x:g}"


def fleet(load: Load) -> str:
    """One column per size, one row per cost, its growth first size → last; the targets at the last size."""
    fl = bench_module("fleet")
    r = load("fleet")
    rows = r.rows
    g = fl.growth_table(rows)
    sizes = [row["size"] for row in rows]
    lines = [f"Rows of {one_run(r)}; {num(rows[0]['offered_rps'])} req/s for {num(rows[0]['duration_s'])} s per "
             "size (decision and view-age percentiles interpolated in the dispatchers' histogram buckets):", "",
             "| cost | " + " | ".join(sizes) + f" | growth {sizes[0]} → {sizes[-1]} |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for k, f in fl.COSTS.items():
        lines.append(f"| {k} | " + " | ".join(_g(f(row)) for row in rows) + f" | ×{_g(g[k])} |")
    floors = [row.get("bus_floor_ms") for row in rows]
    if all(floors):
        for q in ("p50", "p99"):
            lines.append(f"| bus floor {q} ms: the bare NATS operations of one request, same rate, just before | "
                         + " | ".join(_g(fl_[q]) for fl_ in floors) + " | |")
    if all("cpu_split_pct" in row for row in rows):
        for part, label in (("harness", "harness CPU (fleet + client), % of one core"),
                            ("control_plane", "control plane CPU (nats-server, aggregator, dispatchers, ingress), % of one core")):
            lines.append(f"| {label} | " + " | ".join(_g(row["cpu_split_pct"][part]) for row in rows) + " | |")
    lines.append("| CPU of all its processes, % of one core | " + " | ".join(
        _g(round(sum(v for v in row["cpu_pct"].values() if v is not None), 1)) for row in rows) + " | |")
    lines.append("| CPU pressure: share of the run some process waited for a core, % | "
                 + " | ".join(_g(row.get("cpu_pressure_pct")) for row in rows) + " | |")
    lines.append("| failed requests | " + " | ".join(num(row["failed"]) for row in rows) + " | |")
    lines.append("| decisions on a view older than 3 heartbeats | "
                 + " | ".join(num(row["state_age_ms"]["over_3_periods"]) for row in rows) + " | |")
    fastest = max((k for k in g if g[k] is not None), key=lambda k: g[k])
    met = fl.targets(rows[-1])
    last = rows[-1]
    lines += ["", f"Fastest-growing cost: {fastest} (×{_g(g[fastest])}). Targets at {last['size']} "
              f"(added p50 ≤ {_g(fl.TARGET_P50_MS)} ms: {'met' if met['added_p50'] else 'missed'}; "
              f"p99 ≤ {_g(fl.TARGET_P99_MS)} ms: {'met' if met['added_p99'] else 'missed'}; no decision on a view "
              f"older than {fl.STALE_PERIODS} heartbeat periods: {'met' if met['view_age'] else 'missed'}; "
              f"0 failed: {'met' if met['no_failures'] else 'missed'})."]
    if all(floors):
        first = rows[0]
        lines += ["", f"The bus floor on this machine at {num(first['offered_rps'])} req/s was "
                  f"{_g(floors[0]['p50'])} ms at the median before {first['size']} "
                  f"({_g(round(100.0 * floors[0]['p50'] / fl.TARGET_P50_MS))} % of the {_g(fl.TARGET_P50_MS)} ms "
                  f"target) and {_g(floors[-1]['p50'])} ms before {last['size']}: that much of the added latency "
                  "is NATS and the cores themselves, before any HTTP, policy, logging or engine work."]
    return "\n".join(lines)


#: the processes issue 34 counts as the control plane (bench/fleet.py ``cpu_split``'s, by name)
CONTROL_PLANE = ("nats", "aggregator", "dispatcher", "ingress")


#: issue 34's steps, in order: (what changed, the ``bench/fleet.py`` result measured after it, right
#: after ``fleet-before-34`` on the same machine: a ratio across sessions measures the machine's mood)
REQUEST_PATH_STEPS = (("step 2: the ingress sends every job, no execution claims", "fleet-34-step2"),)


def request_path(load: Load) -> str:
    """Issue 34's progress: ``bench/fleet.py`` before the change (``fleet-before-34``) and after each of
    its steps (:data:`REQUEST_PATH_STEPS`, those recorded): per size and step the control plane's CPU
    per request and share of a core, the added latency against the bus floor measured just before it
    in the same run, and the ratios to the issue's targets."""
    before = load("fleet-before-34")
    steps = []
    for label, name in REQUEST_PATH_STEPS:
        try:
            steps.append((label, load(name)))
        except DocgenError:
            if not steps:
                raise
    by = {row["size"]: row for row in before.rows}
    lines = [f"Before: {one_run(before)}."] + [f"After {label}: {one_run(r)}." for label, r in steps]
    lines += ["", "| size | after | control-plane CPU ms per request, before → after | ratio (target ≤ 0.5 at 2P2D) | "
              "control plane % of a core, before → after (target ≤ 60 at 32P256D) | added p50 ms, before → after "
              "| after ÷ its bus floor p50, measured just before (bench/bus_floor.py variant) (target ≤ 1.5) | failed |", "|---|---|---|---|---|---|---|---|"]
    for size in by:
        b = by[size]
        for label, r in steps:
            a = next((row for row in r.rows if row["size"] == size), None)
            if a is None:
                continue
            step = label.split(":")[0]
            cb, ca = _cp_ms(b), _cp_ms(a)
            floor = (a.get("bus_floor_ms") or {}).get("p50")
            lines.append(f"| {size} | {step} | {cb:.2f} → {ca:.2f} | ×{ca / cb:.2f} | "
                         f"{_g(b['cpu_split_pct']['control_plane'])} → {_g(a['cpu_split_pct']['control_plane'])} | "
                         f"{_g(b['added_ms']['p50'])} → {_g(a['added_ms']['p50'])} | "
                         + (f"×{a['added_ms']['p50'] / floor:.2f} of {_g(floor)} ms"
                            f" ({(a.get('bus_floor_ms') or {}).get('variant', 'kairos')})" if floor else "") +
                         f" | {num(b['failed'])} → {num(a['failed'])} |")
    lines += ["", _request_path_targets(by, steps[-1][1])]
    return "\n".join(lines)


def _cp_ms(row: dict) -> float:
    """The control plane's CPU ms per request in one ``bench/fleet.py`` row."""
    return sum(row["cpu_ms_per_request"][k] or 0.0 for k in CONTROL_PLANE)


def _request_path_targets(before: dict[str, dict], last) -> str:
    """Issue 34's three ratio targets at the last step, each met or missed (from the rows alone)."""
    after = {row["size"]: row for row in last.rows}
    parts = []
    if "2P2D" in before and "2P2D" in after:
        b, a = before["2P2D"], after["2P2D"]
        ratio = _cp_ms(a) / _cp_ms(b)
        parts.append(f"CPU per request at 2P2D ×{ratio:.2f} of before (≤ 0.5: {'met' if ratio <= 0.5 else 'missed'})")
        floor = (a.get("bus_floor_ms") or {}).get("p50")
        if floor and a["added_ms"]["p50"] is not None:
            x = a["added_ms"]["p50"] / floor
            parts.append(f"added p50 ×{x:.2f} of the bus floor (≤ 1.5: {'met' if x <= 1.5 else 'missed'})")
    big = after.get("32P256D")
    if big is not None:
        pct = big["cpu_split_pct"]["control_plane"]
        parts.append(f"control plane at 32P256D {_g(pct)} % of a core (≤ 60: {'met' if pct <= 60 else 'missed'})")
    return "Targets, last step: " + "; ".join(parts) + "." if parts else ""
