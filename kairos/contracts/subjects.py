"""Every NATS subject, stream, consumer and KV bucket name Kairos uses, built in one place.

Where they go: the services (``kairos/services/*``) and the docs table (``docs/bus.md``). No other module
builds a subject string, so renaming a subject is a one-line change here.

Hierarchy::

    kairos.req.route              requests to route, request-reply to the queue group "dispatchers": ingress -> one dispatcher
    kairos.route.decided          routing events: dispatcher -> state_aggregator
    kairos.state.<node>           node state heartbeats: node_agent -> state_aggregator
    kairos.jobs.<node>            routed jobs, request-reply: ingress (a dispatcher's job) -> node_agent
    kairos.kv.<node>.<sender>     KV handoff, request-reply: prefill agent (its NATS user) -> decode agent
    kairos.kvdone.<node>.<sender> KV pulled, release blocks: decode agent (its NATS user) -> prefill agent
    kairos.out.<request_id>.<sender>  token stream / result / error: node agent (its NATS user), dispatcher -> ingress
    kairos.cancel                 client went away or timed out: ingress -> node agents
    kairos.resend                 publish your recent out events again (the ingress reconnected): ingress -> node agents
    kairos.steps.<node>           one record per engine step: node_agent -> aggregator, profiler
    $KV.kairos_view.view          cluster view (KV bucket kairos_view): aggregator -> dispatchers
    $KV.kairos_resv.decode.<node>.<slot> deflection reservation (KV bucket kairos_resv, per-message TTL)
    $KV.kairos_requests.<rid>.<part>[.<node>]  decision record + measured TTFT components (KV, bucket TTL)
    $KV.kairos_models.latency.*   latency-model artifacts: profiler -> dispatchers (watch ``latency.current``)
"""

from __future__ import annotations

import re

PREFIX = "kairos"

#: The cluster view, each as it is built (core NATS; the aggregator also keeps the last one in
#: :data:`VIEW_BUCKET`): a replicated bucket electing a leader must not hold the view back.
VIEW_SUBJECT = f"{PREFIX}.view"
#: Routing events (decision + the node's acknowledgement time), consumed by the aggregator.
ROUTED_SUBJECT = f"{PREFIX}.route.decided"
#: Requests to route (core NATS, request-reply): the ingress → one dispatcher of the queue group
#: :data:`DISPATCHER_QUEUE`, which answers :data:`TAKEN` at once (kairos/services/dispatcher/intake.py)
ROUTE_SUBJECT = f"{PREFIX}.req.route"
#: the dispatchers' queue group on :data:`ROUTE_SUBJECT`: each request reaches one replica
DISPATCHER_QUEUE = "dispatchers"
#: a dispatcher's answer to a request it took; :data:`ALIVE`: the routing it waits in goes on
TAKEN = b"taken"
ALIVE = b"alive"
#: headers of a request to route: where the dispatcher sends ``alive`` notices while it waits (the
#: ingress's per-attempt subject), and how many times the ingress has sent this attempt (1 = first)
NOTICES_HEADER = "Kairos-Notices"
DELIVERY_HEADER = "Kairos-Delivery"
#: each copy's send time (the ingress's wall clock, ms): a dispatcher drops a copy it gets later than
#: the ingress waits for its ``taken`` plus the clocks' tolerated skew (another copy is out by then)
SENT_HEADER = "Kairos-Sent-Unix-Ms"
#: a request carrying this header is a ping (the ingress's /health): answered :data:`TAKEN`, not routed
PING_HEADER = "Kairos-Ping"
#: Broadcast: abort a request (client disconnected or ingress timed out).
CANCEL_SUBJECT = f"{PREFIX}.cancel"
#: Broadcast: the ingress reconnected (its server died); agents publish their recent out events again.
RESEND_SUBJECT = f"{PREFIX}.resend"

