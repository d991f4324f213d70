"""Discrete-event P/D cluster simulator (paper §3.3–3.4, §6), in virtual time.

Where things come from: arrivals from ``kairos.core.workload.workloads``; every node is the engine model of
``kairos.core.engine_model`` (the same one the emulated node agent runs in real time); decisions come from
``kairos.core.policy`` (the dispatcher's code). Where they go: one :class:`kairos.core.workload.serving_metrics.RequestRecord`
per request plus the decode nodes' step latencies, summarized by ``kairos.core.workload.serving_metrics.summarize``.

Model of the cluster:

* **Dispatcher view.** Node states are refreshed every Δh = ``heartbeat_ms`` (all nodes report at
  the same instants). Between heartbeats the dispatcher adds what it routed itself: a keep-path
  prompt joins the chosen prefill node's queue view, and a deflection reserves its decode node until
  that request's prefill finishes (§5.3: "marks decode nodes where it has already sent requests in
  the prefill state as unavailable"). ``heartbeat_ms = 0`` gives the exact state (the paper's
  "Oracle").
* **KV transfer.** One link per (prefill node, decode node) pair; **one transfer at a time per link**
  (FIFO), each taking ``setup + tokens·bytes/bandwidth`` of the profile's link. A transfer starts
  only once the decode node has allocated KV blocks for the request (decode-side admission, FIFO),
  so the KV-transfer component includes both the link queue and the wait for decode memory —
  what docs/calibration.md says the paper's transfer times contain.
* **TTFT components** (ms): prefill queue = first prefill chunk start − arrival; prefill exec =
  prefill end − first chunk start; KV transfer = KV arrived − prefill end; decode queue = first
  token − KV arrived. For a deflected request the "prefill" runs on the decode node and the last two
  are 0. The four sum to the TTFT exactly.
* **Reservations (dispatcher rule 3, kairos/core/cluster/routing.py).** A decode node holds at most
  ``deflection_slots(policy)`` deflections (kairos and the static policies 1, kairos+ 4, taichi
  unlimited), exactly as the live dispatcher: a node at its cap is shown to the policy as busy
  with no projection data, and a deflection onto it (static policies pick a target without
  looking) becomes a keep on the best prefill node (``keep_reservation_conflict``).
  ``SimConfig.reservation_rule=False`` lets such deflections queue on the node instead (the
  simulator's behaviour before the rule was shared; the report shows both for Table 4).
* **TaiChi** (``params.flowing_decode``): prefill nodes are P-heavy instances with step budget
  ``params.prefill_chunk_tokens``; a keep-path request decodes on its prefill node from its first
  token on (PD aggregation) and, once its mean time per output token exceeds
  ``flow_tpot_fraction``·τ, migrates live to the decode node with the fewest KV tokens: the target
  reserves blocks, the KV of prompt + tokens so far crosses the link while the source keeps
  decoding, then the source drops it and the target resumes at the next token (its KV transfer
  is not part of TTFT). Steps of prefill nodes with decodes in them count as decode steps.
* **Ground truth.** The engines plan with the policy's model (their predictions, the node-side
  guard) but advance the clock by their own :class:`~kairos.core.engine_model.GroundTruth`: ``truth``
  (another artifact: an error of form), ``truth_scale`` (a bias), ``drift`` (one node slower from
  a given time on) and ``noise`` (multiplicative log-normal σ on every step). With none of them
  the truth *is* the policy's model — the exact-model run the model-error report compares with.
* **Model correction.** For a policy with ``model_correction`` (kairos+), every step's
  (predicted, actual) feeds one :class:`~kairos.core.model.correction.CorrectionEstimator` (the class the
  live aggregator runs); its per-node corrections are refreshed with the view (every Δh) and put
  into the snapshots. Other policies skip this work (they ignore the fields). With the node-side guard on, a decode
  engine's guard limit is β·τ / its ``safety`` (the node knows its own residuals).

Event order is deterministic: the heap is keyed ``(time_ms, priority, sequence)``.

This module is the event loop and the handlers that move requests between nodes and links; the
rest is one concern a module: :mod:`kairos.sim.config` (:class:`SimConfig`), :mod:`kairos.sim.nodes`
(the engines and their ground truth), :mod:`kairos.sim.view` (the dispatcher's view, decisions,
reservations, corrections), :mod:`kairos.sim.links` (the KV-transfer links) and
:mod:`kairos.sim.results` (per-request timings, :class:`SimResult`).
"""

