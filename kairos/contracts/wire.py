"""Typed wire messages exchanged over NATS (JSON bodies, so ``nats sub`` shows readable text).

Every message is a frozen msgspec Struct with a schema version ``v`` and units in field names.
Subjects are in :mod:`kairos.contracts.subjects`; the table with producers/consumers is ``docs/bus.md``.
Times named ``*_unix_ms`` are wall-clock milliseconds since the epoch *of the producing process*;
durations are ``*_ms``. Decoding validates types and names the offending field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar, Union

import msgspec

from kairos.core.cluster.snapshot import BatchSize, KvTokens, NonNegInt
from kairos.core.model.correction import StepCorrection
from kairos.core.policy.base import Decision
from kairos.contracts.errors import ErrorCode
from kairos.core.vocabulary import PathKind, WirePathKind, path_kind

#: 2: the keep path is ``kind="keep"`` everywhere (v1 said ``"prefill"`` in Job, RoutedEvent and
#: DecodeTiming; decoders still read it as ``keep`` for one release, see kairos.core.vocabulary)
SCHEMA_VERSION = 2

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(ge=1)]
BacklogMs = Annotated[float, msgspec.Meta(ge=0, le=1e9)]


def now_ms() -> float:
    """Wall clock in ms since the epoch (the ``*_unix_ms`` fields)."""
    return time.time() * 1000.0


class WireError(ValueError):
    """A message body does not decode into its schema (the message names the field)."""


# -- ingress -> dispatchers (core NATS request to the queue group "dispatchers", subject kairos.req.route) ---

class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling parameters of one request, with the OpenAI / vLLM names (``None`` = engine default).

    Carried on :class:`InferenceRequest` so every backend sees what the client asked for: a vLLM
    backend merges :func:`sampling_body` into its ``/v1/completions`` body (the field names are
    vLLM's ``CompletionRequest`` names, vllm/entrypoints/openai/protocol.py); the emulated engine
    honours the ones that shape its deterministic output (``seed``, ``stop``, ``stop_token_ids``,
    ``min_tokens``, ``ignore_eos``, ``include_stop_str_in_output``; see
    :mod:`kairos.core.engine_model.text`). The ingress validated the values (ranges, token ids against the
    vocabulary) before building this.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None  #: stop strings (a single OpenAI string becomes a one-item list)
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None  #: token id (decimal string) -> bias in [-100, 100]
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    #: structured output (``{"type": "json_object" | "json_schema", ...}``) for vLLM's engine that decodes;
    #: ``logprobs``: top logprobs per output token (vLLM ``CompletionRequest.logprobs``, 0-20), answered in
    #: :attr:`TokenEvent.logprobs`. Emulated ingresses refuse both. Optional (omitted when unset).
    response_format: dict[str, Any] | None = None
    logprobs: int | None = None


def sampling_body(sp: SamplingParams) -> dict:
    """The non-``None`` fields of ``sp`` as a dict, ready to merge into a vLLM ``/v1/completions`` body."""
    return {f: v for f in sp.__struct_fields__ if (v := getattr(sp, f)) is not None}


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """Where a migrated request resumes (issue 33). Its node was lost after ``output_tokens`` of its
    output reached the client; the new attempt keeps the original prompt and sampling, and the
    engine continues with output token ``output_tokens`` — as if the original prompt were followed
    by those tokens (Dynamo's migration, vLLM's ``prompt_token_ids`` + output ids)."""

    output_tokens: Pos  #: output tokens the client has (the original's indices 0 .. n-1)
    output_text: str  #: their text, as sent to the client
    #: their token ids, when the engines that produced them gave ids (vLLM), else None
    output_token_ids: list[NonNeg] | None = None


class InferenceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One client request, as the ingress accepted it (or, with ``resume``, its continuation: then
    ``prompt_tokens`` counts the output tokens already sent and ``max_tokens`` is what is left)."""

    v: int = SCHEMA_VERSION
    request_id: str  #: ingress-assigned id (``cmpl-…``/``chatcmpl-…``), also the out-subject token
    model: str  #: served model name the client asked for
    prompt_tokens: Pos  #: ℓ_r, prompt length in tokens (tokenizer count, estimate, or exact ids)
    max_tokens: Pos  #: output tokens to generate (the emulated engine always generates all of them)
    prompt_tokens_exact: bool = True  #: False when prompt_tokens is the documented estimate
    prompt_text: str | None = None  #: rendered prompt text (for a real-engine backend), or None
    prompt_token_ids: list[int] | None = None  #: token-id prompt as sent by the client, or None
    created_unix_ms: float  #: when the ingress accepted the request
    deadline_unix_ms: float  #: after this the ingress has answered 504; nobody should work on it
    sampling: SamplingParams = SamplingParams()  #: the client's sampling parameters (contract C)
    #: prefix-cache hashes of the prompt's full blocks of ``block_hash_tokens`` tokens each
    #: (kairos/core/cluster/prefix_index.py: from the token ids, else from the text at the ingress's 4 bytes/token);
    #: empty when the ingress hashes nothing
    block_hashes: list[int] = []
    block_hash_tokens: NonNeg = 0
    #: False when the client set no max_tokens (``max_tokens`` is then the endpoint's default: 16 for
    #: completions, the remaining context for chat); the emulated engine ends such requests with EOS
    max_tokens_explicit: bool = True
    resume: Resume | None = None  #: a migrated request's continuation point (None: from the start)


