"""docker-compose.yml's NATS cluster, checked without Docker: one service per member of
kairos/cli/natscluster.py's compose layout, the committed member configs equal to what the generator
writes (``kairos nats-cluster --conf-dir ops/nats``), distinct ports, routes to the other members,
every Kairos service given every server URL and 3 replicas, host networking on every container.

The configs themselves are run by three real nats-servers in
tests/integration/test_compose_nats_cluster.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kairos.cli import natscluster as NC
from kairos.cli.main import main
from kairos.runtime.bus import server_urls, stream_replicas
from kairos.runtime.envconfig import from_env
from tests.compose_tier import compose_exe
from tests.unit.test_deploy_files import COMPOSE, ROOT, config_class, env_of, kairos_services

yaml = pytest.importorskip("yaml")

NATS_DIR = ROOT / "ops" / "nats"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def nats_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("nats:")}


def mounts(svc: dict) -> dict[str, str]:
    """``{container path: host path or volume}`` of a service's short-syntax volumes."""
    return {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}


def listeners(conf: str) -> dict[str, str]:
    """The three listeners of a member config: ``client``, ``monitor`` (top level) and
    ``cluster`` (the ``listen`` inside ``cluster { }``), as ``host:port``."""
    top = dict(re.findall(r'^(listen|http): "([^"]+)"$', conf, re.M))
    cluster = re.search(r'^cluster \{\n(?:  .*\n)*?  listen: "([^"]+)"$', conf, re.M)
    assert cluster and set(top) == {"listen", "http"}, conf
    return {"client": top["listen"], "monitor": top["http"], "cluster": cluster.group(1)}


def committed(svc: dict) -> str:
    return (ROOT / mounts(svc)["/etc/nats/kairos.conf"]).read_text()


def test_committed_member_configs_are_generated():
    members = NC.compose_members()
    for m in members:
        path = NATS_DIR / NC.compose_config_name(m)
        assert path.read_text() == NC.compose_member_config(m, members), \
            "regenerate: kairos nats-cluster --conf-dir ops/nats"
    assert sorted(p.name for p in NATS_DIR.glob("cluster-*.conf")) == sorted(NC.compose_config_name(m) for m in members)


def test_the_cli_writes_the_committed_configs_and_secret_routes(tmp_path):
    r = CliRunner().invoke(main, ["nats-cluster", "--conf-dir", str(tmp_path / "conf"),
                                  "--secrets-dir", str(tmp_path / "secrets")])
    assert r.exit_code == 0, r.output
    for m in NC.compose_members():
        assert (tmp_path / "conf" / NC.compose_config_name(m)).read_text() == (NATS_DIR / NC.compose_config_name(m)).read_text()
        routes = tmp_path / "secrets" / NC.routes_file_name(m)
        assert routes.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    for bad in (["--hosts", "a,b c"], ["--hosts", ""], []):
        r = CliRunner().invoke(main, ["nats-cluster", *bad] + (["--conf-dir", str(tmp_path / "x")] if bad else []))
        assert r.exit_code == 2, (bad, r.output)


def test_compose_runs_one_service_per_member_with_its_own_store(compose):
    nats = nats_services(compose)
    members = NC.compose_members()
    assert set(nats) == {m.name for m in members}
    stores = set()
    for m in members:
        svc, mnt = nats[m.name], mounts(nats[m.name])
        version = tuple(int(x) for x in svc["image"].split(":", 1)[1].split("-")[0].split(".")[:2])
        assert version >= (2, 11), "per-message TTLs of the reservation bucket need nats-server >= 2.11"
        assert svc["command"] == ["nats-server", "--config", "/etc/nats/kairos.conf"]
        assert mnt["/etc/nats/kairos.conf"] == f"./ops/nats/{NC.compose_config_name(m)}"
        assert mnt[f"/etc/nats/{NC.AUTH_INCLUDE}"] == "./ops/nats/auth.conf"
        # the routes file is a compose secret (compose refuses to start without the file)
        targets = {x["target"]: compose["secrets"][x["source"]]["file"] for x in svc["secrets"]}
        assert targets == {f"/etc/nats/{NC.ROUTES_INCLUDE}": f"ops/secrets/{NC.routes_file_name(m)}"}
        assert mnt["/data"] in compose["volumes"], f"{m.name}: /data is not a named volume"
        stores.add(mnt["/data"])
        assert svc["env_file"] == ["ops/secrets/nats-server.env"]
        # the healthcheck asks this member's own monitoring port
        conf = committed(svc)
        assert svc["healthcheck"]["test"][-1] == f"http://{listeners(conf)['monitor']}/healthz"
        assert re.search(r'^jetstream \{\n  store_dir: "/data/jetstream"$', conf, re.M)
    assert len(stores) == len(members), "members share a JetStream store"


