"""Blocks that show a command's own output (docs/cli.md, docs/results.md, README.md): ``kairos demo``
(its live-vs-simulator table), ``kairos bench``'s report, ``make run``'s workload and ``kairos
decide``'s answer for ``examples/snapshot.json``. The command's own formatter prints each, so the
docs show exactly what the user sees.
"""

from __future__ import annotations

import json

from tools.docgen.fmt import command, num, provenance, sig
from tools.docgen.results import ROOT, DocgenError, Load


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
