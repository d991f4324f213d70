"""What the vLLM engine's state stream means for its node agent: pure translations, no I/O.

The ``kairos.engines.vllm.plugin`` plugin publishes an ``EngineSnapshot`` per step and when idle (contract A,
kairos/engines/vllm/plugin/protocol.py); :class:`kairos.engines.vllm.backend.VllmBackend` keeps the last
one beside its own record of each request it sent the server (:class:`_VReq`). From those two,
:func:`engine_state` gives the heartbeat's :class:`~kairos.core.engine_model.EngineState` (what the dispatcher
routes on) and :func:`step_output` turns a snapshot's ``StepRecord`` into the agent's
:class:`~kairos.engines.base.StepOutput` (its step records and the model correction).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kairos.contracts.wire import InferenceRequest
from kairos.core.cluster.snapshot import InFlightDeflection
from kairos.core.engine_model import EngineState
from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import RequestPhase, RequestRole
from kairos.engines.base import StepOutput

#: the phases in which a request's prompt is still being computed on the server
PREFILL_PHASES = (RequestPhase.PREFILLING, RequestPhase.DEFLECTED_PREFILL)


@dataclass
class _VReq:
    """One request this backend has in its vLLM server."""

    req: InferenceRequest
    kind: RequestRole  #: this node's part: prefill, remote_decode or deflect
    #: prefilling → held (prefill node); awaiting_kv → decoding (remote decode); deflected_prefill → decoding
    phase: RequestPhase
    chunk_schedule: list[int] = field(default_factory=list)
    engine_chunks: list[int] = field(default_factory=list)  #: p_i sent to vLLM
    kv_params: dict[str, Any] | None = None
    task: asyncio.Task | None = None
    submitted_mono: float = 0.0
    kv_ready: asyncio.Future | None = None  #: remote decode: set when the first token arrived
    started: bool = False  #: a step computed some of its prompt (StepOutput.prefill_chunks)
    remaining: int = 0  #: prompt tokens still to prefill, per the last snapshot
    tokens_out: int = 0  #: output tokens received so far
    #: a migrated text prompt: its token ids as this engine tokenizes it (the resumed prompt is them
    #: followed by the output ids the client has; issue 33)
    prompt_ids: list[int] | None = None


def step_output(rec: Any, reqs: dict[str, "_VReq"], started: list[tuple[str, int, int]],
                model: LatencyModel) -> StepOutput:
    """A :class:`StepOutput` from the plugin's ``StepRecord`` (kairos.engines.vllm.plugin.protocol).

    ``deflected_chunk`` is the first deflected chunk of the step whose request this backend knows:
    (rid, chunk_index, χ of the dispatcher's schedule at that index — the last entry repeats —,
    prompt tokens run). ``prefill_chunks`` lists every request seen prefilling in the step:
    deflected chunks from the record as (rid, tokens, prompt tokens computed before the chunk), the
    record's other prefills (``StepRecord.prefills``: keep-path requests, the first chunk and every
    later one of a long prompt) likewise, and keep-path prefills from ``started`` the record does not
    name as (rid, tokens, 0) — a record from a plugin without ``prefills`` names none.
    ``predicted_ms`` is the latency model on the step actually run (B, K, prompt tokens, and the
    token-weighted computed prefix ``c`` of its chunks, as in the agent's step record).
    """
    named = {c.request_id for c in rec.prefills}
    chunks: list[tuple[str, int, int]] = [(c.request_id, c.tokens, c.computed_tokens) for c in rec.prefills]
    chunks += [s for s in started if s[0] not in named]
    deflected = None
    for c in rec.chunks:
        chunks.append((c.request_id, c.tokens, c.computed_tokens))
        r = reqs.get(c.request_id)
        if deflected is None and r is not None and r.chunk_schedule:
            chi = r.chunk_schedule[min(c.chunk_index, len(r.chunk_schedule) - 1)]
            deflected = (c.request_id, c.chunk_index, chi, c.tokens)
    n = sum(t for _, t, _ in chunks)
    cached = sum(t * c for _, t, c in chunks) / n if n else 0.0
    predicted = float(model.step_ms(rec.decode_count, rec.kv_tokens, rec.prefill_tokens, cached))
    return StepOutput(step=rec.step, started_unix_ms=rec.started_unix_ms, wall_ms=rec.wall_ms, predicted_ms=predicted,
                      batch_size=rec.decode_count, kv_tokens=rec.kv_tokens, prefill_tokens=rec.prefill_tokens,
                      prefill_chunks=tuple(chunks), deflected_chunk=deflected, tokens=(), first_tokens=(),
                      prefill_done=(), finished=(), cached_tokens=rec.cached_tokens)


def engine_state(role: str, snapshot: Any, reqs: dict[str, _VReq]) -> EngineState:
    """Heartbeat state from the last snapshot: B, K, free KV, the queue of prompt remainders
    (prefill node: every waiting request; decode node: the deflected ones) and the deflected
    requests still prefilling (``in_flight``). ``snapshot``: the last
    kairos.engines.vllm.plugin ``EngineSnapshot`` (None before the first); ``reqs``: the backend's requests by id."""
    s = snapshot
    deflecting = [r for r in reqs.values() if r.kind is RequestRole.DEFLECT and r.phase is RequestPhase.DEFLECTED_PREFILL]
    in_flight = [InFlightDeflection(prompt_tokens=max(r.remaining, 0), output_tokens=r.req.max_tokens)
                 for r in deflecting]
    if s is None:
        return EngineState(role=role, batch_size=0, kv_tokens=0,
                           queue_prompt_tokens=[r.remaining for r in reqs.values()
                                                if r.phase in PREFILL_PHASES],
                           deflection_in_flight=bool(deflecting), in_flight=in_flight, waiting=0,
                           free_kv_tokens=0, running=0)
    if role == "prefill":
        queue = [w.remaining_prefill_tokens for w in s.waiting]
    else:
        queue = [w.remaining_prefill_tokens for w in s.waiting
                 if (r := reqs.get(w.request_id)) is not None and r.kind is RequestRole.DEFLECT]
    used = int(round(s.free_kv_tokens * s.kv_cache_usage / (1.0 - s.kv_cache_usage))) if s.kv_cache_usage < 1 else 0
    return EngineState(role=role, batch_size=s.batch_size, kv_tokens=s.kv_tokens, queue_prompt_tokens=queue,
                       deflection_in_flight=bool(deflecting), in_flight=in_flight, waiting=s.num_waiting,
                       free_kv_tokens=s.free_kv_tokens, running=s.num_running,
                       awaiting_kv=sum(1 for r in reqs.values() if r.phase is RequestPhase.AWAITING_KV),
                       held=sum(1 for r in reqs.values() if r.phase is RequestPhase.HELD),
                       used_kv_tokens=used, steps=s.step)


def track_prefills(snapshot: Any, reqs: dict[str, _VReq]) -> list[tuple[str, int, int]]:
    """Bring the prefilling requests of ``reqs`` up to ``snapshot`` (in place: ``remaining``, the
    prompt tokens still to prefill, and ``started``). Returns the keep-path prefills this snapshot
    shows computing for the first time, as ``(rid, prompt tokens computed, 0)``
    (``StepOutput.prefill_chunks`` entries): those its step record names as first scheduled
    (``StepRecord.first_scheduled``: vLLM's scheduler put them in a batch), or whose prompt the
    waiting list shows partly computed. A request absent from the waiting list has not started
    for that alone: it may not have reached vLLM's scheduler yet (its HTTP request is still in the
    API server), and vLLM's own queue is part of the prefill queue, as in the simulator."""
    started = []
    waiting = {w.request_id: w for w in snapshot.waiting}
    rec = snapshot.step_record
    first = set(rec.first_scheduled) if rec is not None else set()
    for rid, r in reqs.items():
        # "held": the prefill's HTTP answer can overtake the stream's messages about its steps
        held = r.phase is RequestPhase.HELD
        if r.phase not in PREFILL_PHASES and not (held and not r.started):
            continue
        w = waiting.get(rid)
        if held and w is None and rid not in first:  # done before any message showed it: no start to report
            r.started = True
            continue
        if w is not None and not held:
            r.remaining = w.remaining_prefill_tokens
        if r.kind is RequestRole.PREFILL and not r.started and (rid in first or (w is not None and w.remaining_prefill_tokens
                                                                        < w.prompt_tokens)):
            r.started = True
            started.append((rid, r.req.prompt_tokens - (w.remaining_prefill_tokens if w else 0), 0))
    return started
