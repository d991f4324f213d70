"""The permission spec (tests/unit/test_permission_spec.py, typed from docs/security.md) against a
real nats-server running the committed ``ops/nats/auth.conf``: every role publishes to, and
subscribes to, a concrete subject of every subject builder, constant, bucket key and JetStream API
call of ``kairos/contracts/subjects.py``; the server must refuse exactly what the spec denies and let through
exactly what it allows.

Seen two ways, as in test_bus_security.py: a refused PUB or SUB is reported to the client as a
permissions violation naming the subject; an allowed PUB reaches an unrestricted test user's ``>``
subscription, and an allowed SUB receives what that user publishes. Both are read after a marker
sent last on the same connection has arrived (so absence is not slowness).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from pathlib import Path

import nats
import pytest

from kairos.runtime.bus import flush_barrier
from kairos.contracts.permissions import COMPOSE_NODES, inbox_prefix, new_password, password_env_var
from tests.integration.conftest import ADMIN_USER, running_nats
from tests.unit.test_permission_spec import NODES, SPEC, USERS, all_subjects, spec_allows

ROOT = Path(__file__).resolve().parents[2]
_VIOLATION = re.compile(r'violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


@pytest.fixture(scope="module")
def compose_nats(tmp_path_factory):
    """A nats-server with the committed ops/nats/auth.conf (passwords from its environment, as in
    compose) plus an unrestricted test user; yields (url, passwords)."""
    assert tuple(NODES) == COMPOSE_NODES  # the spec's nodes are the committed config's
    d = tmp_path_factory.mktemp("spec-nats")
    pw = {u: new_password() for u in USERS}
    pw[ADMIN_USER] = new_password()
    conf = (ROOT / "ops" / "nats" / "auth.conf").read_text()
    conf = conf.replace("\n  ]\n}", f'\n    {{user: "{ADMIN_USER}", password: "{pw[ADMIN_USER]}"}}\n  ]\n}}', 1)
    assert ADMIN_USER in conf
    (d / "auth.conf").write_text(conf)
    env = {**os.environ, **{password_env_var(u): pw[u] for u in USERS}}
    with running_nats(d / "js", "-c", str(d / "auth.conf"), env=env) as port:
        yield f"nats://127.0.0.1:{port}", pw
    shutil.rmtree(d, ignore_errors=True)


class Role:
    """A connection as ``user`` recording the permission violations the server reports."""

    def __init__(self) -> None:
        self.violations: dict[str, set[str]] = {"publish": set(), "subscription": set()}
        self.nc = None

    async def open(self, url: str, user: str, password: str) -> "Role":
        async def on_error(exc: Exception) -> None:
            m = _VIOLATION.search(str(exc))
            if m:
                self.violations[m.group(1).lower()].add(m.group(2))

        self.nc = await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix(user),
                                     error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)
        return self

    async def refused(self, kind: str, want: set[str], timeout: float = 10.0) -> set[str]:
        """The subjects refused for ``kind``, once every one of ``want`` was reported (or timeout).
        Lower case: nats-py 2.16 lower-cases the server's error line (no two subjects tried here
        differ only in case)."""
        want = {s.lower() for s in want}
        deadline = time.monotonic() + timeout
        while not want <= self.violations[kind] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return set(self.violations[kind])


async def _until(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _literal(subject: str) -> bool:
    return not ({"*", ">"} & set(subject.split(".")))


def _instance(subject: str) -> str:
    """A literal subject a subscription to ``subject`` receives."""
    return ".".join({"*": "x", ">": "x.y"}.get(t, t) for t in subject.split("."))


@pytest.mark.parametrize("user", USERS)
async def test_the_server_refuses_every_publish_outside_the_spec(compose_nats, user):
    url, pw = compose_nats
    admin = await nats.connect(url, user=ADMIN_USER, password=pw[ADMIN_USER])
    role = await Role().open(url, user, pw[user])
    seen: list[str] = []

    async def on_any(msg) -> None:
        seen.append(msg.subject)

    await admin.subscribe(">", cb=on_any)
    await flush_barrier(admin)
    subjects = [s for s in all_subjects() if _literal(s)]
    for s in subjects:
        await role.nc.publish(s, b"spec")
    await flush_barrier(role.nc)
    marker = f"spec.marker.{user}"
    await admin.publish(marker, b"")
    await _until(lambda: marker in seen, what="the marker")

    allowed = {s for s in subjects if spec_allows(user, "publish", s)}
    denied = set(subjects) - allowed
    assert allowed and denied
    assert set(seen) & set(subjects) == allowed  # every allowed publish arrived, no denied one
    assert await role.refused("publish", denied) == {s.lower() for s in denied}

    # replies: only agents answer requests they received (allow_responses), to that reply only
    got: list[str] = []
    request = f"_INBOX.{user}.req"
    reply = f"spec.reply.{user}"

    async def answer(msg) -> None:
        await msg.respond(b"answer")

    async def on_reply(msg) -> None:
        got.append(msg.subject)

    await role.nc.subscribe(request, cb=answer)
    await flush_barrier(role.nc)
    await admin.subscribe(reply, cb=on_reply)
    await admin.publish(request, b"q", reply=reply)
    await flush_barrier(admin)
    if SPEC[user]["allow_responses"]:
        await _until(lambda: got, what="the agent's answer")
        assert got == [reply]
    else:
        assert reply in await role.refused("publish", {reply})  # (all lower case)
        await flush_barrier(role.nc)
        await flush_barrier(admin)
        assert got == []
    await role.nc.close()
    await admin.close()


@pytest.mark.parametrize("user", USERS)
async def test_the_server_refuses_every_subscription_outside_the_spec(compose_nats, user):
    url, pw = compose_nats
    admin = await nats.connect(url, user=ADMIN_USER, password=pw[ADMIN_USER])
    role = await Role().open(url, user, pw[user])
    subjects = all_subjects()
    subs = {s: await role.nc.subscribe(s) for s in subjects}
    marked: list[str] = []

    async def on_marker(msg) -> None:
        marked.append(msg.subject)

    marker = f"_INBOX.{user}.marker"
    await role.nc.subscribe(marker, cb=on_marker)
    await flush_barrier(role.nc)
    for s in subjects:
        await admin.publish(_instance(s), b"spec")
    await admin.publish(marker, b"")
    await flush_barrier(admin)
    await _until(lambda: marked, what="the marker")  # every message before it is in its queue

    allowed = {s for s in subjects if spec_allows(user, "subscribe", s)}
    denied = set(subjects) - allowed
    assert allowed and denied
    assert {s for s, sub in subs.items() if sub.pending_msgs > 0} == allowed
    assert await role.refused("subscription", denied) == {s.lower() for s in denied}
    await role.nc.close()
    await admin.close()
