"""NATS authentication and subject permissions against a real nats-server run with the config
``kairos/contracts/permissions.py`` generates (the one ``kairos up`` uses).

Each "cannot" is shown two ways: the server reports a permissions violation to the offending
client, and the message never reaches a legitimate subscriber, which does receive a control
message sent after it (so absence is not just slowness).
"""

from __future__ import annotations

import asyncio
import time

import nats
import nats.errors
import pytest
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.runtime.streams import ensure_buckets
from kairos.contracts.permissions import agent_user, inbox_prefix
from kairos.contracts.wire import InferenceRequest, encode
from tests.integration.conftest import running_nats, secure_server

NODES = ["prefill-0", "decode-0", "decode-1"]


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory):
    """A nats-server with JetStream and the generated per-role users; yields (url, passwords)."""
    with secure_server(tmp_path_factory.mktemp("secure-nats"), NODES) as server:
        yield server


class Client:
    """A NATS connection as one role that records the errors the server reports to it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def open(self, url: str, user: str, password: str) -> "Client":
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix(user),
                                     error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)
        return self

    async def violation(self, subject: str, kind: str, timeout: float = 5.0) -> str:
        """Wait until the server reported a ``kind`` (publish/subscription) violation for ``subject``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.errors:
                if "violation" in e.lower() and kind in e.lower() and f"\"{subject.lower()}\"" in e.lower():
                    return e
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind} violation for {subject}; errors: {self.errors}")


async def as_role(url: str, passwords: dict[str, str], user: str) -> Client:
    return await Client().open(url, user, passwords[user])


async def wait_for(cond, timeout: float = 5.0, what=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not met in time {what()}"
        await asyncio.sleep(0.01)


async def _close(*clients: Client) -> None:
    for c in clients:
        if c.nc is not None and not c.nc.is_closed:
            await c.nc.close()


async def test_client_without_or_with_wrong_credentials_is_refused(secure_nats):
    url, passwords = secure_nats
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, user="ingress", password="wrong", allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=2)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # a role's password is its own
        await nats.connect(url, user="dispatcher", password=passwords["ingress"], allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)
    ok = await as_role(url, passwords, "ingress")
    assert ok.nc.is_connected
    await _close(ok)


async def test_agent_cannot_publish_another_nodes_state(secure_nats):
    url, passwords = secure_nats
    agg = await as_role(url, passwords, "aggregator")
    agent = await as_role(url, passwords, agent_user("decode-0"))
    got: list[str] = []

    async def on_state(msg) -> None:
        got.append(msg.subject)

    await agg.nc.subscribe(S.STATE_WILDCARD, cb=on_state)
    await flush_barrier(agg.nc)
    await agent.nc.publish(S.state_subject("decode-1"), b"forged")  # someone else's heartbeat
    await agent.nc.publish(S.steps_subject("decode-1"), b"forged")
    await agent.nc.publish(S.state_subject("decode-0"), b"own")  # control
    await flush_barrier(agent.nc)
    await wait_for(lambda: S.state_subject("decode-0") in got,
                   what=lambda: f"got {got}; aggregator errors {agg.errors}; agent errors {agent.errors}")
    assert got == [S.state_subject("decode-0")]
    await agent.violation(S.state_subject("decode-1"), "publish")
    await agent.violation(S.steps_subject("decode-1"), "publish")
    await _close(agg, agent)