#: KV bucket with the materialized cluster view (one key, :data:`VIEW_KEY`).
VIEW_BUCKET = "kairos_view"
VIEW_KEY = "view"
#: KV bucket of deflection reservations, one key per decode node, per-message TTL.
RESERVATION_BUCKET = "kairos_resv"
#: KV bucket of per-request records (``<rid>.decision``, ``<rid>.ingress``, ``<rid>.prefill.<node>``,
#: ``<rid>.decode.<node>``: :func:`record_key`).
REQUESTS_BUCKET = "kairos_requests"

#: KV bucket of latency-model artifacts written by ``kairos profile``: ``latency.<name>`` per
#: profile, and :data:`CURRENT_MODEL_KEY`, the one dispatchers watch and hot-reload.
MODELS_BUCKET = "kairos_models"
CURRENT_MODEL_KEY = "latency.current"

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  #: the whole token (fullmatch: ``$`` would let a trailing "\n" by)
#: :data:`_TOKEN_RE` as a JSON Schema ``pattern`` (anchored: JSON Schema patterns search)
TOKEN_PATTERN = f"^{_TOKEN_RE.pattern}$"


class SubjectError(ValueError):
    """A node or request id cannot be used as a subject token (only ``[A-Za-z0-9_-]``, ≤ 128)."""


def check_token(token: str, what: str = "id") -> str:
    """Return ``token`` if it is a valid single subject token / KV key part, else raise."""
    if not _TOKEN_RE.fullmatch(token):
        shown = token if len(token) <= 140 else f"{token[:128]}… ({len(token)} characters)"
        raise SubjectError(f"{what} {shown!r} must match [A-Za-z0-9_-]{{1,128}} (it becomes a NATS subject token)")
    return token


def subject_node(subject: str, build) -> str | None:
    """The node id ``n`` for which ``build(n) == subject`` (``build``: a one-node subject builder
    such as :func:`state_subject`, the node id its last token), else None (a subject of another
    kind, or a JetStream delivery, which keeps its stream's subject). How a consumer learns the
    sender of a per-node subject: the bus let only that node's agent publish there
    (:mod:`kairos.contracts.permissions`), so the subject, not the body, names the sender."""
    node = subject.rpartition(".")[2]
    try:
        return node if build(node) == subject else None
    except SubjectError:
        return None


def state_subject(node: str) -> str:
    """Heartbeat subject of ``node``."""
    return f"{PREFIX}.state.{check_token(node, 'node id')}"


STATE_WILDCARD = f"{PREFIX}.state.*"


def drain_subject(node: str) -> str:
    """Core NATS subject on which ``node``'s agent takes an operator's drain (``kairos drain NODE``,
    through the ingress's admin endpoint): finish what it has, move the rest, exit (issue 33)."""
    return f"{PREFIX}.drain.{check_token(node, 'node id')}"


def jobs_subject(node: str) -> str:
    """Request-reply subject on which ``node``'s agent accepts routed jobs."""
    return f"{PREFIX}.jobs.{check_token(node, 'node id')}"


def kv_subject(node: str, sender: str) -> str:
    """Request-reply subject on which decode ``node``'s agent accepts KV handoffs sent by NATS user
    ``sender`` (``agent-<prefill node>``, or ``profiler``): the bus lets each user publish only
    under its own name, so the decode node knows who hands it a KV cache (kairos/contracts/origin.py)."""
    return f"{PREFIX}.kv.{check_token(node, 'node id')}.{check_token(sender, 'NATS user')}"


def kv_wildcard(node: str) -> str:
    """Every :func:`kv_subject` of decode ``node`` (its agent's one subscription)."""
    return f"{PREFIX}.kv.{check_token(node, 'node id')}.*"


def kvdone_subject(node: str, sender: str) -> str:
    """Subject on which prefill ``node``'s agent learns that the decode node whose NATS user is
    ``sender`` (``agent-<decode node>``) pulled a KV cache: the bus lets each user publish only under
    its own name, so the prefill node knows which node says so (kairos/contracts/origin.py)."""
    return f"{PREFIX}.kvdone.{check_token(node, 'node id')}.{check_token(sender, 'NATS user')}"


def kvdone_wildcard(node: str) -> str:
    """Every :func:`kvdone_subject` of prefill ``node`` (its agent's one subscription)."""
    return f"{PREFIX}.kvdone.{check_token(node, 'node id')}.*"


