"""``kairos up``: the whole stack on this machine, one OS process per service.

Starts (unless ``--nats-url`` points at a running server) a bundled ``nats-server -js`` on a free
port with a temporary store, then the state aggregator, the node agents (emulated engines, or with
``--engine vllm`` one vLLM-CPU server per node beside its agent, kairos/engines/vllm/launch.py), the
dispatcher replicas and the ingress — each ``python -m kairos.services.<name>`` with its configuration in
``KAIROS_*`` environment variables. Waits for the ingress's ``/health``, prints where everything
is (stdout), then supervises: Ctrl-C / SIGTERM stops every process it started (dispatchers, node
agents, ingress, aggregator, NATS — in-flight requests end with an explicit error). A child that
exits is started again (kairos/cli/supervise.py: as Docker Compose's ``restart: unless-stopped``, with
a doubling backoff from 0.1 s), whatever its exit code — a node agent drained by ``kairos drain`` or
SIGTERM comes back, which makes a rolling restart; the bundled nats-server on the same port and store;
a vLLM engine with the same command — and the stderr line says why it stopped. A child restarted
:data:`MAX_SINGLETON_RESTARTS` times within :data:`RESTART_WINDOW_S` is crash-looping: it stays down,
and the rest keeps serving unless nothing can serve any more (the ingress, the message bus, every
dispatcher, prefill agent or decode agent gone); then everything is stopped.
If any child stopped on its own, the exit code is 1. Child output goes to per-service log files (JSON lines) in the
printed log directory (``--log-dir``, default a temporary directory). On exit everything else in the temporary directory (the NATS store, generated files) is
removed and the logs are kept, their path printed: a clean stop after failed requests is exactly when
they are needed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kairos.cli.processes import (CONTROL_PLANE_NICE, Child, control_plane_priority, die_with_parent, free_port,
                                  free_port_block,
                                  get_json, kill_group, nats_server_binary, port_in_use, reserve_port,
                                  start_bundled_nats, stop_process, wait_listening)
from kairos.cli.up_nats import cluster_servers, external_nats, single_server, wait_cluster_ready
from kairos.cli.supervise import (MAX_SINGLETON_RESTARTS, RESTART_WINDOW_S, RestartBudget, backoff_s, clean_exit,
                                  exit_reason)
from kairos.cli.up_plan import ENGINE_NICE, VLLM_DEFAULTS, UpOptions, api_keys, banner, node_ids, plan, vllm_node

#: ``kairos up``'s API as other modules (kairos profile and demo, the benchmarks, the tests' fixtures)
#: import it from here: the supervisor, and what it is built from (kairos.cli.processes: child
#: processes and ports; kairos.cli.up_plan: the options, the plan, the banner)
__all__ = ["Supervisor", "run_up", "MAX_SINGLETON_RESTARTS", "UpOptions", "VLLM_DEFAULTS", "ENGINE_NICE", "plan",
           "node_ids", "api_keys", "vllm_node", "Child", "CONTROL_PLANE_NICE", "control_plane_priority", "free_port",
           "free_port_block",
           "reserve_port", "port_in_use", "wait_listening", "stop_process", "kill_group", "start_bundled_nats",
           "nats_server_binary", "get_json", "_get_json"]

#: the name kairos/cli/profile.py imports (kairos.cli.processes.get_json)
_get_json = get_json

#: the supervisor's pid in its run directory: a directory whose supervisor is gone was abandoned
OWNER_FILE = "supervisor.pid"


def clear_run_dir(tmp: Path, log_dir: Path) -> Path | None:
    """Remove a ``kairos up`` run directory ``tmp`` (its JetStream store, generated credentials, …)
    except ``log_dir`` when that is inside it and holds a non-empty log. Returns ``log_dir`` if it
    holds a non-empty log (kept), else None (then nothing of ``tmp`` is left)."""
    logs = [p for p in log_dir.glob("*.log") if p.stat().st_size] if log_dir.is_dir() else []
    inside = log_dir.is_relative_to(tmp)
    for entry in list(tmp.iterdir()) if tmp.is_dir() else []:
        if not (logs and inside and entry == log_dir):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    if not (logs and inside):
        shutil.rmtree(tmp, ignore_errors=True)
    return log_dir if logs else None


def reap_abandoned(root: Path) -> list[tuple[Path, int]]:
    """Clear (:func:`clear_run_dir`, logs kept) every ``kairos-up-*`` directory under ``root`` whose
    supervisor (:data:`OWNER_FILE`) no longer runs: a ``kairos up`` killed with SIGKILL cannot remove
    its generated NATS passwords and JetStream store itself. Directories without the file, of a
    running supervisor or of another user's are left alone. Returns ``[(directory, its pid)]``."""
    reaped = []
    for d in sorted(root.glob("kairos-up-*")):
        try:
            pid = int((d / OWNER_FILE).read_text().strip())
            os.kill(pid, 0)
        except ProcessLookupError:  # the supervisor is gone
            clear_run_dir(d, d / "logs")
            reaped.append((d, pid))
        except (OSError, ValueError):  # no owner file (older runs), not ours (PermissionError), unreadable
            continue
    return reaped


