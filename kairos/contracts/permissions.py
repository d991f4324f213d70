"""Who may publish and subscribe to what on the bus: one credential per service role, with subject
permissions derived from :mod:`kairos.contracts.subjects` here and nowhere else (docs/security.md).

Roles (NATS user names): ``ingress``, ``dispatcher``, ``aggregator``, ``profiler`` and one
``agent-<node>`` per node agent. Replicas of one role share its credential (same trust).

What the table enforces (nats-server checks every PUB and SUB against it):

* an agent publishes only its own node's state (``kairos.state.<node>``) and step records
  (``kairos.steps.<node>``), receives only its own jobs / KV handoffs (``kairos.jobs.<node>``,
  ``kairos.kv.<node>``, ``kairos.kvdone.<node>``), sends KV handoffs and KV-pulled notices only
  under its own name (``kairos.kv.<decode>.agent-<node>``, ``kairos.kvdone.<prefill>.agent-<node>``),
  writes only its own node's request records (``$KV.kairos_requests.<rid>.prefill.<node>`` /
  ``.decode.<node>``), and is the only writer of its own node's
  deflection reservations (``$KV.kairos_resv.decode.<node>.*``; everybody else only reads them);
* only the ingress (and ``kairos profile``, which drives the node it profiles) publishes jobs
  (``kairos.jobs.*``: a dispatcher hands each job to the request's ingress, which sends it, issue 34);
  only dispatchers take requests (``kairos.req.route``, their queue group) and publish into the
  ingress's inbox (``taken``, ``alive``, their jobs); the ingress answers those jobs through
  ``allow_responses``; only the ingress sends requests, cancels, and reads
  token streams (``kairos.out.*.*``); an agent publishes token streams only under its own user
  (``kairos.out.<rid>.agent-<node>``), dispatchers under theirs; only the aggregator writes the cluster view
  (``$KV.kairos_view.>``); only the profiler writes latency models (``$KV.kairos_models.>``);
* replies stay private: each role's client uses its own inbox prefix ``_INBOX.<user>``
  (:func:`inbox_prefix`) and may subscribe only below it, so no role can read another's
  request-reply answers or JetStream deliveries (e.g. the prompts a dispatcher pulls);
  responders (agents) answer through ``allow_responses`` (only to requests they received).

Not enforceable by subject (documented limits): any role that declares a
stream may create it if it does not exist yet (with Kairos' own config); JetStream API calls are
allowed per stream, never ``STREAM.DELETE``/``PURGE``/``UPDATE``.

JetStream: KV writes are publishes to ``$KV.<bucket>.<key>``; reads go through the JetStream API
(``$JS.API.STREAM.INFO.<stream>``, ``CONSUMER.CREATE`` for watchers, ``DIRECT.GET`` /
``STREAM.MSG.GET`` for gets) plus ``$JS.FC.<stream>.>`` (flow-control replies of ordered
consumers); pull consumers need ``CONSUMER.MSG.NEXT`` and ``$JS.ACK.<stream>.<consumer>.>``.
Sources: nats-server "Authorization" and "JetStream API reference" docs; nats-py 2.16
``nats/js/manager.py`` and ``nats/js/kv.py`` (the subjects it calls).

No network I/O here: :func:`server_auth_config` renders the ``authorization { users = [...] }``
block of a nats-server config file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path

from kairos.contracts import subjects as S

INGRESS, DISPATCHER, AGGREGATOR, PROFILER = "ingress", "dispatcher", "aggregator", "profiler"
SERVICE_ROLES = (INGRESS, DISPATCHER, AGGREGATOR, PROFILER)
AGENT_PREFIX = "agent-"


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind KV bucket ``bucket`` (JetStream names it ``KV_<bucket>``)."""
    return f"KV_{bucket}"


class RoleError(ValueError):
    """An unknown role or a node id that cannot be a subject token."""


@dataclass(frozen=True)
class Permissions:
    """One role's permissions.

    Attributes:
        user: the NATS user name (the role).
        publish: subjects (wildcards allowed) the role may publish to.
        subscribe: subjects the role may subscribe to.
        allow_responses: may publish to the reply subject of a request it received (responders).
    """

    user: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def agent_user(node: str) -> str:
    """The NATS user of node ``node``'s agent (``agent-<node>``)."""
    return AGENT_PREFIX + S.check_token(node, "node id")


