"""Out events (``kairos.out.<request id>.<sender user>``: node agent / dispatcher -> ingress) and the
ingress's broadcasts to the node agents (``kairos.cancel``, ``kairos.resend``): typed wire messages as
in :mod:`kairos.contracts.wire` (JSON bodies, a schema version ``v``, units in field names; encoded and
decoded with its :func:`~kairos.contracts.wire.encode` / :func:`~kairos.contracts.wire.decode`). The
table of subjects, producers and consumers is ``docs/bus.md``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import SCHEMA_VERSION, NonNeg, Pos

class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's text, logprob, the step's top ``[text, logprob]`` (sampled first): vLLM completions'."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = []


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True, tag="tokens"):
    """Tokens of one engine step (usually one); the last may carry the finish (docs/bus.md, Out events)."""

    v: int = SCHEMA_VERSION
    request_id: str
    first_index: NonNeg  #: output index of the first token in ``text``
    count: Pos  #: tokens in this event
    text: str  #: their text (emulated engines produce placeholder words)
    node: str
    sent_unix_ms: float
    finish_reason: Literal["length", "stop", "abort"] | None = None  #: last event, if the engine knew (vLLM's)
    stop_reason: str | int | None = None  #: with it: the stop string / token id that ended it (vLLM's), else None
    logprobs: list[TokenLogprob] | None = None  #: one per token when asked for (optional)
    #: the tokens' ids, when the engine gives them (a migrated request continues from them: ``Resume``)
    token_ids: list[NonNeg] | None = None


class DoneEvent(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    """The request finished; no more events follow."""

    v: int = SCHEMA_VERSION
    request_id: str
    completion_tokens: NonNeg
    finish_reason: Literal["length", "stop", "abort"] = "length"
    cached_tokens: NonNeg = 0  #: prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    node: str
    sent_unix_ms: float
    stop_reason: str | int | None = None  #: the stop string / token id that ended it (vLLM's), else None


class ErrorEvent(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """The request failed; no more events follow. ``status`` is the HTTP status the ingress returns."""

    v: int = SCHEMA_VERSION
    request_id: str
    status: int  #: HTTP status (``code.status``: 503 no capacity/node, 500 internal, 504 deadline)
    code: ErrorCode  #: the OpenAI-style error code, one of the catalogue (kairos.contracts.errors, docs/errors.md)
    message: str
    source: str  #: service/replica/node that gave up
    sent_unix_ms: float


class HandoffEvent(msgspec.Struct, frozen=True, kw_only=True, tag="handoff"):
    """Keep path: prefill ``node`` handed the request's KV cache to ``decode_node`` (it accepted),
    whose events the ingress then accepts. Sent on the prefill node's own out subject; the ingress
    trusts it because the routing event named that node (kairos/services/ingress/senders.py)."""

    v: int = SCHEMA_VERSION
    request_id: str
    node: str  #: the prefill node (its agent publishes this)
    decode_node: str  #: the decode node that took the KV
    sent_unix_ms: float
    decode_epoch_unix_ms: float = 0.0  #: that decode agent's incarnation (``KvAck.epoch_unix_ms``; 0: unknown)


OutEvent = Union[TokenEvent, DoneEvent, ErrorEvent, HandoffEvent]


class Cancel(msgspec.Struct, frozen=True, kw_only=True):
    """Abort a request everywhere (client disconnected, or the ingress timed it out)."""

    v: int = SCHEMA_VERSION
    request_id: str
    reason: str


class Drain(msgspec.Struct, frozen=True, kw_only=True):
    """Drain ``node`` (``kairos.drain.<node>``; an operator's ``kairos drain``, through the ingress's
    admin endpoint): it finishes what it runs, moves the rest and exits (issue 33)."""

    v: int = SCHEMA_VERSION
    node: str
    reason: str  #: who asked (recorded in the agent's log)
    sent_unix_ms: float


class Resend(msgspec.Struct, frozen=True, kw_only=True):
    """The ingress lost its NATS server and reconnected to another cluster member: every node agent
    publishes again the out events it sent in the last ``window_s`` seconds (the dead server may
    have had them; the ingress drops what it already has by token index). Agents cap ``window_s``
    at what they keep (``kairos/services/node_agent/outbox.py``)."""

    v: int = SCHEMA_VERSION
    window_s: Annotated[float, msgspec.Meta(gt=0)]
    sent_unix_ms: float
