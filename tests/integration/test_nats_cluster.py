"""Three real nats-servers clustered with kairos/cli/natscluster.py's configs (routes with their own
credential, the per-role client permissions on every member): the services' declarations get
3 replicas, a client given every URL survives the death of the server it is connected to, and a
route cannot be opened with a client's credential."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest

from kairos.cli import natscluster as NC
from kairos.cli.up import free_port, nats_server_binary, stop_process, wait_listening
from kairos.contracts import permissions as P
from kairos.contracts import subjects as S
from kairos.runtime.bus import BusAuth, connect, server_urls, stream_replicas
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.streams import ensure_buckets
from kairos.runtime.envconfig import ServiceConfig
from tests.integration.conftest import wait_until


class Members:
    """The three members as child processes (started, killed, restarted by name)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.auth = P.GeneratedAuth.for_nodes(["decode-0"])
        self.members = NC.plan_members(3, [(free_port(), free_port(), free_port()) for _ in range(3)], tmp)
        self.route_pw = P.new_password()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, m: NC.Member) -> None:
        Path(m.store).parent.mkdir(parents=True, exist_ok=True)
        conf = self.tmp / f"{m.name}.conf"
        conf.write_text(NC.member_config(m, self.members, self.route_pw, self.auth.server_config()))
        p = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=open(self.tmp / f"{m.name}.log", "ab"),
                             stderr=subprocess.STDOUT)
        self.procs[m.name] = p
        assert wait_listening(p, m.port), (self.tmp / f"{m.name}.log").read_text()

    def stop(self) -> None:
        for p in self.procs.values():
            stop_process(p)

    @property
    def urls(self) -> str:
        return ",".join(m.url for m in self.members)

    def jsz(self, m: NC.Member) -> dict:
        with urllib.request.urlopen(m.monitor_url + "/jsz?streams=true&config=true", timeout=2) as r:
            return json.loads(r.read())


@pytest.fixture
def members(tmp_path):
    ms = Members(tmp_path)
    try:
        for m in ms.members:
            ms.start(m)
        yield ms
    finally:
        ms.stop()


def test_replicas_follow_the_url_list():
    assert server_urls(" nats://a:1, nats://b:2 ,,") == ["nats://a:1", "nats://b:2"]
    assert stream_replicas(ServiceConfig(nats_url="nats://a:1,nats://b:2,nats://c:3")) == 3
    assert stream_replicas(ServiceConfig(nats_url="nats://a:1")) == 1
    assert stream_replicas(ServiceConfig(nats_url="nats://a:1", nats_replicas=3)) == 3


def test_member_config_refuses_bad_input(tmp_path):
    ms = NC.plan_members(2, [(1, 2, 3), (4, 5, 6)], tmp_path)
    with pytest.raises(ValueError, match="URL-safe"):
        NC.member_config(ms[0], ms, "p@ss", None)
    with pytest.raises(ValueError, match="distinct"):
        NC.member_config(ms[0], [ms[0], NC.Member("nats-1", "127.0.0.1", 1, 7, 8, "s", "p")], "pw", None)


async def test_cluster_replicates_and_clients_fail_over(members):
    """The buckets have one replica per member. Kill the member the ingress is connected to: it
    reconnects to a live one and its requests reach a dispatcher of the queue group on another
    member (core NATS: nothing to elect, nothing stored on the way)."""
    ms = members
    cfg = ServiceConfig(nats_url=ms.urls)
    ingress = await connect(cfg.nats_url, "t-ingress", auth=BusAuth(P.INGRESS, ms.auth.passwords[P.INGRESS]))
    disp = await connect(cfg.nats_url, "t-disp", auth=BusAuth(P.DISPATCHER, ms.auth.passwords[P.DISPATCHER]))
    try:
        js = disp.jetstream(timeout=5)
        await wait_until_ok(lambda: ensure_buckets(js, replicas=stream_replicas(cfg)), "JetStream ready")
        for name in ("KV_" + S.VIEW_BUCKET, "KV_" + S.RESERVATION_BUCKET, "KV_" + S.REQUESTS_BUCKET):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, (name, info.config)

        async def take(msg) -> None:
            await msg.respond(S.TAKEN)

        await disp.subscribe(S.ROUTE_SUBJECT, queue=S.DISPATCHER_QUEUE, cb=take)
        await disp.flush()
        here = ingress.connected_url.port
        victim = next(m for m in ms.members if m.port == here)
        ms.procs[victim.name].kill()
        ms.procs[victim.name].wait()
        answer = await wait_until_ok(lambda: ingress.request(S.ROUTE_SUBJECT, b"{}", timeout=2),
                                     "a request taken after the failover", timeout=20)
        assert answer.data == S.TAKEN and ingress.connected_url.port != here
    finally:
        await ingress.close()
        await disp.close()


