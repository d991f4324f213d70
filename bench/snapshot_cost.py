"""Per-request cost of a dispatcher's routing inputs (issue 19 §3): the live reservations, the view with
the recent routed events folded in, the policy snapshot and the decision, on 2P2D, 8P64D (72 nodes)
and 32P256D (288 nodes) clusters, µs per request split by stage, on one core.

The inputs are a dispatcher's (:class:`kairos.services.dispatcher.state.RoutingState`, driven through
its own methods on a :class:`~kairos.runtime.clock.ManualClock`): requests arrive at
``--rps-per-decode`` × decode nodes; a new :class:`~kairos.contracts.wire.ClusterView` comes every
``--view-ms`` with every node's state refreshed (its heartbeat arrived: prompts from the Bursty
workload generator, a third of the decode nodes idle, the others running 1–48 requests, prefill
queues of 0–4 prompts, the routed jobs the node had not reported yet listed as pending, now and then
a stale node); each keep decision is remembered as a routed event (folded into later snapshots until
a view shows it) and each deflection as a reservation released when its predicted prefill ends;
half of the requests have no prefix-cache hit, the others one on 1–3 nodes.

Each cluster is routed twice from the same seed, through two code paths, each timed per stage:

* ``before`` (the straightforward functions, kept as the oracle):
  ``reservations`` the watched reservations plus pending deflections without the expired ones
  (:func:`~kairos.core.cluster.routing.live_reservations`); ``view`` the view with the recent
  routed events folded in (:func:`~kairos.core.cluster.routing.fold_recent`, a copy of the node
  list); ``snapshot`` :func:`~kairos.core.cluster.routing.build_snapshot`;
* ``after`` (``Router._try`` now, :meth:`RoutingState.snapshot`): ``reservations`` the
  :class:`~kairos.core.cluster.routing.ReservationIndex`, rebuilt only when a reservation changed
  or expired; ``view`` the :class:`~kairos.core.cluster.routing.SnapshotBuilder`, built only
  when a new view came (its cost lands on the first request after it); ``snapshot``
  :meth:`SnapshotBuilder.build` (the events folded in, the changed nodes patched);
* ``decide``: :func:`kairos.core.cluster.routing.decide_within_slots` (the policy and rule 3) in both;
* ``upkeep``, in both: what the replica does as it hears things, per request — the views taken
  (:meth:`RoutingState.take_view`), the routed events remembered and the reservations applied and
  released (where the ``after`` path folds each event and reservation change into its builder).

Every snapshot and decision of the two paths must be identical (compared by digest; the run stops
otherwise). Prints a table of mean µs per request per stage, the p50/p99 of their sum and the
ratio of the before/after means, of the sums and of the inputs alone (``reservations`` + ``view`` +
``snapshot``: ``decide`` and ``upkeep`` run the same code in both paths, so their differences are
the machine's noise), one line per cluster, policy and path; ``--json PATH`` also writes them as a
JSON list, one row per policy and cluster (:func:`compare`; docs/results.md's ``snapshot-cost`` block
is rendered from them). Not a test: figures vary by machine. The stages are timed in the
thread's CPU time (``time.thread_time_ns``, about 1 µs a call), which leaves out the time the OS
gives other processes: the machine is shared.

    python bench/snapshot_cost.py [--requests 2000] [--policy kairos[,kairos+]] [--clusters 2x2,8x64,32x256]
                                  [--json out/snapshot_cost.json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import os
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kairos.contracts import subjects as S
from kairos.contracts.wire import ClusterView, InferenceRequest, NodeView, Reservation, RoutedEvent, encode
from kairos.core.cluster.routing import (build_snapshot, decide_within_slots, deflection_slots,
                                         fold_recent, live_reservations)
from kairos.core.model.latency import load_profile
from kairos.core.policy import parse_policy
from kairos.core.policy.estimates import _SWEEPS
from kairos.core.workload.workloads import generate
from kairos.runtime.clock import ManualClock
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.state import RoutingState

STAGES = ("upkeep", "reservations", "view", "snapshot", "decide")


@dataclass
class Cluster:
    """The simulated cluster feeding one dispatcher's :class:`RoutingState` (see the module docstring)."""

    n_p: int
    n_d: int
    rng: np.random.Generator
    prompts: np.ndarray
    clock: ManualClock = field(default_factory=ManualClock)
    seq: int = 0
    rev: int = 0
    #: (release wall ms, reservation key, revision) of each deflection's reservation
    releases: list[tuple[float, str, int]] = field(default_factory=list)
    #: routed keep jobs a prefill node has not reported yet: node -> request ids
    unreported: dict[str, list[str]] = field(default_factory=dict)
    slot: int = 0

    def draw(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.prompts, size=n)]

    def node(self, name: str, role: str, now: float) -> NodeView:
        """One node's state in a new view: its heartbeat arrived 0–100 ms ago."""
        age = float(self.rng.uniform(0.0, 100.0))
        stale = bool(self.rng.random() < 0.005)
        if role == "decode":
            b = 0 if self.rng.random() < 1 / 3 else int(self.rng.integers(1, 49))
            return NodeView(node=name, role=role, stale=stale, age_ms=age, batch_size=b,
                            kv_tokens=sum(self.draw(b)), waiting=int(self.rng.integers(0, 3)),
                            state_sent_unix_ms=now - age)
        pending = self.unreported.pop(name, [])  # the aggregator folds them into the view
        return NodeView(node=name, role=role, stale=stale, age_ms=age,
                        queue_prompt_tokens=self.draw(int(self.rng.integers(0, 5))),
                        pending_routed=len(pending), pending_ids=pending, state_sent_unix_ms=now - age,
                        kv_backlog_ms=float(self.rng.uniform(0.0, 20.0)))

    def new_view(self) -> bytes:
        """The next view's bytes (every node's heartbeat arrived since the last one)."""
        now = self.clock.now_ms()
        self.seq += 1
        nodes = [self.node(f"prefill-{j}", "prefill", now) for j in range(self.n_p)]
        nodes += [self.node(f"decode-{j}", "decode", now) for j in range(self.n_d)]
        return encode(ClusterView(seq=self.seq, built_unix_ms=now, period_ms=100.0, stale_after_ms=300.0, nodes=nodes))

    def request(self, i: int) -> tuple[InferenceRequest, dict[str, int]]:
        """The i-th request and its prefix-cache hits (node -> cached prompt tokens)."""
        now = self.clock.now_ms()
        ell = self.draw(1)[0]
        req = InferenceRequest(request_id=f"r{i}", model="m", prompt_tokens=ell, max_tokens=256,
                               created_unix_ms=now, deadline_unix_ms=now + 30_000.0)
        hits: dict[str, int] = {}
        if i % 2:
            for j in self.rng.choice(self.n_p + self.n_d, size=int(self.rng.integers(1, 4)), replace=False):
                name = f"prefill-{j}" if j < self.n_p else f"decode-{j - self.n_p}"
                hits[name] = int(self.rng.uniform(0.1, 0.9) * ell) // 16 * 16
        return req, hits

    def routed(self, state: RoutingState, req: InferenceRequest, decision) -> None:
        """The job was accepted: remember its routed event, or hold its reservation until its prefill ends."""
        now = self.clock.now_ms()
        state.remember_routed(RoutedEvent(request_id=req.request_id, kind=decision.decision, node=decision.node,
                                          decode_node=decision.decode_node, prompt_tokens=req.prompt_tokens,
                                          output_tokens=req.max_tokens, node_accepted_unix_ms=now))
        if decision.deflected:
            self.rev, self.slot = self.rev + 1, self.slot + 1
            key = S.reservation_key(decision.node, self.slot)
            state.apply_reservation(key, Reservation(
                request_id=req.request_id, decode_node=decision.node, dispatcher_id="bench",
                prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, created_unix_ms=now,
                expires_unix_ms=now + 30_000.0), self.rev)
            heapq.heappush(self.releases, (now + sum(decision.predicted_step_ms), key, self.rev))
        else:
            self.unreported.setdefault(decision.node, []).append(req.request_id)

    def release_due(self, state: RoutingState) -> None:
        now = self.clock.now_ms()
        while self.releases and self.releases[0][0] <= now:
            _, key, _ = heapq.heappop(self.releases)
            self.rev += 1
            state.watched_reservation(key, self.rev, None, deleted=True)


