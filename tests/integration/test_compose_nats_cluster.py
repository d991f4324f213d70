"""The committed compose NATS cluster run by three real nats-servers: ``ops/nats/cluster-<i>.conf``
with ``ops/nats/auth.conf`` beside it and the routes file ``kairos nats-cluster --secrets-dir``
writes, laid out as in each member's container (``/etc/nats``), the passwords in the server's
environment as compose's ``env_file`` puts them (``kairos nats-auth --secrets-dir``).

The files are used as committed except that their fixed loopback ports (4222…, taken on a shared
machine) and the container's ``/data`` are rewritten to free ports and a temporary directory,
the same rewrite applied to the compose services' URLs. Then the cluster must form (every
member routes to the other two, ``/routez``), elect a JetStream meta leader (``/jsz``), answer
the compose healthcheck, and take the services' stream and buckets with 3 replicas."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kairos.cli import natscluster as NC
from kairos.cli.up import free_port, nats_server_binary, stop_process, wait_listening
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.contracts import permissions as P
from kairos.contracts import subjects as S
from kairos.runtime.bus import connect_service, stream_replicas
from kairos.runtime.streams import ensure_buckets
from kairos.runtime.envconfig import from_env
from tests.integration.conftest import wait_until
from tests.integration.test_nats_cluster import wait_until_ok

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]


def relocate(text: str, ports: dict[int, int], data: Path | None = None) -> str:
    """``text`` with every ``127.0.0.1:<committed port>`` moved to ``ports`` and the container's
    ``/data`` to ``data``. Raises AssertionError on a loopback port the mapping does not know."""
    def sub(m: re.Match) -> str:
        assert int(m.group(1)) in ports, f"unexpected port {m.group(1)}"
        return f"127.0.0.1:{ports[int(m.group(1))]}"
    out = re.sub(r"127\.0\.0\.1:(\d+)", sub, text)
    return out.replace('"/data/', f'"{data}/') if data else out


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


@pytest.fixture
def cluster(tmp_path):
    """The three members started from the committed files; yields (members on their new ports,
    port mapping, passwords, compose file)."""
    members = NC.compose_members()
    ports = {p: free_port() for m in members for p in (m.port, m.cluster_port, m.monitor_port)}
    auth = P.GeneratedAuth.for_nodes(list(P.COMPOSE_NODES))
    P.write_secrets(auth, tmp_path / "secrets")                               # kairos nats-auth --secrets-dir
    NC.write_routes_files(tmp_path / "secrets", members, P.new_password())  # kairos nats-cluster --secrets-dir
    env_file = (tmp_path / "secrets" / "nats-server.env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in env_file if line)
    assert len(env) == len(auth.passwords)
    procs, moved = [], []
    try:
        for m in members:
            etc, data = tmp_path / m.name / "etc", tmp_path / m.name / "data"
            etc.mkdir(parents=True)
            data.mkdir()
            conf = (ROOT / "ops" / "nats" / NC.compose_config_name(m)).read_text()
            (etc / "kairos.conf").write_text(relocate(conf, ports, data))
            (etc / NC.AUTH_INCLUDE).write_text((ROOT / "ops" / "nats" / "auth.conf").read_text())
            routes = (tmp_path / "secrets" / NC.routes_file_name(m)).read_text()
            (etc / NC.ROUTES_INCLUDE).write_text(relocate(routes, ports))
            log = open(tmp_path / f"{m.name}.log", "ab")
            procs.append(subprocess.Popen([nats_server_binary(), "--config", str(etc / "kairos.conf")], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
            log.close()
            moved.append(NC.Member(m.name, m.host, ports[m.port], ports[m.cluster_port], ports[m.monitor_port],
                                   str(data / "jetstream"), str(data / "nats-server.pid")))
        for m, p in zip(moved, procs):
            assert wait_listening(p, m.port), (tmp_path / f"{m.name}.log").read_text()[-3000:]
        yield moved, ports, auth.passwords, tmp_path
    finally:
        for p in procs:
            stop_process(p)


async def test_the_committed_compose_cluster_forms_and_replicates(cluster):
    members, ports, passwords, tmp = cluster
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    names = {m.name for m in members}

    def routed() -> bool:
        for m in members:
            rz = get_json(f"{m.monitor_url}/routez")
            if rz is None or {r.get("remote_name") for r in rz["routes"]} != names - {m.name}:
                return False
        return True
    await wait_until(routed, 30, "every member routed to the other two", every=0.1)

    def leader() -> str | None:
        leaders = {(get_json(f"{m.monitor_url}/jsz") or {}).get("meta_cluster", {}).get("leader") for m in members}
        return leaders.pop() if len(leaders) == 1 else None
    meta = await wait_until(leader, 30, "one JetStream meta leader known to all members", every=0.1)
    assert meta in names
    # every member counts all three peers (a member can know the leader a moment before it counts
    # the third peer: seen once on a loaded machine, cluster_size 2)
    await wait_until(lambda: all((get_json(f"{m.monitor_url}/jsz") or {}).get("meta_cluster", {}).get("cluster_size") == 3
                                 for m in members), 30, "every member counting three meta peers", every=0.1)

    # the compose healthcheck of each member, on its new port
    for name, svc in compose["services"].items():
        if name in names:
            url = relocate(svc["healthcheck"]["test"][-1], ports)
            await wait_until(lambda: (get_json(url) or {}).get("status") == "ok", 30, f"{name} healthy", every=0.1)

    # a dispatcher configured as in the compose file declares the buckets with 3 replicas
    env = {k: relocate(str(v), ports) for k, v in compose["services"]["dispatcher-0"]["environment"].items()
           if k.startswith("KAIROS_") and "${" not in str(v)}
    (tmp / "dispatcher.password").write_text(passwords[P.DISPATCHER])
    env["KAIROS_NATS_PASSWORD_FILE"] = str(tmp / "dispatcher.password")
    cfg = from_env(DispatcherConfig, env=env)
    assert stream_replicas(cfg) == 3
    nc = await connect_service(cfg, "t-dispatcher")
    try:
        js = nc.jetstream(timeout=5)
        await wait_until_ok(lambda: ensure_buckets(js, replicas=stream_replicas(cfg)), "JetStream ready", 30)
        for name in ("KV_" + S.VIEW_BUCKET, "KV_" + S.RESERVATION_BUCKET, "KV_" + S.REQUESTS_BUCKET):
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, (name, info.config)
            assert info.cluster.leader in names and len(info.cluster.replicas or []) == 2, (name, info.cluster)
    finally:
        await nc.close()
