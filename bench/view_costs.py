"""Per-view costs of the control plane at fleet scale (issue 19, section 3): what the ingress and the
state aggregator spend on each cluster view, old path against new, in one run.

The view: 32 prefill + 256 decode nodes (``--prefill``/``--decode``) as the aggregator writes them
(:class:`kairos.contracts.wire.ClusterView`, JSON): prefill nodes with 0-6 queued prompts and a few
routed-but-unreported jobs (pending ids), decode nodes with 0-48 running decodes, a fifth with a
deflection in flight, every node with a learned step-time correction, 1 % stale and 1 % draining.
``--views`` such views (each node's heartbeat age moves between them, as every 100 ms) are cycled.

* **ingress** (:meth:`kairos.services.ingress.readiness.Readiness.take_view`): every view arrives
  twice (``kairos.view`` and the ``kairos_view`` bucket), newer than the one held; the liveness
  watcher then learns the roles. Old: ``decode_if_newer`` (what the ingress called before, as the
  dispatchers still do): the stamp, then the whole ``ClusterView``; the second copy's stamp. New:
  the ingress's :class:`~kairos.services.ingress.readiness.ReadyView`; the second copy is the same
  bytes as the view held, dropped on a byte comparison.
* **aggregator** (:meth:`kairos.services.state_aggregator.service.StateAggregator._report`): the
  per-node gauges and stale log lines of one view. Old: :func:`old_report`, the method as it was
  (``labels()`` on two gauges per node per view); new: the method now (gauge children kept, set on
  change).

Prints one line per part: µs per view old and new, and old/new — wall (:func:`time.perf_counter`)
and, in brackets, the thread's CPU time — each the median of ``--repeats`` timed runs of
``--iterations`` views, old and new runs alternating (:func:`per_view_us`). Not a test: figures
depend on the machine (and on what else runs on it).

    python bench/view_costs.py [--iterations 300] [--repeats 5] [--json out/view_costs.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Callable

from kairos.contracts.wire import ClusterView, InFlight, NodeView, encode
from kairos.core.model.correction import StepCorrection
from kairos.runtime import telemetry
from kairos.runtime.clock import ManualClock
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.readiness import Readiness, ReadyView
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator
from kairos.services.state_aggregator.view import decode_if_newer


def make_view(rng: random.Random, seq: int, prefill: int, decode: int) -> ClusterView:
    """A view of ``prefill`` + ``decode`` nodes in a loaded cluster (module docstring)."""
    nodes = []
    for i in range(prefill + decode):
        role = "prefill" if i < prefill else "decode"
        name = f"{role}-{i if i < prefill else i - prefill}"
        pending = [f"cmpl-{rng.getrandbits(96):024x}" for _ in range(rng.randint(0, 2))]
        common = dict(node=name, role=role, stale=rng.random() < 0.01, age_ms=rng.uniform(0.0, 110.0),
                      accepting=rng.random() >= 0.01, pending_routed=len(pending), pending_ids=pending,
                      state_sent_unix_ms=1.7e12 + seq * 100.0 + rng.uniform(0, 100),
                      correction=StepCorrection(bias=rng.uniform(0.9, 1.2), safety=rng.uniform(1.2, 1.5),
                                                samples=rng.randint(50, 500), window_ms=10_000.0))
        if role == "prefill":
            nodes.append(NodeView(**common, queue_prompt_tokens=[rng.randint(64, 4096) for _ in range(rng.randint(0, 6))],
                                  kv_backlog_ms=rng.uniform(0.0, 20.0)))
        else:
            deflecting = rng.random() < 0.2
            batch = rng.randint(0, 48)
            nodes.append(NodeView(**common, batch_size=batch, kv_tokens=batch * rng.randint(200, 2000),
                                  waiting=rng.randint(0, 3), deflection_in_flight=deflecting,
                                  in_flight=[InFlight(prompt_tokens=rng.randint(64, 4096),
                                                      output_tokens=rng.randint(16, 512))] if deflecting else []))
    return ClusterView(seq=seq, built_unix_ms=1.7e12 + seq * 100.0, period_ms=100.0, stale_after_ms=300.0, nodes=nodes)


class NullLog:
    """A logger that drops every line (the stale/fresh lines cost the same on both paths)."""

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def old_report(agg: StateAggregator, state: dict, view: ClusterView) -> None:
    """``StateAggregator._report`` as it was before its gauge children were kept (``state`` holds its
    ``_labelled`` and ``_stale`` sets): the reference the new method is timed against."""
    counts: dict[tuple[str, str], int] = {(r, s): 0 for r in ("prefill", "decode") for s in ("true", "false")}
    stale = set()
    for n in view.nodes:
        counts[(n.role, "true" if n.stale else "false")] += 1
        if n.stale:
            stale.add(n.node)
    for (r, s), c in counts.items():
        agg.m_nodes.labels(r, s).set(c)
    present = set()
    for n in view.nodes:
        present.add((n.node, n.role))
        agg.m_age.labels(n.node, n.role).set(telemetry.seconds(n.age_ms))
        agg.m_stale.labels(n.node, n.role).set(1 if n.stale else 0)
    for gone in state["labelled"] - present:
        agg.m_age.remove(*gone)
        agg.m_stale.remove(*gone)
    state["labelled"] = present
    for n in stale - state["stale"]:
        agg.log.warning("node_stale", node=n)
    in_view = {n for n, _ in present}
    for n in state["stale"] - stale:
        if n in in_view:
            agg.log.info("node_fresh", node=n)
        else:
            agg.log.warning("node_forgotten", node=n)
    state["stale"] = stale


def per_view_us(old: Callable[[int], None], new: Callable[[int], None], views: int, iterations: int,
                repeats: int) -> dict[str, float]:
    """µs per call of ``old(i)`` and ``new(i)``, ``i`` cycling over ``views``: wall (``perf_counter``)
    and this thread's CPU time (``thread_time``: leaves out what the OS gave other processes), each
    the median of ``repeats`` runs of ``iterations`` calls; old and new runs alternate, so a load
    that comes and goes on a shared machine weighs on both. One untimed warm-up pass each first."""
    for i in range(views):
        old(i)
        new(i)
    out: dict[str, list[float]] = {k: [] for k in ("old_wall", "old_cpu", "new_wall", "new_cpu")}
    for _ in range(repeats):
        for name, step in (("old", old), ("new", new)):
            w0, c0 = time.perf_counter(), time.thread_time()
            for i in range(iterations):
                step(i % views)
            out[f"{name}_cpu"].append((time.thread_time() - c0) / iterations * 1e6)
            out[f"{name}_wall"].append((time.perf_counter() - w0) / iterations * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def ingress_paths(bodies: list[bytes]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """(old, new) ingress steps: view ``i`` arrives twice; the first copy is newer than the view held
    (an empty view built before any: its stamp is decoded, then the view), the second is dropped on
    its stamp; the roles go to a dict as the liveness watcher's ``on_view`` does."""
    older = ClusterView(seq=0, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0)
    held: dict[str, ClusterView | None] = {"view": None}
    old_roles: dict[str, str] = {}

    def old(i: int) -> None:
        held["view"] = older
        for copy in (bodies[i], bodies[i]):
            v = decode_if_newer(copy, held["view"])  # default type: the whole ClusterView, as before
            if v is not None:
                held["view"] = v
                old_roles.update((n.node, n.role) for n in v.nodes)

    roles: dict[str, str] = {}
    r = Readiness(IngressConfig(), lambda: True, _no_infos, lambda v: roles.update((n.node, n.role) for n in v.nodes),
                  ManualClock(), NullLog())
    older_ready = ReadyView(seq=0, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0)

    def new(i: int) -> None:
        r.ready, r._data = older_ready, None
        r.take_view(bodies[i])
        r.take_view(bodies[i])

    return old, new


