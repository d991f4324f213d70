"""The ingress's per-request lifecycle as an explicit state machine (no I/O; issue 10 design note).

One :class:`RequestLifecycle` per client request. The relay (kairos/services/ingress/relay.py) feeds
it what happens — bus events of the attempt it follows, node deaths, bus outages, timeouts — and
carries out the :data:`Action` it returns (write tokens, re-submit, send an error, finish).

States::

    QUEUED ──routed──▶ ROUTED ──first token──▶ STREAMING ──done──▶ ENDED
       │                 │                         │
       └──── node dead / stream interrupted ───────┴──▶ QUEUED (re-submitted as <id>-r<n>) or ENDED (error)

Rules:

* **Which attempt is followed.** An attempt is a bus request id (``<id>``, then ``<id>-r1``, …)
  *and* the node its tokens come from: the first token of an attempt fixes that node; tokens or a
  ``done`` from any other node are dropped (``foreign_node``) — a response never mixes executions.
  Events of an abandoned attempt id are dropped (``old_attempt``).
* **Token order.** Each token event carries its output index: an index below the next expected
  one is a duplicate (dropped); above it, tokens were lost (a bus outage) — the stream is
  *interrupted*. A ``done`` whose ``completion_tokens`` differs from the tokens received is too.
* **When it may be re-submitted.** Only while nothing has reached the client (``committed`` is
  False: a stream before its first byte; a non-streaming request until its answer), with
  re-submissions left (``max_resubmits``) and time left. Re-submission is triggered by *positive
  evidence* that the attempt cannot finish: its node is dead (liveness, not routing staleness),
  or its stream was interrupted.
* **When it migrates** (issue 33). Once output reached the client, the same evidence (a dead,
  drained or failed node, an interrupted stream) continues the request as a new attempt
  (``<id>-m<n>``) that resumes after the ``delivered`` tokens: the original prompt, the tokens the
  client has (:class:`~kairos.contracts.wire.Resume`), the rest of ``max_tokens``. The client sees one
  stream; ``completion_tokens`` counts every attempt's tokens. At most ``max_migrations`` times, then
  an explicit error naming the attempts. A token event that carried the finish reason was the last:
  if only its ``done`` was lost, the request completes instead.
* **When it must end.** ``done`` → completion; an error event, a node death or interruption that
  cannot be re-submitted or migrated, a timeout, the client leaving, the bus unavailable for too
  long, or the ingress shutting down → an explicit error. After ENDED every event is ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent
from kairos.core.vocabulary import KEEP, PathKind


class Phase(enum.Enum):
    QUEUED = "queued"  #: sent to the dispatchers (or being routed); no node accepted its job yet
    ROUTED = "routed"  #: a node accepted its job; no token yet
    STREAMING = "streaming"  #: tokens arriving from one node
    ENDED = "ended"


@dataclass(frozen=True)
class Relay:
    """Deliver these tokens (write them to the stream, or keep them for the final answer)."""

    event: TokenEvent


@dataclass(frozen=True)
class Ignore:
    """Drop the event (``reason``: ``old_attempt``, ``foreign_node``, ``duplicate``, ``ended``, ``not_dependent``)."""

    reason: str


@dataclass(frozen=True)
class Resubmit:
    """Cancel ``old_attempt_id`` on the nodes, forget its partial output, publish ``new_attempt_id``."""

    old_attempt_id: str
    new_attempt_id: str
    why: str  #: ``node_lost:<node>`` or ``stream_interrupted:<detail>``


@dataclass(frozen=True)
class Migrate:
    """Cancel ``old_attempt_id`` on the nodes and continue the request as ``new_attempt_id``, resuming
    after the ``output_tokens`` the client has (their ``output_text``, and ``output_token_ids`` when
    every engine gave ids)."""

    old_attempt_id: str
    new_attempt_id: str
    why: str  #: ``<code>:<detail>``, e.g. ``node_lost:decode-1`` (its code is the metric's reason)
    output_tokens: int
    output_text: str
    output_token_ids: list[int] | None


@dataclass(frozen=True)
class Attempt:
    """One attempt of a request, for its record: its bus id, the node it ran on (its tokens' node,
    else the node its job went to), the output tokens it delivered, and why it was left (None: it
    served the end, or the request ended with it)."""

    attempt_id: str
    node: str | None
    output_tokens: int
    moved: str | None = None


#: error codes from a node agent that say the node cannot finish the attempt while another could:
#: handled as a lost node (re-submitted, or migrated once output reached the client). A prefill
#: node's ``kv_handoff_failed`` is one: every decode node its job named refused the KV or was gone
#: (in a rolling restart, the only one routable at dispatch began draining during the prefill) —
#: the dispatchers route the attempt again on the view of now
MOVABLE_CODES = frozenset({ErrorCode.NODE_LOST, ErrorCode.NODE_SHUTDOWN, ErrorCode.KV_HANDOFF_FAILED})
#: and those that do only once output reached the client: an engine that failed mid-stream (before
#: its first token the backend has retried already, and the client gets the error)
MIGRATABLE_CODES = MOVABLE_CODES | {ErrorCode.ENGINE_ERROR}


@dataclass(frozen=True)
class Fail:
    """End with an explicit error (HTTP status / SSE error event); ``cancel``: tell the nodes to stop
    ``attempt_id`` too."""

    status: int  #: the HTTP status (the code's, or the one an error event carried)
    code: ErrorCode
    message: str
    attempt_id: str
    cancel: bool = True


@dataclass(frozen=True)
class Complete:
    """The request finished: send the final chunk / the full response."""

    finish_reason: str
    completion_tokens: int
    cached_tokens: int = 0  #: prompt tokens served from the engine's prefix cache (DoneEvent)
    stop_reason: str | int | None = None  #: the stop string / token id that ended it (DoneEvent)


Action = Union[Relay, Ignore, Resubmit, Migrate, Fail, Complete]


@dataclass
class RequestLifecycle:
    """One request's lifecycle (rules in the module docstring).

    Args:
        rid: the id the client sees; also the first attempt's bus id.
        max_resubmits: re-submissions allowed after a lost node / interrupted stream, before output
            reached the client.
        max_migrations: migrations allowed once it did (``KAIROS_MAX_MIGRATIONS``).
        max_tokens: the request's output limit (a migration asks for what is left; None: unknown).
    """

    rid: str
    max_resubmits: int = 2
    max_migrations: int = 3
    max_tokens: int | None = None
    phase: Phase = Phase.QUEUED
    attempt_id: str = ""
    resubmits: int = 0
    kind: PathKind | None = None  #: ``keep`` or ``deflect``, from the job the node accepted
    node: str | None = None  #: node that accepted the job
    handoff_node: str | None = None  #: keep path: decode node that took the KV
    token_node: str | None = None  #: node the followed attempt's tokens come from
    received: int = 0  #: tokens of the current attempt accepted so far (= next expected index)
    committed: bool = False  #: something reached the client: no re-submission any more (a migration)
    dropped: dict[str, int] = field(default_factory=dict)  #: ignored events by reason
    migrations: int = 0
    delivered: int = 0  #: output tokens of the earlier attempts of this stream (the client has them)
    texts: list[str] = field(default_factory=list)  #: text of every token event relayed, in order
    ids: list[int] | None = field(default_factory=list)  #: their ids (None once an event came without)
    finish_seen: str | None = None  #: a relayed token event of this attempt carried the finish reason
    stop_seen: str | int | None = None  #: and its stop reason
    attempts: list[Attempt] = field(default_factory=list)  #: the attempts left so far, for the record

    def __post_init__(self) -> None:
        if not self.attempt_id:
            self.attempt_id = self.rid

    # -- queries ---------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def total(self) -> int:
        """Output tokens of the request so far: every attempt's (the ``completion_tokens``)."""
        return self.delivered + self.received

    def attempt_record(self, moved: str | None = None) -> Attempt:
        """The current attempt as the record lists it (``moved``: why it was left)."""
        return Attempt(self.attempt_id, self.token_node or self.handoff_node or self.node, self.received, moved)

    def depends_on(self) -> str | None:
        """The node whose death ends this attempt: the token node once streaming; a deflection's
        node; on the keep path the decode node that took the KV, else the prefill node; None while
        queued."""
        if self.phase is Phase.STREAMING:
            return self.token_node
        if self.phase is Phase.ROUTED:
            if self.kind == KEEP and self.handoff_node is not None:
                return self.handoff_node
            return self.node
        return None

    def can_resubmit(self, time_left: bool) -> bool:
        return not self.committed and self.resubmits < self.max_resubmits and time_left and not self.ended

    def can_migrate(self, time_left: bool) -> bool:
        return self.committed and self.migrations < self.max_migrations and time_left and not self.ended

    # -- events ----------------------------------------------------------------------------------
    def on_routed(self, attempt_id: str, kind: PathKind, node: str) -> Action:
        """``node`` accepted the job of ``attempt_id`` (the ingress sent it, kairos/services/ingress/jobrelay.py)."""
        if attempt_id != self.attempt_id or self.ended:
            return self._drop("old_attempt" if attempt_id != self.attempt_id else "ended")
        self.kind, self.node = kind, node
        if self.phase is Phase.QUEUED:
            self.phase = Phase.ROUTED
        return Ignore("state_only")

    def on_handoff(self, attempt_id: str, decode_node: str) -> None:
        """Keep path: the prefill record says ``decode_node`` took the KV of ``attempt_id``."""
        if attempt_id == self.attempt_id and not self.ended:
            self.handoff_node = decode_node

    def committed_to_client(self) -> None:
        """The HTTP layer sent something to the client (SSE headers / first chunk)."""
        self.committed = True

    def _not_followed(self, ev: TokenEvent | DoneEvent) -> Action | None:
        """A Drop for an event of another attempt, after the end, or from a node other than the one
        whose tokens are followed; None for an event of the followed stream."""
        if ev.request_id != self.attempt_id:
            return self._drop("old_attempt")
        if self.ended:
            return self._drop("ended")
        if self.token_node is not None and ev.node != self.token_node:
            return self._drop("foreign_node")
        return None

    def on_token(self, ev: TokenEvent, time_left: bool) -> Action:
        """Tokens of some attempt arrived."""
        if (drop := self._not_followed(ev)) is not None:
            return drop
        if ev.first_index < self.received:
            if ev.first_index + ev.count <= self.received:
                return self._drop("duplicate")
            return self.interrupted(f"overlapping tokens {ev.first_index}..{ev.first_index + ev.count - 1} after "
                                    f"{self.received}", time_left)
        if ev.first_index > self.received:
            return self.interrupted(f"tokens {self.received}..{ev.first_index - 1} never arrived", time_left)
        self.token_node = ev.node
        self.phase = Phase.STREAMING
        self.received += ev.count
        self.texts.append(ev.text)
        if self.ids is not None:
            self.ids = self.ids + list(ev.token_ids) if ev.token_ids and len(ev.token_ids) == ev.count else None
        if ev.finish_reason is not None:
            self.finish_seen, self.stop_seen = ev.finish_reason, ev.stop_reason
        return Relay(ev)

    def on_done(self, ev: DoneEvent, time_left: bool) -> Action:
        if (drop := self._not_followed(ev)) is not None:
            return drop
        if ev.completion_tokens != self.received:
            return self.interrupted(f"done after {ev.completion_tokens} tokens, {self.received} arrived", time_left)
        self.phase = Phase.ENDED
        return Complete(ev.finish_reason, self.total, ev.cached_tokens, ev.stop_reason)

    def on_error(self, ev: ErrorEvent, time_left: bool = True) -> Action:
        """An error event ends the request — except a node agent's :data:`MOVABLE_CODES` (a restarted
        agent reporting that its previous incarnation held this attempt, a drained node) and, once
        output reached the client, :data:`MIGRATABLE_CODES` (an engine that failed), handled like a
        dead node, and a dispatcher's routing failure once a node has
        accepted the attempt (dropped: it concerns a duplicate copy of the request)."""
        if ev.request_id != self.attempt_id:
            return self._drop("old_attempt")
        if self.ended:
            return self._drop("ended")
        if ev.source.startswith("node_agent:") and ev.code in (MIGRATABLE_CODES if self.committed else MOVABLE_CODES):
            # (a str in a struct built in Python, an ErrorCode when decoded: both hash alike)
            return self._lost(f"{ErrorCode(ev.code).value}:{ev.source}", time_left, ErrorCode(ev.code), ev.message)
        if ev.source.startswith("dispatcher:") and self.phase in (Phase.ROUTED, Phase.STREAMING):
            # a node accepted this attempt: a dispatcher that failed to route a duplicate copy of it
            # (a copy sent again after its routing went silent) says nothing about the node running it
            return self._drop("routed_elsewhere")
        # cancel too (as every Fail): a node whose acceptance came late (after the dispatcher gave up on it) must
        # not run a request that already ended with this error
        return self._end(ev.code, ev.message, ev.status)

    def on_node_dead(self, node: str, time_left: bool) -> Action:
        """``node`` is dead (positive evidence: liveness timeout). Matters only if this attempt depends on
        it — or, on the keep path before the first token, if it is the prefill node the decode node may
        still be pulling the KV from."""
        pulling = self.phase is Phase.ROUTED and self.kind == KEEP and self.node == node
        if self.ended or (self.depends_on() != node and not pulling):
            return Ignore("not_dependent")
        return self._lost(f"node_lost:{node}", time_left, ErrorCode.NODE_LOST,
                          f"node {node} serving request {self.rid} was lost (no heartbeat and no token; it may have "
                          f"crashed) and the request cannot be moved")

    def interrupted(self, detail: str, time_left: bool) -> Action:
        """The followed stream lost events (bus outage): it can never be completed correctly."""
        if self.ended:
            return self._drop("ended")
        return self._lost(f"stream_interrupted:{detail}", time_left, ErrorCode.STREAM_INTERRUPTED,
                          f"the token stream of request {self.rid} was interrupted ({detail}; a message-bus outage) "
                          f"and the request cannot be moved")

    def on_timeout(self, before_first_token: bool) -> Action:
        what = "before its first token" if before_first_token else "waiting for tokens"
        return self._end(ErrorCode.TIMEOUT, f"request {self.rid} timed out {what}")

    def on_bus_unavailable(self, outage_s: float) -> Action:
        return self._end(ErrorCode.BUS_UNAVAILABLE, f"the message bus has been unreachable for {outage_s:.1f} s; "
                                                    f"request {self.rid} cannot be served now, retry it")

    def on_shutdown(self) -> Action:
        return self._end(ErrorCode.INGRESS_SHUTDOWN, f"the ingress serving request {self.rid} is shutting down; "
                                                     f"retry the request")

    def on_client_gone(self) -> Action:
        return self._end(ErrorCode.CLIENT_DISCONNECTED, "client closed the connection")

    # -- helpers ---------------------------------------------------------------------------------
    def _lost(self, why: str, time_left: bool, code: ErrorCode, message: str) -> Action:
        if self.can_resubmit(time_left):
            old = self.attempt_id
            self.attempts.append(self.attempt_record(why))
            self.resubmits += 1
            self._next_attempt(f"{self.rid}-r{self.resubmits}")
            self.received = 0
            self.texts, self.ids = [], []  # nothing reached the client: the next attempt starts over
            return Resubmit(old, self.attempt_id, why)
        if self.can_migrate(time_left):
            if self.finish_seen is not None:  # its last token is here: only the ``done`` was lost
                self.phase = Phase.ENDED
                return Complete(self.finish_seen, self.total, 0, self.stop_seen)
            if self.max_tokens is not None and self.total >= self.max_tokens:
                self.phase = Phase.ENDED
                return Complete("length", self.total)
            return self._migrate(why)
        if self.committed and 0 < self.max_migrations <= self.migrations and time_left:
            self.attempts.append(self.attempt_record(why))  # the last one was lost too: the record says why
            tried = ", ".join(a.attempt_id for a in self.attempts)
            return self._end(ErrorCode.MIGRATION_LIMIT, f"{message}; request {self.rid} already moved "
                                                         f"{self.migrations} time(s) (attempts: {tried})")
        reason = ("output was already sent to the client" if self.committed else
                  f"re-submitted {self.resubmits} time(s) already" if self.resubmits >= self.max_resubmits else
                  "no time left")
        return self._end(code, f"{message}: {reason}")

    def _migrate(self, why: str) -> Migrate:
        """Continue after the tokens the client has, as a new attempt (module docstring)."""
        old = self.attempt_id
        self.attempts.append(self.attempt_record(why))
        self.migrations += 1
        self.delivered += self.received
        self.received = 0
        self._next_attempt(f"{self.rid}-m{self.migrations}")
        return Migrate(old, self.attempt_id, why, self.delivered, "".join(self.texts),
                       list(self.ids) if self.ids is not None else None)

    def _next_attempt(self, attempt_id: str) -> None:
        self.attempt_id = attempt_id
        self.phase, self.kind, self.node, self.handoff_node, self.token_node = Phase.QUEUED, None, None, None, None
        self.finish_seen = self.stop_seen = None

    def _end(self, code: ErrorCode, message: str, status: int | None = None) -> Fail:
        """End with ``code`` (HTTP ``status``: the code's unless an error event carried its own)."""
        self.phase = Phase.ENDED
        return Fail(code.status if status is None else status, code, message, self.attempt_id)  # cancel: the nodes too

    def _drop(self, reason: str) -> Ignore:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return Ignore(reason)
