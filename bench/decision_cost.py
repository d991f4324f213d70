"""Decision-cost benchmark of the kairos policy (issue #2): per-request routing time on 2P2D, 4P16D
and 8P64D clusters with realistic states, on one core.

Prompts (the routed request's, the prefill queues' and the decode contexts) come from the Bursty
workload generator; decode batches are 0-48 requests; a fifth of decode nodes hold a deflection.
Prints one JSON line per cluster size with p50_us, p99_us and the ratio of p99 to the paper's 1 ms
budget (§4.4: "under 1 ms on a single CPU core"). Not a test: figures vary by machine.

    python bench/decision_cost.py [--requests 3000] [--policy kairos]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--policy", default="kairos")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the paper measures

    from shared.latency import load_profile
    from shared.policy import PolicyParams, parse_policy
    from shared.snapshot import ClusterSnapshot, DecodeNodeView, PrefillNodeView, RequestView
    from shared.workloads import generate

    model = load_profile()
    params = PolicyParams()
    policy = parse_policy(args.policy)
    prompts = np.array([r.prompt_tokens for r in generate("bursty", rps=50, duration_s=600, seed=args.seed)])
    rng = np.random.default_rng(args.seed)

    def draw(n: int) -> list[int]:
        return [int(x) for x in rng.choice(prompts, size=n)]

    for n_p, n_d in ((2, 2), (4, 16), (8, 64)):
        snaps = []
        for i in range(args.requests):
            prefill = [PrefillNodeView(id=f"prefill-{j}", queue_prompt_tokens=draw(int(rng.integers(0, 5))))
                       for j in range(n_p)]
            decode = []
            for j in range(n_d):
                b = int(rng.integers(0, 49))
                decode.append(DecodeNodeView(id=f"decode-{j}", batch_size=b, kv_tokens=sum(draw(b)),
                                             deflection_in_flight=bool(rng.random() < 0.2)))
            snaps.append(ClusterSnapshot(request=RequestView(id=f"r{i}", prompt_tokens=draw(1)[0]),
                                         prefill_nodes=prefill, decode_nodes=decode))
        for s in snaps[:200]:  # warm-up
            policy.decide(s, model, params)
        times = np.empty(len(snaps))
        deflections = 0
        for i, s in enumerate(snaps):
            t0 = time.perf_counter_ns()
            d = policy.decide(s, model, params)
            times[i] = (time.perf_counter_ns() - t0) / 1000.0
            deflections += d.decision == "deflect"
        p50, p99 = np.percentile(times, [50, 99])
        print(json.dumps({
            "cluster": f"{n_p}P{n_d}D", "policy": args.policy, "requests": len(snaps),
            "p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1),
            "p99_over_1ms_budget": round(float(p99) / 1000.0, 4), "deflect_fraction": round(deflections / len(snaps), 3),
        }))


if __name__ == "__main__":
    main()
