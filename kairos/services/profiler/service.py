"""Profiler: drives one decode node through the §3.2 grid over the bus, collects its step records,
fits the latency model, and publishes the artifact (``kairos profile``).

Inputs: the node's step records on ``kairos.steps.<node>`` (:class:`~kairos.contracts.wire.StepRecordEvent`,
any backend) and heartbeats on ``kairos.state.<node>``. Outputs: KV handoffs
(``kairos.kv.<node>``, background decodes), deflect jobs (``kairos.jobs.<node>``, the measured
chunks), cancels, and the artifact in the KV bucket ``kairos_models`` under ``latency.<name>`` and
``latency.current`` (dispatchers watch the latter and hot-reload). The plan is
:class:`kairos.core.model.profiling.ProfileGrid`; fitting and its hygiene are
:func:`kairos.core.model.fitting.fit_latency_model`.

The profiled node should not serve traffic meanwhile (its jobs would mix into the samples; the
samples stay valid — every step record is a sample — but the grid would not be the one planned).
The profiler's requests carry ids ``prof-<run>-<n>``; every request it starts is cancelled at the end.

Here: :class:`Profiler` — how each action talks to the node (deflect jobs, KV handoffs, cancels,
waiting on its heartbeats and step records) and :meth:`Profiler.run` (its subscriptions, tasks and
final cancels closed by one :class:`kairos.runtime.resources.Resources`); what is measured, in which
order, is :mod:`kairos.services.profiler.grid`; what a run collected, :mod:`kairos.services.profiler.results`;
:func:`fit_run` and :func:`publish_model` turn it into a published artifact.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Callable, Sequence

import nats.errors
import nats.js.errors
import numpy as np
import structlog

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.runtime.messaging import decoded, publish, request_typed
from kairos.runtime.streams import ensure_buckets, ensure_models_bucket
from kairos.contracts.permissions import PROFILER
from kairos.core.model.fitting import FitRefused, fit_latency_model
from kairos.core.model.latency import LatencyModel
from kairos.core.model.profiling import (ProfileGrid, default_version, fit_summary, prefix_schedule, provenance,
                                         step_records, warmup_steps)
from kairos.core.workload.workloads import WorkloadRequest
from kairos.contracts.events import Cancel, ErrorEvent, HandoffEvent, OutEvent
from kairos.contracts.wire import (decode_step_records, InferenceRequest, Job, JobAck, KvAck, KvHandoff, NodeState,
                                   SamplingParams, WireError)
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.resources import Resources
from kairos.services.profiler.grid import replay_trace, run_grid
from kairos.services.profiler.results import ProfileRunError, ProfileRun

_log = structlog.get_logger("kairos.profiler")


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
        heartbeat_loss_s: the run fails (ProfileRunError) once the node has sent no heartbeat for this
            long, and at least 10 of its heartbeat periods (seconds).
        clock: the clocks of its timeouts and request times (:data:`kairos.runtime.clock.SYSTEM_CLOCK`).
    """

    def __init__(self, nc, node: str, grid: ProfileGrid, *, background: str = "handoff",
                 served_model: str = "kairos-emulated", step_timeout_s: float = 10.0,
                 progress: Callable[[str], None] | None = None, seed: int = 0,
                 max_model_len: int | None = None, heartbeat_loss_s: float = HEARTBEAT_LOSS_S,
                 clock: Clock = SYSTEM_CLOCK) -> None:
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
        self._live: set[str] = set()  #: ids of the requests started and not yet over or cancelled
        self.clock = clock
        self._state_rx: float | None = None  #: monotonic time of the node's last heartbeat (s)
        self.heartbeat_loss_s = heartbeat_loss_s

    # -- bus plumbing ---------------------------------------------------------------------------
    async def _on_step(self, msg) -> None:
        try:
            self.result.events.extend(decode_step_records(msg.data))
        except WireError as exc:  # not a sample: the fit goes on without it
            _log.warning("bad_step_record", node=self.node, error=str(exc))
            return
        self._changed.set()

    async def _on_state(self, msg) -> None:
        if (state := decoded(msg.data, NodeState, _log, "bad_state", node=self.node)) is None:
            return
        self.state = state
        self._state_rx = self.clock.monotonic()
        self._changed.set()

    async def _watch_heartbeats(self) -> None:
        """Raise ProfileRunError once the node has been silent for ``heartbeat_loss_s`` (at least 10
        heartbeat periods) after its first heartbeat: its agent died, or this profiler lost NATS."""
        while True:
            limit = self.heartbeat_loss_s
            if self.state is not None:
                limit = max(limit, 10 * self.state.period_ms / 1000.0)
            age = None if self._state_rx is None else self.clock.monotonic() - self._state_rx
            if age is not None and age > limit:
                if not self.nc.is_connected:
                    raise ProfileRunError(f"lost the connection to NATS ({age:.0f} s without a heartbeat of node "
                                       f"{self.node})")
                raise ProfileRunError(f"node {self.node} sent no heartbeat for {age:.0f} s: its agent stopped or lost "
                                   "NATS")
            await self.clock.sleep(min(1.0, limit / 5))

    async def _on_out(self, msg) -> None:
        # a bad one: the request's end then shows as its timeout
        if (ev := decoded(msg.data, OutEvent, _log, "bad_out_event", node=self.node)) is None:  # type: ignore[arg-type]
            return
        if isinstance(ev, HandoffEvent):  # a keep job's prefill node naming its decode node: not an end
            return
        fut = self._outs.get(ev.request_id)
        if fut is not None and not fut.done():
            fut.set_result(ev)  # first token, done or error: the prefill is over either way

    async def until(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait (on bus events, no polling sleeps) until ``pred()``; ProfileRunError after ``timeout_s``."""
        deadline = self.clock.monotonic() + timeout_s
        while not pred():
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise ProfileRunError(f"node {self.node}: {what} (no progress for {timeout_s:g} s)")
            self._changed.clear()
            await self.clock.wait_event(self._changed, left)

    def _request(self, prompt: int, max_tokens: int) -> InferenceRequest:
        """A request a real engine can run too: random token ids (no prefix-cache hits between the
        profiler's requests) and ``ignore_eos`` (exactly ``max_tokens`` outputs)."""
        self._n += 1
        now = self.clock.now_ms()
        ids = self._rng.integers(PROMPT_ID_RANGE[0], PROMPT_ID_RANGE[1], prompt).tolist()
        return InferenceRequest(request_id=f"prof-{self.tag}-{self._n}", model=self.served_model, prompt_tokens=prompt,
                                max_tokens=max_tokens, prompt_token_ids=ids, sampling=SamplingParams(ignore_eos=True),
                                created_unix_ms=now, deadline_unix_ms=now + 3_600_000.0)

    # -- grid actions ---------------------------------------------------------------------------
    async def start_background(self, batch: int, ctx: int) -> list[str]:
        """Start ``batch`` decodes of ``ctx`` context tokens (KV handoffs from distinct pseudo
        sources, so their transfers run in parallel) and wait until they all decode."""
        rids = []
        out = self.background_tokens(ctx)
        for i in range(batch):
            if self.background == "deflect":
                rids.append(await self.deflect(ctx, [], out))
                continue
            rid, why = await self.handoff(ctx, out, i)
            if rid is None:
                raise ProfileRunError(f"node {self.node} refused a background decode: {why}")
            rids.append(rid)
        n0 = len(self.result.events)
        dwell = self.grid.decode_dwell_steps
        await self.until(lambda: sum(1 for e in self.result.events[n0:] if e.batch_size >= batch) >= dwell,
                          self.step_timeout_s + 30.0, f"{batch} background decodes never ran together")
        return rids

    def background_tokens(self, ctx: int) -> int:
        """Output tokens of a background decode of ``ctx`` context tokens (within the node's context)."""
        return BACKGROUND_TOKENS if self.max_model_len is None else min(BACKGROUND_TOKENS, self.max_model_len - ctx)

    def fits(self, prompt: int, output: int) -> bool:
        """``prompt`` + ``output`` tokens fit the node's context."""
        return self.max_model_len is None or prompt + output <= self.max_model_len

    async def measure_chunks(self, prompt: int, chi: int, batch: int = 0, prefix: int = 0) -> None:
        """One deflected prefill with ``[χ] × chunk_steps`` beside ``batch`` background decodes (the job's
        ``decision_batch_size``: a vLLM node runs χ − B prompt tokens per step, the emulated engine
        subtracts its own B), after ``prefix`` prompt tokens (:func:`kairos.core.model.profiling.prefix_schedule`);
        returns when its prefill is done."""
        rid = await self.deflect(prompt, prefix_schedule(prefix, batch) + [chi] * self.grid.chunk_steps, 1, batch)
        self._live.discard(rid)  # max_tokens 1: finished with its first token

    async def deflect(self, prompt: int, schedule: list[int], max_tokens: int, batch: int = 0) -> str:
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
                raise ProfileRunError(f"node {self.node} refused a profiling job: {ack.reason}")
            self._live.add(rid)
            timeout = self.step_timeout_s * (self.grid.chunk_steps + 1)
            try:
                ev = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise ProfileRunError(f"node {self.node}: chunked prefill {rid} not done in {timeout:g} s") from None
            if isinstance(ev, ErrorEvent):
                raise ProfileRunError(f"node {self.node} failed {rid}: {ev.code} {ev.message}")
            return rid
        finally:
            self._outs.pop(rid, None)
            await sub.unsubscribe()

    async def _ask(self, subject: str, msg, reply_type):
        try:
            return await request_typed(self.nc, subject, msg, reply_type, timeout=5.0)
        except nats.errors.NoRespondersError:
            raise ProfileRunError(f"no node agent answers on {subject} (is node {self.node} up?)") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise ProfileRunError(f"node {self.node} did not answer on {subject} within 5 s") from None

    async def drain(self, rids: list[str]) -> None:
        """Cancel ``rids`` and wait for a heartbeat sent afterwards that shows an idle node."""
        for rid in rids:
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason="profiler"))
            self._live.discard(rid)
        t = self.clock.now_ms()
        await self.until(lambda: self.state is not None and self.state.sent_unix_ms > t and self.state.running == 0
                          and self.state.waiting == 0, self.step_timeout_s + 10.0, "did not become idle after cancels")

    async def handoff(self, prompt: int, output: int, i: int) -> tuple[str | None, str]:
        """One background decode by KV handoff from pseudo source ``i``: (its request id, "") or
        (None, the node's reason) if the node refused it."""
        req = self._request(prompt, output)
        msg = KvHandoff(request=req, src_node=f"profiler-{self.tag}-{i}", kv_tokens=prompt,
                        prefill_done_unix_ms=self.clock.now_ms())
        ack = await self._ask(S.kv_subject(self.node, PROFILER), msg, KvAck)
        if not ack.accepted:
            return None, ack.reason
        self._live.add(req.request_id)
        return req.request_id, ""

    async def replay(self, workload: Sequence[WorkloadRequest], time_scale: float = 1.0) -> dict[str, int]:
        """Trace replay on the node (:func:`kairos.services.profiler.grid.replay_trace`).

        Returns:
            counts: ``deflected``, ``handed_off``, ``refused``.
        """
        return await replay_trace(self, workload, time_scale)

    # -- the run --------------------------------------------------------------------------------
    async def run(self, replay: Sequence[WorkloadRequest] = ()) -> ProfileRun:
        """Run the whole grid, then the optional trace ``replay`` (:meth:`replay`); every request
        started is cancelled even on failure.

        Raises:
            ProfileRunError: the node refused, lost or never ran the profiler's work.
        """
        # the node's records need the requests bucket, which an agent may not create
        # (docs/security.md); a running deployment's control plane has declared its own
        await ensure_buckets(self.nc.jetstream(), replicas=None)  # a cluster's: whatever replicas it has
        res = Resources(_log)  # closed in reverse: the tasks, the cancels, the subscriptions
        try:
            for subject, cb in ((S.steps_subject(self.node), self._on_step),
                                (S.state_subject(self.node), self._on_state)):
                sub = await self.nc.subscribe(subject, cb=cb)
                res.push(f"subscription {subject}", sub.unsubscribe)
            await flush_barrier(self.nc)
            self.result.started_unix_ms = self.clock.now_ms()
            res.push("cancel the requests started", self._cancel_live)
            tasks = (asyncio.ensure_future(run_grid(self, replay)), asyncio.ensure_future(self._watch_heartbeats()))
            res.push("grid and heartbeat watchdog", lambda: _cancel(tasks))
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            # the grid's outcome, or the watchdog's ProfileRunError (the node went silent; the grid is
            # cancelled at close)
            next(t for t in tasks if t.done()).result()
        except ProfileRunError as exc:
            exc.partial = self.result
            raise
        finally:
            await res.aclose()
            self.result.finished_unix_ms = self.clock.now_ms()
        return self.result

    async def _cancel_live(self) -> None:
        """Cancel every request the run started that may still run on the node."""
        for rid in list(self._live):
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason="profiler"))


async def _cancel(tasks: Sequence[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait for them (their outcome was taken already, or is moot)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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


__all__ = ["Profiler", "ProfileRun", "ProfileRunError", "fit_run", "publish_model", "FitRefused", "fit_summary"]
