"""``kairos plan --emit``: a planned cluster (P prefill + D decode nodes) as deployment files.

* ``k8s`` — a kustomize overlay over ``deploy/k8s/overlays/<overlay>`` (``vllm-gpu`` by default):
  the ``prefill`` and ``decode`` StatefulSets' replicas and the password files they mount, the NATS
  ``auth.conf`` with one ``agent-<node>`` user per node (:func:`kairos.contracts.permissions.deployment_auth_config`,
  what ``kairos nats-auth --nodes`` prints) and a placeholder password per new user in the
  ``nats-passwords`` secret, as the base has. ``kubectl kustomize DIR`` renders it.
* ``compose`` — ``docker-compose.yml`` with its ``emulated`` profile's node agents replaced by the
  planned ones (:func:`emit_compose` says why a whole file and not an override); the nodes' NATS
  users and passwords come from ``kairos nats-auth --nodes`` (the file's header has the commands).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

from kairos.contracts import permissions as P

#: the repository's root (deploy/, docker-compose.yml): what the emitted files point at
REPO = Path(__file__).resolve().parents[2]
#: the metrics port of the first planned compose node (the next ones count up, as docker-compose.yml's)
COMPOSE_NODE_PORT = 9110


class EmitError(ValueError):
    """The plan cannot be written as asked (no such overlay, fewer than 1 node of a role)."""


def node_ids(prefill: int, decode: int) -> list[str]:
    """``prefill-0..P-1, decode-0..D-1``: the StatefulSet pod names / compose node ids."""
    return [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]


def _password_key(node: str) -> str:
    return f"NATS_PASSWORD_AGENT_{node.upper().replace('-', '_')}"


def emit_k8s(prefill: int, decode: int, out: Path, overlay: str = "vllm-gpu") -> list[Path]:
    """Write ``out/kustomization.yaml``, ``out/nodes-patch.yaml`` and ``out/auth.conf`` (see the module
    docstring). Returns the paths. Raises EmitError (unknown overlay, a role without nodes), OSError."""
    base = REPO / "deploy" / "k8s" / "overlays" / overlay
    if not (base / "kustomization.yaml").is_file():
        raise EmitError(f"no kustomize overlay {overlay!r} under {base.parent}")
    if prefill < 1 or decode < 1:
        raise EmitError(f"a P/D cluster needs a node of each role, got {prefill}P{decode}D")
    out.mkdir(parents=True, exist_ok=True)
    nodes = node_ids(prefill, decode)
    patches = []
    for role, n in (("prefill", prefill), ("decode", decode)):
        items = [{"key": _password_key(f"{role}-{i}"), "path": f"agent-{role}-{i}"} for i in range(n)]
        patches.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": role},
                        "spec": {"replicas": n, "template": {"spec": {"volumes": [
                            {"name": "nats-password", "secret": {"secretName": "nats-passwords", "items": items}}]}}}})
    patch = out / "nodes-patch.yaml"
    patch.write_text("# kairos plan: the node StatefulSets' sizes and the password file of every node\n"
                     + yaml.safe_dump_all(patches, sort_keys=False))
    auth = out / "auth.conf"
    auth.write_text(P.deployment_auth_config(nodes))
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(base, out.resolve())],
            "patches": [{"path": patch.name}],
            "configMapGenerator": [{"name": "nats-config", "behavior": "merge", "files": [auth.name]}],
            "secretGenerator": [{"name": "nats-passwords", "behavior": "merge",
                                 # PLACEHOLDERS like the base's: replace them (docs/deploy.md "Kubernetes")
                                 "literals": [f"{_password_key(n)}=change-me" for n in nodes]}]}
    path = out / "kustomization.yaml"
    path.write_text(f"# kairos plan: {prefill}P{decode}D over deploy/k8s/overlays/{overlay}; "
                    f"render with: kubectl kustomize {out}\n" + yaml.safe_dump(kust, sort_keys=False))
    return [path, patch, auth]


def _compose_node(template: dict, node: str, port: int) -> dict:
    """A copy of ``template`` (docker-compose.yml's emulated prefill-0 or decode-0) as node ``node``."""
    svc = copy.deepcopy(template)
    svc["secrets"] = [f"nats-agent-{node}"]
    env = svc["environment"]
    env.update({"KAIROS_NODE_ID": node, "KAIROS_NATS_USER": f"agent-{node}",
                "KAIROS_NATS_PASSWORD_FILE": f"/run/secrets/nats-agent-{node}", "KAIROS_METRICS_PORT": str(port)})
    svc["healthcheck"]["test"] = ["CMD", "kairos-healthcheck", f"http://127.0.0.1:{port}/health"]
    return svc


def _emulated_node(name: str, svc: dict) -> bool:
    return name.startswith(("prefill-", "decode-")) and "emulated" in (svc.get("profiles") or [])


def emit_compose(prefill: int, decode: int, out: Path, compose: Path | None = None) -> list[Path]:
    """Write ``out/docker-compose.plan.yml``: ``compose`` (default: the repository's docker-compose.yml)
    with its emulated node agents replaced by the planned ones — copies of its prefill-0 / decode-0
    with their own id, NATS user, password secret and metrics port (9110 + index). A whole file, not
    an override: Compose merges an override's ``profiles`` into the base's, so an override cannot take
    away a base node a smaller plan leaves out. Relative paths stay the project's: run it with
    ``--project-directory`` at the repository (the header says how). Returns its path.
    Raises EmitError (a role without nodes, a base file without its emulated nodes), OSError."""
    if prefill < 1 or decode < 1:
        raise EmitError(f"a P/D cluster needs a node of each role, got {prefill}P{decode}D")
    compose = compose or REPO / "docker-compose.yml"
    doc = yaml.safe_load(compose.read_text()) or {}
    services, secrets = doc.get("services", {}), doc.get("secrets", {})
    templates = {role: services.get(f"{role}-0") for role in ("prefill", "decode")}
    for role, t in templates.items():
        if t is None or not _emulated_node(f"{role}-0", t):
            raise EmitError(f"{compose} has no emulated {role}-0 to copy")
    for name in [n for n, svc in services.items() if _emulated_node(n, svc)]:
        del services[name]
    used = {x if isinstance(x, str) else x.get("source") for svc in services.values() for x in svc.get("secrets", [])}
    for name in [k for k in secrets if k.startswith("nats-agent-") and k not in used]:
        del secrets[name]  # only the removed nodes' own (another profile's agent may share one)
    for i, node in enumerate(node_ids(prefill, decode)):
        services[node] = _compose_node(templates[node.split("-")[0]], node, COMPOSE_NODE_PORT + i)
        secrets[f"nats-agent-{node}"] = {"file": f"ops/secrets/agent-{node}.password"}
    doc["secrets"] = secrets
    out.mkdir(parents=True, exist_ok=True)
    path = out / "docker-compose.plan.yml"
    nodes = ",".join(node_ids(prefill, decode))
    path.write_text(f"# kairos plan: docker-compose.yml with {prefill}P{decode}D emulated nodes. From the repository:\n"
                    f"#   kairos nats-auth --nodes {nodes} > ops/nats/auth.conf\n"
                    f"#   kairos nats-auth --nodes {nodes} --secrets-dir ops/secrets\n"
                    f"#   docker-compose --project-directory . -f {path} --profile emulated up -d\n"
                    + yaml.safe_dump(doc, sort_keys=False))
    return [path]


def emit_plan(kind: str, prefill: int, decode: int, out: Path) -> list[Path]:
    """``kind`` ``k8s`` → :func:`emit_k8s` into ``out/k8s``; ``compose`` → :func:`emit_compose` into ``out``.
    Raises EmitError for another kind."""
    if kind == "k8s":
        return emit_k8s(prefill, decode, out / "k8s")
    if kind == "compose":
        return emit_compose(prefill, decode, out)
    raise EmitError(f"unknown --emit {kind!r} (k8s or compose)")