async def _no_infos() -> list:
    return []


def aggregator_paths(views: list[ClusterView]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """(old, new) aggregator steps: report view ``i``, each on its own aggregator (own registry)."""
    old_agg, new_agg = (StateAggregator(AggregatorConfig(metrics_port=-1)) for _ in range(2))
    old_agg.log = new_agg.log = NullLog()
    state: dict[str, set] = {"labelled": set(), "stale": set()}
    return (lambda i: old_report(old_agg, state, views[i])), (lambda i: new_agg._report(views[i]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--views", type=int, default=20, help="distinct views cycled")
    ap.add_argument("--iterations", type=int, default=300, help="views per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per path (the median is printed)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the rows to this file (a JSON list, one row per part)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    views = [make_view(rng, seq, a.prefill, a.decode) for seq in range(1, a.views + 1)]
    bodies = [encode(v) for v in views]
    rows = []
    for part, (old, new) in (("ingress take_view (2 copies)", ingress_paths(bodies)),
                             ("aggregator _report", aggregator_paths(views))):
        us = per_view_us(old, new, a.views, a.iterations, a.repeats)
        row = {"part": part, "cluster": f"{a.prefill}P{a.decode}D", "nodes": a.prefill + a.decode,
               "view_bytes": len(bodies[0]), "iterations": a.iterations, "repeats": a.repeats,
               **{f"{k}_us": round(v, 1) for k, v in us.items()},
               "old_over_new_wall": round(us["old_wall"] / us["new_wall"], 2),
               "old_over_new_cpu": round(us["old_cpu"] / us["new_cpu"], 2)}
        rows.append(row)
        print(f"{part:29s} {a.prefill}P{a.decode}D ({len(bodies[0]) / 1024:.0f} KiB), µs/view wall (cpu): "
              f"old {us['old_wall']:7.1f} ({us['old_cpu']:7.1f})  new {us['new_wall']:6.1f} ({us['new_cpu']:6.1f})  "
              f"old/new {row['old_over_new_wall']:5.2f}x ({row['old_over_new_cpu']:5.2f}x)", flush=True)
    if a.json:  # a JSON list: what ``python -m tools.docgen record NAME --rows-from PATH`` reads
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