def test_members_have_distinct_ports_and_route_to_each_other(compose, tmp_path):
    nats = nats_services(compose)
    lst = {name: listeners(committed(svc)) for name, svc in nats.items()}
    addrs = [a for m in lst.values() for a in m.values()]
    assert len(addrs) == 9 and len(set(addrs)) == 9, lst
    assert all(a.startswith("127.0.0.1:") for a in addrs), "listeners must stay on loopback"
    # the routes each member gets (kairos nats-cluster --secrets-dir): the other two members' route
    # ports, and its own (the server drops a route to itself; kairos up lists it too)
    NC.write_routes_files(tmp_path, NC.compose_members(), "pw-x")
    for name in nats:
        text = (tmp_path / f"{name}.routes.conf").read_text()
        routes = re.findall(r'"nats-route://([^:]+):([^@]+)@([^"]+)"', text)
        others = {lst[o]["cluster"] for o in nats if o != name}
        assert len(others) == 2 and {r[2] for r in routes} == others | {lst[name]["cluster"]}, (name, routes)
        assert all(r[:2] == (NC.ROUTE_USER, "pw-x") for r in routes)
        assert re.search(rf'user: "{NC.ROUTE_USER}"\n  password: "pw-x"', text)


def test_every_kairos_service_gets_every_server_and_three_replicas(compose):
    urls = sorted(f"nats://{listeners(committed(s))['client']}" for s in nats_services(compose).values())
    found = kairos_services(compose["services"])
    assert len(found) >= 7
    for name, (svc, mod) in found.items():
        env = {k: v for k, v in env_of(svc).items() if v is not None}
        assert sorted(server_urls(env["KAIROS_NATS_URL"])) == urls, name
        cfg = from_env(config_class(mod), env=env)
        assert stream_replicas(cfg) == 3, name
        assert set(svc["depends_on"]) >= set(nats_services(compose)), name
        assert all(svc["depends_on"][n]["condition"] == "service_healthy" for n in nats_services(compose)), name


def test_every_container_uses_the_host_network(compose):
    assert "networks" not in compose, "no compose networks: host networking only"
    for name, svc in compose["services"].items():
        assert svc.get("network_mode") == "host", f"{name}: network_mode must be host"
        assert "ports" not in svc and "networks" not in svc, f"{name}: ports/networks mean a bridge network"


@pytest.mark.compose
def test_docker_compose_accepts_the_file(tmp_path):
    """Debian's docker-compose (1.29): `config -q` with the generated files present."""
    exe = compose_exe()
    secrets = tmp_path / "ops" / "secrets"
    secrets.mkdir(parents=True)
    for name in re.findall(r"file: ops/secrets/(\S+)", COMPOSE.read_text()):
        (secrets / name).write_text("x\n")
    (secrets / "nats-server.env").write_text("")
    r = subprocess.run([exe, "--project-directory", str(tmp_path), "-f", str(COMPOSE), "config", "-q"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COMPOSE_PROFILES": ""})
    assert r.returncode == 0, r.stderr


def test_members_spread_over_hosts_keep_the_standard_ports_and_route_to_each_host(tmp_path):
    """docs/deploy.md's three-host layout: one member per host on 4222/6222/8222, routes to the
    other hosts' 6222; members sharing a host get the next ports."""
    hosts = ["10.0.0.1", "10.0.0.2", "kairos-nats-3.example"]
    members = NC.compose_members(hosts)
    assert [(m.host, m.port, m.cluster_port, m.monitor_port) for m in members] == [(h, 4222, 6222, 8222) for h in hosts]
    for m in members:
        assert listeners(NC.compose_member_config(m, members)) == {
            "client": f"{m.host}:4222", "monitor": f"{m.host}:8222", "cluster": f"{m.host}:6222"}
    NC.write_routes_files(tmp_path, members, "pw")
    for m in members:
        routes = re.findall(r'@([^"]+)"', (tmp_path / NC.routes_file_name(m)).read_text())
        assert sorted(routes) == sorted(f"{h}:6222" for h in hosts)  # the others' and its own
    mixed = NC.compose_members(["a", "a", "b"])
    assert [(m.host, m.port) for m in mixed] == [("a", 4222), ("a", 4223), ("b", 4222)]
    for bad in ([], ["10.0.0.1", "::1"], ["a b"], ["-a"]):
        with pytest.raises(ValueError):
            NC.compose_members(bad)
    with pytest.raises(ValueError, match="URL-safe"):
        NC.write_routes_files(tmp_path, members, "p@ss")