def out_subject(request_id: str, sender: str) -> str:
    """Subject on which NATS user ``sender`` (``agent-<node>``, or ``dispatcher`` for routing
    errors) publishes the token stream / result / error of bus request ``request_id``. The bus lets
    each user publish only under its own name (:mod:`kairos.contracts.permissions`), so the ingress knows
    which node sent an event and accepts only the node the request's job went to (kairos/contracts/origin.py)."""
    return f"{PREFIX}.out.{check_token(request_id, 'request id')}.{check_token(sender, 'NATS user')}"


def out_wildcard(request_id: str) -> str:
    """Every sender's :func:`out_subject` of ``request_id`` (a per-request subscription)."""
    return f"{PREFIX}.out.{check_token(request_id, 'request id')}.*"


def out_origin(subject: str) -> tuple[str, str] | None:
    """``(request id, sender user)`` of an :func:`out_subject`, else None (another subject, or a
    JetStream delivery, which keeps its stream's subject)."""
    parts = subject.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != f"{PREFIX}.out":
        return None
    try:
        return (parts[2], parts[3]) if out_subject(parts[2], parts[3]) == subject else None
    except SubjectError:
        return None


#: Every request's token stream from every sender (an ingress's single subscription, dispatching
#: by the request id token).
OUT_WILDCARD = f"{PREFIX}.out.*.*"


def reservation_key(decode_node: str, slot: int = 0) -> str:
    """KV key (bucket :data:`RESERVATION_BUCKET`) reserving deflection slot ``slot`` of
    ``decode_node`` (``kairos``: one slot per node, §5.3; ``kairos+``: several)."""
    if slot < 0:
        raise SubjectError(f"reservation slot must be >= 0, got {slot}")
    return f"decode.{check_token(decode_node, 'node id')}.{slot}"


def node_of_reservation_key(key: str) -> str | None:
    """The decode node of a :func:`reservation_key` (None for a foreign key)."""
    parts = key.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "decode" and parts[2].isdigit() else None


def steps_subject(node: str) -> str:
    """Subject of ``node``'s per-step records (:class:`kairos.contracts.wire.StepRecordEvent`)."""
    return f"{PREFIX}.steps.{check_token(node, 'node id')}"


STEPS_WILDCARD = f"{PREFIX}.steps.*"


def model_key(name: str) -> str:
    """KV key (bucket :data:`MODELS_BUCKET`) of the latency artifact named ``name``."""
    return f"latency.{check_token(name, 'profile name')}"


RECORD_PARTS = ("decision", "prefill", "decode", "ingress")
#: parts a node agent writes: keyed by the writing node too (:func:`record_key`)
NODE_RECORD_PARTS = ("prefill", "decode")


def record_key(request_id: str, part: str, node: str | None = None) -> str:
    """KV key (bucket :data:`REQUESTS_BUCKET`) of one part of a request's record:
    ``<rid>.decision`` (dispatcher), ``<rid>.ingress`` (ingress), and the node agents' parts
    ``<rid>.prefill.<node>`` / ``<rid>.decode.<node>`` keyed by the node that writes them.

    Why the node in the key: NATS KV records no author, so the subject is the only proof of who
    wrote a record; an agent may write only keys ending in its own node id
    (:mod:`kairos.contracts.permissions`), and a reader asks for the record of the node the request's
    decision names — another agent's record for that request is another key, never read.

    Raises:
        SubjectError: an unknown part, a node part without ``node`` (or another part with one), or
            an id that is not a subject token.
    """
    if part not in RECORD_PARTS:
        raise SubjectError(f"unknown record part {part!r}; known: {RECORD_PARTS}")
    if (node is not None) != (part in NODE_RECORD_PARTS):
        raise SubjectError(f"record part {part!r} is keyed by node: {NODE_RECORD_PARTS} take the node id, "
                           f"the others none (got node={node!r})")
    key = f"{check_token(request_id, 'request id')}.{part}"
    return key if node is None else f"{key}.{check_token(node, 'node id')}"
