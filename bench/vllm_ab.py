"""The paper's effect on real engines: ``pd``, ``kairos`` and ``kairos+`` on the vLLM-CPU testbed.

    python bench/vllm_ab.py [--policies pd,kairos,kairos+] [--rps 1.0] [--duration 60] [--seed 1]
                            [--out bench/results/vllm-ab.jsonl]

Each policy gets a fresh ``kairos up --engine vllm`` stack exactly as ``kairos demo --engine vllm``
builds it (1P1D on the CPU testbed: the ``testbed`` model, the ``cpu-testbed-vllm`` profile, the
demo's SLOs) and the same seeded Bursty workload, replayed by ``kairos bench``'s client; beside
each live run the simulator runs the same workload and policy (``kairos sim``). It prints, and
writes as one JSON line per policy after a provenance line, the live and simulated P95 TTFT, TBT
violations (% of decode steps / inter-token gaps above τ) and failures, and the ratios
``kairos ÷ pd`` of P95 TTFT measured live and predicted by the simulator, from the same run.
The docs/results.md block ``vllm-ab`` is rendered from the file (``python -m tools.docgen``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kairos.cli.demo import VLLM_AB_RPS, VLLM_DEMO, bench_live, simulate_same, vllm_testbed_options  # noqa: E402
from tools.docgen.docgen import result_meta, write_result  # noqa: E402
from kairos.engines.vllm.launch import cached_tiny_model  # noqa: E402
from kairos.cli.up import Supervisor  # noqa: E402

KEYS = ("sent", "completed", "failed", "deflections", "ttft_ms", "tbt_ms", "tbt_violation_rate",
        "tbt_gap_violation_rate", "engine_tbt_violation_rate", "slo_attainment", "ttft_breakdown_p95_ms")


def live_step_violations(live: dict) -> float | None:
    """The live run's TBT violation rate as the simulator counts it (share of engine decode steps
    above τ, :func:`kairos.cli.demo.bench_live`), or the client's gap rate for a run recorded without it."""
    v = live.get("engine_tbt_violation_rate")
    return live["tbt_violation_rate"] if v is None else v


def run_policy(policy: str, model_dir: str, args) -> dict:
    """One live run of ``policy`` on a fresh testbed stack and its simulated twin (one JSON row)."""
    opts = vllm_testbed_options(model_dir, policy=policy)  # as kairos demo --engine vllm runs it
    sup = Supervisor(opts)
    try:
        sup.msg(f"{policy}: starting 1P1D ...")
        sup.up()
        live, scales = bench_live(sup, workload=VLLM_DEMO["workload"], rps=args.rps, duration=args.duration,
                                  seed=args.seed, json_path=None, progress=False)
    finally:
        sup.finish()
    sim = simulate_same(VLLM_DEMO["workload"], args.rps, args.duration, args.seed, opts)
    return {"policy": policy, "beta": opts.beta, "live": {k: live.get(k) for k in KEYS},
            "simulated": {k: sim.get(k) for k in KEYS}, "step_scale": scales}


def ratios(rows: list[dict], base: str = "pd") -> dict[str, dict[str, float]]:
    """``{policy: {"live": p95 ÷ base's p95, "simulated": …}}`` of TTFT for every policy but ``base``."""
    by = {r["policy"]: r for r in rows}
    if base not in by:
        return {}
    out = {}
    for p, r in by.items():
        if p != base:
            out[p] = {side: r[side]["ttft_ms"]["p95"] / by[base][side]["ttft_ms"]["p95"] for side in ("live", "simulated")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="pd,kairos,kairos+")
    ap.add_argument("--rps", type=float, default=VLLM_AB_RPS)
    ap.add_argument("--duration", type=float, default=VLLM_DEMO["duration"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/vllm-ab.jsonl")
    args = ap.parse_args(argv)
    started, load0, t0 = _dt.datetime.now(_dt.timezone.utc), os.getloadavg()[0], time.monotonic()
    model_dir = cached_tiny_model(size=VLLM_DEMO["model_size"])
    rows = [run_policy(p.strip(), model_dir, args) for p in args.policies.split(",") if p.strip()]
    for r in rows:
        lv, sm = r["live"], r["simulated"]
        gaps = lv.get("tbt_gap_violation_rate") or 0.0
        print(f"{r['policy']:8s} live P95 TTFT {lv['ttft_ms']['p95']:9,.0f} ms  TBT viol "
              f"{100 * live_step_violations(lv):5.2f} % of steps ({100 * gaps:5.2f} % of gaps)  failed {lv['failed']}   |   simulated P95 TTFT "
              f"{sm['ttft_ms']['p95']:9,.0f} ms  TBT viol {100 * sm['tbt_violation_rate']:5.2f} %")
    for p, q in ratios(rows).items():
        print(f"P95 TTFT {p} / pd: live {q['live']:.2f}, simulator {q['simulated']:.2f}")
    meta = result_meta(["python", "bench/vllm_ab.py", *(argv if argv is not None else sys.argv[1:])], started, load0,
                       time.monotonic() - t0)
    write_result(Path(args.out), meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
