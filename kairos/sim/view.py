"""The simulated dispatcher: its view of the cluster and its routing decisions (paper §5.3).

Inputs: the nodes' :class:`~kairos.core.engine_model.EngineState` (refreshed every Δh =
``heartbeat_ms``, or read exactly when Δh = 0, the paper's "Oracle"), the engines' prefix-cache
events, every step's (predicted, actual) ms for the model correction, the links' queued transfer
work, and what this dispatcher routed itself since the last refresh. Outputs: the
:class:`~kairos.core.cluster.snapshot.ClusterSnapshot` a policy decides on, and the
:class:`~kairos.core.policy.base.Decision` for each arrival after the live dispatcher's
reservation rule.

Between heartbeats the view adds what it routed itself: a keep-path prompt joins the chosen prefill
node's queue view, and a deflection reserves its decode node until that request's first token
(§5.3: "marks decode nodes where it has already sent requests in the prefill state as
unavailable"). Reservations (dispatcher rule 3, ``kairos/core/cluster/routing.py``): a decode node
holds at most ``slots`` deflections; a node at its cap is shown to the policy busy with no
projection data, and a deflection onto it becomes a keep on the best prefill node
(``keep_reservation_conflict``). For a policy with ``model_correction`` (kairos+) the view runs one
:class:`~kairos.core.model.correction.CorrectionEstimator` (the live aggregator's class) and, with
the node-side guard on, tightens each decode engine's guard to β·τ / its ``safety``.
"""

from __future__ import annotations

from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.cluster.routing import deflection_slots, keep_instead
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, InFlightDeflection, PrefillNodeView, RequestView
from kairos.core.engine_model import StepPlan
from kairos.core.model.correction import IDENTITY, CorrectionEstimator, StepCorrection
from kairos.core.model.latency import LatencyModel
from kairos.core.policy import Policy, PolicyParams
from kairos.core.policy.base import Decision
from kairos.core.workload.workloads import WorkloadRequest
from kairos.sim.config import SimConfig
from kairos.sim.links import KvLinks
from kairos.sim.nodes import SimNodes