def oracle_path(state: RoutingState, req: InferenceRequest, hits: dict[str, int], now: float, ctx) -> tuple:
    """``Router._try``'s inputs, snapshot and decision as built before issue 19 §3, timed per stage (ns)."""
    t0 = time.thread_time_ns()
    held = live_reservations(state._reservations_and_pending(now), now)
    t1 = time.thread_time_ns()
    view = fold_recent(state.view, state._recent())
    t2 = time.thread_time_ns()
    snap = build_snapshot(req, view, held, {}, now, ctx.slots, set(), hits)
    t3 = time.thread_time_ns()
    decision = decide_within_slots(ctx.policy, snap, ctx.model, ctx.params, held, set(), ctx.slots)
    t4 = time.thread_time_ns()
    return snap, decision, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)


def builder_path(state: RoutingState, req: InferenceRequest, hits: dict[str, int], now: float, ctx) -> tuple:
    """:meth:`RoutingState.snapshot`'s three steps (its private helpers, timed one by one), then the decision."""
    t0 = time.thread_time_ns()
    held = state._live_held(now)
    t1 = time.thread_time_ns()
    builder = state._builder_for(ctx.slots)
    t2 = time.thread_time_ns()
    snap = builder.build(req, held.own(req.request_id), {}, now, set(), hits)
    t3 = time.thread_time_ns()
    decision = decide_within_slots(ctx.policy, snap, ctx.model, ctx.params, held, set(), ctx.slots)
    t4 = time.thread_time_ns()
    return snap, decision, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)


