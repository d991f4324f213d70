"""Prefix-index lookup cost (issue #12): "how many leading tokens of request r does node n hold",
for every node at once, on a cluster whose caches hold the Mooncake conversation trace.

Replays the bundled Mooncake trace's ``hash_ids`` through one engine prefix cache per node
(requests spread round-robin, each node's cache bounded by the profile's KV capacity in 512-token
blocks, LRU), feeding the engines' events into one :class:`kairos.core.cluster.prefix_index.PrefixIndex`, then times
``match_tokens`` for each request of the trace against the final index. Prints one JSON line per
cluster size with wall-clock and thread-CPU p50/p99 µs. Not a test: figures vary by machine.

    python bench/prefix_index.py [--clusters 2x2,8x64,32x256]
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
    ap.add_argument("--clusters", default="2x2,8x64,32x256", help="comma-separated PxD cluster sizes")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    from kairos.core.engine_model.prefix import PrefixCache
    from kairos.core.model.latency import load_profile
    from kairos.core.cluster.prefix_index import PrefixIndex
    from kairos.core.workload.workloads import BUNDLED_TRACES, MOONCAKE_BLOCK_TOKENS, TRACES_DIR, load_mooncake_jsonl

    reqs = load_mooncake_jsonl(TRACES_DIR / BUNDLED_TRACES["mooncake"])
    capacity = load_profile().engine.kv_capacity_tokens
    for spec in args.clusters.split(","):
        n_p, n_d = (int(x) for x in spec.lower().split("x"))
        nodes = [f"n{i}" for i in range(n_p + n_d)]
        caches = [PrefixCache(MOONCAKE_BLOCK_TOKENS) for _ in nodes]
        index = PrefixIndex(MOONCAKE_BLOCK_TOKENS)
        for i, r in enumerate(reqs):  # each request computed on one node, then unpinned (it finished)
            j = i % len(nodes)
            c = caches[j]
            c.unpin(c.insert(r.block_hashes[:r.prompt_tokens // MOONCAKE_BLOCK_TOKENS]))
            c.evict_to(capacity)
            index.apply(nodes[j], *c.drain_events())
        gc.collect()
        gc.freeze()  # the replay's garbage is not part of the lookup cost
        times = np.empty(len(reqs))
        cpu = np.empty(len(reqs))
        hits = 0
        for i, r in enumerate(reqs):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            m = index.match_tokens(r.block_hashes, r.prompt_tokens)
            times[i] = (time.perf_counter_ns() - t0) / 1000.0
            cpu[i] = (time.thread_time_ns() - c0) / 1000.0
            hits += bool(m)
        gc.unfreeze()
        p50, p99 = np.percentile(times, [50, 99])
        c50, c99 = np.percentile(cpu, [50, 99])
        print(json.dumps({"cluster": f"{n_p}P{n_d}D", "requests": len(reqs),
                          "cached_blocks": sum(len(c) for c in caches), "p50_us": round(float(p50), 2),
                          "p99_us": round(float(p99), 2), "cpu_p50_us": round(float(c50), 2),
                          "cpu_p99_us": round(float(c99), 2), "requests_with_a_hit": hits}))


if __name__ == "__main__":
    main()