# -- dispatcher -> node agent (request-reply on kairos.jobs.<node>) ----------------------------------

class PathKindField:
    """Mixin of the structs with a ``kind`` path field: a v1 ``"prefill"`` is read as ``"keep"``."""

    def __post_init__(self) -> None:
        if self.kind != (k := path_kind(self.kind)):  # type: ignore[attr-defined]
            msgspec.structs.force_setattr(self, "kind", k)


class Job(PathKindField, msgspec.Struct, frozen=True, kw_only=True):
    """A routed request for one node: keep-path prefill on a prefill node, or a deflection."""

    v: int = SCHEMA_VERSION
    #: ``keep`` (prefill here, then KV handoff) or ``deflect`` (chunked prefill + decode here); a PathKind
    kind: WirePathKind
    request: InferenceRequest
    node: str  #: the node this job is for
    #: keep path: decode nodes to hand the KV to, in order of preference (first = the decision's)
    decode_candidates: list[str] = []
    chunk_schedule: list[int] = []  #: deflect: χ per step (total batch tokens incl. decodes)
    predicted_step_ms: list[float] = []  #: deflect: the policy's predicted latency per step, ms
    #: deflect: TTL (s) of the reservation the decode node publishes while it runs this prefill
    #: (``kairos_resv``; 0: the node's default); set from the decision (kairos.core.cluster.routing.reservation_ttl_s)
    reservation_ttl_s: NonNeg = 0
    #: deflect: B_n of the decode node the decision assumed (its chunk schedule's χ_i include these
    #: B decode tokens; a vLLM engine is given p_i = χ_i − B prompt tokens per step)
    decision_batch_size: NonNeg = 0
    dispatcher_id: str = ""  #: replica that routed the job
    attempt: NonNeg = 0  #: 0 for the first node tried, +1 per re-route
    #: the decision's TTFT estimate for this path, ms (Eq. 1 keep, Eq. 6 deflect; None: the policy
    #: made none): the ingress, which sends the job, records predicted against measured TTFT
    predicted_ttft_ms: float | None = None


class JobAck(msgspec.Struct, frozen=True, kw_only=True):
    """Reply of a node agent to a :class:`Job`."""

    v: int = SCHEMA_VERSION
    accepted: bool
    node: str
    #: why not (``wrong_role``, ``draining``, ``too_long``, ``cancelled``, …) or ``duplicate``; the
    #: ingress's own when it relays one: :data:`JOB_NO_RESPONDERS`, :data:`JOB_UNANSWERED`, :data:`JOB_CANCELLED`
    reason: str = ""
    accepted_unix_ms: float = 0.0  #: node clock when the engine got the job (aggregator dedup key)
    #: the accepting agent's incarnation (``NodeState.epoch_unix_ms``): a later epoch lost the request
    epoch_unix_ms: float = 0.0
    #: an accepted deflection: the reservation the node stored for it (``kairos_resv``), its key and
    #: revision — the dispatcher applies it at once (a KV watcher may deliver it later, or never when
    #: the node deletes it first) and ignores older watched events of that key
    reservation: "Reservation | None" = None
    reservation_key: str | None = None
    reservation_revision: int | None = None


#: reasons of a :class:`JobAck` the ingress writes itself when it relays a job (docs/bus.md, "The
#: request path"): no agent subscribed to the node's job subject, the node did not answer within the
#: ingress's job timeout (it may run the job: the attempt moves), or the job was not sent (the
#: attempt runs elsewhere, moved or ended)
JOB_NO_RESPONDERS, JOB_UNANSWERED, JOB_CANCELLED = "no_responders", "timeout", "cancelled"


