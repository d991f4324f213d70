"""The multi-host compose files, checked without Docker: deploy/compose/control-plane.yml (NATS
cluster, Jaeger, aggregator, dispatchers, ingress) and deploy/compose/gpu-host.yml (engines and
node agents only), rendered for a control-plane address and several host indices.

Same approach as tests/unit/test_deploy_files.py (whose helpers this reuses): PyYAML with merge
keys, compose interpolation resolved, each Kairos service's KAIROS_* variables checked against
the config dataclass it reads. The NATS side is checked against kairos/cli/natscluster.py (the
members' listeners for three members on the control-plane host) and the agents' credentials
against kairos/contracts/permissions.py. Nothing here runs on real hosts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from kairos.cli import natscluster as NC
from kairos.contracts import permissions as P
from kairos.runtime.bus import server_urls, stream_replicas
from kairos.runtime.envconfig import env_name, from_env
from tests.compose_tier import compose_exe
from tests.unit.test_deploy_files import ROOT, config_class, env_of, kairos_module, kairos_services

yaml = pytest.importorskip("yaml")

DIR = ROOT / "deploy" / "compose"
CONTROL_PLANE = DIR / "control-plane.yml"
GPU_HOST = DIR / "gpu-host.yml"
CP = "10.0.0.10"
REQUIRED = {"control-plane.yml": ("KAIROS_CONTROL_PLANE_HOST",),
            "gpu-host.yml": ("KAIROS_CONTROL_PLANE_HOST", "KAIROS_HOST_INDEX", "KAIROS_GPU_HOST_ADDR")}
HOSTS = range(4)   # GPU host indices rendered
SECRETS = "/s"     # KAIROS_SECRETS_DIR in the renders

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class Unset(Exception):
    """A required (``${X:?msg}``) variable is not set."""


def interpolate_with(text: str, env: dict[str, str]) -> str:
    """Compose interpolation with host variables ``env``: ``${X}``, ``${X-d}``, ``${X:-d}``,
    ``${X?m}``, ``${X:?m}`` (unset or, with ``:``, empty → default / error)."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        val = env.get(name)
        missing = val is None or (op is not None and op.startswith(":") and val == "")
        if op is None:
            return val or ""
        if op.endswith("-"):
            return arg if missing else val
        if missing:
            raise Unset(f"{name}: {arg}")
        return val

    return _VAR.sub(sub, text.replace("$$", "\0")).replace("\0", "$")


def render(path: Path, **env: str) -> dict:
    base = {"KAIROS_CONTROL_PLANE_HOST": CP, "KAIROS_SECRETS_DIR": SECRETS}
    if path == GPU_HOST:
        base.update(KAIROS_HOST_INDEX="0", KAIROS_GPU_HOST_ADDR="10.0.1.0")
    return yaml.safe_load(interpolate_with(path.read_text(), {**base, **env}))


def gpu(h: int, **env: str) -> dict:
    return render(GPU_HOST, KAIROS_HOST_INDEX=str(h), KAIROS_GPU_HOST_ADDR=f"10.0.1.{h}", **env)


@pytest.fixture(scope="module")
def cp() -> dict:
    return render(CONTROL_PLANE)


@pytest.fixture(scope="module")
def hosts() -> dict[int, dict]:
    return {h: gpu(h) for h in HOSTS}


def members() -> list:
    """The control plane's NATS members: three on one host (kairos nats-cluster --hosts H,H,H)."""
    return NC.compose_members([CP] * 3)


def secret_file(compose: dict, svc: dict, target: str) -> str:
    """The host file of the compose secret mounted at ``target`` (short syntax: /run/secrets/<name>)."""
    for s in svc.get("secrets", []):
        src, tgt = (s, f"/run/secrets/{s}") if isinstance(s, str) else (s["source"], s.get("target", f"/run/secrets/{s['source']}"))
        if tgt == target:
            return compose["secrets"][src]["file"]
    raise AssertionError(f"no secret mounted at {target}")


def all_files(cp: dict, hosts: dict[int, dict]) -> list[tuple[str, dict]]:
    return [("control-plane", cp)] + [(f"gpu-host {h}", c) for h, c in hosts.items()]


# ---- both files ------------------------------------------------------------------------------