async def test_only_the_ingress_publishes_jobs_and_agents_receive_only_their_own(secure_nats):
    """Issue 34: a dispatcher hands its job to the request's ingress (a request into the ingress's
    inbox), the ingress sends it to the node; the node's answer and the ingress's relay of it go
    back as responses (allow_responses) — nobody else may publish a job, nor answer into the ingress's inbox."""
    url, passwords = secure_nats
    disp = await as_role(url, passwords, "dispatcher")
    ingress = await as_role(url, passwords, "ingress")
    a0 = await as_role(url, passwords, agent_user("decode-0"))
    a1 = await as_role(url, passwords, agent_user("decode-1"))
    jobs0: list[bytes] = []
    jobs1: list[bytes] = []
    stolen: list[bytes] = []

    async def collect(into):
        async def cb(msg) -> None:
            into.append(msg.data)
        return cb

    await a0.nc.subscribe(S.jobs_subject("decode-0"), cb=await collect(jobs0))
    await a0.nc.subscribe(S.jobs_subject("decode-1"), cb=await collect(stolen))  # not its jobs
    collector = await a1.nc.subscribe(S.jobs_subject("decode-1"), cb=await collect(jobs1))
    for c in (a0, a1):
        await flush_barrier(c.nc)
    await a0.violation(S.jobs_subject("decode-1"), "subscription")

    # forged jobs: a dispatcher and another node's agent may not publish jobs
    await disp.nc.publish(S.jobs_subject("decode-1"), b"from-dispatcher")
    await flush_barrier(disp.nc)
    await a0.nc.publish(S.jobs_subject("decode-1"), b"from-agent-0")
    await flush_barrier(a0.nc)
    await ingress.nc.publish(S.jobs_subject("decode-1"), b"from-ingress")
    await ingress.nc.publish(S.jobs_subject("decode-0"), b"from-ingress")
    await flush_barrier(ingress.nc)
    await wait_for(lambda: jobs1 and jobs0)
    assert jobs1 == [b"from-ingress"] and jobs0 == [b"from-ingress"]
    assert stolen == []
    await disp.violation(S.jobs_subject("decode-1"), "publish")
    await a0.violation(S.jobs_subject("decode-1"), "publish")
    await a0.nc.publish("_INBOX.ingress.conversation.cmpl-1", b"forged-answer")  # only dispatchers write there
    await flush_barrier(a0.nc)
    await a0.violation("_INBOX.ingress.conversation.cmpl-1", "publish")

    # the relay: dispatcher -> ingress (its conversation subject) -> agent, answers back as responses
    # (one subscription per subject, as the agent has: nats-server refuses the response when one
    # connection holds two)
    async def answer(msg) -> None:
        await msg.respond(b"accepted")

    async def relay(msg) -> None:
        node_answer = await ingress.nc.request(S.jobs_subject("decode-1"), msg.data, timeout=5)
        await msg.respond(node_answer.data)

    await collector.unsubscribe()
    await a1.nc.subscribe(S.jobs_subject("decode-1"), cb=answer)
    await ingress.nc.subscribe("_INBOX.ingress.conversation.*", cb=relay)
    for c in (a1, ingress):
        await flush_barrier(c.nc)
    try:
        reply = await disp.nc.request("_INBOX.ingress.conversation.cmpl-1", b"job", timeout=5)
    except nats.errors.TimeoutError:
        raise AssertionError(f"no reply; agent errors {a1.errors}, ingress errors {ingress.errors}, "
                             f"dispatcher errors {disp.errors}") from None
    assert reply.data == b"accepted"
    await _close(disp, ingress, a0, a1)


async def test_only_the_aggregator_writes_the_view(secure_nats):
    url, passwords = secure_nats
    agg = await as_role(url, passwords, "aggregator")
    disp = await as_role(url, passwords, "dispatcher")
    ingress = await as_role(url, passwords, "ingress")
    b_agg = await ensure_buckets(agg.nc.jetstream())
    await b_agg.view.put(S.VIEW_KEY, b"real-view")
    for c in (disp, ingress):
        b = await ensure_buckets(c.nc.jetstream(timeout=1.0))
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, asyncio.TimeoutError)):
            await b.view.put(S.VIEW_KEY, b"forged-view")
        await c.violation(f"$KV.{S.VIEW_BUCKET}.{S.VIEW_KEY}", "publish")
        e = await b.view.get(S.VIEW_KEY)  # reading is allowed
        assert e.value == b"real-view"
    await _close(agg, disp, ingress)


async def test_only_a_node_writes_its_own_reservations(secure_nats):
    """A decode node's agent is the only writer of its reservation keys: another node's agent can
    neither write nor delete them, and a dispatcher (which only reads them) cannot forge one."""
    url, passwords = secure_nats
    disp = await as_role(url, passwords, "dispatcher")
    a0 = await as_role(url, passwords, agent_user("decode-0"))
    a1 = await as_role(url, passwords, agent_user("decode-1"))
    bd = await ensure_buckets(disp.nc.jetstream(timeout=1.0))
    # agents write their reservations without opening the bucket (they may not declare it or read it)
    ba, bb = (KeyValue(S.RESERVATION_BUCKET, f"KV_{S.RESERVATION_BUCKET}", f"$KV.{S.RESERVATION_BUCKET}.",
                       c.nc.jetstream(timeout=1.0), direct=False) for c in (a0, a1))
    key1, key0 = S.reservation_key("decode-1", 0), S.reservation_key("decode-0", 0)
    await bb.put(key1, b"held-by-decode-1")  # its own: allowed
    rev0 = await ba.put(key0, b"held-by-decode-0")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, asyncio.TimeoutError)):
        await ba.delete(key1)
    await a0.violation(f"$KV.{S.RESERVATION_BUCKET}.{key1}", "publish")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, asyncio.TimeoutError)):
        await bd.reservations.put(key1, b"forged-by-a-dispatcher")
    await disp.violation(f"$KV.{S.RESERVATION_BUCKET}.{key1}", "publish")
    assert (await bd.reservations.get(key1)).value == b"held-by-decode-1"  # reading is allowed
    await ba.delete(key0, last=rev0)  # its own: allowed
    await _close(disp, a0, a1)


