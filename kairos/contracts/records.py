"""Request records (KV bucket ``kairos_requests``): what ``GET /v1/requests/{id}`` merges.

One record per part of a request's life, each written by the service that saw it, under
``<rid>.<part>`` (:data:`kairos.contracts.subjects.RECORD_PARTS`; the node parts also under a key
naming the node): the dispatcher's decision, the keep path's prefill, the decode side (keep:
handoff + decode; deflect: chunked prefill + decode) and what the client saw at the ingress. Times
named ``*_unix_ms`` are the writer's wall clock in ms; the merge is
:mod:`kairos.services.ingress.records`. Same conventions as :mod:`kairos.contracts.wire` (frozen
msgspec structs, schema ``v``, units in names; encode/decode with its ``encode``/``decode``).
"""

from __future__ import annotations

import msgspec

from kairos.contracts.wire import SCHEMA_VERSION, NonNeg, PathKindField
from kairos.core.policy.base import Decision
from kairos.core.vocabulary import WirePathKind


class DecisionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``<rid>.decision``: what the dispatcher decided and why (written after the node accepted)."""

    v: int = SCHEMA_VERSION
    request_id: str
    dispatcher_id: str
    decision: Decision  #: the policy's decision (policy, kind, node, chunk schedule, estimates, reason)
    node: str  #: node that accepted the job (may differ from decision.node after a re-route)
    decode_node: str
    attempts: NonNeg  #: jobs sent, including refused ones
    excluded_nodes: dict[str, str] = {}  #: node -> why it was excluded while routing this request
    reservation_conflicts: list[str] = []  #: decode nodes whose reservation another request held
    state_age_ms: float | None = None  #: age of the cluster view the policy saw
    view_seq: NonNeg = 0
    decided_unix_ms: float
    decide_ms: float  #: policy evaluation time, ms (all attempts)
    routing_ms: float  #: dequeue -> node accepted, ms


class PrefillTiming(msgspec.Struct, frozen=True, kw_only=True):
    """``<rid>.prefill``: keep-path prefill on a prefill node (node clock)."""

    v: int = SCHEMA_VERSION
    node: str
    received_unix_ms: float
    prefill_start_unix_ms: float | None = None  #: first step that computed this prompt
    prefill_done_unix_ms: float | None = None
    handoff_node: str | None = None  #: decode node that accepted the KV
    error: str | None = None


class DecodeTiming(PathKindField, msgspec.Struct, frozen=True, kw_only=True):
    """``<rid>.decode``: decode node side (keep: handoff + decode; deflect: chunked prefill + decode)."""

    v: int = SCHEMA_VERSION
    node: str
    kind: WirePathKind  #: a PathKind once decoded (``keep`` / ``deflect``)
    received_unix_ms: float  #: handoff (keep) or job (deflect) received
    kv_allocated_unix_ms: float | None = None  #: keep: blocks allocated, transfer may start
    kv_arrived_unix_ms: float | None = None  #: keep: transfer done
    prefill_start_unix_ms: float | None = None  #: deflect: first chunk started
    prefill_done_unix_ms: float | None = None  #: deflect: last chunk done
    first_token_unix_ms: float | None = None
    finished_unix_ms: float | None = None
    completion_tokens: NonNeg = 0
    chunk_predicted_ms: list[float] = []  #: deflect: policy prediction per chunk step
    chunk_actual_ms: list[float] = []  #: deflect: measured wall time per chunk step
    chunk_sizes: list[int] = []  #: deflect: χ actually run per step
    error: str | None = None


class AttemptTiming(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of a request (issue 33): its bus id, the node it ran on, the output tokens it
    delivered, and why it was left (``node_lost:decode-1``, …; None: it served the end)."""

    attempt_id: str
    node: str | None = None
    output_tokens: NonNeg = 0
    moved: str | None = None


class IngressTiming(msgspec.Struct, frozen=True, kw_only=True):
    """``<rid>.ingress``: what the client saw."""

    v: int = SCHEMA_VERSION
    received_unix_ms: float
    first_token_unix_ms: float | None = None
    finished_unix_ms: float | None = None
    status: int = 200
    prompt_tokens: NonNeg = 0
    completion_tokens: NonNeg = 0  #: tokens delivered to the client (a disconnected client: those sent before)
    error: str | None = None
    error_message: str | None = None  #: the message of the error the client got (its ``error.message``)
    #: bus request ids of the re-submissions after a node was lost (``<id>-r1``, …); the decision,
    #: prefill and decode records of the attempt that served the request are under the last one
    resubmitted_as: list[str] = []
    #: the client's ``X-Request-Id`` (kairos/services/ingress/request_ids.py), None when it sent none
    client_request_id: str | None = None
    #: every attempt, in order, when there was more than one (a re-submission or a migration)
    attempts: list[AttemptTiming] = []
