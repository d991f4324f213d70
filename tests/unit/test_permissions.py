"""The permission table (kairos/contracts/permissions.py): derived from kairos/contracts/subjects.py, complete, and
the committed compose config is what the generator produces."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

from kairos.contracts import permissions as P
from kairos.contracts import subjects as S

ROOT = Path(__file__).resolve().parents[2]


def _matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match (``*`` one token, ``>`` the rest)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def can_pub(user: str, subject: str) -> bool:
    return any(_matches(p, subject) for p in P.role_permissions(user).publish)


def can_sub(user: str, subject: str) -> bool:
    return any(_matches(p, subject) for p in P.role_permissions(user).subscribe)


def test_committed_compose_auth_config_is_generated():
    assert (ROOT / "ops" / "nats" / "auth.conf").read_text() == P.deployment_auth_config(P.COMPOSE_NODES), \
        "regenerate: kairos nats-auth > ops/nats/auth.conf"


def test_every_subject_and_bucket_of_subjects_py_is_in_the_table():
    """A subject added to kairos/contracts/subjects.py without a permission fails here (add it to
    role_permissions): every *_subject builder, *_SUBJECT / *_WILDCARD constant and bucket is
    published or subscribed by some role."""
    users = P.cluster_users(["n1"])
    everything = [p for u in users for perms in (P.role_permissions(u),) for p in perms.publish + perms.subscribe]
    for name, fn in inspect.getmembers(S, inspect.isfunction):
        if name.endswith("_subject"):
            args = [1 if p == "lane" else "n1" for p in inspect.signature(fn).parameters]
            subj = fn(*args)
            assert any(_matches(p, subj) for p in everything), f"{name}() -> {subj} is in no role's permissions"
    for name, value in vars(S).items():
        if name.endswith(("_SUBJECT", "_WILDCARD")):
            assert any(_matches(p, value.replace("*", "x")) for p in everything), name
        if name.endswith("_BUCKET"):
            assert any(p.startswith(f"$KV.{value}.") for p in everything), f"nobody writes bucket {value}"


@pytest.mark.parametrize("user,subject,allowed", [
    ("agent-decode-0", S.state_subject("decode-0"), True),
    ("agent-decode-0", S.state_subject("decode-1"), False),
    ("agent-decode-0", S.steps_subject("decode-1"), False),
    ("agent-decode-0", S.jobs_subject("decode-1"), False),
    ("agent-decode-0", "$KV.kairos_resv." + S.reservation_key("decode-1", 0), False),
    ("agent-decode-0", "$KV.kairos_resv." + S.reservation_key("decode-0", 3), True),
    ("agent-decode-0", "$KV.kairos_view.view", False),
    ("agent-decode-0", S.ROUTE_SUBJECT, False),
    ("agent-decode-0", "_INBOX.ingress.abc.cmpl-1", False),  # only dispatchers answer into the ingress's inbox
    ("agent-decode-0", S.out_subject("cmpl-1", "agent-decode-0"), True),
    ("agent-decode-0", S.out_subject("cmpl-1", "agent-decode-1"), False),  # only under its own user
    ("agent-decode-0", S.out_subject("cmpl-1", "dispatcher"), False),
    ("dispatcher", S.out_subject("cmpl-1", "dispatcher"), True),
    ("dispatcher", S.out_subject("cmpl-1", "agent-decode-0"), False),
    ("ingress", S.jobs_subject("decode-0"), True),  # it sends every job (issue 34)
    ("ingress", S.ROUTE_SUBJECT, True),
    ("ingress", "kairos.req.new", False),  # the request lanes are gone (issue 34)
    ("dispatcher", S.ROUTE_SUBJECT, False),
    ("dispatcher", "_INBOX.ingress.abc.cmpl-1", True),  # taken, alive notices, its jobs
    ("dispatcher", "_INBOX.aggregator.abc", False),
    ("ingress", "$KV.kairos_view.view", False),
    ("ingress", "$KV.kairos_requests." + S.record_key("cmpl-1", "decision"), False),
    ("ingress", "$KV.kairos_requests." + S.record_key("cmpl-1", "ingress"), True),
    # the execution claims of old (before issue 34): nobody writes them now
    ("ingress", "$KV.kairos_claims_0.claim.0123456789abcdef0123456789abcdef", False),
    ("agent-decode-0", "$KV.kairos_claims_1.claim.0123456789abcdef0123456789abcdef", False),
    ("agent-decode-0", "$KV.kairos_claims_1.cmpl-1.decision", False),
    ("agent-decode-0", "$KV.kairos_requests." + S.record_key("cmpl-1", "decode", "decode-0"), True),
    ("agent-decode-0", "$KV.kairos_requests." + S.record_key("cmpl-1", "decode", "decode-1"), False),
    ("agent-decode-0", "$KV.kairos_requests." + S.record_key("cmpl-1", "prefill", "prefill-0"), False),
    ("agent-decode-0", "$KV.kairos_requests.cmpl-1.prefill", False),  # the layout before node-keyed records
    ("agent-decode-0", "$KV.kairos_requests." + S.record_key("cmpl-1", "decision"), False),
    ("agent-decode-0", S.kvdone_subject("prefill-0", "agent-decode-0"), True),
    ("agent-decode-0", S.kvdone_subject("prefill-0", "agent-decode-1"), False),  # only under its own user
    ("dispatcher", "$KV.kairos_claims_0.claim.0123456789abcdef0123456789abcdef", False),
    ("dispatcher", S.jobs_subject("decode-0"), False),  # it hands jobs to the ingress
    ("dispatcher", "$KV.kairos_view.view", False),
    ("dispatcher", "$KV.kairos_resv." + S.reservation_key("decode-0", 0), False),  # the node's own to write
    ("dispatcher", S.CANCEL_SUBJECT, False),
    ("aggregator", "$KV.kairos_view.view", True),
    ("aggregator", S.jobs_subject("decode-0"), False),
    ("profiler", "$KV.kairos_models.latency.x", True),
    ("dispatcher", "$KV.kairos_models.current", False),
    ("dispatcher", "$JS.API.STREAM.DELETE.KAIROS_REQ", False),
    ("ingress", "$JS.API.STREAM.PURGE.KV_kairos_requests", False),
])
def test_publish_rules(user, subject, allowed):
    assert can_pub(user, subject) is allowed


@pytest.mark.parametrize("user,subject,allowed", [
    ("agent-decode-0", S.jobs_subject("decode-0"), True),
    ("agent-decode-0", S.jobs_subject("decode-1"), False),
    ("agent-decode-0", S.out_subject("cmpl-1", "agent-decode-0"), False),
    ("agent-decode-0", S.ROUTE_SUBJECT, False),
    ("dispatcher", S.ROUTE_SUBJECT, True),
    ("ingress", S.ROUTE_SUBJECT, False),
    ("agent-decode-0", "_INBOX.dispatcher.abc.def", False),
    ("agent-decode-0", "_INBOX.agent-decode-0.abc.def", True),
    ("ingress", S.out_subject("cmpl-1", "agent-decode-0"), True),
    ("ingress", S.out_subject("cmpl-1", "dispatcher"), True),
    ("dispatcher", S.out_subject("cmpl-1", "dispatcher"), False),
    ("aggregator", S.state_subject("decode-3"), True),
    ("profiler", S.steps_subject("decode-3"), True),
    ("aggregator", S.steps_subject("decode-3"), True),
    ("profiler", S.state_subject("decode-3"), True),
    ("profiler", S.out_subject("prof-ab-1", "agent-prefill-0"), True),
    ("agent-prefill-0", S.kvdone_subject("prefill-0", "agent-decode-0"), True),
    ("agent-prefill-0", S.kvdone_subject("prefill-1", "agent-decode-0"), False),
])
def test_subscribe_rules(user, subject, allowed):
    assert can_sub(user, subject) is allowed


def test_unknown_roles_and_bad_node_ids_are_refused():
    with pytest.raises(P.RoleError) as e:
        P.role_permissions("admin")
    assert str(e.value) == "unknown NATS role 'admin': one of ingress, dispatcher, aggregator, profiler or agent-<node>"
    # a user that is no subject token is refused naming it; "agent-" is one, but names no node
    with pytest.raises(P.RoleError, match=r"^user 'agent-a\.b' must match \[A-Za-z0-9_-\]\{1,128\}"):
        P.role_permissions("agent-a.b")
    with pytest.raises(P.RoleError, match=r"^node id '' must match \[A-Za-z0-9_-\]\{1,128\}"):
        P.role_permissions("agent-")
    with pytest.raises(S.SubjectError, match=r"^node id 'a\.b' must match"):
        P.agent_user("a.b")
    with pytest.raises(S.SubjectError, match=r"^user 'a b' must match"):
        P.inbox_prefix("a b")
    assert P.agent_user("decode-0") == "agent-decode-0" and P.inbox_prefix("agent-decode-0") == "_INBOX.agent-decode-0"


@pytest.mark.parametrize("user", ["ingress", "dispatcher", "aggregator", "profiler", "agent-decode-0"])
def test_each_roles_permissions_name_their_user(user):
    assert P.role_permissions(user).user == user


def test_generated_passwords_start_with_a_letter_so_nats_server_reads_them_from_the_environment():
    # auth.conf's `password: $NATS_PASSWORD_X` is parsed as a config token: a leading digit makes
    # nats-server take it for a number and refuse to start (tests/integration/test_bus_security.py
    # starts a real server with such a config)
    for _ in range(2000):
        pw = P.new_password()
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{43}", pw), pw


def test_generated_config_quotes_literal_passwords_and_references_env_ones():
    lit = P.server_auth_config([P.Credential("ingress", 'p"w$x')])
    assert 'password: "p\\"w$x"' in lit
    ref = P.deployment_auth_config(["n1"])
    assert re.search(r"password: \$NATS_PASSWORD_AGENT_N1,", ref)
    assert P.password_env_var("agent-decode-0") == "NATS_PASSWORD_AGENT_DECODE_0"


def test_compose_gives_every_service_its_own_roles_secret():
    """Each Kairos service in docker-compose.yml logs in as its role (agents as agent-<their node>)
    with the password file of that role, declared as a compose secret under ops/secrets/."""
    yaml = pytest.importorskip("yaml")
    from tests.unit.test_deploy_files import env_of, kairos_services

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    declared = compose["secrets"]
    roles = {"kairos.services.ingress": "ingress", "kairos.services.dispatcher": "dispatcher",
             "kairos.services.state_aggregator": "aggregator"}
    for name, (svc, mod) in kairos_services(compose["services"]).items():
        env = env_of(svc)
        want = P.agent_user(env["KAIROS_NODE_ID"]) if mod == "kairos.services.node_agent" else roles[mod]
        assert env["KAIROS_NATS_USER"] == want, name
        assert svc["secrets"] == [f"nats-{want}"], name
        assert env["KAIROS_NATS_PASSWORD_FILE"] == f"/run/secrets/nats-{want}", name
        assert declared[f"nats-{want}"]["file"] == f"ops/secrets/{want}.password"
        assert "KAIROS_NATS_PASSWORD" not in env, f"{name}: a password in the compose file"
    for name in ("nats-0", "nats-1", "nats-2"):  # every member of the NATS cluster has the users' passwords
        assert compose["services"][name]["env_file"] == ["ops/secrets/nats-server.env"], name


def test_write_secrets_files_are_private_and_match_the_server_env(tmp_path):
    """The directory keeps other host users out (0700); each password file is readable by the
    container user it is bind-mounted into (compose file secrets keep the host mode; the image runs
    as uid 10001); the env file with every password stays the writer's own (0600) — also when the
    files existed before with other modes."""
    auth = P.GeneratedAuth.for_nodes(["decode-0"])
    d = tmp_path / "deploy" / "s"  # parents are created too
    for run in range(2):  # a second run (a new cluster) replaces the files of the first, and their modes
        if run:
            os.chmod(d, 0o755)
            os.chmod(d / "nats-server.env", 0o666)
            os.chmod(d / "ingress.password", 0o600)
        auth = P.GeneratedAuth.for_nodes(["decode-0"])
        files = P.write_secrets(auth, d)
        assert d.stat().st_mode & 0o777 == 0o700
        assert (d / "nats-server.env").stat().st_mode & 0o777 == 0o600
        assert sorted(files) == ["agent-decode-0", "aggregator", "dispatcher", "ingress", "profiler"]
        for user, path in files.items():
            assert path == d / f"{user}.password"
            assert path.stat().st_mode & 0o777 == 0o644
            assert path.read_text() == auth.passwords[user] + "\n"
        env = dict(ln.split("=", 1) for ln in (d / "nats-server.env").read_text().splitlines())
        assert env == {P.password_env_var(u): pw for u, pw in auth.passwords.items()}
        assert len(set(auth.passwords.values())) == len(auth.passwords)  # one password per role


def test_generated_auth_config_logs_each_user_in_with_its_literal_password():
    cfg = P.GeneratedAuth({"ingress": "pw-one", "agent-n1": "pw-two"}).server_config()
    lines = cfg.splitlines()
    assert lines[:3] == ["# Generated by kairos/contracts/permissions.py (one user per Kairos role; docs/security.md). Do not edit.",
                         "authorization {", "  users = ["]
    assert lines[3].startswith('    {user: "ingress", password: "pw-one", permissions: {"publish": {"allow": ["kairos.req.route", ')
    assert lines[3].endswith('"subscribe": {"allow": ["_INBOX.ingress.>", "kairos.out.*.*", '
                             '"kairos.state.*", "kairos.view"]}, allow_responses: true}}')
    assert lines[4].startswith('    {user: "agent-n1", password: "pw-two", permissions: {"publish": {"allow": ["kairos.state.n1", ')
    assert lines[4].endswith('"kairos.cancel", "kairos.resend", "kairos.drain.n1"]}, allow_responses: true}}')
    assert lines[5:] == ["  ]", "}"] and cfg.endswith("}\n")


@pytest.mark.parametrize("nodes,message", [
    (["decode-0", "decode-0"], "node user 'agent-decode-0' is given twice"),
    (["decode-0", "decode-1", "decode_0"],
     "node user 'agent-decode_0' and 'agent-decode-0' share the password variable NATS_PASSWORD_AGENT_DECODE_0"),
    (["a", "A"], "node user 'agent-A' and 'agent-a' share the password variable NATS_PASSWORD_AGENT_A"),
])
def test_node_ids_that_would_share_a_nats_user_or_password_variable_are_refused(nodes, message):
    """A repeated id makes nats-server refuse the config (duplicate user); two ids with one
    NATS_PASSWORD_<USER> variable leave one agent unable to log in."""
    with pytest.raises(P.RoleError) as e:
        P.cluster_users(nodes)
    assert str(e.value) == message + ": node ids must be distinct after '-'/'_' and case"
    assert len(P.cluster_users(["decode-0", "decode-1"])) == len(set(P.cluster_users(["decode-0", "decode-1"])))


def _too_broad(pattern: str) -> bool:
    """Does ``pattern`` cover all of ``$JS.>`` or ``$JS.API.>`` (or a whole API family)? Probed
    with subjects no role needs: a pattern that matches one of them grants what nobody listed."""
    probes = ("$JS.NOTHING.x", "$JS.API.NOTHING", "$JS.API.NOTHING.x.y", "$JS.API.STREAM.DELETE.KAIROS_REQ",
              "$JS.API.ACCOUNT.PURGE.x", "$JS.API.META.LEADER.STEPDOWN", "$JS.API.SERVER.REMOVE")
    return any(_matches(pattern, probe) for probe in probes)


def test_no_role_is_granted_all_of_the_jetstream_api():
    """Lint: no Kairos role (every role is non-admin: none may delete or purge a stream) has a
    grant covering ``$JS.>`` or ``$JS.API.>`` — each JetStream API subject is granted by name."""
    assert _too_broad("$JS.>") and _too_broad("$JS.API.>") and _too_broad(">") and _too_broad("$JS.API.*.>")
    assert not _too_broad("$JS.API.STREAM.INFO.KV_kairos_view")
    for user in P.cluster_users(P.COMPOSE_NODES):
        perms = P.role_permissions(user)
        for pattern in perms.publish + perms.subscribe:
            assert not _too_broad(pattern), f"{user} is granted {pattern}"


@pytest.mark.parametrize("subject", [
    "$JS.API.CONSUMER.CREATE.KV_kairos_requests",  # a watcher: every request id in the cluster
    "$JS.API.CONSUMER.CREATE.KV_kairos_requests.evil.$KV.kairos_requests.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.KV_kairos_requests.evil",
    "$JS.API.STREAM.CREATE.KV_kairos_view",  # a stream config names the subjects it captures
    "$JS.API.STREAM.MSG.GET.KV_kairos_requests",  # next_by_subj walks every record
    "$JS.API.DIRECT.GET.KV_kairos_requests",
    "$JS.API.DIRECT.GET.KV_kairos_requests.$KV.kairos_requests.cmpl-1.decision",
    "$JS.API.DIRECT.GET.KV_kairos_resv.$KV.kairos_resv.decode.decode-1.0",
    "$JS.API.STREAM.INFO.KV_kairos_requests",
    "$JS.API.CONSUMER.CREATE.KV_kairos_claims_0",  # a watcher of a claim bucket
    "$JS.API.STREAM.MSG.GET.KV_kairos_claims_0",
    "$JS.API.CONSUMER.MSG.NEXT.KAIROS_REQ_1.dispatchers",
])
def test_an_agent_has_no_jetstream_api_that_reads_lists_or_delivers(subject):
    """An agent calls no JetStream API at all (issue 34: no execution claims): no consumer (push or
    pull: nats-server delivers wherever the creator says), no stream creation or lookup, no get."""
    assert not can_pub("agent-decode-0", subject)
    assert not can_pub("agent-decode-0", "$JS.API.DIRECT.GET.KV_kairos_claims_2.$KV.kairos_claims_2.claim.0123")


@pytest.mark.parametrize("part,node", [("prefill", None), ("decode", None), ("decision", "n1"), ("bogus", None)])
def test_node_record_parts_need_the_node_and_the_others_refuse_one(part, node):
    with pytest.raises(S.SubjectError):
        S.record_key("cmpl-1", part, node)


def test_write_secrets_creates_each_path_private_before_it_sets_the_mode_again(tmp_path, monkeypatch):
    """The directory is created 0700 and each file with its final mode in the same call that makes
    it, so there is no moment in which another user of the host can enter the directory or open a
    file (the chmod/fchmod after them only repair paths that existed before). Shown with those
    repairs switched off, under a permissive umask."""
    monkeypatch.setattr(P.os, "chmod", lambda *a, **k: None)
    monkeypatch.setattr(P.os, "fchmod", lambda *a, **k: None)
    old = os.umask(0)
    try:
        P.write_secrets(P.GeneratedAuth.for_nodes(["decode-0"]), tmp_path / "s")
    finally:
        os.umask(old)
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "s" / "ingress.password").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "s" / "nats-server.env").stat().st_mode & 0o777 == 0o600