@dataclass
class Ctx:
    policy: object
    model: object
    params: object
    slots: int


def digest(snap, decision) -> bytes:
    """A fingerprint of a snapshot and its decision (kept instead of the objects: a heap of
    requests × nodes structs would make the garbage collector's passes, and the timings, grow)."""
    return hashlib.blake2b(msgspec.json.encode((snap, decision)), digest_size=16).digest()


def run(path, n_p: int, n_d: int, args, ctx: Ctx, prompts: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
    """Route ``args.requests`` requests through ``path``; (µs per request × stage, the
    :func:`digest` of each snapshot and decision)."""
    _SWEEPS.clear()  # each path starts with a cold sweep cache
    cl = Cluster(n_p, n_d, np.random.default_rng(args.seed), prompts)
    state = RoutingState(clock=cl.clock)
    gap_s = 1.0 / (args.rps_per_decode * n_d)
    next_view = cl.clock.now_ms()
    times = np.zeros((args.requests, len(STAGES)))
    decisions = []
    gc.collect()
    upkeep = 0  # ns: the previous request's routed event or reservation, then what came before this one
    for i in range(args.requests):
        cl.clock.advance(gap_s)
        t0 = time.thread_time_ns()
        cl.release_due(state)
        upkeep += time.thread_time_ns() - t0
        if cl.clock.now_ms() >= next_view:
            data = cl.new_view()  # drawing the nodes' states is not the replica's work
            t0 = time.thread_time_ns()
            state.take_view(data)
            upkeep += time.thread_time_ns() - t0
            next_view += args.view_ms
        req, hits = cl.request(i)
        snap, decision, ns = path(state, req, hits, cl.clock.now_ms(), ctx)
        times[i] = (upkeep, *ns)
        decisions.append(digest(snap, decision))
        t0 = time.thread_time_ns()
        cl.routed(state, req, decision)
        upkeep = time.thread_time_ns() - t0
    return times / 1000.0, decisions


def row(label: str, us: np.ndarray) -> str:
    total = us.sum(axis=1)
    p50, p99 = np.percentile(total, [50, 99])
    cells = " | ".join(f"{us[:, k].mean():.1f}" for k in range(len(STAGES)))
    return f"| {label} | {cells} | {total.mean():.1f} | {p50:.1f} | {p99:.1f} |"


INPUTS = ("reservations", "view", "snapshot")


def summary(us: np.ndarray) -> dict:
    """One path's figures for the ``--json`` rows (µs per request, one decimal): the mean of each
    stage, of the inputs (:data:`INPUTS`) and of the sum, and the p50/p99 of the sum."""
    total = us.sum(axis=1)
    p50, p99 = np.percentile(total, [50, 99])
    out = {k: round(float(us[:, i].mean()), 1) for i, k in enumerate(STAGES)}
    out["inputs"] = round(float(us[:, [STAGES.index(k) for k in INPUTS]].sum(axis=1).mean()), 1)
    return {**out, "total": round(float(total.mean()), 1), "p50": round(float(p50), 1), "p99": round(float(p99), 1)}


def compare(policy: str, n_p: int, n_d: int, args, prompts: np.ndarray, model) -> dict:
    """Route one cluster through both paths, check they agree, print the two table lines; the ``--json`` row."""
    ctx = Ctx(parse_policy(policy), model, DispatcherConfig(policy=policy).params(model.engine.max_num_batched_tokens),
              deflection_slots(policy) or 1)
    label = f"{n_p}P{n_d}D ({n_p + n_d})"
    before, want = run(oracle_path, n_p, n_d, args, ctx, prompts)
    after, got = run(builder_path, n_p, n_d, args, ctx, prompts)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        raise SystemExit(f"{policy} {label}: request {first}'s snapshot or decision differs between the two paths")
    b, a = summary(before), summary(after)
    # ratios of the unrounded means
    ratio = before.sum(axis=1).mean() / after.sum(axis=1).mean()
    inputs = [STAGES.index(k) for k in INPUTS]
    ratio_inputs = before[:, inputs].sum(axis=1).mean() / after[:, inputs].sum(axis=1).mean()
    print(row(f"{label} | {policy} | before", before) + "  |  |", flush=True)
    print(row(f"{label} | {policy} | after", after) + f" {ratio:.2f}× | {ratio_inputs:.2f}× |", flush=True)
    return {"policy": policy, "cluster": f"{n_p}P{n_d}D", "prefill": n_p, "decode": n_d, "nodes": n_p + n_d,
            "requests": args.requests, "before_us": b, "after_us": a,
            "before_over_after": round(float(ratio), 2), "inputs_before_over_after": round(float(ratio_inputs), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--policy", default="kairos", help="a policy, or several comma-separated (kairos,kairos+)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clusters", default="2x2,8x64,32x256", help="comma-separated PxD cluster sizes")
    ap.add_argument("--rps-per-decode", type=float, default=2.0)
    ap.add_argument("--view-ms", type=float, default=100.0, help="a new cluster view every this many ms")
    ap.add_argument("--json", help="also write the rows (one per policy and cluster: µs per request by stage "
                                   "before and after, their ratios) to this file, a JSON list")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    try:
        clusters = [tuple(int(x) for x in c.lower().split("x")) for c in args.clusters.split(",")]
    except ValueError:
        raise SystemExit(f"--clusters: expected PxD[,PxD...], got {args.clusters!r}") from None
    model = load_profile()
    prompts = np.array([r.prompt_tokens for r in generate("bursty", rps=50, duration_s=600, seed=args.seed)])
    print(f"{args.requests} requests per cluster and policy, mean µs per request by stage; "
          f"p50/p99 of the sum; before/after: ratio of the means of the sums and of the inputs "
          f"(reservations + view + snapshot)")
    print("| cluster (nodes) | policy | path | " + " | ".join(STAGES)
          + " | total | p50 | p99 | before/after | inputs before/after |")
    print("|---" * (len(STAGES) + 8) + "|")
    rows = [compare(policy, n_p, n_d, args, prompts, model)
            for policy in args.policy.split(",") for n_p, n_d in clusters]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
