"""Profiler: drives one decode node through the §3.2 grid over the bus, collects its step records,
fits the latency model, and publishes the artifact (``kairos profile``).

Inputs: the node's step records on ``kairos.steps.<node>`` (:class:`~kairos.contracts.wire.StepRecordEvent`,
any backend) and heartbeats on ``kairos.state.<node>``. Outputs: KV handoffs
(``kairos.kv.<node>``, background decodes), deflect jobs (``kairos.jobs.<node>``, the measured
chunks), cancels, and the artifact in the KV bucket ``kairos_models`` under ``latency.<name>`` and
``latency.current`` (dispatchers watch the latter and hot-reload). The plan is
:class:`kairos.core.model.profiling.ProfileGrid`; fitting and its hygiene are :func:`kairos.core.model.fitting.fit_latency_model`.

The profiled node should not serve traffic meanwhile (its jobs would mix into the samples; the
samples stay valid — every step record is a sample — but the grid would not be the one planned).
The profiler's requests carry ids ``prof-<run>-<n>``; every request it starts is cancelled at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import nats.errors
import nats.js.errors
import numpy as np

from kairos.contracts import subjects as S
from kairos.runtime.bus import ensure_buckets, ensure_models_bucket, flush_barrier, publish, request_typed
from kairos.runtime.lanes import ensure_claims_bucket
from kairos.contracts.permissions import PROFILER, kv_stream
from kairos.core.model.fitting import FitRefused, StepRecord, fit_latency_model
from kairos.core.model.latency import LatencyModel
from kairos.core.model.profiling import (ProfileGrid, default_version, fit_summary, prefix_schedule, provenance, step_records,
                              warmup_steps)
from kairos.core.workload.workloads import WorkloadRequest
from kairos.contracts.wire import (Cancel, ErrorEvent, InferenceRequest, Job, JobAck, KvAck, KvHandoff, NodeState,
                         OutEvent, HandoffEvent, SamplingParams, StepRecordEvent, WireError, decode, decode_step_records, now_ms)


#: token ids of the profiler's prompts are drawn from this range (half-open): inside any real vocabulary,
#: the tiny test model's too (every id in [1, 1000] is a token; vLLM refuses an id outside the vocabulary).
#: 993 values are plenty against prefix-cache hits: two random prompts share a 16-token block with
#: probability 993^-16
PROMPT_ID_RANGE = (7, 1000)
#: output tokens of a background decode: outlasts one batch's measurements (dwell + chunks + bus
#: round trips are a few hundred steps at most); they are cancelled afterwards anyway
BACKGROUND_TOKENS = 1024


#: a node silent for this long (and at least 10 heartbeat periods) during a run has stopped (s)
HEARTBEAT_LOSS_S = 5.0


class ProfileError(RuntimeError):
    """The node did not take the profiler's work (refused, silent or lost it): the message says which.
    ``partial`` holds what the run collected until then (its step records), if anything."""

    partial: "ProfileRun | None" = None


@dataclass
class ProfileRun:
    """What one profiling run collected."""

    events: list[StepRecordEvent] = field(default_factory=list)
    replay_counts: dict[str, int] = field(default_factory=dict)  #: :meth:`Profiler.replay`'s counts, if any
    extra: dict[str, Any] = field(default_factory=dict)  #: more provenance for the artifact's metadata (load average)
    started_unix_ms: float = 0.0
    finished_unix_ms: float = 0.0

    @property
    def records(self) -> list[StepRecord]:
        """The step records as fitting samples (:func:`kairos.core.model.profiling.step_records`)."""
        return step_records(self.events)


class Profiler:
    """Drive ``node`` through ``grid`` (see the module docstring). Use :meth:`run`.

    Args:
        nc: a connected NATS client.
        node: the decode node's id.
        grid: the plan.
        background: how the B background decodes are started: ``handoff`` (KV handoffs from
            pseudo prefill nodes, all at once; the backend emulates/pulls the KV) or ``deflect``
            (deflect jobs one after another, each prefilled on the node itself — for backends
            whose KV pull cannot take a pseudo source).
        served_model: the model name the requests carry (a real engine checks it).
        step_timeout_s: the node must report a step within this while it has work.
        max_model_len: the node's context limit (prompt + output tokens; None: no limit). Background
            decodes then get at most ``max_model_len − ctx`` output tokens, and grid points whose
            prompt does not fit are skipped (reported through ``progress``) instead of refused by
            a real engine mid-run.
        seed: seed of the random prompt token ids.
        progress: called with one line per grid point (None: silent).
        heartbeat_loss_s: the run fails (ProfileError) once the node has sent no heartbeat for this
            long, and at least 10 of its heartbeat periods (seconds).
    """

    def __init__(self, nc, node: str, grid: ProfileGrid, *, background: str = "handoff",
                 served_model: str = "kairos-emulated", step_timeout_s: float = 10.0,
                 progress: Callable[[str], None] | None = None, seed: int = 0,
                 max_model_len: int | None = None, heartbeat_loss_s: float = HEARTBEAT_LOSS_S) -> None:
        if background not in ("handoff", "deflect"):
            raise ValueError(f"background must be handoff or deflect, got {background!r}")
        self.nc, self.node, self.grid = nc, S.check_token(node, "node id"), grid
        self.background = background
        self.served_model = served_model
        self._rng = np.random.default_rng(seed)
        self.step_timeout_s = step_timeout_s
        self.max_model_len = max_model_len
        self.progress = progress or (lambda _line: None)
        self.tag = uuid.uuid4().hex[:8]
        self._n = 0
        self.result = ProfileRun()
        self.state: NodeState | None = None
        self._changed = asyncio.Event()
        self._outs: dict[str, asyncio.Future] = {}
        self._live: set[str] = set()
        self._subs: list = []
        self._state_rx: float | None = None  #: monotonic time of the node's last heartbeat (s)
        self.heartbeat_loss_s = heartbeat_loss_s

    # -- bus plumbing ---------------------------------------------------------------------------
    async def _on_step(self, msg) -> None:
        try:
            self.result.events.extend(decode_step_records(msg.data))
        except WireError:
            return
        self._changed.set()

    async def _on_state(self, msg) -> None:
        try:
            self.state = decode(msg.data, NodeState)
        except WireError:
            return
        self._state_rx = time.monotonic()
        self._changed.set()

    async def _watch_heartbeats(self) -> None:
        """Raise ProfileError once the node has been silent for ``heartbeat_loss_s`` (at least 10
        heartbeat periods) after its first heartbeat: its agent died, or this profiler lost NATS."""
        while True:
            limit = self.heartbeat_loss_s
            if self.state is not None:
                limit = max(limit, 10 * self.state.period_ms / 1000.0)
            age = None if self._state_rx is None else time.monotonic() - self._state_rx
            if age is not None and age > limit:
                if not self.nc.is_connected:
                    raise ProfileError(f"lost the connection to NATS ({age:.0f} s without a heartbeat of node "
                                       f"{self.node})")
                raise ProfileError(f"node {self.node} sent no heartbeat for {age:.0f} s: its agent stopped or lost "
                                   "NATS")
            await asyncio.sleep(min(1.0, limit / 5))

    async def _on_out(self, msg) -> None:
        try:
            ev = decode(msg.data, OutEvent)
        except WireError:
            return
        if isinstance(ev, HandoffEvent):  # a keep job's prefill node naming its decode node: not an end
            return
        fut = self._outs.get(ev.request_id)
        if fut is not None and not fut.done():
            fut.set_result(ev)  # first token, done or error: the prefill is over either way

    async def _until(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait (on bus events, no polling sleeps) until ``pred()``; ProfileError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProfileError(f"node {self.node}: {what} (no progress for {timeout_s:g} s)")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _request(self, prompt: int, max_tokens: int) -> InferenceRequest:
        """A request a real engine can run too: random token ids (no prefix-cache hits between the
        profiler's requests) and ``ignore_eos`` (exactly ``max_tokens`` outputs)."""
        self._n += 1
        now = now_ms()
        ids = self._rng.integers(PROMPT_ID_RANGE[0], PROMPT_ID_RANGE[1], prompt).tolist()
        return InferenceRequest(request_id=f"prof-{self.tag}-{self._n}", model=self.served_model, prompt_tokens=prompt,
                                max_tokens=max_tokens, prompt_token_ids=ids, sampling=SamplingParams(ignore_eos=True),
                                created_unix_ms=now, deadline_unix_ms=now + 3_600_000.0)

    # -- grid actions ---------------------------------------------------------------------------
    async def _background(self, batch: int, ctx: int) -> list[str]:
        """Start ``batch`` decodes of ``ctx`` context tokens (KV handoffs from distinct pseudo
        sources, so their transfers run in parallel) and wait until they all decode."""
        rids = []
        out = self._background_tokens(ctx)
        for i in range(batch):
            if self.background == "deflect":
                rids.append(await self._deflect(ctx, [], out))
                continue
            req = self._request(ctx, out)
            msg = KvHandoff(request=req, src_node=f"profiler-{self.tag}-{i}", kv_tokens=ctx,
                            prefill_done_unix_ms=now_ms())
            ack = await self._ask(S.kv_subject(self.node, PROFILER), msg, KvAck)
            if not ack.accepted:
                raise ProfileError(f"node {self.node} refused a background decode: {ack.reason}")
            rids.append(req.request_id)
            self._live.add(req.request_id)
        n0 = len(self.result.events)
        dwell = self.grid.decode_dwell_steps
        await self._until(lambda: sum(1 for e in self.result.events[n0:] if e.batch_size >= batch) >= dwell,
                          self.step_timeout_s + 30.0, f"{batch} background decodes never ran together")
        return rids

    def _background_tokens(self, ctx: int) -> int:
        """Output tokens of a background decode of ``ctx`` context tokens (within the node's context)."""
        return BACKGROUND_TOKENS if self.max_model_len is None else min(BACKGROUND_TOKENS, self.max_model_len - ctx)

    def _fits(self, prompt: int, output: int) -> bool:
        return self.max_model_len is None or prompt + output <= self.max_model_len

    async def _chunks(self, prompt: int, chi: int, batch: int = 0, prefix: int = 0) -> None:
        """One deflected prefill with ``[χ] × chunk_steps`` beside ``batch`` background decodes (the job's
        ``decision_batch_size``: a vLLM node runs χ − B prompt tokens per step, the emulated engine
        subtracts its own B), after ``prefix`` prompt tokens (:func:`kairos.core.model.profiling.prefix_schedule`);
        returns when its prefill is done."""
        rid = await self._deflect(prompt, prefix_schedule(prefix, batch) + [chi] * self.grid.chunk_steps, 1, batch)
        self._live.discard(rid)  # max_tokens 1: finished with its first token

    async def _deflect(self, prompt: int, schedule: list[int], max_tokens: int, batch: int = 0) -> str:
        """Send one deflect job and wait for its first token (its prefill is done); returns its id."""
        req = self._request(prompt, max_tokens)
        rid = req.request_id
        sub = await self.nc.subscribe(S.out_wildcard(rid), cb=self._on_out)
        fut = self._outs[rid] = asyncio.get_running_loop().create_future()
        try:
            job = Job(kind="deflect", request=req, node=self.node, chunk_schedule=schedule,
                      decision_batch_size=batch, dispatcher_id=f"profiler-{self.tag}")
            ack = await self._ask(S.jobs_subject(self.node), job, JobAck)
            if not ack.accepted:
                raise ProfileError(f"node {self.node} refused a profiling job: {ack.reason}")
            self._live.add(rid)
            timeout = self.step_timeout_s * (self.grid.chunk_steps + 1)
            try:
                ev = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise ProfileError(f"node {self.node}: chunked prefill {rid} not done in {timeout:g} s") from None
            if isinstance(ev, ErrorEvent):
                raise ProfileError(f"node {self.node} failed {rid}: {ev.code} {ev.message}")
            return rid
        finally:
            self._outs.pop(rid, None)
            await sub.unsubscribe()

    async def _ask(self, subject: str, msg, reply_type):
        try:
            return await request_typed(self.nc, subject, msg, reply_type, timeout=5.0)
        except nats.errors.NoRespondersError:
            raise ProfileError(f"no node agent answers on {subject} (is node {self.node} up?)") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise ProfileError(f"node {self.node} did not answer on {subject} within 5 s") from None

    async def _drain(self, rids: list[str]) -> None:
        """Cancel ``rids`` and wait for a heartbeat sent afterwards that shows an idle node."""
        for rid in rids:
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason="profiler"))
            self._live.discard(rid)
        t = now_ms()
        await self._until(lambda: self.state is not None and self.state.sent_unix_ms > t and self.state.running == 0
                          and self.state.waiting == 0, self.step_timeout_s + 10.0, "did not become idle after cancels")

    async def _handoff(self, prompt: int, output: int, i: int) -> str | None:
        """One background decode by KV handoff; None if the node refused it."""
        req = self._request(prompt, output)
        msg = KvHandoff(request=req, src_node=f"profiler-{self.tag}-{i}", kv_tokens=prompt, prefill_done_unix_ms=now_ms())
        ack = await self._ask(S.kv_subject(self.node, PROFILER), msg, KvAck)
        if not ack.accepted:
            return None
        self._live.add(req.request_id)
        return req.request_id

    async def replay(self, workload: Sequence[WorkloadRequest], time_scale: float = 1.0) -> dict[str, int]:
        """Trace replay on the node (realistic mixes of B, K and chunks): each request at its
        arrival time (× ``time_scale``) becomes a deflection — its prefill runs here in chunks of
        the engine's budget, then it decodes — when none of the profiler's is in flight, else a KV
        handoff (it only decodes here). Requests the node refuses (too long, no memory) are
        skipped and counted. Everything still running at the end is cancelled.

        Returns:
            counts: ``deflected``, ``handed_off``, ``refused``.
        """
        counts = {"deflected": 0, "handed_off": 0, "refused": 0}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deflecting: asyncio.Task | None = None
        try:
            for i, w in enumerate(workload):
                delay = t0 + w.arrival_s * time_scale - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the replay (arrival times), not synchronization
                if deflecting is not None and deflecting.done():
                    if deflecting.exception() is not None:
                        counts["refused"] += 1
                    deflecting = None
                if deflecting is None:
                    deflecting = asyncio.create_task(self._deflect(w.prompt_tokens, [], w.output_tokens))
                    counts["deflected"] += 1
                elif await self._handoff(w.prompt_tokens, w.output_tokens, i) is None:
                    counts["refused"] += 1
                else:
                    counts["handed_off"] += 1
            if deflecting is not None:
                try:
                    await deflecting
                except ProfileError:
                    counts["refused"] += 1
        finally:
            if deflecting is not None and not deflecting.done():
                deflecting.cancel()
        await self._drain(list(self._live))
        return counts

    # -- the run --------------------------------------------------------------------------------
    async def run(self, replay: Sequence[WorkloadRequest] = ()) -> ProfileRun:
        """Run the whole grid, then the optional trace ``replay`` (:meth:`replay`); every request
        started is cancelled even on failure.

        Raises:
            ProfileError: the node refused, lost or never ran the profiler's work.
        """
        # the node's claims need a claim bucket and its records the requests bucket, which an agent may
        # not create (docs/security.md); a running deployment's control plane has declared its own
        js = self.nc.jetstream()
        await ensure_buckets(js, replicas=None)  # a cluster's: whatever replicas it has
        try:
            await js.stream_info(kv_stream(S.claims_bucket(0)))
        except nats.js.errors.NotFoundError:
            await ensure_claims_bucket(js, 0, 1)  # a single server's one claim bucket (kairos/runtime/lanes.py)
        self._subs = [await self.nc.subscribe(S.steps_subject(self.node), cb=self._on_step),
                      await self.nc.subscribe(S.state_subject(self.node), cb=self._on_state)]
        await flush_barrier(self.nc)
        self.result.started_unix_ms = now_ms()
        grid_task = asyncio.ensure_future(self._run_grid(replay))
        watchdog = asyncio.ensure_future(self._watch_heartbeats())
        try:
            await asyncio.wait({grid_task, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            # the grid's outcome, or the watchdog's ProfileError (the node went silent; the grid is
            # cancelled below)
            (grid_task if grid_task.done() else watchdog).result()
        except ProfileError as exc:
            exc.partial = self.result
            raise
        finally:
            for t in (grid_task, watchdog):
                t.cancel()
            await asyncio.gather(grid_task, watchdog, return_exceptions=True)
            for rid in list(self._live):
                try:
                    await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason="profiler"))
                except Exception:
                    pass
            for sub in self._subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is gone: so is the subscription
                    pass
            self.result.finished_unix_ms = now_ms()
        return self.result

    async def _run_grid(self, replay: Sequence[WorkloadRequest]) -> None:
        """The body of :meth:`run`: the grid's phases, the replay, the final idle heartbeat."""
        g = self.grid
        await self._until(lambda: self.state is not None, 10.0, "sent no heartbeat")
        if self.state.role != "decode":
            raise ProfileError(f"node {self.node} is a {self.state.role} node; profile a decode node "
                               "(its engine runs prefill-only, decode-only and mixed steps)")
        await self._drain([])
        self.result.extra["idle_free_kv_tokens"] = self.state.free_kv_tokens  # the node's KV capacity, measured
        for n in g.prefill_chunks:  # prefill-only steps with a growing cached prefix
            prompt = g.chunk_steps * n
            if not self._fits(prompt, 1):  # shortened to the context while a chunk follows the first
                prompt = self.max_model_len - 1 if self.max_model_len - 1 > n else 0
            if not prompt:
                self.progress(f"prefill-only χ={n}: skipped, a chunk of {n} prompt tokens fills the node's "
                              f"context {self.max_model_len}")
                continue
            for _ in range(g.repeats):
                await self._chunks(prompt, n)
            self.progress(f"prefill-only χ={n}: {len(self.result.events)} steps recorded")
        for batch, ctx, chis in g.mixed_plan():
            fit = [chi for chi in chis if self._fits(g.chunk_steps * (chi - batch), 1)]
            if self._background_tokens(ctx) < self.grid.decode_dwell_steps or not fit:
                self.progress(f"B={batch} ctx={ctx}: skipped, its requests exceed the node's context "
                              f"{self.max_model_len}")
                continue
            if fit != chis:
                self.progress(f"B={batch} ctx={ctx}: χ={sorted(set(chis) - set(fit))} skipped (prompts exceed "
                              f"the node's context {self.max_model_len})")
                chis = fit
            need = batch * (ctx + self._background_tokens(ctx))
            if self.state is not None and need > self.state.free_kv_tokens:
                self.progress(f"B={batch} ctx={ctx}: skipped, needs {need} KV tokens, node has "
                              f"{self.state.free_kv_tokens} free")
                continue
            rids = await self._background(batch, ctx)
            for prefix in g.mixed_prefixes:
                for chi in chis:
                    if not self._fits(prefix + g.chunk_steps * (chi - batch), 1):
                        continue  # the prefixed run of a large χ: its prompt exceeds the context
                    for _ in range(g.repeats):
                        await self._chunks(prefix + g.chunk_steps * (chi - batch), chi, batch, prefix)
            self.progress(f"B={batch} ctx={ctx} χ={chis}: {len(self.result.events)} steps recorded")
            await self._drain(rids)
        if replay:
            counts = self.result.replay_counts = await self.replay(replay)
            self.progress(f"replay of {len(replay)} requests {counts}: {len(self.result.events)} steps recorded")
        # an idle heartbeat follows the records of every step before it (the node agent sends
        # them first): after it, nothing the run caused is still on its way
        await self._drain(list(self._live))


