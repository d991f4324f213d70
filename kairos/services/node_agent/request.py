"""The node agent's per-request lifecycle as an explicit state machine (no I/O; issue 18).

One :class:`NodeRequest` per request this node holds. The agent's parts (:mod:`.jobs`, :mod:`.kv`,
:mod:`.agent`) feed it what happens — a job or a KV handoff accepted, the engine's events, the
handoff's answers, the decode node's notice that it pulled the KV, a cancel, a failure — and carry
out the :data:`Action` values each transition returns (:class:`~.effects.Effects`): publish an out
event to the client, write the timing record, release the deflection slot, free the engine's
blocks, start the handoff or the KV pull, end or start a span. Phases are the shared vocabulary
:class:`~kairos.core.vocabulary.RequestPhase`, the node's part :class:`~kairos.core.vocabulary.RequestRole`.

States, per role::

    prefill (keep path, prefill node)
      PREFILLING ──prefill done──▶ HELD ──a decode node took the KV──▶ HANDED_OFF ──KV pulled──▶ GONE
                                     │                                     └──hold expired──▶ GONE
                                     └──KV pulled (its notice overtook the handoff's answer)──▶ GONE
    remote_decode (keep path, decode node)
      WAITING ──blocks allocated──▶ AWAITING_KV ──KV arrived──▶ DECODING ──finished──▶ GONE
    deflect (deflect path, decode node)
      DEFLECTED_PREFILL ──first token──▶ DECODING ──finished──▶ GONE

    every phase but GONE ──cancel / failure──▶ GONE     (drain: as a failure, except HANDED_OFF)

Rules:

* **Who answers the client.** Tokens, ``done`` and errors of the decode side go to the client; a
  prefill node answers only with an error (before its handoff) or the ``handoff`` event naming the
  decode node that took the KV. A request handed off is the decode node's to finish: draining the
  prefill node sends nothing for it.
* **Tokens** are accepted while decoding, and on a remote decode already while its KV is being
  pulled (vLLM streams the first token before the agent's pull returns); the first token of a
  deflected prefill ends the prefill (its slot is released) and starts the decode.
* **Records.** The prefill node writes its record when the KV is handed off (or, with an error,
  when the request ends before that); a decode node writes its record when the request finishes,
  fails or is cancelled.
* **Refused events.** An event the phase does not allow (a token for a prefill, a second
  ``finished``, anything after GONE) changes nothing and returns one :class:`Ignored` naming the
  event and the phase; the agent logs it.

Pure: no I/O, no clock (times come in as arguments, wall-clock ms), no nats/aiohttp/kairos.runtime
(tests/unit/test_layering.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from kairos.contracts.errors import ErrorCode
from kairos.contracts.records import DecodeTiming, PrefillTiming
from kairos.contracts.events import DoneEvent, ErrorEvent, HandoffEvent, OutEvent, TokenEvent
from kairos.contracts.wire import InferenceRequest, Job, KvHandoff
from kairos.core.vocabulary import RequestPhase, RequestRole, job_role

P = RequestPhase


class Span(enum.StrEnum):
    """The spans of one request on this node (their handles are the agent's: ``NodeRequest.spans``)."""

    MAIN = "main"  #: node.prefill / node.deflected_prefill / node.kv_transfer: from acceptance to its first stage's end
    HANDOFF = "handoff"  #: node.kv_handoff (prefill node): from the first offer until the decode node pulled the KV
    DECODE = "decode"  #: node.decode (decode node): from the first token (or the KV's arrival) to the last


@dataclass(frozen=True)
class Publish:
    """Send ``event`` to the client (``kairos.out.<rid>.agent-<node>``)."""

    event: OutEvent


@dataclass(frozen=True)
class WriteRecord:
    """Write this node's ``part`` timing record of the request (``kairos_requests``)."""

    part: str  #: ``prefill`` or ``decode``
    record: PrefillTiming | DecodeTiming


@dataclass(frozen=True)
class ReleaseSlot:
    """Free the deflection slot the request holds, if any (and delete its reservation key)."""


@dataclass(frozen=True)
class FreeEngine:
    """Free the request's blocks on the engine: with ``held_only`` only a ``held`` prompt's KV
    (``release``), else whatever is left of it (``release`` if held, else ``abort``)."""

    held_only: bool


@dataclass(frozen=True)
class HandOff:
    """Keep path, prefill node: offer the KV to the job's decode candidates."""


@dataclass(frozen=True)
class PullKv:
    """Keep path, decode node: pull the KV cache from the prefill node into the allocated blocks."""


@dataclass(frozen=True)
class EndSpan:
    """End ``span`` (if open) with ``attrs`` set and, when given, an error ``status``."""

    span: Span
    status: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartDecode:
    """Start the decode span (a child of the main span): the request decodes from now on."""


@dataclass(frozen=True)
class Ignored:
    """The event is not allowed in the request's phase: nothing changed (``reason`` says which)."""

    reason: str


Action = Union[Publish, WriteRecord, ReleaseSlot, FreeEngine, HandOff, PullKv, EndSpan, StartDecode, Ignored]
#: every span of a request, in the order a failure ends them
ALL_SPANS = (Span.MAIN, Span.HANDOFF, Span.DECODE)
#: the phases in which a role's tokens are sent (vLLM streams a remote decode's first token before
#: the agent's pull returns; a deflection's first token ends its prefill)
TOKEN_PHASES = {RequestRole.REMOTE_DECODE: (P.AWAITING_KV, P.DECODING), RequestRole.DEFLECT: (P.DEFLECTED_PREFILL, P.DECODING)}


@dataclass(frozen=True)
class Chunk:
    """One deflected chunk that ran: χ of the schedule, the dispatcher's predicted and the measured step ms."""

    chi: int
    predicted_ms: float
    actual_ms: float


@dataclass(eq=False)
class NodeRequest:
    """One request on this node (rules in the module docstring). Times are wall-clock ms.

    Build one with :meth:`for_job` (prefill or deflect) or :meth:`for_handoff` (remote decode);
    change it only through its transition methods.
    """

    req: InferenceRequest
    role: RequestRole
    node: str  #: this node's id (the events' and records' ``node``)
    phase: RequestPhase
    received_ms: float
    job: Job | None = None  #: the job (prefill, deflect); None for a remote decode
    src_node: str | None = None  #: remote decode: the prefill node holding the KV
    spans: Any = None  #: the agent's span handles (kairos/services/node_agent/tracing.py); opaque here
    cached_tokens: int = 0  #: prompt tokens the prefilling node served from its prefix cache
    prefill_start_ms: float | None = None
    prefill_done_ms: float | None = None
    kv_alloc_ms: float | None = None
    kv_arrived_ms: float | None = None
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    handoff_node: str | None = None  #: prefill node: the decode node that took the KV
    handoff_sent_ms: float | None = None  #: prefill node: the first offer of the KV
    pulled: bool = False  #: prefill node: the decode node said it pulled the KV
    kv_backlog_ms: float = 0.0  #: prefill node: expected transfer of the KV handed off, not pulled yet
    tokens: int = 0  #: output tokens sent to the client
    tbt_max_ms: float = 0.0
    chunks: list[Chunk] = field(default_factory=list)  #: deflected chunks run here

    # -- creation ---------------------------------------------------------------------------------
    @classmethod
    def for_job(cls, job: Job, node: str, now_ms: float) -> "NodeRequest":
        """A job this node won: the keep path's prefill (PREFILLING) or a deflection (DEFLECTED_PREFILL)."""
        role = job_role(job.kind)
        return cls(req=job.request, role=role, node=node, received_ms=now_ms, job=job,
                   phase=P.PREFILLING if role is RequestRole.PREFILL else P.DEFLECTED_PREFILL)

    @classmethod
    def for_handoff(cls, h: KvHandoff, node: str, now_ms: float) -> "NodeRequest":
        """A KV handoff this decode node accepted: waits for blocks (WAITING)."""
        return cls(req=h.request, role=RequestRole.REMOTE_DECODE, node=node, phase=P.WAITING, received_ms=now_ms,
                   src_node=h.src_node, cached_tokens=h.cached_tokens)

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def done(self) -> bool:
        """Nothing of the request is left on this node."""
        return self.phase is P.GONE

    @property
    def unstarted(self) -> bool:
        """Accepted but not started: no prompt token computed here yet (a prefill or deflection
        whose first chunk has not run) or a remote decode still waiting for blocks. A draining node
        moves such a request at once (kairos/services/node_agent/drain.py)."""
        if self.role is RequestRole.REMOTE_DECODE:
            return self.phase is P.WAITING
        return self.phase in (P.PREFILLING, P.DEFLECTED_PREFILL) and self.prefill_start_ms is None

    def _ignored(self, event: str) -> list[Action]:
        return [Ignored(f"{event} in phase {self.phase.value} ({self.role.value})")]

    # -- bookkeeping that changes no phase ----------------------------------------------------------
    def prefill_chunk_ran(self, started_ms: float, cached_before: int) -> None:
        """A step computed part of this prompt here: the first one starts the prefill clock, after
        its prefix-cache hit of ``cached_before`` tokens. A remote decode's one prompt token after
        its KV arrived is no prefill of this node (its cached tokens are the prefill node's)."""
        if self.role is not RequestRole.REMOTE_DECODE and self.prefill_start_ms is None and not self.done:
            self.prefill_start_ms = started_ms
            self.cached_tokens = cached_before

    def deflected_chunk_ran(self, step_index: int, chi: int, engine_predicted_ms: float, actual_ms: float) -> float:
        """A deflected chunk of this request ran: record it; returns its predicted ms (the job's Eq. 5
        value for ``step_index``, else the engine's own prediction)."""
        pred = self.job.predicted_step_ms if self.job is not None else []
        predicted = pred[step_index] if step_index < len(pred) else engine_predicted_ms
        self.chunks.append(Chunk(chi, predicted, actual_ms))
        return predicted

    def hold_expired(self, limit_ms: float) -> bool:
        """Prefill node: the KV was offered before ``limit_ms`` and its pull never confirmed."""
        return (self.role is RequestRole.PREFILL and self.phase in (P.HELD, P.HANDED_OFF)
                and self.handoff_sent_ms is not None and self.handoff_sent_ms < limit_ms)

    # -- keep path, prefill node ------------------------------------------------------------------
    def prefill_done(self, now_ms: float) -> list[Action]:
        """The engine computed the prompt and holds its KV: end the prefill span, hand the KV off."""
        if self.role is not RequestRole.PREFILL or self.phase is not P.PREFILLING:
            return self._ignored("prefill_done")
        self.phase, self.prefill_done_ms = P.HELD, now_ms
        return [EndSpan(Span.MAIN), HandOff()]

    def handoff_started(self, now_ms: float) -> None:
        """The first offer of the KV goes out now (the hold's expiry counts from here)."""
        if self.phase is P.HELD and self.handoff_sent_ms is None:
            self.handoff_sent_ms = now_ms

    def handed_off(self, decode_node: str, now_ms: float, backlog_ms: float, decode_epoch_ms: float = 0.0) -> list[Action]:
        """``decode_node`` accepted the KV: tell the client which node's tokens to take, write the
        prefill record. If its pulled notice came first (the request is GONE, ``pulled``), the same
        is still owed to the client; ``backlog_ms`` counts only while the KV is still held here;
        ``decode_epoch_ms``: the decode agent's incarnation that accepted (its KvAck), for the ingress."""
        if self.role is not RequestRole.PREFILL or not (self.phase is P.HELD or (self.done and self.pulled)):
            return self._ignored("handed_off")
        self.handoff_node = decode_node
        if self.phase is P.HELD:
            self.phase, self.kv_backlog_ms = P.HANDED_OFF, backlog_ms
        return [Publish(HandoffEvent(request_id=self.rid, node=self.node, decode_node=decode_node, sent_unix_ms=now_ms,
                                     decode_epoch_unix_ms=decode_epoch_ms)),
                WriteRecord("prefill", self.prefill_record())]

    def kv_pulled(self, transfer_ms: float) -> list[Action]:
        """The decode node pulled the KV (or gave up on it): free the held blocks, end the handoff span."""
        if self.role is not RequestRole.PREFILL or self.phase not in (P.HELD, P.HANDED_OFF):
            return self._ignored("kv_pulled")
        self.phase, self.pulled, self.kv_backlog_ms = P.GONE, True, 0.0
        return [FreeEngine(held_only=True), EndSpan(Span.HANDOFF, attrs={"kairos.kv_transfer_ms": transfer_ms})]

    def expire_hold(self) -> list[Action]:
        """The decode node never said it pulled the KV (it died after accepting): free the blocks."""
        if self.role is not RequestRole.PREFILL or self.phase not in (P.HELD, P.HANDED_OFF):
            return self._ignored("expire_hold")
        self.phase, self.kv_backlog_ms = P.GONE, 0.0
        return [FreeEngine(held_only=True), EndSpan(Span.HANDOFF, status="kv_pull_never_confirmed")]

    # -- keep path, decode node -------------------------------------------------------------------
    def allocated(self, now_ms: float) -> list[Action]:
        """The engine allocated the blocks: pull the KV into them."""
        if self.role is not RequestRole.REMOTE_DECODE or self.phase is not P.WAITING:
            return self._ignored("allocated")
        self.phase, self.kv_alloc_ms = P.AWAITING_KV, now_ms
        return [PullKv()]

    def kv_arrived(self, now_ms: float, transfer_ms: float) -> list[Action]:
        """The KV is in place (``transfer_ms`` including the wait for the link): decoding starts."""
        if self.role is not RequestRole.REMOTE_DECODE or self.phase is not P.AWAITING_KV:
            return self._ignored("kv_arrived")
        self.phase, self.kv_arrived_ms = P.DECODING, now_ms
        return [EndSpan(Span.MAIN, attrs={"kairos.kv_transfer_ms": transfer_ms}), StartDecode()]

    # -- decode side (remote decode and deflect) ----------------------------------------------------
    def tokens_out(self, first_index: int, count: int, text: str, now_ms: float,
                   finish_reason: str | None = None, logprobs: list | None = None,
                   stop_reason: str | int | None = None, token_ids: list[int] | None = None) -> list[Action]:
        """``count`` tokens from index ``first_index`` came out of the engine: send them (with
        ``finish_reason`` when the engine said they are the last: the client's last chunk carries it,
        and its ``stop_reason``).
        The first token of a deflected prefill ends it: slot released, the decode span starts."""
        if self.phase not in TOKEN_PHASES.get(self.role, ()):
            return self._ignored("tokens")
        out: list[Action] = []
        if first_index == 0 and self.first_token_ms is None:
            self.first_token_ms = now_ms
            if self.phase is P.DEFLECTED_PREFILL:
                self.phase, self.prefill_done_ms = P.DECODING, now_ms
                out += [EndSpan(Span.MAIN, attrs={"kairos.chunks_run": len(self.chunks)}), ReleaseSlot(),
                        StartDecode()]
        self.tokens += count
        if self.last_token_ms is not None:
            self.tbt_max_ms = max(self.tbt_max_ms, now_ms - self.last_token_ms)
        self.last_token_ms = now_ms
        out.append(Publish(TokenEvent(request_id=self.rid, first_index=first_index, count=count, text=text,
                                      node=self.node, sent_unix_ms=now_ms, finish_reason=finish_reason,
                                      logprobs=logprobs, stop_reason=stop_reason, token_ids=token_ids)))
        return out

    def finished(self, finish_reason: str, engine_cached_tokens: int, now_ms: float,
                 stop_reason: str | int | None = None) -> list[Action]:
        """The engine emitted the last token: end the decode span first (the trace is complete when
        the client has its answer), send ``done`` (with the ``stop_reason`` the engine gave), write
        the decode record. Cached tokens: on the
        keep path what the prefill node served (its handoff), else the larger of the engine's
        report and the prefix hit seen in the step records."""
        if self.role is RequestRole.PREFILL or self.phase not in (P.AWAITING_KV, P.DEFLECTED_PREFILL, P.DECODING):
            return self._ignored("finished")
        before, self.phase = self.phase, P.GONE
        out: list[Action] = [EndSpan(Span.MAIN)] if before is not P.DECODING else []
        if before is P.DEFLECTED_PREFILL:
            out.append(ReleaseSlot())
        cached = self.cached_tokens if self.role is RequestRole.REMOTE_DECODE else max(engine_cached_tokens,
                                                                                       self.cached_tokens)
        return out + [EndSpan(Span.DECODE),
                      Publish(DoneEvent(request_id=self.rid, completion_tokens=self.tokens, node=self.node,
                                        sent_unix_ms=now_ms, finish_reason=finish_reason, cached_tokens=cached,
                                        stop_reason=stop_reason)),
                      WriteRecord("decode", self.decode_record(finished_ms=now_ms))]

    # -- endings ------------------------------------------------------------------------------------
    def failed(self, code: ErrorCode, message: str, now_ms: float, status: int | None = None) -> list[Action]:
        """Give up here: free everything, tell the client (``status``: ``code.status`` unless the
        engine said otherwise), end the spans, write this node's record with the error."""
        if self.done:
            return self._ignored("failed")
        self.phase, self.kv_backlog_ms = P.GONE, 0.0
        error = ErrorEvent(request_id=self.rid, status=code.status if status is None else status, code=code,
                           message=message, source=f"node_agent:{self.node}", sent_unix_ms=now_ms)
        return [FreeEngine(held_only=False), ReleaseSlot(), Publish(error),
                *(EndSpan(s, status=code.value) for s in ALL_SPANS), self._record(code.value)]

    def shutdown(self, now_ms: float) -> list[Action]:
        """The node drains: fail the request (``node_shutdown``) unless its KV was handed off (the
        decode node finishes it)."""
        if self.phase is P.HANDED_OFF:
            return []
        return self.failed(ErrorCode.NODE_SHUTDOWN, f"node {self.node} is shutting down", now_ms)

    def cancelled(self, reason: str) -> list[Action]:
        """The request ended elsewhere (client gone, timeout, moved): free everything, end the spans;
        the stages that ran stay visible in ``GET /v1/requests/{id}`` (a prefill record written at
        the handoff already says everything about this node's part)."""
        if self.done:
            return self._ignored("cancelled")
        handed_off, self.phase, self.kv_backlog_ms = self.phase is P.HANDED_OFF, P.GONE, 0.0
        status = f"cancelled: {reason}"
        out: list[Action] = [FreeEngine(held_only=False), ReleaseSlot(), *(EndSpan(s, status=status) for s in ALL_SPANS)]
        return out if handed_off else out + [self._record(status)]

    # -- timing records ---------------------------------------------------------------------------
    def _record(self, error: str) -> WriteRecord:
        if self.role is RequestRole.PREFILL:
            return WriteRecord("prefill", self.prefill_record(error=error))
        return WriteRecord("decode", self.decode_record(error=error))

    def prefill_record(self, error: str | None = None) -> PrefillTiming:
        """The prefill node's record (``kairos_requests``, part ``prefill``)."""
        return PrefillTiming(node=self.node, received_unix_ms=self.received_ms, prefill_start_unix_ms=self.prefill_start_ms,
                             prefill_done_unix_ms=self.prefill_done_ms, handoff_node=self.handoff_node, error=error)

    def decode_record(self, finished_ms: float | None = None, error: str | None = None) -> DecodeTiming:
        """The decode node's record (part ``decode``): the keep path's KV times, a deflection's
        prefill times and chunk records, the tokens."""
        deflect = self.role is RequestRole.DEFLECT
        return DecodeTiming(node=self.node, kind=self.role.path, received_unix_ms=self.received_ms,
                            kv_allocated_unix_ms=self.kv_alloc_ms, kv_arrived_unix_ms=self.kv_arrived_ms,
                            prefill_start_unix_ms=self.prefill_start_ms if deflect else None,
                            prefill_done_unix_ms=self.prefill_done_ms if deflect else None,
                            first_token_unix_ms=self.first_token_ms, finished_unix_ms=finished_ms,
                            completion_tokens=self.tokens, chunk_predicted_ms=[c.predicted_ms for c in self.chunks],
                            chunk_actual_ms=[c.actual_ms for c in self.chunks],
                            chunk_sizes=[c.chi for c in self.chunks], error=error)
