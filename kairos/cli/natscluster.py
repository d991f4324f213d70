"""A NATS cluster of N JetStream servers: the members' ports and store directories, and their
nats-server configuration files (``kairos up --nats-servers 3``; the compose file's three servers,
``ops/nats/cluster-<i>.conf``).

Each member is one ``nats-server`` with its own client port, cluster (route) port, HTTP monitoring
port and JetStream store; every member lists every member's route (its own is dropped by the
server), so the routes form a full mesh and any member restarted on its ports and store rejoins.
Route connections authenticate with a credential of their own (the ``cluster { authorization }``
block: the clients' users cannot open a route, a route user cannot log in as a client), and every
member carries the same client ``authorization`` block (``kairos/contracts/permissions.py``), so a service
that reconnects to another member has the same permissions there.

Syntax: nats-server 2.15 "Clustering" and "JetStream clustering" configuration docs
(``server_name`` is required for JetStream in a cluster; ``cluster { name, listen, authorization,
routes }``; route URLs ``nats-route://user:password@host:port``; ``http`` is the monitoring
listener; ``pid_file``). JetStream's replication factor is per stream: the services declare every
bucket with one replica per member (``kairos.runtime.bus.stream_replicas``); nothing on a
request's path is stored (docs/bus.md, "The request path").

Two renderings of one member: :func:`member_config` puts everything in one file (``kairos up``
writes it into its private temporary directory); :func:`compose_member_config` is the committed,
secret-free file of docker-compose.yml (``kairos nats-cluster --conf-dir``), which includes the
route credential (:func:`write_routes_files`, ``--secrets-dir``) and the client users
(``ops/nats/auth.conf``) from files beside it. docs/deploy.md "A NATS cluster".
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path


#: the cluster's name (``cluster { name }``); every member must carry the same
CLUSTER_NAME = "kairos"
#: the user name of the route credential (not a client role: kairos/contracts/permissions.py has no such user)
ROUTE_USER = "kairos-route"


@dataclass(frozen=True)
class Member:
    """One cluster member.

    Attributes:
        name: its ``server_name`` (``nats-<i>``), unique in the cluster (JetStream's peer name).
        host: the address its three listeners bind to and that the others reach it at.
        port: client port (``nats://host:port``).
        cluster_port: route port.
        monitor_port: HTTP monitoring port (``/varz``, ``/jsz``, ``/routez``).
        store: its JetStream store directory (never shared with another member).
        pid_file: where the server writes its pid (a test kills the member by it).
    """

    name: str
    host: str
    port: int
    cluster_port: int
    monitor_port: int
    store: str
    pid_file: str

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"


def member_name(i: int) -> str:
    """The ``server_name`` of member ``i`` (``nats-0`` …)."""
    return f"nats-{i}"


def _quote(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid nats-server config string


def _check(m: Member, members: list[Member]) -> None:
    if m not in members:
        raise ValueError(f"{m.name} is not a member of the cluster")
    if len({x.name for x in members}) != len(members):
        raise ValueError("cluster members need distinct names")
    addrs = [(x.host, p) for x in members for p in (x.port, x.cluster_port, x.monitor_port)]
    if len(set(addrs)) != len(addrs):
        raise ValueError("cluster members need distinct host:port listeners")


def route_lines(m: Member, members: list[Member], route_password: str) -> list[str]:
    """The route credential and route list of member ``m`` (lines inside its ``cluster { }``
    block): ``authorization { user, password }`` (what the others must present) and one
    ``nats-route://`` URL per member carrying that credential: the others', and its own, which
    the server recognises and drops (``kairos up`` has always listed it: lists without it were
    tried and did worse in tests/faults/test_nats_cluster.py on a loaded machine, a few runs
    and not understood, so it stays). The password is written
    literally: nats-server expands ``$VAR`` only as a whole unquoted value, never inside a URL
    string, so an environment reference cannot carry it into the route URLs.

    Raises:
        ValueError: as :func:`member_config`.
    """
    _check(m, members)
    if not route_password or not all(c.isalnum() or c in "-_" for c in route_password):
        raise ValueError("the route password must be URL-safe ([A-Za-z0-9_-]) and not empty")
    urls = [_quote(f"nats-route://{ROUTE_USER}:{route_password}@{x.host}:{x.cluster_port}") for x in members]
    return ["authorization {", f"  user: {_quote(ROUTE_USER)}", f"  password: {_quote(route_password)}",
            "  timeout: 2", "}", "routes: [", *(f"  {u}" for u in urls), "]"]


def _render(m: Member, members: list[Member], cluster_body: list[str], tail: list[str],
            jetstream: list[str] = ()) -> str:
    text = [f"# Kairos NATS cluster member {m.name} (kairos/cli/natscluster.py). Do not edit.",
            f"server_name: {_quote(m.name)}",
            f"listen: {_quote(f'{m.host}:{m.port}')}",
            f"http: {_quote(f'{m.host}:{m.monitor_port}')}",
            f"pid_file: {_quote(m.pid_file)}",
            # keep-alive of client and route connections: a frozen member is dropped by its peers in
            # about 6 s (the default, 2 minutes x 2, kept its routes and clients hanging)
            "ping_interval: \"2s\"", "ping_max: 3",
            "jetstream {", f"  store_dir: {_quote(m.store)}", *(f"  {ln}" for ln in jetstream), "}",
            "cluster {", f"  name: {_quote(CLUSTER_NAME)}", f"  listen: {_quote(f'{m.host}:{m.cluster_port}')}",
            *(f"  {ln}" for ln in cluster_body), "}", ""]
    return "\n".join(text + tail)


def member_config(m: Member, members: list[Member], route_password: str, auth_block: str | None) -> str:
    """The nats-server config file of member ``m`` of the cluster ``members`` (``kairos up``):
    everything inline, the route credential included (:func:`route_lines`).

    ``route_password``: the route credential's password (URL-safe characters: it also appears in
    the route URLs). ``auth_block``: the clients' ``authorization { ... }`` block
    (:func:`kairos.contracts.permissions.server_auth_config`), None for no client authentication.

    Raises:
        ValueError: ``m`` is not one of ``members``, two members share a name or a host:port, or
            the password cannot be put in a URL.
    """
    return _render(m, members, route_lines(m, members, route_password), [auth_block] if auth_block else [])


def plan_members(n: int, ports: list[tuple[int, int, int]], base: Path, host: str = "127.0.0.1") -> list[Member]:
    """``n`` members on ``host`` with ``ports[i]`` = (client, cluster, monitor) and member ``i``'s
    store ``base/<name>/jetstream`` and pid file ``base/<name>/nats-server.pid``.

    Raises:
        ValueError: ``n`` < 1 or not ``n`` port triples.
    """
    if n < 1 or len(ports) != n:
        raise ValueError(f"need {n} >= 1 port triples, got {len(ports)}")
    return [Member(member_name(i), host, p, c, mon, str(base / member_name(i) / "jetstream"),
                   str(base / member_name(i) / "nats-server.pid")) for i, (p, c, mon) in enumerate(ports)]


def write_members_file(path: Path, members: list[Member]) -> None:
    """``path``: JSON ``[{name, url, monitor_url, store, pid_file}]`` of the members (for
    operators and the faults tier, which find the servers' leaders from their monitoring ports)."""
    path.write_text(json.dumps([{"name": m.name, "url": m.url, "monitor_url": m.monitor_url, "store": m.store,
                                 "pid_file": m.pid_file} for m in members], indent=2) + "\n")


# ---- docker-compose.yml: the same cluster, one service per member (host networking) -------------

#: client, route and monitoring port of the compose members; members that share a host get the
#: next ones (nats-1 on the same host as nats-0: 4223, 6223, 8223)
COMPOSE_PORTS = (4222, 6222, 8222)
#: in each member's container: its JetStream store and pid file (on the member's own volume)
COMPOSE_STORE = "/data/jetstream"
COMPOSE_PID_FILE = "/data/nats-server.pid"
#: JetStream limits of a compose member (its store is a named volume on the host's disk)
COMPOSE_JETSTREAM_LIMITS = ("max_memory_store: 512MB", "max_file_store: 4GB")
#: files next to a member's config in its container (/etc/nats): the route credential and routes
#: (secret, written by ``kairos nats-cluster --secrets-dir``) and the clients' users (``kairos nats-auth``)
ROUTES_INCLUDE = "routes.conf"
AUTH_INCLUDE = "auth.conf"
#: the default layout: three members on loopback of one host (docker-compose.yml)
COMPOSE_HOSTS = ("127.0.0.1",) * 3


def compose_members(hosts: tuple[str, ...] | list[str] = COMPOSE_HOSTS) -> list[Member]:
    """The compose cluster's members, member ``i`` on ``hosts[i]`` (an IPv4 address or a DNS
    name its peers and the services reach it at; its listeners bind to it), on
    :data:`COMPOSE_PORTS` shifted by the number of earlier members on the same host.

    Raises:
        ValueError: no host, or a host that is not a plain name or IPv4 address (IPv6 literals
            are not supported: they would need brackets in every URL).
    """
    if not hosts:
        raise ValueError("a cluster needs at least one host")
    seen: dict[str, int] = {}
    out = []
    for i, h in enumerate(hosts):
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?", h or ""):
            raise ValueError(f"host {h!r}: give an IPv4 address or a DNS name")
        k = seen[h] = seen.get(h, -1) + 1
        out.append(Member(member_name(i), h, *(p + k for p in COMPOSE_PORTS), COMPOSE_STORE, COMPOSE_PID_FILE))
    return out


def compose_member_config(m: Member, members: list[Member]) -> str:
    """The committed config of compose member ``m`` (``ops/nats/cluster-<i>.conf``): no secret in
    it. The route credential and routes come from ``routes.conf`` (:func:`route_lines`, written by
    ``kairos nats-cluster --secrets-dir``), the clients' per-role users from ``auth.conf``
    (``kairos nats-auth``; passwords from the server's environment), both included from the
    config's own directory (nats-server resolves ``include`` relative to the including file).

    Raises:
        ValueError: as :func:`member_config`.
    """
    _check(m, members)
    peers = ", ".join(f"{x.name} {x.host}:{x.cluster_port}" for x in members if x != m)
    return _render(m, members, [f"# the route credential and the routes to {peers} and itself (secret; kairos nats-cluster "
                       "--secrets-dir)",
                       f"include ./{ROUTES_INCLUDE}"],
                   ["# one user per Kairos role (kairos nats-auth; passwords: NATS_PASSWORD_<USER> in the environment)",
                    f"include ./{AUTH_INCLUDE}",
                    "# TLS (docs/security.md): add a tls { cert_file, key_file, ca_file } block here and mount the files",
                    ""], COMPOSE_JETSTREAM_LIMITS)


def compose_config_name(m: Member) -> str:
    """The committed file of member ``m``: ``cluster-<i>.conf`` (``nats-<i>``)."""
    return f"cluster-{m.name.removeprefix('nats-')}.conf"


def routes_file_name(m: Member) -> str:
    """The secret routes file of member ``m`` in the secrets directory: ``<name>.routes.conf``."""
    return f"{m.name}.routes.conf"


def write_compose_configs(conf_dir: Path, members: list[Member]) -> list[Path]:
    """Write :func:`compose_member_config` of every member to ``conf_dir/cluster-<i>.conf``
    (created if missing; files replaced). Returns the paths. Raises OSError, ValueError."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for m in members:
        out.append(conf_dir / compose_config_name(m))
        out[-1].write_text(compose_member_config(m, members))
    return out


def write_routes_files(secrets_dir: Path, members: list[Member], route_password: str) -> list[Path]:
    """Write each member's route credential and routes (:func:`route_lines`, the same password
    for all: every member must accept the others' routes) to ``secrets_dir/<name>.routes.conf``
    (directory created 0700, files 0600, replaced). Returns the paths. Raises OSError, ValueError."""
    secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for m in members:
        text = "\n".join([f"# Route credential of {m.name} (kairos/cli/natscluster.py). Secret; do not commit.",
                          *route_lines(m, members, route_password), ""])
        out.append(secrets_dir / routes_file_name(m))
        fd = os.open(out[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return out