def fit_run(run: ProfileRun, *, node: str, grid_name: str, grid: ProfileGrid, name: str, version: str | None,
            base: LatencyModel, engine: str, served_model: str, label: str, max_mape: float | None) -> LatencyModel:
    """Fit a profiling run into a versioned artifact with provenance (``kairos.core.model.profiling.provenance``).

    Raises:
        FitRefused: held-out MAPE above ``max_mape`` (nothing may be published).
        ValueError: too few valid steps of a kind.
    """
    warm = warmup_steps(run.events)  # a new step shape's one-off cost is not what serving sees
    meta = provenance(node=node, grid_name=grid_name, grid=grid, events=run.events, engine=engine,
                      served_model=served_model, label=label, started_unix_ms=run.started_unix_ms,
                      finished_unix_ms=run.finished_unix_ms,
                      extra={**({"replay": run.replay_counts} if run.replay_counts else {}), **run.extra,
                             "warmup_steps": len(warm)})
    return fit_latency_model(step_records(e for e in run.events if e.step not in warm), name=name,
                             version=version or default_version(), base=base, metadata=meta, max_mape=max_mape)


async def publish_model(nc, model: LatencyModel, current: bool = True) -> dict[str, int]:
    """Put the artifact into KV ``kairos_models`` under ``latency.<name>`` (and ``latency.current``,
    which the dispatchers watch). Returns key → revision."""
    kv = await ensure_models_bucket(nc.jetstream(), replicas=None)
    body = json.dumps(model.to_dict()).encode()
    out = {S.model_key(model.name): await kv.put(S.model_key(model.name), body)}
    if current:
        out[S.CURRENT_MODEL_KEY] = await kv.put(S.CURRENT_MODEL_KEY, body)
    return out


__all__ = ["Profiler", "ProfileRun", "ProfileError", "fit_run", "publish_model", "FitRefused", "fit_summary"]