def inbox_prefix(user: str) -> str:
    """The inbox prefix ``user``'s client must use (nats-py ``inbox_prefix``): ``_INBOX.<user>``."""
    return f"_INBOX.{S.check_token(user, 'user')}"


def _declare(stream: str) -> list[str]:
    """Create (idempotent, Kairos' config) and look up a stream. Only the control-plane roles: a
    stream's config names the subjects it captures, so whoever creates one could capture (and
    replay) any subject — agents use no stream API at all."""
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.INFO.{stream}"]


def _read(stream: str) -> list[str]:
    """Read a stream / KV bucket: info, watchers (ordered push consumers), gets.

    Watchers are nats-py ordered consumers, created on the legacy subject
    ``$JS.API.CONSUMER.CREATE.<stream>`` (no consumer name: nats-py 2.16 ``nats/js/manager.py``
    ``add_consumer``), which bounds the stream but neither the filter nor the ``deliver_subject``
    (nats-server 2.15 checks neither against the creator's permissions). So only the control-plane
    roles get this; what they could deliver elsewhere keeps its stream's subject, which consumers
    of per-node subjects refuse (:mod:`kairos.contracts.origin`)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>"]


def _get(bucket: str, key_pattern: str) -> str:
    """Get keys matching ``key_pattern`` of KV ``bucket`` and nothing else: the subject form of a
    direct get names the key (``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>``, nats-py
    ``get_msg(direct=True)``; the bucket must allow direct gets)."""
    return f"$JS.API.DIRECT.GET.{kv_stream(bucket)}.$KV.{bucket}.{key_pattern}"


def _kv_buckets_declared() -> list[str]:
    """What :func:`kairos.runtime.streams.ensure_buckets` needs (every control-plane service calls it at start)."""
    out = ["$JS.API.INFO"]  # create_key_value checks the server's API level
    for b in (S.VIEW_BUCKET, S.RESERVATION_BUCKET, S.REQUESTS_BUCKET):
        out += _declare(kv_stream(b))
    return out


def _kv(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


_ANY = "ANY0TOKEN"  # a valid token the subject builders accept, replaced by the NATS wildcard


def _any(build, *args) -> str:
    """``build(<any token>, *args)`` as a wildcard pattern: every id position becomes ``*``."""
    return build(_ANY, *args).replace(_ANY, "*")


def role_permissions(user: str) -> Permissions:
    """The permissions of NATS user ``user`` (a service role or ``agent-<node>``).

    Raises:
        RoleError: unknown role, or an agent node id that is not a subject token.
    """
    rec, view, resv, models = S.REQUESTS_BUCKET, S.VIEW_BUCKET, S.RESERVATION_BUCKET, S.MODELS_BUCKET
    try:
        sub = [inbox_prefix(user) + ".>"]
    except S.SubjectError as exc:
        raise RoleError(str(exc)) from None
    if user == INGRESS:
        # requests go to the dispatchers' queue group (request-reply; a ping of it is one too)
        # jobs: the ingress sends every job of its requests (a dispatcher plans it: kairos/services/ingress/jobrelay.py)
        pub = [S.ROUTE_SUBJECT, _any(S.jobs_subject), S.CANCEL_SUBJECT, S.RESEND_SUBJECT,
               _kv(rec, _any(S.record_key, "ingress")), _any(S.drain_subject)]
        # records are read: one by its key (a get), a window's by an ordered consumer (GET /v1/admin/workload)
        pub += _kv_buckets_declared() + _read(kv_stream(view)) + _read(kv_stream(rec)) + [_get(rec, ">")]
        # heartbeats: the ingress judges node liveness itself (kairos/core/cluster/heartbeat.py), aggregator or not
        sub += [S.OUT_WILDCARD, S.STATE_WILDCARD, S.VIEW_SUBJECT]
        # it answers a dispatcher's job (on its own inbox) with the node's answer: a response
        return Permissions(user, _uniq(pub), _uniq(sub), allow_responses=True)
    if user == DISPATCHER:
        pub = [S.ROUTED_SUBJECT, _any(S.out_subject, DISPATCHER), _kv(rec, _any(S.record_key, "decision"))]
        # a request's answer (taken), its routing's alive notices and its jobs go to the ingress's inbox
        pub += [inbox_prefix(INGRESS) + ".>"]
        pub += _kv_buckets_declared()
        pub += _read(kv_stream(view)) + _read(kv_stream(resv)) + _declare(kv_stream(models)) + _read(kv_stream(models))
        # heartbeats: prefix-aware policies (kairos+, dynamo) index the nodes' prefix-cache events
        sub += [S.ROUTE_SUBJECT, S.ROUTED_SUBJECT, S.CANCEL_SUBJECT, S.STATE_WILDCARD, S.VIEW_SUBJECT]
        return Permissions(user, _uniq(pub), _uniq(sub))
    if user == AGGREGATOR:
        pub = [S.VIEW_SUBJECT, _kv(view, S.VIEW_KEY)] + _kv_buckets_declared()
        # step records: the aggregator's model correction (kairos/core/model/correction.py)
        sub += [S.STATE_WILDCARD, S.ROUTED_SUBJECT, S.STEPS_WILDCARD]
        return Permissions(user, _uniq(pub), _uniq(sub))
    if user == PROFILER:
        pub = [_kv(models, ">")] + _kv_buckets_declared() + _declare(kv_stream(models)) + _read(kv_stream(models))
        # kairos profile drives one node like a dispatcher + prefill node would: jobs, KV handoffs, cancels
        pub += [_any(S.jobs_subject), _any(S.kv_subject, PROFILER), S.CANCEL_SUBJECT]
        sub += [S.STEPS_WILDCARD, S.STATE_WILDCARD, S.OUT_WILDCARD]
        return Permissions(user, _uniq(pub), _uniq(sub))
    if user.startswith(AGENT_PREFIX):
        node = user[len(AGENT_PREFIX):]
        try:
            S.check_token(node, "node id")
        except S.SubjectError as exc:
            raise RoleError(str(exc)) from None
        # its own node's records only (the node id is in the key), KV-pulled notices under its own name
        pub = [S.state_subject(node), S.steps_subject(node), _any(S.out_subject, user), _any(S.kv_subject, user),
               _any(S.kvdone_subject, user), _kv(resv, S.reservation_key(node).rsplit(".", 1)[0] + ".*"),
               _kv(rec, _any(S.record_key, "prefill", node)), _kv(rec, _any(S.record_key, "decode", node))]
        # no JetStream API at all (no consumer, stream-create, stream-info or get): nothing an agent
        # could point at another role's subjects, no way to read a bucket
        sub += [S.jobs_subject(node), S.kv_wildcard(node), S.kvdone_wildcard(node), S.CANCEL_SUBJECT, S.RESEND_SUBJECT,
                S.drain_subject(node)]
        return Permissions(user, _uniq(pub), _uniq(sub), allow_responses=True)
    raise RoleError(f"unknown NATS role {user!r}: one of {', '.join(SERVICE_ROLES)} or {AGENT_PREFIX}<node>")


def _uniq(xs: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(xs))


def cluster_users(nodes: list[str] | tuple[str, ...]) -> list[str]:
    """Every user of a cluster with these node agents: the service roles, then ``agent-<node>``.

    Raises:
        RoleError: a node id given twice (nats-server refuses a duplicate user), or two ids whose
            users share a password variable (``decode-0`` and ``decode_0``:
            :func:`password_env_var`; one of them could not log in).
    """
    users = [*SERVICE_ROLES, *(agent_user(n) for n in nodes)]
    seen: dict[str, str] = {}
    for u in users:
        var = password_env_var(u)
        if var in seen:
            what = "is given twice" if seen[var] == u else f"and {seen[var]!r} share the password variable {var}"
            raise RoleError(f"node user {u!r} {what}: node ids must be distinct after '-'/'_' and case")
        seen[var] = u
    return users


def new_password() -> str:
    """A random password: a letter, then 32 bytes from :mod:`secrets` in URL-safe base64 (44 chars).

    The leading letter matters: the committed ``ops/nats/auth.conf`` reads passwords from the
    environment (``password: $NATS_PASSWORD_<USER>``) and nats-server parses a variable's value as
    a config token, so a value starting with a digit is taken for a number and the server refuses
    to start ("Expected a digit but got 'G'"), which one in five generated password sets did."""
    return secrets.choice(string.ascii_letters) + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Credential:
    """One role's login. ``password`` is the literal password, or with ``env_ref`` the name of an
    environment variable the nats-server resolves when it reads its config (``$NAME``)."""

    user: str
    password: str
    env_ref: bool = False


def password_env_var(user: str) -> str:
    """The environment variable holding ``user``'s password in deployments (compose ``.env``):
    ``NATS_PASSWORD_<USER>`` with ``-`` → ``_`` and upper case (no ``KAIROS_`` prefix: those are
    service config fields, and this one is read by the nats-server)."""
    return "NATS_PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()


def server_auth_config(creds: list[Credential]) -> str:
    """The ``authorization { ... }`` block of a nats-server config granting each credential its
    role's permissions (:func:`role_permissions`). Include it from the main config file.

    Raises:
        RoleError: a user that is not a known role.
    """
    lines = ["# Generated by kairos/contracts/permissions.py (one user per Kairos role; docs/security.md). Do not edit.",
             "authorization {", "  users = ["]
    for c in creds:
        p = role_permissions(c.user)
        pw = f"${c.password}" if c.env_ref else json.dumps(c.password)
        perms = {"publish": {"allow": list(p.publish)}, "subscribe": {"allow": list(p.subscribe)}}
        body = json.dumps(perms)
        resp = ", allow_responses: true" if p.allow_responses else ""
        lines.append(f"    {{user: {json.dumps(c.user)}, password: {pw}, permissions: {body[:-1]}{resp}}}}}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


@dataclass
class GeneratedAuth:
    """Credentials generated for one cluster (``kairos up``): ``passwords[user]``."""

    passwords: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_nodes(cls, nodes: list[str] | tuple[str, ...]) -> "GeneratedAuth":
        """Fresh random passwords for every role of a cluster with these node agents."""
        return cls({u: new_password() for u in cluster_users(nodes)})

    def server_config(self) -> str:
        """The nats-server ``authorization`` block for these credentials."""
        return server_auth_config([Credential(u, p) for u, p in self.passwords.items()])


#: the node agents of docker-compose.yml (both profiles use the same four node ids)
COMPOSE_NODES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def deployment_auth_config(nodes: list[str] | tuple[str, ...]) -> str:
    """The ``authorization`` block for a deployment whose passwords the nats-server reads from its
    environment (``NATS_PASSWORD_<USER>``, :func:`password_env_var`) — the committed
    ``ops/nats/auth.conf`` is this for :data:`COMPOSE_NODES`."""
    return server_auth_config([Credential(u, password_env_var(u), env_ref=True) for u in cluster_users(nodes)])


def write_secrets(auth: GeneratedAuth, directory: Path) -> dict[str, Path]:
    """Write ``<user>.password`` per user and ``nats-server.env`` (``NATS_PASSWORD_<USER>=…`` lines
    for a server using :func:`deployment_auth_config`) into ``directory``, replacing them. Returns
    ``{user: password file}``.

    The directory is created 0700: it is what keeps other users of the host out. The password
    files are 0644 because a compose file secret is a bind mount that keeps the host file's owner
    and mode, and the Kairos image runs as uid 10001, not as the user who wrote the file (with 0600
    every service failed at startup, ``KAIROS_NATS_PASSWORD_FILE=/run/secrets/…: Permission
    denied``; found by ``make compose-smoke``). ``nats-server.env`` holds every password and is
    read on the host only (compose's ``env_file``): 0600.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)

    def write(path: Path, text: str, mode: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(fd, mode)  # an existing file keeps its mode under O_CREAT
        with os.fdopen(fd, "w") as f:
            f.write(text)

    out = {}
    for user, pw in auth.passwords.items():
        out[user] = directory / f"{user}.password"
        write(out[user], pw + "\n", 0o644)
    write(directory / "nats-server.env", "".join(f"{password_env_var(u)}={pw}\n" for u, pw in auth.passwords.items()),
          0o600)
    return out
