"""Experiment runners over the simulator: one (policy, rps) row, RPS sweeps and their plots.

Rows are the JSON objects of ``kairos sim --json`` (keys listed in :func:`run_one`); the same
``kairos.core.workload.serving_metrics.summarize`` computes the live ``kairos bench`` results.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kairos.core.model.latency import LatencyModel
from kairos.core.workload.serving_metrics import summarize
from kairos.core.policy import Policy
from kairos.core.policy import PolicyParams
from kairos.core.workload.workloads import WorkloadRequest
from kairos.sim.results import SimResult
from kairos.sim.simulator import SimConfig, Simulator


def violation_attribution(result: SimResult, limit_ms: float) -> dict[str, int]:
    """Count deflected-prefill steps over β·τ, split by cause (§7 stale-state limitation).

    ``decode_joined``: a decode that was not running on the node at the decision is in the step;
    ``other``: no decode joined (model error, noise, or KV growth of the running decodes).
    """
    out = {"deflected_steps": len(result.deflected_steps), "over_limit": 0, "decode_joined": 0, "other": 0}
    for s in result.deflected_steps:
        if s.actual_ms > limit_ms:
            out["over_limit"] += 1
            out["decode_joined" if s.decode_joined else "other"] += 1
    return out


def drift_violations(result: SimResult, node: int, at_ms: float, limit_ms: float,
                     settle_s: float = 30.0) -> dict[str, Any]:
    """TBT violations on decode node ``node`` (index) around a drift starting at ``at_ms``.

    Returns the rate of its decode steps over ``limit_ms`` before the drift, in the first
    ``settle_s`` after it and from then on (fractions of that node's steps in the interval, None
    without steps), and ``last_violation_after_s``: seconds from the drift to the last over-limit
    step on the node (0 when there is none after the drift).
    """
    before, first, after = [0, 0], [0, 0], [0, 0]
    last = 0.0
    settle_ms = at_ms + settle_s * 1000.0
    for ms, (t, i) in zip(result.decode_step_ms, result.decode_step_at):
        if i != node:
            continue
        bucket = before if t < at_ms else first if t < settle_ms else after
        bucket[1] += 1
        if ms > limit_ms:
            bucket[0] += 1
            if t >= at_ms:
                last = max(last, (t - at_ms) / 1000.0)

    def rate(b: list[int]) -> float | None:
        return b[0] / b[1] if b[1] else None

    return {"node": node, "at_s": at_ms / 1000.0, "settle_s": settle_s, "rate_before": rate(before),
            "rate_first_settle": rate(first), "rate_after_settle": rate(after), "steps_after_settle": after[1],
            "last_violation_after_s": round(last, 3)}


def run_one(workload: Sequence[WorkloadRequest], policy: Policy, model: LatencyModel, params: PolicyParams,
            cfg: SimConfig, rps: float | None = None, label: str | None = None) -> dict[str, Any]:
    """Simulate one policy on one workload and summarize.

    Returns the row: ``policy``, ``rps``, ``requests``, ``ttft_ms`` {p50,p95,p99},
    ``ttft_breakdown_p95_ms`` {prefill_queue, prefill_exec, kv_transfer, decode_queue}, ``tbt_ms``
    {p50,p95}, ``tbt_violation_rate`` (decode steps > τ), ``slo_attainment``, ``deflections``,
    throughput, ``sim_seconds``, ``wall_seconds``, ``speedup`` (sim s per wall s),
    ``deflected_step_violations`` (see :func:`violation_attribution`) and, when a decode node
    drifts, ``drift`` (see :func:`drift_violations`).
    """
    t0 = time.perf_counter()
    res = Simulator(cfg, model, policy, params).run(workload)
    wall = time.perf_counter() - t0
    pp = policy.params(params)
    row = summarize(res.records, tbt_slo_ms=pp.tbt_slo_ms, ttft_slo_ms=pp.ttft_slo_ms,
                    decode_step_ms=res.decode_step_ms)
    row["deflections"] = res.deflections
    row = {"policy": label or policy.spec, "rps": rps, **row, "sim_seconds": round(res.sim_seconds, 3),
           "wall_seconds": round(wall, 3), "speedup": round(res.sim_seconds / wall, 1) if wall > 0 else None,
           "deflected_step_violations": violation_attribution(res, pp.step_limit_ms)}
    if cfg.drift_node is not None and cfg.drift_node.startswith("decode-"):
        row["drift"] = drift_violations(res, int(cfg.drift_node.split("-")[1]), cfg.drift_at_s * 1000.0,
                                        pp.tbt_slo_ms)
    return row


def parse_range(spec: str) -> list[float]:
    """``"6:12:1"`` → [6, 7, ..., 12] (inclusive). Raises ValueError naming the problem."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"range {spec!r} must be START:STOP[:STEP]")
    start, stop = float(parts[0]), float(parts[1])
    step = float(parts[2]) if len(parts) == 3 else 1.0
    if step <= 0 or stop < start or start <= 0:
        raise ValueError(f"range {spec!r}: need 0 < START <= STOP and STEP > 0")
    n = int(round((stop - start) / step)) + 1
    return [round(start + i * step, 6) for i in range(n)]