from __future__ import annotations

import heapq
from typing import Sequence

from kairos.core.engine_model import StepPlan
from kairos.core.model.latency import LatencyModel
from kairos.core.policy import Policy, PolicyParams
from kairos.core.workload.workloads import WorkloadRequest
from kairos.sim.config import SimConfig
from kairos.sim.links import KvLinks, LinkKey
from kairos.sim.nodes import build_nodes
from kairos.sim.results import DeflectedStep, SimRequest, SimResult, request_record
from kairos.sim.view import DispatcherView

__all__ = ["SimConfig", "SimResult", "DeflectedStep", "Simulator"]

# event kinds, in priority order for equal timestamps (heartbeats first so that a decision at the
# same instant sees the fresh state; step ends before arrivals so freed capacity is visible)
_HEARTBEAT, _STEP_END, _TRANSFER_END, _ARRIVAL = range(4)


class Simulator:
    """One run of one policy over one workload. Use :meth:`run`.

    Attributes (after :meth:`run`):
        reqs: every request of the run by id (:class:`~kairos.sim.results.SimRequest`).

    Raises:
        ValueError: fewer than one prefill or decode node, or a drift node that is not a node.
    """

    def __init__(self, cfg: SimConfig, model: LatencyModel, policy: Policy, params: PolicyParams) -> None:
        self.cfg, self.model, self.policy = cfg, model, policy
        self.params = policy.params(params)
        self._now = 0.0
        nodes = build_nodes(cfg, model, self.params, lambda: self._now)
        self.prefill_ids, self.decode_ids = nodes.prefill_ids, nodes.decode_ids
        self.prefill, self.decode = nodes.prefill, nodes.decode
        self.view = DispatcherView(cfg, model, policy, self.params, nodes)
        truth = cfg.truth or model
        self.link = truth.link(cfg.link)
        self.kv_bytes = truth.kv_bytes_per_token

    # -- event loop ----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self, workload: Sequence[WorkloadRequest]) -> SimResult:
        """Simulate until every request has finished. Deterministic for a given seed."""
        self._heap: list = []
        self._seq = 0
        self.reqs: dict[str, SimRequest] = {}
        self.busy = {("p", i): False for i in range(len(self.prefill))} | {("d", i): False for i in range(len(self.decode))}
        self.links = KvLinks(self.link, self.kv_bytes)
        self.decode_steps: list[float] = []
        self.decode_step_at: list[tuple[float, int]] = []
        self.deflected_steps: list[DeflectedStep] = []
        self.deflections = 0
        for w in workload:
            self._push(w.arrival_s * 1000.0, _ARRIVAL, w)
        hb = self.cfg.heartbeat_ms
        self.view.reset()
        if hb > 0 and workload:
            self._push(0.0, _HEARTBEAT, None)
        pending = arrivals_left = len(workload)
        now = 0.0
        while self._heap:
            now, kind, _, payload = heapq.heappop(self._heap)
            self._now = now
            if kind == _ARRIVAL:
                arrivals_left -= 1
                self._arrive(now, payload)
            elif kind == _STEP_END:
                pending -= self._step_end(now, *payload)
            elif kind == _TRANSFER_END:
                self._transfer_end(now, *payload)
            elif kind == _HEARTBEAT:
                # after the last arrival no decision reads the view: only the guards may still move
                # (an overloaded cluster drains its queues for long after; its heartbeats were most of the cost)
                if arrivals_left:
                    self.view.heartbeat(now)
                else:
                    self.view.refresh_guards(now)
                if pending > 0 and (arrivals_left or self.view.guards_follow_corrections):
                    self._push(now + hb, _HEARTBEAT, None)
        records = [request_record(r) for r in self.reqs.values()]
        return SimResult(records=records, decode_step_ms=self.decode_steps, deflected_steps=self.deflected_steps,
                         deflections=self.deflections, sim_seconds=now / 1000.0, decode_step_at=self.decode_step_at)

    # -- dispatcher ----------------------------------------------------------------------------
    def _arrive(self, now: float, w: WorkloadRequest) -> None:
        r = SimRequest(w)
        self.reqs[w.id] = r
        d = self.view.decide(w, now, self.links)
        if d.decision == "deflect":
            di = self.decode_ids.index(d.node)
            r.deflected, r.decode_node = True, di
            r.decided_decodes = self.decode[di].decoding_ids
            r.predicted_steps = list(d.predicted_step_ms)
            self.view.reserved[di][w.id] = w
            self.deflections += 1
            self.decode[di].add_deflected(w.id, w.prompt_tokens, w.output_tokens, list(d.chunk_schedule),
                                          w.block_hashes)
            self._kick(now, "d", di)
        else:
            pi = self.prefill_ids.index(d.node)
            r.prefill_node, r.decode_node = pi, self.decode_ids.index(d.decode_node)
            self.view.routed_since[pi].append(w.prompt_tokens)
            r.local = self.params.flowing_decode
            self.prefill[pi].add_prefill(w.id, w.prompt_tokens, w.block_hashes,
                                         output_tokens=w.output_tokens if r.local else 0)
            self._kick(now, "p", pi)

    # -- engines -------------------------------------------------------------------------------
    def _kick(self, now: float, role: str, i: int) -> None:
        """Admit what fits (a decode node allocates KV blocks even mid-step, as the emulated node
        agent does, so transfers start at once), then start the next step of an idle engine."""
        eng = self.prefill[i] if role == "p" else self.decode[i]
        if role == "d":
            for rid in eng.admit():
                self._allocated(now, i, rid)
        if self.busy[(role, i)]:
            return
        plan = eng.plan_step()
        if plan is None:
            return
        for rid in plan.allocated:
            self._allocated(now, i, rid)
        self.busy[(role, i)] = True
        for rid, _, cached in plan.prefill_chunks:
            r = self.reqs[rid]
            if r.prefill_start_ms is None:
                r.prefill_start_ms = now
                r.cached_tokens = cached  # the first chunk starts after the prefix-cache hit
        self._push(now + plan.duration_ms, _STEP_END, (role, i, plan))

    def _step_end(self, now: float, role: str, i: int, plan: StepPlan) -> int:
        eng = self.prefill[i] if role == "p" else self.decode[i]
        res = eng.commit_step(plan)
        self.busy[(role, i)] = False
        self.view.observe((self.prefill_ids if role == "p" else self.decode_ids)[i], plan, now)
        if plan.batch_size > 0:  # prefill nodes decode only under TaiChi (aggregation)
            self.decode_steps.append(plan.duration_ms)
            self.decode_step_at.append((now, i if role == "d" else -1 - i))
        if role == "d":
            if plan.deflected_chunk is not None:
                rid, idx, _, _ = plan.deflected_chunk
                r = self.reqs[rid]
                self.deflected_steps.append(DeflectedStep(
                    rid, idx, r.predicted_steps[idx] if idx < len(r.predicted_steps) else None,
                    plan.duration_ms, len(r.decided_decodes), plan.batch_size,
                    not r.decided_decodes.issuperset(plan.decode_ids)))
        for rid, _ in res.tokens:
            self.reqs[rid].token_times_ms.append(now)
        for rid in res.first_tokens:
            r = self.reqs[rid]
            if r.first_token_ms is not None:
                continue  # a migrated decode resuming at token 0 on its new node
            r.first_token_ms = now
            if r.deflected or r.local:
                r.prefill_end_ms = now
            if r.deflected:
                self.view.reserved[r.decode_node].pop(rid, None)
        for rid in res.finished:
            r = self.reqs[rid]
            r.done = True
            if r.migrating and role == "p":  # finished on the source before its KV moved
                self._cancel_migration(now, r)
        if role == "p" and self.params.flowing_decode:
            self._flow(now, i, plan)
        for rid in res.prefill_done:  # keep path: hand the KV to the decode node
            r = self.reqs[rid]
            r.prefill_end_ms = now
            self.decode[r.decode_node].add_remote_decode(rid, r.w.prompt_tokens, r.w.output_tokens, r.w.block_hashes)
            self._kick(now, "d", r.decode_node)
        self._kick(now, role, i)
        return len(res.finished)

    def _allocated(self, now: float, di: int, rid: str) -> None:
        """Decode node ``di`` reserved blocks for ``rid``: queue its KV transfer on the link."""
        r = self.reqs[rid]
        # only the blocks the decode node lacks cross the link (vLLM NixlConnector pulls the
        # tokens past the decode side's local prefix hit)
        # (a TaiChi migration also carries the tokens decoded on the source so far)
        r.transfer_tokens = r.w.prompt_tokens + (r.migrate_from if r.migrating else 0) \
            - self.decode[di].cached_prefix_tokens(rid)
        key = (r.prefill_node, di)
        self.links.enqueue(key, r)
        self._start_transfer(now, key)

    def _start_transfer(self, now: float, key: LinkKey) -> None:
        """Start the next KV transfer of link ``key`` if it is free: its end is an event."""
        r = self.links.start(key)
        if r is not None:
            self._push(now + self.links.transfer_ms(r), _TRANSFER_END, (key, r.w.id))

    def _transfer_end(self, now: float, key: LinkKey, rid: str) -> None:
        self.links.finish(key)
        r = self.reqs[rid]
        if r.migrating:
            self._migrated(now, key, r)
            return
        r.kv_arrived_ms = now
        self.prefill[r.prefill_node].release(rid)
        self.decode[r.decode_node].kv_arrived(rid)
        self._start_transfer(now, key)
        self._kick(now, "p", r.prefill_node)  # freed blocks may admit waiting prefills
        self._kick(now, "d", r.decode_node)

    # -- TaiChi flowing decode ------------------------------------------------------------------
    def _flow(self, now: float, p: int, plan: StepPlan) -> None:
        """After a step of P-heavy node ``p``: start migrating each request that decoded in it and
        whose mean time per output token so far exceeds ``flow_tpot_fraction``·τ."""
        limit = self.params.flow_tpot_fraction * self.params.tbt_slo_ms
        src = self.prefill[p]
        for rid in plan.decode_ids:
            r = self.reqs[rid]
            if r.migrating or r.done or len(r.token_times_ms) < 2:
                continue
            tpot = (r.token_times_ms[-1] - r.token_times_ms[0]) / (len(r.token_times_ms) - 1)
            if tpot <= limit:
                continue
            prog = src.progress(rid)
            if prog is None:
                continue
            generated = prog[1]
            di = min(range(len(self.decode)), key=lambda j: (self.decode[j].state().kv_tokens, j))
            r.migrating, r.migrate_from, r.decode_node = True, generated, di
            self.decode[di].add_remote_decode(rid, r.w.prompt_tokens + generated, r.w.output_tokens - generated,
                                              r.w.block_hashes)
            self._kick(now, "d", di)

    def _migrated(self, now: float, key: LinkKey, r: SimRequest) -> None:
        """The migrating KV of ``r`` arrived: the source drops it, the target resumes decoding."""
        src, dst = self.prefill[r.prefill_node], self.decode[r.decode_node]
        r.migrating = False
        prog = src.progress(r.w.id)
        if prog is None:  # finished on the source meanwhile (its target reservation is gone)
            dst.abort(r.w.id)
        else:
            src.abort(r.w.id)
            dst.kv_arrived(r.w.id, generated=prog[1] - r.migrate_from)
        self._start_transfer(now, key)
        self._kick(now, "p", r.prefill_node)
        self._kick(now, "d", r.decode_node)

    def _cancel_migration(self, now: float, r: SimRequest) -> None:
        """``r`` finished on its P-heavy node while migrating: free the target's reservation and
        drop a transfer that has not started (a running one ends in :meth:`_migrated`)."""
        if self.links.unqueue((r.prefill_node, r.decode_node), r):
            r.migrating = False
            self.decode[r.decode_node].abort(r.w.id)
        elif self.decode[r.decode_node].phase(r.w.id) == "waiting":
            r.migrating = False
            self.decode[r.decode_node].abort(r.w.id)
        self._kick(now, "d", r.decode_node)
