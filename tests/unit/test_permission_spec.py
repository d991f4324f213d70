"""The bus permission table against a spec written from intent (docs/security.md), not from the
generator: for each role, the exact subjects it may publish and subscribe to — bus subjects, KV
keys it may write (``$KV.<bucket>.<key>``), the JetStream API calls that read buckets and streams —
as literal patterns typed from the docs' table and rules, never built with ``kairos.contracts.permissions``
or ``kairos.contracts.subjects``. Then every role is tried on a concrete subject of every subject builder,
constant and bucket of ``kairos/contracts/subjects.py`` (its own node's, another node's, every user's): the
table must allow exactly what the spec allows and deny everything else.

The same spec is tried against a real nats-server running the committed ``ops/nats/auth.conf`` by
``tests/integration/test_permission_spec_server.py``.
"""

from __future__ import annotations

import hashlib
import inspect

import pytest

from kairos.contracts import permissions as P
from kairos.contracts import subjects as S

#: the node agents of the compose deployment (ops/nats/auth.conf)
NODES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
USERS = ("ingress", "dispatcher", "aggregator", "profiler", *(f"agent-{n}" for n in NODES))

# --- the spec: docs/security.md "NATS: one user per role", typed out -----------------------------

#: every control-plane service calls ensure_buckets at start: API level, then create/look up the
#: view, reservation and requests buckets ("STREAM.CREATE/STREAM.INFO of the streams they declare")
_DECLARE_BUCKETS = {
    "$JS.API.INFO",
    "$JS.API.STREAM.CREATE.KV_kairos_view", "$JS.API.STREAM.INFO.KV_kairos_view",
    "$JS.API.STREAM.CREATE.KV_kairos_resv", "$JS.API.STREAM.INFO.KV_kairos_resv",
    "$JS.API.STREAM.CREATE.KV_kairos_requests", "$JS.API.STREAM.INFO.KV_kairos_requests",
}
#: the execution claims' buckets of the releases before issue 34 (one per NATS member): nobody may use them now
OLD_CLAIM_BUCKETS = ("kairos_claims_0", "kairos_claims_1", "kairos_claims_2", "kairos_claims_3", "kairos_claims_4")
_DECLARE_MODELS = {"$JS.API.STREAM.CREATE.KV_kairos_models", "$JS.API.STREAM.INFO.KV_kairos_models"}


