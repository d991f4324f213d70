"""Discrete-event P/D cluster simulator (paper §3.3–3.4, §6), in virtual time.

Where things come from: arrivals from ``kairos.core.workload.workloads``; every node is the engine model of
``kairos.core.engine`` (the same one the emulated node agent runs in real time); decisions come from
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
  what CALIBRATION.md §C says the paper's transfer times contain.
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
  guard) but advance the clock by their own :class:`~kairos.core.engine.GroundTruth`: ``truth``
  (another artifact: an error of form), ``truth_scale`` (a bias), ``drift`` (one node slower from
  a given time on) and ``noise`` (multiplicative log-normal σ on every step). With none of them
  the truth *is* the policy's model — the exact-model run the model-error report compares with.
* **Model correction.** For a policy with ``model_correction`` (kairos+), every step's
  (predicted, actual) feeds one :class:`~kairos.core.model.correction.CorrectionEstimator` (the class the
  live aggregator runs); its per-node corrections are refreshed with the view (every Δh) and put
  into the snapshots. Other policies skip this work (they ignore the fields). With the node-side guard on, a decode
  engine's guard limit is β·τ / its ``safety`` (the node knows its own residuals).

Event order is deterministic: the heap is keyed ``(time_ms, priority, sequence)``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kairos.core.model.correction import IDENTITY, CorrectionEstimator, StepCorrection
from kairos.core.engine import Engine
from kairos.core.engine import EngineConfig
from kairos.core.engine import GroundTruth
from kairos.core.model.latency import LatencyModel
from kairos.core.workload.serving_metrics import RequestRecord
from kairos.core.policy import Policy
from kairos.core.policy import PolicyParams
from kairos.core.cluster.routing import deflection_slots, keep_instead
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, InFlightDeflection, PrefillNodeView, RequestView
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.workload.workloads import MOONCAKE_BLOCK_TOKENS, WorkloadRequest

# event kinds, in priority order for equal timestamps (heartbeats first so that a decision at the
# same instant sees the fresh state; step ends before arrivals so freed capacity is visible)
_HEARTBEAT, _STEP_END, _TRANSFER_END, _ARRIVAL = range(4)


@dataclass(frozen=True)
class SimConfig:
    """Cluster and experiment settings.

    Attributes:
        n_prefill, n_decode: node counts (paper: 2P2D).
        heartbeat_ms: Δh, state refresh period of the dispatcher view; 0 = exact state (Oracle).
        link: KV-transfer link name from the profile (None: its default, the paper-calibrated one).
        tbt_guard: kairos+ node-side guard: decode engines shrink a deflected chunk whose predicted
            step would exceed β·τ at the current batch.
        truth: ground-truth latency model of the engines (None: the policy's model).
        truth_scale: every engine's steps take this × the truth model (1.1: 10 % slower).
        drift_node: node id (``decode-0``) that drifts; None: no drift.
        drift_scale: from ``drift_at_s`` on, ``drift_node``'s steps take this × longer (1.15).
        drift_at_s: simulated time (s) the drift starts.
        noise: σ of multiplicative log-normal noise on every step's latency (0: none).
        seed: RNG seed of the noise.
        correction_window_ms: sliding window of the model-correction estimator (ms).
        reservation_rule: apply the live dispatcher's reservation rule (kairos/core/cluster/routing.py rule 3)
            with ``deflection_slots`` per decode node; False: deflections queue on any node.
        deflection_slots: deflections per decode node under the rule; 0: the policy's live
            default (:func:`kairos.core.cluster.routing.deflection_slots`).
        prefix_caching: engines keep prefix caches (kairos/core/engine/prefix.py); requests with block
            hashes (the Mooncake trace) hit them. The dispatcher's prefix index is refreshed with
            the view (every Δh) from the engines' cache events.
        prefix_block_tokens: tokens per hashed block of the workload's ``block_hashes`` (the
            Mooncake trace: 512).
    """

    n_prefill: int = 2
    n_decode: int = 2
    heartbeat_ms: float = 100.0
    link: str | None = None
    tbt_guard: bool = False
    truth: LatencyModel | None = None
    truth_scale: float = 1.0
    drift_node: str | None = None
    drift_scale: float = 1.0
    drift_at_s: float = 0.0
    noise: float = 0.0
    seed: int = 0
    correction_window_ms: float = 10_000.0
    reservation_rule: bool = True
    deflection_slots: int = 0
    prefix_caching: bool = True
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS


@dataclass
class _Req:
    w: WorkloadRequest
    deflected: bool = False
    prefill_node: int = -1
    decode_node: int = -1
    prefill_start_ms: float | None = None
    prefill_end_ms: float | None = None
    kv_arrived_ms: float | None = None
    first_token_ms: float | None = None
    token_times_ms: list[float] = field(default_factory=list)
    # deflection bookkeeping: decodes running at decision and predicted step ms (violation attribution)
    decided_decodes: frozenset[str] = frozenset()
    predicted_steps: list[float] = field(default_factory=list)
    # TaiChi flowing decode: decoding on its prefill node; migration in progress; tokens at its start
    local: bool = False
    migrating: bool = False
    migrate_from: int = 0
    done: bool = False
    transfer_tokens: int = 0  #: keep path: prompt tokens the decode node lacked (KV transferred)
    cached_tokens: int = 0  #: prompt tokens the prefilling node served from its prefix cache


@dataclass
class DeflectedStep:
    """One executed step of a deflected prefill (for TBT-violation attribution)."""

    request_id: str
    step_index: int
    predicted_ms: float | None  #: the dispatcher's prediction for this step (None past the plan)
    actual_ms: float
    batch_at_decision: int
    batch_at_step: int
    decode_joined: bool  #: a decode that was not running at the decision is in this step's batch


@dataclass
class SimResult:
    """Raw output of one run."""

    records: list[RequestRecord]
    #: latency of every step with ≥ 1 decode in it (decode nodes; prefill nodes only under TaiChi)
    decode_step_ms: list[float]
    deflected_steps: list[DeflectedStep]
    deflections: int
    sim_seconds: float
    #: (end time ms, node) of each entry of ``decode_step_ms``: decode node index i, or −1−i for
    #: prefill node i (drift analysis)
    decode_step_at: list[tuple[float, int]] = field(default_factory=list)


class Simulator:
    """One run of one policy over one workload. Use :meth:`run`.

    Raises:
        ValueError: fewer than one prefill or decode node.
    """

    def __init__(self, cfg: SimConfig, model: LatencyModel, policy: Policy, params: PolicyParams) -> None:
        if cfg.n_prefill < 1 or cfg.n_decode < 1:
            raise ValueError("need at least one prefill and one decode node")
        self.cfg, self.model, self.policy = cfg, model, policy
        self.params = policy.params(params)
        truth = cfg.truth or model
        self.prefill_ids = [f"prefill-{i}" for i in range(cfg.n_prefill)]
        self.decode_ids = [f"decode-{i}" for i in range(cfg.n_decode)]
        if cfg.drift_node is not None and cfg.drift_node not in self.prefill_ids + self.decode_ids:
            raise ValueError(f"drift node {cfg.drift_node!r} is not one of {self.prefill_ids + self.decode_ids}")
        self._now = 0.0

        def ground_truth(node: str) -> GroundTruth | None:
            drifts = node == cfg.drift_node and cfg.drift_scale != 1.0
            if truth is model and cfg.truth_scale == 1.0 and not drifts:
                return None  # the exact-model run: the engine's prediction is the truth (no second evaluation)
            return GroundTruth(truth, scale=cfg.truth_scale, drift_scale=cfg.drift_scale if drifts else 1.0,
                               drift_at_ms=cfg.drift_at_s * 1000.0 if drifts else math.inf,
                               clock=lambda: self._now)

        self.corrector = CorrectionEstimator(window_ms=cfg.correction_window_ms)
        self._corr: dict[str, StepCorrection] = {}
        self._correcting = self.params.model_correction  # only kairos+ reads corrections: skip the work otherwise
        rng = np.random.default_rng(cfg.seed)
        noise = None
        if cfg.noise > 0:
            sigma = cfg.noise

            def noise(ms: float) -> float:
                return ms * math.exp(sigma * rng.standard_normal() - sigma * sigma / 2)

        guard = self.params.step_limit_ms if cfg.tbt_guard else None
        self.guard_ms = guard
        pc = dict(prefix_block_tokens=cfg.prefix_block_tokens, prefix_caching=cfg.prefix_caching)
        pcfg = EngineConfig.from_limits("prefill", truth.engine, **pc)
        if self.params.flowing_decode:  # TaiChi P-heavy instances: the chunk-size slider
            pcfg = dataclasses.replace(pcfg, max_num_batched_tokens=max(self.params.prefill_chunk_tokens,
                                                                        pcfg.max_num_seqs))
        self.slots = (cfg.deflection_slots or deflection_slots(policy.name)) if cfg.reservation_rule else None
        self.prefill = [Engine(pcfg, model, step_noise=noise, truth=ground_truth(n)) for n in self.prefill_ids]
        self.decode = [Engine(EngineConfig.from_limits("decode", truth.engine, **pc), model, step_noise=noise,
                              tbt_guard_ms=guard, truth=ground_truth(n)) for n in self.decode_ids]
        self.prefix_index = PrefixIndex(cfg.prefix_block_tokens)
        self.link = truth.link(cfg.link)
        self.kv_bytes = truth.kv_bytes_per_token

    # -- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self, workload: Sequence[WorkloadRequest]) -> SimResult:
        """Simulate until every request has finished. Deterministic for a given seed."""
        self._heap: list = []
        self._seq = 0
        self.reqs: dict[str, _Req] = {}
        self.busy = {("p", i): False for i in range(len(self.prefill))} | {("d", i): False for i in range(len(self.decode))}
        self.links: dict[tuple[int, int], list[str]] = {}
        self.link_busy: set[tuple[int, int]] = set()
        self.reserved: dict[int, dict[str, int]] = {i: {} for i in range(len(self.decode))}
        self.routed_since: dict[int, list[int]] = {i: [] for i in range(len(self.prefill))}
        self.decode_steps: list[float] = []
        self.decode_step_at: list[tuple[float, int]] = []
        self.deflected_steps: list[DeflectedStep] = []
        self.deflections = 0
        for w in workload:
            self._push(w.arrival_s * 1000.0, _ARRIVAL, w)
        hb = self.cfg.heartbeat_ms
        self._view_p = [e.state() for e in self.prefill]
        self._view_d = [e.state() for e in self.decode]
        if hb > 0 and workload:
            self._push(0.0, _HEARTBEAT, None)
        pending = len(workload)
        now = 0.0
        while self._heap:
            now, kind, _, payload = heapq.heappop(self._heap)
            self._now = now
            if kind == _ARRIVAL:
                self._arrive(now, payload)
            elif kind == _STEP_END:
                pending -= self._step_end(now, *payload)
            elif kind == _TRANSFER_END:
                self._transfer_end(now, *payload)
            elif kind == _HEARTBEAT:
                self._view_p = [e.state() for e in self.prefill]
                self._view_d = [e.state() for e in self.decode]
                self._refresh_prefix_index()
                self._refresh_corrections(now)
                for q in self.routed_since.values():
                    q.clear()
                if pending > 0:
                    self._push(now + hb, _HEARTBEAT, None)
        records = [self._record(r) for r in self.reqs.values()]
        return SimResult(records=records, decode_step_ms=self.decode_steps, deflected_steps=self.deflected_steps,
                         deflections=self.deflections, sim_seconds=now / 1000.0, decode_step_at=self.decode_step_at)

    def _refresh_prefix_index(self) -> None:
        """Apply every engine's prefix-cache events since the last refresh to the view's index."""
        for nid, eng in zip(self.prefill_ids + self.decode_ids, self.prefill + self.decode):
            stored, removed = eng.drain_cache_events()
            if stored or removed:
                self.prefix_index.apply(nid, stored, removed)

    def _refresh_corrections(self, now: float) -> None:
        """New per-node corrections (with the view); the guard of a correcting kairos+ node
        tightens to β·τ / safety."""
        if not self._correcting:
            return
        self._corr = self.corrector.corrections(now)
        if self.guard_ms is not None and self.params.model_correction:
            for nid, eng in zip(self.decode_ids, self.decode):
                eng.tbt_guard_ms = self.guard_ms / self._corr.get(nid, IDENTITY).safety

    # -- dispatcher ----------------------------------------------------------------------------
    def _snapshot(self, w: WorkloadRequest) -> ClusterSnapshot:
        exact = self.cfg.heartbeat_ms <= 0
        vp = [e.state() for e in self.prefill] if exact else self._view_p
        vd = [e.state() for e in self.decode] if exact else self._view_d
        if exact:
            self._refresh_corrections(self._now)
            self._refresh_prefix_index()
        corr = self._corr
        hits = self.prefix_index.match_tokens(w.block_hashes, w.prompt_tokens) if w.block_hashes else {}
        prefill = [PrefillNodeView(id=self.prefill_ids[i],
                                   queue_prompt_tokens=list(s.queue_prompt_tokens) + ([] if exact else self.routed_since[i]),
                                   kv_backlog_ms=self._link_backlog_ms(i),
                                   step_bias=corr.get(self.prefill_ids[i], IDENTITY).bias,
                                   cached_prefix_tokens=hits.get(self.prefill_ids[i], 0))
                   for i, s in enumerate(vp)]
        decode = []
        for i, s in enumerate(vd):
            res = self.reserved[i]
            full = self.slots is not None and len(res) >= self.slots  # as kairos.core.cluster.routing.build_snapshot
            decode.append(DecodeNodeView(
                id=self.decode_ids[i], batch_size=s.batch_size, kv_tokens=s.kv_tokens,
                deflection_in_flight=bool(res),
                in_flight=[] if full else [InFlightDeflection(prompt_tokens=self.reqs[r].w.prompt_tokens,
                                                              output_tokens=self.reqs[r].w.output_tokens) for r in res],
                waiting=s.waiting, step_bias=corr.get(self.decode_ids[i], IDENTITY).bias,
                step_safety=corr.get(self.decode_ids[i], IDENTITY).safety,
                cached_prefix_tokens=hits.get(self.decode_ids[i], 0)))
        return ClusterSnapshot(request=RequestView(id=w.id, prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens),
                               prefill_nodes=prefill, decode_nodes=decode)

    def _link_backlog_ms(self, p: int) -> float:
        """Queued KV-transfer work on prefill node ``p``'s links, ms (kairos+ input)."""
        total = 0.0
        for (pi, _), q in self.links.items():
            if pi == p:
                total += sum(self.link.transfer_ms(self.reqs[r].transfer_tokens, self.kv_bytes) for r in q)
        return total

    def _arrive(self, now: float, w: WorkloadRequest) -> None:
        r = _Req(w)
        self.reqs[w.id] = r
        snap = self._snapshot(w)
        d = self.policy.decide(snap, self.model, self.params)
        if d.decision == "deflect" and self.slots is not None \
                and len(self.reserved[self.decode_ids.index(d.node)]) >= self.slots:
            d = keep_instead(d, snap, self.model, self.params, "keep_reservation_conflict")
        if d.decision == "deflect":
            di = self.decode_ids.index(d.node)
            r.deflected, r.decode_node = True, di
            r.decided_decodes = self.decode[di].decoding_ids
            r.predicted_steps = list(d.predicted_step_ms)
            self.reserved[di][w.id] = w.prompt_tokens
            self.deflections += 1
            self.decode[di].add_deflected(w.id, w.prompt_tokens, w.output_tokens, list(d.chunk_schedule),
                                          w.block_hashes)
            self._kick(now, "d", di)
        else:
            pi = self.prefill_ids.index(d.node)
            r.prefill_node, r.decode_node = pi, self.decode_ids.index(d.decode_node)
            self.routed_since[pi].append(w.prompt_tokens)
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

    def _step_end(self, now: float, role: str, i: int, plan) -> int:
        eng = self.prefill[i] if role == "p" else self.decode[i]
        res = eng.commit_step(plan)
        self.busy[(role, i)] = False
        if self._correcting:
            self.corrector.observe((self.prefill_ids if role == "p" else self.decode_ids)[i], plan.predicted_ms,
                                   plan.duration_ms, now, mixed=plan.batch_size > 0 and plan.prefill_tokens > 0)
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
                self.reserved[r.decode_node].pop(rid, None)
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
        self.links.setdefault(key, []).append(rid)
        self._start_transfer(now, key)

    def _start_transfer(self, now: float, key: tuple[int, int]) -> None:
        q = self.links.get(key)
        if key in self.link_busy or not q:
            return
        rid = q.pop(0)
        self.link_busy.add(key)
        r = self.reqs[rid]
        ms = self.link.transfer_ms(r.transfer_tokens, self.kv_bytes)
        self._push(now + ms, _TRANSFER_END, (key, rid))

    def _transfer_end(self, now: float, key: tuple[int, int], rid: str) -> None:
        self.link_busy.discard(key)
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
    def _flow(self, now: float, p: int, plan) -> None:
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

    def _migrated(self, now: float, key: tuple[int, int], r: _Req) -> None:
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

    def _cancel_migration(self, now: float, r: _Req) -> None:
        """``r`` finished on its P-heavy node while migrating: free the target's reservation and
        drop a transfer that has not started (a running one ends in :meth:`_migrated`)."""
        key = (r.prefill_node, r.decode_node)
        q = self.links.get(key)
        if q and r.w.id in q:
            q.remove(r.w.id)
            r.migrating = False
            self.decode[r.decode_node].abort(r.w.id)
        elif self.decode[r.decode_node].phase(r.w.id) == "waiting":
            r.migrating = False
            self.decode[r.decode_node].abort(r.w.id)
        self._kick(now, "d", r.decode_node)

    # -- results -------------------------------------------------------------------------------
    def _record(self, r: _Req) -> RequestRecord:
        a = r.w.arrival_s * 1000.0
        if r.first_token_ms is None:
            return RequestRecord(id=r.w.id, arrival_s=r.w.arrival_s, prompt_tokens=r.w.prompt_tokens,
                                 output_tokens=0, deflected=r.deflected, error="not finished")
        pq = r.prefill_start_ms - a
        if r.deflected or r.local:
            pe, kv, dq = r.first_token_ms - r.prefill_start_ms, 0.0, 0.0
        else:
            pe = r.prefill_end_ms - r.prefill_start_ms
            kv = r.kv_arrived_ms - r.prefill_end_ms
            dq = r.first_token_ms - r.kv_arrived_ms
        return RequestRecord(
            id=r.w.id, arrival_s=r.w.arrival_s, prompt_tokens=r.w.prompt_tokens,
            output_tokens=len(r.token_times_ms), ttft_ms=r.first_token_ms - a,
            token_times_s=[t / 1000.0 for t in r.token_times_ms], deflected=r.deflected,
            prefill_queue_ms=pq, prefill_exec_ms=pe, kv_transfer_ms=kv, decode_queue_ms=dq,
            cached_tokens=r.cached_tokens)
