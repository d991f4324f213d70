"""How much of the paper's effect the CPU testbed leaves once the policy plans with the step times the
engines really ran: the simulator, fed by ``bench/vllm_ab.py``'s measurements.

    python bench/vllm_headroom.py [--ab bench/results/vllm-ab.jsonl] [--betas 1.0,0.74]
                                  [--out bench/results/vllm-headroom.jsonl]

``bench/vllm_ab.py`` records, per policy, how much slower than the ``cpu-testbed-vllm`` profile each
node's steps ran during its live run (``step_scale``: Σ measured ÷ Σ predicted of the node's step
records, :mod:`kairos.cli.stepscale`). This script takes the ``kairos`` run's scales, builds the profile
with its prefill model × the prefill node's scale and its decode and mixed models × the decode node's
(:func:`scaled_model`), and simulates ``pd``, ``kairos`` and ``kairos+`` on the A/B's seeded workload
with that model as both the policy's plan and the engines' truth: planning that knows the real step
times, so no step breaks the TBT SLO by mis-prediction. Beside it the same at the profile's own step
times, for each β (Eq. 5's TBT safety factor) asked. The ``kairos ÷ pd`` P95 TTFT ratio of the first
is the gain the testbed allows a TBT-safe plan; the live A/B's ratio with its TBT violations is what
planning on the profile got. The docs/results.md block ``vllm-headroom`` is rendered from the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kairos.cli.demo import VLLM_AB_RPS, VLLM_DEMO, simulate_same  # noqa: E402
from tools.docgen.docgen import result_meta, write_result  # noqa: E402
from kairos.cli.up import VLLM_DEFAULTS, UpOptions  # noqa: E402
from kairos.core.model.latency import LatencyModel, load_profile, tbt_safety_beta  # noqa: E402

POLICIES = ("pd", "kairos", "kairos+")


def scaled_model(model: LatencyModel, prefill: float, decode: float) -> LatencyModel:
    """``model`` with its prefill-only step times × ``prefill`` and its decode-only and mixed step
    times × ``decode`` (both > 0): the step times of a P/D pair whose prefill node ran ``prefill`` ×
    and decode node ``decode`` × its profile. KV-transfer links and engine limits are unchanged.

    Raises:
        ValueError: a scale ≤ 0.
    """
    if not (prefill > 0 and decode > 0):
        raise ValueError(f"scales must be > 0, got prefill {prefill}, decode {decode}")
    return dataclasses.replace(
        model, version=f"{model.version}+p{prefill:.3f}d{decode:.3f}",
        prefill_intercept_ms=model.prefill_intercept_ms * prefill,
        prefill_coef=tuple(c * prefill for c in model.prefill_coef),
        decode_intercept_ms=model.decode_intercept_ms * decode,
        decode_coef=tuple(c * decode for c in model.decode_coef),
        mixed_delta_coef=tuple(c * decode for c in model.mixed_delta_coef))


def measured_scales(ab_path: Path, policy: str = "kairos") -> dict[str, float]:
    """``{node: step-time scale}`` of ``policy``'s live run in a ``bench/vllm_ab.py`` result file.

    Raises:
        ValueError: no row for ``policy``, or it recorded no scale.
    """
    rows = [json.loads(line) for line in ab_path.read_text().splitlines() if line.strip()]
    row = next((r for r in rows if r.get("policy") == policy), None)
    if row is None or not row.get("step_scale"):
        raise ValueError(f"{ab_path}: no step_scale recorded for policy {policy!r} (re-run bench/vllm_ab.py)")
    return row["step_scale"]


def simulate(model: LatencyModel, beta: float, rps: float, duration: float, seed: int) -> dict[str, dict]:
    """``{policy: simulator row}`` for :data:`POLICIES` on the A/B's workload and 1P1D stack
    (:func:`kairos.cli.demo.simulate_same`, as the A/B's simulated column), ``model`` as plan and truth."""
    opts = dict(port=1, profile=VLLM_DEFAULTS["profile"], prefill=1, decode=1, engine="vllm", beta=beta,
                tbt_slo_ms=VLLM_DEMO["tbt_slo_ms"], ttft_slo_ms=VLLM_DEMO["ttft_slo_ms"])
    return {name: simulate_same(VLLM_DEMO["workload"], rps, duration, seed, UpOptions(policy=name, **opts), model=model)
            for name in POLICIES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ab", default="bench/results/vllm-ab.jsonl")
    ap.add_argument("--betas", default=f"1.0,{tbt_safety_beta(load_profile(VLLM_DEFAULTS['profile']))}",
                    help="β values (default: 1 and the profile's own, as kairos demo --engine vllm plans)")
    ap.add_argument("--out", default="bench/results/vllm-headroom.jsonl")
    args = ap.parse_args(argv)
    started, load0, t0 = _dt.datetime.now(_dt.timezone.utc), os.getloadavg()[0], time.monotonic()
    ab = [json.loads(line) for line in Path(args.ab).read_text().splitlines() if line.strip()]
    ab_cmd = ab[0].get("meta", {}).get("command", "")
    scales = measured_scales(Path(args.ab))
    sp, sd = scales.get("prefill-0", 1.0), scales.get("decode-0", 1.0)
    base = load_profile(VLLM_DEFAULTS["profile"])
    rows = []
    for label, (p, d) in (("profile", (1.0, 1.0)), ("measured", (sp, sd))):
        model = scaled_model(base, p, d)
        for beta in (float(b) for b in args.betas.split(",")):
            sim = simulate(model, beta, VLLM_AB_RPS, VLLM_DEMO["duration"], 1)
            for name, r in sim.items():
                rows.append({"step_times": label, "prefill_scale": p, "decode_scale": d, "beta": beta, "policy": name,
                             "ttft_ms": r["ttft_ms"], "deflections": r["deflections"],
                             "tbt_violation_rate": r["tbt_violation_rate"],
                             "ratio_to_pd": r["ttft_ms"]["p95"] / sim["pd"]["ttft_ms"]["p95"]})
                print(f"{label:8s} (prefill ×{p:.2f}, decode ×{d:.2f}) β {beta:.2f} {name:8s} P95 TTFT "
                      f"{r['ttft_ms']['p95']:9,.0f} ms  ÷ pd {rows[-1]['ratio_to_pd']:.2f}  deflections {r['deflections']}")
    meta = {**result_meta(["python", "bench/vllm_headroom.py", *(argv if argv is not None else sys.argv[1:])], started,
                          load0, time.monotonic() - t0), "ab_command": ab_cmd, "ab_date": ab[0].get("meta", {}).get("date")}
    write_result(Path(args.out), meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