class DispatcherView:
    """What the simulated dispatcher knows and decides; one per :class:`~kairos.sim.simulator.Simulator`.

    Attributes:
        slots: deflections a decode node may hold (None: no reservation rule).
        reserved: per decode node index, the deflections routed to it whose first token has not
            come yet (request id → request).
    """

    def __init__(self, cfg: SimConfig, model: LatencyModel, policy: Policy, params: PolicyParams,
                 nodes: SimNodes) -> None:
        self.model, self.policy, self.params, self.nodes = model, policy, params, nodes
        self.exact = cfg.heartbeat_ms <= 0
        self.slots = (cfg.deflection_slots or deflection_slots(policy.name)) if cfg.reservation_rule else None
        self.prefix_index = PrefixIndex(cfg.prefix_block_tokens)
        self.corrector = CorrectionEstimator(window_ms=cfg.correction_window_ms)
        self._corr: dict[str, StepCorrection] = {}
        self._correcting = params.model_correction  # only kairos+ reads corrections: skip the work otherwise
        self.reset()

    def reset(self) -> None:
        """Start of a run: no reservations, nothing routed, the view read from the engines now."""
        self.reserved: dict[int, dict[str, WorkloadRequest]] = {i: {} for i in range(len(self.nodes.decode))}
        self.routed_since: dict[int, list[int]] = {i: [] for i in range(len(self.nodes.prefill))}
        self._view_p = [e.state() for e in self.nodes.prefill]
        self._view_d = [e.state() for e in self.nodes.decode]

    def heartbeat(self, now: float) -> None:
        """Every Δh: fresh node states, prefix index and corrections; the routed-since lists restart."""
        self._view_p = [e.state() for e in self.nodes.prefill]
        self._view_d = [e.state() for e in self.nodes.decode]
        self._refresh_prefix_index()
        self._refresh_corrections(now)
        for q in self.routed_since.values():
            q.clear()

    @property
    def guards_follow_corrections(self) -> bool:
        """The kairos+ node guards change with the corrections (:meth:`_refresh_corrections`): the
        one part of a heartbeat that acts on the engines, not only on later decisions."""
        return self._correcting and self.nodes.guard_ms is not None

    def refresh_guards(self, now: float) -> None:
        """A heartbeat after the last arrival: no decision reads the view any more; only the node
        guards follow the corrections (when they do)."""
        if self.guards_follow_corrections:
            self._refresh_corrections(now)

    def observe(self, node_id: str, plan: StepPlan, now: float) -> None:
        """A step of ``node_id`` ended at ``now``: feed its (predicted, actual) ms to the correction."""
        if self._correcting:
            self.corrector.observe(node_id, plan.predicted_ms, plan.duration_ms, now,
                                   mixed=plan.batch_size > 0 and plan.prefill_tokens > 0)

    def decide(self, w: WorkloadRequest, now: float, links: KvLinks) -> Decision:
        """The policy's decision for arrival ``w`` at ``now``, a deflection onto a decode node at
        its reservation cap turned into a keep (``keep_reservation_conflict``)."""
        snap = self._snapshot(w, now, links)
        d = self.policy.decide(snap, self.model, self.params)
        if d.decision == "deflect" and self.slots is not None \
                and len(self.reserved[self.nodes.decode_ids.index(d.node)]) >= self.slots:
            d = keep_instead(d, snap, self.model, self.params, "keep_reservation_conflict")
        return d

    def _refresh_prefix_index(self) -> None:
        """Apply every engine's prefix-cache events since the last refresh to the view's index."""
        n = self.nodes
        for nid, eng in zip(n.prefill_ids + n.decode_ids, n.prefill + n.decode):
            stored, removed = eng.drain_cache_events()
            if stored or removed:
                self.prefix_index.apply(nid, stored, removed)

    def _refresh_corrections(self, now: float) -> None:
        """New per-node corrections (with the view); the guard of a correcting kairos+ node
        tightens to β·τ / safety."""
        if not self._correcting:
            return
        self._corr = self.corrector.corrections(now)
        guard = self.nodes.guard_ms
        if guard is not None and self.params.model_correction:
            for nid, eng in zip(self.nodes.decode_ids, self.nodes.decode):
                eng.tbt_guard_ms = guard / self._corr.get(nid, IDENTITY).safety

    def _snapshot(self, w: WorkloadRequest, now: float, links: KvLinks) -> ClusterSnapshot:
        n, exact = self.nodes, self.exact
        vp = [e.state() for e in n.prefill] if exact else self._view_p
        vd = [e.state() for e in n.decode] if exact else self._view_d
        if exact:
            self._refresh_corrections(now)
            self._refresh_prefix_index()
        corr = self._corr
        hits = self.prefix_index.match_tokens(w.block_hashes, w.prompt_tokens) if w.block_hashes else {}
        prefill = [PrefillNodeView(id=n.prefill_ids[i],
                                   queue_prompt_tokens=list(s.queue_prompt_tokens) + ([] if exact else self.routed_since[i]),
                                   kv_backlog_ms=links.backlog_ms(i),
                                   step_bias=corr.get(n.prefill_ids[i], IDENTITY).bias,
                                   cached_prefix_tokens=hits.get(n.prefill_ids[i], 0))
                   for i, s in enumerate(vp)]
        decode = []
        for i, s in enumerate(vd):
            res = self.reserved[i]
            full = self.slots is not None and len(res) >= self.slots  # as kairos.core.cluster.routing.build_snapshot
            decode.append(DecodeNodeView(
                id=n.decode_ids[i], batch_size=s.batch_size, kv_tokens=s.kv_tokens,
                deflection_in_flight=bool(res),
                in_flight=[] if full else [InFlightDeflection(prompt_tokens=r.prompt_tokens,
                                                              output_tokens=r.output_tokens) for r in res.values()],
                waiting=s.waiting, step_bias=corr.get(n.decode_ids[i], IDENTITY).bias,
                step_safety=corr.get(n.decode_ids[i], IDENTITY).safety,
                cached_prefix_tokens=hits.get(n.decode_ids[i], 0)))
        return ClusterSnapshot(request=RequestView(id=w.id, prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens),
                               prefill_nodes=prefill, decode_nodes=decode)
