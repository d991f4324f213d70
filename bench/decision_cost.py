"""Decision-cost benchmark of the kairos policy (issues #2, #12): per-request routing time on 2P2D,
4P16D, 8P64D, 16P128D and 32P256D clusters with realistic states, on one core.

Prompts (the routed request's, the prefill queues' and the decode contexts) come from the Bursty
workload generator; decode batches are 0-48 requests; a fifth of decode nodes hold a deflection;
0-3 random nodes hold a cached prefix of the request (0-90 % of it, whole 16-token blocks — the
nodes that served earlier turns of a conversation; read by cache-aware policies such as
``kairos+``).
Node states either evolve as in a dispatcher's view (``--states live``, default: a node's state
changes only when its heartbeat arrives, every 100 ms, while requests arrive at 2 req/s per decode
node — the policy reuses a node's cached chunk sweep until then) or are new at every decision
(``--states cold``: the worst case, nothing reusable).
Prints one JSON line per cluster size with wall-clock p50_us/p99_us, the thread's CPU time
cpu_p50_us/cpu_p99_us (excludes time the OS gave other processes — this machine is shared) and
the ratio of p99 to the paper's 1 ms budget (§4.4: "under 1 ms on a single CPU core"). Not a
test: figures vary by machine.

    python bench/decision_cost.py [--requests 3000] [--policy kairos] [--clusters 2x2,8x64]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--policy", default="kairos")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clusters", default="2x2,4x16,8x64,16x128,32x256",
                    help="comma-separated PxD cluster sizes")
    ap.add_argument("--states", choices=("live", "cold"), default="live",
                    help="live: node states change when their heartbeat arrives (every --heartbeat-ms, "
                         "requests at --rps-per-decode × decode nodes), as in a dispatcher's view; "
                         "cold: every node's state is new at every decision (no reuse, worst case)")
    ap.add_argument("--heartbeat-ms", type=float, default=100.0)
    ap.add_argument("--rps-per-decode", type=float, default=2.0)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the paper measures

    from kairos.core.model.latency import load_profile
    from kairos.core.policy import PolicyParams
    from kairos.core.policy import parse_policy
    from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, PrefillNodeView, RequestView
    from kairos.core.workload.workloads import generate

    model = load_profile()
    params = PolicyParams()
    policy = parse_policy(args.policy)
    prompts = np.array([r.prompt_tokens for r in generate("bursty", rps=50, duration_s=600, seed=args.seed)])
    rng = np.random.default_rng(args.seed)

    def draw(n: int) -> list[int]:
        return [int(x) for x in rng.choice(prompts, size=n)]

    def hits(ell: int, n_nodes: int) -> dict[int, int]:
        holders = rng.choice(n_nodes, size=int(rng.integers(0, 4)), replace=False) if n_nodes >= 3 else []
        return {int(j): int(rng.uniform(0, 0.9) * ell) // 16 * 16 for j in holders}

    try:
        clusters = [tuple(int(x) for x in c.lower().split("x")) for c in args.clusters.split(",")]
    except ValueError:
        raise SystemExit(f"--clusters: expected PxD[,PxD...], got {args.clusters!r}") from None
    def decode_state() -> tuple[int, int, bool]:
        b = int(rng.integers(0, 49))
        return b, sum(draw(b)), bool(rng.random() < 0.2)

    def prefill_state() -> list[int]:
        return draw(int(rng.integers(0, 5)))

    for n_p, n_d in clusters:
        rps = args.rps_per_decode * n_d
        # probability that a node's heartbeat arrived since the previous decision
        refresh = 1.0 if args.states == "cold" else min(1.0, 1.0 / (rps * args.heartbeat_ms / 1000.0))
        dstate = [decode_state() for _ in range(n_d)]
        pstate = [prefill_state() for _ in range(n_p)]
        snaps = []
        for i in range(args.requests):
            ell = draw(1)[0]
            held = hits(ell, n_p + n_d)  # node index (prefill nodes first) -> cached prefix tokens
            for j in range(n_d):
                if rng.random() < refresh:
                    dstate[j] = decode_state()
            for j in range(n_p):
                if rng.random() < refresh:
                    pstate[j] = prefill_state()
            prefill = [PrefillNodeView(id=f"prefill-{j}", queue_prompt_tokens=pstate[j], cached_prefix_tokens=held.get(j, 0))
                       for j in range(n_p)]
            decode = [DecodeNodeView(id=f"decode-{j}", batch_size=b, kv_tokens=k, deflection_in_flight=f,
                                     cached_prefix_tokens=held.get(n_p + j, 0))
                      for j, (b, k, f) in enumerate(dstate)]
            snaps.append(ClusterSnapshot(request=RequestView(id=f"r{i}", prompt_tokens=ell),
                                         prefill_nodes=prefill, decode_nodes=decode))
        warm = snaps[:200] if args.states == "cold" else []
        for s in warm:  # warm-up (code paths only: cold states never repeat)
            policy.decide(s, model, params)
        wall = np.empty(len(snaps))
        cpu = np.empty(len(snaps))
        deflections = 0
        gc.collect()
        gc.freeze()  # the pre-built snapshots (requests × nodes structs) are not a dispatcher's heap
        for i, s in enumerate(snaps):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            d = policy.decide(s, model, params)
            wall[i] = (time.perf_counter_ns() - t0) / 1000.0
            cpu[i] = (time.thread_time_ns() - c0) / 1000.0
            deflections += d.decision == "deflect"
        gc.unfreeze()
        p50, p99 = np.percentile(wall, [50, 99])
        c50, c99 = np.percentile(cpu, [50, 99])
        print(json.dumps({
            "cluster": f"{n_p}P{n_d}D", "policy": args.policy, "states": args.states,
            "state_refresh_per_decision": round(refresh, 4), "requests": len(snaps),
            "p50_us": round(float(p50), 1), "p99_us": round(float(p99), 1),
            "cpu_p50_us": round(float(c50), 1), "cpu_p99_us": round(float(c99), 1),
            "p99_over_1ms_budget": round(float(p99) / 1000.0, 4), "deflect_fraction": round(deflections / len(snaps), 3),
        }))

if __name__ == "__main__":
    main()