class Supervisor:
    """Starts, watches and stops the processes of one ``kairos up``."""

    def __init__(self, opts: UpOptions, out=sys.stdout, err=sys.stderr) -> None:
        reserve_port(opts.port)  # before any other port is chosen: the ingress binds it last
        self.opts = opts
        self.out, self.err = out, err
        self.procs: list[Child] = []
        for d, pid in reap_abandoned(Path(tempfile.gettempdir())):
            print(f"kairos up: removed the credentials and JetStream store left in {d} by a kairos up that was "
                  f"killed (pid {pid}); its logs are kept", file=err, flush=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="kairos-up-"))
        (self.tmp / OWNER_FILE).write_text(f"{os.getpid()}\n")
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
            die_with_parent()
            if yield_to_engines:
                control_plane_priority()

        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=setup,
                                  cwd=str(Path(__file__).resolve().parents[2]))
        c.started_mono = time.monotonic()
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
        """Start NATS (if bundled); returns the NATS URL (a cluster's: every member's, comma-separated).

        Raises:
            RuntimeError: the given NATS does not listen, or the bundled one did not start.
        """
        if self.opts.nats_url:
            self.creds = external_nats(self.opts)
            return self.opts.nats_url
        if self.opts.nats_servers > 1:
            children, members, self.creds = cluster_servers(self.opts, self.tmp, self.log_dir)
            for c in children:  # all at once: JetStream waits for a quorum of its peers
                self._spawn(c)
            for c in children:
                if not wait_listening(c.proc, int(c.endpoint.rsplit(":", 1)[1]), give_up=lambda: self.stopping) \
                        and not self.stopping:
                    raise RuntimeError(f"{c.name} did not start; log:\n{self._tail(c)}")
            wait_cluster_ready(members, lambda: self.stopping)
            return ",".join(m.url for m in members)
        c, self.creds = single_server(self.opts, self.tmp, self.log_dir)
        if not self._start_nats(c) and not self.stopping:
            raise RuntimeError(f"nats-server did not start; log:\n{self._tail(c)}")
        return c.endpoint

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
        self.write_services()
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
                if get_json(url, headers) is not None:
                    del pending[name]
            body = get_json(ingress) if not pending else None
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

    def write_services(self) -> None:
        """``services.json`` in the log directory: every child with its kind, current pid and endpoint,
        rewritten at every restart (scripts and benchmarks find a service's process there)."""
        rows = [{"name": c.name, "kind": c.kind, "pid": c.proc.pid if c.proc else None, "endpoint": c.endpoint}
                for c in self.procs]
        tmp = self.log_dir / "services.json.tmp"
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(self.log_dir / "services.json")

    def table(self) -> str:
        """The banner printed once the stack is ready (:func:`kairos.cli.up_plan.banner`)."""
        return banner(self.opts, self.procs, self.log_dir, self.targets_path, self.creds)

    def supervise(self) -> int:
        """Block until a signal or until nothing can serve any more; restart every child that exits
        (kairos/cli/supervise.py: backoff, a crash-loop budget). Returns 0 after a signal with every
        child alive or restarted, else 1."""
        reported: set[str] = set()
        budget = RestartBudget(limit=self.opts.max_restarts)
        pending: dict[str, tuple[Child, float]] = {}  #: children to start again, and when (monotonic s)
        while not self.stopping:
            now = time.monotonic()
            for name, (c, due) in list(pending.items()):
                if now >= due:
                    del pending[name]
                    self._restart(c)
            for c in list(self.procs):
                if c.proc is None or c.proc.poll() is None or c.name in reported:
                    continue
                clean = clean_exit(c.proc.returncode, now - c.started_mono)
                rank = None if clean else budget.take(c.name, now)
                why, last_lines = exit_reason(c.proc.returncode), self._tail(c)  # the dead one's, before the new one logs
                self.failed = self.failed or not clean  # keep the logs
                if clean or rank is not None:
                    self.procs.remove(c)
                    if c.kind.startswith("vllm"):  # its EngineCore and workers can outlive the API server, holding the ports
                        kill_group(c.proc)
                    pending[c.name] = (c, now if clean else now + backoff_s(rank))
                    self.msg(f"{c.name} (pid {c.proc.pid}) {why}; starting it again now {self._how(c)} (a clean "
                             f"stop after {now - c.started_mono:.0f} s up: not counted as a restart)" if clean else
                             f"{c.name} (pid {c.proc.pid}) {why}; restarting it in {backoff_s(rank):g} s "
                             f"{self._how(c)} (restart {rank} of at most {budget.limit} in "
                             f"{RESTART_WINDOW_S / 60:g} min). Its last log lines ({c.log_path}):\n{last_lines}")
                    continue
                reported.add(c.name)
                fatal = self._cannot_serve()
                looping = (f"was restarted {budget.limit} times in {RESTART_WINDOW_S / 60:g} min already (a crash "
                           f"loop): left down" if budget.limit else "is not restarted (--max-restarts 0)")
                self.msg(f"{c.name} (pid {c.proc.pid}) {why} and {looping}; "
                         + (f"{fatal}: stopping everything." if fatal else "the rest of the stack keeps serving "
                            "without it (restart kairos up to get it back).")
                         + f" Last log lines ({c.log_path}):\n{last_lines}")
                if fatal:
                    return 1
            time.sleep(0.05 if pending else 0.2)
        return 1 if reported or budget.used() else 0

    @staticmethod
    def _how(c: Child) -> str:
        if c.kind.startswith("message bus"):
            return "on the same port and store (the services reconnect by themselves)"
        if c.kind.startswith("vllm"):
            return "with the same command (its agent refuses jobs until it answers again)"
        return "with the same configuration"

    def _restart(self, c: Child) -> None:
        """Start ``c`` again (a nats-server: waited for, at most 10 s); the services file follows."""
        if c.kind.startswith("message bus"):
            self._start_nats(c)  # if it dies again, the next round sees it
        else:
            self._spawn(c)
        self.msg(f"{c.name} restarted{self._new_pid(c.name)}")
        self.write_services()

    def _new_pid(self, name: str) -> str:
        """`` as pid N``: the pid of the child now running under ``name`` (empty if none)."""
        now = next((c for c in self.procs if c.name == name and c.proc is not None), None)
        return f" as pid {now.proc.pid}" if now is not None else ""

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
    #: routed), then the node agents (each ends its in-flight requests with ``node_shutdown``: the
    #: ingress would move them, but no dispatcher is left), then the vLLM engines (if any; their
    #: agents are gone), then the ingress (it answers every request still open with an explicit
    #: ``ingress_shutdown``, then closes), then the aggregator and NATS, which the others need until
    #: they are gone
    STOP_ORDER = (("dispatcher",), ("agent",), ("vllm",), ("ingress",), ("aggregator",), ("message bus",))

    def down(self) -> None:
        """Stop every started process in :attr:`STOP_ORDER`, group by group; a process still running
        10 s after its signal is killed. The node agents get SIGINT: the whole stack stops, so they
        stop at once instead of draining (SIGTERM, kairos/services/node_agent/drain.py); the rest SIGTERM."""
        for group in self.STOP_ORDER:
            batch = [c for c in self.procs if c.proc and c.proc.poll() is None and any(c.kind.startswith(g) or
                                                                                        c.name.startswith(g) for g in group)]
            for c in batch:
                try:
                    c.proc.send_signal(signal.SIGINT if group == ("agent",) else signal.SIGTERM)
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
        return clear_run_dir(self.tmp, self.log_dir)

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