async def test_prompts_reach_only_the_dispatchers(secure_nats):
    """An agent can neither subscribe to the request subject nor to the inboxes of the ingress and
    the dispatchers; the dispatcher gets the request (and only a dispatcher may answer it)."""
    url, passwords = secure_nats
    disp = await as_role(url, passwords, "dispatcher")
    ingress = await as_role(url, passwords, "ingress")
    spy = await as_role(url, passwords, agent_user("prefill-0"))
    seen: list[str] = []

    async def cb(msg) -> None:
        seen.append(msg.subject)

    watched = (S.ROUTE_SUBJECT, "_INBOX.>", inbox_prefix("dispatcher") + ".>", inbox_prefix("ingress") + ".>",
               S.out_wildcard("cmpl-x"))
    for subject in watched:
        await spy.nc.subscribe(subject, cb=cb)
    await flush_barrier(spy.nc)
    for subject in watched:
        await spy.violation(subject, "subscription")
    got: asyncio.Queue = asyncio.Queue()

    async def take(msg) -> None:
        await msg.respond(S.TAKEN)
        got.put_nowait(msg.data)

    await disp.nc.subscribe(S.ROUTE_SUBJECT, queue=S.DISPATCHER_QUEUE, cb=take)
    await flush_barrier(disp.nc)
    req = InferenceRequest(request_id="cmpl-secret", model="m", prompt_tokens=3, max_tokens=1,
                           prompt_text="my secret prompt", created_unix_ms=0.0, deadline_unix_ms=1e15)
    answer = await ingress.nc.request(S.ROUTE_SUBJECT, encode(req), timeout=5)
    assert answer.data == S.TAKEN
    assert b"my secret prompt" in await asyncio.wait_for(got.get(), 5)
    await flush_barrier(spy.nc)
    assert seen == []
    # and the agent may not send requests itself, nor answer into the ingress's inbox
    await spy.nc.publish(S.ROUTE_SUBJECT, encode(req))
    await spy.violation(S.ROUTE_SUBJECT, "publish")
    await spy.nc.publish(inbox_prefix("ingress") + ".x.cmpl-secret", S.ALIVE)
    await spy.violation(inbox_prefix("ingress") + ".x.cmpl-secret", "publish")
    await _close(disp, ingress, spy)


async def test_committed_compose_auth_config_reads_passwords_from_the_environment(tmp_path):
    """ops/nats/auth.conf (included by ops/nats/cluster-<i>.conf in compose): the server resolves each
    ``$NATS_PASSWORD_<USER>`` from its environment."""
    import os
    import shutil
    from pathlib import Path

    from kairos.contracts.permissions import COMPOSE_NODES, cluster_users, new_password, password_env_var

    root = Path(__file__).resolve().parents[2]
    shutil.copy(root / "ops" / "nats" / "auth.conf", tmp_path / "auth.conf")
    (tmp_path / "main.conf").write_text("include ./auth.conf\n")
    pw = {u: new_password() for u in cluster_users(COMPOSE_NODES)}
    env = {**os.environ, **{password_env_var(u): p for u, p in pw.items()}}
    with running_nats(tmp_path / "js", "-c", str(tmp_path / "main.conf"), env=env) as port:
        url = f"nats://127.0.0.1:{port}"
        c = await as_role(url, pw, "agent-decode-1")
        assert c.nc.is_connected
        await _close(c)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, user="ingress", password=pw["dispatcher"], allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2)


def test_kairos_profile_without_credentials_says_the_login_was_refused(secure_nats, monkeypatch):
    from click.testing import CliRunner

    from kairos.cli.main import main

    url, _ = secure_nats
    for var in ("KAIROS_NATS_USER", "KAIROS_NATS_PASSWORD", "KAIROS_NATS_PASSWORD_FILE"):
        monkeypatch.delenv(var, raising=False)
    started = time.monotonic()  # retrying cannot fix credentials: it gives up at the refusal, not the timeout
    res = CliRunner().invoke(main, ["profile", "--nats-url", url, "--no-publish", "--connect-timeout", "300"])
    assert res.exit_code == 1 and "refused the login" in res.stderr and "KAIROS_NATS_USER" in res.stderr, res.output
    assert time.monotonic() - started < 150