#: where a job plan's request goes: the first field after ``v`` and ``kind`` (:func:`job_with_request`)
_PLAN_REQUEST = b'"request":null'
#: a plan's ``"request":null`` lies within this many bytes of its start (``{"v":…,"kind":"deflect",``)
_PLAN_REQUEST_WITHIN = 64


def job_plan(job: Job) -> bytes:
    """``job`` as a dispatcher hands it to the request's ingress: without its request (``null``), which
    the ingress holds already and splices back in (:func:`job_with_request`). So the prompt is encoded
    once, by the ingress, and crosses the bus twice (to a dispatcher, to the node), not three times."""
    return encode(msgspec.structs.replace(job, request=None))  # replace does not validate: null on the wire


def job_with_request(plan: bytes, request: bytes) -> bytes:
    """The job for the node: ``plan`` (:func:`job_plan`) with ``request`` — an encoded
    :class:`InferenceRequest`, the bytes the ingress sent to the dispatchers — where the plan has
    ``null``. msgspec writes a struct's fields in their declared order, and :class:`Job` declares only
    ``v`` and ``kind`` (a path name) before ``request``: its ``"request":null`` is the first, near the start.

    Raises:
        WireError: ``plan`` has no ``"request":null`` there (it is not a plan).
    """
    at = plan.find(_PLAN_REQUEST, 0, _PLAN_REQUEST_WITHIN + len(_PLAN_REQUEST))
    if at < 0:
        raise WireError('not a job plan: no "request":null among its first fields')
    return b"".join((plan[:at + len(_PLAN_REQUEST) - 4], request, plan[at + len(_PLAN_REQUEST):]))


