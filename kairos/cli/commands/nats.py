"""``kairos nats-auth`` and ``kairos nats-cluster``: the NATS configuration of a deployment (per-role
users and their permissions, :mod:`kairos.contracts.permissions`; the compose cluster's members,
:mod:`kairos.cli.natscluster`)."""

from __future__ import annotations

from pathlib import Path

import click

from kairos.cli import natscluster as NC
from kairos.contracts import permissions as P
from kairos.contracts.subjects import SubjectError


@click.command("nats-auth")
@click.option("--nodes", default="prefill-0,prefill-1,decode-0,decode-1", show_default=True,
              help="Comma list of node ids (one agent-<node> user each).")
@click.option("--secrets-dir", type=click.Path(file_okay=False), default=None,
              help="Instead: write a fresh random password per role into this directory (<user>.password, "
                   "and nats-server.env with NATS_PASSWORD_<USER> lines), e.g. ops/secrets for compose.")
def nats_auth(nodes: str, secrets_dir: str | None) -> None:
    """Print the nats-server authorization block (one user per role with its subject permissions;
    passwords from NATS_PASSWORD_<USER> in the server's environment), or write those passwords."""
    ids = [n.strip() for n in nodes.split(",") if n.strip()]
    if not ids:
        raise click.BadParameter("name at least one node id (a cluster without agents serves nothing)",
                                 param_hint="--nodes")
    try:
        if secrets_dir is None:
            click.echo(P.deployment_auth_config(ids), nl=False)
            return
        files = P.write_secrets(P.GeneratedAuth.for_nodes(ids), Path(secrets_dir))
    except (SubjectError, P.RoleError) as exc:
        raise click.BadParameter(str(exc), param_hint="--nodes") from None
    except OSError as exc:
        raise click.BadParameter(f"cannot write into {secrets_dir}: {exc.strerror or exc}",
                                 param_hint="--secrets-dir") from None
    click.echo(f"wrote {len(files)} password files and nats-server.env to {secrets_dir}", err=True)


@click.command("nats-cluster")
@click.option("--hosts", default=",".join(("127.0.0.1",) * 3), show_default=True,
              help="Comma list: member i (nats-i) runs on host i (IPv4 address or DNS name its peers and the "
                   "services reach it at). Members sharing a host get consecutive ports from 4222/6222/8222.")
@click.option("--conf-dir", type=click.Path(file_okay=False), default=None,
              help="Write the members' configs (cluster-<i>.conf, no secrets) here; ops/nats is what "
                   "docker-compose.yml mounts.")
@click.option("--secrets-dir", type=click.Path(file_okay=False), default=None,
              help="Write a fresh route credential and each member's routes (nats-<i>.routes.conf, 0600) "
                   "here, e.g. ops/secrets for compose.")
def nats_cluster(hosts: str, conf_dir: str | None, secrets_dir: str | None) -> None:
    """The nats-server configs of the compose NATS cluster (kairos/cli/natscluster.py): one per member,
    routes between all of them with their own credential, JetStream on each, the per-role users of
    ops/nats/auth.conf. Docs: docs/deploy.md, "A NATS cluster"."""
    if conf_dir is None and secrets_dir is None:
        raise click.UsageError("give --conf-dir, --secrets-dir or both")
    try:
        members = NC.compose_members([h.strip() for h in hosts.split(",")])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--hosts") from None
    if len(members) < 3 or len(members) % 2 == 0:  # JetStream's raft needs a majority of the members
        click.echo(f"kairos nats-cluster: warning: {len(members)} members survive the loss of "
                   f"{(len(members) - 1) // 2} (a majority must stay up); 3 or 5 is the usual size", err=True)
    for opt, d, write in (("--conf-dir", conf_dir, lambda p: NC.write_compose_configs(p, members)),
                          ("--secrets-dir", secrets_dir,
                           lambda p: NC.write_routes_files(p, members, P.new_password()))):
        if d is None:
            continue
        try:
            files = write(Path(d))
        except OSError as exc:
            raise click.BadParameter(f"cannot write into {d}: {exc.strerror or exc}", param_hint=opt) from None
        click.echo(f"wrote {', '.join(f.name for f in files)} to {d}", err=True)