async def test_routes_refuse_a_client_credential(members, tmp_path):
    """A server that routes with the ingress's login is refused by the cluster (own authorization)."""
    ms = members
    bad = NC.Member("nats-9", "127.0.0.1", free_port(), free_port(), free_port(), str(tmp_path / "x"), str(tmp_path / "p"))
    conf = NC.member_config(bad, ms.members + [bad], "x", None).replace(
        f"{NC.ROUTE_USER}:x@", f"{P.INGRESS}:{ms.auth.passwords[P.INGRESS]}@")
    (tmp_path / "bad.conf").write_text(conf)
    p = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "bad.conf")], stdout=open(tmp_path / "bad.log", "ab"),
                         stderr=subprocess.STDOUT)
    try:
        assert wait_listening(p, bad.port)
        await wait_until(lambda: "Authorization Violation" in (tmp_path / "bad.log").read_text()
                         or any("authorization" in ln.lower() and "violation" in ln.lower()
                                for m in ms.members for ln in (ms.tmp / f"{m.name}.log").read_text().splitlines()),
                         20, "the route refused")
        with urllib.request.urlopen(ms.members[0].monitor_url + "/routez", timeout=2) as r:
            names = {rt.get("remote_name") for rt in json.loads(r.read())["routes"]}
        assert "nats-9" not in names, names
    finally:
        stop_process(p)


async def wait_until_ok(make, what: str, timeout: float = 15.0):
    """Await ``make()`` until it succeeds (JetStream electing leaders, a client reconnecting)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await make()
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what}: still failing after {timeout}s: {exc!r}") from None
            await asyncio.sleep(0.1)


async def test_an_outage_ends_at_the_reconnect_not_when_jetstream_answers_again(members):
    """The member a service is connected to dies: nats-py reconnects to another in milliseconds,
    but JetStream may take seconds to elect leaders, so the service's re-declare keeps failing.
    That is no outage (messages flow): ``disconnected_since`` is cleared at the reconnect (the
    ingress ends every in-flight request with ``bus_unavailable`` when it stays set) and
    ``resuming`` says the re-declare is still to do."""
    ms = members
    nc = await connect(ms.urls, "t-watch", auth=BusAuth(P.INGRESS, ms.auth.passwords[P.INGRESS]))
    jetstream_back = asyncio.Event()
    tries = 0

    async def redeclare() -> None:  # JetStream not answering yet, until the test says so
        nonlocal tries
        tries += 1
        if not jetstream_back.is_set():
            raise nats.errors.TimeoutError

    watch = BusWatch(nc, redeclare, poll_s=0.02, retry_s=0.02).start()
    try:
        here = nc.connected_url.port
        victim = next(m for m in ms.members if m.port == here)
        ms.procs[victim.name].kill()
        ms.procs[victim.name].wait()
        await wait_until(lambda: tries >= 2 and nc.is_connected and nc.connected_url.port != here, 20,
                         "reconnected to another member, its re-declare failing")
        assert watch.disconnected_since is None and watch.resuming and watch.settling(0.0)
        assert watch.outage_s is None or watch.outage_s < 5.0  # None: back within one poll
        jetstream_back.set()
        await wait_until(lambda: not watch.resuming, 5, "the re-declare done")
        assert watch.reconnects == 1
    finally:
        await watch.stop()
        await nc.close()