def _watch(stream: str) -> set[str]:
    """A control-plane role watching / reading a bucket: "CONSUMER.CREATE.<stream> (the unnamed
    form of nats-py's ordered consumers), CONSUMER.DELETE/INFO, DIRECT.GET, STREAM.MSG.GET and
    $JS.FC.<stream>.>" (docs/security.md)."""
    return {f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>"}


def _agent(node: str) -> dict:
    u = f"agent-{node}"
    return {
        "publish": {
            f"kairos.state.{node}", f"kairos.steps.{node}",  # its own only
            f"kairos.out.*.{u}", f"kairos.kv.*.{u}", f"kairos.kvdone.*.{u}",  # under its own name
            f"$KV.kairos_resv.decode.{node}.*",  # its own reservations: the only writer
            f"$KV.kairos_requests.*.prefill.{node}", f"$KV.kairos_requests.*.decode.{node}",
        },  # no JetStream API at all
        "subscribe": {f"_INBOX.{u}.>", f"kairos.jobs.{node}", f"kairos.kv.{node}.*", f"kairos.kvdone.{node}.*",
                      "kairos.cancel", "kairos.resend", f"kairos.drain.{node}"},  # its own drain only
        "allow_responses": True,
    }


SPEC: dict[str, dict] = {
    "ingress": {
        "publish": {
            "kairos.req.route",  # requests (and /health's pings) to the dispatchers' queue group
            "kairos.jobs.*",  # every job of its requests: a dispatcher plans it, the ingress sends it (issue 34)
            "kairos.cancel", "kairos.resend",
            "kairos.drain.*",  # an operator's drain (its admin endpoint), to any node: only the ingress
            "$KV.kairos_requests.*.ingress",
            *_DECLARE_BUCKETS, *_watch("KV_kairos_view"),
            "$JS.API.DIRECT.GET.KV_kairos_requests.$KV.kairos_requests.>",  # records by key
            *_watch("KV_kairos_requests"),  # a window's records (GET /v1/admin/workload, kairos plan --from-live)
        },
        "subscribe": {"_INBOX.ingress.>", "kairos.out.*.*", "kairos.state.*",
                      "kairos.view"},  # the views (core NATS); the bucket's last one is read once
        "allow_responses": True,  # the node's answer to a dispatcher's job, relayed on its reply subject
    },
    "dispatcher": {
        "publish": {
            "kairos.route.decided", "kairos.out.*.dispatcher", "$KV.kairos_requests.*.decision",
            # a request's answer (taken), its routing's alive notices and its jobs, to the ingress
            "_INBOX.ingress.>",
            *_DECLARE_BUCKETS, *_DECLARE_MODELS,
            # watches the view, the reservations (read only) and the latency models (hot reload)
            *_watch("KV_kairos_view"), *_watch("KV_kairos_resv"), *_watch("KV_kairos_models"),
        },
        # heartbeats: "kairos.state.<node>: aggregator, ingress, dispatcher" (origin section)
        "subscribe": {"_INBOX.dispatcher.>", "kairos.req.route",  # requests, as a queue group
                      "kairos.route.decided", "kairos.cancel", "kairos.state.*", "kairos.view"},
        "allow_responses": False,
    },
    "aggregator": {
        "publish": {"kairos.view", "$KV.kairos_view.view", *_DECLARE_BUCKETS},
        "subscribe": {"_INBOX.aggregator.>", "kairos.state.*", "kairos.route.decided", "kairos.steps.*"},
        "allow_responses": False,
    },
    "profiler": {
        "publish": {
            "$KV.kairos_models.>", "kairos.jobs.*", "kairos.kv.*.profiler", "kairos.cancel",
            *_DECLARE_BUCKETS, *_DECLARE_MODELS, *_watch("KV_kairos_models"),
        },
        "subscribe": {"_INBOX.profiler.>", "kairos.steps.*", "kairos.state.*", "kairos.out.*.*"},
        "allow_responses": False,
    },
    **{f"agent-{n}": _agent(n) for n in NODES},
}


# --- NATS subject matching -------------------------------------------------------------------------

def covers(pattern: str, subject: str) -> bool:
    """Does permission ``pattern`` cover ``subject`` (a literal subject, or a subscription with
    wildcards: it is covered when every subject it matches is)? ``*`` is one token, ``>`` the rest
    (at least one token)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">":
            return False
        if tok != "*" and tok != s[i]:
            return False
    return len(p) == len(s)


def spec_allows(user: str, op: str, subject: str) -> bool:
    return any(covers(p, subject) for p in SPEC[user][op])


def table_allows(user: str, op: str, subject: str, perms: P.Permissions | None = None) -> bool:
    return any(covers(p, subject) for p in getattr(perms or P.role_permissions(user), op))


def test_covers_is_nats_matching():
    assert covers("a.*", "a.b") and not covers("a.*", "a.b.c") and not covers("a.*", "a")
    assert covers("a.>", "a.b.c") and not covers("a.>", "a") and covers("a.>", "a.*") and covers("a.>", "a.>")
    assert covers("a.*.c", "a.*.c") and not covers("a.b.c", "a.*.c") and not covers("a.*", "a.>")
    assert not covers("a.b", "a.c") and not covers("a.b.c", "a.b")


# --- every builder of kairos/contracts/subjects.py, as concrete subjects ------------------------------------

RID = "cmpl-1"
#: every subject/key builder and name of kairos/contracts/subjects.py this module tries; a new one fails
#: test_every_builder_of_subjects_py_is_tried until it is added here (and to the spec)
BUILDERS = {
    "state_subject", "steps_subject", "jobs_subject", "drain_subject", "kv_subject", "kv_wildcard", "kvdone_subject",
    "kvdone_wildcard", "out_subject", "out_wildcard", "reservation_key", "record_key", "model_key",
    "VIEW_SUBJECT", "ROUTE_SUBJECT", "ROUTED_SUBJECT", "CANCEL_SUBJECT", "RESEND_SUBJECT", "STATE_WILDCARD",
    "STEPS_WILDCARD", "OUT_WILDCARD", "VIEW_BUCKET", "RESERVATION_BUCKET", "REQUESTS_BUCKET", "MODELS_BUCKET",
    "VIEW_KEY", "CURRENT_MODEL_KEY",
}
BUCKETS = (S.VIEW_BUCKET, S.RESERVATION_BUCKET, S.REQUESTS_BUCKET, S.MODELS_BUCKET, *OLD_CLAIM_BUCKETS)
#: the request lanes' streams of the release before issue 34: nobody may use them now
OLD_LANE_STREAMS = ("KAIROS_REQ", "KAIROS_REQ_1", "KAIROS_REQ_2", "KAIROS_REQ_3", "KAIROS_REQ_4")
STREAMS = (*OLD_LANE_STREAMS, *(f"KV_{b}" for b in BUCKETS))


def kv_keys() -> list[str]:
    """A key of every key builder, for every node, in every form."""
    keys = [S.VIEW_KEY, S.CURRENT_MODEL_KEY, S.model_key("x"),
            "claim." + hashlib.sha256(RID.encode()).hexdigest()[:32]]  # an execution claim's key of old
    for n in NODES:
        keys += [S.reservation_key(n, 0), S.reservation_key(n, 3)]
        keys += [S.record_key(RID, part, n) for part in S.NODE_RECORD_PARTS]
    keys += [S.record_key(RID, part) for part in S.RECORD_PARTS if part not in S.NODE_RECORD_PARTS]
    return keys


def bus_subjects() -> list[str]:
    """A concrete subject of every builder and constant: each node's, each sender's."""
    out = ["kairos.req.new", "kairos.req.new.1",  # the request lanes of old: nobody publishes there now
           S.ROUTE_SUBJECT, S.VIEW_SUBJECT, S.ROUTED_SUBJECT, S.CANCEL_SUBJECT, S.RESEND_SUBJECT, S.STATE_WILDCARD,
           S.STEPS_WILDCARD, S.OUT_WILDCARD, S.out_wildcard(RID)]
    out += [S.out_subject(RID, u) for u in USERS]
    for n in NODES:
        out += [S.state_subject(n), S.steps_subject(n), S.jobs_subject(n), S.kv_wildcard(n), S.kvdone_wildcard(n),
                S.drain_subject(n)]
        out += [S.kv_subject(n, u) for u in USERS] + [S.kvdone_subject(n, u) for u in USERS]
    return out


def kv_subjects() -> list[str]:
    """Writing (and deleting: a publish too) every key in every bucket, and the bucket-wide forms."""
    return [f"$KV.{b}.{k}" for b in BUCKETS for k in [*kv_keys(), ">"]]


def js_api_subjects() -> list[str]:
    """The JetStream API on every stream: the calls some role needs and those nobody may make."""
    out = ["$JS.API.INFO"]
    for st in STREAMS:
        out += [f"$JS.API.STREAM.{op}.{st}" for op in ("CREATE", "INFO", "UPDATE", "DELETE", "PURGE", "MSG.GET",
                                                       "MSG.DELETE")]
        out += [f"$JS.API.CONSUMER.CREATE.{st}", f"$JS.API.CONSUMER.CREATE.{st}.c.kairos.req.new",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.c", f"$JS.API.CONSUMER.DELETE.{st}.c",
                f"$JS.API.CONSUMER.INFO.{st}.c", f"$JS.API.CONSUMER.MSG.NEXT.{st}.c",
                f"$JS.API.DIRECT.GET.{st}", f"$JS.FC.{st}.c.1", f"$JS.ACK.{st}.c.1.2.3.4.5"]
        out += [f"$JS.API.DIRECT.GET.{st}.$KV.{b}.{k}" for b in BUCKETS for k in kv_keys()]
    c = "dispatchers"  # the old lanes' durable consumer
    for q in OLD_LANE_STREAMS:
        out += [f"$JS.API.CONSUMER.CREATE.{q}.{c}.kairos.req.new", f"$JS.API.CONSUMER.CREATE.{q}.{c}",
                f"$JS.API.CONSUMER.CREATE.{q}.{c}.>", f"$JS.API.CONSUMER.INFO.{q}.{c}",
                f"$JS.API.CONSUMER.MSG.NEXT.{q}.{c}", f"$JS.ACK.{q}.{c}.1.2.3.4.5",
                f"$JS.API.CONSUMER.DELETE.{q}.{c}"]
    return out


def inbox_subjects() -> list[str]:
    return ["_INBOX.>", *(f"_INBOX.{u}.x" for u in USERS), *(f"_INBOX.{u}.>" for u in USERS)]


def all_subjects() -> list[str]:
    return list(dict.fromkeys(bus_subjects() + kv_subjects() + js_api_subjects() + inbox_subjects()))


def test_every_builder_of_subjects_py_is_tried():
    parsers = {"node_of_reservation_key"}  # reads a key, builds none
    names = {n for n, f in inspect.getmembers(S, inspect.isfunction)
             if n.endswith(("_subject", "_wildcard", "_key")) and n not in parsers}
    names |= {n for n, v in vars(S).items() if isinstance(v, str) and n.endswith(
        ("_SUBJECT", "_WILDCARD", "_BUCKET", "_KEY", "_STREAM", "_CONSUMER"))}
    assert names == BUILDERS


def test_the_concrete_subjects_are_what_the_spec_names():
    """A sample of the concrete subjects, written out: the builders build what the spec's literal
    patterns speak of (a renamed subject fails here, not silently as "denied to everyone")."""
    subjects = set(all_subjects())
    for s in ("kairos.state.decode-0", "kairos.jobs.prefill-1", "kairos.kv.decode-1.agent-prefill-0",
              "kairos.kvdone.prefill-0.agent-decode-1", "kairos.out.cmpl-1.dispatcher", "kairos.kv.decode-0.*",
              "$KV.kairos_view.view", "$KV.kairos_resv.decode.decode-1.3", "$KV.kairos_requests.cmpl-1.decision",
              "$KV.kairos_requests.cmpl-1.prefill.prefill-0", "$KV.kairos_models.latency.current",
              # an old execution claim's key: claim.<first 32 hex digits of SHA-256 of the request id>
              "$KV.kairos_claims_2.claim." + hashlib.sha256(RID.encode()).hexdigest()[:32],
              "kairos.req.route", "kairos.req.new.1", "$JS.API.STREAM.INFO.KAIROS_REQ_4",
              "$JS.API.STREAM.DELETE.KAIROS_REQ", "$JS.ACK.KAIROS_REQ.dispatchers.1.2.3.4.5"):
        assert s in subjects, s


# --- the table against the spec --------------------------------------------------------------------

@pytest.mark.parametrize("user", USERS)
def test_each_role_is_granted_exactly_the_spec(user):
    """The table's patterns are the spec's, no more (a broader or extra grant) and no fewer."""
    perms = P.role_permissions(user)
    assert set(perms.publish) == SPEC[user]["publish"]
    assert set(perms.subscribe) == SPEC[user]["subscribe"]
    assert perms.allow_responses is SPEC[user]["allow_responses"]


@pytest.mark.parametrize("op", ["publish", "subscribe"])
@pytest.mark.parametrize("user", USERS)
def test_every_subject_outside_a_roles_spec_is_denied(user, op):
    """Every role x a concrete subject of every builder, constant and bucket: the table allows
    exactly what the spec allows."""
    subjects, perms = all_subjects(), P.role_permissions(user)
    wrong = [(s, not spec_allows(user, op, s)) for s in subjects
             if table_allows(user, op, s, perms) != spec_allows(user, op, s)]
    assert wrong == [], f"{user} {op}: (subject, allowed by the table) contrary to the spec"
    assert any(spec_allows(user, op, s) for s in subjects)  # each role is allowed something of the sample


# What the reviewer mutated, as literal cases (each also falls under the tests above).
@pytest.mark.parametrize("user,op,subject", [
    *((f"agent-{n}", "subscribe", s) for n in NODES for s in ("kairos.kv.*.*", "kairos.kv.>", "kairos.kvdone.*.*")),
    *((f"agent-{n}", "subscribe", f"kairos.kv.{m}.agent-prefill-0") for n in NODES for m in NODES if m != n),
    *((f"agent-{n}", "publish", "kairos.cancel") for n in NODES),
    *((f"agent-{n}", "publish", f"kairos.drain.{m}") for n in NODES for m in NODES),  # no node drains another
    *((f"agent-{n}", "subscribe", "kairos.drain.*") for n in NODES),
    ("dispatcher", "publish", "kairos.drain.decode-0"),
    *((f"agent-{n}", "publish", "$KV.kairos_requests.cmpl-1.decision") for n in NODES),
    ("profiler", "publish", "$KV.kairos_view.view"),
    ("ingress", "publish", "$KV.kairos_view.view"),
    ("dispatcher", "publish", "$KV.kairos_view.view"),
    ("dispatcher", "publish", "kairos.cancel"),
    ("aggregator", "publish", "kairos.jobs.decode-0"),
    ("dispatcher", "publish", "kairos.jobs.decode-0"),  # it hands jobs to the ingress (issue 34)
    ("agent-decode-0", "publish", "_INBOX.ingress.x"),  # an agent answers jobs only as a response
])
def test_the_reviewers_mutations_are_denied(user, op, subject):
    assert not table_allows(user, op, subject)
    assert not spec_allows(user, op, subject)
