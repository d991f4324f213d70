"""The message bus of one ``kairos up``: a running NATS it is pointed at (``--nats-url``), or a bundled
``nats-server -js`` — one server, or ``--nats-servers N`` clustered members
(:mod:`kairos.cli.natscluster`) — with generated per-role credentials
(:mod:`kairos.contracts.permissions`). These functions build the :class:`~kairos.cli.processes.Child`
processes and their files; :class:`kairos.cli.up.Supervisor` starts, restarts and stops them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from kairos.cli import natscluster as NC
from kairos.cli.processes import Child, free_port, get_json, nats_server_binary, port_open
from kairos.cli.up_plan import UpOptions, node_ids
from kairos.contracts import permissions as P

#: ``--nats-servers N``: longest wait, s, for the cluster's JetStream to elect its meta leader
CLUSTER_READY_S = 60.0


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (0600: it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def external_nats(opts: UpOptions) -> dict[str, Path] | None:
    """Check the NATS of ``opts.nats_url`` (a cluster: every member's URL, comma-separated; one
    listening member is enough) and return the services' password files ``{user: path}`` from
    ``opts.nats_secrets_dir`` (None without it: the environment's credentials pass through).

    Raises:
        RuntimeError: nothing listens at any URL, or a password file is missing (naming the
            ``kairos nats-auth`` command that writes them).
    """
    url = opts.nats_url or ""

    def listens(u: str) -> bool:
        host, _, port = u.split("://", 1)[-1].rsplit("@", 1)[-1].partition(":")
        return port_open(host or "127.0.0.1", int(port or 4222))

    if not any(listens(u) for u in url.split(",") if u.strip()):
        raise RuntimeError(f"--nats-url {url}: nothing listens there")
    if not opts.nats_secrets_dir:
        return None
    d = Path(opts.nats_secrets_dir).resolve()
    creds = {u: d / f"{u}.password" for u in P.cluster_users(node_ids(opts))}
    missing = [str(p) for u, p in creds.items() if u != P.PROFILER and not p.is_file()]
    if missing:
        raise RuntimeError(f"--nats-secrets-dir: missing {', '.join(missing)} (write them with "
                           f"kairos nats-auth --secrets-dir {opts.nats_secrets_dir} --nodes "
                           f"{','.join(node_ids(opts))})")
    return creds


def single_server(opts: UpOptions, tmp: Path, log_dir: Path) -> tuple[Child, dict[str, Path] | None]:
    """The bundled nats-server (a free port on 127.0.0.1, its JetStream store in ``tmp/jetstream``,
    ``opts.nats_monitor_port`` if set) and, with ``opts.nats_auth``, the services' generated password
    files (``tmp/nats-credentials``, the server's config beside them); None without auth."""
    port = free_port()
    store = tmp / "jetstream"
    argv = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    if opts.nats_monitor_port:
        argv += ["-m", str(opts.nats_monitor_port)]  # bound to -a's 127.0.0.1 like the client port
    creds = None
    if opts.nats_auth:
        auth = P.GeneratedAuth.for_nodes(node_ids(opts))
        creds = P.write_secrets(auth, tmp / "nats-credentials")
        conf = tmp / "nats-credentials" / "nats-server.conf"
        _write_private(conf, auth.server_config())
        argv += ["-c", str(conf)]
    child = Child("nats-server", "message bus (JetStream)", argv, dict(os.environ), f"nats://127.0.0.1:{port}",
                  log_dir / "nats-server.log", extra={"store": str(store)})
    return child, creds


def cluster_servers(opts: UpOptions, tmp: Path,
                    log_dir: Path) -> tuple[list[Child], list[NC.Member], dict[str, Path] | None]:
    """``opts.nats_servers`` clustered nats-servers (kairos/cli/natscluster.py), each a child
    ``nats-<i>`` (restarted like the single server); the same generated client credentials on every
    member, a route credential of their own. Returns the children, the members (also listed in
    ``log_dir/nats-cluster.json``) and the services' password files (None without auth)."""
    n, mon = opts.nats_servers, opts.nats_monitor_port
    ports = [(free_port(), free_port(), mon + i if mon else free_port()) for i in range(n)]
    members = NC.plan_members(n, ports, tmp / "jetstream")
    secrets_dir = tmp / "nats-credentials"
    secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    creds, auth_block = None, None
    if opts.nats_auth:
        auth = P.GeneratedAuth.for_nodes(node_ids(opts))
        creds = P.write_secrets(auth, secrets_dir)
        auth_block = auth.server_config()
    route_pw = P.new_password()
    children = []
    for m in members:
        Path(m.store).parent.mkdir(parents=True, exist_ok=True)
        conf = secrets_dir / f"{m.name}.conf"
        _write_private(conf, NC.member_config(m, members, route_pw, auth_block))
        children.append(Child(m.name, "message bus (JetStream cluster member)", [nats_server_binary(), "-c", str(conf)],
                              dict(os.environ), m.url, log_dir / f"{m.name}.log",
                              extra={"store": m.store, "monitor": m.monitor_url, "pid_file": m.pid_file}))
    NC.write_members_file(log_dir / "nats-cluster.json", members)
    return children, members, creds


def wait_cluster_ready(members: list[NC.Member], stopping: Callable[[], bool]) -> None:
    """Wait until JetStream has its meta leader (every member's ``/healthz`` answers ok; before, a
    service's stream declare could time out and fail the startup), or ``stopping()`` becomes true.

    Raises:
        RuntimeError: not ready within :data:`CLUSTER_READY_S`.
    """
    deadline = time.monotonic() + CLUSTER_READY_S
    while not all((get_json(m.monitor_url + "/healthz") or {}).get("status") == "ok" for m in members):
        if stopping() or time.monotonic() > deadline:
            raise RuntimeError(f"the NATS cluster did not become ready within {CLUSTER_READY_S:g} s")
        time.sleep(0.1)
