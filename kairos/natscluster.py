"""A NATS cluster of N JetStream servers: the members' ports and store directories, and their
nats-server configuration files (``kairos up --nats-servers 3``; the compose file's three servers,
``ops/nats/cluster-<i>.conf``).

Each member is one ``nats-server`` with its own client port, cluster (route) port, HTTP monitoring
port and JetStream store; every member lists every member's route (its own is ignored by the
server), so the routes form a full mesh and any member restarted on its ports and store rejoins.
Route connections authenticate with a credential of their own (the ``cluster { authorization }``
block: the clients' users cannot open a route, a route user cannot log in as a client), and every
member carries the same client ``authorization`` block (``shared/permissions.py``), so a service
that reconnects to another member has the same permissions there.

Syntax: nats-server 2.15 "Clustering" and "JetStream clustering" configuration docs
(``server_name`` is required for JetStream in a cluster; ``cluster { name, listen, authorization,
routes }``; route URLs ``nats-route://user:password@host:port``; ``http`` is the monitoring
listener; ``pid_file``). JetStream's replication factor is per stream: the services declare every
stream and bucket with one replica per member (``shared.bus.stream_replicas``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: the cluster's name (``cluster { name }``); every member must carry the same
CLUSTER_NAME = "kairos"
#: the user name of the route credential (not a client role: shared/permissions.py has no such user)
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


def member_config(m: Member, members: list[Member], route_password: str, auth_block: str | None,
                  route_password_env: bool = False) -> str:
    """The nats-server config file of member ``m`` of the cluster ``members``.

    ``route_password``: the route credential's password (URL-safe characters: it also appears in
    the route URLs), or with ``route_password_env`` the name of an environment variable the server
    resolves (``$NAME``; compose). ``auth_block``: the clients' ``authorization { ... }`` block
    (:func:`shared.permissions.server_auth_config`), None for no client authentication.

    Raises:
        ValueError: ``m`` is not one of ``members``, two members share a name or a host:port, or
            the password cannot be put in a URL.
    """
    if m not in members:
        raise ValueError(f"{m.name} is not a member of the cluster")
    if len({x.name for x in members}) != len(members):
        raise ValueError("cluster members need distinct names")
    addrs = [(x.host, p) for x in members for p in (x.port, x.cluster_port, x.monitor_port)]
    if len(set(addrs)) != len(addrs):
        raise ValueError("cluster members need distinct host:port listeners")
    if not route_password_env and not all(c.isalnum() or c in "-_" for c in route_password):
        raise ValueError("the route password must be URL-safe ([A-Za-z0-9_-])")
    pw = f"${route_password}" if route_password_env else _quote(route_password)
    # in a route URL an environment reference is expanded by the server too ($VAR inside a string)
    url_pw = f"${route_password}" if route_password_env else route_password
    routes = ",\n".join(f"    {_quote(f'nats-route://{ROUTE_USER}:{url_pw}@{x.host}:{x.cluster_port}')}"
                        for x in members)
    text = [f"# Kairos NATS cluster member {m.name} (kairos/natscluster.py). Do not edit.",
            f"server_name: {_quote(m.name)}",
            f"listen: {_quote(f'{m.host}:{m.port}')}",
            f"http: {_quote(f'{m.host}:{m.monitor_port}')}",
            f"pid_file: {_quote(m.pid_file)}",
            "jetstream {", f"  store_dir: {_quote(m.store)}", "}",
            "cluster {", f"  name: {_quote(CLUSTER_NAME)}", f"  listen: {_quote(f'{m.host}:{m.cluster_port}')}",
            "  authorization {", f"    user: {_quote(ROUTE_USER)}", f"    password: {pw}", "    timeout: 2", "  }",
            "  routes: [", routes, "  ]", "}", ""]
    if auth_block:
        text.append(auth_block)
    return "\n".join(text)


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