class JobHead(PathKindField, msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a :class:`Job` the ingress reads when it relays one (msgspec skips the rest, the
    request and its prompt included: the job's bytes go to the node as they came)."""

    kind: WirePathKind
    node: str
    decode_candidates: list[str] = []
    predicted_ttft_ms: float | None = None


# -- prefill agent <-> decode agent ------------------------------------------------------------------

class KvHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """Keep path: prefill finished on ``src_node``; the decode node should pull the KV and decode."""

    v: int = SCHEMA_VERSION
    request: InferenceRequest
    src_node: str  #: prefill node holding the KV blocks
    kv_tokens: NonNeg  #: KV tokens to transfer (the prompt length)
    prefill_done_unix_ms: float
    cached_tokens: NonNeg = 0  #: prompt tokens the prefill node served from its prefix cache
    #: vLLM prefill node: the engine's ``kv_transfer_params`` for this KV (NIXL remote block ids,
    #: engine id, host, port, …), passed unchanged to the decode node's engine; None when emulated
    kv_transfer_params: dict[str, Any] | None = None
    #: a revocation, published without a reply subject (issue 33): this offer timed out and the KV went
    #: to another decode node (or nowhere); a decode node that took it late gives it up unstarted
    revoke: bool = False


class KvAck(msgspec.Struct, frozen=True, kw_only=True):
    """Reply of the decode agent to a :class:`KvHandoff` (before the transfer starts)."""

    v: int = SCHEMA_VERSION
    accepted: bool
    node: str
    reason: str = ""
    epoch_unix_ms: float = 0.0  #: the accepting agent's incarnation (as JobAck's)


class KvDone(msgspec.Struct, frozen=True, kw_only=True):
    """The decode node finished pulling (``ok``) or gave up on (``not ok``) a KV cache."""

    v: int = SCHEMA_VERSION
    request_id: str
    decode_node: str
    ok: bool
    transfer_ms: float = 0.0  #: emulated transfer time incl. waiting for the link, ms


# -- node agent -> aggregator (kairos.state.<node>), dispatcher -> aggregator (kairos.route.decided) ---

NodeRole = Literal["prefill", "decode"]


class InFlight(msgspec.Struct, frozen=True):
    """A deflected prefill still running (mirrors :class:`kairos.core.cluster.snapshot.InFlightDeflection`)."""

    prompt_tokens: NonNegInt  #: prefill tokens not yet computed
    output_tokens: NonNegInt = 0


class NodeState(msgspec.Struct, frozen=True, kw_only=True):
    """Heartbeat of one node agent: its engine state, every ``period_ms``. Counts carry the policy
    input's bounds (:mod:`kairos.core.cluster.snapshot`; issue 32): outside them it is refused."""

    v: int = SCHEMA_VERSION
    node: str
    role: NodeRole
    seq: NonNeg  #: increments per heartbeat within one incarnation (restart resets it)
    sent_unix_ms: float
    #: the agent's incarnation: its start time (wall clock ms); a restart is a newer epoch (kairos/core/cluster/heartbeat.py)
    epoch_unix_ms: float = 0.0
    period_ms: float  #: heartbeat period the agent uses
    batch_size: BatchSize = 0  #: B_n, running decodes
    kv_tokens: KvTokens = 0  #: K_n, cached KV tokens of those decodes
    queue_prompt_tokens: list[NonNegInt] = []  #: prefill tokens still to compute per queued request, FIFO
    deflection_in_flight: bool = False
    in_flight: list[InFlight] = []
    waiting: BatchSize = 0  #: requests waiting for admission
    free_kv_tokens: KvTokens = 0
    running: BatchSize = 0
    kv_backlog_ms: BacklogMs = 0.0  #: prefill node: KV transfers handed off but not yet pulled, ms (link model)
    accepting: bool = True  #: False while draining, or while its engine cannot take work
    draining: bool = False  #: the node is draining (SIGTERM, ``kairos drain``): it finishes what it has, then exits
    #: prefix-cache events (kairos/core/engine_model/prefix.py, kairos/core/cluster/prefix_index.py ``on_heartbeat``): the cache's
    #: block size in tokens (0: the engine reports no cache), the block hashes stored and removed
    #: since the previous heartbeat (net), or with ``cache_full`` the whole cache in ``cache_stored``
    cache_block_tokens: NonNeg = 0
    cache_stored: list[int] = []
    cache_removed: list[int] = []
    cache_full: bool = False


class NodeStateHead(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a :class:`NodeState` that say who sent it and when — what the ingress reads of
    every heartbeat (liveness, kairos/core/cluster/heartbeat.py ``accept_heartbeat``, and the node's
    role). Decoding this skips the engine state and the prefix-cache events (up to 32k hashes every
    50th heartbeat; issue 34: the ingress decoded all of it, 2,880 heartbeats/s at 32P256D). Same
    names, types and bounds as :class:`NodeState`; every other field is skipped unread."""

    v: int = SCHEMA_VERSION
    node: str
    role: NodeRole
    seq: NonNeg
    sent_unix_ms: float
    epoch_unix_ms: float = 0.0
    period_ms: float


class RoutedEvent(PathKindField, msgspec.Struct, frozen=True, kw_only=True):
    """A job a node accepted; the aggregator adds it to the view until the node's state shows it."""

    v: int = SCHEMA_VERSION
    request_id: str
    kind: WirePathKind  #: a PathKind once decoded (``keep`` / ``deflect``)
    node: str  #: node that accepted the job
    decode_node: str
    prompt_tokens: NonNeg
    output_tokens: NonNeg
    node_accepted_unix_ms: float  #: from JobAck (node clock, comparable with NodeState.sent_unix_ms)
    #: the decision's TTFT estimate for the path taken, ms (kairos.core.cluster.routing.predicted_ttft_ms;
    #: None: the policy made none)
    predicted_ttft_ms: float | None = None
    #: the request lane the routed copy came from in the release before issue 34 (request lanes are
    #: gone: None; still read so that an older dispatcher's event decodes)
    lane: int | None = None
    #: the accepting agent's incarnation (``JobAck.epoch_unix_ms``; 0: unknown)
    node_epoch_unix_ms: float = 0.0


class StepRecordEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One executed engine step (``kairos.steps.<node>``, core NATS), from the backend-neutral
    ``StepOutput`` of any backend: predicted vs actual for the closed-loop correction (aggregator)
    and the samples ``kairos profile`` fits.

    ``prefill_cached`` is the token-weighted mean of the chunks' cached prompt tokens (the model's
    ``c``/``prefill_cached`` input, exact for its bilinear features).
    """

    v: int = SCHEMA_VERSION
    node: str
    role: NodeRole
    step: NonNeg
    started_unix_ms: float
    wall_ms: float  #: measured step time, ms
    predicted_ms: float  #: the node's latency model on this step's batch, ms
    batch_size: NonNeg  #: B, decodes in the step
    kv_tokens: NonNeg  #: K, their context tokens
    prefill_tokens: NonNeg  #: new prompt tokens in the step (all chunks)
    prefill_cached: float = 0.0
    prefill_chunks: NonNeg = 0  #: prefill chunks in the step
    deflected: bool = False  #: a deflected chunk ran in this step
    model_version: str = ""  #: ``name@version`` of the node's latency model


#: the body of ``kairos.steps.<node>``: a batch of step records (a JSON array; node agents send one
#: at most ``STEP_BATCH_S`` after its first step) or a single record (a JSON object, as tools may send)
StepRecords = list[StepRecordEvent] | StepRecordEvent

#: a node agent sends its step records at most this many seconds after the step (one message per
#: batch instead of one per step: ~1000 steps/s at near-zero step times, issue 12 item 5)
STEP_BATCH_S = 0.05
#: … or as soon as this many are waiting (a batch stays far below NATS' 1 MiB max_payload)
STEP_BATCH_MAX = 256

#: most prefix-cache block hashes one heartbeat carries (``NodeState.cache_stored`` +
#: ``cache_removed``): ~20 bytes of JSON each, 650 KB at most, under NATS' default 1 MiB
#: ``max_payload``. A decode node can cache 70,000+ blocks (1.15 M tokens in 16-token blocks): its
#: full sync then carries the most recently used ones (``PrefixCache.recent_hashes``), and a delta
#: larger than this becomes such a full sync — the dispatchers' index under-reports hits
#: (conservative), instead of the heartbeat being refused by the server and the index forgetting
#: the node for good.
CACHE_SYNC_MAX_HASHES = 32_768


def decode_step_records(data: bytes) -> list[StepRecordEvent]:
    """The step records of one ``kairos.steps.<node>`` message (:data:`StepRecords`).

    Raises:
        WireError: neither a record nor an array of records.
    """
    recs = decode(data, StepRecords)  # type: ignore[arg-type]
    return recs if isinstance(recs, list) else [recs]


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """One node in the cluster view (state + what was routed to it since)."""

    node: str
    role: NodeRole
    stale: bool  #: heartbeats stopped (no state for stale_after_ms): route nothing here
    age_ms: float  #: time since the aggregator received this node's last heartbeat, at build time
    accepting: bool = True
    draining: bool = False  #: its heartbeat says it drains (route nothing here; it exits when done)
    batch_size: BatchSize = 0
    kv_tokens: KvTokens = 0
    queue_prompt_tokens: list[NonNegInt] = []
    deflection_in_flight: bool = False
    in_flight: list[InFlight] = []
    waiting: BatchSize = 0
    kv_backlog_ms: BacklogMs = 0.0
    pending_routed: NonNeg = 0  #: routed jobs not yet visible in the node's state (already folded in)
    #: node clock time its last state was sent (RoutedEvent.node_accepted_unix_ms is comparable)
    state_sent_unix_ms: float = 0.0
    pending_ids: list[str] = []  #: request ids of the routed jobs folded in (``pending_routed`` of them)
    #: learned step-time correction of this node (aggregator, from kairos.steps.<node>); kairos+ uses it
    correction: StepCorrection = StepCorrection()


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    """The aggregator's materialized view (KV bucket kairos_view, key ``view``)."""

    v: int = SCHEMA_VERSION
    seq: NonNeg
    built_unix_ms: float
    period_ms: float
    stale_after_ms: float
    nodes: list[NodeView] = []


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Value of a reservation key: which request holds the decode node's deflection slot."""

    v: int = SCHEMA_VERSION
    request_id: str
    decode_node: str
    dispatcher_id: str
    prompt_tokens: NonNeg
    output_tokens: NonNeg = 0
    created_unix_ms: float
    expires_unix_ms: float  #: the bus deletes the key at this time even if nobody releases it


# -- encoding helpers --------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
_decoders: dict[object, msgspec.json.Decoder] = {}


def encode(msg: msgspec.Struct | list) -> bytes:
    """JSON body of a wire message (a struct, or a list of them: :data:`StepRecords`)."""
    return _encoder.encode(msg)


def decode(data: bytes, typ: type[T]) -> T:
    """Decode and validate a body into ``typ`` (a Struct or a union of them: ``kairos.contracts.events.OutEvent``).

    Raises:
        WireError: invalid JSON or schema mismatch; the message names the field.
    """
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.json.Decoder(typ)
    try:
        return dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        name = getattr(typ, "__name__", str(typ))
        raise WireError(f"bad {name} message: {exc}") from None