def sweep(make_workload: Callable[[float], Sequence[WorkloadRequest]], rates: Sequence[float],
          policies: Sequence[Policy], model: LatencyModel, params: PolicyParams, cfg: SimConfig,
          progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every policy at every rate (same workload per rate for every policy)."""
    rows = []
    for rps in rates:
        wl = make_workload(rps)
        for pol in policies:
            rows.append(run_one(wl, pol, model, params, cfg, rps=rps))
            if progress:
                progress(f"{pol.spec} @ {rps:g} rps")
    return rows


def sweep_title(workload: str, duration_s: float, n_prefill: int, n_decode: int, profile: str,
                link: str | None = None, seed: int | None = None) -> str:
    """The title every sweep plot carries: what was simulated (workload, duration in s, cluster,
    latency profile, KV link, seed)."""
    parts = [workload, f"{duration_s:g} s", f"{n_prefill}P{n_decode}D", f"profile {profile}"]
    if link:
        parts.append(f"link {link}")
    if seed is not None:
        parts.append(f"seed {seed}")
    return ", ".join(parts)


def plot_sweep(rows: Sequence[dict[str, Any]], out_dir: str | Path, params: PolicyParams,
               prefix: str = "sweep", title: str = "") -> list[Path]:
    """Write PNG plots (P95 TTFT, P95 TBT, SLO attainment, deflections vs RPS; one line per policy,
    SLO lines drawn), each titled ``title`` (see :func:`sweep_title`). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    panels = [
        ("ttft_p95", "P95 TTFT (s)", lambda r: (r["ttft_ms"]["p95"] or 0) / 1000, params.ttft_slo_ms / 1000),
        ("tbt_p95", "P95 TBT (ms)", lambda r: r["tbt_ms"]["p95"] or 0, params.tbt_slo_ms),
        ("slo_attainment", "SLO attainment (%)", lambda r: 100 * r["slo_attainment"], None),
        ("deflections", "deflections", lambda r: r["deflections"], None),
    ]
    paths = []
    for key, ylabel, get, slo in panels:
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
        for pol in policies:
            pts = sorted((r["rps"], get(r)) for r in rows if r["policy"] == pol)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", linewidth=1, label="SLO")
        if title:
            ax.set_title(title, fontsize=8)
        ax.set_xlabel("request rate (RPS)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{prefix}-{key}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def max_sustainable_rps(rows: Sequence[dict[str, Any]], policy: str, params: PolicyParams) -> float | None:
    """Highest swept RPS at which ``policy`` meets both SLOs (P95 TTFT ≤ TTFT SLO and P95 TBT ≤ τ),
    with every lower swept rate meeting them too. None if even the lowest fails."""
    best = None
    for r in sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rps"]):
        ok = (r["ttft_ms"]["p95"] or 0) <= params.ttft_slo_ms and (r["tbt_ms"]["p95"] or 0) <= params.tbt_slo_ms
        if not ok:
            break
        best = r["rps"]
    return best