def test_every_kairos_command_is_an_existing_service_module(cp, hosts):
    expected = {"control-plane": {"kairos.services.state_aggregator", "kairos.services.dispatcher", "kairos.services.ingress"},
                "gpu-host": {"kairos.services.node_agent"}}
    for label, compose in all_files(cp, hosts):
        found = kairos_services(compose["services"])
        assert {mod for _, mod in found.values()} == expected[label.split()[0]], label
        for name, (svc, mod) in found.items():
            assert importlib.util.find_spec(f"{mod}.__main__") is not None, f"{name}: no module {mod}.__main__"
            assert svc["image"] == "kairos:local" and svc["build"]["dockerfile"] == "ops/docker/Dockerfile", name
            assert (DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name
            assert svc.get("healthcheck", {}).get("test") and svc.get("restart"), name
        for name, svc in compose["services"].items():
            if name not in found:   # everything else is a third-party image
                assert svc.get("image") and "kairos" not in svc["image"], name


def test_every_kairos_variable_is_a_config_field_of_that_service(cp, hosts):
    from kairos.engines.vllm.plugin.protocol import STATE_ADDR_ENV

    tls = {"KAIROS_NATS_SCHEME": "tls", "KAIROS_NATS_TLS_CA_FILE": "/etc/kairos/tls/ca.pem"}
    for label, compose in all_files(cp, hosts) + [("control-plane tls", render(CONTROL_PLANE, **tls)),
                                                  ("gpu-host tls", gpu(1, **tls))]:
        for name, (svc, mod) in kairos_services(compose["services"]).items():
            cls = config_class(mod)
            known = {env_name(f.name) for f in dataclasses.fields(cls)}
            unknown = {k for k in env_of(svc) if k.startswith("KAIROS_")} - known
            assert not unknown, f"{label} {name} ({mod}) sets {sorted(unknown)}, which {cls.__name__} does not read"
            cfg = from_env(cls, env={k: v for k, v in env_of(svc).items() if v is not None})
            assert stream_replicas(cfg) == 3, name
        for name, svc in compose["services"].items():
            if kairos_module(svc) is None:
                allowed = {STATE_ADDR_ENV} if svc.get("image", "").startswith("vllm/") else set()
                extra = [k for k in env_of(svc) if k.startswith("KAIROS_") and k not in allowed]
                assert not extra, f"{label} {name} is not a Kairos service but sets {extra}"


def test_every_container_uses_the_host_network(cp, hosts):
    for label, compose in all_files(cp, hosts):
        assert "networks" not in compose, f"{label}: host networking only"
        for name, svc in compose["services"].items():
            assert svc.get("network_mode") == "host", f"{label} {name}: network_mode must be host"
            assert "ports" not in svc and "networks" not in svc, f"{label} {name}: a bridge network"


def test_no_service_is_in_both_files(cp, hosts):
    both = set(cp["services"]) & set(hosts[0]["services"])
    assert not both, f"in both files: {sorted(both)}"
    # the GPU host runs no control-plane piece and depends on nothing outside itself
    for name, svc in hosts[0]["services"].items():
        assert set(svc.get("depends_on") or {}) <= set(hosts[0]["services"]), name


def test_required_host_variables_have_no_default():
    """The control-plane address, host index and GPU-host address are never silently defaulted:
    every use is ``${X:?…}``, and rendering without one fails."""
    for path in (CONTROL_PLANE, GPU_HOST):
        text = path.read_text()
        for var in REQUIRED[path.name]:
            uses = re.findall(r"\$\{" + var + r"([^}]*)\}", text)
            assert uses and all(u.startswith(":?") for u in uses), f"{path.name}: {var} used as {set(uses)}"
            with pytest.raises(Unset):
                yaml.safe_load(interpolate_with(text, {v: "1" for v in REQUIRED[path.name] if v != var}))


@pytest.mark.compose
def test_docker_compose_accepts_both_files(tmp_path):
    """Debian's docker-compose (1.29): `config -q` of each file and profile, with
    the secret files present; and it refuses the files without the required host variables."""
    exe = compose_exe()
    for path in (CONTROL_PLANE, GPU_HOST):
        for name in re.findall(r"/([^/\s]+)$", "\n".join(s["file"] for s in render(path)["secrets"].values()), re.M):
            (tmp_path / name).write_text("x\n")
    (tmp_path / "nats-server.env").write_text("")
    env = {**{k: v for k, v in os.environ.items() if k not in REQUIRED["gpu-host.yml"]},
           "COMPOSE_PROFILES": "", "KAIROS_SECRETS_DIR": str(tmp_path)}
    for path, profiles in ((CONTROL_PLANE, [[]]), (GPU_HOST, [["--profile", "emulated"], ["--profile", "vllm"]])):
        for prof in profiles:
            host = {"KAIROS_CONTROL_PLANE_HOST": CP, "KAIROS_HOST_INDEX": "0", "KAIROS_GPU_HOST_ADDR": "10.0.1.0"}
            r = subprocess.run([exe, "-f", str(path), *prof, "config", "-q"], capture_output=True, text=True,
                               timeout=60, env={**env, **host})
            assert r.returncode == 0, (path.name, prof, r.stderr)
        r = subprocess.run([exe, "-f", str(path), "config", "-q"], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode != 0 and "KAIROS_CONTROL_PLANE_HOST" in r.stderr, (path.name, r.stderr)


# ---- the control plane -------------------------------------------------------------------------


def test_control_plane_runs_the_nats_cluster_on_its_address(cp):
    """Three members with configs generated for the control-plane address (kairos nats-cluster
    --hosts H,H,H: the same ports as ops/nats/cluster-<i>.conf, bound to H), each with its own
    store and route secret, healthchecked on its own monitoring listener; every control-plane
    service gets all three client URLs."""
    ms = members()
    nats = {n: s for n, s in cp["services"].items() if str(s.get("image", "")).startswith("nats:")}
    assert set(nats) == {m.name for m in ms}
    stores = set()
    for m in ms:
        svc = nats[m.name]
        mnt = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        assert svc["command"] == ["nats-server", "--config", "/etc/nats/kairos.conf"]
        assert mnt["/etc/nats/kairos.conf"] == f"./nats/{NC.compose_config_name(m)}"
        assert mnt[f"/etc/nats/{NC.AUTH_INCLUDE}"] == "./nats/auth.conf"
        assert secret_file(cp, svc, f"/etc/nats/{NC.ROUTES_INCLUDE}") == f"{SECRETS}/{NC.routes_file_name(m)}"
        assert svc["env_file"] == [f"{SECRETS}/nats-server.env"]
        stores.add(mnt["/data"])
        conf = NC.compose_member_config(m, ms)
        assert f'http: "{m.host}:{m.monitor_port}"' in conf and f'listen: "{m.host}:{m.port}"' in conf
        assert svc["healthcheck"]["test"][-1] == f"http://{m.host}:{m.monitor_port}/healthz", m.name
    assert len(stores) == 3 and stores <= set(cp["volumes"])
    urls = sorted(f"nats://{m.host}:{m.port}" for m in ms)
    for name, (svc, _) in kairos_services(cp["services"]).items():
        assert sorted(server_urls(env_of(svc)["KAIROS_NATS_URL"])) == urls, name
        assert {n: d["condition"] for n, d in svc["depends_on"].items() if n in nats} == {n: "service_healthy" for n in nats}


def test_control_plane_services_carry_their_role_credentials(cp):
    roles = {"kairos.services.state_aggregator": P.AGGREGATOR, "kairos.services.dispatcher": P.DISPATCHER,
             "kairos.services.ingress": P.INGRESS}
    for name, (svc, mod) in kairos_services(cp["services"]).items():
        env = env_of(svc)
        assert env["KAIROS_NATS_USER"] == roles[mod], name
        assert secret_file(cp, svc, env["KAIROS_NATS_PASSWORD_FILE"]) == f"{SECRETS}/{roles[mod]}.password", name
    replicas = [env_of(s).get("KAIROS_REPLICA_ID") for s, m in kairos_services(cp["services"]).values()
                if m == "kairos.services.dispatcher"]
    assert len(replicas) == 2 and len(set(replicas)) == 2 and None not in replicas


def test_traces_go_to_jaeger_on_the_control_plane(cp, hosts):
    assert f"--collector.otlp.http.host-port={CP}:4318" in cp["services"]["jaeger"]["command"]
    for label, compose in all_files(cp, hosts):
        for name, (svc, _) in kairos_services(compose["services"]).items():
            assert env_of(svc)["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{CP}:4318", f"{label} {name}"


# ---- the GPU hosts ------------------------------------------------------------------------------


def agents(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, (s, m) in kairos_services(compose["services"]).items()
            if m == "kairos.services.node_agent" and set(s.get("profiles") or ()) == {profile}}


def test_gpu_agents_join_the_control_plane_with_agent_credentials(hosts):
    """Every agent of every host: KAIROS_NATS_URL = the control plane's three members, user
    agent-<node> (permissions.agent_user) with that user's password file, a user the control
    plane's auth.conf (kairos nats-auth --nodes <all node ids>) defines."""
    urls = sorted(f"nats://{m.host}:{m.port}" for m in members())
    nodes = [env_of(s)["KAIROS_NODE_ID"] for c in hosts.values() for s in agents(c, "vllm").values()]
    auth = P.deployment_auth_config(nodes)
    for h, compose in hosts.items():
        for profile in ("emulated", "vllm"):
            found = agents(compose, profile)
            assert len(found) == 4, (h, profile)
            for name, svc in found.items():
                env = env_of(svc)
                assert sorted(server_urls(env["KAIROS_NATS_URL"])) == urls, (h, name)
                user = P.agent_user(env["KAIROS_NODE_ID"])
                assert env["KAIROS_NATS_USER"] == user, (h, name)
                assert secret_file(compose, svc, env["KAIROS_NATS_PASSWORD_FILE"]) == f"{SECRETS}/{user}.password"
                assert f'user: "{user}"' in auth


def test_node_ids_are_unique_per_host_index(hosts):
    for profile in ("emulated", "vllm"):
        seen: dict[str, int] = {}
        for h, compose in hosts.items():
            ids = [env_of(s)["KAIROS_NODE_ID"] for s in agents(compose, profile).values()]
            assert len(set(ids)) == 4, (h, ids)
            for node in ids:
                assert node not in seen, f"{profile}: node {node} on hosts {seen[node]} and {h}"
                seen[node] = h
        roles = sorted(env_of(s)["KAIROS_ROLE"] for s in agents(hosts[0], profile).values())
        assert roles == ["decode", "decode", "prefill", "prefill"], roles


def test_tls_urls_and_files_reach_every_service():
    tls = {"KAIROS_NATS_SCHEME": "tls", "KAIROS_NATS_TLS_CA_FILE": "/etc/kairos/tls/ca.pem",
           "KAIROS_NATS_TLS_CERT_FILE": "/etc/kairos/tls/client.pem", "KAIROS_NATS_TLS_KEY_FILE": "/etc/kairos/tls/client.key"}
    for compose in (render(CONTROL_PLANE, **tls), gpu(2, **tls)):
        for name, (svc, _) in kairos_services(compose["services"]).items():
            env = env_of(svc)
            assert all(u.startswith("tls://") for u in server_urls(env["KAIROS_NATS_URL"])), name
            assert {k: env[k] for k in tls if k.startswith("KAIROS_NATS_TLS")} == {k: v for k, v in tls.items() if k != "KAIROS_NATS_SCHEME"}
            mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
            assert mounts.get("/etc/kairos/tls") == "./tls", f"{name}: the TLS files are not mounted"


def test_vllm_agents_sit_beside_their_engine_and_publish_nixl_on_the_host_address(hosts):
    compose = hosts[3]
    svcs = compose["services"]
    ports: dict[str, set] = {"http": set(), "state": set(), "nixl": set(), "metrics": set()}
    for name, agent in agents(compose, "vllm").items():
        engine_name = next(iter(agent["depends_on"]))
        engine, aenv = svcs[engine_name], env_of(agent)
        eenv = env_of(engine)
        assert agent["depends_on"][engine_name]["condition"] == "service_healthy"
        args = dict(a[2:].split("=", 1) for a in engine["command"][1:] if "=" in a)
        assert aenv["KAIROS_BACKEND"] == "vllm" and args["host"] == "127.0.0.1"
        assert aenv["KAIROS_ENGINE_URL"] == f"http://127.0.0.1:{args['port']}"
        assert f"http://127.0.0.1:{args['port']}/health" in engine["healthcheck"]["test"][-1]
        assert aenv["KAIROS_ENGINE_STATE_ADDR"] == eenv["KAIROS_ENGINE_STATE_ADDR"]
        assert eenv["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.1.3", "other hosts' engines must reach the side channel"
        assert agent["healthcheck"]["test"][-1] == f"http://127.0.0.1:{aenv['KAIROS_METRICS_PORT']}/health"
        for kind, port in (("http", args["port"]), ("state", eenv["KAIROS_ENGINE_STATE_ADDR"].rsplit(":", 1)[1]),
                           ("nixl", eenv["VLLM_NIXL_SIDE_CHANNEL_PORT"]), ("metrics", aenv["KAIROS_METRICS_PORT"])):
            ports[kind].add(int(port))
    assert all(len(v) == 4 for v in ports.values()), ports
    gpus = [svcs[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] for n in svcs if n.startswith("vllm-") and "agent" not in n]
    assert len(gpus) == 4 and len(set(gpus)) == 4, gpus
